//! Reports of the built-in default on corpus machines, for the renderers' tests.

use ncclwasm_inspect::report::{self, Connections, Report};
use ncclwasm_inspect::setup::{self, PolicyArg};
use ncclwasm_model::Topology;

/// What the built-in default decides on `topologies/{name}.toml` (default settings, not the
/// environment's), with stripes for 8 B and 1 MiB.
pub fn corpus_report(name: &str) -> Report {
    let topology = Topology::load(format!(
        "{}/../../topologies/{name}.toml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let (host, policy) = setup::host(Default::default(), &PolicyArg::Builtin).unwrap();
    report::evaluate(
        &host,
        policy,
        &topology,
        None,
        &[8, 1 << 20],
        Connections::Sample,
        Default::default(),
    )
    .unwrap()
}
