//! `policy check`: is this file a policy the plugin would load?
//!
//! The file is loaded exactly as the plugin loads it (compiled, checked against world
//! `ncclwasm:policy/policy`, instantiated, `init`-ed with the settings), then every hook is tried
//! on a small sample machine. A file the plugin would refuse is [`Error::Rejected`], told apart
//! from trouble with the settings or the engine, so a deployment script can refuse the file
//! before it reaches a job.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ncclwasm_model::Topology;
use ncclwasm_policy::{CompileCache, ENV_CACHE_DIR, PolicyError, PolicyHost, Settings};
use serde::Serialize;

use crate::Error;
use crate::report::{self, PolicyView};
use crate::setup;

/// The machine every hook is tried on: two RoCE ports of one card, so that every hook, the
/// fusion request included, has something to decide.
const SAMPLE: &str = r#"
name = "check-sample"
description = "two RoCE ports of one dual-port NIC"

[[devices]]
name = "mlx5_0"
provider = "mlx5"
pci-path = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
guid = "0x0002c90300000001"
numa-node = 0
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
address = "10.0.0.1"

[[devices]]
name = "mlx5_1"
provider = "mlx5"
pci-path = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.1"
guid = "0x0002c90300000001"
numa-node = 0
[[devices.ports]]
port = 1
link-layer = "ethernet"
speed-mbps = 100000
address = "10.0.1.1"
"#;

/// What `check` found, as printed with `--json`.
#[derive(Debug, Serialize)]
pub struct Checked {
    pub file: String,
    #[serde(flatten)]
    pub policy: PolicyView,
    /// The hooks the policy implements (WIT names); the built-in default makes the others.
    pub hooks: Vec<&'static str>,
    /// The component's size in bytes and its imports (checked before it was compiled).
    pub size_bytes: usize,
    pub imports: Vec<String>,
    /// Compiling it (or finding its compilation), and where the code came from: `memory`,
    /// `disk` (the compiled-policy cache), `compiled` (and stored there), `off` (no cache).
    pub compile_ms: f64,
    #[serde(serialize_with = "cache_name")]
    pub cache: CompileCache,
    /// The machine the hooks were tried on.
    pub trial: String,
}

/// A policy whose load will compile for long, said before it starts: how big it is, about how
/// long compiling takes, and where the result is kept so later loads skip it.
#[derive(Debug, Clone, PartialEq)]
pub struct LongCompile {
    pub bytes: u64,
    /// The compile's time on a fast machine and on a slow or busy one.
    pub fastest: Duration,
    pub slowest: Duration,
    /// The compiled-policy cache's directory, or why there is none (off, or its directory
    /// refused), so that every load compiles.
    pub cache: Result<PathBuf, String>,
}

/// Cranelift's time per MiB of component on one core (the engine compiles a component on one
/// thread), as measured: 13–15 s for the 11.6 MiB of a componentize-js policy and the 17.5 MiB
/// of a componentize-py one on an idle 2-core machine, 75–92 s on the busy one of issue 35.
const FAST_PER_MIB: Duration = Duration::from_millis(1_100);
const SLOW_PER_MIB: Duration = Duration::from_millis(5_300);

/// Shorter than this even on a slow machine, a compile ends about when a line saying so could
/// be read: nothing is said.
const LONG: Duration = Duration::from_secs(10);

/// Whether loading `file` may compile for long ([`LONG`]) when the compiled-policy cache does
/// not have it: a Python or JavaScript component carries its language's runtime, a Rust or C
/// one compiles in well under a second. Whether the cache has it cannot be known before trying,
/// so the answer is about the first load; `None` for a small file or one that cannot be read
/// (the load then says why).
pub fn long_compile(file: &Path, settings: &Settings) -> Option<LongCompile> {
    let bytes = std::fs::metadata(file).ok()?.len();
    let mib = bytes as f64 / f64::from(1 << 20);
    let slowest = SLOW_PER_MIB.mul_f64(mib);
    (slowest >= LONG).then(|| LongCompile {
        bytes,
        fastest: FAST_PER_MIB.mul_f64(mib),
        slowest,
        cache: match settings.cache.directory() {
            Ok(Some(dir)) => Ok(dir),
            Ok(None) => Err(format!("{ENV_CACHE_DIR}=off")),
            Err(refused) => Err(refused),
        },
    })
}

/// Loads `file` as the plugin would and tries every hook on the sample machine (`doctor` runs
/// this on `NCCL_WASM_POLICY`). A file the plugin would refuse is [`Error::Rejected`].
pub fn check(file: &Path, settings: Settings) -> Result<Checked, Error> {
    let origin = file.display().to_string();
    let bytes = setup::read_policy(file).map_err(Error::Rejected)?;
    let host = PolicyHost::new(settings)?;
    let sample = Topology::parse(SAMPLE, "check-sample")?;
    // With the topology known, loading includes the engine's trial run of every hook.
    host.set_topology(sample.ports());
    let id = host.swap_from_bytes(&bytes, &origin).map_err(rejected)?;
    let report = report::evaluate(
        &host,
        PolicyView::wasm(&id),
        &sample,
        None,
        &[],
        report::Connections::Sample,
        Default::default(),
    )?;
    if let Some((decision, source)) = report::fallbacks(&report).first() {
        return Err(Error::Rejected(format!(
            "policy {origin} failed in {decision} on the sample machine: {}: {}",
            source.cause.as_deref().unwrap_or("fault"),
            source.detail.as_deref().unwrap_or("")
        )));
    }
    Ok(Checked {
        file: origin,
        policy: report.policy.clone(),
        hooks: id.hooks.iter().map(|h| h.name()).collect(),
        size_bytes: id.compilation.bytes,
        imports: id.compilation.imports.clone(),
        compile_ms: id.compilation.time.as_secs_f64() * 1e3,
        cache: id.compilation.cache,
        trial: format!("{}: {}", sample.name, sample.description),
    })
}

fn cache_name<S: serde::Serializer>(cache: &CompileCache, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(cache.name())
}

/// A load failure is the file's fault, except settings and engine trouble.
fn rejected(e: PolicyError) -> Error {
    match e {
        PolicyError::Setting { .. } | PolicyError::IbConfig(_) | PolicyError::Engine(_) => {
            Error::Policy(e)
        }
        e => Error::Rejected(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_machine_is_valid_and_offers_a_fusion_request() {
        let t = Topology::parse(SAMPLE, "check-sample").unwrap();
        let ports = t.ports();
        assert_eq!(ports.len(), 2);
        assert_eq!(
            ports[0].pci_path, ports[1].pci_path,
            "one NIC after NCCL's merge rule"
        );
    }
}
