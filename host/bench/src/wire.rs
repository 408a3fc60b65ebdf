//! The bench's wire format: what the parent ([`super::driver`]) and its two rank processes
//! ([`super::rank`]) say to each other. The parent starts each rank as `ncclwasm bench-rank`
//! with [`RankArgs`]; a rank writes one JSON [`Msg`] per line on its stdout, and reads from its
//! stdin the lines the parent relays (the peer's listen handle in hex, the TCP port, the peer's
//! one-sided listen handle, the connection-scale part's handles, comma-separated) and the
//! parent's go-aheads ([`PLUGIN_DONE`], [`SCALE_DONE`]). A rank that fails says why in its last
//! `error:` line on stderr.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, ValueEnum};
use ncclwasm_abi::SendStats;
use ncclwasm_abi::load::HANDLE_BYTES;
use ncclwasm_inspect::setup;
use ncclwasm_model::ConnPlan;
use serde::{Deserialize, Serialize};

use super::spread::median;
use crate::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Recv,
    Send,
}

/// The ranks by index, as the parent starts them: the receiver first.
pub const ROLES: [(Role, &str); 2] = [(Role::Recv, "receiver"), (Role::Send, "sender")];

/// A rank's command line, as the parent builds it.
#[derive(Debug, ClapArgs)]
pub struct RankArgs {
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
    /// Timed runs of each size on each transport, alternating (plugin, TCP, plugin, …); the
    /// first transfer checked and the warmup only before the first.
    #[arg(long, default_value_t = 1)]
    pub repeats: u32,
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
    /// After `listen` on the library's one-sided table: its ABI version (`ncclRmaPlugin_vN`)
    /// and the listen handle, hex, which the parent hands to the other rank — each rank
    /// connects the group with both.
    RmaHandle {
        abi: u32,
        handle: String,
    },
    /// The receiver's timing of one size of one-sided puts streamed to it.
    Put(Timing),
    /// The sender's one-sided ping-pong of one size: a put with a signal each way.
    PutSignal(RoundTrips),
    /// The sender's one-sided gets of one size from the receiver.
    Get(Completions),
    /// `--single-process`: one size at one depth of matched pairs.
    Pairs(PairTiming),
    /// The CPU this rank used over one part of one size.
    Cpu(CpuUse),
    /// This rank's requests through the plugin are all done, up to here (the two-sided parts,
    /// or one size of the one-sided part); it goes on — and closes what it is done with — when
    /// the parent answers [`PLUGIN_DONE`], once both ranks said so as often.
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
    /// Transfers of this rank completed since its last line: a long measurement is alive
    /// (at most one per [`super::wait::Beat`]).
    Moving,
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
/// (`ncclwasm_send_comm_stats`): who made the plan, the plan itself — the model's [`ConnPlan`],
/// so every field of it travels and prints without being named here — and the bytes of each QP.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// The policy (`name@version`), the built-in default, or the built-in default standing in
    /// for a policy's plan the handshake refused.
    pub source: String,
    pub plan: ConnPlan,
    /// One per QP of `plan`, in plan order.
    pub qps: Vec<ObservedQp>,
    /// The QPs' bytes, summed.
    pub posted_bytes: u64,
    /// The bytes the sender's `test` reported sent through the plugin, every transfer counted.
    pub sent_bytes: u64,
}

/// One QP of the plan the connection ran: its ports by name, and what it carried.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObservedQp {
    /// `device:port` on this side and on the peer's.
    pub local: String,
    pub remote: String,
    /// Payload bytes the plugin posted on it.
    pub bytes: u64,
    /// `bytes` / `posted_bytes` (0 when nothing was posted).
    pub share: f64,
}

impl Observed {
    pub fn new(stats: SendStats, sent_bytes: u64) -> Observed {
        let posted_bytes = stats.posted.iter().sum();
        let qps = (0..stats.plan.qps.len())
            .map(|i| {
                let (local, remote) = stats.ports(i);
                let bytes = stats.posted.get(i).copied().unwrap_or(0);
                ObservedQp {
                    local: local.to_string(),
                    remote: remote.to_string(),
                    bytes,
                    share: if posted_bytes == 0 {
                        0.0
                    } else {
                        bytes as f64 / posted_bytes as f64
                    },
                }
            })
            .collect();
        Observed {
            source: stats.source,
            plan: stats.plan,
            qps,
            posted_bytes,
            sent_bytes,
        }
    }
}

/// Which part of a size a [`CpuUse`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Part {
    Plugin,
    Tcp,
    PluginPingPong,
    TcpPingPong,
    /// One-sided: the stream of puts.
    Put,
    /// One-sided: the ping-pong of puts with a signal.
    PutSignal,
    /// One-sided: the gets.
    Get,
}

