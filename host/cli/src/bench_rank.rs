//! One rank of `ncclwasm bench`: a child process the parent starts twice (receiver and sender).
//!
//! It drives the plugin library as NCCL's proxy does — `init`, `devices`, `getProperties`,
//! `makeVDevice` when the plan runs on a vNIC, `listen` / `connect` + `accept` loops with the
//! 128-byte handles relayed by the parent (each rank has one send comm and one recv comm, as a
//! ring neighbour in NCCL has), `regMr`, `isend`/`irecv`/`test` loops — first a stream from the
//! sender to the receiver (bandwidth), then a ping-pong of one message each way (latency), each
//! size followed at once by the same traffic over a plain TCP connection (the baseline) — at
//! the end the sender asks its connection what it ran (`ncclwasm_send_comm_stats`), and last
//! both ranks set up `--connections` more ([`crate::bench_scale`]). It talks to
//! the parent in JSON lines on stdout ([`Msg`]) and reads the peer's handle, the TCP port and
//! the end of the run from stdin. Every wait is bounded by [`STALL`], so a rank whose peer died
//! stops by itself with one `error:` line.

use std::collections::VecDeque;
use std::io::{BufRead, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, ValueEnum};
use ncclwasm_abi::SendStats;
use ncclwasm_abi::load::{
    HANDLE_BYTES, ListenComm, LoadError, Mr, Plugin, RecvComm, Request, SendComm,
};
use serde::{Deserialize, Serialize};

use crate::bench_scale::{self, Scale};
use crate::fail::{Fail, Outcome};
use crate::setup;

/// The longest any single wait may take (a transfer making no progress, a peer not
/// connecting) before the rank gives up.
pub const STALL: Duration = Duration::from_secs(30);

/// Requests in flight per side while streaming: NCCL's `NCCL_STEPS`.
const WINDOW: usize = 8;

/// The tag the sender uses (NCCL: its rank).
const TAG: i32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Recv,
    Send,
}

#[derive(Debug, ClapArgs)]
pub struct Args {
    #[arg(long)]
    pub role: Role,
    #[arg(long)]
    pub plugin: PathBuf,
    /// The NCCL device to use, after fusing `--fuse`.
    #[arg(long)]
    pub device: i32,
    /// Physical devices to fuse with `makeVDevice` first, as NCCL core would.
    #[arg(long, value_delimiter = ',')]
    pub fuse: Vec<i32>,
    #[arg(long, value_delimiter = ',', required = true, value_parser = setup::parse_size)]
    pub sizes: Vec<u64>,
    #[arg(long)]
    pub iters: Option<u32>,
    #[arg(long)]
    pub warmup: u32,
    /// The ping-pong's sizes.
    #[arg(long, value_delimiter = ',', required = true, value_parser = setup::parse_size)]
    pub latency_sizes: Vec<u64>,
    #[arg(long)]
    pub latency_iters: u32,
    #[arg(long)]
    pub latency_warmup: u32,
    /// Connections for the connection-scale part (0: none).
    #[arg(long, default_value_t = 0)]
    pub connections: u32,
}

/// One line from a rank to the parent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Msg {
    /// After `init`: the ABI version and the devices as `getProperties` reports them.
    Hello {
        abi: u32,
        devices: Vec<DeviceLine>,
    },
    /// This rank's listen handle, hex: the parent hands it to the other rank, which connects.
    Handle(String),
    /// The receiver's timing of one size streamed through the plugin.
    Plugin(Timing),
    /// The sender's ping-pong of one size through the plugin.
    PluginPingPong(RoundTrips),
    /// The sender's connection after its last send through the plugin.
    Observed(Observed),
    /// This rank's requests through the plugin are all done; it closes its comms when the
    /// parent answers [`PLUGIN_DONE`], once both ranks said so.
    PluginDone,
    /// The receiver's TCP port for the baseline.
    TcpPort(u16),
    /// The receiver's timing of one size streamed over TCP.
    Tcp(Timing),
    /// The sender's ping-pong of one size over TCP.
    TcpPingPong(RoundTrips),
    /// The receiver's listen handles for the connection-scale part, hex: relayed to the sender
    /// as one comma-separated line.
    Handles(Vec<String>),
    /// This rank's connection-scale part, all established.
    Scale(Scale),
    /// Seconds this rank took to close its connection-scale comms.
    ScaleClosed(f64),
    Done,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceLine {
    pub name: String,
    pub speed_mbps: i32,
    /// The physical devices it is made of.
    pub children: Vec<i32>,
}

