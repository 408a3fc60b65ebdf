//! What `ncclwasm bench` prints: the report (its JSON shape is host/cli/README.md's), the rows
//! computed from what the ranks timed, and the text tables — the plan the connection ran, the
//! bandwidth and latency tables against TCP, the one-sided table against the two-sided
//! bandwidth, the connection-scale part.

use ncclwasm_inspect::live::FabricView;
use ncclwasm_inspect::render::{self, Table, field};
use ncclwasm_inspect::report::{self, PolicyView, TopologyView};
use serde::Serialize;

use super::spread::{Spread, median};
use super::wire::{
    Completions, CpuUse, DeviceLine, Footprint, Observed, PairTiming, Part, ROLES, RoundTrips,
    Scale, Timing, list,
};
use crate::Error;

/// Sizes from here on count for the large-message ratio.
const LARGE: u64 = 1 << 20;

/// What the run measured, and everything needed to read it.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub plugin: PluginView,
    pub fabric: FabricView,
    pub policy: PolicyView,
    pub topology: TopologyView,
    /// The NCCL device both ranks used and its name.
    pub device: i32,
    pub device_name: String,
    /// The devices as the plugin's `getProperties` reports them (after the fusion, if any).
    pub devices: Vec<DeviceLine>,
    /// The physical devices the ranks asked `makeVDevice` to fuse, as NCCL core would (empty:
    /// none); `devices[device].children` is what the plugin made of the request.
    pub fuse_request: Vec<u32>,
    /// What the sender's connection ran and carried, as the plugin reports it.
    pub observed: Observed,
    pub warmup: u32,
    /// Timed runs of each size on each transport, alternating (`--repeats`).
    pub repeats: u32,
    /// The bandwidth table, one row per `--sizes`.
    pub rows: Vec<Row>,
    /// Each repeat's mean ratio over the sizes of 1 MiB and more: their median, least and
    /// greatest ([`large_ratio`]).
    pub large_message_ratio: Option<f64>,
    pub large_message_ratio_min: Option<f64>,
    pub large_message_ratio_max: Option<f64>,
    pub latency_warmup: u32,
    /// The latency table, one row per `--latency-sizes`.
    pub latency: Vec<LatencyRow>,
    /// The one-sided table, one row per `--sizes`.
    pub one_sided: OneSided,
    /// The connection-scale part (`None` with `--connections 0`).
    pub connections: Option<ConnectionScale>,
}

/// `--single-process`: what one process timed of matched pairs through the plugin, and
/// everything needed to read it.
#[derive(Debug, Serialize)]
pub struct PairsReport {
    pub plugin: PluginView,
    pub fabric: FabricView,
    /// How work requests travel: the value of the provider's variable for it as the process had
    /// it (the soft fabric's `NCCL_WASM_SOFT_DELIVERY`: `in-process` unless the caller chose), or
    /// `own` for a provider without one.
    pub delivery: String,
    /// This plugin's policy: what a library that reports its plan ran (another plugin has
    /// its own decisions).
    pub policy: PolicyView,
    pub topology: TopologyView,
    /// The NCCL device both ends used (always 0) and its name.
    pub device: i32,
    pub device_name: String,
    pub devices: Vec<DeviceLine>,
    /// What the connection ran, when the library exports `ncclwasm_send_comm_stats`.
    pub observed: Option<Observed>,
    /// One per size and depth, sizes in `--pair-sizes` order, depths 1 then 8.
    pub rows: Vec<PairTiming>,
}

/// `--connections` set up at once: each rank's wall time and what the connections added to it.
#[derive(Debug, PartialEq, Serialize)]
pub struct ConnectionScale {
    pub connections: u32,
    /// The slower rank's setup time (first NCCL call to last comm established), per connection.
    pub setup_us_per_connection: f64,
    /// The slower rank's close time, per connection.
    pub close_us_per_connection: f64,
    /// The sending rank: one send comm per connection.
    pub send: ScaleSide,
    /// The receiving rank: one listen, accepted and closed, and one recv comm per connection.
    pub recv: ScaleSide,
}

/// One rank's figures of the connection-scale part.
#[derive(Debug, PartialEq, Serialize)]
pub struct ScaleSide {
    pub setup_secs: f64,
    pub close_secs: f64,
    pub before: Footprint,
    pub after: Footprint,
    /// Resident memory the connections added, per connection.
    pub rss_kib_per_connection: f64,
    pub threads_per_connection: f64,
    pub fds_per_connection: f64,
}

#[derive(Debug, Serialize)]
pub struct PluginView {
    pub path: String,
    /// The `ncclNetPlugin_vN` table used.
    pub abi: u32,
}

