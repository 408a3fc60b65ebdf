//! One rank of `ncclwasm bench`: a child process the parent starts twice (receiver and sender).
//!
//! It drives the plugin library as NCCL's proxy does — `init`, `devices`, `getProperties`,
//! `makeVDevice` when the plan runs on a vNIC, `listen` / `connect` + `accept` loops with the
//! 128-byte handles relayed by the parent (each rank has one send comm and one recv comm, as a
//! ring neighbour in NCCL has), `regMr`, `isend`/`irecv`/`test` loops — first a stream from the
//! sender to the receiver (bandwidth), then a ping-pong of one message each way (latency), each
//! size followed at once by the same traffic over a plain TCP connection (the baseline) — at
//! the end the sender asks its connection what it ran (`ncclwasm_send_comm_stats`); then both
//! ranks drive the library's one-sided table ([`super::one_sided`]), and last both set up
//! `--connections` more ([`super::scale`]). The TCP baseline's half is [`super::tcp`], the bytes
//! sent and checked [`super::workload`]. It talks to the parent in the JSON lines of
//! [`super::wire`]. Every wait is bounded by [`super::wait::stall`] without progress, so a rank
//! whose peer died stops by itself with one `error:` line.

use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

use ncclwasm_abi::load::{HANDLE_BYTES, ListenComm, Mr, Plugin, RecvComm, Request, SendComm};

use super::cpu::CpuClock;
use super::tcp::{tcp_connect, tcp_ping, tcp_pong, tcp_stream};
use super::wait::{plugin_fail, retry, stream};
use super::wire::{self, DeviceLine, Msg, Observed, Part, RankArgs, Role, RoundTrips, Timing};
use super::workload::{fill, iterations, largest, patterned, spoil, verify};
use super::{one_sided, scale};
use crate::Error;

/// The tag the sender uses (NCCL: its rank).
const TAG: i32 = 1;

pub fn run(args: &RankArgs) -> Result<(), Error> {
    let mut stdin = std::io::stdin().lock();
    measure(args, &mut stdin)?;
    wire::send(&Msg::Done)?;
    Ok(())
}

/// What a rank's ping-pong runs on: its send comm and recv comm, and the memory registered on
/// each.
struct Ends<'a, 'c, 'p> {
    tx: &'a SendComm<'p>,
    smr: &'a mut Mr<'c>,
    rx: &'a RecvComm<'p>,
    rmr: &'a mut Mr<'c>,
}

/// A transfer that completed with another size than posted.
pub(super) fn expect_size(what: &str, size: usize, got: usize) -> Result<(), Error> {
    if got == size {
        Ok(())
    } else {
        Err(Error::run(format!("{what}: {size} bytes went as {got}")))
    }
}

