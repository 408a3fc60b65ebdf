//! The bench's parent process: it resolves the library, fabric, topology and policy, picks the
//! device as `policy explain` picks its sample connection's (the vNIC of NCCL core's default
//! fusion when the policy accepts it), starts the two ranks ([`super::ranks`]) with the matching
//! `NCCL_WASM_*` environment, and turns what they report into the report
//! ([`super::tables`]).

use std::path::{Path, PathBuf};

use clap::Args as ClapArgs;
use ncclwasm_inspect::live::FabricView;
use ncclwasm_inspect::render::json;
use ncclwasm_inspect::report::{self, TopologyView, VnicValue};
use ncclwasm_inspect::setup::{self, ConfigArgs, PolicyArg};
use ncclwasm_model::Topology;

use super::pairs::DEPTHS;
use super::ranks::{Expected, Ranks};
use super::tables::{
    BenchReport, OneSided, PairsReport, PluginView, connection_scale, large_ratio, latency_rows,
    one_sided_rows, render, render_pairs, rows,
};
use super::wire::list;
use crate::Error;

/// nccl-tests' default range: 8 B to 64 MiB, doubling.
const BENCH_SIZES: &str =
    "8,16,32,64,128,256,512,1K,2K,4K,8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,8M,16M,32M,64M";

/// The ping-pong's default sizes: the latency-bound ones, 8 B to 64 KiB.
const LATENCY_SIZES: &str = "8,16,32,64,128,256,512,1K,2K,4K,8K,16K,32K,64K";

/// Repeats of each size by default: enough that one noisy run is outvoted and the spread
/// says how far they disagree, few enough that the default run stays as long as one run of
/// each was.
const REPEATS: u32 = 5;

/// The connection-scale part's default: an all-to-all at scale opens this many between a pair
/// of ranks' processes.
const CONNECTIONS: u32 = 1024;

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

    /// Timed iterations per size and repeat [default: about 128 MiB per size over the repeats,
    /// at most 200 per repeat]
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

    /// Timed round trips per latency size and repeat, each timed alone
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    pub latency_iters: u32,

    /// Untimed round trips per latency size after the checked one
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub latency_warmup: u32,

    /// Timed runs of each size on each transport, alternating (plugin, TCP, plugin, …); each
    /// ratio is their median, shown with its least–greatest
    #[arg(long, value_name = "N", default_value_t = REPEATS, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,

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

    /// One process owns both ends of one connection on device 0 and times matched
    /// isend/irecv/test pairs, 1 and 8 in flight: the plugin's own cost per message (on the
    /// soft fabric with in-process delivery, NCCL_WASM_SOFT_DELIVERY=in-process), for this
    /// plugin or any other given with --plugin; instead of the two ranks' tables
    #[arg(long)]
    pub single_process: bool,

    /// --single-process: message sizes, comma-separated (bytes; K, M, G suffixes)
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = LATENCY_SIZES,
        value_parser = setup::parse_size
    )]
    pub pair_sizes: Vec<u64>,

    /// --single-process: timed pairs per size and depth (a tenth as many untimed first)
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub pairs: u32,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// Print the results as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

/// Where the plugin library, the default policy and the guests are: next to this binary.
fn exe_dir() -> Result<PathBuf, Error> {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
        .ok_or_else(|| Error::run("cannot find this binary's directory"))
}

fn absolute(path: &Path) -> Result<PathBuf, Error> {
    std::path::absolute(path).map_err(|e| Error::run(format!("{}: {e}", path.display())))
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
fn plugin_path(args: &Args) -> Result<PathBuf, Error> {
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
            return Err(Error::run(format!(
                "{from} {} not found (to build the plugin: `{BUILD_PLUGIN}`)",
                p.display()
            )));
        }
        None => {
            let dir = exe_dir()?;
            ncclwasm_abi::load::built_library(&dir).ok_or_else(|| {
                Error::run(format!(
                    "no plugin library next to this binary (libnccl_net_wasm.so or libnccl-net-wasm.so in {}): build it with `{BUILD_PLUGIN}`, or pass --plugin PATH",
                    dir.display()
                ))
            })?
        }
    };
    absolute(&path)
}

fn policy_arg(args: &Args) -> Result<PolicyArg, Error> {
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
                Error::run(format!(
                    "{} not found: build the shipped policies with `cargo xtask guests`, or pass --policy FILE|builtin",
                    built.display()
                ))
            })?;
            Ok(PolicyArg::File(path.clone()))
        }
    }
}

/// `--topology`, else `NCCL_WASM_TOPOLOGY`, else the embedded loopback machine (`None`: the
/// ranks use the plugin's own embedded copy).
fn topology(args: &Args) -> Result<(Topology, Option<PathBuf>), Error> {
    let path = args
        .topology
        .clone()
        .or_else(|| std::env::var_os("NCCL_WASM_TOPOLOGY").map(PathBuf::from));
    match path {
        Some(p) => Ok((Topology::load(&p)?, Some(absolute(&p)?))),
        None => Ok((Topology::loopback(), None)),
    }
}

