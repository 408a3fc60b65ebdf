//! One-sided traffic (NCCL's RMA tables), pure: which QP of a lane carries each slice of a put
//! or get, when a signal may be posted, and when a request is done.
//!
//! A *lane* is one context's connection to one peer: the QPs of an ordinary connection plan
//! (`ncclwasm_model::ConnPlan`), so the policy that plans two-sided connections also decides
//! where one-sided bytes go. The shell (`ncclwasm-transport`'s `rma`) posts what [`Book`]
//! answers and feeds it every completion; the book never sees an address or a key.
//!
//! Ordering is RC's and nothing more: work requests on one QP execute in order at the target,
//! those on different QPs do not. So a signal rides the QP of its put (NCCL's proxy chains the
//! RDMA WRITE and the FETCH_AND_ADD on one QP) and goes out at once when that is enough. When it
//! is not — the put was striped over several QPs, or the signal is *strong* (it must follow
//! every earlier put of the context to that peer) and the lane has several QPs — the signal is
//! *held*: it records how many work requests each other QP had posted, and is released once
//! each of those QPs has completed that many. A completion means the target placed the bytes,
//! so the signal can never be seen before the data it announces.
//!
//! Every work request is signalled, so a QP's completions count exactly its posted requests,
//! and a QP never holds more than [`QP_DEPTH`] of them (its send queue and completion queue are
//! sized for that); a request that would exceed it is refused with [`ProtoError::RequestsExhausted`]
//! and the shell polls before it tries again.

use std::collections::VecDeque;

use crate::error::ProtoError;

/// Work requests one QP of a lane may have outstanding: what its send queue and completion
/// queue hold ([`crate::MAX_REQUESTS`], the two-sided data path's depth).
pub const QP_DEPTH: u64 = crate::MAX_REQUESTS as u64;

/// Requests one book tracks at once (every lane of a context set).
pub const MAX_RMA_REQUESTS: usize = 1 << 14;

/// Bits of a `wr_id` that hold the request slot, then the QP, then the generation.
const SLOT_BITS: u32 = 20;
const QP_BITS: u32 = 8;
const _: () = assert!(MAX_RMA_REQUESTS <= 1 << SLOT_BITS && crate::MAX_QPS <= 1 << QP_BITS);

/// A one-sided request: a slot and the generation it was taken in, so a request tested after
/// it was reported done (and its slot reused) is recognised as stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RmaReq {
    slot: u32,
    generation: u32,
}

impl RmaReq {
    /// As one integer, for a handle table on the other side of the C ABI.
    pub fn to_bits(self) -> u64 {
        u64::from(self.generation) << 32 | u64::from(self.slot)
    }

    pub fn from_bits(bits: u64) -> RmaReq {
        RmaReq {
            slot: bits as u32,
            generation: (bits >> 32) as u32,
        }
    }
}

/// How a put or get is cut over the QPs of its lane: the plan's `stripe_width` consecutive QPs
/// from a rotating start, each slice a multiple of `align` bytes except the last (as the
/// two-sided path stripes a message); below `min` bytes, one QP carries it whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Striping {
    pub width: u32,
    pub align: u32,
    pub min: u64,
}

/// One slice of a put or get: `len` bytes at offset `off` of the operation, on plan QP `qp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slice {
    pub qp: usize,
    pub off: u64,
    pub len: u64,
    pub wr_id: u64,
}

/// A signal to post now: on plan QP `qp` of lane `lane`, with `target` the shell's description
/// of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignalPost<S> {
    pub lane: usize,
    pub qp: usize,
    pub wr_id: u64,
    pub target: S,
}

/// What the shell posts for one new request, in this order: the slices, then the signal when
/// it may go now (else the book holds it and [`Book::released`] hands it over later).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posts<S> {
    pub req: RmaReq,
    pub slices: Vec<Slice>,
    pub signal: Option<SignalPost<S>>,
}

/// A signal to follow a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signal<S> {
    /// Ordered after every earlier put of the lane, not only its own.
    pub strong: bool,
    pub target: S,
}

#[derive(Debug, Default)]
struct Lane {
    /// Work requests posted and completed on each QP.
    posted: Vec<u64>,
    completed: Vec<u64>,
    /// Where the next unstriped operation goes.
    next: usize,
    /// A completion of the lane failed: its QP is in error and flushes what it holds, so a
    /// held signal can no longer know its data landed, and is never posted.
    failed: bool,
}

impl Lane {
    fn room(&self, qp: usize, n: u64) -> bool {
        self.posted[qp] - self.completed[qp] + n <= QP_DEPTH
    }
}

#[derive(Debug)]
struct Held<S> {
    req: RmaReq,
    lane: usize,
    qp: usize,
    /// `(qp, posted count)` each other QP must have completed first.
    after: Vec<(usize, u64)>,
    target: S,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    live: bool,
    lane: usize,
    /// Work requests not yet completed, the held signal included.
    pending: u32,
    /// A completion of it failed.
    failed: bool,
}