/// What the sender's connection ran and carried, as the plugin reports it
/// (`ncclwasm_send_comm_stats`): the plan, who made it and why, and the bytes of each QP.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// The policy (`name@version`), the built-in default, or the built-in default standing in
    /// for a policy's plan the handshake refused.
    pub source: String,
    pub reason: String,
    /// QPs each message is striped over.
    pub stripe_width: u32,
    pub align: u32,
    pub adaptive_routing: bool,
    pub ar_threshold: u64,
    pub tc: u8,
    pub sl: u8,
    pub fifo_tc: u8,
    pub ece: bool,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub qps: Vec<ObservedQp>,
    /// The QPs' bytes, summed.
    pub posted_bytes: u64,
    /// The bytes the sender's `test` reported sent through the plugin, every transfer counted.
    pub sent_bytes: u64,
}

/// One QP of the plan the connection ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObservedQp {
    /// `device:port` on this side and on the peer's.
    pub local: String,
    pub remote: String,
    pub weight: u32,
    /// Payload bytes the plugin posted on it.
    pub bytes: u64,
    /// `bytes` / `posted_bytes` (0 when nothing was posted).
    pub share: f64,
}

impl Observed {
    fn new(stats: SendStats, sent_bytes: u64) -> Observed {
        let posted_bytes = stats.qps.iter().map(|q| q.bytes).sum();
        Observed {
            source: stats.source,
            reason: stats.reason,
            stripe_width: stats.stripe_width,
            align: stats.align,
            adaptive_routing: stats.adaptive_routing,
            ar_threshold: stats.ar_threshold,
            tc: stats.tc,
            sl: stats.sl,
            fifo_tc: stats.fifo_tc,
            ece: stats.ece,
            timeout: stats.timeout,
            retry_cnt: stats.retry_cnt,
            qps: stats
                .qps
                .iter()
                .map(|q| ObservedQp {
                    local: q.local.to_string(),
                    remote: q.remote.to_string(),
                    weight: q.weight,
                    bytes: q.bytes,
                    share: if posted_bytes == 0 {
                        0.0
                    } else {
                        q.bytes as f64 / posted_bytes as f64
                    },
                })
                .collect(),
            posted_bytes,
            sent_bytes,
        }
    }
}

/// `iters` timed transfers of `size` bytes took `secs`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub size: u64,
    pub iters: u32,
    pub secs: f64,
    /// Bytes of the first transfer the receiver compared with the sender's pattern.
    pub checked_bytes: u64,
}

impl Timing {
    /// `iters` transfers of `size` bytes, timed from `start` until now; the first transfer's
    /// bytes were checked.
    fn since(size: usize, iters: u32, start: Instant) -> Timing {
        Timing {
            size: size as u64,
            iters,
            secs: start.elapsed().as_secs_f64(),
            checked_bytes: size as u64,
        }
    }
}

/// `iters` round trips of `size` bytes each way, each timed alone by the rank that starts them
/// (the sender), reported one way: half the round trip.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundTrips {
    pub size: u64,
    pub iters: u32,
    /// Half the median round trip: robust to the odd descheduled trip on a busy host.
    pub median_secs: f64,
    /// Half the mean round trip.
    pub mean_secs: f64,
    /// Bytes of the first exchange the sender compared with its pattern: the receiver echoes
    /// what arrived, so both directions are checked (the receiver checks the ping as well).
    pub checked_bytes: u64,
}

impl RoundTrips {
    /// `trips` must not be empty (`--latency-iters` is at least 1).
    fn new(size: usize, mut trips: Vec<Duration>) -> RoundTrips {
        trips.sort_unstable();
        let n = trips.len();
        let median = (trips[(n - 1) / 2] + trips[n / 2]).as_secs_f64() / 2.0;
        let mean = trips.iter().sum::<Duration>().as_secs_f64() / n as f64;
        RoundTrips {
            size: size as u64,
            iters: n as u32,
            median_secs: median / 2.0,
            mean_secs: mean / 2.0,
            checked_bytes: 2 * size as u64,
        }
    }
}

