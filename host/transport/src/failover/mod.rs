//! Rail failover in the shell. The protocol itself — tags, the arrival record, the probe, the
//! replay barrier — is `ncclwasm_proto::failover`; here it meets sockets and verbs:
//! * this file: what both sides need — whether a connection is prepared for failover, the
//!   handshake socket a prepared connection keeps ([`ControlLink`]), the port-down watch
//!   ([`PortWatch`]), a fresh QP's half for a rejoin, and the words of the INFO lines;
//! * [`send`]: the sender's side — polling tagged slices, the policy's answer to a failed port
//!   (`move-to` restripes), the probe and the replay, fail-back;
//! * [`recv`]: the receiver's side — full receive queues, dropping a failed QP and writing its
//!   CTS entries again through one that works, re-creating QPs for the sender's fail-back.
//!
//! The communicators (`crate::send`, `crate::recv`) call in from their progress only when the
//! connection is prepared; an unprepared one runs the reference's data path and never enters.

pub(crate) mod recv;
pub(crate) mod send;

use std::time::{Duration, Instant};

use ncclwasm_model::{
    ConnPlan, Connection, PortAnswer, PortChange, PortEvent, PortEventCause, PortState,
};
use ncclwasm_proto::failover::MAX_FAILOVER_SLICES;
use ncclwasm_proto::handshake::{Control, LocalQp};
use ncclwasm_proto::message::{Message, QpInfo, Rejoin};

use crate::device::PortCtx;
use crate::net_error::NetError;
use crate::qp::ConnQp;
use crate::socket::Stream;
use ncclwasm_model::decide::Decisions;

/// Whether the connection `conn` with plan `plan` runs prepared for failover: when its QPs span
/// two local ports or more, its stripe fits a failover record, and the policy, asked about a
/// failure of any of those ports (the others up), would move or hold the traffic rather
/// than fail the connection. Preparing costs a work request per QP and message, so a
/// connection whose policy would fail anyway runs the reference's data path unchanged. A policy
/// that cannot answer counts as "fail": the connection then fails on a port failure, as NCCL's
/// own default does.
pub(crate) fn prepared(decisions: &dyn Decisions, conn: &Connection, plan: &ConnPlan) -> bool {
    let mut ports: Vec<u32> = plan.qps.iter().map(|q| q.local).collect();
    ports.sort_unstable();
    ports.dedup();
    if ports.len() < 2 || plan.stripe_count() > MAX_FAILOVER_SLICES {
        return false;
    }
    ports.iter().any(|&port| {
        let event = PortEvent {
            port,
            change: PortChange::Down,
            cause: PortEventCause::AsyncEvent,
        };
        let states: Vec<PortState> = (0..conn.local.len() as u32)
            .map(|p| {
                if p == port {
                    PortState::Down
                } else {
                    PortState::Active
                }
            })
            .collect();
        decisions
            .on_port_event_ahead(&event, conn, &plan.qps, &states)
            .is_ok_and(|d| matches!(d.value, PortAnswer::MoveTo { .. } | PortAnswer::Wait { .. }))
    })
}

/// Moves the plan QPs `failed` of `qps` to the error state, so that they deliver nothing more.
///
/// A port whose link went down leaves its QPs alive: the provider fails them only by their
/// retry timer (as a NIC does), and the transport may hear of the port first, from its
/// `PORT_ERR` event, and move their traffic. What they still hold would then land when the
/// link returns — after the move wrote it again and the message completed, into a buffer NCCL
/// may have reused since (`link_failover.rs` saw a later message overwritten by an earlier
/// one, with fault injection hiding it: injection fails the QPs at once). In ERR a QP's
/// outstanding work completes flushed, which the failover accounting ignores, a NIC sends
/// nothing more from it, and its responder places nothing more.
pub(crate) fn fence(
    qps: &[ConnQp],
    failed: impl IntoIterator<Item = usize>,
) -> Result<(), NetError> {
    for q in failed {
        let qp = &qps[q].qp;
        qp.to_error().map_err(NetError::verbs(|| {
            format!("moving failed QP {} to the error state", qp.qpn())
        }))?;
    }
    Ok(())
}

