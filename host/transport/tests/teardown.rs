//! Closing a connection after every byte arrived never fails a request, whichever side closes
//! first — also when the sender closes as soon as its own sends completed and the receiver
//! tests later (NCCL allows both). On hardware the transport layer acknowledges what it placed
//! and a destroyed QP never fails a peer's acknowledged work; the soft fabric must do the same.

mod common;

use std::time::{Duration, Instant};

use common::{deadline, net};
use ncclwasm_transport::{
    Done, HANDLE_SIZE, Listener, MemHandle, Net, RecvBuf, RecvComm, ReqId, SendComm,
};
use ncclwasm_verbs::DmaBuf;

/// Connections opened, used and closed per run.
const CONNS: usize = 1000;
/// Connections open at once: they close together, as a communicator's do.
const BATCH: usize = 50;
/// Bytes each connection carries: a small (directly sent) and a larger message.
const SIZES: [usize; 2] = [100, 40_000];
/// Room per connection in the receive buffer.
const SLOT: usize = 64 * 1024;

/// Who closes first, and when the receiver looks at its last request.
#[derive(Clone, Copy, Debug)]
enum Order {
    SenderFirst,
    ReceiverFirst,
    /// The sender closes once its sends completed; the receiver tests its last receive only
    /// after the delay.
    SenderFirstReceiverLate(Duration),
}

/// One connection of a batch, with its last receive still untested.
struct Open {
    s: SendComm,
    r: RecvComm,
    smr: MemHandle,
    rmr: MemHandle,
    last: Option<ReqId>,
}

/// Opens one connection through the shared listener (NCCL listens once per connection; reusing
/// the listen comm keeps a thousand connections within the test's time).
fn open(net: &Net, listener: &mut Listener, handle: &[u8; HANDLE_SIZE]) -> (SendComm, RecvComm) {
    // Each connect writes into its copy of the handle (the scratch area), as NCCL's does.
    let mut h = *handle;
    common::connect_through(net, 0, listener, &mut h)
}

/// Sends `size` bytes over `c` into its slot; returns the receive, tested only if `test_recv`.
/// Counts every error `test` returns into `errors`.
fn message(
    c: &Open,
    slot: usize,
    size: usize,
    src: &DmaBuf,
    dst: &DmaBuf,
    test_recv: bool,
    errors: &mut Vec<String>,
) -> Option<ReqId> {
    let rreq =
        c.r.irecv(&[RecvBuf {
            addr: dst.addr() + (slot * SLOT) as u64,
            size: SLOT as u64,
            tag: 3,
            mr: Some(&c.rmr),
        }])
        .expect("irecv");
    let end = deadline();
    let sreq = loop {
        if let Some(q) =
            c.s.isend(src.addr(), size as u64, 3, Some(&c.smr))
                .expect("isend")
        {
            break q;
        }
        assert!(Instant::now() < end, "isend never matched");
    };
    loop {
        match c.s.test(sreq) {
            Ok(Some(Done::Send { size: n })) => {
                assert_eq!(n, size as u64);
                break;
            }
            Ok(Some(other)) => panic!("send finished as {other:?}"),
            Ok(None) => assert!(Instant::now() < end, "send never completed"),
            Err(e) => {
                errors.push(format!("send test: {e}"));
                return None;
            }
        }
    }
    if !test_recv {
        return Some(rreq);
    }
    wait_recv(&c.r, rreq, slot, size, dst, errors);
    None
}

/// Spins on a receive until it is done (checking its size and bytes) or fails.
fn wait_recv(
    r: &RecvComm,
    req: ReqId,
    slot: usize,
    size: usize,
    dst: &DmaBuf,
    errors: &mut Vec<String>,
) {
    let end = deadline();
    loop {
        match r.test(req) {
            Ok(Some(Done::Recv { n, sizes })) => {
                assert_eq!((n, sizes[0]), (1, size as u64));
                let mut got = vec![0u8; size];
                dst.read(slot * SLOT, &mut got);
                assert!(
                    got.iter().enumerate().all(|(i, &b)| b == i as u8),
                    "payload differs"
                );
                return;
            }
            Ok(Some(other)) => panic!("receive finished as {other:?}"),
            Ok(None) => assert!(Instant::now() < end, "receive never completed"),
            Err(e) => {
                errors.push(format!("receive test: {e}"));
                return;
            }
        }
    }
}

/// Opens, uses and closes [`CONNS`] connections in batches, closing in `order`; returns the
/// errors `test` returned.
fn run(order: Order) -> Vec<String> {
    let net = net();
    let (mut listener, handle) = net.listen(1).expect("listen");
    let src = DmaBuf::new(SLOT);
    let pattern: Vec<u8> = (0..SLOT).map(|i| i as u8).collect();
    src.write(0, &pattern);
    let dst = DmaBuf::new(BATCH * SLOT);
    let mut errors = Vec::new();
    for _ in 0..CONNS / BATCH {
        let mut batch: Vec<Open> = (0..BATCH)
            .map(|_| {
                let (s, r) = open(&net, &mut listener, &handle);
                let smr = s
                    .reg_mr(src.addr(), SLOT as u64, &src)
                    .expect("reg_mr send");
                let rmr = r
                    .reg_mr(dst.addr(), (BATCH * SLOT) as u64, &dst)
                    .expect("reg_mr recv");
                Open {
                    s,
                    r,
                    smr,
                    rmr,
                    last: None,
                }
            })
            .collect();
        let late = matches!(order, Order::SenderFirstReceiverLate(_));
        for (slot, c) in batch.iter_mut().enumerate() {
            for (k, &size) in SIZES.iter().enumerate() {
                let last = k + 1 == SIZES.len();
                c.last = message(c, slot, size, &src, &dst, !(late && last), &mut errors);
            }
        }
        match order {
            Order::SenderFirst => {
                let recvs: Vec<_> = batch
                    .into_iter()
                    .map(|c| {
                        drop((c.smr, c.s));
                        (c.rmr, c.r)
                    })
                    .collect();
                drop(recvs);
            }
            Order::ReceiverFirst => {
                let sends: Vec<_> = batch
                    .into_iter()
                    .map(|c| {
                        drop((c.rmr, c.r));
                        (c.smr, c.s)
                    })
                    .collect();
                drop(sends);
            }
            Order::SenderFirstReceiverLate(delay) => {
                let recvs: Vec<_> = batch
                    .into_iter()
                    .map(|c| {
                        drop((c.smr, c.s));
                        (c.rmr, c.r, c.last)
                    })
                    .collect();
                std::thread::sleep(delay);
                for (slot, (_, r, last)) in recvs.iter().enumerate() {
                    if let Some(req) = last {
                        wait_recv(r, *req, slot, SIZES[SIZES.len() - 1], &dst, &mut errors);
                    }
                }
            }
        }
    }
    errors
}

fn check(order: Order) {
    let started = Instant::now();
    let errors = run(order);
    println!(
        "{order:?}: {} of {CONNS} connections had an error, in {:.1} s",
        errors.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        errors.is_empty(),
        "{order:?}: {} of {CONNS} connections failed after every byte arrived; first: {}",
        errors.len(),
        errors[0]
    );
}

#[test]
fn a_thousand_connections_closed_sender_first_never_fail() {
    check(Order::SenderFirst);
}

#[test]
fn a_thousand_connections_closed_receiver_first_never_fail() {
    check(Order::ReceiverFirst);
}

#[test]
fn a_sender_closing_before_the_receiver_tests_fails_nothing() {
    check(Order::SenderFirstReceiverLate(Duration::from_millis(200)));
}
