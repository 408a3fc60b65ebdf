//! Rail failover on the data path: how a connection prepared for it carries out a policy's
//! `move-to` without losing, duplicating or corrupting a byte, and without failing a request.
//!
//! # What is decided elsewhere
//! The connecting side decides at connect time whether a connection is *prepared* for failover:
//! when its policy, asked about a failure of each local port the plan uses, would answer
//! anything but `fail` (the built-in default: `NCCL_IB_RESILIENCY_PORT_FAILOVER=1`). The flag
//! travels in the handshake. An unprepared connection runs exactly the reference's data path,
//! and a port failure fails it, as NCCL's default does. When a QP of a prepared connection
//! fails (a fatal completion or a fatal QP event), the sending side asks the policy
//! (`on-port-event`) and gets a checked answer. The receiving side follows: it has nothing to
//! decide, since which ports carry data is the sender's choice.
//!
//! # The design
//! 1. **Tagged immediates.** Every slice (the part of one message one QP carries) ends with a
//!    WRITE_WITH_IMM whose immediate is an [`ImmTag`] — FIFO slot, slice index, slice count and
//!    the slot's use count — and which also writes the message's sizes row, so sizes never
//!    ride in the immediate. The receiver can take a slice on any QP.
//! 2. **Anonymous receives, counted slices.** The receiver keeps every QP's receive queue full
//!    (one receive re-posted per completion) and records in [`Arrivals`] which slices of each
//!    slot arrived; a repeated slice is a duplicate and counts nothing. It publishes each
//!    slot's record as one 64-bit word ([`record_word`]) in registered memory *before* it
//!    reports the receive complete.
//! 3. **The sender probes before it replays.** On `move-to`, new messages are striped over
//!    the surviving ports' QPs ([`surviving_plan`]). Slices of the failed QPs without a success
//!    completion might or might not have landed. The sender RDMA-READs the receiver's records
//!    over a surviving QP: a slice the record shows, or any slice of a slot the receiver has
//!    already moved past, arrived and is not sent again; every other one is written again, with
//!    its tag, on a surviving QP ([`SendFailover::probed`]).
//! 4. **A barrier.** Until every replayed slice is acknowledged, the sender starts no new
//!    message. This is what makes a replay safe: a slice the probe did not see may still be
//!    polled by the receiver afterwards, completing its receive, and NCCL may then reuse the
//!    buffer for a later receive. That later receive's CTS can only be read by the sender after
//!    the probe, and the sender posts its data only after the replays landed, so the replay's
//!    old bytes can never overwrite the new ones. Conversely a receive completed before the
//!    probe is visible in the probed record (the record is written before the completion is
//!    reported, and the completion before any later CTS), so its slices are never replayed.
//! 5. **The receiver's side of the move.** The receive queue of a failed QP is gone with it; the
//!    receiver ignores that QP's completions from then on and writes its outstanding CTS entries
//!    again through one surviving QP, and every later CTS entry through that same QP, so a stale
//!    rewrite can never land after a newer entry of the same slot. When no QP survives (every
//!    port held), the entries wait for the first QP re-created, which then carries them all.
//!
//! Writes are idempotent (the same bytes to the same place), so a slice written twice — once on
//! the failed QP, once again after the probe — leaves the memory as once; the tag makes the
//! receiver count it once. The price of being prepared: one more work request per QP and
//! message (the tagged write carries the sizes row), and receives posted ahead; a connection
//! whose policy would never move traffic does not pay it.
//!
//! 6. **Fail-back.** When the port returns and the policy answers `fail-back`, both sides
//!    re-create its QPs (the old ones are in the error state for good) and exchange their halves
//!    over the handshake socket a prepared connection keeps
//!    ([`crate::handshake::Control`]); new messages are striped over them again
//!    ([`SendFailover::fail_back`]). Only with no probe or replay pending, so no slice is still
//!    accounted to a QP being replaced.
//!
//! 7. **Wait.** A `wait` answer holds the failed port instead of moving its traffic: its QPs
//!    are failed as for a move, but no new message starts while any port is held
//!    ([`SendFailover::hold`]), and nothing of the held port's slices is written on another
//!    port. A probe still runs over a QP that works: slices the receiver already has are
//!    confirmed, so a message it completed finishes on the sender too — without this, a
//!    receiver with nothing left to wait for would never be asked to progress, and never
//!    re-create its QPs. When the port is active again its QPs are re-created as for a
//!    fail-back, and [`SendFailover::resume`] marks the held port's unacknowledged slices
//!    *lost* (the plan QP indices now name the fresh QPs, so "posted on a failed QP" can no
//!    longer tell them) and asks for another probe: the slices the receiver lacks are written
//!    again on their own (fresh) QPs, and the barrier of step 4 holds new messages until those
//!    landed. The shell bounds the wait by the policy's time and fails the connection with its
//!    reason when the port stays down.

