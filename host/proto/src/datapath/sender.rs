//! The send side of a connection: `isend` matched against the CTS FIFO the receiver writes,
//! and on a connection prepared for failover, acknowledgements, probes and replays.

use super::slot::{Matched, QpPost, SlotWork};
use super::{Rotation, unprepared};
use crate::error::ProtoError;
use crate::failover::{InFlight, MAX_FAILOVER_SLICES, Repost, SendFailover};
use crate::fifo::{CtsEntry, FifoCursor};
use crate::handshake::{QpRoute, SendSetup};
use crate::message::RemoteWindow;
use crate::request::{ReqId, RequestKind, RequestPool};
use crate::{MAX_MESSAGE_BYTES, MAX_RECVS, MAX_REQUESTS};

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
    /// The head slot's entries as they read when its first send matched (only its `nreqs`
    /// entries are copied). Later sends are matched, and the writes laid out, against this copy,
    /// and a slot that reads otherwise meanwhile is refused: the receiver writes a slot once, so
    /// a peer that rewrites it after a match (to move a matched receive's buffer, or shrink it
    /// under a send already sized to it) is at fault. The [`SlotWork`] of a full slot borrows
    /// it; the next slot's first match overwrites it.
    slot: [CtsEntry; MAX_RECVS],
    /// Whether a send of the head slot matched (and `slot` holds its copy).
    matched: bool,
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
            slot: [CtsEntry::ZERO; MAX_RECVS],
            matched: false,
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
        if self.matched && self.slot[..nreqs] != entries[..nreqs] {
            return bad("the slot changed after a send matched one of its receives".to_owned());
        }
        let Some(r) = (0..nreqs).find(|&r| self.sends[r].req.is_none() && entries[r].tag == tag)
        else {
            return Ok(None);
        };
        if !self.matched {
            self.slot[..nreqs].copy_from_slice(&entries[..nreqs]);
            self.matched = true;
        }
        let entries = &self.slot;
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
                lost: 0,
            });
        }
        let sends = std::mem::take(&mut self.sends);
        let cursor = self.head;
        self.matched = false;
        self.start = None;
        self.head.advance();
        let work = SlotWork {
            plan: &self.rotation.plan,
            map: &self.rotation.map,
            routes: &self.rotation.routes,
            sizes_fifo: &self.sizes_fifo,
            entries: &self.slot,
            sends,
            nreqs,
            slot: cursor,
            start,
            tagged: self.failover.is_some(),
        };
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
        self.failover_mut()?.fail_over(port, to)?;
        self.follow_plan()
    }

    /// Local port `port`'s QPs were re-created and connected: stripe over them again.
    pub fn fail_back(&mut self, port: u32) -> Result<(), ProtoError> {
        self.failover_mut()?.fail_back(port)?;
        self.follow_plan()
    }

    /// Holds local port `port` after a `wait` answer: its QPs are failed, and nothing new
    /// starts until it is resumed.
    pub fn hold(&mut self, port: u32) -> Result<(), ProtoError> {
        self.failover_mut()?.hold(port)
    }

    /// Held port `port`'s QPs were re-created and connected: probe and write again what the
    /// receiver lacks, then stripe over them again.
    pub fn resume(&mut self, port: u32) -> Result<(), ProtoError> {
        self.failover_mut()?.resume(port)?;
        self.follow_plan()
    }

    /// New messages are striped by the failover state's current plan.
    fn follow_plan(&mut self) -> Result<(), ProtoError> {
        let (_, plan, map) = self.failover_mut()?.current();
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
    /// for [`LocalData::Send`](super::LocalData::Send)).
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
            entries: &rec.entries,
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