/// One size of the bandwidth table. The figures are medians over the repeats.
#[derive(Debug, PartialEq, Serialize)]
pub struct Row {
    pub size: u64,
    /// nccl-tests' count: 4-byte float elements.
    pub count: u64,
    /// Timed iterations of each repeat.
    pub iters: u32,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub tcp_time_us: f64,
    pub tcp_algbw_gbps: f64,
    /// Plugin algbw / TCP algbw, the median of the repeats' (each against its own baseline).
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Each repeat's ratio, in the order they ran.
    pub ratios: Vec<f64>,
    /// CPU per message, both ranks' processes (every thread) together, µs.
    pub cpu_us: f64,
    pub tcp_cpu_us: f64,
    /// Bytes of the first transfer the receiver compared with the sender's pattern.
    pub checked_bytes: u64,
    pub tcp_checked_bytes: u64,
}

/// The one-sided part: the table the ranks drove and what each size measured.
#[derive(Debug, Serialize)]
pub struct OneSided {
    /// The `ncclRmaPlugin_vN` table used.
    pub abi: u32,
    pub rows: Vec<OneSidedRow>,
}

/// One size of the one-sided part: puts streamed, puts with a signal ping-ponged, gets.
#[derive(Debug, PartialEq, Serialize)]
pub struct OneSidedRow {
    pub size: u64,
    /// Timed iterations of each of the three measurements.
    pub iters: u32,
    /// The stream of puts, the receiver's clock from its go to the last signal.
    pub put_gbps: f64,
    /// `put_gbps` / the two-sided plugin algbw of the same size, this run.
    pub put_vs_two_sided: f64,
    /// One way: half the median round trip of a put with a signal each way.
    pub put_signal_us: f64,
    pub put_signal_mean_us: f64,
    /// A get, post to completion (median).
    pub get_us: f64,
    pub get_mean_us: f64,
    /// CPU per operation, both ranks' processes (every thread) together, µs: per put of the
    /// stream, per round trip, per get.
    pub put_cpu_us: f64,
    pub put_signal_cpu_us: f64,
    pub get_cpu_us: f64,
    /// Bytes compared with the pattern: the first put's, the first round trip's both ways, the
    /// first get's.
    pub checked_bytes: u64,
}

/// One size of the ping-pong: one-way latency, half the round trip the sender timed. The
/// figures are medians over the repeats.
#[derive(Debug, PartialEq, Serialize)]
pub struct LatencyRow {
    pub size: u64,
    /// Timed round trips of each repeat.
    pub iters: u32,
    /// Through the plugin: half the median round trip.
    pub latency_us: f64,
    /// Half the mean round trip.
    pub mean_us: f64,
    pub tcp_latency_us: f64,
    pub tcp_mean_us: f64,
    /// Plugin latency / TCP latency (medians): how many times the socket's time the plugin
    /// takes (the inverse sense of the bandwidth ratio); the median of the repeats'.
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Each repeat's ratio, in the order they ran.
    pub ratios: Vec<f64>,
    /// CPU per round trip, both ranks' processes (every thread) together, µs.
    pub cpu_us: f64,
    pub tcp_cpu_us: f64,
    /// Bytes of the first exchange compared with the sender's pattern, both ways.
    pub checked_bytes: u64,
    pub tcp_checked_bytes: u64,
}

/// Both ranks' CPU per message (or round trip) for the `i`-th size of `part`, µs: each rank's
/// reports of a part come in size order.
fn cpu_us(cpu: &[Vec<CpuUse>; 2], part: Part, i: usize, size: u64) -> Result<f64, Error> {
    cpu.iter()
        .map(|rank| {
            rank.iter()
                .filter(|c| c.part == part)
                .nth(i)
                .filter(|c| c.size == size)
                .map(CpuUse::per_message_us)
                .ok_or_else(|| Error::run("a rank did not report the CPU of every part"))
        })
        .sum()
}

/// The median of `values` (0 when there are none).
fn mid(values: impl Iterator<Item = f64>) -> f64 {
    median(&mut values.collect::<Vec<_>>()).unwrap_or(0.0)
}

/// One size's repeats: the plugin's timings and TCP's, each in the order they ran.
type Repeats<'t, T> = (&'t [T], &'t [T]);

/// The repeats of each size, in order: `plugin` and `tcp` in runs of `repeats` timings of one
/// size, the `i`-th of either transport of a size measured right after each other.
fn by_size<'t, T>(
    plugin: &'t [T],
    tcp: &'t [T],
    repeats: usize,
    size: impl Fn(&T) -> u64,
) -> Result<Vec<Repeats<'t, T>>, Error> {
    let repeats = repeats.max(1);
    if plugin.len() != tcp.len() || !plugin.len().is_multiple_of(repeats) {
        return Err(Error::run("the ranks reported an incomplete run"));
    }
    let sizes = plugin.chunks(repeats).zip(tcp.chunks(repeats));
    sizes
        .map(|(p, t)| {
            let first = size(&p[0]);
            if p.iter().chain(t).any(|x| size(x) != first) {
                return Err(Error::run("the ranks reported the sizes out of order"));
            }
            Ok((p, t))
        })
        .collect()
}

