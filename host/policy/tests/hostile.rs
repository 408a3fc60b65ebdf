//! Each hostile guest is contained: stopped, capped or refused; `open` falls back with a logged
//! reason, `closed` fails the call; the host neither crashes nor hangs.

use std::time::{Duration, Instant};

use ncclwasm_model::{
    PortAnswer, PortChange, PortEvent, PortEventCause, PortState, QpPlan, VnicAnswer,
};
use ncclwasm_policy::{FailureCause, FailureMode, Hook, PolicyError, PolicyHost, Source};

use crate::{capture_logs, connection, guest, host_with, logged, ports, settings};

/// The fallback's cause and detail, or a panic saying what came instead.
fn fallback(source: &Source) -> (FailureCause, String) {
    match source {
        Source::Fallback { cause, detail, .. } => (*cause, detail.clone()),
        other => panic!("expected a fallback, got {other}"),
    }
}

/// The built-in default's answer to `make_vnic`, under `host`'s settings.
fn builtin_vnic(host: &PolicyHost, request: &[u32], ports: &[ncclwasm_model::Port]) -> VnicAnswer {
    ncclwasm_default::make_vnic(
        host.ib_config(),
        request,
        ports,
        host.settings().max_devs_per_nic,
    )
}

/// Under `closed`, the same fault is an error naming the hook and the cause.
fn failed<T: std::fmt::Debug>(r: Result<T, PolicyError>, hook: Hook, cause: FailureCause) {
    match r {
        Err(PolicyError::Failed {
            hook: h, cause: c, ..
        }) if h == hook && c == cause => {}
        other => panic!("expected {hook} to fail with {cause}, got {other:?}"),
    }
}

#[test]
fn endless_loop_is_stopped_within_the_deadline() {
    capture_logs();
    let ports = ports();
    let looping = |failure| {
        let mut s = settings(failure);
        s.timeout = Duration::from_millis(200);
        s.policy = Some(guest("hostile-loop"));
        PolicyHost::new(s).expect("host starts")
    };
    let host = looping(FailureMode::Open);
    let deadline = host.settings().timeout;
    let builtin = ncclwasm_default::select_devices(host.ib_config(), &ports);
    for _ in 0..2 {
        let start = Instant::now();
        let d = host.select_devices(&ports).expect("open falls back");
        let took = start.elapsed();
        assert!(
            took < deadline + Duration::from_secs(2),
            "the loop ran {took:?}"
        );
        assert_eq!(fallback(&d.source).0, FailureCause::Timeout);
        assert_eq!(d.value, builtin, "the built-in default decides");
    }
    // The other hooks of the same policy still answer (a fresh instance, `init`-ed again).
    let gid = host.select_gid(&ports[0]).unwrap();
    assert!(matches!(gid.source, Source::NoOpinion(_)), "{}", gid.source);
    assert_eq!(
        gid.value,
        ncclwasm_default::select_gid(host.ib_config(), &ports[0])
    );
    assert_eq!(host.stats().faults[1], (FailureCause::Timeout, 2));
    // Where it was stopped, from the name section alone (the guest profile keeps it, not line
    // tables): the loop, or the export it was inlined into, which is named after the hook.
    let (_, detail) = fallback(&host.select_devices(&ports).unwrap().source);
    let at = detail.split_once("; interrupted, in ").map(|(_, at)| at);
    assert!(
        at.is_some_and(|at| at.contains("select-devices") || at.contains("select_devices")),
        "{detail}"
    );
    assert!(
        logged().contains("hostile-loop@1 failed in select-devices: timeout"),
        "{}",
        logged()
    );

    let closed = looping(FailureMode::Closed);
    let start = Instant::now();
    failed(
        closed.select_devices(&ports),
        Hook::SelectDevices,
        FailureCause::Timeout,
    );
    assert!(start.elapsed() < deadline + Duration::from_secs(2));
}

#[test]
fn memory_bomb_is_capped() {
    capture_logs();
    let ports = ports();
    let host = host_with("hostile-bomb", FailureMode::Open, None);
    let d = host.select_devices(&ports).unwrap();
    let (cause, detail) = fallback(&d.source);
    assert_eq!(cause, FailureCause::OutOfMemory, "{detail}");
    assert_eq!(
        d.value,
        ncclwasm_default::select_devices(host.ib_config(), &ports)
    );
    // The growth was refused in wasi-libc's allocator (`sbrk`); the line names the policy's
    // frame below it.
    let at = detail
        .split_once("NCCL_WASM_POLICY_MEMORY_MB=32 MiB, in ")
        .map(|(_, at)| at);
    assert!(
        at.is_some_and(|at| at.starts_with("select-devices") || at.contains("select_devices")),
        "{detail}"
    );
    assert!(logged().contains("hostile-bomb@1 failed in select-devices: out of memory"));
    // Again: the faulted store was dropped, its memory returned, a fresh one made.
    assert_eq!(
        fallback(&host.select_devices(&ports).unwrap().source).0,
        FailureCause::OutOfMemory
    );

    let closed = host_with("hostile-bomb", FailureMode::Closed, None);
    failed(
        closed.select_devices(&ports),
        Hook::SelectDevices,
        FailureCause::OutOfMemory,
    );
}