/// The children's `NCCL_WASM_*` environment: the fabric, topology, policy and configuration
/// this run resolved (`None`: removed, so the plugin's own default applies).
fn environment(
    args: &Args,
    fabric: &FabricView,
    topo_path: Option<PathBuf>,
    policy: &PolicyArg,
) -> Vec<(String, Option<String>)> {
    let mut env: Vec<(String, Option<String>)> = vec![
        ("NCCL_WASM_FABRIC".into(), Some(fabric.name.clone())),
        (
            "NCCL_WASM_TOPOLOGY".into(),
            topo_path.map(|p| p.display().to_string()),
        ),
        (
            "NCCL_WASM_POLICY".into(),
            match policy {
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
    env
}

/// Runs the bench `args` ask for; the report as text or, with `--json`, JSON.
pub fn run(args: &Args) -> Result<String, Error> {
    if args.sizes.is_empty() || args.latency_sizes.is_empty() || args.pair_sizes.is_empty() {
        return Err(Error::run(
            "--sizes, --latency-sizes and --pair-sizes may not be empty",
        ));
    }
    let lib = plugin_path(args)?;
    // `NCCL_WASM_FABRIC` as the plugin reads it, settled as `ncclwasm devices` shows it.
    let fabric = FabricView::from_env()?;
    let (topo, topo_path) = topology(args)?;
    let policy = policy_arg(args)?;
    let (host, view) = setup::host(setup::settings(&args.config)?, &policy)?;
    let mut env = environment(args, &fabric, topo_path, &policy);
    if args.single_process {
        drop(host);
        // A provider that can deliver in process does, unless the caller chose the delivery
        // (the soft fabric's `tcp` times the fabric's threads too).
        let delivery = match fabric.provider.in_process {
            Some((var, in_process)) => {
                let value = std::env::var(var).unwrap_or_else(|_| in_process.to_owned());
                env.push((var.into(), Some(value.clone())));
                value
            }
            None => "own".to_owned(),
        };
        let measured = Ranks::start_single(
            &[
                "--plugin".into(),
                lib.display().to_string(),
                "--device".into(),
                "0".into(),
                "--sizes".into(),
                list(&args.pair_sizes),
                "--pairs".into(),
                args.pairs.to_string(),
                "--warmup".into(),
                (args.pairs / 10).to_string(),
            ],
            &env,
        )?
        .drive_single(args.pair_sizes.len() * DEPTHS.len())?;
        if measured.pairs.is_empty() {
            return Err(Error::run("the single-process bench timed nothing"));
        }
        let report = PairsReport {
            plugin: PluginView {
                path: lib.display().to_string(),
                abi: measured.abi,
            },
            fabric,
            delivery,
            policy: view,
            topology: TopologyView::from(&topo),
            device: 0,
            device_name: measured
                .devices
                .first()
                .map_or_else(String::new, |d| d.name.clone()),
            devices: measured.devices,
            observed: measured.observed,
            rows: measured.pairs,
        };
        let text = if args.json {
            json(&report)?
        } else {
            render_pairs(&report)
        };
        return Ok(text);
    }
    // The device of `policy explain`'s sample connection: a vNIC when the policy accepts the
    // sample fusion (the ranks then ask `makeVDevice` for it, as NCCL core does), else NCCL
    // device 0 — always device 0 on the `ib` fabric, whose ports are discovered, not read.
    let sample = if fabric.provider.emulated().is_some() {
        Some(report::evaluate(
            &host,
            view.clone(),
            &topo,
            None,
            &[],
            report::Connections::Sample,
            Default::default(),
        )?)
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
        "--repeats".into(),
        args.repeats.to_string(),
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
        repeats: args.repeats as usize,
        connections: args.connections,
    })?;
    let connections = connection_scale(args.connections, &measured.scale)?;
    let repeats = args.repeats as usize;
    let rows = rows(&measured.plugin, &measured.tcp, &measured.cpu, repeats)?;
    let latency = latency_rows(
        &measured.plugin_latency,
        &measured.tcp_latency,
        &measured.cpu,
        repeats,
    )?;
    let large = large_ratio(&rows);
    let one_sided = OneSided {
        abi: measured.rma_abi,
        rows: one_sided_rows(
            &rows,
            &measured.puts,
            &measured.put_signals,
            &measured.gets,
            &measured.cpu,
        )?,
    };
    let observed = measured
        .observed
        .ok_or_else(|| Error::run("the sender did not report what its connection ran"))?;
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
        repeats: args.repeats,
        large_message_ratio: large.map(|s| s.median),
        large_message_ratio_min: large.map(|s| s.min),
        large_message_ratio_max: large.map(|s| s.max),
        rows,
        latency_warmup: args.latency_warmup,
        latency,
        one_sided,
        connections,
    };
    let text = if args.json {
        json(&report)?
    } else {
        render(&report)
    };
    Ok(text)
}
