//! `ncclwasm bench`: two ranks (processes) send through the built plugin library exactly as NCCL
//! drives it and, size by size, over a plain TCP socket, and two tables compare the two:
//! bandwidth (a stream of messages) and latency (a ping-pong, one message each way).
//!
//! This process only orchestrates: it resolves the library, fabric, topology and policy, picks the
//! device as `policy explain` picks its sample connection's (the vNIC of NCCL core's default
//! fusion when the policy accepts it), starts the two ranks ([`crate::bench_rank`]) with the
//! matching `NCCL_WASM_*` environment, relays the listen handles and the TCP port between them,
//! and renders what the ranks timed and what the sender's connection reported it ran — the
//! plan and the bytes per QP, from the plugin itself rather than recomputed here. A rank that
//! dies or stalls fails the run with one line, never a hang.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use clap::Args as ClapArgs;
use ncclwasm_model::Topology;
use ncclwasm_soft::FabricChoice;
use serde::Serialize;

use crate::bench_rank::{self, DeviceLine, Msg, Observed, Role, RoundTrips, Timing};
use crate::bench_scale::{self, Footprint, Scale};
use crate::fail::{Fail, Outcome};
use crate::live::FabricView;
use crate::render::{self, Table, field};
use crate::report::{self, PolicyView, TopologyView, VnicValue};
use crate::setup::{self, ConfigArgs, PolicyArg};

/// nccl-tests' default range: 8 B to 64 MiB, doubling.
const BENCH_SIZES: &str =
    "8,16,32,64,128,256,512,1K,2K,4K,8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,8M,16M,32M,64M";

/// The ping-pong's default sizes: the latency-bound ones, 8 B to 64 KiB.
const LATENCY_SIZES: &str = "8,16,32,64,128,256,512,1K,2K,4K,8K,16K,32K,64K";

/// The connection-scale part's default: an all-to-all at scale opens this many between a pair
/// of ranks' processes.
const CONNECTIONS: u32 = 1024;

/// Sizes from here on count for the large-message ratio.
const LARGE: u64 = 1 << 20;

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The policy the plugin runs: a component (.wasm) or `builtin` [default: the shipped
    /// nccl-default, target/guests/nccl-default.wasm next to this binary]
    #[arg(long, value_name = "FILE|builtin")]
    pub policy: Option<PolicyArg>,

    /// The soft fabric's machine [default: $NCCL_WASM_TOPOLOGY, else topologies/loopback.toml]
    #[arg(long, short = 't', value_name = "T")]
    pub topology: Option<PathBuf>,

    /// Message sizes, comma-separated (bytes; K, M, G suffixes)
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = BENCH_SIZES,
        value_parser = setup::parse_size
    )]
    pub sizes: Vec<u64>,

    /// Timed iterations per size [default: about 128 MiB per size, 4 to 200]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: Option<u32>,

    /// Untimed iterations per size after the checked one
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub warmup: u32,

    /// Ping-pong sizes for the latency table, comma-separated (bytes; K, M, G suffixes)
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = LATENCY_SIZES,
        value_parser = setup::parse_size
    )]
    pub latency_sizes: Vec<u64>,

    /// Timed round trips per latency size, each timed alone
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub latency_iters: u32,

    /// Untimed round trips per latency size after the checked one
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub latency_warmup: u32,

    /// Connections set up at once between the ranks after the tables, timed and weighed
    /// (0: none)
    #[arg(long, value_name = "N", default_value_t = CONNECTIONS)]
    pub connections: u32,

    /// The plugin library: a path, or a name the dynamic loader looks up as NCCL does for
    /// NCCL_NET_PLUGIN (`wasm` is libnccl-net-wasm.so, found through LD_LIBRARY_PATH)
    /// [default: NCCL_NET_PLUGIN when set, else libnccl_net_wasm.so or libnccl-net-wasm.so next
    /// to this binary]
    #[arg(long, value_name = "SO|NAME")]
    pub plugin: Option<PathBuf>,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// Print the results as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

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
    /// The bandwidth table, one row per `--sizes`.
    pub rows: Vec<Row>,
    /// Mean of `ratio` over the sizes of 1 MiB and more.
    pub large_message_ratio: Option<f64>,
    pub latency_warmup: u32,
    /// The latency table, one row per `--latency-sizes`.
    pub latency: Vec<LatencyRow>,
    /// The connection-scale part (`None` with `--connections 0`).
    pub connections: Option<ConnectionScale>,
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

