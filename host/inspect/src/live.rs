//! The live machine: the ports the plugin would discover on this host, through the plugin's own
//! code path — `NCCL_WASM_FABRIC` read by `ncclwasm_fabrics::FabricChoice`, the provider it opens,
//! `Fabric::discover` — for `devices`, `topology capture` and `doctor`.
//!
//! The one departure from the plugin: under `auto` on a host without RDMA devices the plugin
//! would not start, and a provider that needs no NIC (the soft fabric) is shown instead, when
//! this build carries one ([`FabricChoice::settle`]); the
//! fabric's `why` says so on every output.

use std::path::Path;
use std::sync::Arc;

use ncclwasm_fabrics::{FabricChoice, Provider, Settled};
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::{Port, Topology};
use ncclwasm_policy::PolicyHost;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{Net, NetConfig};
use ncclwasm_verbs::{ENV_SYSFS_ROOT, Fabric};
use serde::Serialize;

use crate::Error;

/// Which fabric discovery ran on, and why.
#[derive(Clone, Debug, Serialize)]
pub struct FabricView {
    /// `auto`, `ib` or `soft`: the `NCCL_WASM_FABRIC` value the plugin would run with here.
    pub name: String,
    /// The provider behind it, asked what it can do.
    #[serde(skip)]
    pub provider: &'static Provider,
    /// `auto` found no RDMA device and a provider that needs none stands in.
    #[serde(skip)]
    pub stood_in: bool,
    pub why: String,
    /// The verbs library `dlopen`ed (the `ib` fabric), as the loader resolved it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub library: Option<String>,
    /// `NCCL_WASM_SYSFS_ROOT`, when discovery read sysfs from another tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sysfs_root: Option<String>,
}

impl FabricView {
    /// The fabric the plugin would run on here, before anything is opened (`bench` hands it to
    /// its ranks).
    pub fn from_env() -> Result<FabricView, Error> {
        settle().map(FabricView::new)
    }

    /// The view of a settled choice, before anything is opened.
    fn new(settled: Settled) -> FabricView {
        FabricView {
            name: settled.choice.name().to_owned(),
            provider: settled.choice.provider(),
            stood_in: settled.stood_in,
            why: settled.why,
            library: None,
            sysfs_root: std::env::var(ENV_SYSFS_ROOT).ok().filter(|s| !s.is_empty()),
        }
    }
}

/// `NCCL_WASM_FABRIC` as the plugin reads it, with `auto` on a host without RDMA devices
/// settled to a provider that needs none ([`FabricChoice::settle`]).
fn settle() -> Result<Settled, Error> {
    Ok(FabricChoice::from_env()
        .map_err(|e| Error::Fabric(e.to_string()))?
        .settle())
}

/// What discovery found on this host.
#[derive(Debug)]
pub struct Live {
    pub fabric: FabricView,
    pub ports: Vec<Port>,
    /// The same ports as a topology (named after the host), the input of the policy report
    /// and of `topology capture`.
    pub topology: Topology,
}

/// Discovers this host's ports as the plugin does at `init`.
pub fn discover() -> Result<Live, Error> {
    let settled = settle()?;
    let fabric: Arc<Fabric> = settled.choice.open().map_err(|e| {
        Error::Fabric(format!(
            "cannot open the {} fabric: {e}",
            settled.choice.name()
        ))
    })?;
    let ports = fabric.discover(ncclwasm_verbs::merge_vfs_from_env());
    let view = FabricView {
        library: fabric
            .library_path()
            .map(|p| resolved_library(p).unwrap_or(p.to_owned())),
        ..FabricView::new(settled)
    };
    let mut topology = Topology::from_ports(
        &hostname(),
        &format!(
            "captured by ncclwasm {} on the {} fabric",
            env!("CARGO_PKG_VERSION"),
            view.name
        ),
        &ports,
    );
    topology.origin = format!("discovered on the {} fabric", view.name);
    if let Some(machine) = view.provider.emulated() {
        emulated_addresses(
            &mut topology,
            machine.map_err(|e| Error::Fabric(e.to_string()))?,
        );
    }
    Ok(Live {
        fabric: view,
        ports,
        topology,
    })
}

/// How many devices NCCL lets a vNIC fuse (`NCCL_NET_MAX_DEVS_PER_NIC`'s default; what the
/// plugin's v9–v11 `init` uses).
const MAX_DEVS_PER_NIC: usize = 4;

/// The plugin's `init` on this host, as `init_net` in host/plugin does it: the fabric
/// `NCCL_WASM_FABRIC` settles on here, the policy engine from `NCCL_WASM_POLICY*`, NCCL's
/// out-of-band variables; the error is what NCCL's log would show.
pub fn init() -> Result<Net, String> {
    let settled = FabricChoice::from_env()
        .map_err(|e| e.to_string())?
        .settle();
    let fabric = settled
        .choice
        .open()
        .map_err(|e| format!("cannot open the {} fabric: {e}", settled.choice.name()))?;
    let decisions = PolicyHost::from_env(MAX_DEVS_PER_NIC).map_err(|e| e.to_string())?;
    Net::new(NetConfig {
        fabric,
        require_active_port: settled.choice.requires_active_port(),
        max_devs_per_nic: MAX_DEVS_PER_NIC,
        decisions: Arc::new(decisions),
        oob: OobEnv::from_env(),
    })
    .map_err(|e| e.to_string())
}

/// An emulating provider (the soft fabric) binds each port to the address its topology file
/// gives; discovery cannot see it, so it is taken from the machine the provider loaded.
fn emulated_addresses(topology: &mut Topology, machine: &Topology) {
    for d in &mut topology.devices {
        let Some(sd) = machine.devices.iter().find(|s| s.name == d.name) else {
            continue;
        };
        for p in &mut d.ports {
            if let Some(sp) = sd.ports.iter().find(|s| s.port == p.port) {
                p.address = sp.address;
            }
        }
    }
}

/// The file the dynamic loader mapped for `library` (`libibverbs.so.1` →
/// `/usr/lib/…/libibverbs.so.1.14.44.0`), from this process's maps.
pub fn resolved_library(library: &str) -> Option<String> {
    let name = Path::new(library).file_name()?.to_str()?;
    let maps = file::read_to_string(Path::new("/proc/self/maps"), Limit::PROC).ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(name))
        })
        .map(str::to_owned)
}

/// This host's name, which names a captured topology.
fn hostname() -> String {
    file::hostname().unwrap_or_else(|| "this-host".to_owned())
}
