//! The net_ib data path of nccl-net-wasm: a pure protocol core ([`proto`]) and the I/O shell
//! that runs it over sockets and verbs ([`Net`]).
//!
//! [`proto`] is to the shell what `quinn-proto` is to `quinn`: deterministic state machines
//! and arithmetic with explicit inputs and outputs, and no I/O. The I/O shell owns the
//! sockets and the verbs objects; it feeds these machines what happened (bytes arrived, QPs
//! created, completions polled) and carries out what they ask for (bytes to send, QPs to create
//! and connect, work requests to post). Everything here is unit-tested without a NIC, including a
//! full handshake between two in-memory endpoints.
//!
//! # How a connection is made
//!
//! NCCL's receiving rank calls `listen`: the shell opens a TCP listener and writes a
//! [`ListenHandle`] into NCCL's 128-byte handle. The sending rank calls `connect` with that
//! handle: the shell connects and drives a [`Connector`]; the receiving rank's `accept` drives an
//! [`Acceptor`] on the accepted socket. Both machines are resumable: every NCCL call makes what
//! progress it can and returns "call again" otherwise, as `ncclIbConnect`/`ncclIbAccept` do.
//!
//! ```text
//!  Connector                                         Acceptor
//!  hello {nonce, endpoints}              ──────────▶  check nonce, link layers
//!                                        ◀──────────  device-list {endpoints}
//!  ask the policy: plan-connection
//!  create QPs, register CTS FIFO
//!  connector-metadata {plan, QPs, FIFO}  ──────────▶  validate the plan, create QPs,
//!                                                     bring them to RTR/RTS
//!                                        ◀──────────  acceptor-metadata {QPs, sizes FIFO}
//!  bring QPs to RTR/RTS
//!  ready                                 ──────────▶  established
//! ```
//!
//! The plan is decided once, by the connecting side's policy, and travels in the handshake; the
//! accepting side validates it (with the same checks the host applies to policy answers) and
//! follows it. Per-message work never consults a policy: [`datapath`](proto::datapath) executes
//! the plan's weights, alignment and thresholds.
//!
//! # The data path
//!
//! As in net_ib, the receiver announces each posted receive by RDMA-writing a [`CtsEntry`] into
//! the sender's clear-to-send FIFO; the sender matches a send to it, truncates to the posted size
//! and writes the data with RDMA WRITE, striped over the plan's QPs, finishing each QP's share
//! with a WRITE_WITH_IMM that consumes a receive posted on the same QP. Requests live in a fixed
//! pool of [`MAX_REQUESTS`](proto::MAX_REQUESTS) slots; their indices travel in `wr_id`, so a
//! completion finds its requests without a lookup table.
//!
//! # What the I/O shell does with it
//!
//! * `listen`: bind a TCP listener on a reachable address, pick a random nonce, write
//!   [`ListenHandle::encode`] into NCCL's handle.
//! * `connect`/`accept`: drive a [`Connector`]/[`Acceptor`] (see [`proto::handshake`]): move bytes
//!   between the socket and `transmit`/`handle_bytes`, and carry out each action — call the
//!   policy, create QPs and register the FIFOs, move QPs to RTR/RTS with the given attributes.
//! * Data path: build a [`Sender`](proto::datapath::Sender) or
//!   [`Receiver`](proto::datapath::Receiver) from the established setup; on `isend` read the head
//!   slot of the CTS FIFO (marker first) and post the returned
//!   [`SlotWork`](proto::datapath::SlotWork); on `irecv` post the receives and the CTS write; on
//!   `test` poll the completion queues the request [`awaits`](proto::request::RequestPool::awaiting)
//!   and feed each successful completion to [`complete`](proto::request::RequestPool::complete).
//!   A failed completion is an error of the connection (`ncclRemoteError`), with the QP and
//!   GIDs in the message.
//!
//! # The I/O shell
//!
//! [`Net`] is that shell: it opens the fabric (`NCCL_WASM_FABRIC`), asks the policy which
//! devices NCCL sees, and makes [`Listener`]s, [`SendComm`]s and [`RecvComm`]s whose methods
//! are NCCL's `listen`/`connect`/`accept`/`regMr`/`isend`/`irecv`/`iflush`/`test`, each
//! non-blocking. Errors are [`NetError`]s, each with the [`ErrorClass`] the plugin maps to an
//! `ncclResult_t`.
#![forbid(unsafe_code)]

mod comm;
mod device;
mod error;
#[cfg(test)]
mod fault_tests;
mod mr_cache;
mod net;
mod net_error;
pub mod proto;
mod qp;
mod recv;
mod send;
mod socket;

pub use comm::{Done, MemHandle};
pub use error::TransportError;
pub use mr_cache::RegionSource;
pub use net::{CommConfig, DeviceProps, ENV_FABRIC, FabricChoice, Net, NetConfig};
pub use net_error::{ErrorClass, NetError};
pub use proto::fifo::CtsEntry;
pub use proto::handle::{HANDLE_SIZE, ListenHandle};
pub use proto::handshake::{Acceptor, Connector};
pub use proto::request::ReqId;
pub use recv::{Listener, RecvBuf, RecvComm};
pub use send::{SendComm, SendStats};

/// NCCL calls a communicator from its proxy service and progress threads at once.
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<SendComm>();
    shared_between_threads::<RecvComm>();
    shared_between_threads::<Listener>();
    shared_between_threads::<MemHandle>();
    shared_between_threads::<Net>();
};