use ncclwasm_model::{ConnPlan, QpPlan};

use crate::error::ProtoError;
use crate::fifo::{CtsEntry, FifoCursor};
use crate::request::{ReqId, RequestPool};
use crate::{MAX_QPS, MAX_RECVS, MAX_REQUESTS};

/// The most slices a message of a prepared connection may have: a slot's record is one 64-bit
/// word (a bit per slice beside the use count), read by the sender in one RDMA READ.
pub const MAX_FAILOVER_SLICES: usize = 32;

/// Use counts are kept modulo this (the bits an [`ImmTag`] has for them).
pub const USE_MODULUS: u16 = 1 << USE_BITS;

/// `wr_id` of the sender's probe READ. Tagged slices use their immediate (< 2^32) as `wr_id`.
pub const PROBE_WR_ID: u64 = u64::MAX;

/// `wr_id` of a prepared receiver's signalled CTS writes: they settle no request.
pub const CTS_WR_ID: u64 = u64::MAX - 1;

/// Bits of the immediate for each field of an [`ImmTag`]: slot 8 (a FIFO slot, < 256), slice 7
/// and slice count 7 (a message has 1..=128 slices, one per QP of its stripe), use count 10.
const SLOT_BITS: u32 = 8;
const SLICE_BITS: u32 = 7;
const COUNT_BITS: u32 = 7;
const USE_BITS: u32 = 32 - SLOT_BITS - SLICE_BITS - COUNT_BITS;
const _: () = assert!(MAX_QPS == 1 << SLICE_BITS && MAX_QPS == 1 << COUNT_BITS);

/// What a WRITE_WITH_IMM carries in failover mode: which slice of which message it completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ImmTag {
    /// The CTS FIFO slot of the message.
    pub slot: u8,
    /// Which of its slices (0-based, < `slices`).
    pub slice: u8,
    /// How many slices the message has (1..=128).
    pub slices: u8,
    /// The slot's use count, modulo 2^10: tells a late duplicate of a message from the next
    /// message in the same slot.
    pub use_count: u16,
}

impl ImmTag {
    /// The 32-bit immediate. `slices` is stored minus one, so 128 fits in 7 bits.
    pub fn encode(self) -> Result<u32, ProtoError> {
        let fits = self.slices >= 1
            && usize::from(self.slices) <= MAX_QPS
            && self.slice < self.slices
            && u32::from(self.use_count) < 1 << USE_BITS;
        if !fits {
            return Err(ProtoError::Bookkeeping {
                detail: format!("{self:?} does not fit a failover immediate"),
            });
        }
        Ok(self.pack())
    }

    /// The immediate of a tag known to fit (the data path builds its own tags within the
    /// limits [`encode`](Self::encode) checks).
    pub(crate) fn pack(self) -> u32 {
        u32::from(self.slot)
            | u32::from(self.slice) << SLOT_BITS
            | u32::from(self.slices.wrapping_sub(1)) << (SLOT_BITS + SLICE_BITS)
            | u32::from(self.use_count) << (SLOT_BITS + SLICE_BITS + COUNT_BITS)
    }

    /// The tag an immediate carries; total (every 32-bit value is some tag), so a forged or
    /// corrupted immediate is caught by [`Arrivals::record`]'s checks, not here.
    pub fn decode(imm: u32) -> ImmTag {
        let field = |shift: u32, bits: u32| (imm >> shift) & ((1 << bits) - 1);
        ImmTag {
            slot: field(0, SLOT_BITS) as u8,
            slice: field(SLOT_BITS, SLICE_BITS) as u8,
            slices: field(SLOT_BITS + SLICE_BITS, COUNT_BITS) as u8 + 1,
            use_count: field(SLOT_BITS + SLICE_BITS + COUNT_BITS, USE_BITS) as u16,
        }
    }
}

/// What one tagged completion meant to the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A slice not seen before; `complete` when it was the message's last missing one.
    Fresh { complete: bool },
    /// This slice already arrived (it was written again on another QP): count nothing.
    Duplicate,
}

/// The receiver's record of which slices of each slot's current message arrived.
#[derive(Clone, Debug)]
pub struct Arrivals {
    slots: Vec<SlotArrivals>,
}

