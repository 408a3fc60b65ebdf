//! The counters behind a policy's `telemetry` import, as `Net::telemetry` sums them: each
//! connection's QPs and messages, each port's total over the connections on it, what a closed
//! connection leaves behind, and the recent window.

mod common;

use common::*;
use ncclwasm_model::telemetry::Telemetry;
use ncclwasm_transport::TelemetryFormat;

#[test]
fn the_telemetry_counts_each_connection_and_sums_each_port() {
    let net = net();
    let before = net.telemetry();
    let (s, r) = connect(&net, 0, 0);
    let b = bufs(&s, &r);
    const N: usize = 20;
    const SIZE: usize = 4096;
    for i in 0..N {
        one(&s, &r, &b, SIZE, SIZE, i);
    }
    let t = net.telemetry();
    let port = s.stats().local[0].clone();
    let p = t
        .ports
        .iter()
        .find(|p| p.device == port.device && p.port == port.port)
        .expect("device 0's port");
    let was = before.ports.iter().find(|q| q.index == p.index).unwrap();

    // The two sides of the connection, newest first: the sender's QP carried the payload,
    // each side's `test` finished N messages of SIZE bytes.
    let sending = t
        .connections
        .iter()
        .find(|c| c.sending)
        .expect("the sender");
    let receiving = t
        .connections
        .iter()
        .find(|c| !c.sending)
        .expect("the receiver");
    let payload = (N * SIZE) as u64;
    assert_eq!(sending.qps.len(), s.plan().qps.len());
    assert_eq!(sending.qps[0].send.bytes, s.stats().posted[0]);
    assert_eq!(sending.qps[0].send.bytes, payload);
    assert_eq!((sending.done.wrs, sending.done.bytes), (N as u64, payload));
    assert_eq!(
        (receiving.done.wrs, receiving.done.bytes),
        (N as u64, payload)
    );
    assert!(receiving.qps[0].recv.wrs >= N as u64, "{receiving:?}");
    assert!(sending.completions > 0 && receiving.completions > 0);
    assert!(sending.errors.is_empty() && receiving.errors.is_empty());
    assert!(sending.qps.iter().all(|q| q.port == p.index));

    // The port: both sides' QPs, and the sum of what they posted (the receiver's CTS writes
    // with the sender's payload).
    assert_eq!((p.connections, p.qps), (2, 2), "{p:?}");
    let on_port: u64 = [sending, receiving]
        .iter()
        .flat_map(|c| &c.qps)
        .map(|q| q.send.bytes)
        .sum();
    assert_eq!(p.send.bytes - was.send.bytes, on_port);
    assert!(p.send.bytes - was.send.bytes > payload);
    assert!(
        p.window_bytes > 0 && u64::from(p.window_ms) <= t.at_ms,
        "{p:?}"
    );

    // The file the plugin writes under NCCL_WASM_TELEMETRY_FILE: the same snapshot, as TOML,
    // rewritten while the context lives.
    let path = std::env::temp_dir().join(format!("ncclwasm-telemetry-{}.toml", std::process::id()));
    let _ = std::fs::remove_file(&path);
    net.write_telemetry(
        path.clone(),
        TelemetryFormat::Snapshot,
        std::time::Duration::from_millis(20),
    )
    .unwrap();
    let end = deadline();
    let written = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if let Ok(w) = toml::from_str::<Telemetry>(&text)
            && w.connections.len() >= 2
        {
            break w;
        }
        assert!(
            std::time::Instant::now() < end,
            "no telemetry file at {}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(written.ports.len(), t.ports.len());
    let w = written.ports.iter().find(|q| q.index == p.index).unwrap();
    assert_eq!(
        (w.connections, w.qps, w.send),
        (p.connections, p.qps, p.send)
    );
    std::fs::remove_file(&path).unwrap();

    // Closed: the connections leave the list, their work stays in the port's totals.
    drop((b, s, r));
    let after = net.telemetry();
    let q = after.ports.iter().find(|q| q.index == p.index).unwrap();
    assert!(
        after
            .connections
            .iter()
            .all(|c| c.id != sending.id && c.id != receiving.id)
    );
    assert_eq!((q.connections, q.qps), (0, 0), "{q:?}");
    assert_eq!(q.send, p.send);
    assert_eq!(q.completions, p.completions);
}

/// A telemetry file that cannot be written is one WARN, not silence nor a line a second, and
/// one INFO once it can be written again; a device in its place (`/dev/full`, through a link in
/// the test's directory) is written in place, never replaced.
#[test]
fn an_unwritable_telemetry_file_is_one_warning_and_its_recovery_one_line() {
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let s = ncclwasm_testkit::scratch::Scratch::new("telemetry-file");
    let net = net();
    let every = std::time::Duration::from_millis(10);
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let end = deadline();
        while !done() {
            assert!(std::time::Instant::now() < end, "{what}: {}", logged());
            std::thread::sleep(every);
        }
    };
    let path = s.path("missing").join("telemetry.toml");
    net.write_telemetry(path.clone(), TelemetryFormat::Snapshot, every)
        .unwrap();
    let warned = format!("cannot write the telemetry to {}", path.display());
    wait("the WARN", &|| logged().contains(&warned));
    std::thread::sleep(every * 10);
    assert_eq!(logged().matches(&warned).count(), 1, "{}", logged());
    s.dir("missing");
    let again = format!("writing the telemetry to {} again", path.display());
    wait("the recovery", &|| {
        logged().contains(&again) && path.is_file()
    });

    let full = s.symlink("/dev/full", "full");
    net.write_telemetry(full.clone(), TelemetryFormat::Snapshot, every)
        .unwrap();
    let warned = format!("cannot write the telemetry to {}", full.display());
    wait("the WARN for /dev/full", &|| logged().contains(&warned));
    assert!(std::fs::symlink_metadata(&full).unwrap().is_symlink());
}