#[test]
fn traps_fall_back_and_the_next_call_gets_a_fresh_instance() {
    capture_logs();
    let ports = ports();
    let host = host_with("hostile-trap", FailureMode::Open, None);
    let (cause, detail) = fallback(&host.select_devices(&ports).unwrap().source);
    assert_eq!(cause, FailureCause::Trap);
    assert!(detail.contains("unreachable"), "{detail}");
    // Where: the policy's own function first (past std's abort), with the file:line its line
    // tables give, in one line of a few frames.
    let at = detail
        .split_once(", in ")
        .unwrap_or_else(|| panic!("no location in {detail:?}"))
        .1;
    assert!(
        at.starts_with("select_devices (") && at.contains("/hostile/trap/src/lib.rs:19:"),
        "{detail}"
    );
    assert!(
        !detail.contains('\n') && at.matches(" ← ").count() <= 2,
        "{detail}"
    );
    let gid = host.select_gid(&ports[0]).unwrap();
    let (cause, detail) = fallback(&gid.source);
    assert_eq!(cause, FailureCause::Trap);
    // A panic (`panic = "abort"`) is the same trap, reported past the panic machinery.
    assert!(
        detail.contains(", in select_gid (") && detail.contains("/hostile/trap/src/lib.rs:23:"),
        "{detail}"
    );
    assert_eq!(
        gid.value,
        ncclwasm_default::select_gid(host.ib_config(), &ports[0])
    );
    // After two traps the policy still serves the hooks that work.
    let conn = connection(&ports[0], 3);
    let plan = host.plan_connection(&conn).unwrap();
    assert!(
        matches!(plan.source, Source::NoOpinion(_)),
        "{}",
        plan.source
    );
    assert_eq!(
        plan.value,
        ncclwasm_default::plan_connection(host.ib_config(), &conn)
    );
    let log = logged();
    assert!(
        log.contains("hostile-trap@1 failed in select-devices: trap"),
        "{log}"
    );
    assert!(
        log.contains("hostile-trap@1 failed in select-gid: trap"),
        "{log}"
    );

    let closed = host_with("hostile-trap", FailureMode::Closed, None);
    failed(
        closed.select_devices(&ports),
        Hook::SelectDevices,
        FailureCause::Trap,
    );
    failed(
        closed.select_gid(&ports[0]),
        Hook::SelectGid,
        FailureCause::Trap,
    );
}

#[test]
fn a_log_flood_is_capped() {
    capture_logs();
    let ports = ports();
    let host = host_with("hostile-trap", FailureMode::Open, None);
    let groups = host.group_devices(&ports[..4]).unwrap();
    assert!(
        matches!(groups.source, Source::NoOpinion(_)),
        "{}",
        groups.source
    );
    assert_eq!(
        groups.value,
        ncclwasm_default::group_devices(host.ib_config(), &ports[..4])
    );
    assert!(
        logged().contains("dropped 9984 log lines"),
        "the flood was not capped"
    );
}

#[test]
fn out_of_range_answers_are_refused() {
    capture_logs();
    let ports = ports();
    let host = host_with("hostile-out-of-range", FailureMode::Open, None);
    let invalid = |source: &Source, needle: &str| {
        let (cause, detail) = fallback(source);
        assert_eq!(cause, FailureCause::InvalidAnswer, "{detail}");
        assert!(
            detail.contains(needle),
            "{detail:?} should mention {needle:?}"
        );
    };
    let ib = host.ib_config();
    let devices = host.select_devices(&ports).unwrap();
    invalid(&devices.source, "port 99");
    assert_eq!(devices.value, ncclwasm_default::select_devices(ib, &ports));
    let gid = host.select_gid(&ports[0]).unwrap();
    invalid(&gid.source, "GID index 15 is not in the table");
    assert_eq!(gid.value, ncclwasm_default::select_gid(ib, &ports[0]));
    let groups = host.group_devices(&ports[..4]).unwrap();
    invalid(&groups.source, "port 99");
    assert_eq!(
        groups.value,
        ncclwasm_default::group_devices(ib, &ports[..4])
    );
    let vnic = host.make_vnic(&[0, 1], &ports[..2]).unwrap();
    invalid(&vnic.source, "not requested");
    assert_eq!(vnic.value, builtin_vnic(&host, &[0, 1], &ports[..2]));
    let conn = connection(&ports[0], 3);
    let plan = host.plan_connection(&conn).unwrap();
    invalid(&plan.source, "0 QPs");
    assert_eq!(plan.value, ncclwasm_default::plan_connection(ib, &conn));
    assert!(logged().contains("hostile-out-of-range@1 failed in select-devices: invalid answer"));

    for (case, needle) in [
        ("weight0", "weight 0"),
        ("align3", "power of two"),
        ("timeout0", "timeout 0"),
    ] {
        let host = host_with("hostile-out-of-range", FailureMode::Open, Some(case));
        invalid(
            &host
                .plan_connection(&connection(&ports[0], 3))
                .unwrap()
                .source,
            needle,
        );
    }

    let host = host_with(
        "hostile-out-of-range",
        FailureMode::Open,
        Some("virt-plane"),
    );
    let devices = host.select_devices(&ports).unwrap();
    invalid(&devices.source, "plane 16384 is outside 0..=16383");
    assert_eq!(devices.value, ncclwasm_default::select_devices(ib, &ports));

    let closed = host_with("hostile-out-of-range", FailureMode::Closed, None);
    failed(
        closed.select_devices(&ports),
        Hook::SelectDevices,
        FailureCause::InvalidAnswer,
    );
    failed(
        closed.select_gid(&ports[0]),
        Hook::SelectGid,
        FailureCause::InvalidAnswer,
    );
    failed(
        closed.make_vnic(&[0, 1], &ports[..2]),
        Hook::MakeVnic,
        FailureCause::InvalidAnswer,
    );
    failed(
        closed.plan_connection(&connection(&ports[0], 3)),
        Hook::PlanConnection,
        FailureCause::InvalidAnswer,
    );
}