/// The one-sided requests of a set of lanes and where their work requests stand.
#[derive(Debug)]
pub struct Book<S> {
    lanes: Vec<Lane>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    held: VecDeque<Held<S>>,
}

impl<S: Copy> Book<S> {
    /// A book for lanes with `qps[l]` QPs each (0 for a lane that does not exist).
    pub fn new(qps: impl IntoIterator<Item = usize>) -> Book<S> {
        Book {
            lanes: qps
                .into_iter()
                .map(|n| Lane {
                    posted: vec![0; n],
                    completed: vec![0; n],
                    next: 0,
                    failed: false,
                })
                .collect(),
            slots: Vec::new(),
            free: Vec::new(),
            held: VecDeque::new(),
        }
    }

    /// QPs of lane `lane` (0: no such lane).
    pub fn qps(&self, lane: usize) -> usize {
        self.lanes.get(lane).map_or(0, |l| l.posted.len())
    }

    /// A put (or, with `signal: None` and a read for each slice, a get) of `size` bytes on
    /// `lane`. `Err(RequestsExhausted)` when a QP it needs is full: poll, then ask again.
    pub fn transfer(
        &mut self,
        lane: usize,
        size: u64,
        striping: Striping,
        signal: Option<Signal<S>>,
    ) -> Result<Posts<S>, ProtoError> {
        let nqps = self.qps(lane);
        if nqps == 0 {
            return Err(ProtoError::BadLocalInput {
                detail: format!("one-sided lane {lane} does not exist"),
            });
        }
        let cuts = cut(size, nqps, striping);
        let l = &self.lanes[lane];
        let start = l.next;
        let qp_of = |i: usize| (start + i) % nqps;
        // The signal rides the first slice's QP (the rotation's, for a signal alone).
        let sig_qp = qp_of(0);
        let mut need = vec![0u64; nqps];
        for i in 0..cuts.len() {
            need[qp_of(i)] += 1;
        }
        if signal.is_some() {
            need[sig_qp] += 1;
        }
        if let Some(q) = (0..nqps).find(|&q| need[q] > 0 && !l.room(q, need[q])) {
            return Err(ProtoError::RequestsExhausted {
                capacity: (QP_DEPTH as usize).min(usize::try_from(need[q]).unwrap_or(0)),
            });
        }
        let req = self.take(lane, cuts.len() + usize::from(signal.is_some()))?;
        let l = &mut self.lanes[lane];
        l.next = (start + cuts.len().max(1)) % nqps;
        let slices = cuts
            .iter()
            .enumerate()
            .map(|(i, &(off, len))| {
                let qp = qp_of(i);
                l.posted[qp] += 1;
                Slice {
                    qp,
                    off,
                    len,
                    wr_id: wr_id(req, qp),
                }
            })
            .collect::<Vec<_>>();
        let signal = signal.and_then(|s| {
            let after: Vec<(usize, u64)> = (0..nqps)
                .filter(|&q| q != sig_qp)
                .filter(|&q| s.strong || slices.iter().any(|c| c.qp == q))
                .map(|q| (q, l.posted[q]))
                .filter(|&(q, n)| l.completed[q] < n)
                .collect();
            if after.is_empty() {
                l.posted[sig_qp] += 1;
                Some(SignalPost {
                    lane,
                    qp: sig_qp,
                    wr_id: wr_id(req, sig_qp),
                    target: s.target,
                })
            } else {
                self.held.push_back(Held {
                    req,
                    lane,
                    qp: sig_qp,
                    after,
                    target: s.target,
                });
                None
            }
        });
        Ok(Posts {
            req,
            slices,
            signal,
        })
    }

    /// A flush of `lane`: one small read on each of its QPs, each completing after everything
    /// posted on that QP before it. `Err(RequestsExhausted)` as for [`Book::transfer`].
    pub fn flush(&mut self, lane: usize) -> Result<(RmaReq, Vec<Slice>), ProtoError> {
        let nqps = self.qps(lane);
        if nqps == 0 {
            return Err(ProtoError::BadLocalInput {
                detail: format!("one-sided lane {lane} does not exist"),
            });
        }
        if (0..nqps).any(|q| !self.lanes[lane].room(q, 1)) {
            return Err(ProtoError::RequestsExhausted { capacity: 1 });
        }
        let req = self.take(lane, nqps)?;
        let l = &mut self.lanes[lane];
        let slices = (0..nqps)
            .map(|qp| {
                l.posted[qp] += 1;
                Slice {
                    qp,
                    off: 0,
                    len: 0,
                    wr_id: wr_id(req, qp),
                }
            })
            .collect();
        Ok((req, slices))
    }

