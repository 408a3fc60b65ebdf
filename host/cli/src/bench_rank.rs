//! One rank of `ncclwasm bench`: a child process the parent starts twice (receiver and sender).
//!
//! It drives the plugin library as NCCL's proxy does — `init`, `devices`, `getProperties`,
//! `makeVDevice` when the plan runs on a vNIC, `listen` / `connect` + `accept` loops with the
//! 128-byte handle relayed by the parent, `regMr`, `isend`/`irecv`/`test` loops, and at the end
//! the sender asks its connection what it ran (`ncclwasm_send_comm_stats`) — then streams the
//! same sizes over a plain TCP socket for the baseline. It talks to the parent in JSON lines
//! on stdout ([`Msg`]) and reads the handle and the TCP port from stdin. Every wait is bounded by
//! [`STALL`], so a rank whose peer died stops by itself with one `error:` line.

use std::collections::VecDeque;
use std::io::{BufRead, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, ValueEnum};
use ncclwasm_abi::SendStats;
use ncclwasm_abi::load::{HANDLE_BYTES, LoadError, Plugin, Request};
use serde::{Deserialize, Serialize};

use crate::fail::{Fail, Outcome};
use crate::setup;

/// The longest any single wait may take (a transfer making no progress, a peer not
/// connecting) before the rank gives up.
pub const STALL: Duration = Duration::from_secs(30);

/// Requests in flight per side while streaming: NCCL's `NCCL_STEPS`.
const WINDOW: usize = 8;

/// The tag the sender uses (NCCL: its rank).
const TAG: i32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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
    /// The receiver's listen handle, hex.
    Handle(String),
    /// The receiver's timing of one size through the plugin.
    Plugin(Timing),
    /// The sender's connection after its last send through the plugin.
    Observed(Observed),
    /// The receiver's TCP port for the baseline.
    TcpPort(u16),
    /// The receiver's timing of one size over TCP.
    Tcp(Timing),
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
}

/// What the parent tells the sender once the receiver timed its last size through the plugin.
pub const PLUGIN_DONE: &str = "plugin-done";

/// Timed iterations for `size`: `--iters`, or about 128 MiB per size (at least 4, at most 200)
/// so a default run stays short on slow loopback.
pub fn iterations(size: u64, iters: Option<u32>) -> u32 {
    iters.unwrap_or_else(|| (((128u64 << 20) / size.max(1)).clamp(4, 200)) as u32)
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let max = usize::try_from(args.sizes.iter().copied().max().unwrap_or(0))
        .map_err(|_| Fail::trouble("a size does not fit in memory"))?;
    let mut stdin = std::io::stdin().lock();
    plugin_run(args, max, &mut stdin)?;
    tcp_run(args, max, &mut stdin)?;
    send(&Msg::Done)?;
    Ok(Outcome::success(String::new()))
}

fn send(msg: &Msg) -> Result<(), Fail> {
    let line = serde_json::to_string(msg).map_err(|e| Fail::trouble(format!("encode: {e}")))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Fail::trouble(format!("the parent is gone: {e}")))
}

/// One line from the parent; EOF means it is gone.
fn read_line(stdin: &mut impl BufRead, what: &str) -> Result<String, Fail> {
    let mut line = String::new();
    match stdin.read_line(&mut line) {
        Ok(0) | Err(_) => Err(Fail::trouble(format!(
            "the parent closed stdin before sending the {what}"
        ))),
        Ok(_) => Ok(line.trim().to_owned()),
    }
}

fn plugin_fail(e: LoadError) -> Fail {
    Fail::trouble(format!("plugin: {e}"))
}

/// The byte at `i` of the checked transfer of size number `k`: differs between sizes, so stale
/// data from an earlier size cannot pass.
fn pattern(i: usize, k: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11) ^ k.wrapping_mul(29)) as u8
}

fn fill(buf: &mut [u8], k: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(i, k);
    }
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