/// The ratio's spread as a row's fields: median, least, greatest, every repeat's.
fn spread(ratios: Vec<f64>) -> Result<(f64, f64, f64, Vec<f64>), Error> {
    let s = Spread::of(&ratios).ok_or_else(|| Error::run("a size with no repeat"))?;
    Ok((s.median, s.min, s.max, ratios))
}

/// Both ranks' CPU per message of every repeat of the `i`-th size of `part`, its median.
fn cpu_mid(
    cpu: &[Vec<CpuUse>; 2],
    part: Part,
    i: usize,
    repeats: usize,
    size: u64,
) -> Result<f64, Error> {
    let each = (0..repeats)
        .map(|r| cpu_us(cpu, part, i * repeats + r, size))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(mid(each.into_iter()))
}

/// The table's rows: the `repeats` runs of each size on both transports, in order.
pub fn rows(
    plugin: &[Timing],
    tcp: &[Timing],
    cpu: &[Vec<CpuUse>; 2],
    repeats: usize,
) -> Result<Vec<Row>, Error> {
    let per = |x: &Timing| x.secs / f64::from(x.iters.max(1));
    let bw = |x: &Timing| x.size as f64 / per(x).max(1e-12) / 1e9;
    by_size(plugin, tcp, repeats, |t| t.size)?
        .into_iter()
        .enumerate()
        .map(|(i, (ps, ts))| {
            let size = ps[0].size;
            let (ratio, ratio_min, ratio_max, ratios) =
                spread(ps.iter().zip(ts).map(|(p, t)| bw(p) / bw(t)).collect())?;
            Ok(Row {
                size,
                count: size / 4,
                iters: ps[0].iters,
                time_us: mid(ps.iter().map(|p| per(p) * 1e6)),
                algbw_gbps: mid(ps.iter().map(bw)),
                tcp_time_us: mid(ts.iter().map(|t| per(t) * 1e6)),
                tcp_algbw_gbps: mid(ts.iter().map(bw)),
                ratio,
                ratio_min,
                ratio_max,
                ratios,
                cpu_us: cpu_mid(cpu, Part::Plugin, i, ps.len(), size)?,
                tcp_cpu_us: cpu_mid(cpu, Part::Tcp, i, ts.len(), size)?,
                checked_bytes: ps.iter().map(|p| p.checked_bytes).sum(),
                tcp_checked_bytes: ts.iter().map(|t| t.checked_bytes).sum(),
            })
        })
        .collect()
}

/// The latency table's rows: the `repeats` ping-pongs of each size on both transports, in
/// order.
pub fn latency_rows(
    plugin: &[RoundTrips],
    tcp: &[RoundTrips],
    cpu: &[Vec<CpuUse>; 2],
    repeats: usize,
) -> Result<Vec<LatencyRow>, Error> {
    by_size(plugin, tcp, repeats, |r| r.size)?
        .into_iter()
        .enumerate()
        .map(|(i, (ps, ts))| {
            let size = ps[0].size;
            let ratios = ps.iter().zip(ts);
            let (ratio, ratio_min, ratio_max, ratios) = spread(
                ratios
                    .map(|(p, t)| p.median_secs / t.median_secs.max(1e-12))
                    .collect(),
            )?;
            Ok(LatencyRow {
                size,
                iters: ps[0].iters,
                latency_us: mid(ps.iter().map(|p| p.median_secs * 1e6)),
                mean_us: mid(ps.iter().map(|p| p.mean_secs * 1e6)),
                tcp_latency_us: mid(ts.iter().map(|t| t.median_secs * 1e6)),
                tcp_mean_us: mid(ts.iter().map(|t| t.mean_secs * 1e6)),
                ratio,
                ratio_min,
                ratio_max,
                ratios,
                cpu_us: cpu_mid(cpu, Part::PluginPingPong, i, ps.len(), size)?,
                tcp_cpu_us: cpu_mid(cpu, Part::TcpPingPong, i, ts.len(), size)?,
                checked_bytes: ps.iter().map(|p| p.checked_bytes).sum(),
                tcp_checked_bytes: ts.iter().map(|t| t.checked_bytes).sum(),
            })
        })
        .collect()
}

