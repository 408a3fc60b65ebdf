//! The one-sided part of a rank: after the two-sided parts, both ranks drive the library's RMA
//! table (`ncclRmaPlugin_vN`, through [`ncclwasm_abi::load_rma`]) as NCCL's GIN proxy does —
//! `init`, `listen`, the two listen handles relayed by the parent, a collective `connect` of the
//! two ranks (rank numbers in [`ROLES`] order), one context, and three symmetric registrations:
//! the source, the destination and the signal word. Then, for each size of the bandwidth part,
//! the sender (the initiator, as in the two-sided parts) measures:
//! * puts: a stream to the receiver, up to [`super::wait::WINDOW`] in flight, the last one with
//!   a strong signal completing the stream's length (a long one signals on the way too) — timed
//!   by the receiver, from the go signal it posts until its signal word shows the whole stream
//!   arrived;
//! * puts with a signal: a ping-pong, each side answering the other's signal with its own put
//!   and signal; one way is half the round trip the sender times;
//! * gets: each from the receiver's source, timed alone from its post to its completion.
//!
//! One-sided traffic tells its target nothing but a signal, so whatever must not overlap the
//! other rank's work is ordered by one: a *go* (a signal alone, size 0) from the rank that is
//! ready — its bytes spoiled or filled for the check — or the signal of the put that announces
//! the bytes. A rank's signal word only grows; it counts what it has waited for. The first
//! operation of each kind is checked byte for byte ([`super::workload`]), so a put that lands
//! wrong or late fails the bench. Each size ends with the parent's go-ahead
//! ([`wire::plugin_done`]): the receiver sits out the gets there, and after the last size nothing
//! is in flight when the handles close, in NCCL's order.

use std::cell::Cell;
use std::io::BufRead;
use std::time::{Duration, Instant};

use ncclwasm_abi::load::Plugin;
use ncclwasm_abi::load_rma::{RmaCtx, RmaRequest, Signal, SignalOp, SymMr};

use super::cpu::CpuClock;
use super::wait::{Beat, Look, Transfer, plugin_fail, retry, stream, watch};
use super::wire::{self, Completions, Msg, Part, ROLES, RankArgs, Role, RoundTrips, Timing};
use super::workload::{fill, iterations, largest, patterned, spoil, verify};
use crate::Error;

/// The stream every operation runs on (the context set has one).
const CONTEXT: i32 = 0;

/// This rank's three symmetric registrations, each the same size on both ranks.
struct Buffers<'c> {
    /// What this rank puts, and what the peer gets from it.
    src: SymMr<'c>,
    /// Where the peer's puts land, and this rank's gets.
    dst: SymMr<'c>,
    /// The word at offset 0: the peers' signals add to it.
    sig: SymMr<'c>,
}

/// This rank's side of the pair: the context, the peer's rank, and how far this rank's signal
/// word has been waited for.
struct Link<'a, 'c> {
    ctx: &'a RmaCtx<'c>,
    peer: u32,
    seen: Cell<u64>,
}

