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

use ncclwasm_model::{ConnPlan, Stripes};

use super::fifo::{ARRIVALS_OFFSET, CtsEntry, FifoCursor};
use super::handshake::{QpRoute, RecvSetup, SendSetup};
use super::message::RemoteWindow;
use super::request::{ReqId, RequestKind, RequestPool, encode_wr_id};
use super::{MAX_ENDPOINTS, MAX_MESSAGE_BYTES, MAX_RECVS, MAX_REQUESTS};
use crate::error::ProtoError;
use crate::failover::{
    Arrival, CTS_WR_ID, ImmTag, InFlight, MAX_FAILOVER_SLICES, RecvFailover, Repost, SendFailover,
};

/// A CTS QP's send queue gets a signalled write at least this often, so unsignalled writes can
/// never fill it (`ncclIbPostFifo` signals once per 256 posts per device; the queue holds 512).
pub const CTS_SIGNAL_INTERVAL: u16 = 64;

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
    /// The chain, to post in order with a single `ibv_post_send`.
    pub fn wrs(&self) -> &[WorkRequest] {
        &self.wrs[..self.len]
    }
}

/// One matched send waiting for the rest of its slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Matched {
    req: Option<ReqId>,
    /// After truncation to the posted size.
    size: u64,
}

/// The work of one fully matched FIFO slot, borrowed from the [`Sender`] until posted.
#[derive(Debug)]
pub struct SlotWork<'a> {
    /// The plan the slot is striped with, its QPs' indices in the connection's plan, and the
    /// routes of the connection's QPs.
    plan: &'a ConnPlan,
    map: &'a [u32],
    routes: &'a [QpRoute],
    sizes_fifo: &'a RemoteWindow,
    entries: [CtsEntry; MAX_RECVS],
    sends: [Matched; MAX_RECVS],
    nreqs: usize,
    slot: FifoCursor,
    start: u32,
    /// Prepared for failover: every slice ends with a tagged write that carries the sizes row
    /// (`crate::failover`).
    tagged: bool,
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
            stripes: std::array::from_fn(|r| self.plan.stripes(self.sends[r].size, self.start)),
            wr_id: encode_wr_id(self.requests()),
            slice: 0,
        }
    }

    /// The chain that carries slice `slice` on QP `qp` (of the connection's plan): one write
    /// per grouped send of its part `parts[r]` (offset, length), then the notification.
    fn chain(
        &self,
        qp: usize,
        slice: usize,
        parts: &[(u64, u64); MAX_RECVS],
        wr_id: u64,
    ) -> QpPost {
        let mut wrs = [WorkRequest::default(); MAX_RECVS + 1];
        let route = self.routes[qp];
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
                        use_count: self.slot.use_count(),
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
        QpPost {
            qp,
            route,
            wrs,
            len,
        }
    }
}

/// Iterator over the [`QpPost`]s of a slot: walks every grouped send's stripes in step, since
/// QP `i` of the stripe carries stripe `i` of each of them.
#[derive(Debug)]
pub struct SlotPosts<'a> {
    work: &'a SlotWork<'a>,
    stripes: [Stripes<'a>; MAX_RECVS],
    wr_id: u64,
    slice: usize,
}

impl Iterator for SlotPosts<'_> {
    type Item = QpPost;

    fn next(&mut self) -> Option<QpPost> {
        let w = self.work;
        let mut parts = [(0, 0); MAX_RECVS];
        let mut qp = None;
        for (part, stripes) in parts.iter_mut().zip(&mut self.stripes[..w.nreqs]) {
            let s = stripes.next()?;
            qp = Some(w.map[s.qp as usize] as usize);
            *part = (s.offset, s.len);
        }
        let post = w.chain(qp?, self.slice, &parts, self.wr_id);
        self.slice += 1;
        Some(post)
    }
}

/// Outcome of [`Sender::isend`] when the receiver has posted.
#[derive(Debug)]
pub struct SendMatch<'a> {
    /// The request NCCL gets for this send.
    pub req: ReqId,
    /// When this send completed its slot: the work to post now.
    pub work: Option<SlotWork<'a>>,
}

/// The send side of a connection (`ncclIbSendComm`): reads the CTS FIFO the receiver writes,
/// matches sends to posted receives and lays out the writes.
#[derive(Debug)]
pub struct Sender {
    rotation: Rotation,
    sizes_fifo: RemoteWindow,
    head: FifoCursor,
    /// Sends matched so far for the head slot.
    sends: [Matched; MAX_RECVS],
    /// The stripe start reserved for the head slot (taken when the slot's first send matches).
    start: Option<u32>,
    pool: RequestPool,
    /// A connection prepared for failover keeps its in-flight messages here.
    failover: Option<Box<SendFailover>>,
}

impl Sender {
    /// The send side of an established connection, with every request free.
    pub fn new(setup: &SendSetup) -> Self {
        Sender {
            rotation: Rotation::new(&setup.plan, &setup.routes),
            sizes_fifo: setup.sizes_fifo.clone(),
            head: FifoCursor::default(),
            sends: [Matched::default(); MAX_RECVS],
            start: None,
            pool: RequestPool::new(),
            failover: setup
                .failover
                .then(|| Box::new(SendFailover::new(&setup.plan))),
        }
    }

    /// The FIFO position whose slot the shell must read for the next `isend`.
    pub fn head(&self) -> FifoCursor {
        self.head
    }

    /// The requests, for completions and `test`.
    pub fn requests(&mut self) -> &mut RequestPool {
        &mut self.pool
    }

    /// `isend(tag, size)` against a snapshot of the head slot (`entries`, read marker first).
    ///
    /// Mirrors `ncclIbIsend`: `Ok(None)` — "not yet", NCCL gets a NULL request and retries — when
    /// the receiver has not posted this slot (entry 0's marker is not the head's), when some
    /// entries of a multi-receive have not landed yet (where net_ib spins, we return), or when no
    /// unmatched receive of the slot carries `tag`. Otherwise the send is matched to the first
    /// unmatched receive with its tag, truncated to the posted size, and gets a request; when
    /// every receive of the slot is matched, [`SendMatch::work`] lays out the writes and the head
    /// moves to the next slot.
    pub fn isend(
        &mut self,
        entries: &[CtsEntry; MAX_RECVS],
        tag: u32,
        size: u64,
    ) -> Result<Option<SendMatch<'_>>, ProtoError> {
        let marker = self.head.marker();
        if entries[0].idx != marker || self.failover.as_ref().is_some_and(|f| f.blocked()) {
            return Ok(None);
        }
        let slot = self.head.slot();
        let bad = |detail: String| Err(ProtoError::BadCts { slot, detail });
        let nreqs = entries[0].nreqs as usize;
        if !(1..=MAX_RECVS).contains(&nreqs) {
            return bad(format!("nreqs is {nreqs}, not 1..={MAX_RECVS}"));
        }
        if entries[1..nreqs].iter().any(|e| e.idx != marker) {
            return Ok(None);
        }
        if let Some(r) = entries[..nreqs]
            .iter()
            .position(|e| e.nreqs as usize != nreqs)
        {
            return bad(format!(
                "entry {r} says nreqs {}, entry 0 says {nreqs}",
                entries[r].nreqs
            ));
        }
        if let Some(r) = entries[..nreqs].iter().position(|e| {
            e.addr == 0 || e.size > MAX_MESSAGE_BYTES || e.addr.checked_add(e.size).is_none()
        }) {
            return bad(format!(
                "entry {r} has address {:#x}, size {}",
                entries[r].addr, entries[r].size
            ));
        }
        let Some(r) = (0..nreqs).find(|&r| self.sends[r].req.is_none() && entries[r].tag == tag)
        else {
            return Ok(None);
        };
        let req = self.pool.alloc(RequestKind::Send, nreqs)?;
        let start = match self.start {
            Some(s) => s,
            None => *self.start.insert(self.rotation.take()),
        };
        let size = size.min(entries[r].size);
        self.pool.set_size(req, size);
        if self.failover.is_some() {
            // Settled by the failover record once every slice landed, on whichever QPs.
            self.pool.expect(req, 0);
        } else {
            for (_, route) in self.rotation.qps(start) {
                self.pool.expect(req, route.local);
            }
        }
        self.sends[r] = Matched {
            req: Some(req),
            size,
        };
        if self.sends[..nreqs].iter().any(|m| m.req.is_none()) {
            return Ok(Some(SendMatch { req, work: None }));
        }
        if let Some(f) = &mut self.failover {
            let mut slice_qp = [0u8; MAX_FAILOVER_SLICES];
            for (q, (qp, _)) in slice_qp.iter_mut().zip(self.rotation.qps(start)) {
                *q = qp as u8;
            }
            f.posted(InFlight {
                live: true,
                cursor: self.head,
                entries: *entries,
                sends: self.sends.map(|m| (m.req, m.size)),
                nreqs,
                start,
                generation: f.current().0,
                slices: self.rotation.plan.stripe_count(),
                slice_qp,
                acked: 0,
                replayed: 0,
            });
        }
        let work = SlotWork {
            plan: &self.rotation.plan,
            map: &self.rotation.map,
            routes: &self.rotation.routes,
            sizes_fifo: &self.sizes_fifo,
            entries: *entries,
            sends: self.sends,
            nreqs,
            slot: self.head,
            start,
            tagged: self.failover.is_some(),
        };
        self.sends = [Matched::default(); MAX_RECVS];
        self.start = None;
        self.head.advance();
        Ok(Some(SendMatch {
            req,
            work: Some(work),
        }))
    }
}

