//! Why a question about a decision could not be answered: one type for the crate, each variant
//! saying what it was reading or asking, so the CLI can turn it into its one line and exit
//! status without knowing the crates underneath.

use ncclwasm_model::TopologyError;
use ncclwasm_policy::PolicyError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine, the settings it reads, or a policy it could not load.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A topology file.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// `NCCL_WASM_FABRIC`, or opening the provider it names.
    #[error("{0}")]
    Fabric(String),
    /// A file given on the command line that cannot be read as what it should be (a policy's
    /// bytes, a telemetry snapshot); the message names the file.
    #[error("{0}")]
    Input(String),
    /// `policy check`: the plugin would refuse this file (the file's fault, not the tool's).
    #[error("{0}")]
    Rejected(String),
    /// `--json` output.
    #[error("cannot encode JSON: {0}")]
    Json(#[from] serde_json::Error),
}
