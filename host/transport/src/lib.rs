//! The net_ib data path of nccl-net-wasm: the I/O shell that runs the pure protocol of
//! `ncclwasm-proto` over sockets and verbs.
//!
//! [`Net`] opens nothing itself: it is handed a verbs [`Fabric`](ncclwasm_verbs::Fabric) and a
//! source of decisions, asks which devices NCCL sees, and makes [`Listener`]s, [`SendComm`]s and
//! [`RecvComm`]s whose methods are NCCL's `listen`/`connect`/`accept`/`regMr`/`isend`/`irecv`/
//! `iflush`/`test`, each non-blocking.
//!
//! What the shell does with the protocol core (`docs/architecture.md` walks through it):
//! * `listen`: bind a TCP listener on the out-of-band address chosen as NCCL chooses it
//!   ([`oob`]), pick a random nonce, write the encoded `ListenHandle` into NCCL's 128-byte
//!   handle. `accept` drops connections that do not present that nonce and goes on waiting
//!   ([`Listener`]).
//! * `connect`/`accept`: drive a `Connector`/`Acceptor`: move bytes between the socket and the
//!   machine, and carry out each action — ask for the connection plan, create QPs and register
//!   the FIFOs, move QPs to RTR/RTS with the given attributes. Both are resumable: every NCCL
//!   call makes what progress it can and returns "call again" otherwise, as
//!   `ncclIbConnect`/`ncclIbAccept` do.
//! * Data path: build a `Sender` or `Receiver` from the established setup; on `isend` read the
//!   head slot of the CTS FIFO (marker first) and post the returned slot work; on `irecv` post
//!   the receives and the CTS write; on `test` poll the completion queues the request awaits and
//!   feed each successful completion to the request pool. A failed completion is an error of the
//!   connection (`ncclRemoteError`), with the QP and GIDs in the message. What both
//!   communicators do alike — their endpoints, completion queues and QPs, `regMr`, polling —
//!   is `comm`; the per-message path of each is `send` and `recv`.
//! * Rail failover, on a connection *prepared* for it (its QPs span two ports or more and its
//!   policy would move a failed port's traffic): `failover`, with the sender's side
//!   (`failover::send`: the policy's answer to a failed port, the probe and the replay,
//!   fail-back) and the receiver's (`failover::recv`: dropping a failed QP, writing its CTS
//!   entries again, re-creating QPs on fail-back). The communicators call in from their
//!   progress only on a prepared connection.
//!
//! Errors are [`NetError`]s, each with the [`ErrorClass`] the plugin maps to an `ncclResult_t`.
#![forbid(unsafe_code)]

mod comm;
mod device;
mod failover;
#[cfg(test)]
mod fault_tests;
mod gid_table;
mod gpu;
mod listener;
mod mr_cache;
mod net;
mod net_error;
pub mod oob;
mod oob_host;
mod oob_pattern;
pub mod profile;
mod prometheus;
mod qp;
mod recv;
pub mod rma;
mod send;
mod socket;
mod telemetry;

pub use comm::{Done, MemHandle};
pub use gpu::{GpuSupport, PTR_CUDA, PTR_DMABUF, PTR_HOST, Reasoned};
pub use listener::Listener;
pub use mr_cache::RegionSource;
pub use ncclwasm_proto::handle::HANDLE_SIZE;
pub use ncclwasm_proto::request::ReqId;
pub use ncclwasm_proto::{MAX_ENDPOINTS, MAX_MESSAGE_BYTES, MAX_QPS, MAX_RECVS, MAX_REQUESTS};
pub use net::{CommConfig, DeviceProps, Net, NetConfig};
pub use net_error::{ErrorClass, NetError};
pub use recv::{RecvBuf, RecvComm};
pub use rma::{PutSignal, RmaColl, RmaConfig, RmaCtx, RmaReq, SignalOp, SymMr};
pub use send::{SendComm, SendStats};
pub use telemetry::TelemetryFormat;

/// NCCL calls a communicator from its proxy service and progress threads at once.
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<SendComm>();
    shared_between_threads::<RecvComm>();
    shared_between_threads::<Listener>();
    shared_between_threads::<MemHandle>();
    shared_between_threads::<Net>();
};