impl Sender {
    /// The failover state, on a connection prepared for failover.
    pub fn failover(&self) -> Option<&SendFailover> {
        self.failover.as_deref()
    }

    fn failover_mut(&mut self) -> Result<&mut SendFailover, ProtoError> {
        self.failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a failover step"))
    }

    /// A tagged slice's success completion, from a QP that has not failed.
    pub fn slice_acked(&mut self, wr_id: u64) -> Result<(), ProtoError> {
        let f = self
            .failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a tagged completion"))?;
        f.acked(wr_id, &mut self.pool)
    }

    /// Carries out `move-to to` after local port `port` failed: new messages are striped over
    /// the QPs of `to` that still work; a probe is due when slices are unaccounted for.
    pub fn fail_over(&mut self, port: u32, to: &[u32]) -> Result<(), ProtoError> {
        let f = self.failover_mut()?;
        let full = f.plan(0).clone();
        f.fail_over(&full, port, to)?;
        let (_, plan, map) = f.current();
        let (plan, map) = (plan.clone(), map.to_vec());
        self.rotation.switch(&plan, &map);
        Ok(())
    }

    /// Local port `port`'s QPs were re-created and connected: stripe over them again.
    pub fn fail_back(&mut self, port: u32) -> Result<(), ProtoError> {
        let f = self.failover_mut()?;
        let full = f.plan(0).clone();
        f.fail_back(&full, port)?;
        let (_, plan, map) = f.current();
        let (plan, map) = (plan.clone(), map.to_vec());
        self.rotation.switch(&plan, &map);
        Ok(())
    }

    /// The QP (index and route) to post the due probe READ on, if one is due.
    pub fn take_probe(&mut self) -> Option<(usize, QpRoute)> {
        let q = self.failover.as_deref_mut()?.take_probe()?;
        Some((q, self.rotation.routes[q]))
    }

    /// The probe READ failed with its QP: probe again.
    pub fn probe_lost(&mut self) {
        if let Some(f) = self.failover.as_deref_mut() {
            f.probe_lost();
        }
    }

    /// The probe returned the receiver's records: the slices to write again.
    pub fn probed(&mut self, words: &[u64; MAX_REQUESTS]) -> Result<Vec<Repost>, ProtoError> {
        let f = self
            .failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a probe"))?;
        f.probed(words, &mut self.pool)
    }

    /// The chain that writes `r`'s slice again, and the requests of its slot (in receive order,
    /// for [`LocalData::Send`]).
    pub fn replay(&mut self, r: &Repost) -> Result<(QpPost, Vec<ReqId>), ProtoError> {
        let f = self
            .failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a replay"))?;
        let rec = *f.slot(r.slot);
        let plan = f.plan(rec.generation);
        let mut parts = [(0, 0); MAX_RECVS];
        for (part, &(_, size)) in parts.iter_mut().zip(&rec.sends[..rec.nreqs]) {
            let s = plan.stripes(size, rec.start).nth(r.slice).ok_or_else(|| {
                ProtoError::Bookkeeping {
                    detail: format!("slot {} has no slice {}", r.slot, r.slice),
                }
            })?;
            *part = (s.offset, s.len);
        }
        let bytes = parts.iter().map(|p| p.1).sum();
        let work = SlotWork {
            plan,
            map: &[],
            routes: &self.rotation.routes,
            sizes_fifo: &self.sizes_fifo,
            entries: rec.entries,
            sends: rec.sends.map(|(req, size)| Matched { req, size }),
            nreqs: rec.nreqs,
            slot: rec.cursor,
            start: rec.start,
            tagged: true,
        };
        let post = work.chain(r.qp, r.slice, &parts, 0);
        let reqs = work.requests().collect();
        f.count_replayed_bytes(bytes);
        Ok((post, reqs))
    }
}

/// `what` (a failover step) asked of a connection not prepared for failover: our bug.
fn unprepared(what: &str) -> ProtoError {
    ProtoError::Bookkeeping {
        detail: format!("{what} on a connection not prepared for failover"),
    }
}

/// Where slot `slot`'s arrival record lives in the receiver's sizes FIFO region.
fn record_offset(slot: usize) -> usize {
    ARRIVALS_OFFSET + slot * size_of::<u64>()
}

/// One receive buffer of an `irecv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedRecv {
    pub addr: u64,
    pub size: u64,
    /// NCCL's `int` tag, bit for bit.
    pub tag: u32,
    /// The buffer's rkey on each local endpoint (from its memory registration).
    pub rkeys: [u32; MAX_ENDPOINTS],
}

/// The CTS write announcing one `irecv` to the sender (`ncclIbPostFifo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtsWrite {
    /// The QP (plan index) to post on, and its route.
    pub qp: usize,
    pub route: QpRoute,
    /// The FIFO position: copy `entries()` into the local staging FIFO at
    /// `slot.cts_offset()` and write them from there (inline where supported).
    pub slot: FifoCursor,
    entries: [CtsEntry; MAX_RECVS],
    n: usize,
    /// Destination in the sender's CTS FIFO, and its rkey there.
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    pub wr_id: u64,
}

impl CtsWrite {
    /// The entries to write, `n × 64` bytes.
    pub fn entries(&self) -> &[CtsEntry] {
        &self.entries[..self.n]
    }
}

/// What one `irecv` posts.
#[derive(Debug)]
pub struct RecvPost<'a> {
    pub req: ReqId,
    rotation: &'a Rotation,
    start: u32,
    /// Whether the `irecv` posts receives (a connection prepared for failover keeps its
    /// receive queues full instead).
    receives: bool,
    /// Prepared for failover: the slot's arrival record to publish before posting the CTS
    /// (offset in the sizes FIFO region, little-endian word).
    pub record: Option<(usize, u64)>,
    /// The CTS write, to post after the receives.
    pub cts: CtsWrite,
}

