//! What the running job has done, as a policy reads it through the WIT `telemetry` import:
//! per port and per connection, work requests and bytes posted, completions, completions in
//! error by status, port state changes with their times, and the bytes of a recent window.
//!
//! The transport counts and sums (its `telemetry` module); the policy host hands a snapshot to
//! the guest; offline, `ncclwasm policy explain/diff/test` read one from a *snapshot file*
//! (TOML with the WIT's names, [`Telemetry::parse`]), so an adaptive policy's answers can be
//! reproduced and pinned. The plugin writes the same format when asked
//! (`NCCL_WASM_TELEMETRY_FILE`), so a live job's counters replay offline as they were.

use serde::{Deserialize, Serialize};

use crate::{Port, PortState};

/// State changes kept per port, the latest ones.
pub const MAX_CHANGES: usize = 16;
/// Connections a snapshot lists, the newest ones: bounds what a policy call copies into the
/// guest however many connections a rank opened.
pub const MAX_CONNECTIONS: usize = 64;

/// Work requests posted and the payload bytes they carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Traffic {
    pub wrs: u64,
    pub bytes: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, other: Traffic) {
        self.wrs += other.wrs;
        self.bytes += other.bytes;
    }
}

/// How many completions came back with one `ibv_wc_status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct StatusCount {
    pub status: u32,
    pub count: u64,
}

/// A port went to `state` at `at_ms` (milliseconds since the plugin's `init`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct StateChange {
    pub at_ms: u64,
    pub state: PortState,
}

/// One port, over every connection of the process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct PortTelemetry {
    /// `Port::index`; a snapshot file names the port by `device` and `port` and may leave it out.
    pub index: u32,
    pub device: String,
    pub port: u8,
    /// Send queues: WRITEs, WRITE_WITH_IMMs, SENDs and flush READs posted, and their bytes.
    pub send: Traffic,
    /// Receive queues: receive work requests posted (no bytes: an RDMA WRITE needs none).
    pub recv: Traffic,
    /// Successful completions polled from the port's completion queues.
    pub completions: u64,
    pub errors: Vec<StatusCount>,
    /// When the latest completion in error was polled (ms since `init`).
    pub last_error_ms: Option<u64>,
    /// The latest changes, oldest first, at most [`MAX_CHANGES`].
    pub changes: Vec<StateChange>,
    pub connections: u32,
    pub qps: u32,
    /// Bytes posted for sending in the last `window_ms` milliseconds.
    pub window_ms: u32,
    pub window_bytes: u64,
}

/// One QP of a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct QpTelemetry {
    pub qpn: u32,
    /// `Port::index` of the port it runs on.
    pub port: u32,
    pub send: Traffic,
    pub recv: Traffic,
}

/// One open connection, as one side sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ConnectionTelemetry {
    /// Unique in the process, in the order connections were made.
    pub id: u64,
    pub comm_id: u64,
    pub device: u32,
    /// The side that connected (and sends); `false`: the side that accepted.
    pub sending: bool,
    /// Messages `test` reported done and their bytes.
    pub done: Traffic,
    pub completions: u64,
    pub errors: Vec<StatusCount>,
    /// In plan order.
    pub qps: Vec<QpTelemetry>,
}

/// Everything at one moment: what the WIT `telemetry.read` returns.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Telemetry {
    /// Milliseconds since the plugin's `init`.
    pub at_ms: u64,
    /// Every port of the host's table, in `Port::index` order.
    pub ports: Vec<PortTelemetry>,
    /// Newest first, at most [`MAX_CONNECTIONS`].
    pub connections: Vec<ConnectionTelemetry>,
}

/// Where the policy host reads the counters when a policy asks. The transport implements it over
/// its live counters; a snapshot file is one too (it always answers the same).
pub trait TelemetrySource: Send + Sync {
    fn snapshot(&self) -> Telemetry;
}

impl TelemetrySource for Telemetry {
    fn snapshot(&self) -> Telemetry {
        self.clone()
    }
}

impl Telemetry {
    /// All zero for every port of `ports`: what a policy reads where nothing ran.
    pub fn idle(ports: &[Port]) -> Telemetry {
        Telemetry {
            ports: ports.iter().map(PortTelemetry::idle).collect(),
            ..Telemetry::default()
        }
    }

