//! The work of one fully matched FIFO slot: the chain of work requests each QP of the stripe
//! gets, with where its bytes come from and where they land.

use ncclwasm_model::ConnPlan;

use crate::MAX_RECVS;
use crate::failover::{self, ImmTag};
use crate::fifo::{CtsEntry, FifoCursor};
use crate::handshake::QpRoute;
use crate::message::RemoteWindow;
use crate::request::{ReqId, encode_wr_id};

/// Where the local bytes of a work request come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LocalData {
    /// No bytes (a zero-length write, e.g. the share of a QP beyond a small message's end).
    #[default]
    None,
    /// Bytes `offset .. offset + len` of the slot's `r`-th send buffer, with its lkey on the
    /// QP's local endpoint.
    Send { r: usize, offset: u64, len: u64 },
    /// The first `len` bytes of the sender's sizes staging row for `slot` (see
    /// [`SlotWork::sizes_row`]), registered like the sizes FIFO.
    SizesRow { slot: usize, len: u64 },
}

/// RDMA opcode of a work request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Opcode {
    #[default]
    Write,
    /// RDMA WRITE_WITH_IMM: consumes a receive posted on the peer's QP.
    WriteWithImm { imm: u32 },
}

/// One send work request, ready for `ibv_post_send`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkRequest {
    pub opcode: Opcode,
    pub local: LocalData,
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    /// Meaningful only when `signaled`.
    pub wr_id: u64,
}

/// The chain of work requests one QP gets for one slot: one write per grouped send, plus a final
/// WRITE_WITH_IMM when the data writes alone cannot carry the notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpPost {
    /// Index of the QP in the plan.
    pub qp: usize,
    pub route: QpRoute,
    wrs: [WorkRequest; MAX_RECVS + 1],
    len: usize,
}

impl QpPost {
    /// No chain yet: what [`SlotPosts::next_into`] fills.
    pub const EMPTY: QpPost = QpPost {
        qp: 0,
        route: QpRoute {
            local: 0,
            remote: 0,
        },
        wrs: [WorkRequest {
            opcode: Opcode::Write,
            local: LocalData::None,
            remote_addr: 0,
            rkey: 0,
            signaled: false,
            wr_id: 0,
        }; MAX_RECVS + 1],
        len: 0,
    };

    /// The chain, to post in order with a single `ibv_post_send`.
    pub fn wrs(&self) -> &[WorkRequest] {
        &self.wrs[..self.len]
    }
}

/// One matched send waiting for the rest of its slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Matched {
    pub(super) req: Option<ReqId>,
    /// After truncation to the posted size.
    pub(super) size: u64,
}

/// The work of one fully matched FIFO slot, borrowed from the [`Sender`](super::Sender) until
/// posted.
#[derive(Debug)]
pub struct SlotWork<'a> {
    /// The plan the slot is striped with, its QPs' indices in the connection's plan, and the
    /// routes of the connection's QPs.
    pub(super) plan: &'a ConnPlan,
    pub(super) map: &'a [u32],
    pub(super) routes: &'a [QpRoute],
    pub(super) sizes_fifo: &'a RemoteWindow,
    pub(super) entries: &'a [CtsEntry; MAX_RECVS],
    pub(super) sends: [Matched; MAX_RECVS],
    pub(super) nreqs: usize,
    pub(super) slot: FifoCursor,
    pub(super) start: u32,
    /// Prepared for failover: every slice ends with a tagged write that carries the sizes row
    /// (`crate::failover`).
    pub(super) tagged: bool,
}

