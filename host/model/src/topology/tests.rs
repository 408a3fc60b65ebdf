use ncclwasm_testkit::topology as corpus;

use super::*;

const MINIMAL: &str = r#"name = "t"
[[devices]]
name = "mlx5_0"
guid = "0x0002c90300a1b2c0"
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
"#;

/// Parses `MINIMAL` with `from` replaced by `to` and returns the error as displayed.
fn error(from: &str, to: &str) -> String {
    assert!(MINIMAL.contains(from), "{from:?} not in MINIMAL");
    let text = MINIMAL.replace(from, to);
    match Topology::parse(&text, "t.toml") {
        Ok(_) => panic!("{to:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

fn with_gids(gids: &str) -> String {
    MINIMAL.replace(
        "speed-mbps = 100000",
        &format!("speed-mbps = 100000\ngids = [\n{gids}\n]"),
    )
}

#[test]
fn every_corpus_file_loads() {
    for path in ncclwasm_testkit::topologies() {
        let t = Topology::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(!t.ports().is_empty(), "{}", path.display());
        let stem = path.file_stem().unwrap().to_string_lossy();
        assert_eq!(t.name, stem, "a topology is named after its file");
    }
}

#[test]
fn minimal_file_gets_defaults_and_a_derived_roce_table() {
    let t = Topology::parse(MINIMAL, "t.toml").unwrap();
    let ports = t.ports();
    assert_eq!(ports.len(), 1);
    let p = &ports[0];
    assert_eq!((p.index, p.port, p.state), (0, 1, PortState::Active));
    assert_eq!((p.width, p.mtu, p.lid, p.numa_node), (4, 4096, 0, -1));
    assert_eq!((p.max_qps, p.provider.as_str()), (DEFAULT_MAX_QPS, "soft"));
    assert_eq!(p.guid, 0x0002_c903_00a1_b2c0);
    assert_eq!(t.bind_address(0), Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    assert_eq!(t.bind_address(1), None);
    assert_eq!(p.gids.len(), 256, "gid_tbl_len of an mlx5 device");
    assert!(p.gids[2..].iter().all(Gid::is_unconfigured));
    assert_eq!(
        p.gids[0].addr(),
        "fe80::2:c903:a1:b2c0".parse::<Ipv6Addr>().unwrap()
    );
    assert_eq!(p.gids[0].gid_type, GidType::RoceV1);
    assert!(p.gids[0].is_link_local());
    assert_eq!(
        p.gids[1].addr(),
        "::ffff:127.0.0.1".parse::<Ipv6Addr>().unwrap()
    );
    assert_eq!(
        (p.gids[1].gid_type, p.gids[1].prefix_len),
        (GidType::RoceV2, 24)
    );
    assert_eq!(p.gids[1].family(), AddrFamily::Ipv4);
}

#[test]
fn ipv6_bind_address_becomes_the_roce_v2_gid() {
    let text = MINIMAL.replace(
        "speed-mbps = 100000",
        "speed-mbps = 100000\naddress = \"fd00::7\"\nprefix-len = 48",
    );
    let t = Topology::parse(&text, "t.toml").unwrap();
    let g = &t.ports()[0].gids[1];
    assert_eq!(g.addr(), "fd00::7".parse::<Ipv6Addr>().unwrap());
    assert_eq!((g.family(), g.prefix_len), (AddrFamily::Ipv6, 48));
}

#[test]
fn ib_ports_derive_one_link_local_gid_per_port_distinct_across_functions() {
    let t = Topology::load(corpus("dgx-h100.toml")).unwrap();
    let ports = t.ports();
    assert_eq!(ports.len(), 10);
    let p0 = &ports[0];
    assert_eq!(p0.link_layer, LinkLayer::Infiniband);
    assert_eq!(p0.gids.len(), 256);
    assert_eq!(p0.gids[0].hi(), 0xfe80_0000_0000_0000);
    assert_eq!(p0.gids[0].lo(), p0.guid);
    assert_eq!(
        (p0.gids[0].gid_type, p0.gids[0].prefix_len),
        (GidType::Ib, 64)
    );
    // The storage functions share a GUID and list their own GIDs; their merged PCI paths agree.
    assert_eq!(ports[8].guid, ports[9].guid);
    assert_eq!(ports[8].pci_path, ports[9].pci_path);
    assert_ne!(t.devices[8].pci_path, t.devices[9].pci_path);
}

#[test]
fn derived_gids_of_functions_sharing_a_guid_differ() {
    let t = Topology::load(corpus("pf-vf.toml")).unwrap();
    let ports = t.ports();
    assert_eq!(ports[0].guid, ports[1].guid);
    assert_ne!(ports[0].gids[0], ports[1].gids[0]);
    assert_eq!(ports[0].gids[0].lo() + 1, ports[1].gids[0].lo());
}

#[test]
fn sparse_gid_tables_fill_gaps_with_unconfigured_slots() {
    let t = Topology::load(corpus("k8s-pod.toml")).unwrap();
    let ports = t.ports();
    let g = &ports[0].gids;
    assert_eq!(g.len(), 256);
    assert!(g[2].is_unconfigured());
    assert_eq!(
        (g[2].index, g[2].gid_type, g[2].prefix_len),
        (2, GidType::Unknown, 0)
    );
    assert_eq!(g[1].gid_type, GidType::Unknown);
    assert_eq!(g[3].index, 3);
    assert!(g[4..].iter().all(|g| *g == Gid::unconfigured(g.index)));
    assert_eq!(ports[1].gids.len(), 256);
}

/// Issue 21, point 7: a port's table is as long as the `gid_tbl_len` a real device reports
/// (mlx5: 256), or as the file's `gid-tbl-len` says, whatever indices are listed; every slot
/// past the listed ones is unconfigured, as the kernel reports it.
#[test]
fn gid_tables_are_as_long_as_the_device_reports() {
    for path in ncclwasm_testkit::topologies() {
        let t = Topology::load(&path).unwrap();
        for p in t.ports() {
            assert_eq!(p.gids.len(), 256, "{}: {}", path.display(), p.device);
            assert!(p.gids.iter().enumerate().all(|(i, g)| g.index == i as u32));
        }
    }
    let short = with_gids("{ index = 1, gid = \"fe80::1\", type = \"roce-v1\" },")
        .replace("gids = [", "gid-tbl-len = 16\ngids = [");
    let t = Topology::parse(&short, "t.toml").unwrap();
    assert_eq!(t.ports()[0].gids.len(), 16);
    let rxe = with_gids("{ index = 700, gid = \"fe80::1\", type = \"roce-v1\" },")
        .replace("gids = [", "gid-tbl-len = 1024\ngids = [");
    assert_eq!(
        Topology::parse(&rxe, "t.toml").unwrap().ports()[0]
            .gids
            .len(),
        1024
    );
    for (text, want) in [
        (
            short.replace("index = 1,", "index = 16,"),
            "gid-tbl-len: the GID table is 16 entries long, so it has no index 16",
        ),
        (
            with_gids("{ index = 256, gid = \"fe80::1\", type = \"roce-v1\" },"),
            "gid-tbl-len: the GID table is 256 entries long, so it has no index 256",
        ),
        (
            short.replace("gid-tbl-len = 16", "gid-tbl-len = 1025"),
            "gid-tbl-len: 1025 is longer than any verbs GID table",
        ),
    ] {
        let e = Topology::parse(&text, "t.toml").unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn ports_flatten_in_file_order_with_multi_port_devices() {
    let t = Topology::load(corpus("mixed-ib-roce.toml")).unwrap();
    let names: Vec<String> = t
        .ports()
        .iter()
        .map(|p| format!("{}:{}", p.device, p.port))
        .collect();
    assert_eq!(
        names,
        [
            "mlx5_0:1", "mlx5_1:1", "mlx5_3:1", "mlx5_2:1", "mlx4_0:1", "mlx4_0:2"
        ]
    );
    assert!(
        t.ports()
            .iter()
            .enumerate()
            .all(|(i, p)| p.index == i as u32)
    );
}

#[test]
fn merged_pci_path_zeroes_function_and_vf_device_digits() {
    let p = "/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:01.3";
    assert_eq!(
        merged_pci_path(p, false),
        "/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:01.0"
    );
    assert_eq!(
        merged_pci_path(p, true),
        "/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:00.0"
    );
    assert_eq!(merged_pci_path("", true), "");
}

#[test]
fn guid_forms() {
    assert_eq!(
        parse_guid("0x0002c90300a1b2c0"),
        Some(0x0002_c903_00a1_b2c0)
    );
    assert_eq!(
        parse_guid("946d:ae03:00f1:2a40"),
        Some(0x946d_ae03_00f1_2a40)
    );
    assert_eq!(parse_guid("946d:ae03:00f1"), None);
    assert_eq!(parse_guid("0x"), None);
    assert_eq!(parse_guid("0x1ffffffffffffffff"), None);
    let t = Topology::parse(&MINIMAL.replace("\"0x0002c90300a1b2c0\"", "42"), "t").unwrap();
    assert_eq!(t.devices[0].guid, 42);
    let e = error("\"0x0002c90300a1b2c0\"", "-1");
    assert!(
        e.starts_with("t.toml:4:8: devices[0].guid: invalid value"),
        "{e}"
    );
}

#[test]
fn syntax_and_type_errors_name_file_line_and_field() {
    let e = error("speed-mbps = 100000", "speed-mbps = \"fast\"");
    assert_eq!(
        e,
        "t.toml:8:14: devices[0].ports[0].speed-mbps: invalid type: string \"fast\", expected u32"
    );
    let e = error("speed-mbps = 100000", "speed_mbps = 1");
    assert!(
        e.starts_with("t.toml:8:1: devices[0].ports[0].speed_mbps: unknown field"),
        "{e}"
    );
    let e = error("speed-mbps = 100000", "");
    assert!(
        e.contains("devices[0].ports[0]: missing field `speed-mbps`"),
        "{e}"
    );
    let e = error("link-layer = \"ethernet\"", "link-layer = \"eth\"");
    assert!(
        e.starts_with("t.toml:7:14: devices[0].ports[0].link-layer: unknown variant `eth`"),
        "{e}"
    );
    let e = error("name = \"t\"", "name = \"t");
    assert!(e.starts_with("t.toml:1:"), "{e}");
}

#[test]
fn semantic_errors_name_file_line_and_field() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "speed-mbps = 100000",
            "speed-mbps = 0",
            "t.toml:8:14: devices[0].ports[0].speed-mbps: mlx5_0 port 1: speed 0 on an active port",
        ),
        (
            "port = 1",
            "port = 0",
            "t.toml:6:8: devices[0].ports[0].port: port numbers start at 1",
        ),
        (
            "port = 1",
            "port = 1\nwidth = 3",
            "t.toml:7:9: devices[0].ports[0].width: 3 lanes",
        ),
        (
            "port = 1",
            "port = 1\nmtu = 9000",
            "t.toml:7:7: devices[0].ports[0].mtu: 9000 is not an IB MTU",
        ),
        (
            "link-layer = \"ethernet\"",
            "link-layer = \"infiniband\"",
            "t.toml:6:8: devices[0].ports[0].lid: mlx5_0 port 1: an active InfiniBand port needs",
        ),
        (
            "port = 1",
            "port = 1\naddress = \"localhost\"",
            "t.toml:7:11: devices[0].ports[0].address: \"localhost\" is not an IP address",
        ),
        (
            "port = 1",
            "port = 1\nprefix-len = 33",
            "t.toml:7:14: devices[0].ports[0].prefix-len: 33 exceeds 32",
        ),
        (
            "guid = ",
            "numa-node = -2\nguid = ",
            "t.toml:4:13: devices[0].numa-node: -2 is not a NUMA node",
        ),
        (
            "guid = ",
            "max-qps = 0\nguid = ",
            "t.toml:4:11: devices[0].max-qps: is 0",
        ),
        (
            "guid = ",
            "pci-path = \"/sys/devices/pci0000:00/0c:00.0\"\nguid = ",
            "t.toml:4:12: devices[0].pci-path: \"/sys/devices/pci0000:00/0c:00.0\" is not a sysfs PCI path",
        ),
        (
            "name = \"mlx5_0\"",
            "name = \"mlx5 0\"",
            "t.toml:3:8: devices[0].name: \"mlx5 0\" is not a device name",
        ),
        ("name = \"t\"", "name = \"\"", "t.toml:1:8: name: is empty"),
    ];
    for (from, to, want) in cases {
        let e = error(from, to);
        assert!(e.starts_with(want), "got   {e}\nwant  {want}");
    }
}

#[test]
fn duplicates_are_refused_at_the_second_occurrence() {
    let two_devices = format!(
        "{MINIMAL}{}",
        &MINIMAL[MINIMAL.find("[[devices]]").unwrap()..]
    );
    let e = Topology::parse(&two_devices, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "t.toml:10:8: devices[1].name: device \"mlx5_0\" is already defined as devices[0]"
        ),
        "{e}"
    );
    let two_ports = format!(
        "{MINIMAL}{}",
        &MINIMAL[MINIMAL.find("[[devices.ports]]").unwrap()..]
    );
    let e = Topology::parse(&two_ports, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "t.toml:10:8: devices[0].ports[1].port: device \"mlx5_0\" already has a port 1"
        ),
        "{e}"
    );
    let e = Topology::parse(
        &with_gids("{ index = 1, gid = \"fe80::1\", type = \"roce-v1\" },\n{ index = 1, gid = \"fe80::2\", type = \"roce-v2\" },"),
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with(
            "t.toml:11:11: devices[0].ports[0].gids[1].index: GID index 1 is listed twice"
        ),
        "{e}"
    );
}

#[test]
fn gid_entries_are_checked() {
    let cases: &[(&str, &str)] = &[
        (
            "{ index = 0, gid = \"fe80::x\", type = \"roce-v2\" }",
            "gids[0].gid: \"fe80::x\" is not a GID",
        ),
        (
            "{ index = 0, gid = \"10.0.0.1\", type = \"roce-v2\" }",
            "gids[0].gid: \"10.0.0.1\" is not a GID",
        ),
        (
            "{ index = 1024, gid = \"fe80::1\", type = \"roce-v2\" }",
            "gids[0].index: 1024 is beyond",
        ),
        (
            "{ index = 0, gid = \"fe80::1\", type = \"ib\" }",
            "gids[0].type: a RoCE port's GIDs",
        ),
        (
            "{ index = 0, gid = \"fe80::1\", type = \"v2\" }",
            "gids[0].type: unknown variant `v2`",
        ),
        (
            "{ index = 0, gid = \"::ffff:10.0.0.1\", type = \"roce-v2\", prefix-len = 33 }",
            "gids[0].prefix-len: 33 exceeds 32",
        ),
        (
            "{ index = 0, gid = \"fe80::1\", type = \"roce-v2\", mask = 3 }",
            "gids[0].mask: unknown field",
        ),
    ];
    for (gid, want) in cases {
        let e = Topology::parse(&with_gids(gid), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("t.toml:10:") && e.contains(want),
            "got {e}\nwant {want}"
        );
    }
    // IB ports take IB GIDs only.
    let ib = with_gids("{ index = 0, gid = \"fe80::1\", type = \"roce-v2\" }")
        .replace("\"ethernet\"", "\"infiniband\"\nlid = 3");
    let e = Topology::parse(&ib, "t.toml").unwrap_err().to_string();
    assert!(
        e.contains("an InfiniBand port's GIDs are of type \"ib\""),
        "{e}"
    );
}

#[test]
fn listed_gid_prefix_defaults_follow_the_address_kind() {
    let t = Topology::parse(
        &with_gids(
            "{ index = 0, gid = \"fe80::1\", type = \"roce-v1\" },\n\
             { index = 1, gid = \"::ffff:10.0.0.1\", type = \"roce-v2\" },\n\
             { index = 2, gid = \"fd00::1\", type = \"roce-v2\" },\n\
             { index = 3, gid = \"fd00::2\", type = \"unknown\" },",
        ),
        "t.toml",
    )
    .unwrap();
    let prefixes: Vec<u8> = t.ports()[0].gids[..4]
        .iter()
        .map(|g| g.prefix_len)
        .collect();
    assert_eq!(prefixes, [64, 24, 64, 0]);
}

#[test]
fn structural_errors() {
    let e = Topology::parse("name = \"x\"\n", "t.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("devices: no [[devices]] tables"), "{e}");
    let no_ports = &MINIMAL[..MINIMAL.find("[[devices.ports]]").unwrap()];
    let e = Topology::parse(no_ports, "t.toml").unwrap_err().to_string();
    assert!(
        e.starts_with("t.toml:3:8: devices[0].ports: device \"mlx5_0\" has no"),
        "{e}"
    );
    let e = Topology::load(corpus("no-such-file.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cannot read topology file ") && e.contains("no-such-file.toml"),
        "{e}"
    );
}

/// `NCCL_WASM_TOPOLOGY` pointing at something that is not a topology file: one line naming the
/// file and what it is, in under a second, never a hang or an endless read.
#[test]
fn a_device_fifo_directory_or_giant_is_refused_in_one_line_at_once() {
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    use ncclwasm_testkit::scratch::{Scratch, within};

    let s = Scratch::new("topology-load");
    let dir = s.dir("machines");
    let cases = [
        (
            PathBuf::from("/dev/zero"),
            "is a character device, not a regular file",
        ),
        (
            PathBuf::from("/dev/urandom"),
            "is a character device, not a regular file",
        ),
        (s.fifo("t.fifo"), "is a FIFO, not a regular file"),
        (
            s.symlink(&dir, "t.toml"),
            "is a directory, not a regular file",
        ),
        (
            s.sparse("big.toml", 1 << 30),
            "is 1073741824 bytes, the cap for a topology file is 16 MiB",
        ),
    ];
    for (path, what) in cases {
        let started = Instant::now();
        let p = path.clone();
        let e = within(Duration::from_secs(5), move || Topology::load(&p))
            .expect_err("refused")
            .to_string();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{} took {took:?}",
            path.display()
        );
        assert!(!e.contains('\n'), "one line: {e}");
        assert_eq!(
            e,
            format!(
                "topology file {} {what} (check NCCL_WASM_TOPOLOGY or the path given)",
                path.display()
            )
        );
        eprintln!("{}: refused in {took:?}", path.display());
    }
}

/// `n` single-port RoCE devices whose ports have `gid_tbl_len` slots.
fn many_devices(n: usize, gid_tbl_len: u32) -> String {
    let mut text = String::from("name = \"many\"\n");
    for i in 0..n {
        text += &format!(
            "[[devices]]\nname = \"d{i}\"\nguid = {i}\n[[devices.ports]]\nport = 1\n\
             link-layer = \"ethernet\"\nspeed-mbps = 1000\ngid-tbl-len = {gid_tbl_len}\n"
        );
    }
    text
}

/// Issue 36: what a file may ask for is bounded, in this one place every reader goes through;
/// past a bound the error is one line naming the field, however large the offending value.
#[test]
fn what_a_file_may_ask_for_is_bounded_with_one_line_errors() {
    let long = "x".repeat(100 << 10);
    let cases: Vec<(String, String, &str)> = vec![
        (
            "name = \"mlx5_0\"".into(),
            format!("name = \"{long}\""),
            "t.toml:3:8: devices[0].name: \"xxxxxxxx",
        ),
        (
            "name = \"mlx5_0\"".into(),
            format!("name = \"{}\"", "m".repeat(bounds::MAX_NAME + 1)),
            "t.toml:3:8: devices[0].name: \"mmmm",
        ),
        (
            "name = \"mlx5_0\"".into(),
            "name = \"mlx5/0\"".into(),
            "t.toml:3:8: devices[0].name: \"mlx5/0\" is not a device name",
        ),
        (
            "guid = ".into(),
            format!("provider = \"{long}\"\nguid = "),
            "t.toml:4:12: devices[0].provider: \"xxxx",
        ),
        (
            "guid = ".into(),
            format!(
                "pci-path = \"/sys/devices/{}/0000:0c:00.0\"\nguid = ",
                "p".repeat(5000)
            ),
            "t.toml:4:12: devices[0].pci-path: \"/sys/devices/pppp",
        ),
        (
            "guid = ".into(),
            "pci-path = \"/sys/devices/pci0000:00/../0000:0c:00.0\"\nguid = ".into(),
            "t.toml:4:12: devices[0].pci-path: \"/sys/devices/pci0000:00/../0000:0c:00.0\" is not",
        ),
        (
            "name = \"t\"".into(),
            format!("name = \"{long}\""),
            "t.toml:1:8: name: \"xxxx",
        ),
    ];
    for (from, to, want) in &cases {
        let e = error(from, to);
        assert!(e.starts_with(want), "got   {e}\nwant  {want}");
        assert!(!e.contains('\n') && e.len() < 400, "one short line: {e}");
    }
    let at_bound = MINIMAL.replace("mlx5_0", &"m".repeat(bounds::MAX_NAME));
    assert!(Topology::parse(&at_bound, "t.toml").is_ok());

    let e = Topology::parse(&many_devices(bounds::MAX_DEVICES + 1, 1), "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "devices[{}]: {} devices; a topology describes at most {}",
            bounds::MAX_DEVICES,
            bounds::MAX_DEVICES + 1,
            bounds::MAX_DEVICES
        )),
        "{e}"
    );
    let slots = bounds::MAX_GID_SLOTS / 1024;
    assert!(Topology::parse(&many_devices(slots, 1024), "t.toml").is_ok());
    let e = Topology::parse(&many_devices(slots + 1, 1024), "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("devices[{slots}]: the GID tables up to here have")),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}
