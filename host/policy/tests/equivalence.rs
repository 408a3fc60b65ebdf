//! The built-in default and its wasm twin `nccl-default` decide the same on every topology of
//! the corpus under every `NCCL_IB_*` setting of the table (`docs/architecture.md`, "The failure model").

use ncclwasm_model::validate;
use ncclwasm_model::{
    ConnPlan, Connection, Port, PortChange, PortEvent, PortEventCause, PortState, Topology,
};
use ncclwasm_policy::{Decision, FailureCause, FailureMode, PolicyError, PolicyHost, Source};

use crate::{connection, guest, settings};

/// `NCCL_IB_*` settings that change the decisions (each row is one configuration).
const SETTINGS: &[&[(&str, &str)]] = &[
    &[],
    &[("NCCL_IB_HCA", "mlx5_0,mlx5_1")],
    &[("NCCL_IB_HCA", "^mlx5_0")],
    &[("NCCL_IB_HCA", "=mlx5_1")],
    // Prefix trap: `mlx5_1` also matches `mlx5_10`…, `=mlx5_1` does not.
    &[("NCCL_IB_HCA", "mlx5_1")],
    &[("NCCL_IB_HCA", "mlx5_0:1,mlx5_2:1")],
    &[("NCCL_IB_HCA", "^=mlx5_3")],
    &[("NCCL_IB_GID_INDEX", "3")],
    &[("NCCL_IB_GID_INDEX", "0")],
    &[("NCCL_IB_ADDR_FAMILY", "AF_INET6")],
    &[("NCCL_IB_ADDR_RANGE", "10.0.0.0/8")],
    &[("NCCL_IB_ROCE_VERSION_NUM", "1")],
    &[("NCCL_IB_QPS_PER_CONNECTION", "4")],
    &[
        ("NCCL_IB_QPS_PER_CONNECTION", "3"),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", "1"),
    ],
    &[
        ("NCCL_IB_ADAPTIVE_ROUTING", "1"),
        ("NCCL_IB_AR_THRESHOLD", "65536"),
    ],
    &[
        ("NCCL_IB_TC", "106"),
        ("NCCL_IB_SL", "3"),
        ("NCCL_IB_FIFO_TC", "96"),
    ],
    &[("NCCL_IB_TIMEOUT", "22"), ("NCCL_IB_RETRY_CNT", "5")],
    &[("NCCL_IB_MERGE_NICS", "0")],
    &[
        ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1"),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
    ],
];

/// Both hosts' answers for one hook must be equal, and the wasm one must not be a fallback.
fn same<T: PartialEq + std::fmt::Debug>(
    what: &str,
    native: Result<Decision<T>, PolicyError>,
    wasm: Result<Decision<T>, PolicyError>,
    failures: &mut Vec<String>,
) {
    match (native, wasm) {
        (Ok(n), Ok(w)) => {
            if let Source::Fallback { cause, detail, .. } = &w.source {
                failures.push(format!(
                    "{what}: nccl-default fell back ({cause}: {detail})"
                ));
            } else if n.value != w.value {
                failures.push(format!(
                    "{what}:\n  built-in {:?}\n  wasm     {:?}",
                    n.value, w.value
                ));
            }
        }
        (n, w) => failures.push(format!(
            "{what}: built-in {:?} / wasm {:?}",
            n.err(),
            w.err()
        )),
    }
}

fn hosts(ib: &[(&str, &str)]) -> Option<(PolicyHost, PolicyHost)> {
    let mut s = settings(FailureMode::Open);
    s.ib = ib
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    s.ib.sort();
    let native = match PolicyHost::new(s.clone()) {
        Ok(h) => h,
        // A row the built-in default refuses is refused the same way everywhere.
        Err(PolicyError::IbConfig(_)) => return None,
        Err(e) => panic!("{ib:?}: {e}"),
    };
    // One compilation for the whole table instead of one per row: the per-user disk cache,
    // which `Settings` uses by default.
    s.policy = Some(guest("nccl-default"));
    s.failure = FailureMode::Closed;
    let wasm = PolicyHost::new(s).unwrap_or_else(|e| panic!("nccl-default with {ib:?}: {e}"));
    Some((native, wasm))
}

