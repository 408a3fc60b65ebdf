//! Work requests as posted: the scatter/gather list, a send WR with the requester's progress
//! on it, a receive WR.
//!
//! Separate because three parties handle them: the C entry points build them, the requester
//! sends and retires send WRs, the responder consumes receive WRs.

use std::time::Instant;

use ibverbs_sys::ibv_wc_opcode;
use smallvec::SmallVec;

use crate::mr::MrGuard;
use crate::wire::{AtomicArgs, ReqOp};

/// One scatter/gather element as posted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A WR's scatter/gather list. One entry is kept inline (NCCL's WRs carry at most one, and the
/// vector it replaces was as large), so posting such a WR allocates nothing; longer lists spill
/// to the heap.
pub(crate) type Sges = SmallVec<[Sge; 1]>;

/// A posted send WR.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub op: ReqOp,
    pub signaled: bool,
    pub sges: Sges,
    /// Payload copied at post time (`IBV_SEND_INLINE`), in a buffer from the QP's spare list
    /// (`St::inline_spare`) that goes back to it when the WR retires.
    pub inline: Option<Vec<u8>>,
    pub raddr: u64,
    pub rkey: u32,
    pub imm: u32,
    /// An atomic's operands (zero for other opcodes).
    pub atomic: AtomicArgs,
    pub(super) seq: u64,
    pub(super) len: u32,
    pub(super) acked: bool,
    pub(super) sent_at: Option<Instant>,
    /// The source segments of a pulled WR (the `pull` module), pinned from its transmission
    /// until the responder answers, since that is when it reads them. Boxed: only a pulled WR
    /// (32 KiB or more) has any, and every WR of the queue carries the field.
    pub(super) pinned: Option<Box<SmallVec<[MrGuard; 1]>>>,
}

impl SendWqe {
    pub(crate) fn new(wr_id: u64, op: ReqOp, signaled: bool, sges: Sges) -> SendWqe {
        SendWqe {
            wr_id,
            op,
            signaled,
            sges,
            inline: None,
            raddr: 0,
            rkey: 0,
            imm: 0,
            atomic: AtomicArgs::default(),
            seq: 0,
            len: 0,
            acked: false,
            sent_at: None,
            pinned: None,
        }
    }

    /// Whether the requester waits for an answer to it (and so runs the retry timer).
    pub(super) fn ack_req(&self) -> bool {
        self.signaled || self.op.returns_data()
    }

    pub(super) fn wc_opcode(&self) -> ibv_wc_opcode::Type {
        match self.op {
            ReqOp::Write | ReqOp::WriteImm => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
            ReqOp::Read => ibv_wc_opcode::IBV_WC_RDMA_READ,
            ReqOp::FetchAdd => ibv_wc_opcode::IBV_WC_FETCH_ADD,
            ReqOp::CmpSwap => ibv_wc_opcode::IBV_WC_COMP_SWAP,
            _ => ibv_wc_opcode::IBV_WC_SEND,
        }
    }
}

/// A posted receive WR.
#[derive(Debug)]
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sges: Sges,
}