/// One rank's CPU (all its threads) over one part of one size: `secs` over `messages` messages,
/// or round trips for a ping-pong. Each rank reports its own stretch: the receiver's timed
/// stream, the sender's whole stream with its warmup (one-sided: its timed puts); the sender's
/// timed round trips (or gets), the receiver's every answer (or every get it served).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    pub part: Part,
    pub size: u64,
    pub messages: u32,
    pub secs: f64,
}

impl CpuUse {
    /// Microseconds of CPU per message.
    pub fn per_message_us(&self) -> f64 {
        self.secs * 1e6 / f64::from(self.messages.max(1))
    }
}

/// `iters` timed transfers of `size` bytes took `secs`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub size: u64,
    pub iters: u32,
    pub secs: f64,
    /// Bytes of the first transfer the receiver compared with the sender's pattern (0: a
    /// repeat after the first, whose transfers were checked then).
    pub checked_bytes: u64,
}

impl Timing {
    /// `iters` transfers of `size` bytes, timed from `start` until now; `checked`: a transfer
    /// of theirs was compared with the pattern first.
    pub fn since(size: usize, iters: u32, start: Instant, checked: bool) -> Timing {
        Timing {
            size: size as u64,
            iters,
            secs: start.elapsed().as_secs_f64(),
            checked_bytes: if checked { size as u64 } else { 0 },
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
    /// what arrived, so both directions are checked (the receiver checks the ping as well); 0
    /// in a repeat after the first.
    pub checked_bytes: u64,
}

/// The median and the mean of `times`, seconds (0 when empty).
fn median_and_mean(times: &[Duration]) -> (f64, f64) {
    let mut secs: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
    let mean = secs.iter().sum::<f64>() / secs.len().max(1) as f64;
    (median(&mut secs).unwrap_or(0.0), mean)
}

impl RoundTrips {
    /// `trips` must not be empty (`--latency-iters` is at least 1); `checked`: an exchange was
    /// compared with the pattern both ways first (the first repeat's).
    pub fn new(size: usize, trips: Vec<Duration>, checked: bool) -> RoundTrips {
        let (median, mean) = median_and_mean(&trips);
        RoundTrips {
            size: size as u64,
            iters: trips.len() as u32,
            median_secs: median / 2.0,
            mean_secs: mean / 2.0,
            checked_bytes: if checked { 2 * size as u64 } else { 0 },
        }
    }
}

/// `iters` operations of `size` bytes, each timed alone from its post to its completion by the
/// rank that posts them: a one-sided get, whose request goes out and whose bytes come back, so
/// the whole time is its latency (not halved as a round trip of two messages is).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completions {
    pub size: u64,
    pub iters: u32,
    pub median_secs: f64,
    pub mean_secs: f64,
    /// Bytes of the first operation compared with the pattern.
    pub checked_bytes: u64,
}

impl Completions {
    /// `times` must not be empty; the first operation's bytes were checked.
    pub fn new(size: usize, times: Vec<Duration>) -> Completions {
        let (median_secs, mean_secs) = median_and_mean(&times);
        Completions {
            size: size as u64,
            iters: times.len() as u32,
            median_secs,
            mean_secs,
            checked_bytes: size as u64,
        }
    }
}

/// One size at one depth: ns per matched pair over the timed batches.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairTiming {
    pub size: u64,
    /// Pairs in flight at once.
    pub depth: u32,
    /// Timed pairs (whole batches of `depth`).
    pub pairs: u32,
    pub median_ns: f64,
    /// The 99th percentile: what the odd slow pair costs (a page fault, a preemption).
    pub p99_ns: f64,
    pub mean_ns: f64,
}

impl PairTiming {
    /// `batches` must not be empty; each is the time of `depth` pairs.
    pub fn new(size: usize, depth: usize, batches: Vec<Duration>) -> PairTiming {
        let n = batches.len();
        let mut per_pair: Vec<f64> = batches
            .iter()
            .map(|d| d.as_nanos() as f64 / depth as f64)
            .collect();
        let mean = per_pair.iter().sum::<f64>() / n as f64;
        // Sorted by the median: nearest rank, the smallest batch time at or above 99% of them.
        let median = median(&mut per_pair).unwrap_or(0.0);
        let p99 = per_pair[(n * 99).div_ceil(100).max(1) - 1];
        PairTiming {
            size: size as u64,
            depth: depth as u32,
            pairs: (n * depth) as u32,
            median_ns: median,
            p99_ns: p99,
            mean_ns: mean,
        }
    }
}

/// One rank's side of the connection-scale part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scale {
    pub role: Role,
    pub connections: u32,
    /// From the first `listen`/`connect` to the last comm established.
    pub setup_secs: f64,
    pub before: Footprint,
    pub after: Footprint,
}