#[derive(Debug, PartialEq, Serialize)]
pub struct Row {
    pub size: u64,
    /// nccl-tests' count: 4-byte float elements.
    pub count: u64,
    pub iters: u32,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub tcp_time_us: f64,
    pub tcp_algbw_gbps: f64,
    /// Plugin algbw / TCP algbw.
    pub ratio: f64,
    /// Bytes of the first transfer the receiver compared with the sender's pattern.
    pub checked_bytes: u64,
    pub tcp_checked_bytes: u64,
}

/// One size of the ping-pong: one-way latency, half the round trip the sender timed.
#[derive(Debug, PartialEq, Serialize)]
pub struct LatencyRow {
    pub size: u64,
    pub iters: u32,
    /// Through the plugin: half the median round trip.
    pub latency_us: f64,
    /// Half the mean round trip.
    pub mean_us: f64,
    pub tcp_latency_us: f64,
    pub tcp_mean_us: f64,
    /// Plugin latency / TCP latency (medians): how many times the socket's time the plugin
    /// takes (the inverse sense of the bandwidth ratio).
    pub ratio: f64,
    /// Bytes of the first exchange compared with the sender's pattern, both ways.
    pub checked_bytes: u64,
    pub tcp_checked_bytes: u64,
}

/// Where the plugin library, the default policy and the guests are: next to this binary.
fn exe_dir() -> Result<PathBuf, Fail> {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .ok_or_else(|| Fail::trouble("cannot find this binary's directory"))
}

fn absolute(path: &Path) -> Result<PathBuf, Fail> {
    std::path::absolute(path).map_err(|e| Fail::trouble(format!("{}: {e}", path.display())))
}

/// How to build the plugin where this binary looks for it: cargo's directory of its profile.
const BUILD_PLUGIN: &str = if cfg!(debug_assertions) {
    "cargo build -p ncclwasm-plugin"
} else {
    "cargo build --release -p ncclwasm-plugin"
};

/// `--plugin`, else `NCCL_NET_PLUGIN`, else the library next to this binary (nothing builds it
/// as a side effect of building the CLI: it is its own package).
///
/// A value without `/` is a name, handed to `dlopen` as NCCL hands it (`X` becomes
/// `libnccl-net-X.so` unless it is a `lib*.so` name already), so the dynamic loader searches
/// `LD_LIBRARY_PATH` and its cache exactly as it does when NCCL loads the plugin: that is how an
/// installed copy is tried in the job's environment. NCCL also tries a bare `X` verbatim first,
/// which only a library file named like a plugin alias would answer; the bench does not.
fn plugin_path(args: &Args) -> Result<PathBuf, Fail> {
    let given = args.plugin.clone().map(|p| ("--plugin", p)).or_else(|| {
        std::env::var_os("NCCL_NET_PLUGIN")
            .filter(|v| !v.is_empty())
            .map(|v| ("NCCL_NET_PLUGIN", PathBuf::from(v)))
    });
    let path = match given {
        Some((_, p)) if !p.as_os_str().as_encoded_bytes().contains(&b'/') => {
            let name = p.to_string_lossy();
            return Ok(if name.starts_with("lib") && name.ends_with(".so") {
                p
            } else {
                PathBuf::from(format!("libnccl-net-{name}.so"))
            });
        }
        Some((_, p)) if p.is_file() => p,
        Some((from, p)) => {
            return Err(Fail::trouble(format!(
                "{from} {} not found (to build the plugin: `{BUILD_PLUGIN}`)",
                p.display()
            )));
        }
        None => {
            let dir = exe_dir()?;
            ncclwasm_abi::load::built_library(&dir).ok_or_else(|| {
                Fail::trouble(format!(
                    "no plugin library next to this binary (libnccl_net_wasm.so or libnccl-net-wasm.so in {}): build it with `{BUILD_PLUGIN}`, or pass --plugin PATH",
                    dir.display()
                ))
            })?
        }
    };
    absolute(&path)
}