    /// A snapshot file's text (`origin` names it in errors), laid over the port table `ports`:
    /// each port of the file is found by `device` and `port` and takes that port's index;
    /// ports the file leaves out are idle. A port the table lacks, a port listed twice, more
    /// than [`MAX_CHANGES`] changes or [`MAX_CONNECTIONS`] connections, or a QP on a port not
    /// in the table is an error naming it.
    pub fn parse(text: &str, origin: &str, ports: &[Port]) -> Result<Telemetry, String> {
        let file: Telemetry = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|e| {
                let field = e.path().to_string();
                format!("{origin}: {field}: {}", e.into_inner().message().trim())
            })?;
        let mut out = Telemetry {
            at_ms: file.at_ms,
            connections: file.connections,
            ..Telemetry::idle(ports)
        };
        let mut seen = vec![false; ports.len()];
        for p in file.ports {
            let Some(i) = ports
                .iter()
                .position(|q| q.device == p.device && q.port == p.port)
            else {
                return Err(format!(
                    "{origin}: port {}:{} is not in the topology",
                    p.device, p.port
                ));
            };
            if std::mem::replace(&mut seen[i], true) {
                return Err(format!(
                    "{origin}: port {}:{} is listed twice",
                    p.device, p.port
                ));
            }
            if p.changes.len() > MAX_CHANGES {
                return Err(format!(
                    "{origin}: port {}:{} has {} changes; a snapshot keeps at most {MAX_CHANGES}",
                    p.device,
                    p.port,
                    p.changes.len()
                ));
            }
            out.ports[i] = PortTelemetry {
                index: ports[i].index,
                ..p
            };
        }
        if out.connections.len() > MAX_CONNECTIONS {
            return Err(format!(
                "{origin}: {} connections; a snapshot lists at most {MAX_CONNECTIONS}",
                out.connections.len()
            ));
        }
        let known = |i: u32| ports.iter().any(|p| p.index == i);
        if let Some(q) = out
            .connections
            .iter()
            .flat_map(|c| &c.qps)
            .find(|q| !known(q.port))
        {
            return Err(format!(
                "{origin}: QP {} runs on port index {}, which the topology does not have",
                q.qpn, q.port
            ));
        }
        Ok(out)
    }

    /// The snapshot file at `path`, laid over `ports` as [`parse`](Self::parse) does.
    pub fn load(path: &std::path::Path, ports: &[Port]) -> Result<Telemetry, String> {
        let text = crate::file::read_to_string(path, crate::file::Limit::TELEMETRY)
            .map_err(|e| e.to_string())?;
        Telemetry::parse(&text, &path.display().to_string(), ports)
    }

    /// As a snapshot file: TOML with the WIT's names, which [`parse`](Self::parse) reads back.
    pub fn to_toml(&self) -> String {
        // Plain records of integers, strings and lists: nothing TOML cannot write.
        toml::to_string(self).unwrap_or_default()
    }
}

impl PortTelemetry {
    /// A port nothing ran on.
    pub fn idle(port: &Port) -> PortTelemetry {
        PortTelemetry {
            index: port.index,
            device: port.device.clone(),
            port: port.port,
            ..PortTelemetry::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::Topology;

    fn ports() -> Vec<Port> {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../topologies/dual-port.toml"
        ))
        .unwrap();
        Topology::parse(&text, "dual-port").unwrap().ports()
    }

    /// A file names ports by device and port: they take the table's index, the others are
    /// idle, and the result writes back to the same snapshot.
    #[test]
    fn a_snapshot_file_is_laid_over_the_port_table() {
        let ports = ports();
        let second = &ports[1];
        let text = format!(
            "at-ms = 5000\n[[ports]]\ndevice = \"{}\"\nport = {}\nsend = {{ wrs = 10, bytes = 4096 }}\n\
             window-ms = 1000\nwindow-bytes = 2048\nchanges = [{{ at-ms = 100, state = \"down\" }}, \
             {{ at-ms = 200, state = \"active\" }}]\n",
            second.device, second.port
        );
        let t = Telemetry::parse(&text, "t.toml", &ports).unwrap();
        assert_eq!(t.ports.len(), ports.len());
        assert_eq!(t.ports[1].index, second.index);
        assert_eq!(
            t.ports[1].send,
            Traffic {
                wrs: 10,
                bytes: 4096
            }
        );
        assert_eq!(t.ports[1].changes[0].state, PortState::Down);
        assert_eq!(t.ports[0], PortTelemetry::idle(&ports[0]));
        assert_eq!(Telemetry::parse(&t.to_toml(), "again", &ports).unwrap(), t);
    }

    #[test]
    fn a_snapshot_file_that_does_not_fit_the_table_is_refused_by_name() {
        let ports = ports();
        let err = |text: &str| Telemetry::parse(text, "t.toml", &ports).unwrap_err();
        assert!(
            err("[[ports]]\ndevice = \"nope\"\nport = 1\n")
                .contains("nope:1 is not in the topology")
        );
        let p = &ports[0];
        let twice = format!(
            "[[ports]]\ndevice = \"{0}\"\nport = {1}\n[[ports]]\ndevice = \"{0}\"\nport = {1}\n",
            p.device, p.port
        );
        assert!(err(&twice).contains("listed twice"));
        assert!(err("[[connections]]\nqps = [{ qpn = 7, port = 99 }]\n").contains("port index 99"));
        assert!(err("at-ms = \"soon\"\n").starts_with("t.toml: at-ms:"));
        assert!(err("bogus = 1\n").contains("unknown field"));
    }
}
