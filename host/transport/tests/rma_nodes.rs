//! One-sided traffic between three nodes: three ranks, each this test binary re-run by `ip
//! netns exec` in a network namespace of its own, as `multi_node.rs` runs two. The nodes are
//! cabled as a full mesh of veth pairs (node i's end towards node j is `to<j>`); each node has
//! one address ([`ADDRS`], a /32 on each of its veths, with a host route to each peer over the
//! veth that reaches it), loopback up for its puts to itself, and a soft fabric from
//! `topologies/loopback.toml` with 127.0.0.1 exchanged for that address (so the derived RoCEv2
//! GID is the node's address too). The handshakes go over the veths (`NCCL_SOCKET_IFNAME=to`).
//!
//! Each rank, on device 0: listens, tells the others its handle through the parent's relay,
//! makes a collective communicator (`rma_connect`) and a two-context set, then
//! 1. puts to every rank, itself included, [`ITERS`] slices each with a signal (INC and ADD of
//!    `it + 1` alternating, every third strong, the two contexts alternating every two);
//!    each target waits for each sender's signal word to reach the exact sum, and right then
//!    finds every byte of that sender's slices in place (and none past them);
//! 2. gets back what it put at each rank, compares, and flushes each rank on both contexts;
//! 3. is refused, with nothing written anywhere, a rank out of range, ranges beyond the
//!    registrations, a registration of a second collective communicator, a context out of
//!    range: each an `InvalidArgument`; memory checksums before and after show no byte moved;
//! 4. posts puts to the next rank, tests none of them, and drops the context, the
//!    registrations and both communicators with those in flight, then exits.
//!
//! The parent requires every rank to exit successfully having said each `VERIFIED` line, and
//! shows a failed rank's stderr.

mod common;

use std::fs::File;
use std::io::Write as _;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::nodes::heard;
use common::{deadline, handle_from_hex, handle_hex, net_with};
use ncclwasm_policy::PolicyHost;
use ncclwasm_testkit::child::{self, say};
use ncclwasm_testkit::netns::{self, Hosts, ip};
use ncclwasm_testkit::scratch::Scratch;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{
    ErrorClass, HANDLE_SIZE, NetError, PutSignal, RmaColl, RmaConfig, RmaCtx, RmaReq, SignalOp,
    SymMr,
};
use ncclwasm_verbs::DmaBuf;

/// The test the ranks run.
const RANK_TEST: &str = "rank";
/// Set in a rank: its number, 0 to 2.
const RANK_ENV: &str = "NCCLWASM_TEST_RANK";
const RANKS: usize = 3;
/// Each node's one address (TEST-NET-2), in rank order.
const ADDRS: [&str; RANKS] = ["198.51.100.1", "198.51.100.2", "198.51.100.3"];
/// Puts from each rank to each rank.
const ITERS: usize = 40;
/// Room for one put in the buffers: the largest put and some bytes that must stay untouched.
const SLOT: usize = 80 << 10;
/// Registered buffers (source, destination, gets): a slot per (peer, iteration).
const LEN: usize = RANKS * ITERS * SLOT;
/// The second communicator's buffer.
const OTHER: usize = 4096;
/// What a failing rank says to the others (its panic hook).
const FAILED: &str = "FAILED";
/// Puts left in flight at the close.
const IN_FLIGHT: usize = 20;
const CONTEXTS: usize = 2;

/// Bytes of put `it`: small and odd-sized, every tenth above the striping threshold.
fn size(it: usize) -> usize {
    if it % 10 == 9 {
        (72 << 10) + it
    } else {
        1 + (it * 7919) % 6000
    }
}

/// Where `from`'s put `it` lands in the target's destination buffer (and where a get of it
/// lands in `from`'s buffer when `from` is the peer the get reads).
fn slot(from: usize, it: usize) -> usize {
    (from * ITERS + it) * SLOT
}