/// The one-sided table's rows: each size's three measurements, in order, its puts against the
/// bandwidth table's row of the same size (`two_sided`, measured in the same run).
pub fn one_sided_rows(
    two_sided: &[Row],
    puts: &[Timing],
    signals: &[RoundTrips],
    gets: &[Completions],
    cpu: &[Vec<CpuUse>; 2],
) -> Result<Vec<OneSidedRow>, Error> {
    let n = two_sided.len();
    if puts.len() != n || signals.len() != n || gets.len() != n {
        return Err(Error::run(
            "the ranks reported an incomplete one-sided part",
        ));
    }
    two_sided
        .iter()
        .zip(puts.iter().zip(signals).zip(gets))
        .enumerate()
        .map(|(i, (row, ((p, s), g)))| {
            if [p.size, s.size, g.size].iter().any(|&x| x != row.size) {
                return Err(Error::run(
                    "the ranks reported the one-sided sizes out of order",
                ));
            }
            let put_gbps = p.size as f64 / (p.secs / f64::from(p.iters.max(1))).max(1e-12) / 1e9;
            Ok(OneSidedRow {
                size: row.size,
                iters: p.iters,
                put_gbps,
                put_vs_two_sided: put_gbps / row.algbw_gbps.max(1e-12),
                put_signal_us: s.median_secs * 1e6,
                put_signal_mean_us: s.mean_secs * 1e6,
                get_us: g.median_secs * 1e6,
                get_mean_us: g.mean_secs * 1e6,
                put_cpu_us: cpu_us(cpu, Part::Put, i, row.size)?,
                put_signal_cpu_us: cpu_us(cpu, Part::PutSignal, i, row.size)?,
                get_cpu_us: cpu_us(cpu, Part::Get, i, row.size)?,
                checked_bytes: p.checked_bytes + s.checked_bytes + g.checked_bytes,
            })
        })
        .collect()
}

/// The connection-scale figures from both ranks' reports (`None` when none was asked for).
pub fn connection_scale(
    n: u32,
    scale: &[Option<(Scale, Option<f64>)>; 2],
) -> Result<Option<ConnectionScale>, Error> {
    if n == 0 {
        return Ok(None);
    }
    let side = |i: usize| match &scale[i] {
        Some((s, Some(close))) if s.connections == n && s.role == ROLES[i].0 => {
            let per = |after: u64, before: u64| (after as f64 - before as f64) / f64::from(n);
            Ok(ScaleSide {
                setup_secs: s.setup_secs,
                close_secs: *close,
                before: s.before,
                after: s.after,
                rss_kib_per_connection: per(s.after.rss_kib, s.before.rss_kib),
                threads_per_connection: per(s.after.threads, s.before.threads),
                fds_per_connection: per(s.after.fds, s.before.fds),
            })
        }
        _ => Err(Error::run(format!(
            "the {} did not report its {n} connections",
            ROLES[i].1
        ))),
    };
    let (recv, send) = (side(0)?, side(1)?);
    let per = |a: f64, b: f64| a.max(b) / f64::from(n) * 1e6;
    Ok(Some(ConnectionScale {
        connections: n,
        setup_us_per_connection: per(send.setup_secs, recv.setup_secs),
        close_us_per_connection: per(send.close_secs, recv.close_secs),
        send,
        recv,
    }))
}

/// The devices as the plugin's `getProperties` reports them.
fn devices_section(devices: &[DeviceLine]) -> String {
    let mut t = Table::new(2, &["dev", "name", "speed", "ports of"]);
    for (i, d) in devices.iter().enumerate() {
        t.row(vec![
            i.to_string(),
            d.name.clone(),
            render::speed(u32::try_from(d.speed_mbps).unwrap_or(0)),
            list(&d.children),
        ]);
    }
    field("devices", "as the plugin's getProperties reports them") + &t.render()
}

/// The plan the sender's connection ran and the bytes each QP carried. The plan's fields are
/// shown as `policy explain` shows them ([`report::plan_values`]), so a new one appears in both.
fn observed_section(o: &Observed) -> String {
    let mut out = field(
        "plan",
        &format!(
            "as the sender's connection ran it (the plugin's ncclwasm_send_comm_stats): {} QP(s)",
            o.qps.len()
        ),
    );
    out += &field("  source", &o.source);
    out += &field("  why", &o.plan.reason);
    let mut t = Table::new(2, &["plan", "value"]);
    // The QP count is in the line above and the QPs in the table below.
    for (label, value) in report::plan_values(&o.plan).filter(|(label, _)| *label != "qps") {
        t.row(vec![label.to_owned(), value]);
    }
    out += &t.render();
    let mut t = Table::new(2, &["qp", "local", "remote", "weight", "bytes", "share"]);
    for (i, (q, plan)) in o.qps.iter().zip(&o.plan.qps).enumerate() {
        t.row(vec![
            i.to_string(),
            q.local.clone(),
            q.remote.clone(),
            plan.weight.to_string(),
            q.bytes.to_string(),
            format!("{:.1}%", q.share * 100.0),
        ]);
    }
    out += &t.render();
    out + &field(
        "  bytes",
        &format!(
            "{} posted over the QPs; the sender's test reported {} sent",
            o.posted_bytes, o.sent_bytes
        ),
    )
}