/// "mlx5_0:1", or the index when the connection has no such port.
pub(crate) fn port_name(conn: &Connection, port: u32) -> String {
    conn.local.get(port as usize).map_or_else(
        || format!("port {port}"),
        |e| format!("{}:{}", e.device, e.port),
    )
}

/// How the event was learnt, for INFO lines.
pub(crate) fn cause_text(cause: PortEventCause) -> &'static str {
    match cause {
        PortEventCause::AsyncEvent => "async event (PORT_ERR, or QP fatal)",
        PortEventCause::FatalCompletion => "failed work completion",
    }
}

/// The handshake socket a prepared connection keeps after the handshake: fail-back re-creates
/// failed QPs and exchanges their halves over it (`Message::Rejoin`, `Message::Rejoined`).
#[derive(Debug)]
pub(crate) struct ControlLink {
    stream: Stream,
    control: Control,
    /// When a side that has no reason to expect a message reads the socket next ([`due`]).
    ///
    /// [`due`]: Self::due
    next_look: Instant,
}

/// How often a receiver with every QP up looks for a rejoin: often enough that the sender's
/// fail-back or resume is answered at once, seldom enough that the system call costs nothing
/// next to the progress calls NCCL makes meanwhile.
const LOOK_EVERY: Duration = Duration::from_millis(1);

impl ControlLink {
    pub(crate) fn new(stream: Stream) -> Self {
        ControlLink {
            stream,
            control: Control::default(),
            next_look: Instant::now(),
        }
    }

    /// Whether it is time to look at the socket again (at most every [`LOOK_EVERY`]): one
    /// clock read otherwise.
    pub(crate) fn due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next_look {
            return false;
        }
        self.next_look = now + LOOK_EVERY;
        true
    }

    /// Sends what is queued, reads what arrived, and returns the next complete message.
    pub(crate) fn poll(&mut self) -> Result<Option<Rejoin>, NetError> {
        self.stream.pump(&mut self.control, FAIL_BACK)?;
        self.control
            .next_message()
            .map_err(NetError::protocol(FAIL_BACK))
    }

    pub(crate) fn send(&mut self, m: &Message) -> Result<(), NetError> {
        self.control
            .send(m)
            .map_err(NetError::protocol(FAIL_BACK))?;
        self.stream.pump(&mut self.control, FAIL_BACK)
    }
}

const FAIL_BACK: &str = "fail-back";

/// What a fresh QP tells the peer, for a [`Rejoin`]: its half, on endpoint `endpoint`.
pub(crate) fn half(l: &LocalQp, endpoint: usize) -> QpInfo {
    QpInfo {
        qpn: l.qpn,
        endpoint: endpoint as u8,
        secret: l.secret,
        psn: l.psn,
        ece: None,
    }
}

/// Which local ports went down since last asked (`PORT_ERR` events), for a prepared connection:
/// a port's QPs may sit idle, and the async event is then the only news of the failure.
#[derive(Debug)]
pub(crate) struct PortWatch {
    /// Per local endpoint: the device's port generation and the port's downs when last looked.
    seen: Vec<(u64, u64)>,
}

impl PortWatch {
    /// Starts from what the ports have seen so far.
    pub(crate) fn new(ports: &[PortCtx]) -> Self {
        PortWatch {
            seen: ports
                .iter()
                .map(|p| {
                    (
                        p.dev.port_generation(),
                        p.dev.port_counts(p.port.port).downs,
                    )
                })
                .collect(),
        }
    }

    /// The endpoints whose port went down since the last call; one atomic load per endpoint
    /// when nothing happened.
    pub(crate) fn newly_down(&mut self, ports: &[PortCtx]) -> Vec<usize> {
        let mut out = Vec::new();
        for (e, (p, seen)) in ports.iter().zip(&mut self.seen).enumerate() {
            let g = p.dev.port_generation();
            if g == seen.0 {
                continue;
            }
            let downs = p.dev.port_counts(p.port.port).downs;
            if downs > seen.1 {
                out.push(e);
            }
            *seen = (g, downs);
        }
        out
    }
}