/// Byte `i` of the slice `from` puts to `to` in iteration `it`.
fn byte(from: usize, to: usize, it: usize, i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ (from * 61 + to * 17 + it * 5 + 1) as u8
}

fn op(it: usize) -> SignalOp {
    match it % 2 {
        0 => SignalOp::Inc,
        _ => SignalOp::Add(it as u64 + 1),
    }
}

fn context(it: usize) -> usize {
    (it / 2) % CONTEXTS
}

/// What each sender's signal word reaches at each target.
fn signal_sum() -> u64 {
    (0..ITERS)
        .map(|it| match op(it) {
            SignalOp::Inc => 1,
            SignalOp::Add(v) => v,
        })
        .sum()
}

/// The other ranks' protocol lines, `R <rank> <kind> <payload>`, kept until asked for: lines
/// of different ranks reach this rank in any order, and `heard` drops what it skips.
struct Peers {
    me: usize,
    kept: Vec<(usize, String, String)>,
}

impl Peers {
    fn say(&self, kind: &str, payload: &str) {
        say(&format!("R {} {kind} {payload}", self.me));
    }

    /// The payload of `from`'s line `kind`.
    fn hear(&mut self, kind: &str, from: usize) -> String {
        loop {
            if let Some(k) = self
                .kept
                .iter()
                .position(|(r, k, _)| *r == from && k == kind)
            {
                return self.kept.swap_remove(k).2;
            }
            let line = heard("R ");
            let mut f = line.trim().splitn(3, ' ');
            let r: usize = f.next().and_then(|r| r.parse().ok()).expect("a rank");
            let k = f.next().expect("a kind").to_owned();
            assert_ne!(k, FAILED, "rank {r} failed: the others stop too");
            self.kept
                .push((r, k, f.next().unwrap_or_default().to_owned()));
        }
    }

    /// Returns once every rank said `name` (the bootstrap's barrier, through the parent).
    fn barrier(&mut self, name: &str) {
        self.say(name, "");
        let me = self.me;
        for r in (0..RANKS).filter(|&r| r != me) {
            self.hear(name, r);
        }
    }
}

fn wait(ctx: &RmaCtx, reqs: impl IntoIterator<Item = RmaReq>, what: &str) {
    let end = deadline();
    for r in reqs {
        while !ctx.test(r).unwrap_or_else(|e| panic!("{what}: {e}")) {
            assert!(Instant::now() < end, "{what}: a request never completed");
        }
    }
}

/// A zeroed buffer of `len` bytes registered on `coll`.
fn sym(coll: &RmaColl, len: usize) -> (Arc<DmaBuf>, SymMr) {
    let buf = DmaBuf::new(len);
    let mr = coll
        .reg_mr_sym(buf.addr(), len as u64, &buf)
        .expect("a symmetric registration");
    (buf, mr)
}

