//! What a [`ConnPlan`] means for one message: the striping arithmetic the data path executes and
//! `ncclwasm policy explain` prints, so both can never disagree.
//!
//! A message of `size` bytes starting at the connection's rotating QP index `start` goes over
//! `stripe_width` consecutive QPs (wrapping around the QP list). QP `q` takes
//! `ceil(size * w_q / W)` bytes rounded up to `align`, where `W` is the sum of the weights of the
//! QPs in this stripe; because every share is rounded up, the last QPs may get less or nothing
//! (they are still posted, carrying zero bytes, as NCCL does). With equal weights this is exactly
//! NCCL's `DIVUP(DIVUP(size, nqps), 128) * 128` chunking (as `ncclIbMultiSend`).
//!
//! The data path calls this per message, so it allocates nothing: [`ConnPlan::stripes`] is an
//! iterator over the plan's own QP list.

use crate::{ConnPlan, PlanPatch, QpPlan};

/// One QP's part of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stripe {
    /// Index into [`ConnPlan::qps`].
    pub qp: u32,
    /// Where this part starts in the message (clamped to the message size).
    pub offset: u64,
    /// How many bytes it carries; 0 when earlier stripes already covered the message.
    pub len: u64,
}

impl ConnPlan {
    /// How many QPs one message is striped over: `stripe_width`, at most the number of QPs (a
    /// QP is never used twice for one message), 0 only for a plan without QPs.
    pub fn stripe_count(&self) -> usize {
        (self.stripe_width.max(1) as usize).min(self.qps.len())
    }

    /// The stripes of a `size`-byte message starting at rotating QP index `start`.
    pub fn stripes(&self, size: u64, start: u32) -> Stripes<'_> {
        let count = self.stripe_count();
        let start = if self.qps.is_empty() {
            0
        } else {
            start as usize % self.qps.len()
        };
        let total_weight = (0..count)
            .map(|i| weight(&self.qps[wrap(start + i, self.qps.len())]))
            .sum();
        Stripes {
            qps: &self.qps,
            start,
            count,
            next: 0,
            size,
            offset: 0,
            total_weight,
            align: u64::from(self.align.max(1)),
        }
    }

    /// The rotating start index of the message after one that started at `start`: every QP a
    /// message used advances it by one, as NCCL's `qpIndex` does.
    pub fn next_start(&self, start: u32) -> u32 {
        if self.qps.is_empty() {
            return 0;
        }
        ((start as usize + self.stripe_count()) % self.qps.len()) as u32
    }
}

/// `i % len` for an `i` below `2 × len` (a start inside the list plus at most one lap): the
/// data path lays out every message with this, and a division costs more than the rest.
fn wrap(i: usize, len: usize) -> usize {
    if i >= len { i - len } else { i }
}

/// A zero weight (refused by validation) counts as 1 so the arithmetic never divides by zero.
fn weight(qp: &QpPlan) -> u64 {
    u64::from(qp.weight.max(1))
}

/// Iterator over the [`Stripe`]s of one message; see [`ConnPlan::stripes`].
#[derive(Clone, Debug)]
pub struct Stripes<'a> {
    qps: &'a [QpPlan],
    start: usize,
    count: usize,
    next: usize,
    size: u64,
    /// Sum of the chunks handed out so far (may exceed `size`: chunks are rounded up).
    offset: u64,
    total_weight: u64,
    align: u64,
}

