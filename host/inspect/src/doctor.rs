//! `doctor`'s checks: what will hold the plugin back on this host, each OK, WARN or FAIL with
//! the fix ([`Doctor::this_host`]; the CLI prints them one line each).
//!
//! Each check is a small function returning a [`Check`], run in [`checks`]; a new concern is a
//! new function and one line there. The inputs every check may need (the fabric choice, what
//! discovery found, the settings) are gathered once in [`Host`].

use ncclwasm_default::IbConfig;
use ncclwasm_fabrics::{ENV_FABRIC, FabricChoice};
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::{LinkLayer, PortState};
use ncclwasm_policy::{Settings, WASM_VARIABLES};
use ncclwasm_transport::{GpuSupport, Net};
use ncclwasm_verbs::{Fabric, IbOptions};
use serde::Serialize;

use crate::check::check;
use crate::live::{self, Live};
use crate::render::{duration, one_line, size};
use crate::report::port_name;
use crate::setup::{self, ConfigArgs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

/// One line of the report.
#[derive(Debug, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it (empty when OK).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub fix: String,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: String::new(),
        }
    }

    fn bad(
        name: &'static str,
        status: Status,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            status,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Doctor {
    pub checks: Vec<Check>,
    /// True when a check FAILed (the exit status is then 1).
    pub failed: bool,
}

/// What the checks look at, gathered once.
struct Host {
    /// `NCCL_WASM_FABRIC`, or why it is unusable.
    choice: Result<FabricChoice, String>,
    /// Discovery on the fabric the plugin would use (soft when `auto` finds no device).
    live: Result<Live, String>,
    /// `NCCL_IB_*` as the built-in default reads them.
    ib: Result<IbConfig, String>,
    /// The plugin's `init` here ([`live::init`]), or why it fails.
    net: Result<Net, String>,
}

impl Host {
    fn gather() -> Host {
        let ib = IbConfig::from_pairs(&ncclwasm_default::env_pairs()).map_err(|e| e.to_string());
        Host {
            choice: FabricChoice::from_env().map_err(|e| e.to_string()),
            live: live::discover().map_err(|e| one_line(&e.to_string())),
            ib,
            net: live::init(),
        }
    }

    /// Whether the plugin needs a real NIC here (an emulating provider, the soft fabric, pins
    /// and needs nothing).
    fn wants_nic(&self) -> bool {
        self.choice.as_ref().is_ok_and(|c| c.provider().needs_nic())
    }
}

/// Every check, in the order they print.
fn checks(host: &Host) -> Vec<Check> {
    let mut checks = vec![
        verbs_library(host),
        fabric(host),
        ports(host),
        roce_gids(host),
        memlock(host),
        init(host),
        oob(host),
    ];
    checks.extend(gpu(host));
    checks.extend([policy(), settings(host)]);
    checks.extend(config_warnings(host));
    checks
}

impl Doctor {
    /// Every check on this host, in the order they print.
    pub fn this_host() -> Doctor {
        let checks = checks(&Host::gather());
        let failed = checks.iter().any(|c| c.status == Status::Fail);
        Doctor { checks, failed }
    }
}

/// The plugin's `init` on this host: whether NCCL would get a context, and how many devices.
fn init(host: &Host) -> Check {
    const NAME: &str = "init";
    match &host.net {
        Ok(net) if net.device_count() == 0 => Check::bad(
            NAME,
            Status::Warn,
            format!(
                "a context opens on the {} fabric with no device (no active port passes                  NCCL_IB_HCA): NCCL falls back to another transport, as with its own IB transport",
                net.fabric_name()
            ),
            "bring a port up or correct NCCL_IB_HCA (`ncclwasm devices` shows the selection)",
        ),
        Ok(net) => Check::ok(
            NAME,
            format!(
                "a context opens on the {} fabric: {} device(s) for NCCL",
                net.fabric_name(),
                net.device_count()
            ),
        ),
        Err(e) => Check::bad(
            NAME,
            Status::Fail,
            format!("the plugin's init would fail: {e}"),
            "fix what the message names; NCCL then falls back to its own transports",
        ),
    }
}

/// The handshake listener's address: what `init` chose, or the same choice made alone when
/// `init` failed for another reason.
fn oob(host: &Host) -> Check {
    const NAME: &str = "oob";
    let choice = match &host.net {
        Ok(net) => Ok(net.oob().clone()),
        Err(_) => ncclwasm_transport::oob::choose_from_env().map_err(|e| e.to_string()),
    };
    match choice {
        Ok(c) => Check::ok(NAME, format!("{} {} ({})", c.ifname, c.addr.ip(), c.reason)),
        Err(e) => Check::bad(
            NAME,
            Status::Fail,
            e,
            "set NCCL_SOCKET_IFNAME to a running interface the other nodes reach (NCCL's own \
             sockets use the same one)",
        ),
    }
}

/// GPU memory registration on device 0, as `init` decided it: peer memory (`NCCL_PTR_CUDA`),
/// DMA-BUF (`NCCL_PTR_DMABUF`), relaxed ordering, flush, Data Direct. Without either GPU path
/// NCCL stages every GPU transfer through host memory.
fn gpu(host: &Host) -> Vec<Check> {
    let Ok(net) = &host.net else {
        return Vec::new();
    };
    let g: GpuSupport = match net.gpu_support(0) {
        Ok(g) => g,
        Err(e) => return vec![Check::bad("gpu", Status::Warn, e.to_string(), "")],
    };
    let gdr = g.peer_memory.value.is_some() || g.dmabuf.value;
    let mut out = vec![
        match (&g.peer_memory.value, g.dmabuf.value) {
            (Some(_), _) | (None, true) => Check::ok("peer-memory", g.peer_memory.reason.clone()),
            (None, false) => Check::bad(
                "peer-memory",
                Status::Warn,
                g.peer_memory.reason.clone(),
                "load nvidia-peermem (`modprobe nvidia-peermem`), or use DMA-BUF (Linux ≥ 5.12 \
                 and NVIDIA's open kernel modules): else GPU buffers bounce through host memory",
            ),
        },
        if g.dmabuf.value || g.peer_memory.value.is_some() {
            Check::ok("dma-buf", g.dmabuf.reason.clone())
        } else {
            Check::bad(
                "dma-buf",
                Status::Warn,
                g.dmabuf.reason.clone(),
                "a kernel and rdma-core with ibv_reg_dmabuf_mr (Linux ≥ 5.12, rdma-core ≥ 34)",
            )
        },
        Check::ok("relaxed-ord", g.relaxed_ordering.reason.clone()),
    ];
    if gdr {
        out.push(Check::ok("flush", g.flush.reason.clone()));
    }
    if g.data_direct.value.is_some() {
        out.push(Check::ok("data-direct", g.data_direct.reason.clone()));
    }
    out
}

/// libibverbs opened as the `ib` fabric opens it; its version from the file the loader mapped
/// (`libibverbs.so.1.14.44.0`: rdma-core 44).
fn verbs_library(host: &Host) -> Check {
    const NAME: &str = "libibverbs";
    match Fabric::ib(IbOptions::default()) {
        Ok(f) => {
            let path = f.library_path().unwrap_or("libibverbs.so.1");
            let file = live::resolved_library(path).unwrap_or_else(|| path.to_owned());
            Check::ok(NAME, format!("{} ({file})", library_version(&file)))
        }
        Err(e) => Check::bad(
            NAME,
            if host.wants_nic() {
                Status::Fail
            } else {
                Status::Warn
            },
            format!("{e}"),
            "install rdma-core (apt install ibverbs-providers libibverbs1, dnf install \
             rdma-core libibverbs), or point NCCL_WASM_IBVERBS_PATH at the library",
        ),
    }
}

/// `libibverbs.so.1.14.44.0` → `libibverbs 1.14.44.0 (rdma-core 44)`; a name without a full
/// version says only what it has.
pub fn library_version(file: &str) -> String {
    let name = file.rsplit('/').next().unwrap_or(file);
    match name.split_once(".so.") {
        Some((stem, version)) => {
            let parts: Vec<&str> = version.split('.').collect();
            match parts.get(2) {
                Some(release) => format!("{stem} {version} (rdma-core {release})"),
                None => format!("{stem} {version} (version not in the file name)"),
            }
        }
        None => format!("{name} (version not in the file name)"),
    }
}

/// `NCCL_WASM_FABRIC` and whether the plugin will start on it.
fn fabric(host: &Host) -> Check {
    const NAME: &str = "fabric";
    if let Err(e) = &host.choice {
        return Check::bad(
            NAME,
            Status::Fail,
            e.clone(),
            "use one of the values it names",
        );
    }
    match &host.live {
        Ok(live) if live.fabric.stood_in => Check::bad(
            NAME,
            Status::Fail,
            format!("auto: {}", live.fabric.why),
            format!(
                "install the NIC's driver and rdma-core; or {ENV_FABRIC}={} to run the \
                 plugin without a NIC (tests, demos)",
                live.fabric.name
            ),
        ),
        Ok(live) => Check::ok(NAME, format!("{} ({})", live.fabric.name, live.fabric.why)),
        Err(e) => Check::bad(
            NAME,
            Status::Fail,
            e.clone(),
            "see the message; `ncclwasm devices -v` shows discovery",
        ),
    }
}

/// Devices and active ports: `auto` starts only with an active port.
fn ports(host: &Host) -> Check {
    const NAME: &str = "ports";
    let Ok(live) = &host.live else {
        return Check::bad(NAME, Status::Fail, "discovery did not run", "see `fabric`");
    };
    let active: Vec<String> = live
        .ports
        .iter()
        .filter(|p| p.state == PortState::Active)
        .map(port_name)
        .collect();
    let found = format!(
        "{} device(s), {} port(s), {} active",
        live.topology.devices.len(),
        live.ports.len(),
        active.len()
    );
    if active.is_empty() {
        Check::bad(
            NAME,
            Status::Fail,
            found,
            "bring a port up: check the cable and `ibstat` (IB: a subnet manager must run) or \
             `ip link` of the RoCE netdev",
        )
    } else {
        Check::ok(NAME, format!("{found}: {}", active.join(", ")))
    }
}

/// Active RoCE ports must have a GID NCCL would pick that routes: configured and not
/// link-local (NCCL's own rule, `ncclwasm_default::select_gid`).
fn roce_gids(host: &Host) -> Check {
    const NAME: &str = "roce gids";
    let (Ok(live), Ok(ib)) = (&host.live, &host.ib) else {
        return Check::bad(
            NAME,
            Status::Warn,
            "not checked (discovery or NCCL_IB_* settings failed)",
            "see `fabric` and `settings`",
        );
    };
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for p in live
        .ports
        .iter()
        .filter(|p| p.link_layer == LinkLayer::Ethernet && p.state == PortState::Active)
    {
        let pick = ncclwasm_default::select_gid(ib, p);
        let name = port_name(p);
        match p.gids.iter().find(|g| g.index == pick.index) {
            Some(g) if !g.is_unconfigured() && !g.is_link_local() => {
                good.push(format!("{name} → {} {}", g.index, g.addr()));
            }
            Some(g) => bad.push(format!("{name} → {} {} (not routable)", g.index, g.addr())),
            None => bad.push(format!("{name} → {} (not in the table)", pick.index)),
        }
    }
    if !bad.is_empty() {
        Check::bad(
            NAME,
            Status::Fail,
            format!("no IPv4/IPv6 GID NCCL would pick: {}", bad.join(", ")),
            "give the port's netdev an IP address (`ip addr add … dev <netdev>`: the kernel adds \
             its RoCE GIDs), or set NCCL_IB_GID_INDEX / NCCL_IB_ADDR_FAMILY to an entry that has one",
        )
    } else if good.is_empty() {
        Check::ok(NAME, "no active RoCE port")
    } else {
        Check::ok(NAME, good.join(", "))
    }
}

/// What NCCL needs locked: its communication buffers (`NCCL_BUFFSIZE`, 4 MiB per channel and
/// peer, several channels per peer) plus the application's registered buffers; below this a
/// registration fails on any but the smallest job.
const MEMLOCK_NEEDED: u64 = 1 << 30;

/// `RLIMIT_MEMLOCK`: every registered buffer is pinned and counts against it.
fn memlock(host: &Host) -> Check {
    const NAME: &str = "memlock";
    const FIX: &str = "`ulimit -l unlimited` (limits.conf: `* - memlock unlimited`; systemd: \
                       LimitMEMLOCK=infinity; containers: `--ulimit memlock=-1`)";
    let Some((soft, hard)) = memlock_limits() else {
        return Check::bad(NAME, Status::Warn, "cannot read /proc/self/limits", FIX);
    };
    let show = |v: Option<u64>| v.map_or("unlimited".to_owned(), size);
    let found = format!("RLIMIT_MEMLOCK {} (hard {})", show(soft), show(hard));
    match soft {
        None => Check::ok(NAME, found),
        Some(b) if b >= MEMLOCK_NEEDED => Check::bad(
            NAME,
            Status::Warn,
            format!("{found}: enough for small jobs; NCCL recommends unlimited"),
            FIX,
        ),
        Some(_) if !host.wants_nic() => Check::bad(
            NAME,
            Status::Warn,
            format!("{found}: fine on the soft fabric (it pins nothing), too low for an RDMA NIC"),
            FIX,
        ),
        Some(_) => Check::bad(
            NAME,
            Status::Fail,
            format!(
                "{found}: NCCL pins its buffers (NCCL_BUFFSIZE 4 MiB per channel and peer) and \
                 yours; registration fails below about {}",
                size(MEMLOCK_NEEDED)
            ),
            FIX,
        ),
    }
}

/// Soft and hard `Max locked memory` in bytes (`None`: unlimited).
fn memlock_limits() -> Option<(Option<u64>, Option<u64>)> {
    let limits =
        file::read_to_string(std::path::Path::new("/proc/self/limits"), Limit::PROC).ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let mut values = line["Max locked memory".len()..].split_whitespace();
    let parse = |v: Option<&str>| match v? {
        "unlimited" => Some(None),
        n => n.parse().ok().map(Some),
    };
    Some((parse(values.next())?, parse(values.next())?))
}

/// `NCCL_WASM_POLICY`, loaded and tried as `policy check` does.
fn policy() -> Check {
    const NAME: &str = "policy";
    let Some(path) = std::env::var_os(ncclwasm_policy::ENV_POLICY).filter(|p| !p.is_empty()) else {
        return Check::ok(
            NAME,
            "NCCL_WASM_POLICY unset: the built-in default (NCCL's own decisions)",
        );
    };
    let path = std::path::PathBuf::from(path);
    let none = ConfigArgs {
        config: None,
        env: Vec::new(),
    };
    let checked = setup::settings(&none).and_then(|s| check(&path, s));
    match checked {
        Ok(c) => Check::ok(
            NAME,
            format!(
                "{} {} ({}): loads ({} KiB, {} to compile: {}), every hook answers",
                c.policy.name,
                c.policy.version,
                c.file,
                c.size_bytes.div_ceil(1024),
                duration(c.compile_ms / 1e3),
                c.cache
            ),
        ),
        Err(f) => Check::bad(
            NAME,
            Status::Fail,
            one_line(&f.to_string()),
            format!(
                "fix or replace {} (`ncclwasm policy check FILE` tells why), or unset \
                 NCCL_WASM_POLICY for the built-in default",
                path.display()
            ),
        ),
    }
}

/// One WARN per `NCCL_IB_*` value accepted as NCCL accepts it but read other than it reads
/// (`ConfigWarning`): the plugin WARNs the same at `init`.
fn config_warnings(host: &Host) -> Vec<Check> {
    let Ok(ib) = &host.ib else {
        return Vec::new();
    };
    ib.warnings()
        .iter()
        .map(|w| {
            Check::bad(
                "config",
                Status::Warn,
                w.to_string(),
                format!(
                    "NCCL's own IB transport reads it the same way; correct or unset {}, or set \
                     {}=1 to have the plugin refuse such values",
                    w.name,
                    ncclwasm_default::STRICT_CONFIG
                ),
            )
        })
        .collect()
}

/// `NCCL_IB_*` and `NCCL_WASM_*`: parsed as the plugin parses them, the ones set listed with
/// their source.
fn settings(host: &Host) -> Check {
    const NAME: &str = "settings";
    let mut errors: Vec<String> = Vec::new();
    if let Err(e) = &host.ib {
        errors.push(e.clone());
    }
    let settings = Settings::from_env();
    if let Err(e) = &settings {
        errors.push(e.to_string());
    }
    if !errors.is_empty() {
        return Check::bad(
            NAME,
            Status::Fail,
            errors.join("; "),
            "correct or unset the variable named",
        );
    }
    let mut set: Vec<String> = Vec::new();
    let mut defaults = 0;
    if let Ok(ib) = &host.ib {
        for s in ib.sources() {
            match s.source {
                ncclwasm_default::Source::Environment => {
                    set.push(format!("{}={} (environment)", s.name, s.value));
                }
                ncclwasm_default::Source::Default => defaults += 1,
            }
        }
        set.extend(
            ib.ignored()
                .iter()
                .map(|(k, v)| format!("{k}={v} (environment, read by the transport)")),
        );
    }
    for (k, v) in std::env::vars() {
        if WASM_VARIABLES.contains(&k.as_str()) {
            set.push(format!("{k}={v} (environment)"));
        }
    }
    set.sort();
    let summary = if set.is_empty() {
        format!("all at their defaults ({defaults} NCCL_IB_* read)")
    } else {
        format!("{}; {defaults} NCCL_IB_* at defaults", set.join(", "))
    };
    let unknown = settings.map(|s| s.unknown_warnings()).unwrap_or_default();
    if unknown.is_empty() {
        Check::ok(NAME, summary)
    } else {
        Check::bad(
            NAME,
            Status::Warn,
            format!("{summary}; {}", unknown.join("; ")),
            "correct the spelling, or unset the variable",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy crate lists every `NCCL_WASM_*` name by hand for the parts it does not
    /// depend on; they must be the names those parts read.
    #[test]
    fn the_known_wasm_variables_are_the_ones_each_part_reads() {
        for name in [
            ENV_FABRIC,
            ncclwasm_verbs::ENV_SYSFS_ROOT,
            ncclwasm_verbs::ib::PATH_ENV,
            ncclwasm_default::STRICT_CONFIG,
        ] {
            assert!(WASM_VARIABLES.contains(&name), "{name}");
        }
    }

    /// Issue 21, point 5: each value accepted as NCCL accepts it is one WARN line naming the
    /// variable and what was done.
    #[test]
    fn accepted_oddities_are_one_warn_each() {
        let pairs: Vec<(String, String)> = [
            ("NCCL_IB_ADDR_RANGE", "garbage"),
            ("NCCL_IB_GID_INDEX", "-5"),
            ("NCCL_IB_HCA", "mlx5_0, mlx5_1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let host = Host {
            choice: Ok(FabricChoice::Auto),
            live: Err("not run".into()),
            ib: IbConfig::from_pairs(&pairs).map_err(|e| e.to_string()),
            net: Err("not run".into()),
        };
        let warns = config_warnings(&host);
        assert_eq!(warns.len(), 3, "{warns:?}");
        assert!(
            warns
                .iter()
                .all(|c| c.status == Status::Warn && c.name == "config")
        );
        let text: Vec<&str> = warns.iter().map(|c| c.detail.as_str()).collect();
        let text = text.join("\n");
        for want in [
            "NCCL_IB_ADDR_RANGE=garbage: not address/prefix-length",
            "ignored, as NCCL does",
            "NCCL_IB_GID_INDEX=-5: negative; read as -1, automatic selection",
            "NCCL_IB_HCA=mlx5_0, mlx5_1: entry \" mlx5_1\" contains whitespace",
        ] {
            assert!(text.contains(want), "{want}\n{text}");
        }
    }

    #[test]
    fn version_comes_from_the_file_name() {
        assert_eq!(
            library_version("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0"),
            "libibverbs 1.14.44.0 (rdma-core 44)"
        );
        assert_eq!(
            library_version("libibverbs.so.1"),
            "libibverbs 1 (version not in the file name)"
        );
        assert_eq!(
            library_version("/opt/x/libsoft.so"),
            "libsoft.so (version not in the file name)"
        );
    }
}