impl<'a, 'c> Link<'a, 'c> {
    /// One put of `size` bytes, from this rank's source to the peer's destination, with a
    /// signal when `signal` says so (the peer's word, grown by the op).
    fn put<'m>(
        &self,
        bufs: &'m Buffers<'c>,
        size: usize,
        signal: Option<(SignalOp, bool)>,
    ) -> Result<Option<RmaRequest<'m>>, Error>
    where
        'a: 'm,
    {
        let ctx: &'a RmaCtx<'c> = self.ctx;
        let (src, dst) = ((&bufs.src, 0), (&bufs.dst, 0));
        match signal {
            None => ctx.iput(CONTEXT, src, dst, size, self.peer),
            Some((op, strong)) => ctx.iput_signal(
                CONTEXT,
                src,
                dst,
                size,
                self.peer,
                Signal {
                    mr: &bufs.sig,
                    off: 0,
                    op,
                    strong,
                },
            ),
        }
        .map_err(plugin_fail)
    }

    /// The go: a signal alone (size 0), telling the peer this rank is ready.
    fn go<'m>(&self, bufs: &'m Buffers<'c>) -> Result<RmaRequest<'m>, Error>
    where
        'a: 'm,
    {
        retry("a go signal", || {
            self.put(bufs, 0, Some((SignalOp::Inc, false)))
        })
    }

    /// Waits until this rank's signal word has grown by `by` since the last wait, testing `own`
    /// (this rank's request still in flight, if any) to completion meanwhile and giving the
    /// context progress, as NCCL's proxy does while a kernel waits. The word may be past the
    /// count: the peer's next signal (a go) can land before `own` completes, and the next wait
    /// counts it. The word growing, or `own` completing, is progress: a long stream of puts
    /// signals on the way ([`Link::put_stream`]).
    fn arrive(
        &self,
        bufs: &Buffers<'c>,
        by: u64,
        mut own: Option<RmaRequest<'_>>,
        what: &str,
    ) -> Result<(), Error> {
        let target = self.seen.get() + by;
        let mut word = None;
        watch(what, || {
            let completed = match own.as_mut() {
                Some(r) => r.poll()?.is_some(),
                None => false,
            };
            if completed {
                own = None;
            }
            let now = bufs.sig.word(0).map_err(plugin_fail)?;
            let grew = word.is_some_and(|w| now > w);
            word = Some(now);
            Ok(if own.is_none() && now >= target {
                Look::Done(())
            } else {
                if now < target {
                    self.ctx.progress().map_err(plugin_fail)?;
                }
                if grew || completed {
                    Look::Moved
                } else {
                    Look::Idle
                }
            })
        })?;
        self.seen.set(target);
        Ok(())
    }

    /// `n` puts of `size` bytes streamed to the peer, the last one with a strong signal adding
    /// what the stream's earlier signals did not: once the peer's word has grown by `n`, every
    /// put of the stream is there. A long stream also signals on the way, weakly, once a
    /// [`Beat`] (with the puts posted since the last signal): the peer sees nothing else of it
    /// until its end, and would take a stream of minutes for a stalled one.
    fn put_stream(&self, bufs: &Buffers<'c>, size: usize, n: u32) -> Result<(), Error> {
        let (mut posted, mut signaled) = (0, 0);
        let mut beat = Beat::new(Instant::now());
        stream(n, || {
            let signal = if posted + 1 == n {
                Some((SignalOp::Add(u64::from(n - signaled)), true))
            } else if beat.due(Instant::now()) {
                Some((SignalOp::Add(u64::from(posted + 1 - signaled)), false))
            } else {
                None
            };
            let r = self.put(bufs, size, signal)?;
            if r.is_some() {
                posted += 1;
                if signal.is_some() {
                    signaled = posted;
                }
            }
            Ok(r)
        })
        .map(drop)
    }

    /// One round trip, timed: this rank's put with a signal, then the peer's answer seen.
    fn trip(&self, bufs: &Buffers<'c>, size: usize) -> Result<Duration, Error> {
        let start = Instant::now();
        let ping = retry("iputSignal", || {
            self.put(bufs, size, Some((SignalOp::Inc, false)))
        })?;
        self.arrive(bufs, 1, Some(ping), "the one-sided pong")?;
        Ok(start.elapsed())
    }

    /// One get of `size` bytes from the peer's source into this rank's destination, timed
    /// from its post to its completion.
    fn get(&self, bufs: &Buffers<'c>, size: usize) -> Result<Duration, Error> {
        let start = Instant::now();
        let mut r = retry("iget", || {
            let from = (&bufs.src, 0);
            let to = (&bufs.dst, 0);
            self.ctx
                .iget(CONTEXT, from, to, size, self.peer)
                .map_err(plugin_fail)
        })?;
        retry("a get", || r.poll())?;
        Ok(start.elapsed())
    }
}