#[derive(Clone, Copy, Debug, Default)]
struct SlotArrivals {
    /// The use count of the message being received in this slot.
    use_count: u16,
    /// How many slices it has, 0 before its first slice.
    slices: u8,
    /// Bit `i`: slice `i` arrived.
    seen: u32,
    /// Whether a message was ever expected here (a never-used slot publishes 0).
    used: bool,
}

impl Arrivals {
    /// A record for `slots` FIFO slots (the communicator's request count).
    pub fn new(slots: usize) -> Self {
        Arrivals {
            slots: vec![SlotArrivals::default(); slots],
        }
    }

    /// Expect the message of use count `use_count` in `slot` (when its receive is posted): what
    /// the slot recorded for the previous message is forgotten.
    pub fn expect(&mut self, slot: usize, use_count: u16) -> Result<(), ProtoError> {
        let s = self.slot_mut(slot)?;
        *s = SlotArrivals {
            use_count,
            used: true,
            ..SlotArrivals::default()
        };
        Ok(())
    }

    /// The slot's record as the sender's probe reads it ([`record_word`]).
    pub fn word(&self, slot: usize) -> u64 {
        self.slots
            .get(slot)
            .filter(|s| s.used)
            .map_or(0, |s| record_word(s.use_count, s.seen))
    }

    /// Count one tagged completion. A slice of the slot's previous message is a late duplicate
    /// (a replay of a slice that had landed). A tag for a slot never posted, for any other use
    /// of the slot, or whose slice count disagrees with the message's earlier slices is a
    /// protocol error (the peer is broken or hostile), never silently counted.
    pub fn record(&mut self, tag: ImmTag) -> Result<Arrival, ProtoError> {
        let s = self.slot_mut(usize::from(tag.slot))?;
        let bad = |why: &str| ProtoError::Bookkeeping {
            detail: format!("a completion tagged {tag:?} {why}"),
        };
        if s.used && tag.use_count == (s.use_count + USE_MODULUS - 1) % USE_MODULUS {
            return Ok(Arrival::Duplicate);
        }
        if !s.used || tag.use_count != s.use_count {
            return Err(bad(&format!(
                "is not for the message the slot expects (use {})",
                s.use_count
            )));
        }
        if s.slices != 0 && s.slices != tag.slices {
            return Err(bad(&format!(
                "disagrees with the {} slices of the message",
                s.slices
            )));
        }
        if tag.slice >= tag.slices || usize::from(tag.slices) > MAX_FAILOVER_SLICES {
            return Err(bad("names a slice beyond the message"));
        }
        s.slices = tag.slices;
        let bit = 1u32 << tag.slice;
        if s.seen & bit != 0 {
            return Ok(Arrival::Duplicate);
        }
        s.seen |= bit;
        Ok(Arrival::Fresh {
            complete: s.seen.count_ones() == u32::from(s.slices),
        })
    }

    fn slot_mut(&mut self, slot: usize) -> Result<&mut SlotArrivals, ProtoError> {
        let n = self.slots.len();
        self.slots
            .get_mut(slot)
            .ok_or_else(|| ProtoError::Bookkeeping {
                detail: format!("slot {slot} is outside the {n} FIFO slots"),
            })
    }
}

/// The use count a prepared connection carries for the message at `cursor`: the slot's uses
/// modulo [`USE_MODULUS`], as many as an [`ImmTag`] has bits for.
pub fn use_count(cursor: FifoCursor) -> u16 {
    (cursor.uses() % u64::from(USE_MODULUS)) as u16
}

/// A slot's arrival record as the receiver publishes it: bit 63 set once the slot was used, the
/// use count in bits 32..48, the arrived slices in bits 0..32. Zero for a slot never used.
pub fn record_word(use_count: u16, seen: u32) -> u64 {
    1 << 63 | u64::from(use_count) << 32 | u64::from(seen)
}

/// A slice to write again after a probe: slice `slice` of the message in FIFO slot `slot`, on
/// plan QP `qp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repost {
    pub slot: usize,
    pub slice: usize,
    pub qp: usize,
}

