//! The receive side of a connection: what each `irecv` posts (receives, the CTS write) and
//! each `iflush` reads, and on a connection prepared for failover, tagged arrivals and the CTS
//! rewrite after a QP failed.

use super::{Rotation, unprepared};
use crate::error::ProtoError;
use crate::failover::{self, Arrival, CTS_WR_ID, ImmTag, RecvFailover};
use crate::fifo::{ARRIVALS_OFFSET, CtsEntry, FifoCursor};
use crate::handshake::{QpRoute, RecvSetup};
use crate::message::RemoteWindow;
use crate::request::{ReqId, RequestKind, RequestPool, encode_wr_id};
use crate::{MAX_ENDPOINTS, MAX_MESSAGE_BYTES, MAX_RECVS, MAX_REQUESTS};

/// A CTS QP's send queue gets a signalled write at least this often, so unsignalled writes can
/// never fill it (`ncclIbPostFifo` signals once per 256 posts per device; the queue holds 512).
pub const CTS_SIGNAL_INTERVAL: u16 = 64;

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
    /// The CTS write, to post after the receives; `None` while every QP of a prepared
    /// connection failed (the sender holds them): [`Receiver::qp_rejoined`] writes it then.
    pub cts: Option<CtsWrite>,
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

    /// Plan QP `qp` was re-created and connected again (fail-back, resume): it counts again.
    /// When every QP had failed, the CTS writes of the receives in flight, to post through it.
    pub fn qp_rejoined(&mut self, qp: usize) -> Vec<CtsWrite> {
        let Some(f) = self.failover.as_deref_mut() else {
            return Vec::new();
        };
        let stranded = f.stranded();
        f.rejoined(qp);
        if !stranded {
            return Vec::new();
        }
        // The CTS entries of the receives in flight, and every later one, go through this
        // first QP back.
        self.rewrite_cts(qp)
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
    /// through one QP that still works; when none is left, they wait for one to be re-created
    /// ([`qp_rejoined`](Self::qp_rejoined)) and nothing is written.
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
        match (0..routes.len()).find(|&q| !f.is_failed(q)) {
            Some(pin) => Ok(self.rewrite_cts(pin)),
            None => {
                // The sender holds its ports (`wait`) or fails: the CTS entries wait for a QP to
                // come back (`qp_rejoined`).
                f.cts_pin = None;
                Ok(Vec::new())
            }
        }
    }

    /// Pins every CTS write to QP `pin` from now on, and returns the writes of the CTS entries
    /// of every receive in flight through it.
    fn rewrite_cts(&mut self, pin: usize) -> Vec<CtsWrite> {
        let route = self.rotation.routes[pin];
        let Some(f) = self.failover.as_deref_mut() else {
            return Vec::new();
        };
        f.cts_pin = Some(pin);
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
        out
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
                f.arrivals.expect(slot.slot(), failover::use_count(slot))?;
                f.slot_req[slot.slot()] = Some(req);
                f.entries[slot.slot()] = (entries, n, slot);
                record = Some((record_offset(slot.slot()), f.arrivals.word(slot.slot())));
                let k = c.next;
                c.next = (c.next + 1) % c.n;
                if f.stranded() {
                    // Written when a QP rejoins (`qp_rejoined`).
                    self.tail.advance();
                    return Ok(RecvPost {
                        req,
                        rotation: &self.rotation,
                        start,
                        receives: false,
                        record,
                        cts: None,
                    });
                }
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
            cts: Some(cts),
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
