//! Rail failover on the data path: the pure part, and the design the transport is to follow.
//!
//! # What is decided elsewhere
//! When a port of a connection's vNIC goes down (an async port event, or a QP on it completing
//! with a fatal status), the transport asks the policy (`on-port-event`, `PolicyHost::on_port_event`)
//! and gets a checked answer: `move-to` named surviving ports, `wait` (at most 10 s) for the port
//! to return, or `fail`; when the port comes back, `fail-back` or `stay`. This module is about
//! carrying a `move-to` out without losing or duplicating a byte, and without failing a request.
//!
//! # The design
//! RDMA writes are idempotent: writing the same bytes to the same remote address twice leaves
//! the same memory. So a slice (the part of one message one QP carries) may safely be written
//! again on another QP. What must happen exactly once is what the receiver *counts*: the
//! WRITE_WITH_IMM completion that tells it a slice has landed. Hence:
//!
//! 1. **Tagged immediates.** Today the immediate carries the message size and the receiver pairs
//!    completions with requests by the rotation both sides walk. In failover mode the immediate
//!    carries an [`ImmTag`] instead — the FIFO slot, the slice index, the number of slices of the
//!    message and a few bits of the slot's use count — and the size travels in the sizes row, as
//!    it already does for multi-receives. The receiver then needs no rotation to know what a
//!    completion is for: it can take it on any QP.
//! 2. **Receiver counts distinct slices.** [`Arrivals`] keeps, per slot, which slices landed;
//!    a repeated tag is a duplicate (the slice was written twice) and is ignored, except that it
//!    consumed a receive work request, which the receiver re-posts. A slot's receive completes
//!    when all its slices arrived, whichever QPs carried them.
//! 3. **Sender re-posts what it cannot prove arrived.** In failover mode every slice's write is
//!    signalled, so a success completion proves that slice landed (RC: the responder acknowledged
//!    it). On a failed QP, [`replay`] lists the slices of every in-flight slot that have no success
//!    completion, and assigns each to a QP on the ports the policy named; the sender posts them
//!    there with the same tag. A slice that had in fact landed before the failure arrives twice
//!    and is dropped by step 2.
//! 4. **Receiver side of the move.** The receiver's RQ on the failed QP is gone with the QP: it
//!    keeps the RQs of the surviving QPs topped up (receives are anonymous in failover mode) and
//!    re-writes its outstanding CTS FIFO entries through a surviving QP (FIFO writes are
//!    idempotent too: same entry, same slot).
//! 5. **New messages** are striped over the QPs of the surviving ports only ([`surviving_plan`]);
//!    after `fail-back`, over the whole plan again, once the failed port's QPs were re-created and
//!    re-connected through the handshake socket (the QP itself went to the error state).
//!
//! The sender learns what the receiver has by completions alone (step 3), without the RDMA READ
//! probe NCCL 2.30 uses: the price is one completion per slice instead of one per message while
//! failover is enabled, which the built-in default (`NCCL_IB_RESILIENCY_PORT_FAILOVER=0`) never
//! pays.
//!
//! # What exists
//! The pure parts of steps 1, 2, 3 and 5, tested here. The transport does not use them yet: a
//! port failure still fails the connection (as NCCL's default does), whatever the policy answers.
//! Remaining: the failover-mode posting in `datapath` (signalled slices, tags, anonymous
//! receives), the transport's event routing to the owning connection and its call of
//! `on_port_event`, the re-post and FIFO rewrite, QP re-creation for fail-back, soft fault
//! injection of a port up/down during traffic, counters and INFO lines, and the end-to-end test.

use ncclwasm_model::{ConnPlan, QpPlan};

