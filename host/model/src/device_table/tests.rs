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

/// The PCI path of a card of its own on bus `bus`.
fn pci(bus: u32) -> String {
    format!("/pci0000:00/0000:{bus:02x}:00.0")
}

fn four() -> Vec<Port> {
    (0..4)
        .map(|i| port(i, &format!("mlx5_{i}"), 1, &pci(i)))
        .collect()
}

/// NCCL's defaults: `NCCL_IB_MERGE_VFS=1`, `NCCL_IB_DATA_DIRECT=1`.
const NCCL: TableEnv = TableEnv {
    merge_vfs: true,
    data_direct_both: false,
};

fn ports_of(t: &DeviceTable) -> Vec<u8> {
    t.devices().iter().map(|d| d.port).collect()
}

fn no_dd() -> BTreeMap<String, String> {
    BTreeMap::new()
}

#[test]
fn selected_ports_are_devices_in_selection_order() {
    let mut ports = four();
    ports.reverse();
    let t = DeviceTable::new(&ports, &[], &no_dd(), &[], NCCL);
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
    let t = DeviceTable::new(&ports, &[group(&[2, 0], None)], &no_dd(), &[], NCCL);
    assert_eq!(names(&t), ["mlx5_2+mlx5_0", "mlx5_1", "mlx5_3"]);
    assert_eq!(selected(&t), [vec![2, 0], vec![1], vec![3]]);
    let fused = &t.devices()[0];
    assert_eq!(
        (fused.pci_path.as_str(), fused.children.as_slice()),
        (pci(2).as_str(), &[0][..])
    );

    let named = DeviceTable::new(&ports, &[group(&[3, 1], Some("rail"))], &no_dd(), &[], NCCL);
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
        &[],
        NCCL,
    );
    // Port 3 is not selected: the "group" of 2 and 3 is port 2 alone.
    assert_eq!(names(&t), ["mlx5_0", "mlx5_1", "mlx5_2"]);
    assert_eq!(selected(&t), [[0], [1], [2]]);
}

/// net_ib 2.30's names: both verbs ports of `mlx4_0` are `mlx4_0`, and their port numbers
/// tell them apart (1, then 2 + the one earlier device on the card = 3).
#[test]
fn ports_of_one_nic_share_its_name_and_count_up_their_port_numbers() {
    let ports = [
        port(0, "mlx4_0", 1, "/pci0000:00/0000:04:00.0"),
        port(1, "mlx4_0", 2, "/pci0000:00/0000:04:00.0"),
        port(2, "mlx5_0", 1, "/pci0000:00/0000:05:00.0"),
    ];
    let mut t = DeviceTable::new(&ports, &[], &no_dd(), &[], NCCL);
    assert_eq!(names(&t), ["mlx4_0", "mlx4_0", "mlx5_0"]);
    assert_eq!(ports_of(&t), [1, 3, 1]);
    // A vNIC of the two: net_ib's name, and its first child's port.
    let v = t.fuse(&[0, 1]).unwrap();
    assert_eq!(t.devices()[v as usize].name, "mlx4_0+mlx4_0");
    assert_eq!(t.devices()[v as usize].port, 1);
    // Asked again (another communicator), the same fusion gets the same name.
    let again = t.fuse(&[0, 1]).unwrap();
    assert_eq!(t.devices()[again as usize].name, "mlx4_0+mlx4_0");
}

/// `ncclIbGetRealPort`: the functions of a dual-port card (one merged PCI path) report ports 1
/// and 2; its virtual functions count as the card with `NCCL_IB_MERGE_VFS=1` (their paths were
/// merged to the card's by discovery) and as cards of their own without; devices on another
/// bus, and devices without a PCI path, count nothing.
#[test]
fn port_numbers_count_earlier_devices_on_the_same_card() {
    let card = "/pci0000:00/0000:3b:00.0";
    let ports = [
        port(0, "mlx5_0", 1, card),
        port(1, "mlx5_1", 1, card),
        port(2, "mlx5_2", 1, "/pci0000:00/0000:5e:00.0"),
        port(3, "mlx5_3", 1, ""),
        port(4, "mlx5_4", 1, ""),
        port(5, "mlx5_5", 1, card),
    ];
    let t = DeviceTable::new(&ports, &[], &no_dd(), &[], NCCL);
    assert_eq!(ports_of(&t), [1, 2, 1, 1, 1, 3]);

    // Two virtual functions of one card, paths as discovery merges them without MERGE_VFS.
    let vfs = [
        port(0, "mlx5_6", 1, "/pci0000:00/0000:3b:02.0"),
        port(1, "mlx5_7", 1, "/pci0000:00/0000:3b:03.0"),
    ];
    let separate = TableEnv {
        merge_vfs: false,
        ..NCCL
    };
    assert_eq!(
        ports_of(&DeviceTable::new(&vfs, &[], &no_dd(), &[], separate)),
        [1, 1]
    );
    // With it, net_ib compares up to the bus: the same card.
    assert_eq!(
        ports_of(&DeviceTable::new(&vfs, &[], &no_dd(), &[], NCCL)),
        [1, 2]
    );
}