/// What the sender keeps of a posted message until every slice is acknowledged: enough to lay
/// out any slice again on another QP.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InFlight {
    pub(crate) live: bool,
    pub(crate) cursor: FifoCursor,
    pub(crate) entries: [CtsEntry; MAX_RECVS],
    /// Each grouped send's request and size after truncation.
    pub(crate) sends: [(Option<ReqId>, u64); MAX_RECVS],
    pub(crate) nreqs: usize,
    /// The stripe start, in the plan of generation `generation`.
    pub(crate) start: u32,
    pub(crate) generation: usize,
    pub(crate) slices: usize,
    /// The plan QP each slice was last posted on.
    pub(crate) slice_qp: [u8; MAX_FAILOVER_SLICES],
    /// Bit `i`: slice `i` is known to have landed.
    pub(crate) acked: u32,
    /// Bit `i`: slice `i` was written again and that write is not acknowledged yet.
    pub(crate) replayed: u32,
    /// Bit `i`: slice `i` was in flight on a held port's QP that has been re-created since:
    /// the probe decides whether it landed.
    pub(crate) lost: u32,
}

impl InFlight {
    const EMPTY: InFlight = InFlight {
        live: false,
        cursor: FifoCursor::ZERO,
        entries: [CtsEntry::ZERO; MAX_RECVS],
        sends: [(None, 0); MAX_RECVS],
        nreqs: 0,
        start: 0,
        generation: 0,
        slices: 0,
        slice_qp: [0; MAX_FAILOVER_SLICES],
        acked: 0,
        replayed: 0,
        lost: 0,
    };

    fn all(&self) -> u32 {
        if self.slices >= 32 {
            u32::MAX
        } else {
            (1 << self.slices) - 1
        }
    }
}

/// Where the probe stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    Idle,
    /// A failure left slices unaccounted for: post a probe.
    Needed,
    /// A probe READ is out; `again` when another failure happened since it was posted.
    Posted {
        again: bool,
    },
}

/// What failover has done on a send side, for counters and INFO lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FailoverCounters {
    /// Moves carried out (`move-to` answers).
    pub moves: u32,
    /// Fail-backs carried out: a port's re-created QPs carry traffic again.
    pub fail_backs: u32,
    /// Ports held by a `wait` answer.
    pub waits: u32,
    /// Held ports that came back in time: their re-created QPs carry the held traffic.
    pub resumes: u32,
    /// Probe READs completed.
    pub probes: u32,
    /// Slices of failed QPs the probe showed had landed.
    pub confirmed: u64,
    /// Slices written again on a surviving QP.
    pub replayed: u64,
    /// Payload bytes of the replayed slices.
    pub replayed_bytes: u64,
}

/// The sender's failover state (a prepared connection only): the in-flight messages, the plans
/// new messages were striped with, which QPs failed, the probe and the replay barrier.
#[derive(Debug)]
pub struct SendFailover {
    slots: Vec<InFlight>,
    /// The plan of each generation and its QPs' indices in the connection's plan; generation 0
    /// is the connection's own plan, each move adds one.
    plans: Vec<(ConnPlan, Vec<u32>)>,
    /// Bit `q`: plan QP `q` failed; its completions count nothing from then on.
    failed: u128,
    /// Local ports held by a `wait` answer, until they come back.
    held: Vec<u32>,
    probe: Probe,
    /// Replayed slices not acknowledged yet.
    replays: u32,
    counters: FailoverCounters,
}

/// Most moves one connection carries out: each adds a plan generation, and a connection whose
/// ports fail this often is better failed.
const MAX_GENERATIONS: usize = 64;

impl SendFailover {
    pub(crate) fn new(plan: &ConnPlan) -> Self {
        SendFailover {
            slots: vec![InFlight::EMPTY; MAX_REQUESTS],
            plans: vec![(plan.clone(), (0..plan.qps.len() as u32).collect())],
            failed: 0,
            held: Vec::new(),
            probe: Probe::Idle,
            replays: 0,
            counters: FailoverCounters::default(),
        }
    }

    pub fn counters(&self) -> FailoverCounters {
        self.counters
    }

    /// Whether plan QP `qp` failed.
    pub fn is_failed(&self, qp: usize) -> bool {
        qp < 128 && self.failed & (1 << qp) != 0
    }

    /// The current plan generation and its plan.
    pub(crate) fn current(&self) -> (usize, &ConnPlan, &[u32]) {
        let g = self.plans.len() - 1;
        (g, &self.plans[g].0, &self.plans[g].1)
    }

    pub(crate) fn plan(&self, generation: usize) -> &ConnPlan {
        &self.plans[generation].0
    }

    pub(crate) fn slot(&self, slot: usize) -> &InFlight {
        &self.slots[slot]
    }

    /// Keep a posted message until all its slices are acknowledged.
    pub(crate) fn posted(&mut self, record: InFlight) {
        let slot = record.cursor.slot();
        self.slots[slot] = record;
    }

