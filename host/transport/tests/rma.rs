//! One-sided traffic (the RMA tables' semantics) between three ranks, each a thread of this
//! process with its own collective communicator, on the soft fabric: puts with INC and ADD
//! signals where the target checks every byte as soon as its signal reaches the count, strong
//! and weak signals over a fused device's two QPs (where a signal must wait for the other QP's
//! slices), gets, flushes, two contexts, a buffer registered twice, bad input refused with no
//! byte written, contexts dropped with requests in flight, and the policy placing each
//! context's connections (rail-aligned, and the built-in's one QP per port).

mod common;

use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use common::deadline;
use ncclwasm_transport::{
    HANDLE_SIZE, Net, PutSignal, RmaColl, RmaConfig, RmaCtx, RmaReq, SignalOp, SymMr,
};
use ncclwasm_verbs::DmaBuf;

const RANKS: usize = 3;
const ITERS: usize = 24;

/// Runs `body(rank, coll, barrier)` on `RANKS` threads, each with a collective communicator on
/// device `dev` of `net`; `barrier` is the ranks' own (NCCL's bootstrap), for tests.
fn ranks(net: &Net, dev: i64, body: impl Fn(usize, RmaColl, &Barrier) + Sync) {
    let handles = Mutex::new(vec![[0u8; HANDLE_SIZE]; RANKS]);
    let gathered = Barrier::new(RANKS);
    std::thread::scope(|s| {
        for rank in 0..RANKS {
            let (handles, gathered, body) = (&handles, &gathered, &body);
            s.spawn(move || {
                let (mut listener, handle) = net.listen(dev).unwrap();
                handles.lock().unwrap()[rank] = handle;
                gathered.wait();
                let all = handles.lock().unwrap().clone();
                let coll = net.rma_connect(&all, rank, &mut listener, 0xfeed).unwrap();
                drop(listener);
                body(rank, coll, gathered);
            });
        }
    });
}

fn wait(ctx: &RmaCtx, reqs: impl IntoIterator<Item = RmaReq>) {
    let end = deadline();
    for r in reqs {
        while !ctx.test(r).unwrap() {
            assert!(Instant::now() < end, "a one-sided request never completed");
        }
    }
}

/// A registered buffer of `len` bytes.
fn sym(coll: &RmaColl, len: usize) -> (Arc<DmaBuf>, SymMr) {
    let buf = DmaBuf::new(len);
    let mr = coll.reg_mr_sym(buf.addr(), len as u64, &buf).unwrap();
    (buf, mr)
}

fn byte(from: usize, to: usize, it: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(13) ^ (from * 31 + to * 7 + it * 3) as u8
}