fn plugin_run(args: &Args, max: usize, stdin: &mut impl BufRead) -> Result<(), Fail> {
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
    match args.role {
        Role::Recv => {
            let (listen, handle) = plugin.listen(args.device).map_err(plugin_fail)?;
            send(&Msg::Handle(hex(&handle)))?;
            let comm = retry("accept", || listen.accept().map_err(plugin_fail))?;
            drop(listen); // as NCCL: closeListen right after accept
            let mut mr = comm.reg_mr(max.max(1)).map_err(plugin_fail)?;
            for (k, &size) in args.sizes.iter().enumerate() {
                let size = size as usize;
                // Stale bytes that cannot pass the check.
                mr.bytes()[..size]
                    .iter_mut()
                    .for_each(|b| *b = !pattern(0, k));
                let got = stream(1, || comm.irecv(&mr, 0..size, TAG).map_err(plugin_fail))?;
                if got != size {
                    return Err(Fail::trouble(format!("{size} bytes arrived as {got}")));
                }
                verify(&mr.bytes()[..size], k, "plugin")?;
                stream(args.warmup, || {
                    comm.irecv(&mr, 0..size, TAG).map_err(plugin_fail)
                })?;
                let iters = iterations(size as u64, args.iters);
                let start = Instant::now();
                stream(iters, || comm.irecv(&mr, 0..size, TAG).map_err(plugin_fail))?;
                send(&Msg::Plugin(Timing {
                    size: size as u64,
                    iters,
                    secs: start.elapsed().as_secs_f64(),
                }))?;
            }
        }
        Role::Send => {
            let line = read_line(stdin, "listen handle")?;
            let mut handle =
                unhex(&line).ok_or_else(|| Fail::trouble(format!("not a handle: {line:?}")))?;
            let comm = retry("connect", || {
                plugin
                    .connect(args.device, &mut handle)
                    .map_err(plugin_fail)
            })?;
            let mut mr = comm.reg_mr(max.max(1)).map_err(plugin_fail)?;
            let mut sent = 0;
            for (k, &size) in args.sizes.iter().enumerate() {
                let size = size as usize;
                fill(&mut mr.bytes()[..size], k);
                let got = stream(1, || comm.isend(&mr, 0..size, TAG).map_err(plugin_fail))?;
                if got != size {
                    return Err(Fail::trouble(format!("{size} bytes sent as {got}")));
                }
                let iters = iterations(size as u64, args.iters);
                sent += got
                    + stream(args.warmup + iters, || {
                        comm.isend(&mr, 0..size, TAG).map_err(plugin_fail)
                    })?;
            }
            let stats = comm.stats().map_err(plugin_fail)?;
            send(&Msg::Observed(Observed::new(stats, sent as u64)))?;
            // Close only once the receiver is done too, as NCCL tears a connection down only
            // after both sides' operations completed: the receiver's last clear-to-send writes
            // may not be acknowledged yet, and closing under them fails them (RC semantics).
            let line = read_line(stdin, "end of the receiver's plugin run")?;
            if line != PLUGIN_DONE {
                return Err(Fail::trouble(format!(
                    "expected {PLUGIN_DONE:?} from the parent, got {line:?}"
                )));
            }
        }
    }
    Ok(())
}

fn io_fail(what: &str) -> impl Fn(std::io::Error) -> Fail {
    move |e| Fail::trouble(format!("tcp baseline: {what}: {e}"))
}

/// The same sizes and iterations over one plain TCP stream on loopback: the checked message,
/// the warmup, then a one-byte "go" from the receiver and the timed messages back to back.
fn tcp_run(args: &Args, max: usize, stdin: &mut impl BufRead) -> Result<(), Fail> {
    let mut buf = vec![0u8; max.max(1)];
    let mut stream = match args.role {
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
    stream
        .set_read_timeout(Some(STALL))
        .and_then(|()| stream.set_write_timeout(Some(STALL)))
        .map_err(io_fail("setup"))?;
    for (k, &size) in args.sizes.iter().enumerate() {
        let size = size as usize;
        let iters = iterations(size as u64, args.iters);
        let msg = &mut buf[..size];
        match args.role {
            Role::Recv => {
                msg.iter_mut().for_each(|b| *b = !pattern(0, k));
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
                send(&Msg::Tcp(Timing {
                    size: size as u64,
                    iters,
                    secs: start.elapsed().as_secs_f64(),
                }))?;
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
            }
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; HANDLE_BYTES]> {
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
