//! Drop-in for NCCL 2.30's IB transport (issue 21, point 5): where `ncclIbInitDevices` carries
//! on, so does `Net::new`. An `NCCL_IB_HCA` that selects nothing gives a context with no device
//! (NCCL then falls back to another transport); a forced `NCCL_IB_GID_INDEX` that some ports
//! lack fails only those ports' connections. Each test runs in a child with its own settings.

mod common;

use common::{connect, in_child, net};

/// Two soft ports on the loopback address; only `soft_0` has a GID at index 2.
const TWO_TABLES: &str = r#"name = "two-tables"
[[devices]]
name = "soft_0"
guid = "0x0002c90300000001"
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
gids = [
  { index = 0, gid = "fe80::2:c903:0:1", type = "roce-v1" },
  { index = 1, gid = "::ffff:127.0.0.1", type = "roce-v2" },
  { index = 2, gid = "::ffff:127.0.0.1", type = "roce-v2" },
]
[[devices]]
name = "soft_1"
guid = "0x0002c90300000002"
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
gids = [
  { index = 0, gid = "fe80::2:c903:0:2", type = "roce-v1" },
  { index = 1, gid = "::ffff:127.0.0.1", type = "roce-v2" },
]
"#;

#[test]
fn an_hca_list_that_selects_nothing_gives_a_context_with_no_device() {
    const TEST: &str = "an_hca_list_that_selects_nothing_gives_a_context_with_no_device";
    for hca in ["mlx5_9", "^"] {
        if ncclwasm_testkit::child::rerun_with_env(TEST, &[("NCCL_IB_HCA", hca)]) {
            continue;
        }
        assert!(in_child());
        let hca = std::env::var("NCCL_IB_HCA").unwrap_or_default();
        assert_eq!(net().device_count(), 0, "NCCL_IB_HCA={hca}");
        return;
    }
}

#[test]
fn a_gid_index_some_ports_lack_fails_only_their_connections() {
    const TEST: &str = "a_gid_index_some_ports_lack_fails_only_their_connections";
    let scratch = ncclwasm_testkit::scratch::Scratch::new("dropin-gid");
    let topology = scratch.write("two-tables.toml", TWO_TABLES.as_bytes());
    let topology = topology.to_str().expect("a UTF-8 temp path");
    if ncclwasm_testkit::child::rerun_with_env(
        TEST,
        &[("NCCL_WASM_TOPOLOGY", topology), ("NCCL_IB_GID_INDEX", "2")],
    ) {
        return;
    }
    let net = net();
    assert_eq!(net.device_count(), 2, "init keeps both ports, as NCCL");
    let (_s, _r) = connect(&net, 0, 0);
    let Err(e) = net.listen(1) else {
        panic!("soft_1 has no GID 2: listen must fail");
    };
    let e = e.to_string();
    assert!(
        e.contains("soft_1:1: GID index 2 is not a configured entry"),
        "{e}"
    );
}

/// Points 2 and 3: names and `props.port` as net_ib 2.30 reports them, in its PCI order (the
/// down port of `mixed-ib-roce`'s `mlx5_3` is not a device). The
/// two functions of a dual-port card, and a physical and a virtual function of one card, are
/// ports 1 and 2, in function order whatever the discovery order; the second verbs port of `mlx4_0` keeps the NIC's name and is port 3 (its
/// port 2 plus the earlier device on the card). (A vNIC's name: `device_table`'s tests.)
#[test]
fn devices_are_named_and_numbered_as_net_ib_reports_them() {
    const TEST: &str = "devices_are_named_and_numbered_as_net_ib_reports_them";
    let cases: [(&str, &[(&str, u8)]); 4] = [
        ("dual-port.toml", &[("mlx5_0", 1), ("mlx5_1", 2)]),
        ("pf-vf.toml", &[("mlx5_0", 1), ("mlx5_2", 2)]),
        // Function 1 discovered first: NCCL's sort reads the unmerged path (issue 33).
        ("swapped-functions.toml", &[("mlx5_1", 1), ("mlx5_0", 2)]),
        (
            "mixed-ib-roce.toml",
            &[
                ("mlx5_0", 1),
                ("mlx5_1", 1),
                ("mlx5_2", 1),
                ("mlx4_0", 1),
                ("mlx4_0", 3),
            ],
        ),
    ];
    for (file, _) in cases {
        let path = ncclwasm_testkit::topology(file);
        let path = path.to_str().expect("a UTF-8 path");
        if ncclwasm_testkit::child::rerun_with_env(TEST, &[("NCCL_WASM_TOPOLOGY", path)]) {
            continue;
        }
        // The child: the case its environment names.
        let topology = std::env::var("NCCL_WASM_TOPOLOGY").expect("set by the parent");
        let (file, expected) = cases
            .into_iter()
            .find(|(f, _)| std::path::Path::new(&topology).ends_with(f))
            .expect("one of the cases");
        let net = net();
        let got: Vec<(String, u8)> = (0..net.device_count() as i64)
            .map(|d| {
                let p = net.properties(d).expect("a device");
                (p.name, p.port)
            })
            .collect();
        let expected: Vec<(String, u8)> =
            expected.iter().map(|&(n, p)| (n.to_owned(), p)).collect();
        assert_eq!(got, expected, "{file}");
        return;
    }
}

/// Issue 33, point 6: a vNIC's properties other than name, speed, rail and plane are its first
/// child's, as `ncclIbGetProperties` reads them: on `pf-vf` (PF 131072 QPs, VF 65536) the
/// fusion PF+VF reports the PF's `maxComms`, VF+PF the VF's.
#[test]
fn a_vnic_reports_its_first_childs_max_comms() {
    const TEST: &str = "a_vnic_reports_its_first_childs_max_comms";
    let path = ncclwasm_testkit::topology("pf-vf.toml");
    let path = path.to_str().expect("a UTF-8 path");
    if ncclwasm_testkit::child::rerun_with_env(TEST, &[("NCCL_WASM_TOPOLOGY", path)]) {
        return;
    }
    let net = net();
    let max_comms = |dev: u32| net.properties(i64::from(dev)).expect("a device").max_comms;
    assert_eq!((max_comms(0), max_comms(1)), (131_072, 65_536));
    let pf_vf = net.make_vdevice(&[0, 1]).expect("a fusion");
    let vf_pf = net.make_vdevice(&[1, 0]).expect("a fusion");
    assert_eq!((max_comms(pf_vf), max_comms(vf_pf)), (131_072, 65_536));
    let speed = net.properties(i64::from(pf_vf)).unwrap().speed_mbps;
    assert_eq!(speed, 200_000, "the speeds add up");
}
