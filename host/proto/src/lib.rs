//! The net_ib protocol of nccl-net-wasm, pure: no sockets, no verbs, no clocks, no randomness,
//! no policy engine. Its only dependency is the shared model.
//!
//! This crate is to the transport what `quinn-proto` is to `quinn`: deterministic state machines
//! and arithmetic with explicit inputs and outputs. The I/O shell (`ncclwasm-transport`) owns the
//! sockets and the verbs objects; it feeds these machines what happened (bytes arrived, QPs
//! created, completions polled) and carries out what they ask for (bytes to send, QPs to create
//! and connect, work requests to post). Everything here is unit-tested without a NIC and without
//! wasmtime, including a full handshake between two in-memory endpoints
//! (`docs/architecture.md`, "The handshake" and "One message").
//!
//! * [`handle`]: the 128-byte listen handle.
//! * [`message`]: the handshake wire format (framing, messages, bounds).
//! * [`handshake`]: the connect and accept state machines — one file per side
//!   (`connector.rs`, `acceptor.rs`) over what both share (the framed link, the checks, QP
//!   routes and bring-up).
//! * [`fifo`]: the clear-to-send FIFO entry and ring arithmetic, the sizes FIFO.
//! * [`request`]: the request pool, `wr_id` encoding and completion accounting.
//! * [`rma`]: one-sided traffic (NCCL's RMA tables): slices, held signals, completions.
//! * [`datapath`]: per-message decisions — the sender matching sends to posted receives, the
//!   work requests of one slot, the receiver's receive and flush posting.
//! * [`failover`]: rail failover on the data path — the design, tagged immediates, duplicate
//!   slices, what to re-post where.
//! * [`ProtoError`]: the one error type, each message saying what to do.
//!
//! Which unproven connections a listener keeps, and for how long, is not protocol: that is the
//! `ncclwasm-admission` crate, which the transport's listener and the soft fabric use.
#![forbid(unsafe_code)]

pub mod datapath;
pub mod failover;
pub mod fifo;
pub mod handle;
pub mod handshake;
pub mod message;
pub mod request;
pub mod rma;

mod codec;
mod error;

pub use error::ProtoError;

/// Version of everything this crate puts on the wire: the handle, the handshake messages and the
/// FIFO layouts. Both sides must match exactly; there is no negotiation.
pub const PROTOCOL_VERSION: u16 = 2;

/// Receives one `irecv` may group (`maxRecvs` in NCCL's properties, `NCCL_NET_IB_MAX_RECVS`).
pub const MAX_RECVS: usize = 8;

/// Requests in flight per communicator: NCCL's 32 outstanding requests, each of which may be a
/// multi-receive of [`MAX_RECVS`] (as net_ib's `MAX_REQUESTS`). It is also the number of CTS FIFO
/// slots, and it must stay ≤ 256 because request indices travel as bytes in `wr_id`.
pub const MAX_REQUESTS: usize = 32 * MAX_RECVS;
const _: () = assert!(MAX_REQUESTS <= 256);

/// Endpoints (ports) per side of a connection: NCCL's largest vNIC (v12 plugins fuse up to 8).
pub const MAX_ENDPOINTS: usize = 8;

/// QPs per connection (`NCCL_IB_MAX_QPS`).
pub const MAX_QPS: usize = ncclwasm_model::validate::MAX_QPS_PER_CONNECTION as usize;

/// The largest message NCCL can be told about: `test` reports sizes as C `int`, and the
/// immediate data and the sizes FIFO carry 32 bits.
pub const MAX_MESSAGE_BYTES: u64 = i32::MAX as u64;
