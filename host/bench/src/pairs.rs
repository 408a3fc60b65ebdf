//! `ncclwasm bench --single-process`, the child's side: one process owns both ends of one
//! connection of a plugin library — any NCCL net plugin, v8 to v12 — and times matched
//! `irecv` + `isend` + `test` pairs, so the figure is the plugin's own cost per message and
//! not a fabric's or a second process's. On the `soft` fabric the parent asks for in-process
//! delivery (`NCCL_WASM_SOFT_DELIVERY=in-process`): a work request is carried out by the thread
//! that posts it, so no socket, fabric thread or wake-up is timed. A plugin that opens
//! `libibverbs.so.1` gets the same fabric through the soft provider's stand-in first on
//! `LD_LIBRARY_PATH` (host/cli/README.md, "bench --single-process").
//!
//! Per size and per depth ([`DEPTHS`]: one pair in flight, then NCCL's eight), after a checked
//! pair and the warmup: `depth` receives posted, `depth` sends posted, all tested until done;
//! the batch is timed from the first post to the last completion and divided by `depth`. No
//! wait yields or sleeps between attempts (a yield is a system call, longer than the pair
//! itself); the clock is read for the stall bound only every [`CHECK_EVERY`] attempts.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args as ClapArgs;
use ncclwasm_abi::load::{Mr, RecvComm, Request, SendComm};
use ncclwasm_inspect::setup;

use super::rank::{connect_both, expect_size, open};
use super::wait::{plugin_fail, secs, stall};
use super::wire::{self, Msg, Observed, PairTiming};
use super::workload::{fill, largest, spoil, verify};
use crate::Error;

/// NCCL's `NCCL_STEPS`: the most requests a pipelined transfer keeps in flight per comm.
const MAX_DEPTH: usize = 8;

/// Pairs in flight: one (latency-bound) and [`MAX_DEPTH`] (a pipelined transfer).
pub const DEPTHS: [usize; 2] = [1, MAX_DEPTH];

/// Pairs run untimed before the first size (its warmup alone left it up to 1.6x slower than
/// the same size timed later in the run).
const SETTLE: Duration = Duration::from_millis(300);

/// Attempts between two looks at the clock while a wait spins.
const CHECK_EVERY: u32 = 1 << 12;

/// The tag of every send and receive (NCCL: the sender's rank).
const TAG: i32 = 1;

/// The child's command line, as the parent builds it (`ncclwasm bench-pairs`).
#[derive(Debug, ClapArgs)]
pub struct PairArgs {
    #[arg(long)]
    pub plugin: PathBuf,
    /// The NCCL device both ends use.
    #[arg(long)]
    pub device: i32,
    #[arg(long, value_delimiter = ',', required = true, value_parser = setup::parse_size)]
    pub sizes: Vec<u64>,
    /// Timed pairs per size and depth.
    #[arg(long)]
    pub pairs: u32,
    /// Untimed pairs per size and depth, after the checked one.
    #[arg(long)]
    pub warmup: u32,
}

pub fn run(args: &PairArgs) -> Result<(), Error> {
    measure(args)?;
    wire::send(&Msg::Done)?;
    Ok(())
}

/// Both ends of one connection and their registrations: the receive side holds [`MAX_DEPTH`]
/// messages of the largest size, each receive its own slice, as NCCL's buffers are.
struct Ends<'p, 'c> {
    tx: &'c SendComm<'p>,
    rx: &'c RecvComm<'p>,
    smr: Mr<'c>,
    rmr: Mr<'c>,
}