fn policy_arg(args: &Args) -> Result<PolicyArg, Fail> {
    match &args.policy {
        Some(PolicyArg::File(p)) => Ok(PolicyArg::File(absolute(p)?)),
        Some(PolicyArg::Builtin) => Ok(PolicyArg::Builtin),
        None => {
            // cargo's `target/<profile>/ncclwasm` next to `target/guests/`, or the release
            // tarball's `bin/ncclwasm` next to `policies/` (`cargo xtask dist`).
            let dir = exe_dir()?;
            let up = dir.parent().map_or(dir.clone(), Path::to_path_buf);
            let built = up.join("guests/nccl-default.wasm");
            let shipped = up.join("policies/nccl-default.wasm");
            let path = [&built, &shipped].into_iter().find(|p| p.is_file());
            let path = path.ok_or_else(|| {
                Fail::trouble(format!(
                    "{} not found: build the shipped policies with `cargo xtask guests`, or pass --policy FILE|builtin",
                    built.display()
                ))
            })?;
            Ok(PolicyArg::File(path.clone()))
        }
    }
}

/// `NCCL_WASM_FABRIC` as the plugin reads it (`ncclwasm_soft::FabricChoice`), with `auto` on a
/// host without RDMA devices settled to the soft fabric, as `ncclwasm devices` shows it.
fn fabric() -> Result<FabricView, Fail> {
    let settled = FabricChoice::from_env().map_err(Fail::trouble)?.settle();
    Ok(FabricView::new(settled))
}