/// What the parent tells both ranks once each has reported [`Msg::PluginDone`].
pub const PLUGIN_DONE: &str = "plugin-done";

/// Timed iterations for `size`: `--iters`, or about 128 MiB per size (at least 4, at most 200)
/// so a default run stays short on slow loopback.
pub fn iterations(size: u64, iters: Option<u32>) -> u32 {
    iters.unwrap_or_else(|| (((128u64 << 20) / size.max(1)).clamp(4, 200)) as u32)
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let mut stdin = std::io::stdin().lock();
    measure(args, &mut stdin)?;
    send(&Msg::Done)?;
    Ok(Outcome::success(String::new()))
}

/// The largest of `sizes`, as a buffer length (at least 1: a registration is never empty).
fn largest(sizes: &[u64]) -> Result<usize, Fail> {
    usize::try_from(sizes.iter().copied().max().unwrap_or(0).max(1))
        .map_err(|_| Fail::trouble("a size does not fit in memory"))
}

pub(crate) fn send(msg: &Msg) -> Result<(), Fail> {
    let line = serde_json::to_string(msg).map_err(|e| Fail::trouble(format!("encode: {e}")))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Fail::trouble(format!("the parent is gone: {e}")))
}

/// One line from the parent; EOF means it is gone.
pub(crate) fn read_line(stdin: &mut impl BufRead, what: &str) -> Result<String, Fail> {
    let mut line = String::new();
    match stdin.read_line(&mut line) {
        Ok(0) | Err(_) => Err(Fail::trouble(format!(
            "the parent closed stdin before sending the {what}"
        ))),
        Ok(_) => Ok(line.trim().to_owned()),
    }
}

pub(crate) fn plugin_fail(e: LoadError) -> Fail {
    Fail::trouble(format!("plugin: {e}"))
}

/// The byte at `i` of the checked transfer of pattern number `k` (one per size and part): differs
/// between them, so stale data from an earlier transfer cannot pass.
fn pattern(i: usize, k: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11) ^ k.wrapping_mul(29)) as u8
}

fn fill(buf: &mut [u8], k: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(i, k);
    }
}

/// Bytes that cannot pass the check of pattern `k`: what a receive buffer holds before a checked
/// transfer, so one that never arrived fails.
fn spoil(buf: &mut [u8], k: usize) {
    buf.fill(!pattern(0, k));
}

fn verify(buf: &[u8], k: usize, what: &str) -> Result<(), Fail> {
    match buf.iter().enumerate().find(|&(i, &b)| b != pattern(i, k)) {
        None => Ok(()),
        Some((i, &b)) => Err(Fail::trouble(format!(
            "{what}: byte {i} of {} is {b:#04x}, expected {:#04x}",
            buf.len(),
            pattern(i, k)
        ))),
    }
}