impl RecvPost<'_> {
    /// The `wr_id` of every receive work request of this `irecv`.
    pub fn wr_id(&self) -> u64 {
        encode_wr_id([self.req])
    }

    /// The QPs (plan index and route) that each get one receive work request without
    /// scatter entries, with [`wr_id`](Self::wr_id): one per QP the matching send's
    /// WRITE_WITH_IMM will arrive on.
    pub fn receives(&self) -> impl Iterator<Item = (usize, QpRoute)> + '_ {
        self.rotation.qps(self.start).filter(|_| self.receives)
    }
}

/// What one `iflush` posts: an RDMA READ of one byte of receive buffer `recv` over each local
/// endpoint's flush QP, signalled with `wr_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlushPost {
    pub req: ReqId,
    pub recv: usize,
    pub endpoints: usize,
    pub wr_id: u64,
}

/// The CTS QPs: the first QP (in plan order) on each local endpoint, used in turn so the CTS
/// traffic spreads over the receiver's ports, as `ncclIbPostFifo` rotates over devices.
#[derive(Debug)]
struct CtsQps {
    qps: [usize; MAX_ENDPOINTS],
    unsignaled: [u16; MAX_ENDPOINTS],
    n: usize,
    next: usize,
}

/// The receive side of a connection (`ncclIbRecvComm`).
#[derive(Debug)]
pub struct Receiver {
    rotation: Rotation,
    cts_fifo: RemoteWindow,
    cts: CtsQps,
    tail: FifoCursor,
    flush: bool,
    endpoints: usize,
    pool: RequestPool,
    failover: Option<Box<RecvFailover>>,
}

/// What a tagged arrival asks of the shell: publish the slot's record (offset in the sizes
/// FIFO region, word), and re-post the receive the completion consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrived {
    pub record: Option<(usize, u64)>,
}

impl Receiver {
    /// The receive side of an established connection, with every request free.
    pub fn new(setup: &RecvSetup) -> Self {
        let mut cts = CtsQps {
            qps: [0; MAX_ENDPOINTS],
            unsignaled: [0; MAX_ENDPOINTS],
            n: 0,
            next: 0,
        };
        for ep in 0..setup.local.len() {
            if let Some(q) = setup.routes.iter().position(|r| r.local == ep) {
                cts.qps[cts.n] = q;
                cts.n += 1;
            }
        }
        Receiver {
            rotation: Rotation::new(&setup.plan, &setup.routes),
            cts_fifo: setup.cts_fifo.clone(),
            cts,
            tail: FifoCursor::default(),
            flush: setup.flush,
            endpoints: setup.local.len(),
            pool: RequestPool::new(),
            failover: setup.failover.then(|| Box::new(RecvFailover::new())),
        }
    }

    /// Receives to post on every QP when the connection is established: a prepared connection
    /// keeps each receive queue full (one re-posted per completion), since a slice may arrive on
    /// any QP; otherwise none (each `irecv` posts its own).
    pub fn prefill(&self) -> usize {
        if self.failover.is_some() {
            MAX_REQUESTS
        } else {
            0
        }
    }

    /// Plan QP `qp` was re-created and connected again (fail-back): it counts again.
    pub fn qp_rejoined(&mut self, qp: usize) {
        if let Some(f) = self.failover.as_deref_mut() {
            f.rejoined(qp);
        }
    }

    /// The QP every CTS write goes through since a QP failed.
    pub fn cts_qp(&self) -> Option<usize> {
        self.failover.as_ref().and_then(|f| f.cts_pin)
    }

    /// Whether a QP failed and was not re-created yet (a rejoin may come).
    pub fn any_failed(&self) -> bool {
        self.failover.as_ref().is_some_and(|f| f.failed != 0)
    }

    /// Whether plan QP `qp` failed (its completions count nothing any more).
    pub fn is_failed(&self, qp: usize) -> bool {
        self.failover.as_ref().is_some_and(|f| f.is_failed(qp))
    }

    /// A tagged slice arrived (prepared connection). Completes the slot's receive when it was
    /// the last slice missing; a duplicate counts nothing.
    pub fn arrived(&mut self, imm: u32) -> Result<Arrived, ProtoError> {
        let f = self
            .failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a tagged arrival"))?;
        let tag = ImmTag::decode(imm);
        let slot = usize::from(tag.slot);
        match f.arrivals.record(tag)? {
            Arrival::Duplicate => Ok(Arrived { record: None }),
            Arrival::Fresh { complete } => {
                if complete && let Some(req) = f.slot_req[slot].take() {
                    self.pool.settle(req, 0, u64::from(imm))?;
                }
                Ok(Arrived {
                    record: Some((record_offset(slot), f.arrivals.word(slot))),
                })
            }
        }
    }

    /// Plan QP `qp` failed (prepared connection): its completions are ignored from now on, and
    /// the CTS entries of every receive in flight are written again, like every later one,
    /// through one QP that still works. An error when no QP is left.
    pub fn qp_failed(&mut self, qp: usize) -> Result<Vec<CtsWrite>, ProtoError> {
        let routes = &self.rotation.routes;
        let f = self
            .failover
            .as_deref_mut()
            .ok_or_else(|| unprepared("a failover step"))?;
        if f.is_failed(qp) {
            return Ok(Vec::new());
        }
        f.failed |= 1 << qp;
        let live = (0..routes.len()).find(|&q| !f.is_failed(q));
        let Some(pin) = live else {
            return Err(ProtoError::Bookkeeping {
                detail: "every QP of the connection failed".into(),
            });
        };
        f.cts_pin = Some(pin);
        let route = routes[pin];
        let mut out = Vec::new();
        for (slot, req) in f.slot_req.iter().enumerate() {
            if req.is_none() {
                continue;
            }
            let (entries, n, cursor) = f.entries[slot];
            out.push(CtsWrite {
                qp: pin,
                route,
                slot: cursor,
                entries,
                n,
                remote_addr: self.cts_fifo.addr + cursor.cts_offset(),
                rkey: self.cts_fifo.rkeys[route.remote],
                signaled: true,
                wr_id: CTS_WR_ID,
            });
        }
        Ok(out)
    }

    /// The requests, for completions and `test`.
    pub fn requests(&mut self) -> &mut RequestPool {
        &mut self.pool
    }