    /// No new message may start: a port is held, a probe is pending or replays are
    /// unacknowledged (the barrier of the design, steps 4 and 7).
    pub fn blocked(&self) -> bool {
        !self.held.is_empty() || self.probe != Probe::Idle || self.replays > 0
    }

    /// Whether local port `port` is held by a `wait` answer.
    pub fn is_held(&self, port: u32) -> bool {
        self.held.contains(&port)
    }

    /// A tagged slice's success completion (its `wr_id` is its immediate) polled from a QP that
    /// has not failed. Settles the message's requests in `pool` once every slice landed.
    pub(crate) fn acked(&mut self, wr_id: u64, pool: &mut RequestPool) -> Result<(), ProtoError> {
        let tag =
            u32::try_from(wr_id)
                .map(ImmTag::decode)
                .map_err(|_| ProtoError::Bookkeeping {
                    detail: format!("send completion wr_id {wr_id:#x} is not a failover tag"),
                })?;
        let s = &mut self.slots[usize::from(tag.slot)];
        if !s.live || use_count(s.cursor) != tag.use_count || usize::from(tag.slice) >= s.slices {
            // The acknowledgement of a slice written twice, for a message already settled.
            return Ok(());
        }
        self.ack(usize::from(tag.slot), 1 << tag.slice, pool)
    }

    /// Slices `bits` of the message in `slot` landed.
    fn ack(&mut self, slot: usize, bits: u32, pool: &mut RequestPool) -> Result<(), ProtoError> {
        let s = &mut self.slots[slot];
        let ended = s.replayed & bits;
        self.replays -= ended.count_ones();
        s.replayed &= !bits;
        s.lost &= !bits;
        s.acked |= bits;
        settle_if_done(s, pool)
    }

    /// The connection's own plan (generation 0), which failed and restored ports are
    /// counted against.
    fn full(&self) -> &ConnPlan {
        &self.plans[0].0
    }

    /// Bit `q`: plan QP `q` is on local port `port`.
    fn port_qps(&self, port: u32) -> u128 {
        (self.full().qps.iter().enumerate())
            .filter(|(_, p)| p.local == port)
            .fold(0, |m, (q, _)| m | 1 << q)
    }

    /// The QPs of local port `port` failed and the policy moved their traffic to `to`: new
    /// messages go over the QPs of `to` that still work, and a probe is due if any in-flight
    /// slice on a failed QP is unaccounted for.
    pub fn fail_over(&mut self, port: u32, to: &[u32]) -> Result<(), ProtoError> {
        self.failed |= self.port_qps(port);
        let live: Vec<u32> = to.iter().copied().filter(|&p| p != port).collect();
        let (mut plan, mut kept) = surviving_plan(self.full(), &live);
        let keep: Vec<usize> = (0..kept.len())
            .filter(|&i| !self.is_failed(kept[i] as usize))
            .collect();
        plan.qps = keep.iter().map(|&i| plan.qps[i]).collect();
        kept = keep.iter().map(|&i| kept[i]).collect();
        plan.stripe_width = plan.stripe_width.min(plan.qps.len() as u32).max(1);
        if plan.qps.is_empty() {
            return Err(ProtoError::Bookkeeping {
                detail: format!("no working QP is left on the ports {to:?}"),
            });
        }
        if self.plans.len() >= MAX_GENERATIONS {
            return Err(ProtoError::Bookkeeping {
                detail: format!("{MAX_GENERATIONS} moves on one connection"),
            });
        }
        self.plans.push((plan, kept));
        self.counters.moves += 1;
        self.probe_if_lost();
        Ok(())
    }

    /// A probe is due when an in-flight slice on a failed QP is unaccounted for.
    fn probe_if_lost(&mut self) {
        let lost = self.slots.iter().any(|s| {
            s.live
                && (0..s.slices)
                    .any(|i| s.acked & (1 << i) == 0 && self.is_failed(usize::from(s.slice_qp[i])))
        });
        if lost {
            self.probe_again();
        }
    }

    /// Asks for a probe; one already out is read again after it returns.
    fn probe_again(&mut self) {
        self.probe = match self.probe {
            Probe::Posted { .. } => Probe::Posted { again: true },
            _ => Probe::Needed,
        };
    }

