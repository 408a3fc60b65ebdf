//! Per-message decisions of the data path: which posted receive a send goes to, which work
//! requests carry it over which QPs, and what the receiver posts. Everything here is
//! allocation-free after construction; results are small values the shell turns into verbs
//! calls (`ibv_post_send`/`ibv_post_recv`) without further thought.
//!
//! Both sides walk the plan's QPs with the same rotation: message `k` uses `stripe_width`
//! consecutive QPs (modulo the QP count) starting where message `k - 1` stopped, as net_ib's
//! `qpIndex` advances in `ncclIbMultiSend` and `ncclIbIrecv`. Since sends and receives match one
//! to one in posting order, each WRITE_WITH_IMM the sender posts on a QP meets a receive the
//! receiver posted on the same QP for the same message.
//!
//! The files follow the roles:
//!
//! * `sender.rs`: the send side, [`Sender`] — matching `isend`s to the receiver's CTS entries,
//!   and the failover steps of a prepared connection (acknowledgements, probe, replays).
//! * `receiver.rs`: the receive side, [`Receiver`] — what one `irecv` posts (receives, the CTS
//!   write), `iflush`, tagged arrivals and the CTS rewrite after a QP failed.
//! * `slot.rs`: the work layout of one matched FIFO slot ([`SlotWork`]): which work requests
//!   carry which bytes over which QP of the stripe.
//!
//! This file holds what both sides share: the rotation over the plan's QPs.

use ncclwasm_model::ConnPlan;

use crate::error::ProtoError;
use crate::handshake::QpRoute;

mod receiver;
mod sender;
mod slot;
#[cfg(test)]
mod tests;

pub use receiver::{
    Arrived, CTS_SIGNAL_INTERVAL, CtsWrite, FlushPost, PostedRecv, Receiver, RecvPost,
};
pub use sender::{SendMatch, Sender};
pub use slot::{LocalData, Opcode, QpPost, SlotPosts, SlotWork, WorkRequest};

/// What is common to both directions: the plan, its QPs' routes and the rotation over them.
/// The striping itself is the plan's own arithmetic ([`ConnPlan::stripes`]), which
/// `ncclwasm policy explain` prints too.
#[derive(Debug)]
struct Rotation {
    /// The plan messages are striped with now: the connection's own, or after a failover the
    /// surviving part of it.
    plan: ConnPlan,
    /// For each QP of `plan`, its index in the connection's plan (the identity until a move).
    map: Vec<u32>,
    /// The routes of the connection's QPs, in its plan's order.
    routes: Vec<QpRoute>,
    /// First QP of the next message.
    next: u32,
}

impl Rotation {
    fn new(plan: &ConnPlan, routes: &[QpRoute]) -> Self {
        Rotation {
            plan: plan.clone(),
            map: (0..plan.qps.len() as u32).collect(),
            routes: routes.to_vec(),
            next: 0,
        }
    }

    /// Stripes new messages with `plan`, whose QPs are `map` in the connection's plan.
    fn switch(&mut self, plan: &ConnPlan, map: &[u32]) {
        self.plan = plan.clone();
        self.map = map.to_vec();
        self.next = 0;
    }

    /// Claims the next message's QPs: returns its first QP and moves the rotation on.
    fn take(&mut self) -> u32 {
        let start = self.next;
        self.next = self.plan.next_start(start);
        start
    }

    /// The routes of the QPs a message starting at `start` uses, with their index in the
    /// connection's plan.
    fn qps(&self, start: u32) -> impl Iterator<Item = (usize, QpRoute)> + '_ {
        self.plan.stripes(0, start).map(|s| {
            let q = self.map[s.qp as usize] as usize;
            (q, self.routes[q])
        })
    }
}

/// `what` (a failover step) asked of a connection not prepared for failover: our bug.
fn unprepared(what: &str) -> ProtoError {
    ProtoError::Bookkeeping {
        detail: format!("{what} on a connection not prepared for failover"),
    }
}
