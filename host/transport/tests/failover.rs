//! Rail failover end to end on the soft fabric: a fused two-port device carries a stream of
//! messages, one port goes down in the middle (the soft fabric's fault injection: every QP on the
//! port fails, on both ends), and what the policy answers is carried out. Every message's bytes
//! are checked, and each receive must complete exactly once.
//!
//! Each test runs in a child process with its own settings (`rerun_with_env`), so a port taken
//! down never leaks into another test.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ncclwasm_model::{PortAnswer, PortChange, PortState};
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{ErrorClass, NetError, RecvBuf, RecvComm, ReqId, SendComm};
use ncclwasm_verbs::{Context, DmaBuf};

/// Messages in the stream, and how many are in flight at once.
const MESSAGES: usize = 96;
const IN_FLIGHT: usize = 8;
/// Each in-flight message lands in its own region of the receive buffer.
const REGION: usize = 24 * MIB;

/// A second context on soft device `name`: fault injection acts on the device, so every
/// connection on it sees the port go down.
fn device(name: &str) -> std::sync::Arc<Context> {
    ncclwasm_soft::fabric()
        .expect("soft fabric")
        .open(name)
        .expect("a context on the device")
}

/// Message `k`: (send offset, size), sizes from 1 byte to 1 MiB, and every fifth 20 MiB (large
/// enough that a slice of it goes over each port).
fn shape(k: usize) -> (usize, usize) {
    let size = if k % 5 == 4 {
        20 * MIB + k
    } else {
        (k * 7919 + k * k * 131) % MIB + 1
    };
    ((k * 4099) % (8 * MIB), size)
}

/// A send buffer with the usual pattern and a receive buffer with a region per message in
/// flight.
fn buffers(s: &SendComm, r: &RecvComm) -> Bufs {
    let send = DmaBuf::new(BUF);
    let recv = DmaBuf::new(IN_FLIGHT * REGION);
    pattern(&send, 7);
    Bufs {
        smr: s.reg_mr(send.addr(), BUF as u64, &send).unwrap(),
        rmr: r.reg_mr(recv.addr(), recv.len() as u64, &recv).unwrap(),
        send,
        recv,
    }
}

/// The first logged line containing every one of `parts`.
fn log_line(parts: &[&str]) -> String {
    let log = logged();
    log.lines()
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .unwrap_or_else(|| panic!("no line with {parts:?} in the log:\n{log}"))
        .to_owned()
}

