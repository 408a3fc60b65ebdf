//! NCCL's profiler, as the data path sees it (`docs/architecture.md`, "NCCL's profiler").
//!
//! NCCL hands a v10+ plugin a profiler callback at `init` and a parent handle with each
//! `isend`/`irecv` buffer (NULL for its bootstrap traffic). net_ib, built with
//! `NET_PROFILER=1`, starts one *QP event* per request and QP the request's data goes over (at
//! most 8), before the post, with an IB-v1 descriptor (device, `wr_id`, opcode, QP number,
//! length), and stops them when `test` finds the request done. (net_ib also starts one on a
//! stripe's QP whose share of a small message is empty; here a QP carrying none of the
//! request's bytes has no event.) This transport does the same
//! through [`Profiler`], which the plugin implements over the C callback, and adds events of its
//! own for the decisions behind a connection ([`DecisionEvent`]: its plan, a failover move, a
//! fail-back), reported under the next profiled send, whose parent handle is alive then.
//!
//! Nothing of this runs without a profiler, or for a request NCCL gave no parent: the data path
//! checks one `Option` per post.

use std::fmt;

use crate::MAX_RECVS;

/// QP events one request (one receive buffer) records, as net_ib's `MAX_QPS_PER_REQ`.
pub const MAX_QP_EVENTS: usize = 8;

/// `ibv_wr_opcode` of an RDMA WRITE and a WRITE_WITH_IMM: a send's QP event's opcode.
pub const WR_RDMA_WRITE: i32 = 0;
pub const WR_RDMA_WRITE_WITH_IMM: i32 = 1;
/// The opcode of a receive's QP event, which posts no `ibv_wr_opcode`: `ibv_wc_opcode`'s
/// `IBV_WC_RECV_RDMA_WITH_IMM`, what completes it.
pub const WC_RECV_RDMA_WITH_IMM: i32 = 129;

/// One QP event: net_ib's `ncclProfilerNetIbDescr_v1_t.qp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEvent {
    /// The local endpoint of the connection the QP runs on (net_ib's `devIndex`).
    pub device: i32,
    pub wr_id: u64,
    pub opcode: i32,
    pub qpn: u32,
    /// The request's bytes in this work request (for a receive: the buffer's size).
    pub length: u64,
}

/// What a decision event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionKind {
    /// The plan the connection runs (reported once, with its first profiled send).
    Plan,
    /// A port failed and its traffic moved to others.
    FailoverMove,
    /// The port came back and took its share again.
    FailBack,
    /// A port failed and the policy holds its traffic for it (`wait`).
    Wait,
    /// A held port came back: its re-created QPs carry the held traffic.
    Resume,
}

/// A decision about one connection, as this plugin's own profiler events carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecisionEvent<'a> {
    pub kind: DecisionKind,
    pub comm_id: u64,
    /// The NCCL device the connection was made on.
    pub device: u32,
    /// QPs of the plan.
    pub qps: u32,
    /// Failover moves and fail-backs so far.
    pub moves: u32,
    pub fail_backs: u32,
    /// Who made the plan: the policy and version, or why the built-in default did.
    pub source: &'a str,
}

/// NCCL's profiler. Every method is called from NCCL's threads, on the data path.
pub trait Profiler: fmt::Debug + Send + Sync {
    /// Starts a QP event under NCCL's handle `parent` (never 0); the event's handle, 0 when the
    /// profiler made none.
    fn start_qp(&self, parent: usize, event: &QpEvent) -> usize;
    /// Stops an event [`start_qp`](Self::start_qp) made (never 0).
    fn stop(&self, handle: usize);
    /// A decision about a connection, under `parent`: started and stopped at once.
    fn decision(&self, parent: usize, event: &DecisionEvent<'_>);
}

/// The QP events of one request (or one buffer of a multi-receive): its parent handle and the
/// events started under it. Plain data, kept with the request's other per-slot state.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QpEvents {
    parent: usize,
    handles: [usize; MAX_QP_EVENTS],
    n: u8,
}

impl QpEvents {
    /// A request NCCL gave the parent handle `parent` (0: none, nothing is recorded).
    pub(crate) fn under(parent: usize) -> QpEvents {
        QpEvents {
            parent,
            ..QpEvents::default()
        }
    }

    /// Starts `event` under the request's parent, up to [`MAX_QP_EVENTS`].
    pub(crate) fn start(&mut self, profiler: &dyn Profiler, event: &QpEvent) {
        if self.parent == 0 || usize::from(self.n) == MAX_QP_EVENTS {
            return;
        }
        let handle = profiler.start_qp(self.parent, event);
        if handle != 0 {
            self.handles[usize::from(self.n)] = handle;
            self.n += 1;
        }
    }

    /// Stops every event started; the request records nothing more.
    pub(crate) fn stop(&mut self, profiler: &dyn Profiler) {
        for &h in &self.handles[..usize::from(self.n)] {
            profiler.stop(h);
        }
        *self = QpEvents::default();
    }
}

/// The QP events of a multi-receive, one set per buffer.
pub(crate) type RecvEvents = [QpEvents; MAX_RECVS];