/// `--topology`, else `NCCL_WASM_TOPOLOGY`, else the embedded loopback machine (`None`: the
/// ranks use the plugin's own embedded copy).
fn topology(args: &Args) -> Result<(Topology, Option<PathBuf>), Fail> {
    let path = args
        .topology
        .clone()
        .or_else(|| std::env::var_os("NCCL_WASM_TOPOLOGY").map(PathBuf::from));
    match path {
        Some(p) => Ok((Topology::load(&p)?, Some(absolute(&p)?))),
        None => Ok((Topology::loopback(), None)),
    }
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    if args.sizes.is_empty() || args.latency_sizes.is_empty() {
        return Err(Fail::trouble(
            "--sizes and --latency-sizes may not be empty",
        ));
    }
    let lib = plugin_path(args)?;
    let fabric = fabric()?;
    let (topo, topo_path) = topology(args)?;
    let policy = policy_arg(args)?;
    let (host, view) = setup::host(setup::settings(&args.config)?, &policy)?;
    // The device of `policy explain`'s sample connection: a vNIC when the policy accepts the
    // sample fusion (the ranks then ask `makeVDevice` for it, as NCCL core does), else NCCL
    // device 0 — always device 0 on the `ib` fabric, whose ports are discovered, not read.
    let sample = if fabric.name == "soft" {
        Some(report::evaluate(&host, view.clone(), &topo, None, &[])?)
    } else {
        None
    };
    drop(host);
    let (device, fuse) = match sample
        .as_ref()
        .and_then(|p| p.connection.as_ref().map(|c| (p, c)))
    {
        Some((p, c)) => {
            let fused = p
                .vnic
                .as_ref()
                .filter(|v| !matches!(v.answer.value, VnicValue::Refuse));
            let fuse = match fused {
                Some(v) if c.device as usize >= p.nccl_devices.len() => v.request.clone(),
                _ => Vec::new(),
            };
            (c.device as i32, fuse)
        }
        None => (0, Vec::new()),
    };

    let mut env: Vec<(String, Option<String>)> = vec![
        ("NCCL_WASM_FABRIC".into(), Some(fabric.name.clone())),
        (
            "NCCL_WASM_TOPOLOGY".into(),
            topo_path.map(|p| p.display().to_string()),
        ),
        (
            "NCCL_WASM_POLICY".into(),
            match &policy {
                PolicyArg::File(p) => Some(p.display().to_string()),
                PolicyArg::Builtin => None,
            },
        ),
    ];
    if let Some(c) = &args.config.config {
        env.push(("NCCL_WASM_POLICY_CONFIG".into(), Some(c.clone())));
    }
    env.extend(
        args.config
            .env
            .iter()
            .map(|(k, v)| (k.clone(), Some(v.clone()))),
    );

    let mut rank_args: Vec<String> = vec![
        "--plugin".into(),
        lib.display().to_string(),
        "--device".into(),
        device.to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
        "--sizes".into(),
        list(&args.sizes),
        "--latency-sizes".into(),
        list(&args.latency_sizes),
        "--latency-iters".into(),
        args.latency_iters.to_string(),
        "--latency-warmup".into(),
        args.latency_warmup.to_string(),
        "--connections".into(),
        args.connections.to_string(),
    ];
    if !fuse.is_empty() {
        rank_args.push("--fuse".into());
        rank_args.push(list(&fuse));
    }
    if let Some(n) = args.iters {
        rank_args.push("--iters".into());
        rank_args.push(n.to_string());
    }
    let measured = Ranks::start(&rank_args, &env)?.drive(&Expected {
        sizes: args.sizes.len(),
        latency_sizes: args.latency_sizes.len(),
        connections: args.connections,
    })?;
    let connections = connection_scale(args.connections, &measured.scale)?;
    let rows = rows(&measured.plugin, &measured.tcp)?;
    let latency = latency_rows(&measured.plugin_latency, &measured.tcp_latency)?;
    let observed = measured
        .observed
        .ok_or_else(|| Fail::trouble("the sender did not report what its connection ran"))?;
    let report = BenchReport {
        plugin: PluginView {
            path: lib.display().to_string(),
            abi: measured.abi,
        },
        fabric,
        policy: view,
        topology: TopologyView::from(&topo),
        device,
        device_name: measured
            .devices
            .get(device as usize)
            .map_or_else(String::new, |d| d.name.clone()),
        devices: measured.devices,
        fuse_request: fuse,
        observed,
        warmup: args.warmup,
        large_message_ratio: large_ratio(&rows),
        rows,
        latency_warmup: args.latency_warmup,
        latency,
        connections,
    };
    let text = if args.json {
        crate::json(&report)?
    } else {
        render(&report)
    };
    Ok(Outcome::success(text))
}