    /// Accounts one completion: its `wr_id` and whether it succeeded.
    pub fn complete(&mut self, wr_id: u64, ok: bool) -> Result<(), ProtoError> {
        let slot = (wr_id & ((1 << SLOT_BITS) - 1)) as u32;
        let qp = ((wr_id >> SLOT_BITS) & ((1 << QP_BITS) - 1)) as usize;
        let req = RmaReq {
            slot,
            generation: (wr_id >> 32) as u32,
        };
        let s = self.live(req).ok_or_else(|| ProtoError::Bookkeeping {
            detail: format!("a one-sided completion (wr_id {wr_id:#x}) matches no request"),
        })?;
        let lane = s.lane;
        s.pending = s.pending.saturating_sub(1);
        s.failed |= !ok;
        let l = &mut self.lanes[lane];
        l.failed |= !ok;
        match l.completed.get_mut(qp) {
            Some(c) => *c += 1,
            None => {
                return Err(ProtoError::Bookkeeping {
                    detail: format!("a one-sided completion names QP {qp} of {}", l.posted.len()),
                });
            }
        }
        Ok(())
    }

    /// Held signals whose QPs have now completed what they waited for, to post now, in the
    /// order they were asked for (each one counted as posted). A held signal of a lane with a
    /// failed completion is dropped instead, and its request fails: its data may not have
    /// landed, and a signal must never say it did.
    pub fn released(&mut self) -> Vec<SignalPost<S>> {
        let mut out = Vec::new();
        let (lanes, slots) = (&mut self.lanes, &mut self.slots);
        self.held.retain(|h| {
            let l = &mut lanes[h.lane];
            if l.failed {
                if let Some(s) = slots
                    .get_mut(h.req.slot as usize)
                    .filter(|s| s.live && s.generation == h.req.generation)
                {
                    s.pending = s.pending.saturating_sub(1);
                    s.failed = true;
                }
                return false;
            }
            if h.after.iter().any(|&(q, n)| l.completed[q] < n) {
                return true;
            }
            l.posted[h.qp] += 1;
            out.push(SignalPost {
                lane: h.lane,
                qp: h.qp,
                wr_id: wr_id(h.req, h.qp),
                target: h.target,
            });
            false
        });
        out
    }

    /// The lane of a live request.
    pub fn lane_of(&self, req: RmaReq) -> Result<usize, ProtoError> {
        self.slots
            .get(req.slot as usize)
            .filter(|s| s.live && s.generation == req.generation)
            .map(|s| s.lane)
            .ok_or_else(|| stale(req))
    }

    /// `Ok(None)`: still running. `Ok(Some(ok))`: done, and freed — `ok` false when one of its
    /// completions failed. A request already reported done is an error.
    pub fn test(&mut self, req: RmaReq) -> Result<Option<bool>, ProtoError> {
        let s = self.live(req).ok_or_else(|| stale(req))?;
        if s.pending > 0 {
            return Ok(None);
        }
        let ok = !s.failed;
        s.live = false;
        self.free.push(req.slot);
        Ok(Some(ok))
    }

    /// Requests not yet reported done.
    pub fn live_requests(&self) -> usize {
        self.slots.iter().filter(|s| s.live).count()
    }

    fn live(&mut self, req: RmaReq) -> Option<&mut Slot> {
        self.slots
            .get_mut(req.slot as usize)
            .filter(|s| s.live && s.generation == req.generation)
    }

    fn take(&mut self, lane: usize, pending: usize) -> Result<RmaReq, ProtoError> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if self.slots.len() < MAX_RMA_REQUESTS => {
                self.slots.push(Slot::default());
                (self.slots.len() - 1) as u32
            }
            None => {
                return Err(ProtoError::RequestsExhausted {
                    capacity: MAX_RMA_REQUESTS,
                });
            }
        };
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        s.live = true;
        s.lane = lane;
        s.pending = pending as u32;
        s.failed = false;
        Ok(RmaReq {
            slot,
            generation: s.generation,
        })
    }
}

fn stale(req: RmaReq) -> ProtoError {
    ProtoError::BadLocalInput {
        detail: format!(
            "one-sided request {:#x} is not in flight (already reported done, or never made)",
            req.to_bits()
        ),
    }
}

fn wr_id(req: RmaReq, qp: usize) -> u64 {
    u64::from(req.generation) << 32 | (qp as u64) << SLOT_BITS | u64::from(req.slot)
}

/// The largest slice one work request carries (a scatter/gather entry's length is 32 bits).
pub const MAX_SLICE: u64 = 1 << 30;

/// `(offset, length)` of each slice of `size` bytes over at most `nqps` QPs; a slice above
/// [`MAX_SLICE`] is cut further, its pieces going on over the rotation.
fn cut(size: u64, nqps: usize, s: Striping) -> Vec<(u64, u64)> {
    if size == 0 {
        return Vec::new();
    }
    let width = (s.width.max(1) as usize).min(nqps) as u64;
    let chunk = if width == 1 || size < s.min {
        size
    } else {
        let align = u64::from(s.align.max(1));
        size.div_ceil(width).div_ceil(align) * align
    };
    let chunk = chunk.min(MAX_SLICE);
    (0..size.div_ceil(chunk))
        .map(|i| (i * chunk, chunk.min(size - i * chunk)))
        .collect()
}

#[cfg(test)]
mod tests;
