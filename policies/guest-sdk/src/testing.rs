//! Helpers for a policy's native unit tests: the repository's topology corpus and connections
//! built from it, so a test reads like the situation it checks ("mlx5_0 talking to a peer's
//! mlx5_3") instead of pages of struct literals.

use std::cell::RefCell;
use std::path::PathBuf;

use crate::model::telemetry::Telemetry;
use crate::{Connection, Endpoint, Port};

thread_local! {
    static TELEMETRY: RefCell<Telemetry> = RefCell::new(Telemetry::default());
}

/// What [`crate::telemetry`] returns on this thread from now on, natively (a unit test of a
/// policy that reads the counters).
pub fn set_telemetry(snapshot: Telemetry) {
    TELEMETRY.with(|t| *t.borrow_mut() = snapshot);
}

/// The snapshot [`set_telemetry`] gave this thread.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn telemetry_now() -> Telemetry {
    TELEMETRY.with(|t| t.borrow().clone())
}

/// The port table of `topologies/<name>.toml`, as the host would report it.
///
/// Panics with the loader's message (file, line, field) when the file is missing or invalid.
pub fn topology(name: &str) -> Vec<Port> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../topologies")
        .join(format!("{name}.toml"));
    match ncclwasm_model::Topology::load(&path) {
        Ok(t) => t.ports(),
        Err(e) => panic!("{e}"),
    }
}

/// The port named `device` (first port of that device).
pub fn port<'a>(ports: &'a [Port], device: &str) -> &'a Port {
    ports
        .iter()
        .find(|p| p.device == device)
        .unwrap_or_else(|| panic!("no device {device} in the topology"))
}

/// `port` communicating with its GID at `gid_index` (which must be in its table).
pub fn endpoint(port: &Port, gid_index: u32) -> Endpoint {
    assert!(
        port.gids.iter().any(|g| g.index == gid_index),
        "{} has no GID index {gid_index}",
        port.device
    );
    port.endpoint(gid_index)
}

/// A connection over `local` to `peer` on NCCL device 0, named after the local devices as a
/// fused NIC is (`mlx5_0+mlx5_1`).
pub fn connection(local: Vec<Endpoint>, peer: Vec<Endpoint>) -> Connection {
    let device_name = local
        .iter()
        .map(|e| e.device.as_str())
        .collect::<Vec<_>>()
        .join("+");
    Connection {
        net_attr: None,
        one_sided: None,
        comm_id: 0x5eed,
        traffic_class: -1,
        device: 0,
        device_name,
        local,
        peer,
    }
}