/// Every rank puts `ITERS` slices to every rank (itself included), each followed by a signal
/// (INC on even iterations, ADD of `it + 1` on odd ones; every third strong); each target waits
/// for each sender's signal word to reach the total and then finds every byte in place. Then
/// each rank gets back what it put, and flushes.
fn puts_and_signals(net: &Net, dev: i64, chunk: usize) {
    let sum: u64 = (0..ITERS)
        .map(|it| if it % 2 == 0 { 1 } else { it as u64 + 1 })
        .sum();
    ranks(net, dev, |rank, coll, barrier| {
        let ctx = coll
            .create_context(RmaConfig {
                contexts: 2,
                traffic_class: -1,
                rank_stride: 1,
            })
            .unwrap();
        if dev != 0 {
            let plan = ctx.plan(0, rank).unwrap();
            assert_eq!((plan.qps.len(), plan.stripe_width), (2, 2), "{plan:?}");
        }
        let (src, src_mr) = sym(&coll, RANKS * ITERS * chunk);
        let (dst, dst_mr) = sym(&coll, RANKS * ITERS * chunk);
        // The destination again: one buffer, two registrations, both usable.
        let dst_again = coll.reg_mr_sym(dst.addr(), dst.len() as u64, &dst).unwrap();
        let (sig, sig_mr) = sym(&coll, RANKS * 8);
        let (got, got_mr) = sym(&coll, RANKS * ITERS * chunk);
        let mut reqs = Vec::new();
        for to in 0..RANKS {
            for it in 0..ITERS {
                let off = ((to * ITERS + it) * chunk) as u64;
                let data: Vec<u8> = (0..chunk).map(|i| byte(rank, to, it, i)).collect();
                src.write(off as usize, &data);
                let op = match it % 2 {
                    0 => SignalOp::Inc,
                    _ => SignalOp::Add(it as u64 + 1),
                };
                let dst = if it % 4 == 1 { &dst_again } else { &dst_mr };
                let at = ((rank * ITERS + it) * chunk) as u64;
                let signal = Some(PutSignal {
                    mr: &sig_mr,
                    off: (rank * 8) as u64,
                    op,
                    strong: it % 3 == 0,
                });
                reqs.push(
                    ctx.put(it % 2, &src_mr, off, chunk as u64, dst, at, to, signal)
                        .unwrap(),
                );
            }
        }
        // The target's view: each sender's word reaches the sum only after its bytes landed.
        let end = deadline();
        for from in 0..RANKS {
            while sig.load_u64_acquire(from * 8) != sum {
                ctx.progress().unwrap();
                assert!(
                    Instant::now() < end,
                    "rank {rank}: signal of {from} never arrived"
                );
            }
            for it in 0..ITERS {
                let mut b = vec![0u8; chunk];
                dst.read((from * ITERS + it) * chunk, &mut b);
                for (i, &v) in b.iter().enumerate() {
                    assert_eq!(
                        v,
                        byte(from, rank, it, i),
                        "rank {rank} from {from} it {it} byte {i}"
                    );
                }
            }
        }
        wait(&ctx, reqs);
        // Gets: read back from each rank what this rank put there.
        let reqs: Vec<_> = (0..RANKS)
            .flat_map(|to| (0..ITERS).map(move |it| (to, it)))
            .map(|(to, it)| {
                let remote = ((rank * ITERS + it) * chunk) as u64;
                let local = ((to * ITERS + it) * chunk) as u64;
                ctx.get(1, &dst_mr, remote, chunk as u64, &got_mr, local, to)
                    .unwrap()
            })
            .collect();
        wait(&ctx, reqs);
        let (mut a, mut b) = (vec![0u8; got.len()], vec![0u8; src.len()]);
        got.read(0, &mut a);
        src.read(0, &mut b);
        assert!(
            a == b,
            "rank {rank}: a get returned other bytes than were put"
        );
        let flushes: Vec<_> = (0..RANKS)
            .map(|to| ctx.flush(0, &dst_mr, to).unwrap())
            .collect();
        wait(&ctx, flushes);
        assert_eq!(ctx.last_error(), None);
        // Nobody closes while a peer may still read its memory.
        barrier.wait();
    });
}

/// Bytes posted on each port, as a policy's telemetry reads them.
fn port_bytes(net: &Net) -> Vec<u64> {
    net.telemetry().ports.iter().map(|p| p.send.bytes).collect()
}

/// [`puts_and_signals`] on device 0; the per-port telemetry counts the one-sided bytes too (every
/// put and get on device 0's port).
#[test]
fn puts_signals_gets_and_flushes_between_three_ranks() {
    let net = common::net();
    let chunk = 4096 + 13;
    let before = port_bytes(&net);
    puts_and_signals(&net, 0, chunk);
    let after = port_bytes(&net);
    let moved = (2 * RANKS * RANKS * ITERS * chunk) as u64;
    assert!(
        after[0] - before[0] >= moved,
        "port 0 counted {} bytes, {moved} were put and got",
        after[0] - before[0]
    );
}

/// On a fused device (two ports, two QPs per connection) large puts are striped over both QPs:
/// every signal then waits for the other QP's slice.
#[test]
fn striped_puts_over_a_fused_device_never_signal_early() {
    let net = common::net();
    let fused = net.make_vdevice(&[0, 1]).unwrap();
    puts_and_signals(&net, i64::from(fused), (256 << 10) + 40);
}

