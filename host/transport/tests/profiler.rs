//! NCCL's profiler sees the data path as net_ib's `NET_PROFILER` build shows it: one QP event
//! per request and QP its data goes over, started before the post under NCCL's parent handle
//! and stopped when `test` finds the request done; none for a request without a parent; and
//! this plugin's decision events (the plan, a failover move, a fail-back, a hold and its
//! resume) under the next profiled send.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::*;
use ncclwasm_transport::profile::{
    DecisionEvent, DecisionKind, Profiler, QpEvent, WC_RECV_RDMA_WITH_IMM, WR_RDMA_WRITE_WITH_IMM,
};
use ncclwasm_transport::{Net, RecvBuf, RecvComm, SendComm};

/// What the recording profiler was told, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Start {
        parent: usize,
        handle: usize,
        event: QpEvent,
    },
    Stop(usize),
    Decision {
        parent: usize,
        kind: DecisionKind,
        qps: u32,
        moves: u32,
        fail_backs: u32,
    },
}

#[derive(Debug, Default)]
struct Recorder {
    seen: Mutex<Vec<Seen>>,
    next: AtomicUsize,
}

impl Recorder {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

impl Profiler for Recorder {
    fn start_qp(&self, parent: usize, event: &QpEvent) -> usize {
        let handle = 0x10_000 + self.next.fetch_add(1, Ordering::Relaxed);
        self.seen.lock().unwrap().push(Seen::Start {
            parent,
            handle,
            event: *event,
        });
        handle
    }

    fn stop(&self, handle: usize) {
        self.seen.lock().unwrap().push(Seen::Stop(handle));
    }