    /// The QPs of local port `port` were re-created and connected again (`fail-back`): they
    /// carry new messages again, with every other QP that works. Only once no probe or replay
    /// is pending ([`blocked`](Self::blocked)), so no slice is still accounted to the QPs the
    /// new ones replace.
    pub fn fail_back(&mut self, port: u32) -> Result<(), ProtoError> {
        if self.blocked() {
            return Err(ProtoError::Bookkeeping {
                detail: "fail-back while a port is held, or a probe or replays are pending".into(),
            });
        }
        self.restore(port)?;
        self.counters.fail_backs += 1;
        Ok(())
    }

    /// The policy answered `wait` to the failure of local port `port`: its QPs are failed as
    /// for a move, and no new message starts until it comes back ([`resume`](Self::resume));
    /// a probe over a working QP only confirms what landed — the shell fails the connection
    /// when the port does not come back in time.
    pub fn hold(&mut self, port: u32) -> Result<(), ProtoError> {
        // A port whose QPs fail again as soon as they are re-created would cycle for ever.
        if self.counters.waits as usize >= MAX_GENERATIONS {
            return Err(ProtoError::Bookkeeping {
                detail: format!("{MAX_GENERATIONS} waits on one connection"),
            });
        }
        self.failed |= self.port_qps(port);
        if !self.is_held(port) {
            self.held.push(port);
        }
        self.counters.waits += 1;
        self.probe_if_lost();
        Ok(())
    }

    /// Held port `port` came back and its QPs were re-created and connected again: its
    /// unacknowledged slices are probed (those the receiver lacks are written again on their
    /// own QPs), and new messages start again once nothing is held and the replays landed.
    pub fn resume(&mut self, port: u32) -> Result<(), ProtoError> {
        let Some(at) = self.held.iter().position(|&p| p == port) else {
            return Err(ProtoError::Bookkeeping {
                detail: format!("resuming port {port}, which is not held"),
            });
        };
        self.held.swap_remove(at);
        let on_port = self.port_qps(port);
        let mut lost = false;
        for s in self.slots.iter_mut().filter(|s| s.live) {
            for i in 0..s.slices {
                if s.acked & (1 << i) == 0 && on_port & (1 << s.slice_qp[i]) != 0 {
                    s.lost |= 1 << i;
                    lost = true;
                }
            }
        }
        self.restore(port)?;
        if lost {
            self.probe_again();
        }
        self.counters.resumes += 1;
        Ok(())
    }

    /// The QPs of local port `port` work again: they count again, and new messages are
    /// striped over every QP of the connection's plan that works (a new plan generation when
    /// that differs from the current one).
    fn restore(&mut self, port: u32) -> Result<(), ProtoError> {
        self.failed &= !self.port_qps(port);
        let full = self.full();
        let kept: Vec<u32> = (0..full.qps.len() as u32)
            .filter(|&q| !self.is_failed(q as usize))
            .collect();
        if kept == self.current().2 {
            return Ok(());
        }
        let mut plan = full.clone();
        plan.qps = kept.iter().map(|&q| full.qps[q as usize]).collect();
        plan.stripe_width = plan.stripe_width.min(plan.qps.len() as u32).max(1);
        if self.plans.len() >= MAX_GENERATIONS {
            return Err(ProtoError::Bookkeeping {
                detail: format!("{MAX_GENERATIONS} plan changes on one connection"),
            });
        }
        self.plans.push((plan, kept));
        Ok(())
    }

    /// The plan QP to post the probe READ on, when one is due; the caller posts it and the
    /// probe counts as out.
    pub fn take_probe(&mut self) -> Option<usize> {
        if self.probe != Probe::Needed {
            return None;
        }
        // Over a QP that works: while a port is held, the current plan still names its QPs.
        let q = self
            .current()
            .2
            .iter()
            .copied()
            .find(|&q| !self.is_failed(q as usize))?;
        self.probe = Probe::Posted { again: false };
        Some(q as usize)
    }

    /// The probe READ failed (its QP failed too): probe again.
    pub fn probe_lost(&mut self) {
        if matches!(self.probe, Probe::Posted { .. }) {
            self.probe = Probe::Needed;
        }
    }