pub fn run(plugin: &Plugin, args: &RankArgs, stdin: &mut impl BufRead) -> Result<(), Error> {
    let rank = ROLES
        .iter()
        .position(|&(role, _)| role == args.role)
        .unwrap_or(0);
    let mut rma = plugin.rma().map_err(plugin_fail)?;
    rma.init().map_err(plugin_fail)?;
    let (listen, handle) = rma.listen(args.device).map_err(plugin_fail)?;
    wire::send(&Msg::RmaHandle {
        abi: rma.version(),
        handle: wire::hex(&handle),
    })?;
    let mut handles = [handle; 2];
    handles[1 - rank] = wire::read_handle(stdin, "peer's one-sided listen handle")?;
    let coll = rma.connect(&handles, rank, &listen).map_err(plugin_fail)?;
    // One context reaching every rank (stride 1); the traffic class is the plugin's default.
    let ctx = coll.create_context(1, -1, 1).map_err(plugin_fail)?;
    let len = largest(&args.sizes)?;
    let mut bufs = Buffers {
        src: coll.reg_mr_sym(len).map_err(plugin_fail)?,
        dst: coll.reg_mr_sym(len).map_err(plugin_fail)?,
        sig: coll.reg_mr_sym(8).map_err(plugin_fail)?,
    };
    let link = Link {
        ctx: &ctx,
        peer: (1 - rank) as u32,
        seen: Cell::new(0),
    };
    // Three patterns per size, after the two-sided parts' (see `workload::patterned`).
    let n = args.sizes.len();
    let first = n + args.latency_sizes.len();
    for (size, k) in patterned(&args.sizes, first) {
        let iters = iterations(size as u64, args.iters, 1);
        match args.role {
            Role::Recv => {
                target_puts(args, size, k, iters, &link, &mut bufs)?;
                pong(args, size, k + n, iters, &link, &mut bufs)?;
                serve_gets(args, size, k + 2 * n, iters, &link, &mut bufs, stdin)?;
            }
            Role::Send => {
                puts(args, size, k, iters, &link, &mut bufs)?;
                ping(args, size, k + n, iters, &link, &mut bufs)?;
                gets(args, size, k + 2 * n, iters, &link, &mut bufs, stdin)?;
            }
        }
    }
    Ok(())
}

/// The sender's puts of one size: the checked one, `--warmup` untimed, then the timed stream,
/// each after the receiver's go.
fn puts(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
) -> Result<(), Error> {
    fill(&mut bufs.src.bytes()[..size], k);
    link.arrive(bufs, 1, None, "the receiver's go")?;
    link.put_stream(bufs, size, 1)?;
    if args.warmup > 0 {
        link.arrive(bufs, 1, None, "the receiver's go")?;
        link.put_stream(bufs, size, args.warmup)?;
    }
    link.arrive(bufs, 1, None, "the receiver's go")?;
    let cpu = CpuClock::start()?;
    link.put_stream(bufs, size, iters)?;
    cpu.report(Part::Put, size, iters)
}

/// The receiver's side of [`puts`]: a go for each stream, the first one's bytes checked, the
/// timed one timed from its go to its signal.
fn target_puts(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
) -> Result<(), Error> {
    spoil(&mut bufs.dst.bytes()[..size], k);
    link.arrive(bufs, 1, Some(link.go(bufs)?), "the checked put")?;
    verify(&bufs.dst.bytes()[..size], k, "one-sided put")?;
    if args.warmup > 0 {
        let by = u64::from(args.warmup);
        link.arrive(bufs, by, Some(link.go(bufs)?), "the warmup puts")?;
    }
    let cpu = CpuClock::start()?;
    let start = Instant::now();
    let by = u64::from(iters);
    link.arrive(bufs, by, Some(link.go(bufs)?), "the timed puts")?;
    let timing = Timing::since(size, iters, start, true);
    cpu.report(Part::Put, size, iters)?;
    wire::send(&Msg::Put(timing))
}