/// `init`, the devices (fusing `fuse` first, as NCCL core would, into `device`) and the
/// `Hello` line.
pub(super) fn open(path: &Path, device: i32, fuse: &[i32]) -> Result<Plugin, Error> {
    let mut plugin = Plugin::open(path).map_err(plugin_fail)?;
    plugin.init().map_err(plugin_fail)?;
    let n = plugin.devices().map_err(plugin_fail)?;
    if !fuse.is_empty() {
        let d = plugin.make_vdevice(fuse).map_err(plugin_fail)?;
        if d != device {
            return Err(Error::run(format!(
                "the plugin made vNIC {d}, the plan expected device {device}"
            )));
        }
    }
    let total = plugin.devices().map_err(plugin_fail)?;
    if device < 0 || device >= total {
        return Err(Error::run(format!(
            "the plugin has {total} device(s) ({n} physical); device {device} is not one"
        )));
    }
    let devices = (0..total)
        .map(|d| {
            plugin.properties(d).map(|p| DeviceLine {
                name: p.name,
                speed_mbps: p.speed_mbps,
                children: p.children,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(plugin_fail)?;
    wire::send(&Msg::Hello {
        abi: plugin.version(),
        devices,
    })?;
    Ok(plugin)
}

/// This rank's send comm (to the peer's listener) and recv comm (the peer's connect), both
/// advanced in one loop as NCCL's proxy does, so neither rank waits for the other's half first.
pub(super) fn connect_both<'p>(
    plugin: &'p Plugin,
    device: i32,
    listen: &ListenComm<'p>,
    peer: &mut [u8; HANDLE_BYTES],
) -> Result<(SendComm<'p>, RecvComm<'p>), Error> {
    let (mut tx, mut rx) = (None, None);
    retry("connect and accept", || {
        if tx.is_none() {
            tx = plugin.connect(device, peer).map_err(plugin_fail)?;
        }
        if rx.is_none() {
            rx = listen.accept().map_err(plugin_fail)?;
        }
        Ok(if tx.is_some() && rx.is_some() {
            tx.take().zip(rx.take())
        } else {
            None
        })
    })
}

/// Whether each of `--repeats` is the first of its size: only the first checks a transfer and
/// runs the warmup, the later ones find the path warm.
fn repeats(args: &RankArgs) -> impl Iterator<Item = bool> {
    (0..args.repeats.max(1)).map(|r| r == 0)
}

/// Both transports, side by side: the plugin's comms, then the TCP connection, then each size
/// through the plugin and at once over TCP, `--repeats` times in turn — the two figures of a
/// repeat are measured seconds apart, not minutes, so a host whose load changes meanwhile (a
/// shared CI machine) moves both alike, and a repeat that drew a bad moment is one of several.
fn measure(args: &RankArgs, stdin: &mut impl BufRead) -> Result<(), Error> {
    let (bw, lat) = (largest(&args.sizes)?, largest(&args.latency_sizes)?);
    let plugin = open(&args.plugin, args.device, &args.fuse)?;
    let (listen, handle) = plugin.listen(args.device).map_err(plugin_fail)?;
    wire::send(&Msg::Handle(wire::hex(&handle)))?;
    let mut peer = wire::read_handle(stdin, "peer's listen handle")?;
    let (tx, rx) = connect_both(&plugin, args.device, &listen, &mut peer)?;
    drop(listen); // as NCCL: closeListen right after accept
    // The streaming side's registration holds the largest message of either part.
    let (smr, rmr) = match args.role {
        Role::Recv => (tx.reg_mr(lat), rx.reg_mr(bw.max(lat))),
        Role::Send => (tx.reg_mr(bw.max(lat)), rx.reg_mr(lat)),
    };
    let (mut smr, mut rmr) = (smr.map_err(plugin_fail)?, rmr.map_err(plugin_fail)?);
    let mut ends = Ends {
        tx: &tx,
        smr: &mut smr,
        rx: &rx,
        rmr: &mut rmr,
    };
    let mut tcp = tcp_connect(args, stdin)?;
    // The TCP messages' buffer, and the sender's for the echo.
    let (mut buf, mut back) = (vec![0u8; bw.max(lat)], vec![0u8; lat]);
    let mut sent = 0;
    for (size, k) in patterned(&args.sizes, 0) {
        for first in repeats(args) {
            sent += plugin_stream(args, size, k, first, &mut ends)?;
            tcp_stream(args, k, first, &mut tcp, &mut buf[..size])?;
        }
    }
    for (size, k) in patterned(&args.latency_sizes, args.sizes.len()) {
        let msg = &mut buf[..size];
        for first in repeats(args) {
            match args.role {
                Role::Recv => {
                    pong(args, size, k, first, &mut ends)?;
                    tcp_pong(args, k, first, &mut tcp, msg)?;
                }
                Role::Send => {
                    sent += ping(args, size, k, first, &mut ends)?;
                    tcp_ping(args, k, first, &mut tcp, msg, &mut back[..size])?;
                }
            }
        }
    }
    if args.role == Role::Send {
        let stats = tx.stats().map_err(plugin_fail)?;
        wire::send(&Msg::Observed(Observed::new(stats, sent as u64)))?;
    }
    wire::plugin_done(stdin)?;
    one_sided::run(&plugin, args, stdin)?;
    scale::run(&plugin, args.role, args.device, args.connections, stdin)
}

/// One repeat of one size of the bandwidth part through the plugin, from the sender's send comm
/// to the receiver's recv comm: the checked transfer and `--warmup` untimed ones when it is the
/// `first`, then the timed ones, [`super::wait::WINDOW`] in flight, timed by the receiver from
/// its first post to its last completion.
/// Returns the bytes `test` reported sent (none on the receiver).
fn plugin_stream(
    args: &RankArgs,
    size: usize,
    k: usize,
    first: bool,
    ends: &mut Ends<'_, '_, '_>,
) -> Result<usize, Error> {
    let iters = iterations(size as u64, args.iters, args.repeats);
    let warmup = if first { args.warmup } else { 0 };
    match args.role {
        Role::Recv => {
            let (rx, mr) = (ends.rx, &mut *ends.rmr);
            if first {
                spoil(&mut mr.bytes()[..size], k);
                let got = stream(1, || rx.irecv(mr, 0..size, TAG).map_err(plugin_fail))?;
                expect_size("plugin", size, got)?;
                verify(&mr.bytes()[..size], k, "plugin")?;
            }
            stream(warmup, || rx.irecv(mr, 0..size, TAG).map_err(plugin_fail))?;
            let cpu = CpuClock::start()?;
            let start = Instant::now();
            stream(iters, || rx.irecv(mr, 0..size, TAG).map_err(plugin_fail))?;
            let timing = Timing::since(size, iters, start, first);
            cpu.report(Part::Plugin, size, iters)?;
            wire::send(&Msg::Plugin(timing))?;
            Ok(0)
        }
        Role::Send => {
            let (tx, mr) = (ends.tx, &mut *ends.smr);
            let mut got = 0;
            if first {
                fill(&mut mr.bytes()[..size], k);
                got = stream(1, || tx.isend(mr, 0..size, TAG).map_err(plugin_fail))?;
                expect_size("plugin", size, got)?;
            }
            let cpu = CpuClock::start()?;
            let rest = stream(warmup + iters, || {
                tx.isend(mr, 0..size, TAG).map_err(plugin_fail)
            })?;
            cpu.report(Part::Plugin, size, warmup + iters)?;
            Ok(got + rest)
        }
    }
}

/// The sender's half of one repeat of one size of the ping-pong through the plugin: when it is
/// the `first`, the checked exchange (its pattern out, the receiver's echo back and compared)
/// and `--latency-warmup` untimed round trips; then `--latency-iters` timed one by one.
/// Returns the bytes its pings carried.
fn ping(
    args: &RankArgs,
    size: usize,
    k: usize,
    first: bool,
    ends: &mut Ends<'_, '_, '_>,
) -> Result<usize, Error> {
    let mut untimed = 0;
    if first {
        fill(&mut ends.smr.bytes()[..size], k);
        spoil(&mut ends.rmr.bytes()[..size], k);
        trip(ends, size)?;
        verify(&ends.rmr.bytes()[..size], k, "plugin ping-pong, the echo")?;
        for _ in 0..args.latency_warmup {
            trip(ends, size)?;
        }
        untimed = 1 + args.latency_warmup;
    }
    let cpu = CpuClock::start()?;
    let trips = (0..args.latency_iters)
        .map(|_| trip(ends, size))
        .collect::<Result<Vec<_>, _>>()?;
    cpu.report(Part::PluginPingPong, size, args.latency_iters)?;
    wire::send(&Msg::PluginPingPong(RoundTrips::new(size, trips, first)))?;
    Ok(size * (untimed + args.latency_iters) as usize)
}

/// One round trip through the plugin, timed: the ping is posted, then the receive of the pong
/// (its clear-to-send travels while the peer answers), both tested in one loop until done.
fn trip(ends: &Ends<'_, '_, '_>, size: usize) -> Result<Duration, Error> {
    let Ends { tx, rx, .. } = ends;
    let (smr, rmr) = (&*ends.smr, &*ends.rmr);
    let start = Instant::now();
    let mut ping = retry("isend", || tx.isend(smr, 0..size, TAG).map_err(plugin_fail))?;
    let mut pong = retry("irecv", || rx.irecv(rmr, 0..size, TAG).map_err(plugin_fail))?;
    let (mut sent, mut got) = (None, None);
    let (sent, got) = retry("a round trip", || {
        if sent.is_none() {
            sent = ping.test().map_err(plugin_fail)?;
        }
        if got.is_none() {
            got = pong.test().map_err(plugin_fail)?;
        }
        Ok(sent.zip(got))
    })?;
    let elapsed = start.elapsed();
    expect_size("plugin ping", size, sent)?;
    expect_size("plugin pong", size, got)?;
    Ok(elapsed)
}

/// The receiver's half of one repeat of one size of the ping-pong through the plugin: it
/// answers each ping with a pong of the same size; when it is the `first`, it checks the first
/// ping and echoes exactly what arrived, and answers the warmup's too. The next receive is
/// posted right after each pong, so the next ping finds its clear-to-send waiting, as it would
/// in a pipeline NCCL keeps busy.
fn pong(
    args: &RankArgs,
    size: usize,
    k: usize,
    first: bool,
    ends: &mut Ends<'_, '_, '_>,
) -> Result<(), Error> {
    let (tx, rx) = (ends.tx, ends.rx);
    if first {
        spoil(&mut ends.rmr.bytes()[..size], k);
    }
    let got = stream(1, || rx.irecv(ends.rmr, 0..size, TAG).map_err(plugin_fail))?;
    expect_size("plugin ping", size, got)?;
    if first {
        verify(&ends.rmr.bytes()[..size], k, "plugin ping-pong, the ping")?;
        ends.smr.bytes()[..size].copy_from_slice(&ends.rmr.bytes()[..size]);
    }
    let (smr, rmr) = (&*ends.smr, &*ends.rmr);
    let post = || retry("irecv", || rx.irecv(rmr, 0..size, TAG).map_err(plugin_fail));
    // The receive of the next ping; none before the answer to the one just received.
    let mut next: Option<Request<'_>> = None;
    // The pings after the one received: the checked one's warmup and the timed ones.
    let rest = if first {
        args.latency_warmup + args.latency_iters
    } else {
        args.latency_iters - 1
    };
    let cpu = CpuClock::start()?;
    for i in 0..=rest {
        if let Some(mut ping) = next.take() {
            let got = retry("a ping", || ping.test().map_err(plugin_fail))?;
            expect_size("plugin ping", size, got)?;
        }
        let mut answer = retry("isend", || tx.isend(smr, 0..size, TAG).map_err(plugin_fail))?;
        if i < rest {
            next = Some(post()?);
        }
        let sent = retry("a pong", || answer.test().map_err(plugin_fail))?;
        expect_size("plugin pong", size, sent)?;
    }
    cpu.report(Part::PluginPingPong, size, rest + 1)
}