/// A single-port device of a Data Direct NIC is its `<dev>_dma` twin (NCCL ≥ 2.28's default),
/// or is followed by it with `NCCL_IB_DATA_DIRECT=2`; a group gets none. Twins number their
/// ports on the Data Direct function's own path.
#[test]
fn data_direct_twins_replace_or_follow_single_port_devices() {
    let ports = [
        port(0, "mlx5_0", 1, &pci(0)),
        port(1, "mlx5_0", 2, &pci(0)),
        port(2, "mlx5_1", 1, &pci(1)),
        port(3, "mlx5_2", 1, &pci(2)),
        port(4, "mlx5_3", 1, &pci(3)),
    ];
    let dd: BTreeMap<String, String> = ["mlx5_0", "mlx5_1", "mlx5_2"]
        .iter()
        .zip(0xa0..)
        .map(|(d, bus)| ((*d).to_owned(), pci(bus).replace(".0", ".1")))
        .collect();
    let groups = [group(&[2, 3], None)];
    let t = DeviceTable::new(&ports, &groups, &dd, &[], NCCL);
    assert_eq!(
        names(&t),
        ["mlx5_0_dma", "mlx5_0_dma", "mlx5_1+mlx5_2", "mlx5_3"]
    );
    assert_eq!(ports_of(&t), [1, 3, 1, 1]);
    let twin = &t.devices()[1];
    assert_eq!(
        twin.members,
        [Member {
            selected: 1,
            data_direct: true
        }]
    );
    assert_eq!(twin.pci_path, dd["mlx5_0"]);
    assert_eq!(twin.children, [1]);
    assert_eq!(t.physical_count(), 4);

    let both = TableEnv {
        data_direct_both: true,
        ..NCCL
    };
    let t = DeviceTable::new(&ports, &groups, &dd, &[], both);
    assert_eq!(
        names(&t),
        [
            "mlx5_0",
            "mlx5_0_dma",
            "mlx5_0",
            "mlx5_0_dma",
            "mlx5_1+mlx5_2",
            "mlx5_3"
        ]
    );
    assert_eq!(ports_of(&t), [1, 1, 3, 3, 1, 1]);
    assert!(!t.devices()[2].members[0].data_direct);
    assert!(t.devices()[3].members[0].data_direct);
}

#[test]
fn fusions_are_appended_named_after_their_children() {
    let mut t = DeviceTable::new(&four(), &[group(&[2, 3], None)], &no_dd(), &[], NCCL);
    assert_eq!(t.fuse(&[2, 0]), Ok(3));
    assert_eq!(t.fuse(&[2, 0]), Ok(4));
    assert_eq!(t.fuse(&[1]), Ok(5));
    assert_eq!(
        names(&t)[3..],
        ["mlx5_2+mlx5_3+mlx5_0", "mlx5_2+mlx5_3+mlx5_0", "mlx5_1"]
    );
    let v = &t.devices()[3];
    assert_eq!(selected(&t)[3], [2, 3, 0]);
    assert_eq!(
        (v.children.as_slice(), v.pci_path.as_str()),
        (&[2, 0][..], pci(2).as_str())
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

fn ids(rail: i16, plane: i16) -> RailPlane {
    RailPlane { rail, plane }
}

/// NCCL 2.30's rails and planes: a device of one port keeps its port's; a vNIC has a rail only
/// when its members share a defined one, and as plane the virtual bit with one bit per member's
/// plane index (undefined planes are index 0; the others count in selection order).
#[test]
fn rails_and_planes_follow_net_ib() {
    let ports = four();
    let given = [ids(0, 5), ids(0, 7), ids(1, 5), RailPlane::UNDEF];
    let mut t = DeviceTable::new(&ports, &[], &no_dd(), &given, NCCL);
    let of = |t: &DeviceTable| t.devices().iter().map(|d| d.ids).collect::<Vec<_>>();
    assert_eq!(of(&t), given);
    // Planes 5, 7 are indices 1, 2 (undefined is 0).
    let same_rail = t.fuse(&[0, 1]).unwrap();
    let across = t.fuse(&[0, 2, 3]).unwrap();
    let alone = t.fuse(&[2]).unwrap();
    let d = |v: u32| t.devices()[v as usize].ids;
    assert_eq!(d(same_rail), ids(0, PLANE_VIRT_BIT | 0b110));
    assert_eq!(d(across), ids(ID_UNDEF, PLANE_VIRT_BIT | 0b011));
    assert_eq!(d(alone), ids(1, 5));
    // A group is a device of several ports too.
    let grouped = DeviceTable::new(&ports, &[group(&[0, 1], None)], &no_dd(), &given, NCCL);
    assert_eq!(grouped.devices()[0].ids, ids(0, PLANE_VIRT_BIT | 0b110));
    // No rails given: everything undefined, fused planes on index 0.
    let mut bare = DeviceTable::new(&ports, &[], &no_dd(), &[], NCCL);
    let v = bare.fuse(&[0, 1]).unwrap();
    assert_eq!(bare.devices()[0].ids, RailPlane::UNDEF);
    assert_eq!(
        bare.devices()[v as usize].ids,
        ids(ID_UNDEF, PLANE_VIRT_BIT | 1)
    );
}
