//! The one error type of the protocol core.

/// Everything that can go wrong in the protocol core. Each message says what happened and what
/// to do about it; the I/O shell maps them to NCCL results (a peer's fault or a bad handle to
/// `ncclRemoteError`/`ncclInvalidUsage`, a bookkeeping violation to `ncclInternalError`).
/// Deliberately not `#[non_exhaustive]`: the transport maps every variant to an NCCL result
/// without a catch-all, so a new variant is classified on purpose.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The 128-byte NCCL handle did not decode.
    #[error(
        "the NCCL listen handle is not one of ours ({detail}); both ranks must load the same \
         nccl-net-wasm build, and the handle must reach connect() unmodified"
    )]
    BadHandle { detail: String },

    /// The first bytes of a handshake message were not our magic.
    #[error(
        "the handshake peer sent {found:02x?} where the nccl-net-wasm magic belongs; something \
         other than this plugin is talking on the handshake socket (check that every rank loads \
         nccl-net-wasm and that nothing else listens on the advertised address)"
    )]
    BadMagic { found: [u8; 4] },

    /// Both sides speak the protocol, but not the same version of it.
    #[error(
        "{what} speaks nccl-net-wasm protocol version {theirs}, this side speaks {ours}; \
         install the same nccl-net-wasm build on every node"
    )]
    VersionMismatch {
        what: &'static str,
        ours: u16,
        theirs: u16,
    },

    /// A message had the right magic and version but its body does not decode.
    #[error(
        "malformed {what}: {detail}; the peer is corrupt or not this nccl-net-wasm build — \
         check both ranks run the same plugin"
    )]
    Malformed { what: &'static str, detail: String },

    /// A well-formed message arrived at the wrong point of the handshake.
    #[error(
        "the peer sent a {got} message while this side was {state}; the two sides disagree \
         about the handshake (mixed plugin builds?)"
    )]
    UnexpectedMessage {
        got: &'static str,
        state: &'static str,
    },

    /// The connector presented a nonce this listener never handed out.
    #[error(
        "a connection reached this listener with nonce {got:#018x} but the handle carried \
         {expected:#018x}; it is a stray or stale connection — the peer used another listen handle"
    )]
    NonceMismatch { expected: u64, got: u64 },

    /// The connector's policy produced a plan this side cannot follow.
    #[error(
        "connection plan refused: {detail}; fix the connecting side's policy (try `ncclwasm \
         policy check`) or fall back to the built-in default"
    )]
    InvalidPlan { detail: String },

    /// The two sides cannot be connected at all (link layers differ, no endpoints …).
    #[error("cannot connect: {detail}; select NICs of one link layer on both ranks (NCCL_IB_HCA)")]
    Incompatible { detail: String },

    /// The peer's QP or memory information does not fit the plan.
    #[error(
        "the peer's connection metadata is inconsistent: {detail}; the peer is corrupt or not \
         this nccl-net-wasm build — check both ranks run the same plugin"
    )]
    BadPeerInfo { detail: String },

    /// The peer closed the handshake socket before the handshake finished.
    #[error(
        "the peer closed the handshake connection while this side was {state}; the remote rank \
         probably failed — look at its log"
    )]
    UnexpectedEof { state: &'static str },

    /// The I/O shell called a state machine with an input it is not waiting for.
    #[error("{input} is not valid while the handshake is {state} (a bug in the I/O shell)")]
    WrongState {
        input: &'static str,
        state: &'static str,
    },

    /// The I/O shell supplied local information that does not fit the plan or the limits.
    #[error("invalid local input: {detail} (a bug in the I/O shell)")]
    BadLocalInput { detail: String },

    /// All request slots of a communicator are in flight.
    #[error(
        "all {capacity} requests of this communicator are in flight; NCCL posted more than its \
         documented limit (32 × maxRecvs), or completed requests are not being tested"
    )]
    RequestsExhausted { capacity: usize },

    /// The receiver posted clear-to-send information the sender cannot use.
    #[error("the receiver posted an unusable receive in CTS slot {slot}: {detail}")]
    BadCts { slot: usize, detail: String },

    /// A completion or a request handle does not match the bookkeeping.
    #[error(
        "request bookkeeping violated: {detail}; this is a bug in nccl-net-wasm — please report \
         it with the NCCL log"
    )]
    Bookkeeping { detail: String },
}