/// FNV-1a of the whole buffer.
fn checksum(buf: &DmaBuf) -> u64 {
    let mut b = vec![0u8; buf.len()];
    buf.read(0, &mut b);
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The call was refused as an invalid argument (and so posted nothing); counts it.
fn refused(count: &mut usize, what: &str, r: Result<RmaReq, NetError>) {
    match r {
        Ok(req) => panic!("{what}: accepted as {req:?}"),
        Err(e) => assert_eq!(e.class(), ErrorClass::InvalidArgument, "{what}: {e}"),
    }
    *count += 1;
}

/// A rank's side: does nothing unless this process was started as a rank.
#[test]
fn rank() {
    if !child::enter(RANK_TEST) {
        return;
    }
    let me: usize = std::env::var(RANK_ENV)
        .expect("the rank number")
        .parse()
        .expect("a rank number");
    // A rank that fails tells the others, which fail at their next wait for a line instead of
    // waiting for the relay's timeout.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // Not `say`, which panics when stdout is gone: a panic in the hook aborts.
        let _ = writeln!(std::io::stdout(), "{}R {me} {FAILED}", child::TAG);
        report(info);
    }));
    let mut peers = Peers {
        me,
        kept: Vec::new(),
    };
    let policy = Arc::new(PolicyHost::from_env(4).expect("policy settings"));
    let net = net_with(OobEnv::from_env(), policy).expect("a context on the soft fabric");
    // Two listeners: one per collective communicator.
    let (mut listener, handle) = net.listen(0).expect("listen");
    let (mut listener2, handle2) = net.listen(0).expect("listen again");
    peers.say(
        "HANDLE",
        &format!("{} {}", handle_hex(&handle), handle_hex(&handle2)),
    );
    let (mut handles, mut handles2) = ([[0u8; HANDLE_SIZE]; RANKS], [[0u8; HANDLE_SIZE]; RANKS]);
    for r in 0..RANKS {
        let (a, b) = if r == me {
            (handle, handle2)
        } else {
            let line = peers.hear("HANDLE", r);
            let (a, b) = line.split_once(' ').expect("two handles");
            (handle_from_hex(a), handle_from_hex(b))
        };
        (handles[r], handles2[r]) = (a, b);
    }
    let coll = net
        .rma_connect(&handles, me, &mut listener, 0x5eed)
        .expect("the collective communicator");
    let coll2 = net
        .rma_connect(&handles2, me, &mut listener2, 0x5eee)
        .expect("the second collective communicator");
    drop((listener, listener2));
    assert_eq!((coll.rank(), coll.nranks()), (me, RANKS));
    let ctx = coll
        .create_context(RmaConfig {
            contexts: CONTEXTS as u32,
            traffic_class: -1,
            rank_stride: 1,
        })
        .expect("two contexts");
    // Collective: the same order on every rank.
    let (src, src_mr) = sym(&coll, LEN);
    let (dst, dst_mr) = sym(&coll, LEN);
    let (sig, sig_mr) = sym(&coll, RANKS * 8);
    let (got, got_mr) = sym(&coll, LEN);
    let (other, other_mr) = sym(&coll2, OTHER);
    other.write(0, &vec![0x5a; OTHER]);
    for to in 0..RANKS {
        for it in 0..ITERS {
            let data: Vec<u8> = (0..size(it)).map(|i| byte(me, to, it, i)).collect();
            src.write(slot(to, it), &data);
        }
    }
    peers.barrier("READY");

    // 1. Puts with signals, to every rank.
    let sum = signal_sum();
    let mut reqs = Vec::new();
    for it in 0..ITERS {
        for to in 0..RANKS {
            let signal = Some(PutSignal {
                mr: &sig_mr,
                off: (me * 8) as u64,
                op: op(it),
                strong: it % 3 == 0,
            });
            let put = ctx.put(
                context(it),
                &src_mr,
                slot(to, it) as u64,
                size(it) as u64,
                &dst_mr,
                slot(me, it) as u64,
                to,
                signal,
            );
            reqs.push(put.unwrap_or_else(|e| panic!("rank {me}: put {it} to {to}: {e}")));
        }
    }
    let end = deadline();
    for from in (0..RANKS).map(|k| (me + 1 + k) % RANKS) {
        loop {
            let v = sig.load_u64_acquire(from * 8);
            if v == sum {
                break;
            }
            assert!(
                v < sum,
                "rank {me}: the signal of {from} went past {sum}: {v}"
            );
            ctx.progress().expect("progress");
            assert!(
                Instant::now() < end,
                "rank {me}: the signal of {from} stuck at {v} of {sum}"
            );
        }
        // The word reached its sum: every put of `from` must be in place, now.
        let mut b = vec![0u8; SLOT];
        for it in 0..ITERS {
            dst.read(slot(from, it), &mut b);
            let n = size(it);
            let wrong = (0..n).find(|&i| b[i] != byte(from, me, it, i));
            assert_eq!(
                wrong, None,
                "rank {me}: signal of {from} seen before byte of its put {it} ({n} bytes)"
            );
            let past = b[n..].iter().position(|&x| x != 0);
            assert_eq!(past, None, "rank {me}: bytes past put {it} of {from}");
        }
    }
    wait(&ctx, reqs, "puts");
    assert_eq!(ctx.last_error(), None);
    say(&format!(
        "VERIFIED signals: {RANKS}x{ITERS} puts into rank {me}, each sender's word at {sum}"
    ));

    // 2. Gets: what this rank put at each rank, back into `got`; then flushes.
    let mut reqs = Vec::new();
    for to in 0..RANKS {
        for it in 0..ITERS {
            let get = ctx.get(
                context(it + 1),
                &dst_mr,
                slot(me, it) as u64,
                size(it) as u64,
                &got_mr,
                slot(to, it) as u64,
                to,
            );
            reqs.push(get.unwrap_or_else(|e| panic!("rank {me}: get {it} from {to}: {e}")));
        }
    }
    wait(&ctx, reqs, "gets");
    let (mut a, mut b) = (vec![0u8; LEN], vec![0u8; LEN]);
    got.read(0, &mut a);
    src.read(0, &mut b);
    let bad = a.iter().zip(&b).position(|(x, y)| x != y);
    assert_eq!(
        bad, None,
        "rank {me}: a get returned other bytes than were put"
    );
    let flushes: Vec<_> = (0..RANKS)
        .flat_map(|to| (0..CONTEXTS).map(move |c| (c, to)))
        .map(|(c, to)| ctx.flush(c, &dst_mr, to).expect("flush"))
        .collect();
    wait(&ctx, flushes, "flushes");
    say(&format!("VERIFIED gets: {} from each rank", ITERS));
    // Nobody writes into another rank's memory from here on.
    peers.barrier("QUIET");

    // 3. Bad input: refused, nothing written.
    let mine = [&src, &dst, &sig, &got, &other];
    let before: Vec<u64> = mine.iter().map(|b| checksum(b)).collect();
    let next = (me + 1) % RANKS;
    let (s, l) = (SLOT as u64, LEN as u64);
    let sig_ok = Some(PutSignal {
        mr: &sig_mr,
        off: (me * 8) as u64,
        op: SignalOp::Inc,
        strong: true,
    });
    let mut n = 0;
    refused(
        &mut n,
        "put to rank 3",
        ctx.put(0, &src_mr, 0, s, &dst_mr, 0, RANKS, None),
    );
    refused(
        &mut n,
        "put with signal to rank 3",
        ctx.put(0, &src_mr, 0, s, &dst_mr, 0, RANKS, sig_ok),
    );
    refused(
        &mut n,
        "get from rank 3",
        ctx.get(0, &dst_mr, 0, s, &got_mr, 0, RANKS),
    );
    refused(&mut n, "flush of rank 3", ctx.flush(1, &dst_mr, RANKS));
    refused(
        &mut n,
        "put to context 2",
        ctx.put(CONTEXTS, &src_mr, 0, s, &dst_mr, 0, next, None),
    );
    refused(
        &mut n,
        "put past the destination",
        ctx.put(0, &src_mr, 0, s, &dst_mr, l - s + 1, next, sig_ok),
    );
    refused(
        &mut n,
        "put past the source",
        ctx.put(1, &src_mr, l - 7, 8, &dst_mr, 0, next, None),
    );
    refused(
        &mut n,
        "put whose end overflows",
        ctx.put(0, &src_mr, 0, 16, &dst_mr, u64::MAX - 7, next, None),
    );
    refused(
        &mut n,
        "signal past its registration",
        ctx.put(
            0,
            &src_mr,
            0,
            s,
            &dst_mr,
            0,
            next,
            Some(PutSignal {
                mr: &sig_mr,
                off: (RANKS * 8) as u64,
                op: SignalOp::Inc,
                strong: false,
            }),
        ),
    );
    refused(
        &mut n,
        "signal word not 8-byte aligned",
        ctx.put(
            0,
            &src_mr,
            0,
            s,
            &dst_mr,
            0,
            next,
            Some(PutSignal {
                mr: &sig_mr,
                off: 4,
                op: SignalOp::Inc,
                strong: false,
            }),
        ),
    );
    refused(
        &mut n,
        "get past the remote registration",
        ctx.get(1, &dst_mr, l - 3, 8, &got_mr, 0, next),
    );
    refused(
        &mut n,
        "get past the local registration",
        ctx.get(0, &dst_mr, 0, s, &got_mr, l - 3, next),
    );
    let o = OTHER as u64;
    refused(
        &mut n,
        "put into another communicator's registration",
        ctx.put(0, &src_mr, 0, o, &other_mr, 0, next, None),
    );
    refused(
        &mut n,
        "put from another communicator's registration",
        ctx.put(1, &other_mr, 0, o, &dst_mr, 0, next, None),
    );
    refused(
        &mut n,
        "signal into another communicator's registration",
        ctx.put(
            0,
            &src_mr,
            0,
            8,
            &dst_mr,
            0,
            next,
            Some(PutSignal {
                mr: &other_mr,
                off: 0,
                op: SignalOp::Add(9),
                strong: true,
            }),
        ),
    );
    refused(
        &mut n,
        "get into another communicator's registration",
        ctx.get(1, &dst_mr, 0, o, &other_mr, 0, next),
    );
    refused(
        &mut n,
        "flush through another communicator's registration",
        ctx.flush(0, &other_mr, next),
    );
    // Whatever might have been posted all the same has landed once these are done.
    let flushes: Vec<_> = (0..RANKS)
        .flat_map(|to| (0..CONTEXTS).map(move |c| (c, to)))
        .map(|(c, to)| ctx.flush(c, &dst_mr, to).expect("flush"))
        .collect();
    wait(&ctx, flushes, "flushes after the refusals");
    assert_eq!(ctx.last_error(), None);
    peers.barrier("REFUSED");
    let after: Vec<u64> = mine.iter().map(|b| checksum(b)).collect();
    assert_eq!(
        after, before,
        "rank {me}: memory changed by refused calls [src, dst, sig, got, other]"
    );
    say(&format!(
        "VERIFIED refusals: {n} calls refused as invalid arguments, memory unchanged"
    ));
    // Nobody writes into another rank's memory until every rank has looked at its own.
    peers.barrier("CHECKED");

    // The bytes crossed the veths: every peer's address carried at least this rank's puts to
    // it, and no other address carried any.
    let put_bytes: u64 = (0..ITERS).map(|it| size(it) as u64).sum();
    let traffic = ncclwasm_soft::traffic();
    for t in &traffic {
        assert_eq!(t.local.to_string(), ADDRS[me], "rank {me}: {t:?}");
        assert!(
            ADDRS.contains(&t.peer.to_string().as_str()),
            "rank {me}: {t:?}"
        );
    }
    for r in (0..RANKS).filter(|&r| r != me) {
        let sent: u64 = traffic
            .iter()
            .filter(|t| t.peer.to_string() == ADDRS[r])
            .map(|t| t.sent)
            .sum();
        assert!(
            sent >= put_bytes,
            "rank {me}: {sent} bytes to rank {r}, less than its puts' {put_bytes}"
        );
    }

    // 4. Close with puts in flight to the next rank, none tested.
    for k in 0..IN_FLIGHT {
        let signal = (k % 2 == 0).then_some(PutSignal {
            mr: &sig_mr,
            off: (me * 8) as u64,
            op: SignalOp::Inc,
            strong: k % 4 == 0,
        });
        ctx.put(
            k % CONTEXTS,
            &src_mr,
            slot(next, k) as u64,
            size(k) as u64,
            &dst_mr,
            slot(me, k) as u64,
            next,
            signal,
        )
        .unwrap_or_else(|e| panic!("rank {me}: put {k} left in flight: {e}"));
    }
    peers.barrier("CLOSING");
    let t = Instant::now();
    drop(ctx);
    drop((src_mr, dst_mr, sig_mr, got_mr, other_mr));
    drop((coll, coll2));
    drop(net);
    say(&format!(
        "VERIFIED close: {IN_FLIGHT} puts in flight, all closed in {:?}",
        t.elapsed()
    ));
}