/// The large-message ratio: each repeat's mean ratio over the sizes of 1 MiB and more (`None`
/// without such a size), as a spread over the repeats.
pub fn large_ratio(rows: &[Row]) -> Option<Spread> {
    let large: Vec<&Row> = rows.iter().filter(|r| r.size >= LARGE).collect();
    let repeats = large.iter().map(|r| r.ratios.len()).min()?;
    let means: Vec<f64> = (0..repeats)
        .map(|i| large.iter().map(|r| r.ratios[i]).sum::<f64>() / large.len() as f64)
        .collect();
    Spread::of(&means)
}

/// What the run ran on: the fabric, the policy, the topology.
fn setup_section(fabric: &FabricView, policy: &PolicyView, topology: &TopologyView) -> String {
    let mut out = field("fabric", &format!("{}  ({})", fabric.name, fabric.why));
    out += &field(
        "policy",
        &match &policy.origin {
            Some(origin) => format!("{} {}  ({origin})", policy.name, policy.version),
            None => "built-in default (NCCL's own decisions)".to_owned(),
        },
    );
    out + &field(
        "topology",
        &format!("{}  ({})", topology.name, topology.origin),
    )
}

/// The run for people: setup, the plan the connection ran, the nccl-tests-style bandwidth table,
/// the latency table, the one-sided table, then the connection-scale part.
pub fn render(r: &BenchReport) -> String {
    let mut out = field(
        "bench",
        &format!(
            "2 ranks (processes) through {} (ncclNetPlugin_v{})",
            r.plugin.path, r.plugin.abi
        ),
    );
    out += &setup_section(&r.fabric, &r.policy, &r.topology);
    out.push('\n');
    out += &devices_section(&r.devices);
    if !r.fuse_request.is_empty() {
        out += &field(
            "vnic",
            &format!(
                "makeVDevice of devices {}, as NCCL core asks by default: device {}",
                list(&r.fuse_request),
                r.device
            ),
        );
    }
    out.push('\n');
    out += &observed_section(&r.observed);
    out.push('\n');
    out += &field(
        "bandwidth",
        &format!(
            "device {} ({}); a stream, up to 8 messages in flight; the receiver's clock; {} warmup + {}; every byte of the first transfer of each size checked",
            r.device,
            r.device_name,
            r.warmup,
            repeated("the timed iterations per size", r.repeats)
        ),
    );
    out += &render::table(
        2,
        &[
            "size",
            "iters",
            "time µs",
            "algbw GB/s",
            "tcp µs",
            "tcp GB/s",
            "ratio",
            "cpu µs",
            "tcp cpu µs",
        ],
        &r.rows,
        |row| {
            vec![
                row.size.to_string(),
                row.iters.to_string(),
                format!("{:.1}", row.time_us),
                format!("{:.3}", row.algbw_gbps),
                format!("{:.1}", row.tcp_time_us),
                format!("{:.3}", row.tcp_algbw_gbps),
                ratio_cell(&row.ratios),
                format!("{:.1}", row.cpu_us),
                format!("{:.1}", row.tcp_cpu_us),
            ]
        },
    );
    out += &field(
        "ratio",
        &match large_ratio(&r.rows) {
            Some(x) => format!(
                "{} for messages of 1 MiB and more (plugin algbw / raw TCP algbw, each repeat's mean over the sizes)",
                x.ratio()
            ),
            None => "no message of 1 MiB or more in --sizes".to_owned(),
        },
    );
    out.push('\n');
    out += &field(
        "latency",
        &format!(
            "a ping-pong, one message each way (a send comm and a recv comm per rank; TCP: one connection, TCP_NODELAY); the sender's clock; one way = half the round trip; {} warmup + {}; every byte of the first exchange checked both ways",
            r.latency_warmup,
            repeated("the timed round trips per size", r.repeats)
        ),
    );
    out += &render::table(
        2,
        &[
            "size",
            "iters",
            "median µs",
            "mean µs",
            "tcp median",
            "tcp mean",
            "ratio",
            "cpu µs",
            "tcp cpu µs",
        ],
        &r.latency,
        |row| {
            vec![
                row.size.to_string(),
                row.iters.to_string(),
                format!("{:.1}", row.latency_us),
                format!("{:.1}", row.mean_us),
                format!("{:.1}", row.tcp_latency_us),
                format!("{:.1}", row.tcp_mean_us),
                ratio_cell(&row.ratios),
                format!("{:.1}", row.cpu_us),
                format!("{:.1}", row.tcp_cpu_us),
            ]
        },
    );
    out += &field(
        "ratio",
        "plugin median / raw TCP median: how many times the socket's latency the plugin takes",
    );
    if r.repeats > 1 {
        out += &field(
            "repeats",
            "each figure is the median of the repeats'; a ratio is each repeat's plugin figure against the TCP figure measured right after it, their median (least–greatest)",
        );
    }
    out += &field(
        "cpu",
        "µs of CPU per message (ping-pong: per round trip), both ranks' processes, every thread (/proc/self/task/*/schedstat)",
    );
    out.push('\n');
    out += &one_sided_section(r);
    if let Some(c) = &r.connections {
        out.push('\n');
        out += &scale_section(c);
    }
    out
}