fn list<T: ToString>(items: &[T]) -> String {
    items.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

/// What the ranks reported: the streams' timings from the receiver, the ping-pongs' from the
/// sender.
#[derive(Debug)]
struct Measured {
    abi: u32,
    devices: Vec<DeviceLine>,
    plugin: Vec<Timing>,
    tcp: Vec<Timing>,
    plugin_latency: Vec<RoundTrips>,
    tcp_latency: Vec<RoundTrips>,
    /// From the sender.
    observed: Option<Observed>,
    /// Each rank's connection-scale part and its close time, by rank.
    scale: [Option<(Scale, Option<f64>)>; 2],
}

/// How many rows each table gets.
#[derive(Debug)]
struct Expected {
    sizes: usize,
    latency_sizes: usize,
    connections: u32,
}

/// The two rank processes; killed (and reaped) on drop unless they finished.
#[derive(Debug)]
struct Ranks {
    children: Vec<Child>,
    /// Each rank's stdin: the peer's handle, the TCP port (the sender) and the end of the run
    /// go there.
    stdins: Vec<ChildStdin>,
    events: mpsc::Receiver<(usize, Option<Msg>)>,
    /// Each rank's stderr, read to the end.
    errors: Vec<Option<std::thread::JoinHandle<String>>>,
}

const ROLES: [(Role, &str); 2] = [(Role::Recv, "receiver"), (Role::Send, "sender")];

/// How long a rank that is done (or failed) may take to exit: `finalize` stops the plugin's
/// threads.
const REAP: Duration = Duration::from_secs(10);

impl Ranks {
    fn start(rank_args: &[String], env: &[(String, Option<String>)]) -> Result<Ranks, Fail> {
        let exe = std::env::current_exe()
            .map_err(|e| Fail::trouble(format!("cannot re-run this binary: {e}")))?;
        let (tx, events) = mpsc::channel();
        let mut ranks = Ranks {
            children: Vec::new(),
            stdins: Vec::new(),
            events,
            errors: Vec::new(),
        };
        for (i, (role, _)) in ROLES.iter().enumerate() {
            let mut cmd = Command::new(&exe);
            cmd.arg("bench-rank")
                .arg("--role")
                .arg(if *role == Role::Recv { "recv" } else { "send" })
                .args(rank_args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                match v {
                    Some(v) => cmd.env(k, v),
                    None => cmd.env_remove(k),
                };
            }
            let mut child = cmd
                .spawn()
                .map_err(|e| Fail::trouble(format!("cannot start a rank: {e}")))?;
            let stdout = child.stdout.take().expect("piped");
            let mut stderr = child.stderr.take().expect("piped");
            ranks.stdins.push(child.stdin.take().expect("piped"));
            ranks.children.push(child);
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    // Anything else on stdout (a library printing) is not ours to interpret.
                    let Ok(msg) = serde_json::from_str::<Msg>(&line) else {
                        continue;
                    };
                    if tx.send((i, Some(msg))).is_err() {
                        break;
                    }
                }
                let _ = tx.send((i, None));
            });
            ranks.errors.push(Some(std::thread::spawn(move || {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                text
            })));
        }
        Ok(ranks)
    }

    /// Rank `i`'s exit status, waiting at most [`REAP`]; a rank still running then is killed.
    fn reap(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        let child = &mut self.children[i];
        let start = std::time::Instant::now();
        while start.elapsed() < REAP {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Why rank `i` stopped: its `error:` line, or its exit status.
    fn failure(&mut self, i: usize) -> Fail {
        let name = ROLES[i].1;
        let status = self.reap(i);
        let text = self.errors[i]
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with("error: "))
            .map(|l| l.trim_start_matches("error: ").to_owned())
            .or_else(|| {
                text.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(str::to_owned)
            });
        // The plugin WARNs on stderr when it has no NCCL logger: its last word says why.
        let warn = text
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("WARN "))
            .map_or(String::new(), |w| format!(" [{w}]"));
        match (line, status) {
            (Some(l), _) => Fail::trouble(format!("bench rank {i} ({name}) failed: {l}{warn}")),
            (None, Some(s)) => Fail::trouble(format!("bench rank {i} ({name}) stopped ({s})")),
            (None, None) => Fail::trouble(format!(
                "bench rank {i} ({name}) stopped answering and was killed"
            )),
        }
    }

    /// One line to rank `i`.
    fn relay(&mut self, i: usize, line: &str) -> Result<(), Fail> {
        let to = &mut self.stdins[i];
        if writeln!(to, "{line}").and_then(|()| to.flush()).is_err() {
            return Err(self.failure(i));
        }
        Ok(())
    }

    /// Relays and collects until both ranks are done; every wait bounded.
    fn drive(mut self, expected: &Expected) -> Result<Measured, Fail> {
        let mut m = Measured {
            abi: 0,
            devices: Vec::new(),
            plugin: Vec::new(),
            tcp: Vec::new(),
            plugin_latency: Vec::new(),
            tcp_latency: Vec::new(),
            observed: None,
            scale: [None, None],
        };
        let progress = Progress::new();
        let mut done = [false; 2];
        let mut plugin_done = [false; 2];
        // A rank gives up after its own stall limit; this one covers a rank that hangs anyway.
        let limit = bench_rank::STALL + Duration::from_secs(30);
        while !done.iter().all(|&d| d) {
            let (i, msg) = match self.events.recv_timeout(limit) {
                Ok(event) => event,
                Err(_) => {
                    return Err(Fail::trouble(format!(
                        "the bench ranks made no progress for {} s",
                        limit.as_secs()
                    )));
                }
            };
            match msg {
                None if !done[i] => return Err(self.failure(i)),
                None => {}
                Some(Msg::Done) => done[i] = true,
                // Both ranks load the same library; the receiver's view is shown.
                Some(Msg::Hello { abi, devices }) if i == 0 => {
                    m.abi = abi;
                    m.devices = devices;
                }
                Some(Msg::Hello { .. }) => {}
                Some(Msg::Observed(o)) => m.observed = Some(o),
                // Each rank connects to the other's listener.
                Some(Msg::Handle(h)) => self.relay(1 - i, &h)?,
                Some(Msg::TcpPort(p)) => self.relay(1, &p.to_string())?,
                Some(Msg::PluginDone) => {
                    plugin_done[i] = true;
                    if plugin_done.iter().all(|&d| d) {
                        for r in 0..ROLES.len() {
                            self.relay(r, bench_rank::PLUGIN_DONE)?;
                        }
                    }
                }
                Some(Msg::Plugin(t)) => {
                    m.plugin.push(t);
                    progress.show("plugin", t.size, m.plugin.len(), expected.sizes);
                }
                Some(Msg::PluginPingPong(r)) => {
                    m.plugin_latency.push(r);
                    let n = m.plugin_latency.len();
                    progress.show("plugin ping-pong", r.size, n, expected.latency_sizes);
                }
                Some(Msg::Tcp(t)) => {
                    m.tcp.push(t);
                    progress.show("tcp", t.size, m.tcp.len(), expected.sizes);
                }
                Some(Msg::TcpPingPong(r)) => {
                    m.tcp_latency.push(r);
                    let n = m.tcp_latency.len();
                    progress.show("tcp ping-pong", r.size, n, expected.latency_sizes);
                    if n == expected.latency_sizes && expected.connections > 0 {
                        progress.phase(&format!("{} connections", expected.connections));
                    }
                }
                // The receiver's handles, to the sender.
                Some(Msg::Handles(h)) => self.relay(1, &h.join(","))?,
                Some(Msg::Scale(s)) => {
                    m.scale[i] = Some((s, None));
                    if m.scale.iter().all(Option::is_some) {
                        for r in 0..ROLES.len() {
                            self.relay(r, bench_scale::SCALE_DONE)?;
                        }
                    }
                }
                Some(Msg::ScaleClosed(secs)) => {
                    if let Some((_, close)) = &mut m.scale[i] {
                        *close = Some(secs);
                    }
                }
            }
        }
        progress.clear();
        for i in 0..self.children.len() {
            if !self.reap(i).is_some_and(|s| s.success()) {
                return Err(self.failure(i));
            }
        }
        self.children.clear();
        Ok(m)
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One overwritten status line on stderr, only when it is a terminal.
#[derive(Debug)]
struct Progress {
    tty: bool,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, phase: &str, size: u64, n: usize, total: usize) {
        if self.tty {
            eprint!(
                "\r\x1b[Kbench: {phase} {} ({n}/{total})",
                render::size(size)
            );
        }
    }

    fn phase(&self, phase: &str) {
        if self.tty {
            eprint!("\r\x1b[Kbench: {phase}");
        }
    }

    fn clear(&self) {
        if self.tty {
            eprint!("\r\x1b[K");
        }
    }
}

