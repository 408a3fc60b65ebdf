//! A port of a connection went down or came back: the event a policy is asked about
//! (`on-port-event`) and the answers it may give.
//!
//! Ports are named by their index in [`crate::Connection::local`] (the ports of the vNIC the
//! connection runs on), so an answer can only name ports the connection already has QPs on; the
//! data path never opens new QPs to carry out an answer.

use serde::{Deserialize, Serialize};

/// The longest a policy may hold a failed port's traffic waiting for it to come back. A QP's own
/// retry budget at NCCL's defaults (`NCCL_IB_TIMEOUT=20`, `NCCL_IB_RETRY_CNT=7`) is about 30 s;
/// a wait far shorter than that keeps a collective from stalling on a port that stays down.
pub const MAX_PORT_WAIT_MS: u32 = 10_000;

/// Which way a port went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortChange {
    Down,
    Up,
}

/// How the host learned of the change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortEventCause {
    /// The device's asynchronous port event (port error / port active).
    AsyncEvent,
    /// A QP on the port completed a work request with a fatal status.
    FatalCompletion,
}

/// One port of one connection changed state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortEvent {
    /// Index into [`crate::Connection::local`].
    pub port: u32,
    pub change: PortChange,
    pub cause: PortEventCause,
}

/// What a connection does about a [`PortEvent`]. In JSON: `{"kind": "move-to", "ports": [1],
/// "reason": "…"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum PortAnswer {
    /// Down: carry the failed QPs' traffic over the QPs on these ports (indices into
    /// [`crate::Connection::local`]).
    MoveTo { ports: Vec<u32>, reason: String },
    /// Down: hold the failed QPs' traffic up to `ms` milliseconds for the port to return; the
    /// connection fails if it does not.
    Wait { ms: u32, reason: String },
    /// Down: fail the connection.
    Fail { reason: String },
    /// Up: the port takes its share of the plan again.
    FailBack { reason: String },
    /// Up: traffic stays where it is.
    Stay { reason: String },
}

impl PortAnswer {
    /// The WIT name of the case, for logs and `explain`.
    pub fn kind(&self) -> &'static str {
        match self {
            PortAnswer::MoveTo { .. } => "move-to",
            PortAnswer::Wait { .. } => "wait",
            PortAnswer::Fail { .. } => "fail",
            PortAnswer::FailBack { .. } => "fail-back",
            PortAnswer::Stay { .. } => "stay",
        }
    }

    /// Whether this case answers a change that way: `move-to`, `wait` and `fail` answer a
    /// port-down, `fail-back` and `stay` a port-up.
    pub fn answers(&self, change: PortChange) -> bool {
        let down = matches!(
            self,
            PortAnswer::MoveTo { .. } | PortAnswer::Wait { .. } | PortAnswer::Fail { .. }
        );
        down == (change == PortChange::Down)
    }

    pub fn reason(&self) -> &str {
        match self {
            PortAnswer::MoveTo { reason, .. }
            | PortAnswer::Wait { reason, .. }
            | PortAnswer::Fail { reason }
            | PortAnswer::FailBack { reason }
            | PortAnswer::Stay { reason } => reason,
        }
    }
}