    /// The probe READ returned the receiver's records (`words[slot]`): slices the records show
    /// are acknowledged, every other unacknowledged slice of a failed QP is assigned a surviving
    /// QP in turn. Returns the slices to write again; settles messages that are now complete.
    pub fn probed(
        &mut self,
        words: &[u64; MAX_REQUESTS],
        pool: &mut RequestPool,
    ) -> Result<Vec<Repost>, ProtoError> {
        let mut again = matches!(self.probe, Probe::Posted { again: true });
        self.counters.probes += 1;
        let targets: Vec<u32> = (self.current().2.iter().copied())
            .filter(|&q| !self.is_failed(q as usize))
            .collect();
        let mut next = 0;
        let mut out = Vec::new();
        for (slot, &w) in words.iter().enumerate() {
            let s = self.slots[slot];
            if !s.live {
                continue;
            }
            // The receiver expects a slot's message before its CTS is written, so a record of
            // another use means it moved past this message: every slice arrived.
            let same_use = w >> 63 == 1 && (w >> 32) as u16 == use_count(s.cursor);
            let seen = if same_use { w as u32 } else { u32::MAX };
            let mut confirmed = 0;
            for i in 0..s.slices {
                let bit = 1 << i;
                let on = usize::from(s.slice_qp[i]);
                let failed = self.is_failed(on);
                if s.acked & bit != 0 || !(failed || s.lost & bit != 0) {
                    continue;
                }
                if seen & bit != 0 {
                    confirmed |= bit;
                    continue;
                }
                let qp = if !failed {
                    // A resumed port's slice goes again on its own, re-created QP.
                    on
                } else if self.is_held(self.full().qps[on].local) {
                    // It waits for its port: confirmed now if it landed, written again on
                    // its own QP once the port is back.
                    continue;
                } else if let Some(&t) = targets.get(next % targets.len().max(1)) {
                    next += 1;
                    t as usize
                } else {
                    // Every QP of the plan is on a held port: probe again once one is back.
                    again = true;
                    continue;
                };
                let s = &mut self.slots[slot];
                s.lost &= !bit;
                s.slice_qp[i] = qp as u8;
                if s.replayed & bit == 0 {
                    s.replayed |= bit;
                    self.replays += 1;
                }
                self.counters.replayed += 1;
                out.push(Repost { slot, slice: i, qp });
            }
            self.counters.confirmed += u64::from(confirmed.count_ones());
            self.ack(slot, confirmed, pool)?;
        }
        self.probe = if again { Probe::Needed } else { Probe::Idle };
        Ok(out)
    }

    /// Payload bytes of a replayed slice, for the counters.
    pub(crate) fn count_replayed_bytes(&mut self, bytes: u64) {
        self.counters.replayed_bytes += bytes;
    }
}

/// Once every slice of `s` landed: its requests are settled (each waits on one token, see
/// `Sender::isend`) and the record is free.
fn settle_if_done(s: &mut InFlight, pool: &mut RequestPool) -> Result<(), ProtoError> {
    if !s.live || s.acked & s.all() != s.all() {
        return Ok(());
    }
    for (req, _) in &s.sends[..s.nreqs] {
        if let Some(r) = req {
            pool.settle(*r, 0, 0)?;
        }
    }
    s.live = false;
    Ok(())
}

/// The receiver's failover state (a prepared connection only).
#[derive(Debug)]
pub struct RecvFailover {
    pub(crate) arrivals: Arrivals,
    /// The request waiting in each slot.
    pub(crate) slot_req: Vec<Option<ReqId>>,
    /// The CTS entries of each slot, to write again after a failure.
    pub(crate) entries: Vec<([CtsEntry; MAX_RECVS], usize, FifoCursor)>,
    /// Bit `q`: plan QP `q` failed.
    pub(crate) failed: u128,
    /// After a failure, every CTS write goes through this QP (none while every QP failed).
    pub(crate) cts_pin: Option<usize>,
}

impl RecvFailover {
    pub(crate) fn new() -> Self {
        RecvFailover {
            arrivals: Arrivals::new(MAX_REQUESTS),
            slot_req: vec![None; MAX_REQUESTS],
            entries: vec![([CtsEntry::ZERO; MAX_RECVS], 0, FifoCursor::ZERO); MAX_REQUESTS],
            failed: 0,
            cts_pin: None,
        }
    }

    pub fn is_failed(&self, qp: usize) -> bool {
        qp < 128 && self.failed & (1 << qp) != 0
    }

    /// Every QP failed (none was left to pin the CTS writes to): the CTS entries wait for one
    /// to be re-created.
    pub(crate) fn stranded(&self) -> bool {
        self.cts_pin.is_none() && self.failed != 0
    }

    /// Plan QP `qp` was re-created and connected again: its completions count again.
    pub(crate) fn rejoined(&mut self, qp: usize) {
        if qp < 128 {
            self.failed &= !(1 << qp);
        }
    }
}