impl Iterator for Stripes<'_> {
    type Item = Stripe;

    fn next(&mut self) -> Option<Stripe> {
        if self.next == self.count {
            return None;
        }
        let qp = wrap(self.start + self.next, self.qps.len());
        self.next += 1;
        let chunk = if self.count == 1 {
            // The whole message: no share to compute (this runs for every message).
            self.size
        } else {
            let share = (u128::from(self.size) * u128::from(weight(&self.qps[qp])))
                .div_ceil(u128::from(self.total_weight));
            let align = u128::from(self.align);
            u64::try_from(share.div_ceil(align) * align).unwrap_or(u64::MAX)
        };
        let offset = self.offset.min(self.size);
        let len = chunk.min(self.size - offset);
        self.offset = self.offset.saturating_add(chunk);
        Some(Stripe {
            qp: qp as u32,
            offset,
            len,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.count - self.next;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Stripes<'_> {}

impl PlanPatch {
    /// The plan a policy's patch makes of the built-in `base`: each `Some` field replaces the
    /// base's, each `None` keeps it. The reason says what the policy changed and why, then why the
    /// rest is what it is, since `explain` and the INFO log show only this one string.
    pub fn apply(self, base: ConnPlan) -> ConnPlan {
        let why = if self.reason.is_empty() {
            "no reason given".to_owned()
        } else {
            self.reason.clone()
        };
        let (plan, changed) = self.overlay(base);
        let reason = if changed.is_empty() {
            return plan;
        } else if changed.len() == ConnPlan::FIELDS.len() {
            // Nothing is left to the built-in default, so its reason would only repeat.
            format!("policy set every field: {why}")
        } else {
            format!(
                "policy set {}: {why}; built-in default for the rest: {}",
                changed.join(", "),
                plan.reason
            )
        };
        ConnPlan { reason, ..plan }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(weights: &[u32], stripe_width: u32, align: u32) -> ConnPlan {
        ConnPlan {
            qps: weights
                .iter()
                .enumerate()
                .map(|(i, &weight)| QpPlan {
                    local: i as u32,
                    remote: i as u32,
                    weight,
                })
                .collect(),
            stripe_width,
            align,
            ar_threshold: 8192,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            reason: "default".into(),
            ..ConnPlan::default()
        }
    }

    /// `ncclIbMultiSend`'s loop, written out independently: every QP gets the same chunk,
    /// `DIVUP(DIVUP(size, nqps), 128) * 128`, clipped to what is left.
    fn nccl_lengths(size: u64, nqps: u64) -> Vec<u64> {
        let chunk = size.div_ceil(nqps).div_ceil(128) * 128;
        let mut sent = 0u64;
        (0..nqps)
            .map(|_| {
                let len = chunk.min(size.saturating_sub(sent));
                sent += chunk;
                len
            })
            .collect()
    }

    #[test]
    fn equal_weights_reproduce_nccl_chunking_exactly() {
        let sizes = (0..4200u64).chain([
            65_535,
            65_536,
            1 << 20,
            (1 << 20) + 1,
            3 << 30,
            u64::from(u32::MAX),
        ]);
        for size in sizes {
            for n in 1..=8u32 {
                let p = plan(&vec![1; n as usize], n, 128);
                let got: Vec<u64> = p.stripes(size, 0).map(|s| s.len).collect();
                assert_eq!(
                    got,
                    nccl_lengths(size, u64::from(n)),
                    "size {size}, {n} QPs"
                );
            }
        }
    }

    #[test]
    fn weighted_shares_and_offsets() {
        let p = plan(&[1, 3], 2, 128);
        let s: Vec<Stripe> = p.stripes(1024, 0).collect();
        assert_eq!(
            s,
            [
                Stripe {
                    qp: 0,
                    offset: 0,
                    len: 256
                },
                Stripe {
                    qp: 1,
                    offset: 256,
                    len: 768
                }
            ]
        );
        // ceil(1000 * 1/4) = 250 -> 256; ceil(1000 * 3/4) = 750 -> 768, clipped to 744.
        let lens: Vec<u64> = p.stripes(1000, 0).map(|s| s.len).collect();
        assert_eq!(lens, [256, 744]);
        // Weights of QPs outside the stripe do not count: [1, 3, 4] with width 2 from QP 1.
        let p = plan(&[1, 3, 4], 2, 1);
        let s: Vec<(u32, u64)> = p.stripes(700, 1).map(|s| (s.qp, s.len)).collect();
        assert_eq!(s, [(1, 300), (2, 400)]);
    }

    #[test]
    fn small_messages_leave_later_stripes_empty() {
        let p = plan(&[1, 1, 1, 1], 4, 128);
        let s: Vec<Stripe> = p.stripes(100, 2).collect();
        assert_eq!(
            s,
            [
                Stripe {
                    qp: 2,
                    offset: 0,
                    len: 100
                },
                Stripe {
                    qp: 3,
                    offset: 100,
                    len: 0
                },
                Stripe {
                    qp: 0,
                    offset: 100,
                    len: 0
                },
                Stripe {
                    qp: 1,
                    offset: 100,
                    len: 0
                },
            ]
        );
    }

    #[test]
    fn stripes_always_cover_the_message_exactly_once() {
        for weights in [&[1u32][..], &[2, 1], &[5, 1, 1], &[1, 7, 3, 2, 9]] {
            for width in 1..=weights.len() as u32 {
                for align in [1, 64, 128, 4096] {
                    let p = plan(weights, width, align);
                    for size in [0u64, 1, 127, 128, 129, 4095, 10_000, 1 << 22] {
                        for start in 0..weights.len() as u32 {
                            let mut expect = 0;
                            for s in p.stripes(size, start) {
                                assert_eq!(s.offset, expect.min(size));
                                assert!(s.len == 0 || s.offset % u64::from(align) == 0);
                                expect = s.offset + s.len;
                            }
                            assert_eq!(expect, size, "{weights:?} w{width} a{align} s{size}");
                            assert_eq!(p.stripes(size, start).len(), width as usize);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rotation_wraps_and_advances_by_the_stripe_count() {
        let p = plan(&[1, 1, 1, 1], 2, 128);
        let qps: Vec<u32> = p.stripes(4096, 3).map(|s| s.qp).collect();
        assert_eq!(qps, [3, 0]);
        assert_eq!(p.next_start(3), 1);
        assert_eq!(p.next_start(7), 1, "start is taken modulo the QP count");
        // A width larger than the QP list uses each QP once.
        let wide = plan(&[1, 1], 5, 128);
        assert_eq!(wide.stripe_count(), 2);
        assert_eq!(wide.next_start(1), 1);
        let empty = plan(&[], 2, 128);
        assert_eq!(empty.stripes(100, 3).count(), 0);
        assert_eq!(empty.next_start(3), 0);
    }

    #[test]
    fn patch_keeps_base_for_none_and_combines_reasons() {
        let base = plan(&[1, 1], 2, 128);
        let same = PlanPatch::default().apply(base.clone());
        assert_eq!(same, base);
        let patched = PlanPatch {
            tc: Some(106),
            sl: Some(3),
            reason: "storage traffic class".into(),
            ..PlanPatch::default()
        }
        .apply(base.clone());
        assert_eq!((patched.tc, patched.sl, patched.fifo_tc), (106, 3, 0));
        assert_eq!(patched.qps, base.qps);
        assert_eq!(
            patched.reason,
            "policy set tc, sl: storage traffic class; built-in default for the rest: default"
        );
        let qps = vec![QpPlan {
            local: 0,
            remote: 1,
            weight: 2,
        }];
        let patched = PlanPatch {
            qps: Some(qps.clone()),
            ..PlanPatch::default()
        }
        .apply(base.clone());
        assert_eq!(patched.qps, qps);
        assert!(
            patched
                .reason
                .starts_with("policy set qps: no reason given")
        );
        // A whole plan leaves nothing to the built-in default: its reason is not repeated.
        let whole = PlanPatch::from(ConnPlan {
            reason: "all mine".into(),
            ..base.clone()
        })
        .apply(base);
        assert_eq!(whole.reason, "policy set every field: all mine");
        assert_eq!(ConnPlan::FIELDS.len(), 11);
    }
}