    fn decision(&self, parent: usize, e: &DecisionEvent<'_>) {
        assert!(!e.source.is_empty());
        self.seen.lock().unwrap().push(Seen::Decision {
            parent,
            kind: e.kind,
            qps: e.qps,
            moves: e.moves,
            fail_backs: e.fail_backs,
        });
    }
}

const SEND_PARENT: usize = 0xa000;
const RECV_PARENT: usize = 0xb000;

/// One message of `size` bytes, each side profiled under its parent (0: none).
fn message(s: &SendComm, r: &RecvComm, b: &Bufs, size: u64, parents: (usize, usize)) {
    let rreq = r
        .irecv_profiled(
            &[RecvBuf {
                addr: b.recv.addr(),
                size,
                tag: 1,
                mr: Some(&b.rmr),
            }],
            &[parents.1],
        )
        .unwrap();
    let end = deadline();
    let sreq = loop {
        if let Some(q) = s
            .isend_profiled(b.send.addr(), size, 1, Some(&b.smr), parents.0)
            .unwrap()
        {
            break q;
        }
        // As NCCL's proxy tests its posted receives: a held connection needs the receiver's
        // progress to re-create its QPs.
        assert!(r.test(rreq).unwrap().is_none(), "received before sent");
        assert!(Instant::now() < end, "isend never matched");
    };
    assert_eq!(wait_send(s, sreq), size);
    assert_eq!(wait_recv(r, rreq).1[0], size);
}

/// A connection over the fused device of the soft fabric's two ports (2 QPs, striped), made
/// after a recording profiler was set, and its buffers. The context comes back too: its async
/// event thread, which fail-back needs, lives as long as it.
fn profiled() -> (Net, Arc<Recorder>, SendComm, RecvComm, Bufs) {
    let net = net();
    let rec = Arc::new(Recorder::default());
    net.set_profiler(rec.clone());
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (s, r) = connect(&net, v, v);
    let b = bufs(&s, &r);
    (net, rec, s, r, b)
}

/// Every started event stopped exactly once, after its start.
fn balanced(seen: &[Seen]) {
    for (i, s) in seen.iter().enumerate() {
        if let Seen::Start { handle, .. } = s {
            let stops: Vec<usize> = (0..seen.len())
                .filter(|&j| seen[j] == Seen::Stop(*handle))
                .collect();
            assert!(stops.len() == 1 && stops[0] > i, "{handle:#x}: {seen:?}");
        }
    }
}

#[test]
fn a_striped_message_has_one_qp_event_per_qp_on_each_side() {
    let (_net, rec, s, r, b) = profiled();
    let plan = s.plan().clone();
    assert_eq!((plan.qps.len(), plan.stripe_width), (2, 2), "{plan:?}");

    // NCCL's bootstrap traffic has no parent: nothing is recorded.
    message(&s, &r, &b, 64 << 10, (0, 0));
    assert_eq!(rec.take(), []);

    message(&s, &r, &b, 64 << 10, (SEND_PARENT, RECV_PARENT));
    let seen = rec.take();
    balanced(&seen);
    // The plan, under the send's parent, before the send's events; one event per QP on each
    // side.
    let plan = seen
        .iter()
        .position(|s| matches!(s, Seen::Decision { .. }))
        .expect("the plan's event");
    assert_eq!(
        seen[plan],
        Seen::Decision {
            parent: SEND_PARENT,
            kind: DecisionKind::Plan,
            qps: 2,
            moves: 0,
            fail_backs: 0
        }
    );
    assert!(
        !seen[..plan].iter().any(|s| matches!(
            s,
            Seen::Start {
                parent: SEND_PARENT,
                ..
            }
        )),
        "{seen:?}"
    );
    let starts = |parent: usize| -> Vec<QpEvent> {
        seen.iter()
            .filter_map(|s| match s {
                Seen::Start {
                    parent: p, event, ..
                } if *p == parent => Some(*event),
                _ => None,
            })
            .collect()
    };
    let sent = starts(SEND_PARENT);
    assert_eq!(sent.len(), 2, "{seen:?}");
    assert_ne!(sent[0].qpn, sent[1].qpn);
    assert_eq!((sent[0].device, sent[1].device), (0, 1), "{sent:?}");
    assert!(
        sent.iter()
            .all(|e| e.opcode == WR_RDMA_WRITE_WITH_IMM && e.wr_id == sent[0].wr_id)
    );
    assert_eq!(sent.iter().map(|e| e.length).sum::<u64>(), 64 << 10);
    let received = starts(RECV_PARENT);
    assert_eq!(received.len(), 2, "{seen:?}");
    assert!(
        received
            .iter()
            .all(|e| e.opcode == WC_RECV_RDMA_WITH_IMM && e.length == 64 << 10)
    );

    // The plan is reported once.
    message(&s, &r, &b, 8, (SEND_PARENT, 0));
    let seen = rec.take();
    balanced(&seen);
    assert!(
        seen.iter().all(|s| !matches!(s, Seen::Decision { .. })),
        "{seen:?}"
    );
    // 8 bytes fill one QP's stripe: the other QP carries none of them, and has no event.
    assert_eq!(seen.len(), 2, "a start and a stop: {seen:?}");
}

/// A port goes down and comes back on a connection prepared for failover: the next profiled
/// send reports the plan, the move and the fail-back, in that order, with the counts so far.
#[test]
fn a_failover_and_its_fail_back_are_reported_to_the_profiler() {
    let vars = [
        ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1"),
        ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
    ];
    if ncclwasm_testkit::child::rerun_with_env(
        "a_failover_and_its_fail_back_are_reported_to_the_profiler",
        &vars,
    ) {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let (_net, rec, s, r, b) = profiled();
    let first = s.stats().local[0].device.clone();
    let dev = ncclwasm_soft::fabric().unwrap().open(&first).unwrap();
    let counters = || s.stats().failover.expect("prepared for failover");
    assert!(dev.inject_port_down(1).unwrap());
    let end = deadline();
    while counters().moves == 0 {
        message(&s, &r, &b, 4096, (0, 0));
        assert!(Instant::now() < end, "no move:\n{}", logged());
    }
    assert!(dev.inject_port_up(1).unwrap());
    while counters().fail_backs == 0 {
        message(&s, &r, &b, 4096, (0, 0));
        assert!(Instant::now() < end, "no fail-back:\n{}", logged());
    }
    assert_eq!(
        decisions_of_a_profiled_send(&rec, &s, &r, &b),
        [
            (DecisionKind::Plan, 1, 1),
            (DecisionKind::FailoverMove, 1, 1),
            (DecisionKind::FailBack, 1, 1)
        ]
    );
}

/// The same under a policy that holds the failed port (rail-aligned with `wait-ms`): the plan,
/// the hold and the resume, with no move or fail-back counted.
#[test]
fn a_held_port_and_its_resume_are_reported_to_the_profiler() {
    let policy = ncclwasm_testkit::guest("rail-aligned");
    let vars = [
        ("NCCL_WASM_POLICY", policy.to_str().expect("a UTF-8 path")),
        ("NCCL_WASM_POLICY_CONFIG", "wait-ms=10000"),
    ];
    if ncclwasm_testkit::child::rerun_with_env(
        "a_held_port_and_its_resume_are_reported_to_the_profiler",
        &vars,
    ) {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let (_net, rec, s, r, b) = profiled();
    let first = s.stats().local[0].device.clone();
    let dev = ncclwasm_soft::fabric().unwrap().open(&first).unwrap();
    assert!(dev.inject_port_down(1).unwrap());
    // Back while the next message is held.
    let up = ports_up_later(vec![dev], std::time::Duration::from_millis(300));
    let end = deadline();
    while s.stats().failover.expect("prepared").resumes == 0 {
        message(&s, &r, &b, 4096, (0, 0));
        assert!(Instant::now() < end, "no resume:\n{}", logged());
    }
    up.join().unwrap();
    assert_eq!(
        decisions_of_a_profiled_send(&rec, &s, &r, &b),
        [
            (DecisionKind::Plan, 0, 0),
            (DecisionKind::Wait, 0, 0),
            (DecisionKind::Resume, 0, 0)
        ]
    );
}

/// The decision events a profiled send reports (kind, moves, fail-backs), when nothing was
/// profiled before it.
fn decisions_of_a_profiled_send(
    rec: &Recorder,
    s: &SendComm,
    r: &RecvComm,
    b: &Bufs,
) -> Vec<(DecisionKind, u32, u32)> {
    assert_eq!(rec.take(), [], "nothing profiled yet");
    message(s, r, b, 4096, (SEND_PARENT, 0));
    rec.take()
        .into_iter()
        .filter_map(|s| match s {
            Seen::Decision {
                parent,
                kind,
                moves,
                fail_backs,
                ..
            } => {
                assert_eq!(parent, SEND_PARENT);
                Some((kind, moves, fail_backs))
            }
            _ => None,
        })
        .collect()
}
