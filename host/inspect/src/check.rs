//! `policy check`: is this file a policy the plugin would load?
//!
//! The file is loaded exactly as the plugin loads it (compiled, checked against world
//! `ncclwasm:policy/policy`, instantiated, `init`-ed with the settings), then every hook is tried
//! on a small sample machine. A file the plugin would refuse is [`Error::Rejected`], told apart
//! from trouble with the settings or the engine, so a deployment script can refuse the file
//! before it reaches a job.

use std::path::Path;

use ncclwasm_model::Topology;
use ncclwasm_policy::{CompileCache, PolicyError, PolicyHost, Settings};
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