/// What the process holds, from `/proc/self`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Footprint {
    /// Resident memory (`VmRSS`).
    pub rss_kib: u64,
    pub threads: u64,
    pub fds: u64,
}

/// What the parent tells both ranks once each has reported [`Msg::PluginDone`] as often.
pub const PLUGIN_DONE: &str = "plugin-done";

/// What the parent tells both ranks once each has reported its [`Scale`]: close them now (each
/// then reports the time its closes took, [`Msg::ScaleClosed`]).
pub const SCALE_DONE: &str = "scale-done";

/// One line to the parent.
pub fn send(msg: &Msg) -> Result<(), Error> {
    let line = serde_json::to_string(msg).map_err(|e| Error::run(format!("encode: {e}")))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::run(format!("the parent is gone: {e}")))
}

/// One line from the parent; EOF means it is gone.
pub fn read_line(stdin: &mut impl BufRead, what: &str) -> Result<String, Error> {
    let mut line = String::new();
    match stdin.read_line(&mut line) {
        Ok(0) | Err(_) => Err(Error::run(format!(
            "the parent closed stdin before sending the {what}"
        ))),
        Ok(_) => Ok(line.trim().to_owned()),
    }
}

/// The parent's next line must be `expected`.
pub fn expect_line(stdin: &mut impl BufRead, expected: &str) -> Result<(), Error> {
    let line = read_line(stdin, expected)?;
    if line != expected {
        return Err(Error::run(format!(
            "expected {expected:?} from the parent, got {line:?}"
        )));
    }
    Ok(())
}

/// Waits, registrations and comms still open, until the parent says both ranks are done up to
/// here, as NCCL tears a connection down only after both sides' operations completed: the
/// peer's last writes (a clear-to-send, a get's read) may not be acknowledged yet, and closing
/// under them fails them (RC semantics).
pub fn plugin_done(stdin: &mut impl BufRead) -> Result<(), Error> {
    send(&Msg::PluginDone)?;
    expect_line(stdin, PLUGIN_DONE)
}

/// The peer's listen handle, as the parent relays it.
pub fn read_handle(stdin: &mut impl BufRead, what: &str) -> Result<[u8; HANDLE_BYTES], Error> {
    let line = read_line(stdin, what)?;
    unhex(&line).ok_or_else(|| Error::run(format!("not a handle: {line:?}")))
}

/// Comma-separated, as [`RankArgs`]' lists are parsed and the bench's tables print them.
pub fn list<T: ToString>(items: &[T]) -> String {
    items.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

/// A listen handle as the parent relays it.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Option<[u8; HANDLE_BYTES]> {
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
    fn round_trips_report_half_the_median_and_the_mean() {
        let us = Duration::from_micros;
        let odd = RoundTrips::new(8, vec![us(30), us(10), us(20)], true);
        assert!((odd.median_secs - 10e-6).abs() < 1e-12);
        assert!((odd.mean_secs - 10e-6).abs() < 1e-12);
        assert_eq!((odd.iters, odd.checked_bytes), (3, 16));
        let even = RoundTrips::new(8, vec![us(40), us(10), us(20), us(1000)], false);
        assert_eq!(even.checked_bytes, 0);
        assert!((even.median_secs - 15e-6).abs() < 1e-12);
    }

    #[test]
    fn completions_are_not_halved() {
        let us = Duration::from_micros;
        let gets = Completions::new(8, vec![us(30), us(10), us(20)]);
        assert!((gets.median_secs - 20e-6).abs() < 1e-12);
        assert!((gets.mean_secs - 20e-6).abs() < 1e-12);
        assert_eq!((gets.iters, gets.checked_bytes), (3, 8));
    }

    #[test]
    fn pairs_are_batches_divided_by_their_depth() {
        let ns = Duration::from_nanos;
        let one = PairTiming::new(8, 1, vec![ns(300), ns(100), ns(200)]);
        assert_eq!((one.pairs, one.depth), (3, 1));
        assert!((one.median_ns - 200.0).abs() < 1e-9);
        assert!((one.p99_ns - 300.0).abs() < 1e-9);
        assert!((one.mean_ns - 200.0).abs() < 1e-9);
        let mut batches: Vec<Duration> = (1..=100).map(|i| ns(8 * i)).collect();
        batches.push(ns(8000));
        let eight = PairTiming::new(8, 8, batches);
        assert_eq!(eight.pairs, 808);
        assert!((eight.median_ns - 51.0).abs() < 1e-9);
        // The 100th of 101 batches, 800 ns, over 8 pairs.
        assert!((eight.p99_ns - 100.0).abs() < 1e-9);
    }
}