/// The table's rows: both runs of each size, in order.
fn rows(plugin: &[Timing], tcp: &[Timing]) -> Result<Vec<Row>, Fail> {
    if plugin.len() != tcp.len() {
        return Err(Fail::trouble("the ranks reported an incomplete run"));
    }
    Ok(plugin
        .iter()
        .zip(tcp)
        .map(|(p, t)| {
            let per = |x: &Timing| x.secs / f64::from(x.iters.max(1));
            let bw = |x: &Timing| x.size as f64 / per(x).max(1e-12) / 1e9;
            Row {
                size: p.size,
                count: p.size / 4,
                iters: p.iters,
                time_us: per(p) * 1e6,
                algbw_gbps: bw(p),
                tcp_time_us: per(t) * 1e6,
                tcp_algbw_gbps: bw(t),
                ratio: bw(p) / bw(t),
                checked_bytes: p.checked_bytes,
                tcp_checked_bytes: t.checked_bytes,
            }
        })
        .collect())
}

/// The latency table's rows: both ping-pongs of each size, in order.
fn latency_rows(plugin: &[RoundTrips], tcp: &[RoundTrips]) -> Result<Vec<LatencyRow>, Fail> {
    if plugin.len() != tcp.len() {
        return Err(Fail::trouble("the ranks reported an incomplete ping-pong"));
    }
    Ok(plugin
        .iter()
        .zip(tcp)
        .map(|(p, t)| LatencyRow {
            size: p.size,
            iters: p.iters,
            latency_us: p.median_secs * 1e6,
            mean_us: p.mean_secs * 1e6,
            tcp_latency_us: t.median_secs * 1e6,
            tcp_mean_us: t.mean_secs * 1e6,
            ratio: p.median_secs / t.median_secs.max(1e-12),
            checked_bytes: p.checked_bytes,
            tcp_checked_bytes: t.checked_bytes,
        })
        .collect())
}

