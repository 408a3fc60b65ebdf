//! Integration tests of the policy engine: one binary (as wasmtime's own tests are laid out),
//! one module per concern. Guests come from `target/guests/` (built by `cargo xtask guests`).

mod bad_files;
mod equivalence;
mod hostile;
mod load;
mod swap;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use ncclwasm_model::{Connection, Gid, GidType, LinkLayer, Port, PortState};
use ncclwasm_policy::{FailureMode, PolicyHost, Settings};

use ncclwasm_testkit::guest;

fn guest_bytes(package: &str) -> Vec<u8> {
    std::fs::read(guest(package)).expect("readable guest")
}

/// Settings for a test host: small memory, the given failure mode, and a deadline so long that
/// only a runaway guest meets it — tests run in parallel on a loaded 2-core machine, where an
/// honest call can be descheduled for longer than a production deadline. The test of the
/// deadline itself sets a short one.
fn settings(failure: FailureMode) -> Settings {
    let mut s = Settings::default();
    s.timeout = std::time::Duration::from_secs(10);
    s.memory_mb = 32;
    s.failure = failure;
    s
}

/// A host running `package` (with `NCCL_WASM_POLICY_CONFIG=config` when given).
fn host_with(package: &str, failure: FailureMode, config: Option<&str>) -> PolicyHost {
    let mut s = settings(failure);
    s.policy = Some(guest(package));
    s.config = config.map(str::to_owned);
    PolicyHost::new(s).expect("host starts")
}

fn gid(index: u32, text: &str, gid_type: GidType, prefix_len: u8) -> Gid {
    Gid::new(index, text.parse().expect("GID text"), gid_type, prefix_len)
}

/// A small mixed machine: four RoCE ports, two InfiniBand ports, one RoCE port that is down.
fn ports() -> Vec<Port> {
    let roce = |i: u32| {
        vec![
            gid(0, &format!("fe80::{i}"), GidType::RoceV1, 64),
            gid(1, &format!("fe80::{i}"), GidType::RoceV2, 64),
            gid(2, &format!("::ffff:10.0.{i}.1"), GidType::RoceV1, 24),
            gid(3, &format!("::ffff:10.0.{i}.1"), GidType::RoceV2, 24),
            Gid::unconfigured(4),
        ]
    };
    let ib = |i: u32| vec![gid(0, &format!("fe80::{i}:1"), GidType::Ib, 64)];
    (0..7u32)
        .map(|i| {
            let eth = i < 4 || i == 6;
            Port {
                index: i,
                device: format!("mlx5_{i}"),
                port: 1,
                state: if i == 6 {
                    PortState::Down
                } else {
                    PortState::Active
                },
                link_layer: if eth {
                    LinkLayer::Ethernet
                } else {
                    LinkLayer::Infiniband
                },
                speed_mbps: 200_000,
                width: 4,
                mtu: 4096,
                lid: if eth { 0 } else { i as u16 + 1 },
                pci_path: format!("/sys/devices/pci0000:00/0000:00:0{i}.0"),
                full_pci_path: format!("/sys/devices/pci0000:00/0000:00:0{i}.0"),
                guid: 0x1000 + u64::from(i),
                numa_node: (i / 4) as i32,
                max_qps: 1 << 16,
                provider: "mlx5".to_owned(),
                gids: if eth { roce(i) } else { ib(i) },
            }
        })
        .collect()
}

/// A connection from `port` to an identical peer, over GID `gid_index`.
fn connection(port: &Port, gid_index: u32) -> Connection {
    assert!(
        port.gids.iter().any(|g| g.index == gid_index),
        "GID index {gid_index}"
    );
    let endpoint = port.endpoint(gid_index);
    Connection {
        net_attr: None,
        one_sided: None,
        comm_id: 0xc0ffee,
        traffic_class: -1,
        device: port.index,
        device_name: port.device.clone(),
        local: vec![endpoint.clone()],
        peer: vec![endpoint],
    }
}

/// Everything the engine logged (WARN and above), from every test of this binary.
fn logged() -> String {
    let buf = log_buffer().lock().unwrap();
    String::from_utf8_lossy(&buf).into_owned()
}

fn log_buffer() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&buf);
        tracing_subscriber::fmt()
            .with_env_filter("ncclwasm=warn")
            .with_ansi(false)
            .with_writer(move || LogSink(Arc::clone(&sink)))
            .init();
        buf
    })
}

/// Install the capturing subscriber (idempotent); call before making a host.
fn capture_logs() {
    log_buffer();
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
