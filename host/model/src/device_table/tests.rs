use super::*;
use crate::Topology;

/// A port of NIC `device`, port `port`, at `index` of the host's table, on PCI path `pci`.
fn port(index: u32, device: &str, port: u8, pci: &str) -> Port {
    let mut p = Topology::load(ncclwasm_testkit::topology("dual-port.toml"))
        .unwrap()
        .ports()
        .remove(0);
    p.index = index;
    p.device = device.into();
    p.port = port;
    p.pci_path = pci.into();
    p
}

fn group(ports: &[u32], name: Option<&str>) -> DeviceGroup {
    DeviceGroup {
        ports: ports.to_vec(),
        name: name.map(str::to_owned),
        reason: "test".into(),
    }
}

fn names(t: &DeviceTable) -> Vec<&str> {
    t.devices().iter().map(|d| d.name.as_str()).collect()
}

fn selected(t: &DeviceTable) -> Vec<Vec<usize>> {
    t.devices()
        .iter()
        .map(|d| d.members.iter().map(|m| m.selected).collect())
        .collect()
}

fn four() -> Vec<Port> {
    (0..4)
        .map(|i| port(i, &format!("mlx5_{i}"), 1, &format!("/pci/{i}")))
        .collect()
}

fn no_dd() -> BTreeMap<String, String> {
    BTreeMap::new()
}

#[test]
fn selected_ports_are_devices_in_selection_order() {
    let mut ports = four();
    ports.reverse();
    let t = DeviceTable::new(&ports, &[], &no_dd());
    assert_eq!(names(&t), ["mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0"]);
    assert_eq!(selected(&t), [[0], [1], [2], [3]]);
    assert_eq!(t.physical_count(), 4);
    for (i, d) in t.devices().iter().enumerate() {
        assert_eq!(d.children, [i as u32]);
        assert_eq!(
            (d.port, d.pci_path.as_str()),
            (1, ports[i].pci_path.as_str())
        );
        assert!(!d.members[0].data_direct);
    }
}

/// The order rule: the group stands where its earliest-selected member stands (port 0, first
/// of the selection, though the group lists it last); inside it, the group's order.
#[test]
fn a_group_stands_at_its_first_selected_member_and_keeps_its_own_order() {
    let ports = four();
    let t = DeviceTable::new(&ports, &[group(&[2, 0], None)], &no_dd());
    assert_eq!(names(&t), ["mlx5_2+mlx5_0", "mlx5_1", "mlx5_3"]);
    assert_eq!(selected(&t), [vec![2, 0], vec![1], vec![3]]);
    let fused = &t.devices()[0];
    assert_eq!(
        (fused.pci_path.as_str(), fused.children.as_slice()),
        ("/pci/2", &[0][..])
    );

    let named = DeviceTable::new(&ports, &[group(&[3, 1], Some("rail"))], &no_dd());
    assert_eq!(names(&named), ["mlx5_0", "rail", "mlx5_2"]);
    assert_eq!(selected(&named), [vec![0], vec![3, 1], vec![2]]);
}

#[test]
fn groups_fuse_only_selected_ports_and_at_least_two() {
    let ports = four();
    let t = DeviceTable::new(
        &ports[..3],
        &[group(&[1], None), group(&[2, 3], None)],
        &no_dd(),
    );
    // Port 3 is not selected: the "group" of 2 and 3 is port 2 alone.
    assert_eq!(names(&t), ["mlx5_0", "mlx5_1", "mlx5_2"]);
    assert_eq!(selected(&t), [[0], [1], [2]]);
}

/// Today's rule, pinned until the plugin follows NCCL 2.30's: the earlier devices of a shared
/// name get `:port`, the last keeps the plain name.
#[test]
fn ports_of_one_nic_are_told_apart_by_port_number() {
    let ports = [
        port(0, "mlx4_0", 1, "/pci/4"),
        port(1, "mlx4_0", 2, "/pci/4"),
        port(2, "mlx5_0", 1, "/pci/5"),
    ];
    let t = DeviceTable::new(&ports, &[], &no_dd());
    assert_eq!(names(&t), ["mlx4_0:1", "mlx4_0", "mlx5_0"]);
    assert_eq!(t.devices()[1].port, 2);
}

#[test]
fn data_direct_twins_follow_single_port_devices_only() {
    let ports = [
        port(0, "mlx5_0", 1, "/pci/0"),
        port(1, "mlx5_0", 2, "/pci/0"),
        port(2, "mlx5_1", 1, "/pci/1"),
        port(3, "mlx5_2", 1, "/pci/2"),
        port(4, "mlx5_3", 1, "/pci/3"),
    ];
    let dd: BTreeMap<String, String> = ["mlx5_0", "mlx5_1", "mlx5_2"]
        .iter()
        .map(|d| ((*d).to_owned(), format!("/sys/dd/{d}")))
        .collect();
    let t = DeviceTable::new(&ports, &[group(&[2, 3], None)], &dd);
    assert_eq!(
        names(&t),
        [
            "mlx5_0:1",
            "mlx5_0_dma:1",
            "mlx5_0",
            "mlx5_0_dma",
            "mlx5_1+mlx5_2",
            "mlx5_3"
        ]
    );
    let twin = &t.devices()[3];
    assert_eq!(
        twin.members,
        [Member {
            selected: 1,
            data_direct: true
        }]
    );
    assert_eq!((twin.port, twin.pci_path.as_str()), (2, "/sys/dd/mlx5_0"));
    assert_eq!(twin.children, [3]);
    assert_eq!(t.physical_count(), 6);
}

#[test]
fn fusions_are_appended_named_after_their_children() {
    let mut t = DeviceTable::new(&four(), &[group(&[2, 3], None)], &no_dd());
    assert_eq!(t.fuse(&[2, 0]), Ok(3));
    assert_eq!(t.fuse(&[2, 0]), Ok(4));
    assert_eq!(t.fuse(&[1]), Ok(5));
    assert_eq!(
        names(&t)[3..],
        ["mlx5_2+mlx5_3+mlx5_0", "mlx5_2+mlx5_3+mlx5_0#2", "mlx5_1#2"]
    );
    let v = &t.devices()[3];
    assert_eq!(selected(&t)[3], [2, 3, 0]);
    assert_eq!(
        (v.children.as_slice(), v.pci_path.as_str()),
        (&[2, 0][..], "/pci/2")
    );
    assert_eq!(t.physical_count(), 3);
    assert_eq!(
        t.fuse(&[0, 3]),
        Err(FuseError::NotPhysical {
            device: 3,
            physical: 3
        })
    );
    assert_eq!(t.fuse(&[]), Err(FuseError::Empty));
    assert_eq!(t.devices().len(), 6, "a refused fusion appends nothing");
    assert_eq!(
        t.fuse(&[9]).unwrap_err().to_string(),
        "device 9 is not one of the 3 physical devices"
    );
}
