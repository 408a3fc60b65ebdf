//! The one error type of the I/O shell, and how each maps to an NCCL result.

use ncclwasm_verbs::VerbsError;

use ncclwasm_proto::ProtoError;

use ncclwasm_model::decide::DecisionError;

/// Which `ncclResult_t` an error becomes at the plugin edge: system errors for the OS and the NIC,
/// invalid argument for a value NCCL passed that cannot be right (a NULL out-pointer, a device
/// that does not exist, a buffer outside its registration), invalid usage for configuration and
/// for calls the API does not allow (a closed communicator, a stale request), remote errors for
/// what the peer or the fabric did, and internal errors only for our own bugs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// `ncclInternalError`.
    Internal,
    /// `ncclSystemError`.
    System,
    /// `ncclInvalidArgument`.
    InvalidArgument,
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
    #[error(
        "port {port} of {connection} failed and the connection cannot go on: {reason} \
         [{source_of}]"
    )]
    PortFailed {
        connection: String,
        port: String,
        reason: String,
        /// Who decided: the policy and version, or the built-in default.
        source_of: String,
    },
    #[error("cannot make a virtual NIC of devices {devices:?}: {reason}")]
    Vnic { devices: Vec<u32>, reason: String },
    /// The caller used the API in a way it does not support (a call before `init`, on a closed
    /// communicator, on a request already completed).
    #[error("invalid use: {0}")]
    Usage(String),
    /// The caller passed a value that cannot be right (NULL where a pointer is needed, a count
    /// out of range, a buffer outside its registration).
    #[error("invalid argument: {0}")]
    Argument(String),
    /// A one-sided request whose work failed at the NIC; the message is the context's first
    /// failure (a failed completion names the QP, the ports and the status).
    #[error("one-sided request failed: {0}")]
    OneSided(String),
    /// A bug in nccl-net-wasm: bookkeeping that cannot happen, or a panic caught at the edge.
    #[error(
        "internal error: {0}; this is a bug in nccl-net-wasm — please report it with the NCCL log"
    )]
    Internal(String),
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
        // No catch-all: a new variant must be classified here, on purpose.
        match self {
            NetError::Protocol { source, .. } => match source {
                ProtoError::BadHandle { .. }
                | ProtoError::InvalidPlan { .. }
                | ProtoError::Incompatible { .. }
                | ProtoError::RequestsExhausted { .. } => ErrorClass::InvalidUsage,
                ProtoError::BadMagic { .. }
                | ProtoError::VersionMismatch { .. }
                | ProtoError::Malformed { .. }
                | ProtoError::UnexpectedMessage { .. }
                | ProtoError::NonceMismatch { .. }
                | ProtoError::BadPeerInfo { .. }
                | ProtoError::UnexpectedEof { .. }
                | ProtoError::BadCts { .. } => ErrorClass::Remote,
                ProtoError::WrongState { .. }
                | ProtoError::BadLocalInput { .. }
                | ProtoError::Bookkeeping { .. } => ErrorClass::Internal,
            },
            NetError::Verbs { .. }
            | NetError::Io { .. }
            | NetError::NoDevice(_)
            | NetError::Fatal { .. }
            | NetError::PortFailed { .. } => ErrorClass::System,
            NetError::Decision(_)
            | NetError::Vnic { .. }
            | NetError::Config { .. }
            | NetError::Usage(_) => ErrorClass::InvalidUsage,
            NetError::BadDevice { .. } | NetError::Argument(_) => ErrorClass::InvalidArgument,
            NetError::Completion { .. } | NetError::OneSided(_) => ErrorClass::Remote,
            NetError::Internal(_) => ErrorClass::Internal,
        }
    }

    /// The error of a failed verb, for `map_err`. The description is built only when the verb
    /// failed: a fixed text, or a closure for one that names objects (`|| format!(…)`), so the
    /// data path's calls allocate nothing while they succeed.
    pub(crate) fn verbs(what: impl Context) -> impl FnOnce(VerbsError) -> NetError {
        move |source| NetError::Verbs {
            what: what.describe(),
            source,
        }
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
        let what = what.into();
        move |source| NetError::Io { what, source }
    }

    pub(crate) fn protocol(during: &'static str) -> impl FnOnce(ProtoError) -> NetError {
        move |source| NetError::Protocol { during, source }
    }
}

/// What a failed operation was doing, turned into text only once it failed (see
/// [`NetError::verbs`]).
pub(crate) trait Context {
    fn describe(self) -> String;
}

impl Context for &str {
    fn describe(self) -> String {
        self.to_owned()
    }
}

impl Context for String {
    fn describe(self) -> String {
        self
    }
}

impl<F: FnOnce() -> String> Context for F {
    fn describe(self) -> String {
        self()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Configuration and misuse are the caller's, peers' faults are remote, only our bugs are
    /// internal.
    #[test]
    fn every_kind_of_error_has_its_class() {
        let s = || String::from("x");
        let cases = [
            (NetError::Usage(s()), ErrorClass::InvalidUsage),
            (NetError::Argument(s()), ErrorClass::InvalidArgument),
            (NetError::Internal(s()), ErrorClass::Internal),
            (
                NetError::Config {
                    variable: "NCCL_IB_HCA",
                    value: s(),
                    problem: s(),
                },
                ErrorClass::InvalidUsage,
            ),
            (
                NetError::BadDevice { dev: 9, count: 2 },
                ErrorClass::InvalidArgument,
            ),
            (
                NetError::Vnic {
                    devices: vec![0, 0],
                    reason: s(),
                },
                ErrorClass::InvalidUsage,
            ),
            (NetError::NoDevice(s()), ErrorClass::System),
            (
                NetError::PortFailed {
                    connection: s(),
                    port: s(),
                    reason: s(),
                    source_of: s(),
                },
                ErrorClass::System,
            ),
            (
                NetError::Verbs {
                    what: s(),
                    source: VerbsError::NoSuchDevice(s()),
                },
                ErrorClass::System,
            ),
            (
                NetError::Io {
                    what: s(),
                    source: std::io::Error::other("x"),
                },
                ErrorClass::System,
            ),
            (
                NetError::Fatal {
                    object: s(),
                    event: s(),
                },
                ErrorClass::System,
            ),
            (
                NetError::Completion {
                    qpn: 1,
                    local: s(),
                    peer: s(),
                    status: s(),
                    opcode: s(),
                    vendor_err: 0,
                    wr_id: 0,
                },
                ErrorClass::Remote,
            ),
        ];
        for (e, class) in cases {
            assert_eq!(e.class(), class, "{e}");
        }
        let proto = [
            (
                ProtoError::BadHandle { detail: s() },
                ErrorClass::InvalidUsage,
            ),
            (
                ProtoError::RequestsExhausted { capacity: 32 },
                ErrorClass::InvalidUsage,
            ),
            (
                ProtoError::NonceMismatch {
                    expected: 1,
                    got: 2,
                },
                ErrorClass::Remote,
            ),
            (ProtoError::UnexpectedEof { state: "x" }, ErrorClass::Remote),
            (
                ProtoError::Bookkeeping { detail: s() },
                ErrorClass::Internal,
            ),
            (
                ProtoError::BadLocalInput { detail: s() },
                ErrorClass::Internal,
            ),
        ];
        for (source, class) in proto {
            let e = NetError::Protocol {
                during: "test",
                source,
            };
            assert_eq!(e.class(), class, "{e}");
        }
    }
}