/// The sender's one-sided ping-pong of one size: after the receiver's go, the checked round
/// trip (its pattern out, the receiver's echo back and compared), `--warmup` untimed, then the
/// timed ones one by one.
fn ping(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
) -> Result<(), Error> {
    fill(&mut bufs.src.bytes()[..size], k);
    spoil(&mut bufs.dst.bytes()[..size], k);
    link.arrive(bufs, 1, None, "the receiver's go")?;
    link.trip(bufs, size)?;
    verify(
        &bufs.dst.bytes()[..size],
        k,
        "one-sided ping-pong, the echo",
    )?;
    for _ in 0..args.warmup {
        link.trip(bufs, size)?;
    }
    let cpu = CpuClock::start()?;
    let trips = (0..iters)
        .map(|_| link.trip(bufs, size))
        .collect::<Result<Vec<_>, _>>()?;
    cpu.report(Part::PutSignal, size, iters)?;
    wire::send(&Msg::PutSignal(RoundTrips::new(size, trips, true)))
}

/// The receiver's side of [`ping`]: it checks the first ping and echoes what arrived, then
/// answers each ping with a put and signal of the same size, testing each answer while it
/// waits for the next ping.
fn pong(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
) -> Result<(), Error> {
    spoil(&mut bufs.dst.bytes()[..size], k);
    link.arrive(bufs, 1, Some(link.go(bufs)?), "the checked ping")?;
    verify(
        &bufs.dst.bytes()[..size],
        k,
        "one-sided ping-pong, the ping",
    )?;
    bufs.src.bytes()[..size].copy_from_slice(&bufs.dst.bytes()[..size]);
    let bufs = &*bufs;
    let answer = || {
        retry("iputSignal", || {
            link.put(bufs, size, Some((SignalOp::Inc, false)))
        })
    };
    let rest = args.warmup + iters;
    let cpu = CpuClock::start()?;
    let mut last = answer()?;
    for _ in 0..rest {
        link.arrive(bufs, 1, Some(last), "a one-sided ping")?;
        last = answer()?;
    }
    retry("the last pong", || last.poll())?;
    cpu.report(Part::PutSignal, size, rest + 1)
}

/// The sender's gets of one size from the receiver: after its go, the checked get, `--warmup`
/// untimed, then the timed ones one by one; then the parent's go-ahead.
fn gets(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
    stdin: &mut impl BufRead,
) -> Result<(), Error> {
    spoil(&mut bufs.dst.bytes()[..size], k);
    link.arrive(bufs, 1, None, "the receiver's go")?;
    link.get(bufs, size)?;
    verify(&bufs.dst.bytes()[..size], k, "one-sided get")?;
    for _ in 0..args.warmup {
        link.get(bufs, size)?;
    }
    let cpu = CpuClock::start()?;
    let times = (0..iters)
        .map(|_| link.get(bufs, size))
        .collect::<Result<Vec<_>, _>>()?;
    cpu.report(Part::Get, size, iters)?;
    wire::send(&Msg::Get(Completions::new(size, times)))?;
    wire::plugin_done(stdin)
}

/// The receiver's side of [`gets`]: its source filled with the pattern, a go, and nothing to do
/// until the parent says the sender is done — the fabric serves the reads (its CPU is counted).
fn serve_gets(
    args: &RankArgs,
    size: usize,
    k: usize,
    iters: u32,
    link: &Link<'_, '_>,
    bufs: &mut Buffers<'_>,
    stdin: &mut impl BufRead,
) -> Result<(), Error> {
    fill(&mut bufs.src.bytes()[..size], k);
    let cpu = CpuClock::start()?;
    let mut go = link.go(bufs)?;
    retry("the go signal", || go.poll())?;
    wire::plugin_done(stdin)?;
    cpu.report(Part::Get, size, 1 + args.warmup + iters)
}