/// `ip` in host `i`'s namespace.
fn ip_in(hosts: &Hosts, i: usize, args: &[&str]) {
    let mut all = vec!["-n", hosts.name(i)];
    all.extend_from_slice(args);
    ip(&all);
}

#[test]
fn three_ranks_put_signal_get_and_close_across_namespaces() {
    if let Some(why) = netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return;
    }
    let started = Instant::now();
    let scratch = Scratch::new("rma-nodes");
    let hosts = Hosts::new(RANKS);
    // The full mesh: one veth pair per pair of nodes.
    let pairs = (0..RANKS).flat_map(|a| (a + 1..RANKS).map(move |b| (a, b)));
    for (a, b) in pairs {
        let (to_a, to_b) = (format!("to{a}"), format!("to{b}"));
        hosts.link(
            a,
            (&to_b, &format!("{}/32", ADDRS[a])),
            b,
            (&to_a, &format!("{}/32", ADDRS[b])),
        );
        ip_in(&hosts, a, &["route", "add", ADDRS[b], "dev", &to_b]);
        ip_in(&hosts, b, &["route", "add", ADDRS[a], "dev", &to_a]);
    }
    let loopback = std::fs::read_to_string(ncclwasm_testkit::topology("loopback.toml")).unwrap();
    let ranks = (0..RANKS)
        .map(|i| {
            // Puts to itself go to its own address, through `lo`.
            hosts.loopback_up(i);
            let topology = scratch.write(
                &format!("node{i}.toml"),
                loopback.replace("127.0.0.1", ADDRS[i]).as_bytes(),
            );
            let stderr = File::create(scratch.path(&format!("rank{i}.stderr"))).unwrap();
            let mut cmd: Command = child::command_via(hosts.exec(i), RANK_TEST);
            cmd.env(RANK_ENV, i.to_string())
                .env("NCCL_WASM_TOPOLOGY", topology)
                .env("NCCL_SOCKET_IFNAME", "to")
                .env("NCCL_SOCKET_FAMILY", "AF_INET")
                .env_remove("NCCL_WASM_POLICY")
                .env_remove("NCCL_IB_HCA")
                .stderr(stderr);
            (format!("rank {i} in {}", hosts.name(i)), cmd)
        })
        .collect();
    let out = child::relay(ranks, Duration::from_secs(240));
    let mut failed = Vec::new();
    for (i, r) in out.iter().enumerate() {
        let mine: Vec<&String> = r.lines.iter().filter(|l| l.contains("VERIFIED")).collect();
        let all = ["signals", "gets", "refusals", "close"]
            .iter()
            .all(|w| mine.iter().any(|l| l.contains(&format!("VERIFIED {w}:"))));
        if !r.status.success() || !all {
            let stderr = std::fs::read_to_string(scratch.path(&format!("rank{i}.stderr")))
                .unwrap_or_default();
            failed.push(format!(
                "{} ({}): lines {mine:?}\n--- its stderr ---\n{stderr}",
                r.name, r.status
            ));
        }
        for l in mine {
            println!("{}: {l}", r.name);
        }
    }
    assert!(failed.is_empty(), "ranks failed:\n{}", failed.join("\n"));
    println!("three ranks done in {:?}", started.elapsed());
}