/// The connection-scale figures from both ranks' reports (`None` when none was asked for).
fn connection_scale(
    n: u32,
    scale: &[Option<(Scale, Option<f64>)>; 2],
) -> Result<Option<ConnectionScale>, Fail> {
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
        _ => Err(Fail::trouble(format!(
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

/// The plan the sender's connection ran and the bytes each QP carried.
fn observed_section(o: &Observed) -> String {
    let mut out = field(
        "plan",
        &format!(
            "as the sender's connection ran it (the plugin's ncclwasm_send_comm_stats): {} QP(s)",
            o.qps.len()
        ),
    );
    out += &field("  source", &o.source);
    out += &field("  why", &o.reason);
    let stripe = (o.stripe_width.max(1) as usize).min(o.qps.len());
    let mut t = Table::new(2, &["plan", "value"]);
    for (label, value) in [
        (
            "stripe width",
            format!("{stripe} of {} QPs per message", o.qps.len()),
        ),
        ("align", format!("{} bytes", o.align)),
        (
            "adaptive routing",
            report::adaptive_routing_value(o.adaptive_routing, o.ar_threshold),
        ),
        (
            "tc / sl / fifo tc",
            format!("{} / {} / {}", o.tc, o.sl, o.fifo_tc),
        ),
        (
            "ece / timeout / retry",
            report::ece_timeout_retry_value(o.ece, o.timeout, o.retry_cnt),
        ),
    ] {
        t.row(vec![label.to_owned(), value]);
    }
    out += &t.render();
    let mut t = Table::new(2, &["qp", "local", "remote", "weight", "bytes", "share"]);
    for (i, q) in o.qps.iter().enumerate() {
        t.row(vec![
            i.to_string(),
            q.local.clone(),
            q.remote.clone(),
            q.weight.to_string(),
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

fn large_ratio(rows: &[Row]) -> Option<f64> {
    let large: Vec<f64> = rows
        .iter()
        .filter(|r| r.size >= LARGE)
        .map(|r| r.ratio)
        .collect();
    (!large.is_empty()).then(|| large.iter().sum::<f64>() / large.len() as f64)
}

/// The run for people: setup, the plan the connection ran, the nccl-tests-style bandwidth table,
/// then the latency table.
pub fn render(r: &BenchReport) -> String {
    let mut out = field(
        "bench",
        &format!(
            "2 ranks (processes) through {} (ncclNetPlugin_v{})",
            r.plugin.path, r.plugin.abi
        ),
    );
    out += &field("fabric", &format!("{}  ({})", r.fabric.name, r.fabric.why));
    out += &field(
        "policy",
        &match &r.policy.origin {
            Some(origin) => format!("{} {}  ({origin})", r.policy.name, r.policy.version),
            None => "built-in default (NCCL's own decisions)".to_owned(),
        },
    );
    out += &field(
        "topology",
        &format!("{}  ({})", r.topology.name, r.topology.origin),
    );
    out.push('\n');
    out += &field("devices", "as the plugin's getProperties reports them");
    let mut t = Table::new(2, &["dev", "name", "speed", "ports of"]);
    for (i, d) in r.devices.iter().enumerate() {
        t.row(vec![
            i.to_string(),
            d.name.clone(),
            render::speed(u32::try_from(d.speed_mbps).unwrap_or(0)),
            list(&d.children),
        ]);
    }
    out += &t.render();
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
            "device {} ({}); a stream, up to 8 messages in flight; the receiver's clock; {} warmup + the timed iterations per size; every byte of the first transfer of each size checked",
            r.device, r.device_name, r.warmup
        ),
    );
    out += &render::table(
        2,
        &[
            "size",
            "count",
            "iters",
            "time µs",
            "algbw GB/s",
            "tcp µs",
            "tcp GB/s",
            "ratio",
        ],
        &r.rows,
        |row| {
            vec![
                row.size.to_string(),
                row.count.to_string(),
                row.iters.to_string(),
                format!("{:.1}", row.time_us),
                format!("{:.3}", row.algbw_gbps),
                format!("{:.1}", row.tcp_time_us),
                format!("{:.3}", row.tcp_algbw_gbps),
                format!("{:.2}", row.ratio),
            ]
        },
    );
    out += &field(
        "ratio",
        &match r.large_message_ratio {
            Some(x) => format!(
                "{x:.2} for messages of 1 MiB and more (plugin algbw / raw TCP algbw, mean)"
            ),
            None => "no message of 1 MiB or more in --sizes".to_owned(),
        },
    );
    out.push('\n');
    out += &field(
        "latency",
        &format!(
            "a ping-pong, one message each way (a send comm and a recv comm per rank; TCP: one connection, TCP_NODELAY); the sender's clock; one way = half the round trip; {} warmup + the timed round trips per size; every byte of the first exchange checked both ways",
            r.latency_warmup
        ),
    );
    out += &render::table(
        2,
        &[
            "size",
            "iters",
            "median µs",
            "mean µs",
            "tcp median µs",
            "tcp mean µs",
            "ratio",
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
                format!("{:.2}", row.ratio),
            ]
        },
    );
    out += &field(
        "ratio",
        "plugin median / raw TCP median: how many times the socket's latency the plugin takes",
    );
    if let Some(c) = &r.connections {
        out.push('\n');
        out += &scale_section(c);
    }
    out
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

    #[test]
    fn rows_divide_by_iterations_and_compare_to_tcp() {
        let rows = rows(
            &[timing(8, 4, 4e-6), timing(1 << 20, 2, 2e-3)],
            &[timing(8, 4, 8e-6), timing(1 << 20, 2, 1e-3)],
        )
        .unwrap();
        assert_eq!(rows[0].count, 2);
        assert!((rows[0].time_us - 1.0).abs() < 1e-9);
        assert!((rows[0].algbw_gbps - 0.008).abs() < 1e-9);
        assert!((rows[0].ratio - 2.0).abs() < 1e-9);
        assert!((rows[1].ratio - 0.5).abs() < 1e-9);
        assert_eq!(large_ratio(&rows), Some(0.5));
        assert_eq!(large_ratio(&rows[..1]), None);
        assert!(super::rows(&[timing(8, 1, 1.0)], &[]).is_err());
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
        let rows = latency_rows(&[trips(30e-6, 40e-6)], &[trips(10e-6, 11e-6)]).unwrap();
        assert!((rows[0].latency_us - 30.0).abs() < 1e-9);
        assert!((rows[0].mean_us - 40.0).abs() < 1e-9);
        assert!((rows[0].tcp_latency_us - 10.0).abs() < 1e-9);
        assert!((rows[0].ratio - 3.0).abs() < 1e-9);
        assert_eq!((rows[0].checked_bytes, rows[0].tcp_checked_bytes), (16, 16));
        assert!(latency_rows(&[trips(1.0, 1.0)], &[]).is_err());
    }
}