/// The plan new messages are striped over after a `move-to ports`: the QPs on those ports, in
/// plan order, with their weights, and the stripe width clamped to what is left. Also returns,
/// for each QP of the new plan, its index in the old one (the QP objects stay the same).
pub fn surviving_plan(plan: &ConnPlan, ports: &[u32]) -> (ConnPlan, Vec<u32>) {
    let kept: Vec<u32> = (0..plan.qps.len() as u32)
        .filter(|&q| ports.contains(&plan.qps[q as usize].local))
        .collect();
    let qps: Vec<QpPlan> = kept.iter().map(|&q| plan.qps[q as usize]).collect();
    let stripe_width = plan.stripe_width.min(qps.len() as u32).max(1);
    (
        ConnPlan {
            qps,
            stripe_width,
            ..plan.clone()
        },
        kept,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(slot: u8, slice: u8, slices: u8, use_count: u16) -> ImmTag {
        ImmTag {
            slot,
            slice,
            slices,
            use_count,
        }
    }

    #[test]
    fn tags_round_trip_through_the_immediate() {
        for t in [
            tag(0, 0, 1, 0),
            tag(255, 127, 128, 1023),
            tag(17, 3, 4, 512),
            tag(1, 0, 2, 1),
        ] {
            assert_eq!(ImmTag::decode(t.encode().unwrap()), t);
        }
        // Distinct tags give distinct immediates.
        let a = tag(1, 0, 2, 1).encode().unwrap();
        let b = tag(1, 1, 2, 1).encode().unwrap();
        let c = tag(1, 0, 2, 2).encode().unwrap();
        assert!(a != b && a != c && b != c);
        for bad in [
            tag(0, 0, 0, 0),
            tag(0, 2, 2, 0),
            tag(0, 0, 129, 0),
            tag(0, 0, 1, 1024),
        ] {
            assert!(bad.encode().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn receiver_counts_each_slice_once() {
        let mut a = Arrivals::new(4);
        a.expect(2, 7).unwrap();
        assert_eq!(
            a.record(tag(2, 1, 3, 7)).unwrap(),
            Arrival::Fresh { complete: false }
        );
        // Slice 1 written again on another QP after a failover: not counted.
        assert_eq!(a.record(tag(2, 1, 3, 7)).unwrap(), Arrival::Duplicate);
        assert_eq!(
            a.record(tag(2, 0, 3, 7)).unwrap(),
            Arrival::Fresh { complete: false }
        );
        assert_eq!(
            a.record(tag(2, 2, 3, 7)).unwrap(),
            Arrival::Fresh { complete: true }
        );
        assert_eq!(a.record(tag(2, 2, 3, 7)).unwrap(), Arrival::Duplicate);
        // A late duplicate of the previous use of the slot counts nothing once the next use is
        // expected; any older use is an error.
        a.expect(2, 8).unwrap();
        assert_eq!(a.record(tag(2, 0, 3, 7)).unwrap(), Arrival::Duplicate);
        assert!(a.record(tag(2, 0, 3, 6)).is_err());
        assert_eq!(a.word(2), record_word(8, 0));
        assert_eq!(a.word(3), 0);
        assert_eq!(
            a.record(tag(2, 0, 1, 8)).unwrap(),
            Arrival::Fresh { complete: true }
        );
        // Contradicting slice counts and unknown slots are errors.
        a.expect(0, 1).unwrap();
        a.record(tag(0, 0, 2, 1)).unwrap();
        assert!(a.record(tag(0, 1, 3, 1)).is_err());
        assert!(a.record(tag(9, 0, 1, 0)).is_err());
        assert!(a.expect(4, 0).is_err());
    }

    fn plan_on(ports: &[u32]) -> Vec<QpPlan> {
        ports
            .iter()
            .map(|&p| QpPlan {
                local: p,
                remote: p,
                weight: 1,
            })
            .collect()
    }

    #[test]
    fn surviving_plan_keeps_the_qps_of_the_named_ports() {
        let plan = ConnPlan {
            qps: plan_on(&[0, 1, 0, 1]),
            stripe_width: 4,
            align: 128,
            ar_threshold: 8192,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            reason: "r".into(),
            ..ConnPlan::default()
        };
        let (p, kept) = surviving_plan(&plan, &[1]);
        assert_eq!(kept, [1, 3]);
        assert_eq!(p.qps, plan_on(&[1, 1]));
        assert_eq!(p.stripe_width, 2);
        // Every message is still covered exactly once by the surviving QPs.
        for size in [0u64, 1, 128, 1000, 1 << 20] {
            let covered: u64 = p.stripes(size, 1).map(|s| s.len).sum();
            assert_eq!(covered, size);
        }
    }
}