/// What a table's rows timed, and how often, for its header.
fn repeated(what: &str, repeats: u32) -> String {
    match repeats {
        1 => what.to_owned(),
        n => format!("{what}, {n} times alternating with TCP"),
    }
}

/// A ratio cell: the median of the repeats and their least–greatest.
fn ratio_cell(ratios: &[f64]) -> String {
    Spread::of(ratios).map_or_else(String::new, |s| s.ratio())
}

/// The one-sided table: each size's puts, puts with a signal and gets through the library's
/// RMA table, its puts against the bandwidth table's plugin figure.
fn one_sided_section(r: &BenchReport) -> String {
    let mut out = field(
        "one-sided",
        &format!(
            "ncclRmaPlugin_v{}, device {} ({}); 2 ranks, one context; the sender puts to the receiver: a stream, up to 8 in flight, the last with a strong signal, the receiver's clock from its go signal to that signal; put+signal: a ping-pong, one way = half the round trip; get: each alone, post to completion; {} warmup + the timed iterations per size; every byte of the first put, round trip and get of each size checked",
            r.one_sided.abi, r.device, r.device_name, r.warmup
        ),
    );
    out += &render::table(
        2,
        &[
            "size",
            "put GB/s",
            "vs two-sided",
            "put+signal µs",
            "get µs",
            "cpu µs/op",
        ],
        &r.one_sided.rows,
        |row| {
            vec![
                row.size.to_string(),
                format!("{:.3}", row.put_gbps),
                format!("{:.2}", row.put_vs_two_sided),
                format!("{:.1}", row.put_signal_us),
                format!("{:.1}", row.get_us),
                format!("{:.1}", row.put_cpu_us),
            ]
        },
    );
    out += &field(
        "vs",
        "put GB/s / the bandwidth table's plugin algbw of the same size, this run",
    );
    out + &field(
        "cpu",
        "µs of CPU per put of the stream, both ranks' processes, every thread (per round trip and per get: --json)",
    )
}

/// `--single-process` for people: setup, the plan when the library reports it, the table.
pub fn render_pairs(r: &PairsReport) -> String {
    let mut out = field(
        "bench",
        &format!(
            "1 process, both ends of one connection, through {} (ncclNetPlugin_v{})",
            r.plugin.path, r.plugin.abi
        ),
    );
    // The NCCL_WASM_* settings are this plugin's; another has its own decisions.
    out += &match r.observed {
        Some(_) => setup_section(&r.fabric, &r.policy, &r.topology),
        None => field(
            "settings",
            "not this plugin (no ncclwasm_send_comm_stats): fabric, policy and topology are its own; it reaches the soft fabric only through a libibverbs.so.1 on LD_LIBRARY_PATH",
        ),
    };
    let delivery = match r.fabric.provider.in_process {
        Some((var, _)) => format!("{var}={} (the {} provider's)", r.delivery, r.fabric.name),
        None => format!("the {} provider's own", r.fabric.name),
    };
    out += &field("delivery", &delivery);
    out.push('\n');
    out += &devices_section(&r.devices);
    out.push('\n');
    out += &match &r.observed {
        Some(o) => observed_section(o),
        None => field(
            "plan",
            "not reported: the library does not export ncclwasm_send_comm_stats",
        ),
    };
    out.push('\n');
    out += &field(
        "pairs",
        &format!(
            "device {} ({}); matched irecv + isend + test until both are done, `in flight` of them posted at once and timed together, per pair; the first pair of each size checked byte for byte",
            r.device, r.device_name
        ),
    );
    out + &render::table(
        2,
        &[
            "size",
            "in flight",
            "pairs",
            "median ns",
            "p99 ns",
            "mean ns",
        ],
        &r.rows,
        |row| {
            vec![
                row.size.to_string(),
                row.depth.to_string(),
                row.pairs.to_string(),
                format!("{:.0}", row.median_ns),
                format!("{:.0}", row.p99_ns),
                format!("{:.0}", row.mean_ns),
            ]
        },
    )
}