/// Reruns `test` in a child process with `vars` (and guest `policy`'s path as
/// `NCCL_WASM_POLICY`); in the child, returns a context and a connection over a device fused
/// of both soft ports, with INFO logs captured.
fn fused_in_child(
    test: &str,
    policy: Option<&str>,
    vars: &[(&str, &str)],
) -> Option<(ncclwasm_transport::Net, SendComm, RecvComm)> {
    let path = policy.map(|p| ncclwasm_testkit::guest(p).to_string_lossy().into_owned());
    let mut all = vars.to_vec();
    all.extend(path.as_deref().map(|p| ("NCCL_WASM_POLICY", p)));
    if ncclwasm_testkit::child::rerun_with_env(test, &all) {
        return None;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let net = net();
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (s, r) = connect(&net, v, v);
    Some((net, s, r))
}

/// A whole stream goes through, and every QP of port 0 carries part of it (after `what`
/// re-created them).
fn port_0_carries_a_stream(s: &SendComm, r: &RecvComm, b: &Bufs, what: &str) {
    let before = s.stats().posted;
    assert_eq!(stream(s, r, b, |_| ()).expect("no request fails"), MESSAGES);
    let stats = s.stats();
    for (q, qp) in stats.plan.qps.iter().enumerate() {
        if qp.local == 0 {
            assert!(
                stats.posted[q] > before[q],
                "QP {q} carries nothing after the {what}"
            );
        }
    }
}

/// Streams as [`stream`] does, taking the first port of the fused device down once, with a
/// large message certainly in flight on it: before the first large message past a third of
/// the stream is sent, the receiver's QPs on that port stop answering (a stalled responder:
/// nothing written on them is placed or acknowledged); once the message was posted, with a
/// slice of it on the port, the port goes down and the stall ends (the failed QPs discard what
/// they held). `failed` is called then, with the bytes posted on each QP so far.
fn stream_losing_port_0(
    s: &SendComm,
    r: &RecvComm,
    b: &Bufs,
    mut failed: impl FnMut(&[u64]),
) -> Result<usize, NetError> {
    let first = s.stats().local[0].device.clone();
    let dev = device(&first);
    let on_port_0: Vec<usize> = (0..s.plan().qps.len())
        .filter(|&q| s.plan().qps[q].local == 0)
        .collect();
    assert!(!on_port_0.is_empty(), "no QP on port 0: {:?}", s.plan());
    let large = (MESSAGES / 3..MESSAGES)
        .find(|&k| shape(k).1 > 8 * MIB)
        .expect("a large message past a third of the stream");
    // Long enough never to end on its own: the port goes down while it lasts.
    let stall = Duration::from_secs(3600);
    // What each QP carried before the large message.
    let before = std::cell::RefCell::new(Vec::new());
    stream_with(
        s,
        r,
        b,
        |k| {
            if k == large {
                *before.borrow_mut() = s.stats().posted;
                for &q in &on_port_0 {
                    r.inject_stall(q, stall).unwrap();
                }
            }
        },
        |k| {
            if k != large {
                return;
            }
            let posted = s.stats().posted;
            let before = before.borrow();
            assert!(
                on_port_0
                    .iter()
                    .any(|&q| posted[q] >= before[q] + (8 * MIB) as u64),
                "no slice of message {k} on port 0: {before:?} then {posted:?}"
            );
            assert!(dev.inject_port_down(1).unwrap(), "{first} port 1 went down");
            for &q in &on_port_0 {
                r.inject_stall(q, Duration::ZERO).unwrap();
            }
            failed(&posted);
        },
    )
}

/// Streams until the connection fails, taking the first port of its fused device down for
/// good a third of the way in: the error, and how long after the failure it came.
fn port_down_for_good(s: &SendComm, r: &RecvComm) -> (NetError, Duration) {
    let dev = device(&s.stats().local[0].device);
    let b = buffers(s, r);
    let mut started = None;
    let err = stream(s, r, &b, |k| {
        if k == MESSAGES / 3 {
            started = Some(Instant::now());
            dev.inject_port_down(1).unwrap();
        }
    })
    .expect_err("a port that stays down fails the connection");
    (err, started.expect("the port went down").elapsed())
}

/// The receive side of one in-flight message.
struct Pending {
    k: usize,
    /// Its region of the receive buffer.
    region: usize,
    recv: ReqId,
    send: ReqId,
    send_done: bool,
}

/// Streams `MESSAGES` messages, `IN_FLIGHT` at a time, calling `at(k)` after message `k` was
/// posted. Returns the first error of any call, after checking every completed message.
fn stream(s: &SendComm, r: &RecvComm, b: &Bufs, at: impl FnMut(usize)) -> Result<usize, NetError> {
    stream_with(s, r, b, |_| (), at)
}

/// [`stream`], calling `before(k)` too: once message `k`'s receive is posted and nothing else
/// is waited for before its send.
fn stream_with(
    s: &SendComm,
    r: &RecvComm,
    b: &Bufs,
    mut before: impl FnMut(usize),
    mut at: impl FnMut(usize),
) -> Result<usize, NetError> {
    let mut pending: Vec<Pending> = Vec::new();
    let mut free: Vec<usize> = (0..IN_FLIGHT).map(|i| i * REGION).collect();
    let mut done = 0;
    let end = Instant::now() + Duration::from_secs(60);
    let retire = |p: &mut Pending| -> Result<bool, NetError> {
        if !p.send_done {
            p.send_done = s.test(p.send)?.is_some();
        }
        let Some(d) = r.test(p.recv)? else {
            return Ok(false);
        };
        let (off, size) = shape(p.k);
        let region = p.region;
        assert_eq!(
            d,
            ncclwasm_transport::Done::Recv {
                n: 1,
                sizes: [size as u64, 0, 0, 0, 0, 0, 0, 0]
            },
            "message {}",
            p.k
        );
        let mut got = vec![0u8; size + 1];
        b.recv.read(region, &mut got);
        let mut want = vec![0u8; size];
        b.send.read(off, &mut want);
        assert!(got[..size] == want[..], "message {} arrived altered", p.k);
        assert_eq!(got[size], 0xee, "message {} wrote past its size", p.k);
        b.recv.write(region, &vec![0xee; size + 1]);
        // A receive completes once: its request is free now.
        assert!(
            r.test(p.recv).is_err(),
            "message {} completed a second time",
            p.k
        );
        Ok(true)
    };
    // Retires every pending message that completed; its region is free again.
    let sweep = |pending: &mut Vec<Pending>,
                 free: &mut Vec<usize>,
                 done: &mut usize|
     -> Result<(), NetError> {
        let mut i = 0;
        while i < pending.len() {
            if retire(&mut pending[i])? {
                let p = pending.remove(i);
                while !p.send_done && s.test(p.send)?.is_none() {
                    assert!(Instant::now() < end, "send of {} never completed", p.k);
                }
                free.push(p.region);
                *done += 1;
            } else {
                i += 1;
            }
        }
        Ok(())
    };
    b.recv.fill(0xee);
    for k in 0..MESSAGES {
        while pending.len() == IN_FLIGHT {
            sweep(&mut pending, &mut free, &mut done)?;
            assert!(Instant::now() < end, "the stream stalled at message {k}");
        }
        let (off, size) = shape(k);
        let region = free.pop().expect("a free region");
        let recv = r.irecv(&[RecvBuf {
            addr: b.recv.addr() + region as u64,
            size: REGION as u64 - 1,
            tag: 3,
            mr: Some(&b.rmr),
        }])?;
        before(k);
        let send = loop {
            if let Some(req) = s.isend(b.send.addr() + off as u64, size as u64, 3, Some(&b.smr))? {
                break req;
            }
            for p in &mut pending {
                if !p.send_done {
                    p.send_done = s.test(p.send)?.is_some();
                }
            }
            // As NCCL's proxy tests its posted receives: a held connection needs the
            // receiver's progress to re-create its QPs.
            assert!(
                r.test(recv)?.is_none(),
                "message {k} arrived before it was sent"
            );
            assert!(Instant::now() < end, "isend of {k} never matched");
        };
        pending.push(Pending {
            k,
            region,
            recv,
            send,
            send_done: false,
        });
        at(k);
    }
    while !pending.is_empty() {
        sweep(&mut pending, &mut free, &mut done)?;
        assert!(Instant::now() < end, "the stream never drained");
    }
    Ok(done)
}

/// NCCL 2.30's knobs through the built-in default: the port's traffic moves to the other port
/// of the vNIC, and comes back when the port does.
#[test]
fn a_port_down_mid_transfer_moves_its_traffic_and_loses_nothing() {
    let vars = [
        ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1"),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    let test = "a_port_down_mid_transfer_moves_its_traffic_and_loses_nothing";
    let Some((net, s, r)) = fused_in_child(test, None, &vars) else {
        return;
    };
    let stats = s.stats();
    prepared_over_both_ports(&stats);
    let first = stats.local[0].device.clone();
    drop(stats);
    let dev = device(&first);
    let b = buffers(&s, &r);
    let mut posted_at_failure = Vec::new();
    // The probe and the replay are exercised, not only the move.
    let done = stream_losing_port_0(&s, &r, &b, |posted| posted_at_failure = posted.to_vec())
        .expect("no request fails");
    assert!(!posted_at_failure.is_empty(), "the port never went down");
    assert_eq!(done, MESSAGES);
    let stats = s.stats();
    let c = stats.failover.unwrap();
    assert_eq!(c.moves, 1, "{c:?}");
    // The large message was in flight on the failed port (its receiver stalled until the port
    // went down): the probe ran, and its slice was written again (or found delivered).
    assert_eq!(c.probes, 1, "{c:?}");
    assert!(c.replayed + c.confirmed >= 1, "{c:?}");
    // After the move only the surviving port's QPs carry new messages; a failed QP's counter
    // grows no more than the slices that were in flight on it at the failure.
    for (q, qp) in stats.plan.qps.iter().enumerate() {
        if qp.local == 0 {
            assert!(
                stats.posted[q] <= posted_at_failure[q] + (IN_FLIGHT * REGION) as u64,
                "QP {q} on the failed port kept carrying: {} then {}",
                posted_at_failure[q],
                stats.posted[q]
            );
        }
    }
    let answer = log_line(&["NET/WASM", "failed (", "move-to"]);
    assert!(
        answer.contains("NCCL_IB_RESILIENCY_PORT_FAILOVER=1"),
        "{answer}"
    );
    log_line(&["failover probe 1"]);
    println!("{answer}");
    println!("{c:?}");

    // The port comes back: the policy answers fail-back, the failed QPs are re-created over
    // the kept handshake socket, and the port carries new messages again.
    assert!(dev.inject_port_up(1).unwrap());
    let end = Instant::now() + Duration::from_secs(20);
    while s.stats().failover.unwrap().fail_backs == 0 {
        small_message(&s, &r);
        assert!(Instant::now() < end, "no fail-back:\n{}", logged());
    }
    port_0_carries_a_stream(&s, &r, &b, "fail-back");
    let back = log_line(&["NET/WASM", "is active again", "fail-back"]);
    assert!(
        back.contains("NCCL_IB_RESILIENCY_PORT_RECOVERY=1"),
        "{back}"
    );
    println!("{back}");

    // What a policy's telemetry says of it: the port's two changes, in order and timed, and
    // the completions its failed QPs flushed in error.
    let t = net.telemetry();
    let port = t
        .ports
        .iter()
        .find(|p| p.device == first && p.port == 1)
        .expect("the failed port in the telemetry");
    let changes: Vec<PortState> = port.changes.iter().map(|c| c.state).collect();
    assert_eq!(changes, [PortState::Down, PortState::Active], "{port:?}");
    assert!(port.changes[0].at_ms <= port.changes[1].at_ms && port.changes[1].at_ms <= t.at_ms);
    assert!(
        !port.errors.is_empty() && port.last_error_ms.is_some(),
        "{port:?}"
    );
    println!("telemetry of {first}:1: {port:?}");
}

/// NCCL's default (`NCCL_IB_RESILIENCY_PORT_FAILOVER=0`) through the shipped nccl-default
/// policy, failing closed: the policy answers `fail`, so the connection is not prepared and a
/// port failure fails it: a clean error from the next call within the fault's own time, never
/// a hang.
#[test]
fn a_policy_that_answers_fail_fails_the_connection_cleanly() {
    let vars = [
        ("NCCL_WASM_POLICY_FAILURE", "closed"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    let test = "a_policy_that_answers_fail_fails_the_connection_cleanly";
    let Some((_net, s, r)) = fused_in_child(test, Some("nccl-default"), &vars) else {
        return;
    };
    assert!(
        s.plan_source().contains("nccl-default"),
        "{}",
        s.plan_source()
    );
    assert!(
        s.stats().failover.is_none(),
        "not prepared: the policy fails"
    );
    let (err, took) = port_down_for_good(&s, &r);
    assert!(
        matches!(err.class(), ErrorClass::System | ErrorClass::Remote),
        "{err}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    println!("{err} (after {took:?})");
}

/// The shipped rail-aligned policy with `wait-ms`: the failed port's traffic is held, not
/// moved; when the port is back in time its QPs are re-created on both ends, what the
/// receiver lacks is written again on them, and the stream goes on with nothing lost or
/// duplicated (`stream` checks every message's bytes and that each receive completes once).
#[test]
fn a_held_port_back_in_time_resumes_and_loses_nothing() {
    let vars = [
        ("NCCL_WASM_POLICY_CONFIG", "wait-ms=10000"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    let test = "a_held_port_back_in_time_resumes_and_loses_nothing";
    let Some((_net, s, r)) = fused_in_child(test, Some("rail-aligned"), &vars) else {
        return;
    };
    prepared_over_both_ports(&s.stats());
    let dev = device(&s.stats().local[0].device);
    let b = buffers(&s, &r);
    let mut back = None;
    // Up again 300 ms after it went down, from another thread, while the stream is held.
    let done = stream_losing_port_0(&s, &r, &b, |_| {
        back = Some(ports_up_later(
            vec![Arc::clone(&dev)],
            Duration::from_millis(300),
        ));
    })
    .unwrap_or_else(|e| panic!("no request fails: {e}\n{}", logged()));
    back.expect("the port never went down").join().unwrap();
    assert_eq!(done, MESSAGES);
    let c = s.stats().failover.unwrap();
    // A slice was in flight on the port when it failed (`stream_losing_port_0` stalls its
    // receiver until then); the proto test `a_held_port_resumes_on_its_own_qps_and_loses_nothing`
    // pins the replay.
    assert_eq!((c.moves, c.waits, c.resumes), (0, 1, 1), "{c:?}");
    let held = log_line(&["NET/WASM", "failed (", "wait"]);
    assert!(held.contains("rail-aligned"), "{held}");
    log_line(&["new messages wait up to 10000 ms"]);
    let resumed = log_line(&["held port", "is back after"]);
    println!("{held}\n{resumed}\n{c:?}");
    port_0_carries_a_stream(&s, &r, &b, "resume");
}

/// The same policy when the port stays down: the connection fails once the policy's time is
/// up, with its reason, never before and never a hang.
#[test]
fn a_held_port_that_stays_down_fails_with_the_policys_reason() {
    let vars = [
        ("NCCL_WASM_POLICY_CONFIG", "wait-ms=400"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    let test = "a_held_port_that_stays_down_fails_with_the_policys_reason";
    let Some((_net, s, r)) = fused_in_child(test, Some("rail-aligned"), &vars) else {
        return;
    };
    prepared_over_both_ports(&s.stats());
    let (err, took) = port_down_for_good(&s, &r);
    let text = err.to_string();
    assert!(
        matches!(err, NetError::PortFailed { .. })
            && text.contains("did not come back within the 400 ms")
            && text.contains("rail-aligned"),
        "{text}"
    );
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert_eq!(
        s.stats().failover.map(|c| (c.waits, c.resumes)),
        Some((1, 0))
    );
    println!("{err} (after {took:?})");
}

/// A move and a hold on one connection: the test's policy holds port 1 and leaves port 0 to
/// NCCL 2.30's failover and recovery (move to port 1, fail back). Port 0 goes down and its
/// traffic moves; port 1 goes down too and is held, with no QP left to probe over; port 0
/// comes back first — nothing may be asked about it while the connection is held — then port
/// 1: the held port resumes, then port 0 fails back, and every message arrives once, intact.
#[test]
fn a_move_then_a_hold_resumes_and_fails_back() {
    let vars = [
        ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1"),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    if ncclwasm_testkit::child::rerun_with_env("a_move_then_a_hold_resumes_and_fails_back", &vars) {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let overlay = Overlay::new(|e| {
        (e.port == 1 && e.change == PortChange::Down).then(|| PortAnswer::Wait {
            ms: 10_000,
            reason: "port 1 is held".into(),
        })
    });
    let net = overlay.net(OobEnv::default());
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (s, r) = connect(&net, v, v);
    let stats = s.stats();
    prepared_over_both_ports(&stats);
    let devs = [0, 1].map(|p| device(&stats.local[p].device));
    drop(stats);
    let b = buffers(&s, &r);
    let mut back = None;
    let done = stream(&s, &r, &b, |k| {
        if k == MESSAGES / 4 {
            assert!(devs[0].inject_port_down(1).unwrap());
        }
        if k == MESSAGES / 2 {
            assert!(devs[1].inject_port_down(1).unwrap());
            back = Some(ports_up_later(devs.to_vec(), Duration::from_millis(200)));
        }
    })
    .unwrap_or_else(|e| panic!("no request fails: {e}\n{}", logged()));
    back.expect("port 1 went down").join().unwrap();
    assert_eq!(done, MESSAGES);
    let end = Instant::now() + Duration::from_secs(20);
    while s.stats().failover.unwrap().fail_backs == 0 {
        small_message(&s, &r);
        assert!(Instant::now() < end, "no fail-back:\n{}", logged());
    }
    let c = s.stats().failover.unwrap();
    assert_eq!(
        (c.moves, c.waits, c.resumes, c.fail_backs),
        (1, 1, 1, 1),
        "{c:?}"
    );
    println!("{c:?}");
    port_0_carries_a_stream(&s, &r, &b, "fail-back");
}

/// The sender's port fails and comes back while the receiver's ports stay up: a machine of
/// four soft devices, the sender fused over the first two, the receiver over the last two, and
/// only the sender's first device loses its port. The policy holds the port (`wait`); a large
/// message has slices in flight on it, which the receiver's stalled QPs never place. The
/// receiver's QPs then see nothing (RC hardware tells a responder nothing when its requester
/// goes away) and it writes no clear-to-send meanwhile, so nothing of its own fails: only the
/// sender's rejoin on the kept handshake socket tells it of the resume — it must read it at
/// once, fail the QPs it names (which ends their stall, placing nothing) and answer, so the
/// sender can write the lost slices again on the re-created QPs.
#[test]
fn a_receiver_whose_ports_are_up_answers_the_senders_rejoin() {
    let test = "a_receiver_whose_ports_are_up_answers_the_senders_rejoin";
    let scratch = (!in_child()).then(|| ncclwasm_testkit::scratch::Scratch::new("four"));
    let topology = scratch.as_ref().map_or_else(String::new, |s| {
        let devices: String = (0..4)
            .map(|d| {
                format!(
                    "[[devices]]\nname = \"soft_{d}\"\nprovider = \"soft\"\n\
                     guid = \"0x02005e000000010{d}\"\n\n[[devices.ports]]\nport = 1\n\
                     link-layer = \"ethernet\"\nspeed-mbps = 100000\nwidth = 4\nmtu = 4096\n\
                     address = \"127.0.0.1\"\n\n"
                )
            })
            .collect();
        let text = format!("name = \"four\"\n\n{devices}");
        s.write("four.toml", text.as_bytes())
            .to_string_lossy()
            .into_owned()
    });
    let policy = ncclwasm_testkit::guest("rail-aligned");
    let vars = [
        ("NCCL_WASM_TOPOLOGY", topology.as_str()),
        ("NCCL_WASM_POLICY", &*policy.to_string_lossy()),
        ("NCCL_WASM_POLICY_CONFIG", "wait-ms=10000"),
        ("NCCL_IB_QPS_PER_CONNECTION", "2"),
    ];
    if ncclwasm_testkit::child::rerun_with_env(test, &vars) {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let net = net();
    let sdev = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let rdev = i64::from(net.make_vdevice(&[2, 3]).unwrap());
    let (s, r) = connect(&net, sdev, rdev);
    prepared_over_both_ports(&s.stats());
    let b = buffers(&s, &r);
    // Every QP has its connections before the failure.
    port_0_carries_a_stream(&s, &r, &b, "start");
    let on_port_0: Vec<usize> = (0..s.plan().qps.len())
        .filter(|&q| s.plan().qps[q].local == 0)
        .collect();
    let size = 20 * MIB;
    let rreq = r
        .irecv(&[RecvBuf {
            addr: b.recv.addr(),
            size: size as u64,
            tag: 1,
            mr: Some(&b.rmr),
        }])
        .unwrap();
    for &q in &on_port_0 {
        r.inject_stall(q, Duration::from_secs(3600)).unwrap();
    }
    let before = s.stats().posted;
    let sreq = isend(&s, b.send.addr(), size as u64, 1, &b.smr);
    let posted = s.stats().posted;
    assert!(
        on_port_0.iter().any(|&q| posted[q] > before[q]),
        "no slice on port 0: {before:?} then {posted:?}"
    );
    let first = s.stats().local[0].device.clone();
    assert_eq!(first, "soft_0");
    let dev = device(&first);
    assert!(dev.inject_port_down(1).unwrap());
    let end = Instant::now() + Duration::from_secs(20);
    while s.stats().failover.unwrap().waits == 0 {
        assert!(
            s.test(sreq).unwrap().is_none(),
            "sent whole with slices lost"
        );
        assert!(
            r.test(rreq).unwrap().is_none(),
            "received whole with slices lost"
        );
        assert!(Instant::now() < end, "the sender never held the port");
    }
    assert!(dev.inject_port_up(1).unwrap());
    let (mut sent, mut received) = (false, false);
    while !(sent && received) {
        sent = sent || s.test(sreq).unwrap().is_some();
        received = received || r.test(rreq).unwrap().is_some();
        assert!(
            Instant::now() < end,
            "the receiver never answered the sender's rejoin:\n{}",
            logged()
        );
    }
    let (mut want, mut got) = (vec![0u8; size], vec![0u8; size]);
    b.send.read(0, &mut want);
    b.recv.read(0, &mut got);
    assert!(got == want, "the message arrived altered");
    let c = s.stats().failover.unwrap();
    assert_eq!((c.waits, c.resumes), (1, 1), "{c:?}");
    log_line(&["NET/WASM", "failed at the sender (its rejoin names it)"]);
    port_0_carries_a_stream(&s, &r, &b, "resume");
}