fn measure(args: &PairArgs) -> Result<(), Error> {
    let largest = largest(&args.sizes)?;
    let plugin = open(&args.plugin, args.device, &[])?;
    let (listen, mut handle) = plugin.listen(args.device).map_err(plugin_fail)?;
    let (tx, rx) = connect_both(&plugin, args.device, &listen, &mut handle)?;
    drop(listen);
    let mut ends = Ends {
        tx: &tx,
        rx: &rx,
        smr: tx.reg_mr(largest).map_err(plugin_fail)?,
        rmr: rx.reg_mr(largest * MAX_DEPTH).map_err(plugin_fail)?,
    };
    // Until the clock and the caches settle: the first size timed otherwise pays for them.
    let (start, mut sent) = (Instant::now(), 0u64);
    while start.elapsed() < SETTLE {
        batch(&ends, args.sizes[0] as usize, 1)?;
        sent += args.sizes[0];
    }
    for (k, &size) in args.sizes.iter().enumerate() {
        let size = size as usize;
        checked(&mut ends, size, k)?;
        sent += size as u64;
        for depth in DEPTHS {
            for _ in 0..args.warmup.div_ceil(depth as u32) {
                batch(&ends, size, depth)?;
            }
            let batches = args.pairs.div_ceil(depth as u32).max(1);
            let times = (0..batches)
                .map(|_| batch(&ends, size, depth))
                .collect::<Result<Vec<_>, _>>()?;
            sent += (size * depth) as u64 * u64::from(batches + args.warmup.div_ceil(depth as u32));
            wire::send(&Msg::Pairs(PairTiming::new(size, depth, times)))?;
        }
    }
    // What the connection ran, when the library says (ours does; another plugin need not).
    if plugin.reports_stats() {
        let stats = tx.stats().map_err(plugin_fail)?;
        wire::send(&Msg::Observed(Observed::new(stats, sent)))?;
    }
    Ok(())
}

/// The first pair of a size: every byte compared with the sender's pattern.
fn checked(ends: &mut Ends<'_, '_>, size: usize, k: usize) -> Result<(), Error> {
    fill(&mut ends.smr.bytes()[..size], k);
    spoil(&mut ends.rmr.bytes()[..size], k);
    batch(ends, size, 1)?;
    verify(&ends.rmr.bytes()[..size], k, "the single-process pair")
}

/// `depth` matched pairs: the receives, then the sends, then every request tested until done;
/// the time from the first post to the last completion.
fn batch(ends: &Ends<'_, '_>, size: usize, depth: usize) -> Result<Duration, Error> {
    let (smr, rmr) = (&ends.smr, &ends.rmr);
    let start = Instant::now();
    let mut reqs: [Option<Request<'_>>; 2 * MAX_DEPTH] = Default::default();
    let (recvs, sends) = reqs[..2 * depth].split_at_mut(depth);
    for (i, slot) in recvs.iter_mut().enumerate() {
        let at = i * size..(i + 1) * size;
        *slot = Some(spin("irecv", || {
            ends.rx.irecv(rmr, at.clone(), TAG).map_err(plugin_fail)
        })?);
    }
    for slot in sends {
        *slot = Some(spin("isend", || {
            ends.tx.isend(smr, 0..size, TAG).map_err(plugin_fail)
        })?);
    }
    let mut pending = 2 * depth;
    spin("test", || {
        for r in reqs[..2 * depth].iter_mut() {
            if let Some(req) = r
                && let Some(got) = req.test().map_err(plugin_fail)?
            {
                expect_size("single-process pair", size, got)?;
                *r = None;
                pending -= 1;
            }
        }
        Ok((pending == 0).then_some(()))
    })?;
    Ok(start.elapsed())
}

/// Calls `attempt` until it yields, without yielding the CPU in between, for at most
/// [`stall`] after the first [`CHECK_EVERY`] attempts (the clock read every [`CHECK_EVERY`]).
fn spin<T>(what: &str, mut attempt: impl FnMut() -> Result<Option<T>, Error>) -> Result<T, Error> {
    // Started at the first look: most waits end long before, and a clock read is a tenth of
    // the cheapest plugin's pair.
    let mut start = None;
    let mut n = 0u32;
    loop {
        if let Some(v) = attempt()? {
            return Ok(v);
        }
        n = n.wrapping_add(1);
        if n.is_multiple_of(CHECK_EVERY)
            && start.get_or_insert_with(Instant::now).elapsed() > stall()
        {
            return Err(Error::run(format!(
                "{what} did not complete within {}",
                secs(stall())
            )));
        }
    }
}