/// The connection-scale part: time per connection, and what each rank's process grew by.
fn scale_section(c: &ConnectionScale) -> String {
    let mut out = field(
        "connections",
        &format!(
            "{} set up at once between the ranks (the receiver listens and accepts each, the sender connects each; all advanced in one loop): {:.0} µs per connection (the slower rank), closed in {:.0} µs per connection",
            c.connections, c.setup_us_per_connection, c.close_us_per_connection
        ),
    );
    out += &render::table(
        2,
        &[
            "rank",
            "setup ms",
            "close ms",
            "RSS KiB/conn",
            "threads/conn",
            "fds/conn",
        ],
        &[("sender", &c.send), ("receiver", &c.recv)],
        |(name, s)| {
            vec![
                (*name).to_owned(),
                format!("{:.1}", s.setup_secs * 1e3),
                format!("{:.1}", s.close_secs * 1e3),
                format!("{:.1}", s.rss_kib_per_connection),
                format!("{:.2}", s.threads_per_connection),
                format!("{:.2}", s.fds_per_connection),
            ]
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(size: u64, iters: u32, secs: f64) -> Timing {
        Timing {
            size,
            iters,
            secs,
            checked_bytes: size,
        }
    }

    fn cpu(part: Part, size: u64, messages: u32, secs: f64) -> CpuUse {
        CpuUse {
            part,
            size,
            messages,
            secs,
        }
    }

    /// Each rank's CPU reports for `parts`, one per size in `sizes`: the receiver 1 µs and the
    /// sender 3 µs per message.
    fn both_ranks(parts: &[Part], sizes: &[u64]) -> [Vec<CpuUse>; 2] {
        let rank = |per: f64| {
            parts
                .iter()
                .flat_map(|&p| sizes.iter().map(move |&s| cpu(p, s, 4, 4.0 * per)))
                .collect()
        };
        [rank(1e-6), rank(3e-6)]
    }

    #[test]
    fn rows_divide_by_iterations_and_compare_to_tcp() {
        let sizes = [8, 1 << 20];
        let rows = rows(
            &[timing(8, 4, 4e-6), timing(1 << 20, 2, 2e-3)],
            &[timing(8, 4, 8e-6), timing(1 << 20, 2, 1e-3)],
            &both_ranks(&[Part::Plugin, Part::Tcp], &sizes),
            1,
        )
        .unwrap();
        // Both ranks' CPU per message, summed.
        assert!((rows[1].cpu_us - 4.0).abs() < 1e-9 && (rows[1].tcp_cpu_us - 4.0).abs() < 1e-9);
        // A rank that did not say: the run is incomplete.
        let mut missing = both_ranks(&[Part::Plugin, Part::Tcp], &sizes);
        missing[1].retain(|c| c.part != Part::Tcp);
        assert!(super::rows(&[timing(8, 4, 1.0)], &[timing(8, 4, 1.0)], &missing, 1).is_err());
        assert_eq!(rows[0].count, 2);
        assert!((rows[0].time_us - 1.0).abs() < 1e-9);
        assert!((rows[0].algbw_gbps - 0.008).abs() < 1e-9);
        assert!((rows[0].ratio - 2.0).abs() < 1e-9);
        assert!((rows[1].ratio - 0.5).abs() < 1e-9);
        assert_eq!(large_ratio(&rows).map(|s| s.median), Some(0.5));
        assert_eq!(large_ratio(&rows[..1]), None);
        let cpu = both_ranks(&[Part::Plugin, Part::Tcp], &sizes);
        assert!(super::rows(&[timing(8, 1, 1.0)], &[], &cpu, 1).is_err());
    }

    /// Three alternating repeats of two sizes: each ratio is a repeat's plugin figure against
    /// its own baseline, the row its median with the extremes, and the large-message ratio each
    /// repeat's mean over the large sizes, the median of those.
    #[test]
    fn repeats_give_each_ratio_its_median_and_spread() {
        const MIB: u64 = 1 << 20;
        let sizes = [MIB, 2 * MIB];
        // Repeat r of a size: the plugin 1, 2, 4 ms, TCP always 2 ms (ratios 2, 1, 0.5); the
        // second size's ratios are twice the first's.
        // Only the first repeat of a size checks a transfer.
        let repeats = |s: u64, secs: [f64; 3]| {
            secs.into_iter().enumerate().map(move |(r, t)| Timing {
                checked_bytes: if r == 0 { s } else { 0 },
                ..timing(s, 1, t)
            })
        };
        let plugin: Vec<Timing> = sizes
            .iter()
            .flat_map(|&s| repeats(s, [1e-3, 2e-3, 4e-3].map(|t| t * MIB as f64 / s as f64)))
            .collect();
        let tcp: Vec<Timing> = sizes.iter().flat_map(|&s| repeats(s, [2e-3; 3])).collect();
        let parts = [Part::Plugin, Part::Tcp];
        let cpu: [Vec<CpuUse>; 2] = [0, 1].map(|_| {
            parts
                .iter()
                .flat_map(|&p| {
                    sizes
                        .iter()
                        .flat_map(move |&s| [1.0, 3.0, 2.0].map(|us| cpu(p, s, 1, us * 1e-6)))
                })
                .collect()
        });
        let rows = rows(&plugin, &tcp, &cpu, 3).unwrap();
        assert_eq!(rows.len(), 2);
        let r = &rows[0];
        assert_eq!(r.ratios, [2.0, 1.0, 0.5]);
        assert_eq!((r.ratio, r.ratio_min, r.ratio_max), (1.0, 0.5, 2.0));
        assert!((r.time_us - 2000.0).abs() < 1e-9 && (r.tcp_time_us - 2000.0).abs() < 1e-9);
        // Both ranks' CPU (2 µs each, the median) per message.
        assert!((r.cpu_us - 4.0).abs() < 1e-9);
        // Checked once, by the first repeat.
        assert_eq!((r.checked_bytes, r.tcp_checked_bytes), (MIB, MIB));
        assert_eq!(rows[1].ratios, [4.0, 2.0, 1.0]);
        assert_eq!(ratio_cell(&rows[1].ratios), "2.00× (1.00–4.00)");
        // Repeat by repeat over both sizes: 3, 1.5, 0.75.
        let large = large_ratio(&rows).unwrap();
        assert_eq!((large.median, large.min, large.max), (1.5, 0.75, 3.0));
        // A size whose repeats are not all there, or out of order: the run is incomplete.
        assert!(super::rows(&plugin[..5], &tcp[..5], &cpu, 3).is_err());
        let mut swapped = plugin.clone();
        swapped.swap(2, 3);
        assert!(super::rows(&swapped, &tcp, &cpu, 3).is_err());
    }

    #[test]
    fn latency_rows_compare_medians_with_tcp() {
        let trips = |median_secs: f64, mean_secs: f64| RoundTrips {
            size: 8,
            iters: 3,
            median_secs,
            mean_secs,
            checked_bytes: 16,
        };
        let cpu = both_ranks(&[Part::PluginPingPong, Part::TcpPingPong], &[8]);
        let rows = latency_rows(&[trips(30e-6, 40e-6)], &[trips(10e-6, 11e-6)], &cpu, 1).unwrap();
        assert!((rows[0].cpu_us - 4.0).abs() < 1e-9);
        assert!((rows[0].latency_us - 30.0).abs() < 1e-9);
        assert!((rows[0].mean_us - 40.0).abs() < 1e-9);
        assert!((rows[0].tcp_latency_us - 10.0).abs() < 1e-9);
        assert!((rows[0].ratio - 3.0).abs() < 1e-9);
        assert_eq!((rows[0].checked_bytes, rows[0].tcp_checked_bytes), (16, 16));
        assert!(latency_rows(&[trips(1.0, 1.0)], &[], &cpu, 1).is_err());
    }

    #[test]
    fn one_sided_rows_compare_puts_with_the_two_sided_stream() {
        let parts = [
            Part::Plugin,
            Part::Tcp,
            Part::Put,
            Part::PutSignal,
            Part::Get,
        ];
        let cpu = both_ranks(&parts, &[8]);
        let two_sided = rows(&[timing(8, 4, 4e-6)], &[timing(8, 4, 8e-6)], &cpu, 1).unwrap();
        let trips = RoundTrips {
            size: 8,
            iters: 4,
            median_secs: 5e-6,
            mean_secs: 6e-6,
            checked_bytes: 16,
        };
        let gets = Completions {
            size: 8,
            iters: 4,
            median_secs: 7e-6,
            mean_secs: 9e-6,
            checked_bytes: 8,
        };
        // Puts twice as fast as the two-sided stream's 1 µs per message.
        let puts = [timing(8, 4, 2e-6)];
        let rows = one_sided_rows(&two_sided, &puts, &[trips], &[gets], &cpu).unwrap();
        assert!((rows[0].put_gbps - 0.016).abs() < 1e-9);
        assert!((rows[0].put_vs_two_sided - 2.0).abs() < 1e-9);
        assert!((rows[0].put_signal_us - 5.0).abs() < 1e-9);
        assert!((rows[0].get_us - 7.0).abs() < 1e-9 && (rows[0].get_mean_us - 9.0).abs() < 1e-9);
        assert!((rows[0].get_cpu_us - 4.0).abs() < 1e-9);
        assert_eq!(rows[0].checked_bytes, 32);
        // A size missing, or reported for another size: the run is incomplete.
        assert!(one_sided_rows(&two_sided, &[], &[trips], &[gets], &cpu).is_err());
        let other = [timing(16, 4, 2e-6)];
        assert!(one_sided_rows(&two_sided, &other, &[trips], &[gets], &cpu).is_err());
    }
}