/// The parser of Prometheus' own Python client (Debian's `python3-prometheus-client`, which
/// `.ci/run` installs) reads a file, and prints each sample as `type name labels value`, labels
/// sorted.
const PROMETHEUS_PARSE: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(open(sys.argv[1]).read()):
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        print(family.type, s.name, labels, s.value, sep="\t")
"#;

/// `NCCL_WASM_METRICS_FILE`: the counters in Prometheus' text format, which Prometheus' own
/// parser accepts, with the values of the snapshot; counters are `_total`; the file goes with
/// the context.
#[test]
fn the_metrics_file_is_what_prometheus_reads() {
    let scratch = ncclwasm_testkit::scratch::Scratch::new("metrics-file");
    let net = net();
    let (s, r) = connect(&net, 0, 0);
    let b = bufs(&s, &r);
    const N: usize = 8;
    const SIZE: usize = 8192;
    for i in 0..N {
        one(&s, &r, &b, SIZE, SIZE, i);
    }
    let port = s.stats().local[0].clone();
    let path = scratch.path("ncclwasm.prom");
    net.write_telemetry(
        path.clone(),
        TelemetryFormat::Prometheus,
        std::time::Duration::from_millis(20),
    )
    .unwrap();
    let end = deadline();
    while !path.is_file() {
        assert!(std::time::Instant::now() < end, "no metrics file");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let t = net.telemetry();
    let p = t
        .ports
        .iter()
        .find(|p| p.device == port.device && p.port == port.port)
        .unwrap();

    let parsed = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(PROMETHEUS_PARSE)
        .arg(&path)
        .output()
        .expect("run /usr/bin/python3 (install python3-prometheus-client)");
    let out = String::from_utf8_lossy(&parsed.stdout);
    assert!(
        parsed.status.success(),
        "Prometheus' parser refused the file: {}\n{}",
        String::from_utf8_lossy(&parsed.stderr),
        std::fs::read_to_string(&path).unwrap_or_default()
    );
    let samples: Vec<[&str; 4]> = out
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            [f[0], f[1], f[2], f[3]]
        })
        .collect();
    let value = |name: &str, labels: &str| -> f64 {
        let found: Vec<_> = samples
            .iter()
            .filter(|s| s[1] == name && s[2] == labels)
            .collect();
        assert_eq!(found.len(), 1, "{name}{{{labels}}} in\n{out}");
        found[0][3].parse().unwrap()
    };
    let pid = std::process::id();
    let on_port = format!("device={},pid={pid},port={}", port.device, port.port);
    assert_eq!(
        value("ncclwasm_port_send_bytes_total", &on_port),
        p.send.bytes as f64
    );
    assert_eq!(
        value("ncclwasm_port_completions_total", &on_port),
        p.completions as f64
    );
    assert_eq!(
        value("ncclwasm_port_state", &format!("{on_port},state=active")),
        1.0
    );
    let sending = t.connections.iter().find(|c| c.sending).unwrap();
    let conn = format!(
        "comm={:#018x},connection={},nccl_device=0,pid={pid},side=send",
        sending.comm_id, sending.id
    );
    assert_eq!(
        value("ncclwasm_connection_message_bytes_total", &conn),
        (N * SIZE) as f64
    );
    for [kind, name, ..] in &samples {
        assert_eq!(
            *kind == "counter",
            name.ends_with("_total"),
            "{name}: {kind}"
        );
        assert!(name.starts_with("ncclwasm_"), "{name}");
    }

    drop((b, s, r));
    drop(net);
    assert!(!path.exists(), "the metrics file outlived its context");
}