/// The ordering a striped put's signal relies on, made visible: each target stalls the second
/// QP of every sender's connection (the first carries the first slice and the signal), so the
/// signal's QP runs ahead. The signal must still never be seen before both slices landed.
#[test]
fn a_signal_waits_for_a_stalled_slice_on_the_other_qp() {
    let net = common::net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let chunk = (256 << 10) + 40;
    ranks(&net, fused, |rank, coll, barrier| {
        let ctx = coll
            .create_context(RmaConfig {
                contexts: 1,
                traffic_class: -1,
                rank_stride: 1,
            })
            .unwrap();
        let (src, src_mr) = sym(&coll, chunk);
        let (dst, dst_mr) = sym(&coll, RANKS * chunk);
        let (sig, sig_mr) = sym(&coll, RANKS * 8);
        let data: Vec<u8> = (0..chunk).map(|i| byte(rank, 0, 0, i)).collect();
        src.write(0, &data);
        for from in 0..RANKS {
            ctx.inject_stall(0, from, 1, Duration::from_millis(300))
                .unwrap();
        }
        barrier.wait();
        let reqs: Vec<_> = (0..RANKS)
            .map(|to| {
                let signal = Some(PutSignal {
                    mr: &sig_mr,
                    off: (rank * 8) as u64,
                    op: SignalOp::Inc,
                    strong: false,
                });
                let at = (rank * chunk) as u64;
                ctx.put(0, &src_mr, 0, chunk as u64, &dst_mr, at, to, signal)
                    .unwrap()
            })
            .collect();
        let end = deadline();
        for from in 0..RANKS {
            while sig.load_u64_acquire(from * 8) != 1 {
                ctx.progress().unwrap();
                assert!(
                    Instant::now() < end,
                    "rank {rank}: signal of {from} never arrived"
                );
            }
            let mut b = vec![0u8; chunk];
            dst.read(from * chunk, &mut b);
            let wrong = (0..chunk).filter(|&i| b[i] != byte(from, 0, 0, i)).count();
            assert_eq!(
                wrong, 0,
                "rank {rank}: the signal of {from} came before its bytes"
            );
        }
        wait(&ctx, reqs);
        barrier.wait();
    });
}

/// On device `fused` of both soft ports, two contexts: asserts each connection's local ports
/// are `want(context)`, then every rank puts to the next on each context and checks what
/// arrived — the placement carries traffic, not only a plan.
fn contexts_on_a_fused_device(want: fn(usize) -> Vec<u32>) {
    let net = common::net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    const LEN: usize = 64 << 10;
    ranks(&net, fused, |rank, coll, barrier| {
        let ctx = coll
            .create_context(RmaConfig {
                contexts: 2,
                traffic_class: -1,
                rank_stride: 1,
            })
            .unwrap();
        for c in 0..2 {
            for peer in 0..RANKS {
                let plan = ctx.plan(c, peer).unwrap();
                let locals: Vec<u32> = plan.qps.iter().map(|q| q.local).collect();
                assert_eq!(locals, want(c), "context {c} to {peer}: {}", plan.reason);
            }
        }
        let (src, src_mr) = sym(&coll, 2 * LEN);
        let (dst, dst_mr) = sym(&coll, 2 * LEN);
        for c in 0..2 {
            let data: Vec<u8> = (0..LEN).map(|i| byte(rank, c, 0, i)).collect();
            src.write(c * LEN, &data);
        }
        barrier.wait();
        let to = (rank + 1) % RANKS;
        let reqs: Vec<_> = (0..2)
            .map(|c| {
                let at = (c * LEN) as u64;
                ctx.put(c, &src_mr, at, LEN as u64, &dst_mr, at, to, None)
                    .unwrap()
            })
            .collect();
        wait(&ctx, reqs);
        barrier.wait();
        let from = (rank + RANKS - 1) % RANKS;
        for c in 0..2 {
            let mut b = vec![0u8; LEN];
            dst.read(c * LEN, &mut b);
            assert!(
                (0..LEN).all(|i| b[i] == byte(from, c, 0, i)),
                "rank {rank}: context {c}'s put from {from} differs"
            );
        }
        barrier.wait();
    });
}