/// `sizes` with their pattern numbers, counted from `first`: the bandwidth part's from 0, the
/// ping-pong's after them, so no two checked transfers of a run look alike.
fn patterned(sizes: &[u64], first: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    sizes
        .iter()
        .enumerate()
        .map(move |(k, &size)| (size as usize, first + k))
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
fn expect_size(what: &str, size: usize, got: usize) -> Result<(), Fail> {
    if got == size {
        Ok(())
    } else {
        Err(Fail::trouble(format!("{what}: {size} bytes went as {got}")))
    }
}

/// Calls `attempt` until it yields, for at most [`STALL`].
fn retry<T>(what: &str, mut attempt: impl FnMut() -> Result<Option<T>, Fail>) -> Result<T, Fail> {
    let start = Instant::now();
    loop {
        if let Some(v) = attempt()? {
            return Ok(v);
        }
        if start.elapsed() > STALL {
            return Err(Fail::trouble(format!(
                "{what} did not complete within {} s (is the other rank alive?)",
                STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
}

/// `n` transfers posted by `post`, at most [`WINDOW`] in flight, each tested to completion;
/// returns the sizes they reported, summed.
fn stream<'m>(
    n: u32,
    mut post: impl FnMut() -> Result<Option<Request<'m>>, Fail>,
) -> Result<usize, Fail> {
    let mut inflight: VecDeque<Request<'m>> = VecDeque::new();
    let (mut posted, mut total) = (0, 0);
    let mut progress = Instant::now();
    while posted < n || !inflight.is_empty() {
        if posted < n
            && inflight.len() < WINDOW
            && let Some(r) = post()?
        {
            inflight.push_back(r);
            posted += 1;
            progress = Instant::now();
            continue;
        }
        if let Some(front) = inflight.front_mut()
            && let Some(size) = front.test().map_err(plugin_fail)?
        {
            total += size;
            inflight.pop_front();
            progress = Instant::now();
            continue;
        }
        if progress.elapsed() > STALL {
            return Err(Fail::trouble(format!(
                "no transfer completed for {} s (is the other rank alive?)",
                STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
    Ok(total)
}

/// `init`, the devices (fusing `--fuse` first, as NCCL core would) and the `Hello` line.
fn open(args: &Args) -> Result<Plugin, Fail> {
    let mut plugin = Plugin::open(&args.plugin).map_err(plugin_fail)?;
    plugin.init().map_err(plugin_fail)?;
    let n = plugin.devices().map_err(plugin_fail)?;
    if !args.fuse.is_empty() {
        let d = plugin.make_vdevice(&args.fuse).map_err(plugin_fail)?;
        if d != args.device {
            return Err(Fail::trouble(format!(
                "the plugin made vNIC {d}, the plan expected device {}",
                args.device
            )));
        }
    }
    let total = plugin.devices().map_err(plugin_fail)?;
    if args.device < 0 || args.device >= total {
        return Err(Fail::trouble(format!(
            "the plugin has {total} device(s) ({n} physical); device {} is not one",
            args.device
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
    send(&Msg::Hello {
        abi: plugin.version(),
        devices,
    })?;
    Ok(plugin)
}

/// This rank's send comm (to the peer's listener) and recv comm (the peer's connect), both
/// advanced in one loop as NCCL's proxy does, so neither rank waits for the other's half first.
fn connect_both<'p>(
    plugin: &'p Plugin,
    device: i32,
    listen: &ListenComm<'p>,
    peer: &mut [u8; HANDLE_BYTES],
) -> Result<(SendComm<'p>, RecvComm<'p>), Fail> {
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

/// Both transports, side by side: the plugin's comms, then the TCP connection, then each size
/// through the plugin and at once over TCP — the two figures of a row are measured seconds
/// apart, not minutes, so a host whose load changes meanwhile (a shared CI machine) moves both
/// alike.
fn measure(args: &Args, stdin: &mut impl BufRead) -> Result<(), Fail> {
    let (bw, lat) = (largest(&args.sizes)?, largest(&args.latency_sizes)?);
    let plugin = open(args)?;
    let (listen, handle) = plugin.listen(args.device).map_err(plugin_fail)?;
    send(&Msg::Handle(hex(&handle)))?;
    let line = read_line(stdin, "peer's listen handle")?;
    let mut peer = unhex(&line).ok_or_else(|| Fail::trouble(format!("not a handle: {line:?}")))?;
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
        sent += plugin_stream(args, size, k, &mut ends)?;
        tcp_stream(args, k, &mut tcp, &mut buf[..size])?;
    }
    for (size, k) in patterned(&args.latency_sizes, args.sizes.len()) {
        let msg = &mut buf[..size];
        match args.role {
            Role::Recv => {
                pong(args, size, k, &mut ends)?;
                tcp_pong(args, k, &mut tcp, msg)?;
            }
            Role::Send => {
                sent += ping(args, size, k, &mut ends)?;
                tcp_ping(args, k, &mut tcp, msg, &mut back[..size])?;
            }
        }
    }
    if args.role == Role::Send {
        let stats = tx.stats().map_err(plugin_fail)?;
        send(&Msg::Observed(Observed::new(stats, sent as u64)))?;
    }
    plugin_done(stdin)?;
    bench_scale::run(&plugin, args, stdin)
}

/// Waits, registrations and comms still open, until the parent says both ranks are done, as
/// NCCL tears a connection down only after both sides' operations completed: the peer's last
/// clear-to-send writes may not be acknowledged yet, and closing under them fails them (RC
/// semantics).
fn plugin_done(stdin: &mut impl BufRead) -> Result<(), Fail> {
    send(&Msg::PluginDone)?;
    expect_line(stdin, PLUGIN_DONE)
}

/// The parent's next line must be `expected`.
pub(crate) fn expect_line(stdin: &mut impl BufRead, expected: &str) -> Result<(), Fail> {
    let line = read_line(stdin, expected)?;
    if line != expected {
        return Err(Fail::trouble(format!(
            "expected {expected:?} from the parent, got {line:?}"
        )));
    }
    Ok(())
}

/// One size of the bandwidth part through the plugin, from the sender's send comm to the
/// receiver's recv comm: the checked transfer, `--warmup` untimed ones, then the timed ones,
/// [`WINDOW`] in flight, timed by the receiver from its first post to its last completion.
/// Returns the bytes `test` reported sent (none on the receiver).
fn plugin_stream(
    args: &Args,
    size: usize,
    k: usize,
    ends: &mut Ends<'_, '_, '_>,
) -> Result<usize, Fail> {
    let iters = iterations(size as u64, args.iters);
    match args.role {
        Role::Recv => {
            let (rx, mr) = (ends.rx, &mut *ends.rmr);
            spoil(&mut mr.bytes()[..size], k);
            let got = stream(1, || rx.irecv(mr, 0..size, TAG).map_err(plugin_fail))?;
            expect_size("plugin", size, got)?;
            verify(&mr.bytes()[..size], k, "plugin")?;
            stream(args.warmup, || {
                rx.irecv(mr, 0..size, TAG).map_err(plugin_fail)
            })?;
            let start = Instant::now();
            stream(iters, || rx.irecv(mr, 0..size, TAG).map_err(plugin_fail))?;
            send(&Msg::Plugin(Timing::since(size, iters, start)))?;
            Ok(0)
        }
        Role::Send => {
            let (tx, mr) = (ends.tx, &mut *ends.smr);
            fill(&mut mr.bytes()[..size], k);
            let got = stream(1, || tx.isend(mr, 0..size, TAG).map_err(plugin_fail))?;
            expect_size("plugin", size, got)?;
            Ok(got
                + stream(args.warmup + iters, || {
                    tx.isend(mr, 0..size, TAG).map_err(plugin_fail)
                })?)
        }
    }
}

/// The sender's half of one size of the ping-pong through the plugin: the checked exchange
/// (its pattern out, the receiver's echo back and compared), `--latency-warmup` untimed round
/// trips, then `--latency-iters` timed one by one. Returns the bytes its pings carried.
fn ping(args: &Args, size: usize, k: usize, ends: &mut Ends<'_, '_, '_>) -> Result<usize, Fail> {
    fill(&mut ends.smr.bytes()[..size], k);
    spoil(&mut ends.rmr.bytes()[..size], k);
    trip(ends, size)?;
    verify(&ends.rmr.bytes()[..size], k, "plugin ping-pong, the echo")?;
    for _ in 0..args.latency_warmup {
        trip(ends, size)?;
    }
    let trips = (0..args.latency_iters)
        .map(|_| trip(ends, size))
        .collect::<Result<Vec<_>, _>>()?;
    send(&Msg::PluginPingPong(RoundTrips::new(size, trips)))?;
    Ok(size * (1 + args.latency_warmup + args.latency_iters) as usize)
}

/// One round trip through the plugin, timed: the ping is posted, then the receive of the pong
/// (its clear-to-send travels while the peer answers), both tested in one loop until done.
fn trip(ends: &Ends<'_, '_, '_>, size: usize) -> Result<Duration, Fail> {
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

/// The receiver's half of one size of the ping-pong through the plugin: it checks the first
/// ping and echoes exactly what arrived, then answers each ping with a pong of the same size.
/// The next receive is posted right after each pong, so the next ping finds its clear-to-send
/// waiting, as it would in a pipeline NCCL keeps busy.
fn pong(args: &Args, size: usize, k: usize, ends: &mut Ends<'_, '_, '_>) -> Result<(), Fail> {
    let (tx, rx) = (ends.tx, ends.rx);
    spoil(&mut ends.rmr.bytes()[..size], k);
    let got = stream(1, || rx.irecv(ends.rmr, 0..size, TAG).map_err(plugin_fail))?;
    expect_size("plugin ping", size, got)?;
    verify(&ends.rmr.bytes()[..size], k, "plugin ping-pong, the ping")?;
    ends.smr.bytes()[..size].copy_from_slice(&ends.rmr.bytes()[..size]);
    let (smr, rmr) = (&*ends.smr, &*ends.rmr);
    let post = || retry("irecv", || rx.irecv(rmr, 0..size, TAG).map_err(plugin_fail));
    // The receive of the next ping; none before the echo.
    let mut next: Option<Request<'_>> = None;
    let rest = args.latency_warmup + args.latency_iters;
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
    Ok(())
}

fn io_fail(what: &str) -> impl Fn(std::io::Error) -> Fail {
    move |e| Fail::trouble(format!("tcp baseline: {what}: {e}"))
}

/// The baseline's socket buffers, each way: those of the soft fabric's QP sockets, so the
/// plugin's TCP and the baseline's run on equal sockets and the ratio compares protocols, not
/// socket tuning. Fixed rather than autotuned, so the window does not depend on what the
/// connection carried before (the small sizes come first) nor on the host's `tcp_rmem`
/// ceiling, which can let tens of MiB queue up in the receiver, more than the caches hold.
const TCP_BUFFER: usize = 4 << 20;

/// The baseline's one TCP connection on loopback: the receiver listens, the sender connects to
/// the port the parent relays.
///
/// What makes it a well-tuned stream, so that a ratio of 1 means "as fast as one socket goes
/// here": `TCP_NODELAY` (a ping or the last segment of a message leaves at once), socket buffers
/// of [`TCP_BUFFER`], every message written whole from, and read straight into, a buffer
/// allocated and touched before the timing (no staging copy, no page fault, no allocation per
/// message; the kernel segments it), and the pattern check outside the timed loop.
fn tcp_connect(args: &Args, stdin: &mut impl BufRead) -> Result<TcpStream, Fail> {
    let stream = match args.role {
        Role::Recv => {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io_fail("bind"))?;
            let port = listener.local_addr().map_err(io_fail("bind"))?.port();
            listener.set_nonblocking(true).map_err(io_fail("listen"))?;
            send(&Msg::TcpPort(port))?;
            let (s, _) = retry("tcp accept", || match listener.accept() {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(None)
                }
                Err(e) => Err(io_fail("accept")(e)),
            })?;
            s.set_nonblocking(false).map_err(io_fail("accept"))?;
            s
        }
        Role::Send => {
            let line = read_line(stdin, "TCP port")?;
            let port: u16 = line
                .parse()
                .map_err(|_| Fail::trouble(format!("not a port: {line:?}")))?;
            TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(io_fail("connect"))?
        }
    };
    stream.set_nodelay(true).map_err(io_fail("setup"))?;
    let socket = socket2::SockRef::from(&stream);
    socket
        .set_send_buffer_size(TCP_BUFFER)
        .and_then(|()| socket.set_recv_buffer_size(TCP_BUFFER))
        .map_err(io_fail("setup"))?;
    stream
        .set_read_timeout(Some(STALL))
        .and_then(|()| stream.set_write_timeout(Some(STALL)))
        .map_err(io_fail("setup"))?;
    Ok(stream)
}

/// One size of the TCP stream, `msg` its buffer on either rank: the checked message, the
/// warmup, then a one-byte "go" from the receiver and the timed messages back to back, timed
/// by the receiver.
fn tcp_stream(args: &Args, k: usize, stream: &mut TcpStream, msg: &mut [u8]) -> Result<(), Fail> {
    let iters = iterations(msg.len() as u64, args.iters);
    match args.role {
        Role::Recv => {
            spoil(msg, k);
            stream.read_exact(msg).map_err(io_fail("receive"))?;
            verify(msg, k, "tcp")?;
            for _ in 0..args.warmup {
                stream.read_exact(msg).map_err(io_fail("receive"))?;
            }
            let start = Instant::now();
            stream.write_all(b"g").map_err(io_fail("go"))?;
            for _ in 0..iters {
                stream.read_exact(msg).map_err(io_fail("receive"))?;
            }
            send(&Msg::Tcp(Timing::since(msg.len(), iters, start)))
        }
        Role::Send => {
            fill(msg, k);
            for _ in 0..=args.warmup {
                stream.write_all(msg).map_err(io_fail("send"))?;
            }
            let mut go = [0u8; 1];
            stream.read_exact(&mut go).map_err(io_fail("go"))?;
            for _ in 0..iters {
                stream.write_all(msg).map_err(io_fail("send"))?;
            }
            Ok(())
        }
    }
}

/// The sender's half of one size of the TCP ping-pong, the same shape as [`ping`]: the checked
/// exchange, the warmup, then each timed round trip alone.
fn tcp_ping(
    args: &Args,
    k: usize,
    stream: &mut TcpStream,
    out: &mut [u8],
    back: &mut [u8],
) -> Result<(), Fail> {
    fill(out, k);
    spoil(back, k);
    tcp_trip(stream, out, back)?;
    verify(back, k, "tcp ping-pong, the echo")?;
    for _ in 0..args.latency_warmup {
        tcp_trip(stream, out, back)?;
    }
    let trips = (0..args.latency_iters)
        .map(|_| tcp_trip(stream, out, back))
        .collect::<Result<Vec<_>, _>>()?;
    send(&Msg::TcpPingPong(RoundTrips::new(out.len(), trips)))
}

fn tcp_trip(stream: &mut TcpStream, out: &[u8], back: &mut [u8]) -> Result<Duration, Fail> {
    let start = Instant::now();
    stream.write_all(out).map_err(io_fail("ping"))?;
    stream.read_exact(back).map_err(io_fail("pong"))?;
    Ok(start.elapsed())
}

/// The receiver's half of one size of the TCP ping-pong: it checks the first ping and answers
/// every ping with the bytes that arrived.
fn tcp_pong(args: &Args, k: usize, stream: &mut TcpStream, msg: &mut [u8]) -> Result<(), Fail> {
    spoil(msg, k);
    for i in 0..=args.latency_warmup + args.latency_iters {
        stream.read_exact(msg).map_err(io_fail("ping"))?;
        if i == 0 {
            verify(msg, k, "tcp ping-pong, the ping")?;
        }
        stream.write_all(msg).map_err(io_fail("pong"))?;
    }
    Ok(())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(text: &str) -> Option<[u8; HANDLE_BYTES]> {
    let mut out = [0u8; HANDLE_BYTES];
    if text.len() != 2 * HANDLE_BYTES || !text.is_ascii() {
        return None;
    }
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_through_hex() {
        let mut h = [0u8; HANDLE_BYTES];
        h.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 7) as u8);
        assert_eq!(unhex(&hex(&h)), Some(h));
        assert_eq!(unhex("00"), None);
        assert_eq!(unhex(&"zz".repeat(HANDLE_BYTES)), None);
    }

    #[test]
    fn default_iterations_shrink_with_size() {
        assert_eq!(iterations(8, None), 200);
        assert_eq!(iterations(1 << 20, None), 128);
        assert_eq!(iterations(64 << 20, None), 4);
        assert_eq!(iterations(64 << 20, Some(2)), 2);
    }

    #[test]
    fn round_trips_report_half_the_median_and_the_mean() {
        let us = Duration::from_micros;
        let odd = RoundTrips::new(8, vec![us(30), us(10), us(20)]);
        assert!((odd.median_secs - 10e-6).abs() < 1e-12);
        assert!((odd.mean_secs - 10e-6).abs() < 1e-12);
        assert_eq!((odd.iters, odd.checked_bytes), (3, 16));
        let even = RoundTrips::new(8, vec![us(40), us(10), us(20), us(1000)]);
        assert!((even.median_secs - 15e-6).abs() < 1e-12);
    }

    #[test]
    fn the_check_catches_a_stale_or_wrong_byte() {
        let mut buf = vec![0u8; 5000];
        fill(&mut buf, 3);
        assert!(verify(&buf, 3, "t").is_ok());
        assert!(verify(&buf, 4, "t").is_err());
        buf[4321] ^= 1;
        assert!(
            verify(&buf, 3, "t")
                .unwrap_err()
                .line()
                .contains("byte 4321")
        );
    }
}