    /// `irecv` of `recvs.len()` grouped buffers (`ncclIbIrecv` + `ncclIbPostFifo`): a request,
    /// the receives to post, and the CTS entries to write. Sizes above
    /// [`MAX_MESSAGE_BYTES`] are announced as that much — no message can be larger.
    pub fn irecv(&mut self, recvs: &[PostedRecv]) -> Result<RecvPost<'_>, ProtoError> {
        let n = recvs.len();
        if !(1..=MAX_RECVS).contains(&n) {
            return Err(ProtoError::BadLocalInput {
                detail: format!("irecv of {n} buffers; 1..={MAX_RECVS} are supported"),
            });
        }
        let req = self.pool.alloc(RequestKind::Recv, n)?;
        let slot = self.tail;
        self.pool.set_fifo_slot(req, slot.slot());
        let start = self.rotation.take();
        if self.failover.is_some() {
            // Settled by the arrival record once every slice landed, on whichever QPs.
            self.pool.expect(req, 0);
            self.pool.set_sizes_in_fifo(req);
        } else {
            for (_, route) in self.rotation.qps(start) {
                self.pool.expect(req, route.local);
            }
        }
        let mut entries = [CtsEntry::default(); MAX_RECVS];
        for (e, r) in entries.iter_mut().zip(recvs) {
            *e = CtsEntry {
                addr: r.addr,
                size: r.size.min(MAX_MESSAGE_BYTES),
                rkeys: r.rkeys,
                tag: r.tag,
                nreqs: n as u32,
                idx: slot.marker(),
            };
        }
        let c = &mut self.cts;
        let mut record = None;
        let (qp, signaled) = match self.failover.as_deref_mut() {
            Some(f) => {
                f.arrivals.expect(slot.slot(), slot.use_count())?;
                f.slot_req[slot.slot()] = Some(req);
                f.entries[slot.slot()] = (entries, n, slot);
                record = Some((record_offset(slot.slot()), f.arrivals.word(slot.slot())));
                let k = c.next;
                c.next = (c.next + 1) % c.n;
                let qp = f.cts_pin.unwrap_or(c.qps[k]);
                // One signal per interval and endpoint slot of the rotation, as below; the
                // completion settles nothing.
                c.unsignaled[k] += 1;
                let signaled = c.unsignaled[k] >= CTS_SIGNAL_INTERVAL;
                if signaled {
                    c.unsignaled[k] = 0;
                }
                (qp, signaled)
            }
            None => {
                let k = c.next;
                c.next = (c.next + 1) % c.n;
                let qp = c.qps[k];
                c.unsignaled[k] += 1;
                let signaled = c.unsignaled[k] >= CTS_SIGNAL_INTERVAL;
                if signaled {
                    c.unsignaled[k] = 0;
                    self.pool.expect(req, self.rotation.routes[qp].local);
                }
                (qp, signaled)
            }
        };
        let route = self.rotation.routes[qp];
        self.tail.advance();
        let cts = CtsWrite {
            qp,
            route,
            slot,
            entries,
            n,
            remote_addr: self.cts_fifo.addr + slot.cts_offset(),
            rkey: self.cts_fifo.rkeys[route.remote],
            signaled,
            wr_id: if self.failover.is_some() {
                CTS_WR_ID
            } else {
                encode_wr_id([req])
            },
        };
        Ok(RecvPost {
            req,
            rotation: &self.rotation,
            start,
            receives: self.failover.is_none(),
            record,
            cts,
        })
    }

    /// `iflush` after a receive into GPU memory (`ncclIbIflush`): one RDMA READ per local
    /// endpoint from the last non-empty buffer, because we cannot tell which device the data
    /// came through. `None` when flushing is off or every size is zero.
    pub fn iflush(&mut self, sizes: &[u64]) -> Result<Option<FlushPost>, ProtoError> {
        let Some(recv) = sizes.iter().rposition(|&s| s != 0) else {
            return Ok(None);
        };
        if !self.flush {
            return Ok(None);
        }
        let req = self.pool.alloc(RequestKind::Flush, 1)?;
        for d in 0..self.endpoints {
            self.pool.expect(req, d);
        }
        Ok(Some(FlushPost {
            req,
            recv,
            endpoints: self.endpoints,
            wr_id: encode_wr_id([req]),
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::fifo::{CTS_FIFO_BYTES, SIZES_SLOT_BYTES};
    use crate::handshake::tests::{acceptor, connector, run_pair};
    use crate::message::tests::plan;
    use crate::request::{Completion, Finished, RecvSizes};
    use crate::{MAX_QPS, MAX_REQUESTS};

    const RECV_BASE: u64 = 0x10_0000;
    const SEND_BASE: u64 = 0x80_0000;
    const MEM: usize = 4 << 20;

    /// Both ends of one connection over a simulated RC fabric: memories, posted receive queues
    /// per QP and completion queues per device. It checks what hardware checks (rkeys, bounds,
    /// a posted receive for every WRITE_WITH_IMM) and delivers completions like a NIC.
    struct Wire {
        tx: Sender,
        rx: Receiver,
        send: SendSetup,
        recv: RecvSetup,
        /// Sender's CTS FIFO, written by the receiver.
        cts: Vec<[CtsEntry; MAX_RECVS]>,
        /// Receiver's sizes FIFO, and the sender's staging copy.
        sizes: Vec<[u32; MAX_RECVS]>,
        staging: Vec<[u32; MAX_RECVS]>,
        recv_mem: Vec<u8>,
        send_mem: Vec<u8>,
        /// Receive WRs posted per QP (wr_ids), in order.
        rq: Vec<VecDeque<u64>>,
        tx_cq: Vec<VecDeque<Completion>>,
        rx_cq: Vec<VecDeque<Completion>>,
        /// Shell side table: each send request's buffer.
        send_addr: [u64; MAX_REQUESTS],
        /// Work posted, for inspection: (qp, chain) per QP post.
        posted: Vec<QpPost>,
        /// Prepared for failover: chains held per QP until delivered (when `defer`), tagged
        /// arrivals `(qp, imm)` for the receiver, acknowledgements `(qp, wr_id)` for the
        /// sender, and the receiver's published records.
        defer: bool,
        queued: Vec<VecDeque<(QpPost, Vec<ReqId>)>>,
        arrivals: VecDeque<(usize, u32)>,
        acks: VecDeque<(usize, u64)>,
        records: Vec<u64>,
    }

    fn rkey_of(addr: u64, endpoint: usize) -> u32 {
        (addr as u32 >> 8) ^ (0x100 * (endpoint as u32 + 1))
    }

    impl Wire {
        fn new(decide: fn(&ncclwasm_model::Connection) -> ConnPlan, flush: bool) -> Self {
            Self::with_ports(2, 3, decide, flush)
        }

        fn with_ports(
            senders: usize,
            receivers: usize,
            decide: fn(&ncclwasm_model::Connection) -> ConnPlan,
            flush: bool,
        ) -> Self {
            let (mut c, mut a) = (connector(senders), acceptor(receivers));
            let t = run_pair(&mut c, &mut a, |_| 1 << 16, decide).unwrap();
            let (send, mut recv) = (t.send.unwrap(), t.recv.unwrap());
            recv.flush = flush;
            Wire {
                tx: Sender::new(&send),
                rx: Receiver::new(&recv),
                cts: vec![[CtsEntry::default(); MAX_RECVS]; MAX_REQUESTS],
                sizes: vec![[0; MAX_RECVS]; MAX_REQUESTS],
                staging: vec![[0; MAX_RECVS]; MAX_REQUESTS],
                recv_mem: vec![0; MEM],
                send_mem: (0..MEM).map(|i| (i * 7 + i / 251) as u8).collect(),
                rq: vec![VecDeque::new(); send.routes.len()],
                tx_cq: vec![VecDeque::new(); send.local.len()],
                rx_cq: vec![VecDeque::new(); recv.local.len()],
                send_addr: [0; MAX_REQUESTS],
                posted: Vec::new(),
                defer: false,
                queued: Vec::new(),
                arrivals: VecDeque::new(),
                acks: VecDeque::new(),
                records: vec![0; MAX_REQUESTS],
                send,
                recv,
            }
        }

        /// `irecv` of buffers `(offset in receive memory, size, tag)`: posts receives, writes
        /// the CTS entries into the sender's FIFO.
        fn irecv(&mut self, bufs: &[(u64, u64, u32)]) -> Result<ReqId, ProtoError> {
            let recvs: Vec<PostedRecv> = bufs
                .iter()
                .map(|&(off, size, tag)| {
                    let addr = RECV_BASE + off;
                    PostedRecv {
                        addr,
                        size,
                        tag,
                        rkeys: std::array::from_fn(|d| rkey_of(addr, d)),
                    }
                })
                .collect();
            let post = self.rx.irecv(&recvs)?;
            if let Some((off, word)) = post.record {
                self.records[(off - ARRIVALS_OFFSET) / 8] = word;
            }
            let wr_id = post.wr_id();
            for (qp, _) in post.receives() {
                self.rq[qp].push_back(wr_id);
            }
            let cts = post.cts;
            assert_eq!(
                cts.rkey, self.recv.cts_fifo.rkeys[cts.route.remote],
                "CTS rkey"
            );
            let off = cts.remote_addr - self.recv.cts_fifo.addr;
            assert!(off as usize + cts.entries().len() * CtsEntry::SIZE <= CTS_FIFO_BYTES);
            assert_eq!(off, cts.slot.cts_offset());
            let slot = cts.slot.slot();
            for (i, e) in cts.entries().iter().enumerate() {
                // Through the wire format, as the NIC would carry it.
                self.cts[slot][i] = CtsEntry::from_bytes(&e.to_bytes());
            }
            if cts.signaled && cts.wr_id != CTS_WR_ID {
                self.rx_cq[cts.route.local].push_back(Completion::Send { wr_id: cts.wr_id });
            }
            Ok(post.req)
        }

        /// `isend` of `len` bytes at `off` in send memory; executes the slot's work if complete.
        fn isend(&mut self, off: u64, len: u64, tag: u32) -> Result<Option<ReqId>, ProtoError> {
            let entries = self.cts[self.tx.head().slot()];
            let Some(m) = self.tx.isend(&entries, tag, len)? else {
                return Ok(None);
            };
            let req = m.req;
            self.send_addr[req.index()] = SEND_BASE + off;
            if let Some(work) = m.work {
                let reqs: Vec<ReqId> = work.requests().collect();
                if let Some((slot, row)) = work.sizes_row() {
                    self.staging[slot] = row;
                }
                let posts: Vec<QpPost> = work.posts().collect();
                for p in posts {
                    if self.defer {
                        self.queued[p.qp].push_back((p, reqs.clone()));
                    } else {
                        self.execute(&p, &reqs);
                    }
                    self.posted.push(p);
                }
            }
            Ok(Some(req))
        }

        fn execute(&mut self, p: &QpPost, reqs: &[ReqId]) {
            for wr in p.wrs() {
                match wr.local {
                    LocalData::None => {}
                    LocalData::Send { r, offset, len } => {
                        let src = (self.send_addr[reqs[r].index()] - SEND_BASE + offset) as usize;
                        let dst = (wr.remote_addr - RECV_BASE) as usize;
                        let buf_base = wr.remote_addr - offset;
                        assert_eq!(wr.rkey, rkey_of(buf_base, p.route.remote), "data rkey");
                        let (src, dst, n) = (src, dst, len as usize);
                        self.recv_mem[dst..dst + n].copy_from_slice(&self.send_mem[src..src + n]);
                    }
                    LocalData::SizesRow { slot, len } => {
                        assert_eq!(
                            wr.rkey, self.send.sizes_fifo.rkeys[p.route.remote],
                            "sizes rkey"
                        );
                        let off = wr.remote_addr - self.send.sizes_fifo.addr;
                        assert_eq!(off as usize, slot * SIZES_SLOT_BYTES);
                        let n = len as usize / 4;
                        self.sizes[slot][..n].copy_from_slice(&self.staging[slot][..n]);
                    }
                }
                let prepared = self.send.failover;
                if let (Opcode::WriteWithImm { imm }, true) = (wr.opcode, prepared) {
                    // Anonymous receives: any QP takes any slice.
                    self.arrivals.push_back((p.qp, imm));
                } else if let Opcode::WriteWithImm { imm } = wr.opcode {
                    let wr_id = self.rq[p.qp]
                        .pop_front()
                        .expect("WRITE_WITH_IMM without a posted receive (RNR)");
                    self.rx_cq[p.route.remote].push_back(Completion::RecvWithImm { wr_id, imm });
                }
                if wr.signaled && prepared {
                    self.acks.push_back((p.qp, wr.wr_id));
                } else if wr.signaled {
                    self.tx_cq[p.route.local].push_back(Completion::Send { wr_id: wr.wr_id });
                }
            }
        }

        /// Polls every completion queue into the pools.
        fn poll(&mut self) {
            for (d, cq) in self.tx_cq.iter_mut().enumerate() {
                while let Some(c) = cq.pop_front() {
                    self.tx.requests().complete(d, c).unwrap();
                }
            }
            for (d, cq) in self.rx_cq.iter_mut().enumerate() {
                while let Some(c) = cq.pop_front() {
                    self.rx.requests().complete(d, c).unwrap();
                }
            }
        }

        /// Tests a receive to completion and returns its sizes.
        fn recv_sizes(&mut self, req: ReqId) -> Vec<u64> {
            self.poll();
            match self.rx.requests().test(req).unwrap() {
                Some(Finished::Recv {
                    sizes: RecvSizes::Immediate(s),
                    n: 1,
                }) => vec![u64::from(s)],
                Some(Finished::Recv {
                    sizes: RecvSizes::SizesFifo { slot },
                    n,
                }) => self.sizes[slot][..n]
                    .iter()
                    .map(|&s| u64::from(s))
                    .collect(),
                other => panic!("receive not done: {other:?}"),
            }
        }

        fn send_size(&mut self, req: ReqId) -> u64 {
            self.poll();
            match self.tx.requests().test(req).unwrap() {
                Some(Finished::Send { size }) => size,
                other => panic!("send not done: {other:?}"),
            }
        }

        fn received(&self, off: u64, len: u64) -> &[u8] {
            &self.recv_mem[off as usize..(off + len) as usize]
        }

        fn sent(&self, off: u64, len: u64) -> &[u8] {
            &self.send_mem[off as usize..(off + len) as usize]
        }
    }

    impl Wire {
        /// A wire whose connection is prepared for failover, and whose fabric holds every
        /// posted chain until [`deliver`](Self::deliver) says which QP moves.
        fn prepared(decide: fn(&ncclwasm_model::Connection) -> ConnPlan) -> Self {
            let mut w = Wire::with_ports(2, 2, decide, false);
            w.send.failover = true;
            w.recv.failover = true;
            w.tx = Sender::new(&w.send);
            w.rx = Receiver::new(&w.recv);
            w.queued = vec![VecDeque::new(); w.send.routes.len()];
            w.defer = true;
            w
        }

        /// Lets the first `n` chains waiting on QP `qp` land.
        fn deliver(&mut self, qp: usize, n: usize) {
            for _ in 0..n {
                let Some((p, reqs)) = self.queued[qp].pop_front() else {
                    return;
                };
                self.execute(&p, &reqs);
            }
        }

        /// The receiver polls every arrival: counts it, publishes the record.
        fn rx_poll(&mut self) {
            while let Some((qp, imm)) = self.arrivals.pop_front() {
                if self.rx.is_failed(qp) {
                    continue;
                }
                if let Some((off, word)) = self.rx.arrived(imm).unwrap().record {
                    self.records[(off - ARRIVALS_OFFSET) / 8] = word;
                }
            }
        }

        /// The sender polls acknowledgements; QPs that failed count nothing.
        fn tx_poll(&mut self) {
            while let Some((qp, wr_id)) = self.acks.pop_front() {
                if !self.tx.failover().unwrap().is_failed(qp) {
                    self.tx.slice_acked(wr_id).unwrap();
                }
            }
        }
    }

    /// A connection prepared for failover loses port 0 with slices in every state — landed and
    /// acknowledged, landed but not acknowledged, landed but not yet polled by the receiver, and
    /// never sent — and every receive still completes exactly once with the right bytes; the
    /// replays are exactly the slices the probe did not see, and no message starts before they
    /// landed.
    #[test]
    fn a_failed_port_loses_and_duplicates_nothing() {
        // QPs 0 and 2 on port 0, 1 and 3 on port 1; stripes of 2.
        fn four(_: &ncclwasm_model::Connection) -> ConnPlan {
            plan(&[(0, 0, 1), (1, 1, 1), (0, 0, 1), (1, 1, 1)], 2)
        }
        let mut w = Wire::prepared(four);
        const N: u64 = 12;
        const LEN: u64 = 40_000;
        let mut recvs = Vec::new();
        let mut sends = Vec::new();
        for k in 0..N {
            recvs.push(w.irecv(&[(k * LEN, LEN, 7)]).unwrap());
            sends.push(w.isend(k * LEN, LEN, 7).unwrap().unwrap());
        }
        // Each QP carried N / 2 chains; the sizes row rides with every tagged slice.
        assert!(w.queued.iter().all(|q| q.len() == N as usize / 2));
        assert!(w.posted.iter().all(|p| p.wrs().len() == 2));
        // Port 1 delivers everything. Port 0: QP 0 lands 4 chains, the receiver polls 3 of them
        // before the failure, the sender hears of 2; QP 2 lands nothing.
        w.deliver(1, N as usize);
        w.deliver(3, N as usize);
        w.deliver(0, 3);
        w.rx_poll();
        w.deliver(0, 1);
        let acks: Vec<(usize, u64)> = w.acks.drain(..).collect();
        let mut heard_on_0 = 0;
        for (qp, wr_id) in acks {
            if qp == 0 {
                heard_on_0 += 1;
                if heard_on_0 > 2 {
                    continue;
                }
            }
            w.acks.push_back((qp, wr_id));
        }
        w.tx_poll();
        // Port 0 fails: what was queued on it is lost.
        for q in [0, 2] {
            w.queued[q].clear();
        }
        w.tx.fail_over(0, &[1]).unwrap();
        // The barrier: nothing new starts until the replays landed.
        let extra = w.irecv(&[(N * LEN, LEN, 7)]).unwrap();
        assert!(w.isend(N * LEN, LEN, 7).unwrap().is_none());
        let (probe_qp, route) = w.tx.take_probe().unwrap();
        assert_eq!(
            route.local, 1,
            "the probe goes over a surviving port (QP {probe_qp})"
        );
        assert!(w.tx.take_probe().is_none(), "one probe at a time");
        // The READ sees what the receiver has polled: 3 of QP 0's chains.
        let words: [u64; MAX_REQUESTS] = w.records.clone().try_into().unwrap();
        let reposts = w.tx.probed(&words).unwrap();
        // Lost: QP 0's 3 unpolled chains (1 landed, 2 never sent) and all 6 of QP 2's.
        assert_eq!(reposts.len(), 3 + 6, "{reposts:?}");
        let c = w.tx.failover().unwrap().counters();
        assert_eq!((c.moves, c.probes, c.confirmed, c.replayed), (1, 1, 1, 9));
        for r in &reposts {
            assert!(r.qp == 1 || r.qp == 3, "{r:?} goes to a surviving QP");
            let (post, reqs) = w.tx.replay(r).unwrap();
            assert_eq!(post.qp, r.qp);
            w.execute(&post, &reqs);
        }
        assert!(
            w.isend(N * LEN, LEN, 7).unwrap().is_none(),
            "replays not acknowledged yet"
        );
        w.rx_poll();
        w.tx_poll();
        // Every receive completed once, with every byte; every send completed.
        for (k, &r) in recvs.iter().enumerate() {
            assert_eq!(w.recv_sizes(r), [LEN], "receive {k}");
            let k = k as u64;
            assert_eq!(
                w.received(k * LEN, LEN),
                w.sent(k * LEN, LEN),
                "bytes of {k}"
            );
            assert!(w.rx.requests().test(r).is_err(), "completed twice");
        }
        for &s in &sends {
            assert_eq!(w.send_size(s), LEN);
        }
        // New messages go over port 1 only, and still arrive.
        let s = w.isend(N * LEN, LEN, 7).unwrap().unwrap();
        assert!(w.queued[0].is_empty() && w.queued[2].is_empty());
        w.deliver(1, 1);
        w.deliver(3, 1);
        w.rx_poll();
        w.tx_poll();
        assert_eq!(w.recv_sizes(extra), [LEN]);
        assert_eq!(w.received(N * LEN, LEN), w.sent(N * LEN, LEN));
        assert_eq!(w.send_size(s), LEN);
        assert_eq!(w.rx.requests().in_flight() + w.tx.requests().in_flight(), 0);
    }

    /// The receiver drops a failed QP and writes the CTS entries of its receives in flight again
    /// through one surviving QP, which then carries every CTS write; losing the last QP is an
    /// error.
    #[test]
    fn a_receiver_rewrites_its_cts_through_a_surviving_qp() {
        fn two(_: &ncclwasm_model::Connection) -> ConnPlan {
            plan(&[(0, 0, 1), (1, 1, 1)], 2)
        }
        let mut w = Wire::prepared(two);
        let a = w.irecv(&[(0, 100, 1)]).unwrap();
        let b = w.irecv(&[(100, 100, 2)]).unwrap();
        let rewrites = w.rx.qp_failed(0).unwrap();
        assert_eq!(rewrites.len(), 2);
        assert!(rewrites.iter().all(|c| c.qp == 1 && c.signaled));
        assert_eq!(rewrites[0].entries()[0].tag, 1);
        assert_eq!(rewrites[1].entries()[0].tag, 2);
        assert!(w.rx.qp_failed(0).unwrap().is_empty(), "once");
        assert_eq!(w.rx.cts_qp(), Some(1));
        w.irecv(&[(200, 100, 3)]).unwrap();
        assert!(w.rx.qp_failed(1).is_err(), "no QP left");
        let _ = (a, b);
    }

    /// 5 QPs over 2 × 3 ports, uneven weights, stripes of 2, AR above 8 KiB.
    fn rails(_: &ncclwasm_model::Connection) -> ConnPlan {
        plan(&[(0, 0, 1), (1, 1, 2), (0, 2, 1), (1, 0, 3), (0, 1, 1)], 2)
    }

    fn wide(_: &ncclwasm_model::Connection) -> ConnPlan {
        ConnPlan {
            adaptive_routing: false,
            ..plan(&[(0, 0, 1), (1, 1, 1), (0, 2, 1), (1, 0, 1)], 4)
        }
    }

    #[test]
    fn single_messages_arrive_intact_with_their_size() {
        let mut w = Wire::new(rails, false);
        for (k, len) in [0u64, 1, 127, 128, 129, 4097, 8192, 8193, 100_000, 1 << 20]
            .into_iter()
            .enumerate()
        {
            let off = (k as u64) * 4096;
            let r = w.irecv(&[(0, 2 << 20, 7)]).unwrap();
            let s = w.isend(off, len, 7).unwrap().expect("posted");
            assert_eq!(w.send_size(s), len);
            assert_eq!(w.recv_sizes(r), vec![len]);
            assert!(
                w.received(0, len) == w.sent(off, len),
                "payload of {len} bytes"
            );
        }
        assert_eq!(
            (w.tx.requests().in_flight(), w.rx.requests().in_flight()),
            (0, 0)
        );
        assert!(
            w.rq.iter().all(VecDeque::is_empty),
            "every posted receive was consumed"
        );
    }

    #[test]
    fn sends_are_truncated_to_the_posted_size() {
        let mut w = Wire::new(rails, false);
        let r = w.irecv(&[(64, 1000, 1)]).unwrap();
        let s = w.isend(0, 5000, 1).unwrap().unwrap();
        assert_eq!(w.send_size(s), 1000);
        assert_eq!(w.recv_sizes(r), vec![1000]);
        assert!(w.received(64, 1000) == w.sent(0, 1000));
        assert!(
            w.received(1064, 64).iter().all(|&b| b == 0),
            "nothing past the buffer"
        );
    }

    #[test]
    fn work_requests_follow_the_adaptive_routing_rule() {
        let mut w = Wire::new(rails, false);
        // At the threshold: data writes carry the immediate themselves.
        let r = w.irecv(&[(0, 1 << 20, 1)]).unwrap();
        let s = w.isend(0, 8192, 1).unwrap().unwrap();
        for p in w.posted.drain(..) {
            let wrs = p.wrs();
            assert_eq!(wrs.len(), 1);
            assert_eq!(wrs[0].opcode, Opcode::WriteWithImm { imm: 8192 });
            assert!(wrs[0].signaled);
        }
        let _ = (w.send_size(s), w.recv_sizes(r));
        // Above it: bulk WRITEs, then a zero-byte WRITE_WITH_IMM per QP.
        let r = w.irecv(&[(0, 1 << 20, 1)]).unwrap();
        let s = w.isend(0, 8193, 1).unwrap().unwrap();
        assert_eq!(w.posted.len(), 2, "stripe width 2");
        for p in w.posted.drain(..) {
            let wrs = p.wrs();
            assert_eq!(wrs.len(), 2);
            assert_eq!((wrs[0].opcode, wrs[0].signaled), (Opcode::Write, false));
            assert_eq!(wrs[1].opcode, Opcode::WriteWithImm { imm: 8193 });
            assert_eq!(wrs[1].local, LocalData::None);
            assert!(wrs[1].signaled && wrs[1].wr_id == encode_wr_id([s]));
        }
        assert_eq!(w.recv_sizes(r), vec![8193]);
        // AR off: never a separate immediate, whatever the size.
        let mut w = Wire::new(wide, false);
        let r = w.irecv(&[(0, 1 << 20, 1)]).unwrap();
        w.isend(0, 1 << 20, 1).unwrap().unwrap();
        assert!(w.posted.iter().all(|p| p.wrs().len() == 1));
        assert_eq!(w.recv_sizes(r), vec![1 << 20]);
    }

    #[test]
    fn stripes_follow_the_plan_weights_and_rotate() {
        let mut w = Wire::new(rails, false);
        let mut firsts = Vec::new();
        for _ in 0..6 {
            let r = w.irecv(&[(0, 1 << 20, 1)]).unwrap();
            let s = w.isend(0, 3 * 128 * 10, 1).unwrap().unwrap();
            firsts.push(w.posted[0].qp);
            let lens: Vec<u64> = w
                .posted
                .drain(..)
                .map(|p| match p.wrs()[0].local {
                    LocalData::Send { len, .. } => len,
                    _ => 0,
                })
                .collect();
            assert_eq!(lens.iter().sum::<u64>(), 3840);
            let _ = (w.send_size(s), w.recv_sizes(r));
        }
        // Two QPs per message out of five: starts 0, 2, 4, 1, 3, 0.
        assert_eq!(firsts, [0, 2, 4, 1, 3, 0]);
    }

    #[test]
    fn multi_receive_matches_tags_and_carries_sizes() {
        let mut w = Wire::new(rails, false);
        let bufs = [(0, 10_000, 10), (20_000, 300, 11), (40_000, 50_000, 12)];
        let r = w.irecv(&bufs).unwrap();
        // Sends arrive in another order than the buffers; nothing is posted until the last.
        let s12 = w.isend(0, 30_000, 12).unwrap().unwrap();
        assert!(w.posted.is_empty());
        assert_eq!(
            w.tx.requests().test(s12).unwrap(),
            None,
            "matched but not sent"
        );
        let s10 = w.isend(100_000, 0, 10).unwrap().unwrap();
        assert_eq!(w.isend(0, 1, 12).unwrap(), None, "tag 12 already matched");
        assert_eq!(w.isend(0, 1, 99).unwrap(), None, "no receive with tag 99");
        let s11 = w.isend(200_000, 900, 11).unwrap().unwrap();
        // Every QP chain: three data writes, then the sizes write with the immediate.
        for p in &w.posted {
            let last = p.wrs()[3];
            assert_eq!(p.wrs().len(), 4);
            assert_eq!(last.opcode, Opcode::WriteWithImm { imm: 0 });
            assert!(matches!(last.local, LocalData::SizesRow { len: 12, .. }));
            assert_eq!(
                last.wr_id,
                encode_wr_id([s10, s11, s12]),
                "wr_id in receive order"
            );
        }
        assert_eq!(w.recv_sizes(r), vec![0, 300, 30_000]);
        assert_eq!(
            (w.send_size(s10), w.send_size(s11), w.send_size(s12)),
            (0, 300, 30_000)
        );
        assert!(w.received(20_000, 300) == w.sent(200_000, 300));
        assert!(w.received(40_000, 30_000) == w.sent(0, 30_000));
    }

    #[test]
    fn sender_waits_for_the_receiver() {
        let mut w = Wire::new(rails, false);
        assert_eq!(w.isend(0, 10, 1).unwrap(), None, "nothing posted yet");
        let r = w.irecv(&[(0, 100, 1), (100, 100, 2)]).unwrap();
        // Entry 1 has not landed yet: its marker is stale.
        let slot = w.tx.head().slot();
        let saved = w.cts[slot][1];
        w.cts[slot][1].idx = 0;
        assert_eq!(w.isend(0, 10, 1).unwrap(), None);
        w.cts[slot][1] = saved;
        w.isend(0, 10, 1).unwrap().unwrap();
        w.isend(0, 20, 2).unwrap().unwrap();
        assert_eq!(w.recv_sizes(r), vec![10, 20]);
    }

    #[test]
    fn unusable_cts_entries_are_errors() {
        let mut w = Wire::new(rails, false);
        w.irecv(&[(0, 100, 1), (100, 100, 2)]).unwrap();
        let slot = w.tx.head().slot();
        let good = w.cts[slot];
        let mut check = |edit: fn(&mut [CtsEntry; MAX_RECVS]), what: &str| {
            let mut e = good;
            edit(&mut e);
            let err = w.tx.isend(&e, 1, 10).unwrap_err();
            assert!(matches!(err, ProtoError::BadCts { .. }), "{err}");
            assert!(err.to_string().contains(what), "{err}");
        };
        check(|e| e[0].nreqs = 9, "nreqs is 9");
        check(|e| e[0].nreqs = 0, "nreqs is 0");
        check(|e| e[1].nreqs = 1, "entry 1 says nreqs 1");
        check(|e| e[1].addr = 0, "entry 1 has address 0x0");
        check(|e| e[0].size = u64::MAX, "entry 0");
        check(|e| e[0].addr = u64::MAX - 10, "entry 0");
        assert_eq!(
            w.tx.requests().in_flight(),
            0,
            "refused sends take no request"
        );
    }

    #[test]
    fn thousands_of_messages_wrap_the_fifo_and_free_every_request() {
        let mut w = Wire::new(wide, false);
        let mut pending = VecDeque::new();
        for k in 0..3000u64 {
            // Keep up to 40 receives outstanding, as NCCL pipelines them.
            let len = (k * 977) % 70_000;
            let r = w.irecv(&[((k % 8) * 80_000, 80_000, 3)]).unwrap();
            pending.push_back((r, len));
            if pending.len() == 40 {
                for _ in 0..40 {
                    let (r, len) = pending.pop_front().unwrap();
                    let s = w.isend(0, len, 3).unwrap().unwrap();
                    assert_eq!(w.send_size(s), len);
                    assert_eq!(w.recv_sizes(r), vec![len]);
                }
            }
        }
        for (r, len) in pending.drain(..) {
            let s = w.isend(0, len, 3).unwrap().unwrap();
            assert_eq!((w.send_size(s), w.recv_sizes(r)), (len, vec![len]));
        }
        assert_eq!(
            (w.tx.requests().in_flight(), w.rx.requests().in_flight()),
            (0, 0)
        );
        assert!(w.rq.iter().all(VecDeque::is_empty));
    }

    #[test]
    fn cts_writes_rotate_over_endpoints_and_are_signalled_periodically() {
        let mut w = Wire::new(rails, false);
        let mut per_qp = [0u32; MAX_QPS];
        let mut signaled = 0;
        for _ in 0..(2 * CTS_SIGNAL_INTERVAL as usize * 3) {
            let post =
                w.rx.irecv(&[PostedRecv {
                    addr: 1,
                    size: 1,
                    tag: 0,
                    rkeys: [1; 8],
                }])
                .unwrap();
            let (req, cts) = (post.req, post.cts);
            per_qp[cts.qp] += 1;
            if cts.signaled {
                signaled += 1;
                assert!(
                    w.rx.requests()
                        .awaiting(req)
                        .unwrap()
                        .contains(cts.route.local)
                );
            }
            // Complete it by hand: receives then (if signalled) the CTS write.
            let wr_id = encode_wr_id([req]);
            let devices: Vec<usize> = w.rx.requests().awaiting(req).unwrap().iter().collect();
            for d in devices {
                while w.rx.requests().awaiting(req).unwrap().contains(d) {
                    let c = Completion::RecvWithImm { wr_id, imm: 1 };
                    if w.rx.requests().complete(d, c).is_err() {
                        w.rx.requests()
                            .complete(d, Completion::Send { wr_id })
                            .unwrap();
                    }
                }
            }
            assert!(w.rx.requests().test(req).unwrap().is_some());
        }
        // The acceptor has 3 ports; the first QP on each carries the CTS: QPs 0, 1, 2.
        assert_eq!(&per_qp[..5], &[128, 128, 128, 0, 0]);
        assert_eq!(signaled, 6, "one in {CTS_SIGNAL_INTERVAL} per CTS QP");
    }

    #[test]
    fn flush_reads_on_every_endpoint_from_the_last_nonempty_buffer() {
        let mut w = Wire::new(rails, true);
        let f = w.rx.iflush(&[0, 5, 7, 0]).unwrap().unwrap();
        assert_eq!((f.recv, f.endpoints), (2, 3));
        for d in 0..3 {
            assert_eq!(w.rx.requests().test(f.req).unwrap(), None);
            w.rx.requests()
                .complete(d, Completion::Send { wr_id: f.wr_id })
                .unwrap();
        }
        assert_eq!(w.rx.requests().test(f.req).unwrap(), Some(Finished::Flush));
        assert_eq!(w.rx.iflush(&[0, 0]).unwrap(), None, "nothing to flush");
        let mut off = Wire::new(rails, false);
        assert_eq!(off.rx.iflush(&[9]).unwrap(), None, "flushing disabled");
    }

    #[test]
    fn receive_limits() {
        let mut w = Wire::new(rails, false);
        assert!(matches!(
            w.irecv(&[]),
            Err(ProtoError::BadLocalInput { .. })
        ));
        let nine = [(0, 1, 0); MAX_RECVS + 1];
        assert!(matches!(
            w.irecv(&nine),
            Err(ProtoError::BadLocalInput { .. })
        ));
        // Huge posted sizes are announced as the largest possible message.
        w.irecv(&[(0, u64::MAX, 0)]).unwrap();
        assert_eq!(w.cts[0][0].size, MAX_MESSAGE_BYTES);
        for _ in 1..MAX_REQUESTS {
            w.irecv(&[(0, 1, 0)]).unwrap();
        }
        let e = w.irecv(&[(0, 1, 0)]).unwrap_err();
        assert!(
            matches!(e, ProtoError::RequestsExhausted { capacity: 256 }),
            "{e}"
        );
    }

    /// Fuzz-style: whatever a (hostile or corrupted) receiver writes into the CTS FIFO, and
    /// whatever completions arrive, the sender and the pools return errors but never panic.
    #[test]
    fn random_cts_entries_and_completions_never_panic() {
        use crate::message::tests::Rng;
        let mut rng = Rng(7);
        let mut w = Wire::new(rails, false);
        for _ in 0..20_000 {
            let marker = w.tx.head().marker();
            let mut e = [CtsEntry::default(); MAX_RECVS];
            for x in e.iter_mut() {
                *x = CtsEntry {
                    addr: match rng.below(3) {
                        0 => 0,
                        1 => u64::MAX - rng.below(1 << 20) as u64,
                        _ => rng.next(),
                    },
                    size: if rng.below(2) == 0 {
                        rng.next()
                    } else {
                        rng.next() % (1 << 24)
                    },
                    rkeys: std::array::from_fn(|_| rng.next() as u32),
                    tag: rng.below(3) as u32,
                    nreqs: rng.below(10) as u32,
                    idx: if rng.below(4) == 0 {
                        rng.next()
                    } else {
                        marker
                    },
                };
            }
            let tag = rng.below(3) as u32;
            let size = rng.next() >> rng.below(64);
            if let Ok(Some(SendMatch {
                work: Some(work), ..
            })) = w.tx.isend(&e, tag, size)
            {
                let _ = work.sizes_row();
                for p in work.posts() {
                    assert!(!p.wrs().is_empty() && p.wrs().last().unwrap().signaled);
                }
            }
            let c = if rng.below(2) == 0 {
                Completion::Send {
                    wr_id: rng.next() >> (8 * rng.below(8)),
                }
            } else {
                Completion::RecvWithImm {
                    wr_id: rng.next() % 300,
                    imm: rng.next() as u32,
                }
            };
            let _ = w.tx.requests().complete(rng.below(10), c);
            let id = ReqId::from_index(rng.below(MAX_REQUESTS)).unwrap();
            let _ = w.tx.requests().test(id);
        }
    }

    /// Everything at its limit: 8 × 8 ports, 128 QPs all in one stripe, eight grouped receives.
    #[test]
    fn largest_connection_and_multi_receive() {
        fn widest(_: &ncclwasm_model::Connection) -> ConnPlan {
            let qps: Vec<(u32, u32, u32)> = (0..MAX_QPS as u32)
                .map(|q| (q % 8, (q / 8) % 8, 1 + q % 5))
                .collect();
            plan(&qps, MAX_QPS as u32)
        }
        let mut w = Wire::with_ports(8, 8, widest, true);
        assert_eq!(w.send.routes.len(), 128);
        for round in 0..3u64 {
            let bufs: Vec<(u64, u64, u32)> = (0..8)
                .map(|i| (i * 300_000, 300_000, 100 + i as u32))
                .collect();
            let r = w.irecv(&bufs).unwrap();
            let mut sends = Vec::new();
            for i in (0..8u64).rev() {
                let len = (i + round) * 33_333;
                sends.push((
                    w.isend(i * 1000, len, 100 + i as u32).unwrap().unwrap(),
                    len,
                ));
            }
            assert_eq!(w.posted.len(), 128);
            assert!(w.posted.drain(..).all(|p| p.wrs().len() == 9));
            let expect: Vec<u64> = (0..8).map(|i| (i + round) * 33_333).collect();
            assert_eq!(w.recv_sizes(r), expect);
            for (s, len) in sends {
                assert_eq!(w.send_size(s), len);
            }
            for i in 0..8u64 {
                let len = (i + round) * 33_333;
                assert!(
                    w.received(i * 300_000, len) == w.sent(i * 1000, len),
                    "buffer {i}"
                );
            }
        }
        assert_eq!(
            (w.tx.requests().in_flight(), w.rx.requests().in_flight()),
            (0, 0)
        );
    }
}
