//! The telemetry in Prometheus' text exposition format (0.0.4), for node_exporter's textfile
//! collector (`NCCL_WASM_METRICS_FILE`): the same counters a policy reads, named by
//! Prometheus' conventions — an `ncclwasm_` prefix, base units (bytes, seconds), `_total` on
//! counters — so a dashboard sums them per rail with the usual `rate()` queries.
//!
//! Every series carries the process id (`pid`): a node's ranks write one file each into the
//! collector's directory, and the collector refuses two files that expose the same series.
//! Counters only grow while the plugin's context lives (closed connections leave their work in
//! their ports' totals), so `rate()` over them is the traffic; a connection's series end when
//! it closes, as a connection's own counters do.

use std::fmt::Write;

use ncclwasm_model::PortState;
use ncclwasm_model::telemetry::{
    ConnectionTelemetry, PortTelemetry, StatusCount, Telemetry, Traffic,
};
use ncclwasm_verbs::WcStatus;

/// What a port's snapshot does not say: its state now, how many times it changed (the
/// snapshot keeps only the latest changes), and its rail when the policy named one (v12's
/// `railId`), so a dashboard can sum per rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PortStatus {
    pub state: PortState,
    pub changes: u64,
    pub rail: Option<i16>,
}

/// One metric family being written: its HELP and TYPE once, then its samples.
struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
}

impl Family<'_> {
    fn sample(&mut self, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let _ = write!(self.out, "{}{{", self.name);
        for (i, (k, v)) in labels.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(self.out, "{sep}{k}=\"{}\"", escape(v));
        }
        let _ = writeln!(self.out, "}} {value}");
    }
}

/// Starts the family `name` of `kind` (`counter` or `gauge`) with its help text.
fn family<'a>(out: &'a mut String, name: &'static str, kind: &str, help: &str) -> Family<'a> {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    Family { out, name }
}

/// A label value as the format quotes it: backslash, double quote and newline escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn state_name(s: PortState) -> &'static str {
    match s {
        PortState::Down => "down",
        PortState::Initializing => "initializing",
        PortState::Armed => "armed",
        PortState::Active => "active",
    }
}

