//! The connect and accept state machines.
//!
//! They mirror the stage machines of `ncclIbConnect` and `ncclIbAccept`: resumable, never
//! blocking, one step per input. The I/O shell
//!
//! * feeds received bytes with `handle_bytes` (any chunking, one byte at a time included) and a
//!   closed socket with `handle_eof`;
//! * sends what [`transmit`](Connector::transmit) returns and reports how much went out with
//!   [`advance_transmit`](Connector::advance_transmit) (partial non-blocking writes are fine);
//! * performs the actions from `poll_action` — ask the policy, create QPs, bring QPs up — and
//!   reports each result with the matching input method;
//! * returns the communicator to NCCL when the `Established` action appears, and "call again"
//!   (NULL comm) before that.
//!
//! An input the machine is not waiting for is refused with
//! [`ProtoError::WrongState`](crate::ProtoError::WrongState) and leaves the machine as it was.
//! Anything wrong with the peer (garbage, another version, an invalid plan, inconsistent
//! metadata, an early EOF) fails the machine for good: every later input returns an error
//! naming the failed state.
//!
//! The files follow the two sides and what they share:
//!
//! * `connector.rs`: the sending side, [`Connector`] (`ncclIbConnect`).
//! * `acceptor.rs`: the receiving side, [`Acceptor`] (`ncclIbAccept`).
//! * `link.rs`: the framed byte stream under both machines and what their states share (a
//!   failed state, input refused once failed, the end of the stream); [`Control`], the same
//!   stream once the connection is up.
//! * `check.rs`: the rules each side applies to its own inputs and to the peer's.
//! * `bring_up.rs`: where each QP runs ([`QpRoute`]) and what brings it to RTS
//!   ([`QpBringUp`]), in the handshake and when a failed QP rejoins.
//!
//! This file holds what the shell and the data path see of both: the QPs the shell reports
//! ([`LocalQp`]) and each side's established result ([`SendSetup`], [`RecvSetup`]).

use ncclwasm_model::{ConnPlan, Endpoint};

use crate::message::{Ece, RemoteWindow};

mod acceptor;
mod bring_up;
mod check;
mod connector;
mod link;
#[cfg(test)]
pub(crate) mod tests;

pub use acceptor::{Acceptor, AcceptorAction, AcceptorConfig};
pub use bring_up::{QpBringUp, QpRoute, rejoin_bring_up};
pub use connector::{Connector, ConnectorAction, ConnectorConfig};
pub use link::Control;

/// A QP the shell created, as reported back to the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalQp {
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The value the peer must present to connect to this QP: what `query_ece` reports in
    /// `options` on a provider that requires ECE. It travels whether or not the plan negotiates
    /// ECE, because such a provider admits no connection without it; other NICs ignore it.
    pub secret: u32,
    /// The first packet sequence number this QP sends (24 bits), e.g. random.
    pub psn: u32,
    /// Connector only: ECE values queried after creation when the plan negotiates ECE. The
    /// acceptor reports its ECE after bring-up instead ([`Acceptor::qps_ready`]).
    pub ece: Option<Ece>,
}

/// A connected send side: what the data path needs. Only the handshake makes one, so the data
/// path may rely on it having been validated (hence `non_exhaustive`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendSetup {
    pub plan: ConnPlan,
    pub local: Vec<Endpoint>,
    pub peer: Vec<Endpoint>,
    /// One per planned QP, in plan order.
    pub routes: Vec<QpRoute>,
    /// The receiver's sizes FIFO (rkeys per peer endpoint).
    pub sizes_fifo: RemoteWindow,
    /// Whether the receiver flushes GPU receives.
    pub peer_flush: bool,
    /// Whether the connection runs prepared for rail failover (`crate::failover`).
    pub failover: bool,
}

/// A connected receive side: what the data path needs. Only the handshake makes one, so the
/// data path may rely on it having been validated (hence `non_exhaustive`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecvSetup {
    pub plan: ConnPlan,
    pub local: Vec<Endpoint>,
    pub peer: Vec<Endpoint>,
    /// One per planned QP, in plan order.
    pub routes: Vec<QpRoute>,
    /// The sender's CTS FIFO (rkeys per peer endpoint).
    pub cts_fifo: RemoteWindow,
    /// Whether this side flushes GPU receives (as the shell reported in `qps_created`).
    pub flush: bool,
    /// Whether the connection runs prepared for rail failover, as the connector decided.
    pub failover: bool,
}