use crate::MAX_QPS;
use crate::error::ProtoError;

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
        Ok(u32::from(self.slot)
            | u32::from(self.slice) << SLOT_BITS
            | u32::from(self.slices - 1) << (SLOT_BITS + SLICE_BITS)
            | u32::from(self.use_count) << (SLOT_BITS + SLICE_BITS + COUNT_BITS))
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
    seen: u128,
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
            ..SlotArrivals::default()
        };
        Ok(())
    }

    /// Count one tagged completion. A tag for a slot not posted, for another use of the slot,
    /// or whose slice count disagrees with the message's earlier slices is a protocol error
    /// (the peer is broken or hostile), never silently counted.
    pub fn record(&mut self, tag: ImmTag) -> Result<Arrival, ProtoError> {
        let s = self.slot_mut(usize::from(tag.slot))?;
        let bad = |why: &str| ProtoError::Bookkeeping {
            detail: format!("a completion tagged {tag:?} {why}"),
        };
        if tag.use_count != s.use_count {
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
        if tag.slice >= tag.slices {
            return Err(bad("names a slice beyond the message"));
        }
        s.slices = tag.slices;
        let bit = 1u128 << tag.slice;
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

/// One slice of an in-flight message as the sender posted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedSlice {
    pub tag: ImmTag,
    /// The plan QP index it was posted on.
    pub qp: u32,
    /// Whether its success completion was polled: then it landed, whatever happens next.
    pub acked: bool,
}

/// A slice to post again, with its original tag, on plan QP `qp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repost {
    pub tag: ImmTag,
    pub qp: u32,
}

/// The slices to post again after the QPs on local port `failed` failed: every unacknowledged
/// slice posted on such a QP, assigned in turn to the QPs of `plan` on the ports `to` (a
/// checked `move-to` answer). Acknowledged slices and slices in flight on healthy QPs are left
/// alone: the former landed, the latter will complete where they are.
pub fn replay(
    plan: &[QpPlan],
    failed: u32,
    to: &[u32],
    posted: &[PostedSlice],
) -> Result<Vec<Repost>, ProtoError> {
    let targets: Vec<u32> = (0..plan.len() as u32)
        .filter(|&q| to.contains(&plan[q as usize].local) && plan[q as usize].local != failed)
        .collect();
    let on_failed = |s: &PostedSlice| plan.get(s.qp as usize).is_some_and(|q| q.local == failed);
    let lost: Vec<&PostedSlice> = posted.iter().filter(|s| !s.acked && on_failed(s)).collect();
    if lost.is_empty() {
        return Ok(Vec::new());
    }
    if targets.is_empty() {
        return Err(ProtoError::Bookkeeping {
            detail: format!(
                "no QP of the plan is on the ports {to:?} to move port {failed}'s traffic to"
            ),
        });
    }
    Ok(lost
        .iter()
        .zip(targets.iter().cycle())
        .map(|(s, &qp)| Repost { tag: s.tag, qp })
        .collect())
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
        // A late duplicate of the previous use of the slot is refused once the next is expected.
        a.expect(2, 8).unwrap();
        assert!(a.record(tag(2, 0, 3, 7)).is_err());
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
    fn replay_reposts_only_unacknowledged_slices_of_the_failed_port() {
        // QPs 0 and 2 on port 0, QPs 1 and 3 on port 1.
        let plan = plan_on(&[0, 1, 0, 1]);
        let posted = [
            PostedSlice {
                tag: tag(0, 0, 2, 1),
                qp: 0,
                acked: true,
            },
            PostedSlice {
                tag: tag(0, 1, 2, 1),
                qp: 1,
                acked: false,
            },
            PostedSlice {
                tag: tag(1, 0, 2, 1),
                qp: 2,
                acked: false,
            },
            PostedSlice {
                tag: tag(1, 1, 2, 1),
                qp: 3,
                acked: false,
            },
            PostedSlice {
                tag: tag(2, 0, 1, 1),
                qp: 0,
                acked: false,
            },
        ];
        let r = replay(&plan, 0, &[1], &posted).unwrap();
        assert_eq!(
            r,
            [
                Repost {
                    tag: tag(1, 0, 2, 1),
                    qp: 1
                },
                Repost {
                    tag: tag(2, 0, 1, 1),
                    qp: 3
                },
            ]
        );
        // Nothing lost: nothing to do, even with nowhere to go.
        assert!(replay(&plan, 1, &[], &posted[..1]).unwrap().is_empty());
        // Lost slices but no QP on the named ports: an error, not a silent drop.
        assert!(replay(&plan_on(&[0, 0, 2]), 0, &[1], &posted).is_err());
    }

    #[test]
    fn surviving_plan_keeps_the_qps_of_the_named_ports() {
        let plan = ConnPlan {
            qps: plan_on(&[0, 1, 0, 1]),
            stripe_width: 4,
            align: 128,
            adaptive_routing: false,
            ar_threshold: 8192,
            tc: 0,
            sl: 0,
            fifo_tc: 0,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            reason: "r".into(),
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
