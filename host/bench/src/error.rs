//! Why a bench run stopped: its setup, or the run itself — a rank that failed or stalled, the
//! plugin library, the TCP baseline, or a report that does not add up. The `ncclwasm` binary
//! prints it as its one `error:` line (exit status 2); a rank's line is how the parent learns
//! why that rank stopped.

use std::fmt::Display;

use ncclwasm_model::TopologyError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Resolving the run (the fabric, the policy, the settings), as `policy explain` resolves
    /// them.
    #[error(transparent)]
    Setup(#[from] ncclwasm_inspect::Error),
    /// The soft fabric's machine (`--topology`).
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The run itself; the message says which rank or part, and what happened.
    #[error("{0}")]
    Run(String),
}

impl Error {
    pub(crate) fn run(message: impl Display) -> Error {
        Error::Run(message.to_string())
    }
}
