//! Device discovery is linear in the number of devices: a 10 000-device soft machine opens with
//! one read of the provider's device list (each open used to read the whole list again, 32 s for
//! this machine).

use std::fmt::Write as _;
use std::time::Instant;

const DEVICES: usize = 10_000;

/// A machine of `n` single-port RoCE devices on loopback. Each GID table is 4 slots long instead
/// of mlx5's 256: the soft fabric lays out sysfs files for every slot, and this test is about the
/// device list, not GID tables.
fn machine(n: usize) -> String {
    let mut t = String::from("name = \"many\"\ndescription = \"discovery scaling\"\n");
    for i in 0..n {
        write!(
            t,
            "\n[[devices]]\nname = \"soft_{i}\"\nprovider = \"soft\"\nguid = \"{:#018x}\"\n\
             numa-node = 0\nmax-qps = 16\n\n[[devices.ports]]\nport = 1\n\
             link-layer = \"ethernet\"\nspeed-mbps = 100000\nwidth = 4\nmtu = 4096\n\
             address = \"127.0.0.1\"\ngid-tbl-len = 4\n",
            0x0200_5e00_0000_0000_u64 + i as u64 + 1
        )
        .unwrap();
    }
    t
}

#[test]
fn ten_thousand_devices_open_with_one_read_of_the_device_list() {
    const TEST: &str = "ten_thousand_devices_open_with_one_read_of_the_device_list";
    if !ncclwasm_testkit::child::enter(TEST) {
        let dir = std::env::temp_dir().join(format!("ncclwasm-discovery-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("many.toml");
        std::fs::write(&file, machine(DEVICES)).unwrap();
        let mut child = ncclwasm_testkit::child::command(TEST);
        child.env("NCCL_WASM_TOPOLOGY", &file);
        let out = ncclwasm_testkit::child::run(child, TEST);
        print!("{}", String::from_utf8_lossy(&out.stdout));
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let fabric = ncclwasm_soft::fabric().unwrap();
    let start = Instant::now();
    let ports = fabric.discover(true);
    let took = start.elapsed();
    println!(
        "{} devices discovered in {took:?}, device list read {} time(s)",
        ports.len(),
        fabric.device_lists_read()
    );
    assert_eq!(ports.len(), DEVICES);
    assert_eq!(fabric.device_lists_read(), 1, "one read for every open");
    // Later opens share one fresh read while any context opened from it lives.
    let first = fabric.open("soft_0").unwrap();
    let last = fabric.open("soft_9999").unwrap();
    assert_eq!((first.name(), last.name()), ("soft_0", "soft_9999"));
    assert_eq!(fabric.device_lists_read(), 2);
    assert!(
        took.as_secs() < 30,
        "{took:?}: not a measurement, a hang bound"
    );
}
