//! The one error type of the I/O shell, and how each maps to an NCCL result.

use ncclwasm_verbs::VerbsError;

use ncclwasm_proto::ProtoError;

use crate::decide::DecisionError;

/// Which `ncclResult_t` an error becomes at the plugin edge (the README's guidance: system errors
/// for the OS and the NIC, internal errors for misuse by NCCL core or our own bugs, invalid usage
/// for configuration, remote errors for what the peer or the fabric did).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// `ncclInternalError`.
    Internal,
    /// `ncclSystemError`.
    System,
    /// `ncclInvalidUsage`.
    InvalidUsage,
    /// `ncclRemoteError`.
    Remote,
}

/// Everything that can go wrong between NCCL's calls and the verbs: each message says which
/// operation, on what, and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// The protocol core refused an input (a peer's bytes, a handle, a plan, bookkeeping).
    #[error("{during}: {source}")]
    Protocol {
        during: &'static str,
        #[source]
        source: ProtoError,
    },
    /// A verb failed.
    #[error("{what}: {source}")]
    Verbs {
        what: String,
        #[source]
        source: VerbsError,
    },
    /// A socket operation of the handshake failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// No decision could be made: the policy engine failed closed, or could not start.
    #[error("policy: {0}")]
    Decision(#[from] DecisionError),
    /// No usable fabric or port: NCCL falls back to its own transports.
    #[error("no usable network device: {0}")]
    NoDevice(String),
    /// NCCL named a device this plugin does not have.
    #[error("device {dev} does not exist; this plugin reports {count} device(s)")]
    BadDevice { dev: i64, count: usize },
    /// A fatal async event made the device (or one of this connection's QPs) unusable.
    #[error(
        "{object} reported a fatal asynchronous event ({event}); the connection cannot continue \
         — check the NIC and the fabric (dmesg, ibstat)"
    )]
    Fatal { object: String, event: String },
    /// A work completion failed: the peer, the fabric or a key was at fault.
    #[error(
        "work completion failed on QP {qpn} ({local} -> {peer}): status {status}, opcode \
         {opcode}, vendor error {vendor_err:#x}, wr_id {wr_id:#x}; the remote rank probably \
         failed or the fabric dropped the connection — look at the peer's log"
    )]
    Completion {
        qpn: u32,
        local: String,
        peer: String,
        status: String,
        opcode: String,
        vendor_err: u32,
        wr_id: u64,
    },
    /// NCCL core's fusion request was refused.
    #[error("cannot make a virtual NIC of devices {devices:?}: {reason}")]
    Vnic { devices: Vec<u32>, reason: String },
    /// The caller used the API in a way it does not support.
    #[error("invalid use: {0}")]
    Usage(String),
    /// A configuration variable has a value the plugin cannot follow: the message names the
    /// variable, its value, and what there is to choose from.
    #[error("{variable}={value:?}: {problem}")]
    Config {
        variable: &'static str,
        value: String,
        problem: String,
    },
}

impl NetError {
    /// The NCCL result this error becomes.
    pub fn class(&self) -> ErrorClass {
        match self {
            NetError::Protocol { source, .. } => match source {
                ProtoError::BadHandle { .. }
                | ProtoError::InvalidPlan { .. }
                | ProtoError::Incompatible { .. } => ErrorClass::InvalidUsage,
                ProtoError::BadMagic { .. }
                | ProtoError::VersionMismatch { .. }
                | ProtoError::Malformed { .. }
                | ProtoError::UnexpectedMessage { .. }
                | ProtoError::NonceMismatch { .. }
                | ProtoError::BadPeerInfo { .. }
                | ProtoError::UnexpectedEof { .. }
                | ProtoError::BadCts { .. } => ErrorClass::Remote,
                _ => ErrorClass::Internal,
            },
            NetError::Verbs { .. }
            | NetError::Io { .. }
            | NetError::NoDevice(_)
            | NetError::Fatal { .. } => ErrorClass::System,
            NetError::Decision(_) | NetError::Vnic { .. } | NetError::Config { .. } => {
                ErrorClass::InvalidUsage
            }
            NetError::BadDevice { .. } | NetError::Usage(_) => ErrorClass::Internal,
            NetError::Completion { .. } => ErrorClass::Remote,
        }
    }

    pub(crate) fn verbs(what: impl Into<String>) -> impl FnOnce(VerbsError) -> NetError {
        let what = what.into();
        move |source| NetError::Verbs { what, source }
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
        let what = what.into();
        move |source| NetError::Io { what, source }
    }

    pub(crate) fn protocol(during: &'static str) -> impl FnOnce(ProtoError) -> NetError {
        move |source| NetError::Protocol { during, source }
    }
}