#[test]
fn a_port_answer_naming_a_port_the_vnic_lacks_is_refused() {
    capture_logs();
    let ports = ports();
    let mut conn = connection(&ports[0], 3);
    conn.local.push(ports[1].endpoint(3));
    let qps = [0, 1].map(|local| QpPlan {
        local,
        remote: 0,
        weight: 1,
    });
    let down = PortEvent {
        port: 0,
        change: PortChange::Down,
        cause: PortEventCause::AsyncEvent,
    };
    let states = [PortState::Down, PortState::Active];
    // Open: the built-in default decides (NCCL's: failover off, the connection fails).
    let host = host_with("hostile-out-of-range", FailureMode::Open, None);
    let d = host.on_port_event(&down, &conn, &qps, &states).unwrap();
    let (cause, detail) = fallback(&d.source);
    assert_eq!(cause, FailureCause::InvalidAnswer);
    assert!(detail.contains("move-to names port 99"), "{detail}");
    assert!(matches!(d.value, PortAnswer::Fail { .. }), "{:?}", d.value);
    assert!(logged().contains("hostile-out-of-range@1 failed in on-port-event: invalid answer"));
    // Closed: the call fails, so the transport fails the connection cleanly.
    let closed = host_with("hostile-out-of-range", FailureMode::Closed, None);
    failed(
        closed.on_port_event(&down, &conn, &qps, &states),
        Hook::OnPortEvent,
        FailureCause::InvalidAnswer,
    );
    // A policy that does not declare the hook is never asked.
    let quiet = host_with("weighted-stripe", FailureMode::Closed, None);
    let d = quiet.on_port_event(&down, &conn, &qps, &states).unwrap();
    assert!(
        matches!(d.source, Source::NotImplemented(_)),
        "{}",
        d.source
    );
}

#[test]
fn contradictory_answers_are_refused() {
    capture_logs();
    let ports = ports();
    let host = host_with("hostile-contradictory", FailureMode::Open, None);
    let invalid = |source: &Source, needle: &str| {
        let (cause, detail) = fallback(source);
        assert_eq!(cause, FailureCause::InvalidAnswer, "{detail}");
        assert!(
            detail.contains(needle),
            "{detail:?} should mention {needle:?}"
        );
    };
    invalid(&host.select_devices(&ports).unwrap().source, "twice");
    invalid(
        &host.group_devices(&ports[..6]).unwrap().source,
        "mixes link layers",
    );
    invalid(
        &host
            .plan_connection(&connection(&ports[0], 3))
            .unwrap()
            .source,
        "stripe width 2",
    );
    // Hooks it has no opinion on are unaffected: the built-in default answers them.
    let gid = host.select_gid(&ports[0]).unwrap();
    assert!(matches!(gid.source, Source::NoOpinion(_)), "{}", gid.source);
    assert_eq!(
        gid.value,
        ncclwasm_default::select_gid(host.ib_config(), &ports[0])
    );
    assert_eq!(gid.value.index, 3, "RoCEv2 IPv4: {}", gid.value.reason);
    let vnic = host.make_vnic(&[0, 1], &ports[..2]).unwrap();
    assert!(
        matches!(vnic.source, Source::NoOpinion(_)),
        "{}",
        vnic.source
    );
    assert_eq!(vnic.value, builtin_vnic(&host, &[0, 1], &ports[..2]));
    assert!(
        matches!(vnic.value, VnicAnswer::Accept { .. }),
        "two active RoCE ports fuse: {:?}",
        vnic.value
    );

    let overlap = host_with("hostile-contradictory", FailureMode::Open, Some("overlap"));
    invalid(
        &overlap.group_devices(&ports[..4]).unwrap().source,
        "earlier group",
    );

    let closed = host_with("hostile-contradictory", FailureMode::Closed, None);
    failed(
        closed.group_devices(&ports[..6]),
        Hook::GroupDevices,
        FailureCause::InvalidAnswer,
    );
    failed(
        closed.plan_connection(&connection(&ports[0], 3)),
        Hook::PlanConnection,
        FailureCause::InvalidAnswer,
    );
}