/// `t` (with `status`, one per port of `t.ports`) in the exposition format, every series
/// labelled with `pid`.
pub(crate) fn render(t: &Telemetry, status: &[PortStatus], pid: u32) -> String {
    let pid = pid.to_string();
    let mut out = String::with_capacity(4096 + 512 * (t.ports.len() + t.connections.len()));
    let mut f = family(
        &mut out,
        "ncclwasm_uptime_seconds",
        "gauge",
        "Seconds since the plugin's init.",
    );
    f.sample(&[("pid", &pid)], t.at_ms as f64 / 1000.0);

    let ports: Vec<(Vec<(&str, String)>, &_)> = t
        .ports
        .iter()
        .zip(status)
        .map(|(p, s)| {
            let mut labels = vec![
                ("pid", pid.clone()),
                ("device", p.device.clone()),
                ("port", p.port.to_string()),
            ];
            labels.extend(s.rail.map(|r| ("rail", r.to_string())));
            (labels, p)
        })
        .collect();
    type PortValue = fn(&PortTelemetry) -> u64;
    let per_port: [(&'static str, &str, &str, PortValue); 6] = [
        (
            "ncclwasm_port_send_work_requests_total",
            "counter",
            "Work requests posted to the port's send queues (RDMA writes, sends, reads, atomics), one-sided traffic included.",
            |p| p.send.wrs,
        ),
        (
            "ncclwasm_port_send_bytes_total",
            "counter",
            "Payload bytes of the work requests posted to the port's send queues.",
            |p| p.send.bytes,
        ),
        (
            "ncclwasm_port_recv_work_requests_total",
            "counter",
            "Receive work requests posted on the port.",
            |p| p.recv.wrs,
        ),
        (
            "ncclwasm_port_completions_total",
            "counter",
            "Successful work completions polled from the port's completion queues.",
            |p| p.completions,
        ),
        (
            "ncclwasm_port_connections",
            "gauge",
            "Open connections with a QP on the port.",
            |p| u64::from(p.connections),
        ),
        ("ncclwasm_port_qps", "gauge", "Open QPs on the port.", |p| {
            u64::from(p.qps)
        }),
    ];
    for (name, kind, help, value) in per_port {
        let mut f = family(&mut out, name, kind, help);
        for p in &ports {
            f.sample(&as_refs(&p.0), value(p.1));
        }
    }
    let mut f = family(
        &mut out,
        "ncclwasm_port_recent_send_bytes_per_second",
        "gauge",
        "Bytes posted for sending on the port per second over the last second or so.",
    );
    for p in &ports {
        let (bytes, ms) = (p.1.window_bytes, p.1.window_ms);
        let rate = if ms == 0 {
            0.0
        } else {
            bytes as f64 * 1000.0 / f64::from(ms)
        };
        f.sample(&as_refs(&p.0), rate);
    }
    let mut f = family(
        &mut out,
        "ncclwasm_port_completion_errors_total",
        "counter",
        "Work completions in error polled from the port's completion queues, by ibv_wc_status.",
    );
    for p in &ports {
        for e in &p.1.errors {
            let mut labels = p.0.clone();
            labels.push(("status", status_label(e)));
            f.sample(&as_refs(&labels), e.count);
        }
    }
    let mut f = family(
        &mut out,
        "ncclwasm_port_state_changes_total",
        "counter",
        "Port state changes the plugin was told of (async events).",
    );
    for (p, s) in ports.iter().zip(status) {
        f.sample(&as_refs(&p.0), s.changes);
    }
    let mut f = family(
        &mut out,
        "ncclwasm_port_state",
        "gauge",
        "1 for the port's state now, 0 for the others.",
    );
    for (p, s) in ports.iter().zip(status) {
        for state in [
            PortState::Down,
            PortState::Initializing,
            PortState::Armed,
            PortState::Active,
        ] {
            let mut labels = p.0.clone();
            labels.push(("state", state_name(state).to_owned()));
            f.sample(&as_refs(&labels), u8::from(s.state == state));
        }
    }

    let conn_labels = |c: &ConnectionTelemetry| {
        [
            ("pid", pid.clone()),
            ("connection", c.id.to_string()),
            ("comm", format!("{:#018x}", c.comm_id)),
            ("nccl_device", c.device.to_string()),
            ("side", if c.sending { "send" } else { "recv" }.to_owned()),
        ]
    };
    type ConnValue = fn(&ConnectionTelemetry) -> u64;
    let per_conn: [(&'static str, &str, ConnValue); 3] = [
        (
            "ncclwasm_connection_messages_total",
            "Messages of the connection that test() reported done.",
            |c| c.done.wrs,
        ),
        (
            "ncclwasm_connection_message_bytes_total",
            "Bytes of the messages of the connection that test() reported done.",
            |c| c.done.bytes,
        ),
        (
            "ncclwasm_connection_completions_total",
            "Successful work completions the connection polled.",
            |c| c.completions,
        ),
    ];
    for (name, help, value) in per_conn {
        let mut f = family(&mut out, name, "counter", help);
        for c in &t.connections {
            f.sample(&as_refs(&conn_labels(c)), value(c));
        }
    }
    let mut f = family(
        &mut out,
        "ncclwasm_connection_completion_errors_total",
        "counter",
        "Work completions in error the connection polled, by ibv_wc_status.",
    );
    for c in &t.connections {
        for e in &c.errors {
            let mut labels = conn_labels(c).to_vec();
            labels.push(("status", status_label(e)));
            f.sample(&as_refs(&labels), e.count);
        }
    }

    let qp_labels = |c: &ConnectionTelemetry, qpn: u32, port: u32| {
        let mut labels = vec![
            ("pid", pid.clone()),
            ("connection", c.id.to_string()),
            ("qpn", qpn.to_string()),
        ];
        if let Some((port_labels, _)) = ports.iter().find(|p| p.1.index == port) {
            labels.extend(port_labels[1..].iter().cloned());
        }
        labels
    };
    type QpValue = fn(&Traffic, &Traffic) -> u64;
    let per_qp: [(&'static str, &str, QpValue); 3] = [
        (
            "ncclwasm_qp_send_work_requests_total",
            "Work requests posted to the QP's send queue.",
            |send, _| send.wrs,
        ),
        (
            "ncclwasm_qp_send_bytes_total",
            "Payload bytes of the work requests posted to the QP's send queue.",
            |send, _| send.bytes,
        ),
        (
            "ncclwasm_qp_recv_work_requests_total",
            "Receive work requests posted to the QP.",
            |_, recv| recv.wrs,
        ),
    ];
    for (name, help, value) in per_qp {
        let mut f = family(&mut out, name, "counter", help);
        for c in &t.connections {
            for q in &c.qps {
                f.sample(
                    &as_refs(&qp_labels(c, q.qpn, q.port)),
                    value(&q.send, &q.recv),
                );
            }
        }
    }
    out
}

fn as_refs<'a>(labels: &'a [(&'a str, String)]) -> Vec<(&'a str, &'a str)> {
    labels.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn status_label(e: &StatusCount) -> String {
    WcStatus::from_raw(e.status).c_name().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_model::telemetry::{ConnectionTelemetry, PortTelemetry, QpTelemetry, StatusCount};

    fn snapshot() -> Telemetry {
        Telemetry {
            at_ms: 2500,
            ports: vec![
                PortTelemetry {
                    index: 0,
                    device: "mlx5_0".into(),
                    port: 1,
                    send: Traffic {
                        wrs: 3,
                        bytes: 12288,
                    },
                    completions: 3,
                    errors: vec![StatusCount {
                        status: 12,
                        count: 2,
                    }],
                    connections: 1,
                    qps: 1,
                    window_ms: 500,
                    window_bytes: 4096,
                    ..PortTelemetry::default()
                },
                PortTelemetry {
                    index: 1,
                    device: "we\"ird\\name".into(),
                    port: 2,
                    ..PortTelemetry::default()
                },
            ],
            connections: vec![ConnectionTelemetry {
                id: 7,
                comm_id: 0xabc,
                device: 0,
                sending: true,
                done: Traffic {
                    wrs: 3,
                    bytes: 12288,
                },
                completions: 3,
                errors: vec![],
                qps: vec![QpTelemetry {
                    qpn: 0x11,
                    port: 0,
                    send: Traffic {
                        wrs: 3,
                        bytes: 12288,
                    },
                    recv: Traffic::default(),
                }],
            }],
        }
    }

    /// Each family once, with HELP and TYPE before its samples; counters end in `_total`;
    /// the values are the snapshot's; label values are escaped.
    #[test]
    fn the_snapshot_as_prometheus_reads_it() {
        let status = [
            PortStatus {
                state: PortState::Active,
                changes: 0,
                rail: Some(4),
            },
            PortStatus {
                state: PortState::Down,
                changes: 3,
                rail: None,
            },
        ];
        let text = render(&snapshot(), &status, 42);
        let lines: Vec<&str> = text.lines().collect();
        for l in &lines {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(name.ends_with("_total"), kind == "counter", "{l}");
                assert_eq!(
                    lines
                        .iter()
                        .filter(|m| m.starts_with(&format!("# TYPE {name} ")))
                        .count(),
                    1
                );
            }
        }
        for want in [
            "ncclwasm_uptime_seconds{pid=\"42\"} 2.5",
            "ncclwasm_port_send_bytes_total{pid=\"42\",device=\"mlx5_0\",port=\"1\",rail=\"4\"} 12288",
            "ncclwasm_port_recent_send_bytes_per_second{pid=\"42\",device=\"mlx5_0\",port=\"1\",rail=\"4\"} 8192",
            "ncclwasm_port_completion_errors_total{pid=\"42\",device=\"mlx5_0\",port=\"1\",rail=\"4\",status=\"IBV_WC_RETRY_EXC_ERR\"} 2",
            "ncclwasm_port_state{pid=\"42\",device=\"we\\\"ird\\\\name\",port=\"2\",state=\"down\"} 1",
            "ncclwasm_port_state{pid=\"42\",device=\"we\\\"ird\\\\name\",port=\"2\",state=\"active\"} 0",
            "ncclwasm_port_state_changes_total{pid=\"42\",device=\"we\\\"ird\\\\name\",port=\"2\"} 3",
            "ncclwasm_connection_message_bytes_total{pid=\"42\",connection=\"7\",comm=\"0x0000000000000abc\",nccl_device=\"0\",side=\"send\"} 12288",
            "ncclwasm_qp_send_bytes_total{pid=\"42\",connection=\"7\",qpn=\"17\",device=\"mlx5_0\",port=\"1\",rail=\"4\"} 12288",
        ] {
            assert!(lines.contains(&want), "no line {want} in\n{text}");
        }
    }
}