/// The policy places one-sided traffic: rail-aligned gives each context of a fused device one
/// QP on a port of its own (contexts spread over the rails).
#[test]
fn rail_aligned_gives_each_context_its_own_port() {
    const TEST: &str = "rail_aligned_gives_each_context_its_own_port";
    let policy = ncclwasm_testkit::guest("rail-aligned");
    if ncclwasm_testkit::child::rerun_with_env(
        TEST,
        &[("NCCL_WASM_POLICY", policy.to_str().unwrap())],
    ) {
        return;
    }
    contexts_on_a_fused_device(|c| vec![c as u32]);
}

/// The built-in default connects one-sided traffic as NCCL's GIN proxy does: one QP per port
/// of the device, whatever NCCL_IB_QPS_PER_CONNECTION says.
#[test]
fn the_builtin_gives_one_sided_traffic_one_qp_per_port() {
    const TEST: &str = "the_builtin_gives_one_sided_traffic_one_qp_per_port";
    if ncclwasm_testkit::child::rerun_with_env(TEST, &[("NCCL_IB_QPS_PER_CONNECTION", "3")]) {
        return;
    }
    contexts_on_a_fused_device(|_| vec![0, 1]);
}

/// A port failure under one-sided traffic: rank 0 cuts the second QP of its fused connection to
/// rank 1 and puts a striped put with a signal. The slice on the cut QP fails, the one on the
/// other QP lands; the signal (held behind both slices) must never be posted, so rank 1's
/// signal word stays 0. The request fails, the context reports why, and takes no new work.
#[test]
fn a_failed_slice_fails_the_put_and_its_signal_never_lands() {
    // The cut QP's write fails when its retries run out, as on a NIC: a short budget
    // (67 ms × 2) instead of NCCL's 4.3 s × 8.
    const TEST: &str = "a_failed_slice_fails_the_put_and_its_signal_never_lands";
    let short = [("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "1")];
    if ncclwasm_testkit::child::rerun_with_env(TEST, &short) {
        return;
    }
    let net = common::net();
    let fused = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let chunk = (256 << 10) + 40;
    ranks(&net, fused, |rank, coll, barrier| {
        let ctx = coll
            .create_context(RmaConfig {
                contexts: 1,
                traffic_class: -1,
                rank_stride: 1,
            })
            .unwrap();
        let (_src, src_mr) = sym(&coll, chunk);
        let (_dst, dst_mr) = sym(&coll, chunk);
        let (sig, sig_mr) = sym(&coll, 8);
        barrier.wait();
        if rank == 0 {
            assert_eq!(ctx.plan(0, 1).unwrap().qps.len(), 2);
            // Connections open at a QP's first work request: one small put on each QP (small
            // ones take the QPs in turn), then the cut.
            let warm: Vec<_> = (0..2)
                .map(|_| ctx.put(0, &src_mr, 0, 8, &dst_mr, 0, 1, None).unwrap())
                .collect();
            wait(&ctx, warm);
            ctx.inject_cut(0, 1, 1).unwrap();
            let signal = Some(PutSignal {
                mr: &sig_mr,
                off: 0,
                op: SignalOp::Inc,
                strong: false,
            });
            let req = ctx
                .put(0, &src_mr, 0, chunk as u64, &dst_mr, 0, 1, signal)
                .unwrap();
            // Done once every work request of it completed, the signal's included had it been
            // posted: after this, a posted signal would have landed.
            let end = deadline();
            let failed = loop {
                match ctx.test(req) {
                    Ok(true) => break None,
                    Ok(false) => assert!(Instant::now() < end, "the put never finished"),
                    Err(e) => break Some(e.to_string()),
                }
            };
            let why = failed.expect("a put with a failed slice fails");
            let last = ctx.last_error().expect("the context reports the failure");
            assert!(!last.is_empty(), "{why}");
            let again = ctx
                .put(0, &src_mr, 0, 8, &dst_mr, 0, 2, None)
                .unwrap_err()
                .to_string();
            assert!(again.contains("failed earlier"), "{again}");
        }
        barrier.wait();
        if rank == 1 {
            assert_eq!(
                sig.load_u64_acquire(0),
                0,
                "a signal announced a failed put"
            );
        }
    });
}
