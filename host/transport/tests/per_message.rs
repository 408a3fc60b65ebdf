//! What one message costs the plugin itself: no heap allocation on the thread that calls
//! `isend`/`irecv`/`test` (a counting global allocator watches it), and exactly the work
//! requests `net_ib.cc` posts for the same message.
//!
//! Each case runs on the soft fabric in process: one QP (device 0), two QPs striped (the
//! fused device of ports 0 and 1: one QP per port, every message over both), and a
//! multi-receive of two buffers. The soft fabric's in-process delivery (what the per-message
//! bench runs on) is checked here too, in a child process since it is a process-wide choice.

mod common;

use common::*;
use ncclwasm_soft::Delivery;
use ncclwasm_soft::alloc_count::{CountingAlloc, allocations};
use ncclwasm_transport::{Net, RecvBuf, RecvComm, SendComm};
use ncclwasm_verbs::Posted;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Bytes per message.
const SIZE: u64 = 8;
/// Messages before counting: every FIFO slot and request slot used twice, every queue of the
/// soft fabric grown to its working size, the inline buffers of a full CTS signalling interval
/// handed back.
const WARM_UP: usize = 600;
/// Messages counted.
const MESSAGES: usize = 1000;

/// One connection and its buffers.
struct Case {
    s: SendComm,
    r: RecvComm,
    b: Bufs,
}

impl Case {
    fn new(net: &Net, dev: i64) -> Case {
        let (s, r) = connect(net, dev, dev);
        let b = bufs(&s, &r);
        Case { s, r, b }
    }

    /// One matched message of `recvs` grouped buffers (8 bytes each): `irecv`, an `isend` per
    /// buffer, then `test` until both sides are done. Allocates nothing itself.
    fn message(&self, recvs: usize) {
        let b = &self.b;
        let buf = |i: usize| RecvBuf {
            addr: b.recv.addr() + 64 * i as u64,
            size: SIZE,
            tag: i as u32,
            mr: Some(&b.rmr),
        };
        let bufs = [buf(0), buf(1)];
        let rreq = self.r.irecv(&bufs[..recvs]).unwrap();
        let mut sreqs = [None; 2];
        for (i, s) in sreqs.iter_mut().enumerate().take(recvs) {
            *s = Some(isend(
                &self.s,
                b.send.addr() + 64 * i as u64,
                SIZE,
                i as u32,
                &b.smr,
            ));
        }
        for s in sreqs.into_iter().flatten() {
            assert_eq!(wait_send(&self.s, s), SIZE);
        }
        let (n, sizes) = wait_recv(&self.r, rreq);
        assert_eq!(n, recvs);
        assert!(sizes[..n].iter().all(|&s| s == SIZE), "{sizes:?}");
    }

    /// Work requests posted by the sender and by the receiver, over every QP of the plan.
    fn posted(&self) -> (Posted, Posted) {
        let sum = |v: Vec<Posted>| {
            v.iter().fold(Posted::default(), |a, p| Posted {
                sends: a.sends + p.sends,
                send_bytes: a.send_bytes + p.send_bytes,
                recvs: a.recvs + p.recvs,
            })
        };
        (sum(self.s.work_requests()), sum(self.r.work_requests()))
    }
}

/// Proves the allocator counts at all, so a zero below means something.
#[test]
fn the_counting_allocator_counts_this_thread() {
    let (_, n) = allocations(|| std::hint::black_box(Vec::<u8>::with_capacity(16)));
    assert_eq!(n, 1);
    let (_, n) = allocations(|| std::thread::spawn(|| vec![0u8; 16]).join().unwrap());
    assert!(n >= 1, "spawning allocates on this thread");
}

#[test]
fn a_message_allocates_nothing_on_the_calling_thread() {
    let net = net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    for (name, dev, recvs) in [
        ("one QP", 0, 1),
        ("two QPs striped", fused, 1),
        ("multi-receive of 2", 0, 2),
    ] {
        let c = Case::new(&net, dev);
        for _ in 0..WARM_UP {
            c.message(recvs);
        }
        let ((), n) = allocations(|| {
            for _ in 0..MESSAGES {
                c.message(recvs);
            }
        });
        assert_eq!(
            n, 0,
            "{name}: {n} allocations on the calling thread in {MESSAGES} messages"
        );
    }
}

/// The reference's work requests per message (`net_ib.cc`), which ours must equal:
/// - sender, `ncclIbMultiSend`: on each of the `nqps` QPs of the message, one RDMA WRITE per
///   grouped receive, the last of them made the WRITE_WITH_IMM — plus, for a multi-receive, one
///   more WRITE_WITH_IMM carrying the sizes (no adaptive routing here);
/// - receiver, `ncclIbIrecv`: one receive WR per QP of the message, and `ncclIbPostFifo`: one
///   RDMA WRITE of the CTS entries on one QP.
fn reference(nqps: u64, recvs: u64) -> (Posted, Posted) {
    let per_qp = if recvs > 1 { recvs + 1 } else { 1 };
    (
        Posted {
            sends: nqps * per_qp,
            ..Posted::default()
        },
        Posted {
            sends: 1,
            recvs: nqps,
            ..Posted::default()
        },
    )
}

#[test]
fn work_requests_per_message_are_the_references() {
    let net = net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    for (name, dev, nqps, recvs) in [
        ("8 B on one QP", 0, 1, 1),
        ("8 B striped over two QPs", fused, 2, 1),
        ("multi-receive of 2 on one QP", 0, 1, 2),
    ] {
        let c = Case::new(&net, dev);
        let plan = c.s.plan();
        assert_eq!(
            (plan.qps.len(), plan.stripe_width),
            (nqps as usize, nqps as u32),
            "{name}: {plan:?}"
        );
        let (s0, r0) = c.posted();
        const N: u64 = 300;
        for _ in 0..N {
            c.message(recvs as usize);
        }
        let (s1, r1) = c.posted();
        // Work requests only: their bytes are the telemetry's (`telemetry.rs`).
        let per = |a: Posted, b: Posted| Posted {
            sends: (b.sends - a.sends) / N,
            recvs: (b.recvs - a.recvs) / N,
            ..Posted::default()
        };
        let exact = |a: Posted, b: Posted| {
            (b.sends - a.sends).is_multiple_of(N) && (b.recvs - a.recvs).is_multiple_of(N)
        };
        assert!(exact(s0, s1) && exact(r0, r1), "{name}: uneven counts");
        assert_eq!(
            (per(s0, s1), per(r0, r1)),
            reference(nqps, recvs),
            "{name}: (sender, receiver) work requests per message"
        );
    }
}

/// In-process delivery moves every size as TCP does (byte for byte, truncation included), on
/// one QP and striped over two, and allocates nothing per message either.
#[test]
fn in_process_delivery_carries_the_same_messages() {
    if ncclwasm_testkit::child::rerun_with_env("in_process_delivery_carries_the_same_messages", &[])
    {
        return;
    }
    ncclwasm_soft::set_delivery(Delivery::InProcess);
    let net = net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    for dev in [0, fused] {
        let c = Case::new(&net, dev);
        sizes_suite(&c.s, &c.r, &c.b);
        for _ in 0..WARM_UP {
            c.message(2);
        }
        let ((), n) = allocations(|| {
            for _ in 0..MESSAGES {
                c.message(2);
            }
        });
        assert_eq!(n, 0, "device {dev}: {n} allocations in {MESSAGES} messages");
    }
}