/// Compare every hook for one (topology, settings) pair; false when the settings are refused.
fn compare(
    topology: &str,
    ports: &[Port],
    ib: &[(&str, &str)],
    failures: &mut Vec<String>,
) -> bool {
    let Some((native, wasm)) = hosts(ib) else {
        return false;
    };
    let at = |hook: &str| format!("{topology} {ib:?} {hook}");
    let (n, w) = (native.select_devices(ports), wasm.select_devices(ports));
    let selected: Vec<Port> = match &n {
        Ok(d) => d
            .value
            .ports
            .iter()
            .filter_map(|i| ports.iter().find(|p| p.index == *i).cloned())
            .collect(),
        Err(_) => Vec::new(),
    };
    same(&at("select-devices"), n, w, failures);
    for port in &selected {
        let gid = native.select_gid(port);
        let gid_index = gid.as_ref().ok().map(|d| d.value.index);
        let forced_bad = gid
            .as_ref()
            .is_ok_and(|d| validate::check_gid(&d.value, port).is_err());
        match wasm.select_gid(port) {
            // NCCL_IB_GID_INDEX is obeyed as NCCL obeys it, even when it names a slot this port
            // lacks; the host refuses that answer from a policy. Both agree it is that index.
            Err(PolicyError::Failed {
                cause: FailureCause::InvalidAnswer,
                ..
            }) if forced_bad => {}
            w => same(
                &at(&format!("select-gid {}", port.device)),
                gid,
                w,
                failures,
            ),
        }
        if let Some(g) = gid_index.filter(|g| port.gids.iter().any(|x| x.index == *g)) {
            let conn = connection(port, g);
            same(
                &at(&format!("plan-connection {}", port.device)),
                unreasoned(native.plan_connection(&conn)),
                unreasoned(wasm.plan_connection(&conn)),
                failures,
            );
        }
    }
    same(
        &at("group-devices"),
        native.group_devices(&selected),
        wasm.group_devices(&selected),
        failures,
    );
    // on-port-event, on a connection over the first two selected ports (as a fused NIC).
    let local: Vec<_> = selected
        .iter()
        .take(2)
        .filter_map(|p| Some(p.endpoint(native.select_gid(p).ok()?.value.index)))
        .collect();
    let conn = Connection {
        net_attr: None,
        one_sided: None,
        comm_id: 1,
        traffic_class: -1,
        device: 0,
        device_name: "sample".into(),
        peer: local.clone(),
        local,
    };
    // The same fused connection carrying one context of one-sided traffic (where a port was
    // selected).
    let one_sided = Connection {
        one_sided: Some(ncclwasm_model::OneSided {
            context: 1,
            contexts: 2,
            rank: 0,
            peer: 1,
            nranks: 2,
        }),
        traffic_class: 41,
        ..conn.clone()
    };
    if !conn.local.is_empty() {
        same(
            &at("plan-connection one-sided"),
            unreasoned(native.plan_connection(&one_sided)),
            unreasoned(wasm.plan_connection(&one_sided)),
            failures,
        );
    }
    if let Ok(plan) = native.plan_connection(&conn) {
        let n = conn.local.len();
        for failed in 0..n as u32 {
            for (change, cause) in [
                (PortChange::Down, PortEventCause::AsyncEvent),
                (PortChange::Down, PortEventCause::FatalCompletion),
                (PortChange::Up, PortEventCause::AsyncEvent),
            ] {
                let mut states = vec![PortState::Active; n];
                if (change, cause) == (PortChange::Down, PortEventCause::AsyncEvent) {
                    states[failed as usize] = PortState::Down;
                }
                let event = PortEvent {
                    port: failed,
                    change,
                    cause,
                };
                let qps = &plan.value.qps;
                same(
                    &at(&format!("on-port-event {event:?}")),
                    native.on_port_event(&event, &conn, qps, &states),
                    wasm.on_port_event(&event, &conn, qps, &states),
                    failures,
                );
            }
        }
    }
    for n_req in [2, selected.len().min(8)] {
        if selected.len() >= n_req && n_req >= 2 {
            let request: Vec<u32> = (0..n_req as u32).collect();
            let req_ports = &selected[..n_req];
            same(
                &at(&format!("make-vnic {request:?}")),
                native.make_vnic(&request, req_ports),
                wasm.make_vnic(&request, req_ports),
                failures,
            );
        }
    }
    true
}

#[test]
fn builtin_and_wasm_nccl_default_agree_on_the_corpus() {
    let files = ncclwasm_testkit::topologies();
    let mut failures = Vec::new();
    let mut compared = 0;
    for file in &files {
        let topology = Topology::load(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let ports = topology.ports();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        for ib in SETTINGS {
            compared += usize::from(compare(&name, &ports, ib, &mut failures));
        }
    }
    assert!(
        compared >= files.len() * (SETTINGS.len() - 2),
        "too many settings refused"
    );
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A plan from a policy is a patch merged over the built-in plan, and the merged reason says
/// which fields the policy set: plans are compared on everything but the reason.
fn unreasoned(
    d: Result<Decision<ConnPlan>, PolicyError>,
) -> Result<Decision<ConnPlan>, PolicyError> {
    d.map(|mut d| {
        d.value.reason.clear();
        d
    })
}