impl SlotWork<'_> {
    /// The requests of the slot, in receive order (`r` in [`LocalData::Send`]).
    pub fn requests(&self) -> impl Iterator<Item = ReqId> + '_ {
        self.sends[..self.nreqs].iter().filter_map(|m| m.req)
    }

    /// For a multi-receive, or any message of a connection prepared for failover: the sizes to
    /// store in the sender's staging row `slot` before posting, where [`LocalData::SizesRow`]
    /// reads them.
    pub fn sizes_row(&self) -> Option<(usize, [u32; MAX_RECVS])> {
        (self.nreqs > 1 || self.tagged).then(|| {
            let mut row = [0u32; MAX_RECVS];
            for (s, m) in row.iter_mut().zip(&self.sends[..self.nreqs]) {
                *s = m.size as u32;
            }
            (self.slot.slot(), row)
        })
    }

    /// Adaptive routing sends the bulk as plain RDMA WRITE (which the fabric may route
    /// adaptively) and signals with a separate zero-byte WRITE_WITH_IMM; a multi-receive always
    /// needs the separate write, to carry the sizes (`ncclIbMultiSend`), and so does a tagged
    /// slice.
    fn separate_imm(&self) -> bool {
        self.tagged
            || self.nreqs > 1
            || (self.plan.adaptive_routing && self.sends[0].size > self.plan.ar_threshold)
    }

    /// The QPs of the stripe with their work request chains, in posting order
    /// (`ncclIbMultiSend`'s loop over QPs).
    pub fn posts(&self) -> SlotPosts<'_> {
        SlotPosts {
            work: self,
            wr_id: encode_wr_id(self.requests()),
            slice: 0,
        }
    }

    /// The chain that carries slice `slice` on QP `qp` (of the connection's plan): one write
    /// per grouped send of its part `parts[r]` (offset, length), then the notification.
    pub(super) fn chain(
        &self,
        qp: usize,
        slice: usize,
        parts: &[(u64, u64); MAX_RECVS],
        wr_id: u64,
    ) -> QpPost {
        let mut post = QpPost::EMPTY;
        self.chain_into(qp, slice, parts, wr_id, &mut post);
        post
    }

    /// [`chain`](Self::chain) written into `post` in place: the chain is a few hundred bytes,
    /// and the data path lays one out per QP of every message.
    fn chain_into(
        &self,
        qp: usize,
        slice: usize,
        parts: &[(u64, u64); MAX_RECVS],
        wr_id: u64,
        post: &mut QpPost,
    ) {
        let route = self.routes[qp];
        let wrs = &mut post.wrs;
        for (r, &(offset, len)) in parts[..self.nreqs].iter().enumerate() {
            let e = &self.entries[r];
            wrs[r] = WorkRequest {
                opcode: Opcode::Write,
                local: if len == 0 {
                    LocalData::None
                } else {
                    LocalData::Send { r, offset, len }
                },
                remote_addr: e.addr + offset,
                // The responder checks the rkey of a zero-length write too.
                rkey: e.rkeys[route.remote],
                signaled: false,
                wr_id: 0,
            };
        }
        let mut len = self.nreqs;
        let mut wr_id = wr_id;
        if self.separate_imm() {
            let first = &self.entries[0];
            wrs[len] = if self.nreqs > 1 || self.tagged {
                let imm = if self.tagged {
                    let tag = ImmTag {
                        slot: self.slot.slot() as u8,
                        slice: slice as u8,
                        slices: self.plan.stripe_count() as u8,
                        use_count: failover::use_count(self.slot),
                    }
                    .pack();
                    // A tagged slice is acknowledged by its tag, whichever QP carried it.
                    wr_id = u64::from(tag);
                    tag
                } else {
                    0
                };
                WorkRequest {
                    opcode: Opcode::WriteWithImm { imm },
                    local: LocalData::SizesRow {
                        slot: self.slot.slot(),
                        len: (self.nreqs * size_of::<u32>()) as u64,
                    },
                    remote_addr: self.sizes_fifo.addr + self.slot.sizes_offset(),
                    rkey: self.sizes_fifo.rkeys[route.remote],
                    ..WorkRequest::default()
                }
            } else {
                // Zero bytes, aimed at the receive buffer so the rkey is one the peer knows.
                WorkRequest {
                    opcode: Opcode::WriteWithImm {
                        imm: self.sends[0].size as u32,
                    },
                    remote_addr: first.addr,
                    rkey: first.rkeys[route.remote],
                    ..WorkRequest::default()
                }
            };
            len += 1;
        } else {
            wrs[0].opcode = Opcode::WriteWithImm {
                imm: self.sends[0].size as u32,
            };
        }
        wrs[len - 1].signaled = true;
        wrs[len - 1].wr_id = wr_id;
        (post.qp, post.route, post.len) = (qp, route, len);
    }
}

/// Iterator over the [`QpPost`]s of a slot: walks every grouped send's stripes in step, since
/// QP `i` of the stripe carries stripe `i` of each of them. Holds no iterator per send: stripe
/// `i` is laid out again from the plan each time (a stripe is a handful of QPs, and most slots
/// hold one send over one QP), which keeps this small enough to build and move per message.
#[derive(Debug)]
pub struct SlotPosts<'a> {
    work: &'a SlotWork<'a>,
    wr_id: u64,
    slice: usize,
}

impl SlotPosts<'_> {
    /// The next QP's chain, written into `post` (the data path's form of `next`, which moves
    /// nothing); `false` once every QP of the stripe has its chain.
    pub fn next_into(&mut self, post: &mut QpPost) -> bool {
        let w = self.work;
        let mut parts = [(0, 0); MAX_RECVS];
        let mut qp = None;
        for (part, send) in parts.iter_mut().zip(&w.sends[..w.nreqs]) {
            let Some(s) = w.plan.stripes(send.size, w.start).nth(self.slice) else {
                return false;
            };
            qp = Some(w.map[s.qp as usize] as usize);
            *part = (s.offset, s.len);
        }
        let Some(qp) = qp else {
            return false;
        };
        w.chain_into(qp, self.slice, &parts, self.wr_id, post);
        self.slice += 1;
        true
    }
}

impl Iterator for SlotPosts<'_> {
    type Item = QpPost;

    fn next(&mut self) -> Option<QpPost> {
        let mut post = QpPost::EMPTY;
        self.next_into(&mut post).then_some(post)
    }
}
