//! Requests: the fixed pool, their indices in `wr_id`, and completion accounting.
//!
//! A communicator owns [`MAX_REQUESTS`] request slots, allocated once when it is created; taking
//! and returning a slot is a push/pop on a preallocated free list, so the hot path never
//! allocates. A request is done when every completion it expects has arrived: each work request
//! it is part of adds one expected completion on the device (endpoint) whose completion queue
//! will report it, and each completion polled from that queue takes one away, as the per-device
//! `events` counters of `ncclIbRequest`/`ncclIbTest` do.
//!
//! Request indices travel in `wr_id`: one byte per request. A receive, CTS or flush work request
//! carries its single request; the final signalled write of a send slot carries every request the
//! slot's multi-send served (up to [`MAX_RECVS`], 8 bits each), so one completion settles all of
//! them (`ncclIbMultiSend`).

use super::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};
use crate::error::ProtoError;

/// A request's index in its communicator's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReqId(u8);

impl ReqId {
    /// The index, for the shell's side tables (buffers, memory handles) sized [`MAX_REQUESTS`].
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// The request at `index` of the pool, e.g. recovered from the address of the shell's
    /// record for it when NCCL hands a request back to `test`.
    pub fn from_index(index: usize) -> Result<Self, ProtoError> {
        u8::try_from(index)
            .map(ReqId)
            .map_err(|_| ProtoError::Bookkeeping {
                detail: format!("request index {index} is outside the pool of {MAX_REQUESTS}"),
            })
    }
}

/// Packs up to [`MAX_RECVS`] request indices into a `wr_id`, the `r`-th in byte `r`; indices
/// beyond the eighth are ignored.
pub fn encode_wr_id(ids: impl IntoIterator<Item = ReqId>) -> u64 {
    ids.into_iter()
        .take(MAX_RECVS)
        .enumerate()
        .fold(0, |acc, (r, id)| acc | (u64::from(id.0) << (8 * r)))
}

/// The `r`-th request index packed in a `wr_id`.
pub fn wr_id_request(wr_id: u64, r: usize) -> ReqId {
    ReqId((wr_id >> (8 * r)) as u8)
}

/// What a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestKind {
    Send,
    Recv,
    Flush,
}

/// A set of endpoint indices (bit `d` = endpoint `d`): the devices whose completion queues a
/// request still waits on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceSet(u8);

impl DeviceSet {
    pub fn contains(self, device: usize) -> bool {
        device < MAX_ENDPOINTS && self.0 & (1 << device) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = usize> {
        (0..MAX_ENDPOINTS).filter(move |&d| self.contains(d))
    }
}

/// What a polled work completion (with success status) says, as far as bookkeeping goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A signalled send-queue work request finished: a data write, a CTS write or a flush read.
    Send { wr_id: u64 },
    /// A WRITE_WITH_IMM consumed a posted receive (`IBV_WC_RECV_RDMA_WITH_IMM`).
    RecvWithImm { wr_id: u64, imm: u32 },
}

/// Where a finished receive's sizes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvSizes {
    /// A single receive: the size came as the immediate value.
    Immediate(u32),
    /// A multi-receive: the sender wrote the n sizes into this row of the sizes FIFO.
    SizesFifo { slot: usize },
}

/// A request that completed; its slot is free again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// The send's size after truncation to the posted receive (what `test` reports).
    Send {
        size: u64,
    },
    Recv {
        n: usize,
        sizes: RecvSizes,
    },
    Flush,
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    kind: Option<RequestKind>,
    /// Requests grouped with this one: receives of the `irecv`, or sends of the slot.
    nreqs: u8,
    /// Completions still expected, per endpoint.
    events: [u16; MAX_ENDPOINTS],
    /// Send: size after truncation. Receive of one: the immediate size once it arrived.
    size: u64,
    /// Receive: the FIFO slot, where a multi-receive's sizes land.
    fifo_slot: u16,
    /// Receive: the sizes are in the sizes FIFO even for a single receive (a connection
    /// prepared for failover carries a tag in the immediate instead).
    sizes_in_fifo: bool,
}

/// The requests of one communicator.
#[derive(Debug)]
pub struct RequestPool {
    slots: Vec<Slot>,
    /// Free indices, popped from the end.
    free: Vec<u8>,
}

impl Default for RequestPool {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestPool {
    /// All [`MAX_REQUESTS`] slots free; the only allocation the pool ever makes.
    pub fn new() -> Self {
        RequestPool {
            slots: vec![Slot::default(); MAX_REQUESTS],
            free: (0..MAX_REQUESTS).rev().map(|i| i as u8).collect(),
        }
    }

    /// Requests currently in flight.
    pub fn in_flight(&self) -> usize {
        MAX_REQUESTS - self.free.len()
    }

    /// Takes a free slot (`ncclIbGetRequest`).
    pub(crate) fn alloc(&mut self, kind: RequestKind, nreqs: usize) -> Result<ReqId, ProtoError> {
        let i = self.free.pop().ok_or(ProtoError::RequestsExhausted {
            capacity: MAX_REQUESTS,
        })?;
        self.slots[usize::from(i)] = Slot {
            kind: Some(kind),
            nreqs: nreqs as u8,
            ..Slot::default()
        };
        Ok(ReqId(i))
    }

    /// One more completion expected on `device`.
    pub(crate) fn expect(&mut self, id: ReqId, device: usize) {
        self.slots[id.index()].events[device] += 1;
    }

    pub(crate) fn set_size(&mut self, id: ReqId, size: u64) {
        self.slots[id.index()].size = size;
    }

    pub(crate) fn set_fifo_slot(&mut self, id: ReqId, slot: usize) {
        self.slots[id.index()].fifo_slot = slot as u16;
    }

    pub(crate) fn set_sizes_in_fifo(&mut self, id: ReqId) {
        self.slots[id.index()].sizes_in_fifo = true;
    }

    fn live(&self, id: ReqId, what: &str) -> Result<&Slot, ProtoError> {
        let s = &self.slots[id.index()];
        match s.kind {
            Some(_) => Ok(s),
            None => Err(ProtoError::Bookkeeping {
                detail: format!(
                    "{what} names request {}, which is not in flight",
                    id.index()
                ),
            }),
        }
    }

    /// The endpoints whose completion queues `id` still waits on; the shell polls those.
    pub fn awaiting(&self, id: ReqId) -> Result<DeviceSet, ProtoError> {
        let s = self.live(id, "awaiting")?;
        let bits = s.events.iter().enumerate().filter(|&(_, &e)| e > 0);
        Ok(DeviceSet(bits.fold(0, |acc, (d, _)| acc | (1 << d))))
    }

    pub(crate) fn settle(
        &mut self,
        id: ReqId,
        device: usize,
        wr_id: u64,
    ) -> Result<(), ProtoError> {
        let e = &mut self.slots[id.index()].events[device];
        if *e == 0 {
            return Err(ProtoError::Bookkeeping {
                detail: format!(
                    "completion wr_id {wr_id:#x} on device {device} for request {}, which expects none there",
                    id.index()
                ),
            });
        }
        *e -= 1;
        Ok(())
    }

    /// Accounts one successful completion polled from `device`'s completion queue, following
    /// `ncclIbTest`: a send completion settles every request packed in its `wr_id` (their count
    /// is the first one's `nreqs`); any other completion settles its one request, and a
    /// receive's immediate value is its size when it is a single receive. Failed completions
    /// never get here: the shell reports them as errors of the connection.
    pub fn complete(&mut self, device: usize, c: Completion) -> Result<(), ProtoError> {
        let bad = |detail: String| Err(ProtoError::Bookkeeping { detail });
        if device >= MAX_ENDPOINTS {
            return bad(format!(
                "completion from device {device}; there are at most {MAX_ENDPOINTS}"
            ));
        }
        let wr_id = match c {
            Completion::Send { wr_id } | Completion::RecvWithImm { wr_id, .. } => wr_id,
        };
        let first = wr_id_request(wr_id, 0);
        let slot = *self.live(first, "a completion")?;
        match (slot.kind, c) {
            (Some(RequestKind::Send), Completion::Send { .. }) => {
                let n = usize::from(slot.nreqs);
                if n < 8 && wr_id >> (8 * n) != 0 {
                    return bad(format!(
                        "send wr_id {wr_id:#x} packs more than {n} request(s)"
                    ));
                }
                for r in 0..n {
                    let id = wr_id_request(wr_id, r);
                    if self.live(id, "a send completion")?.kind != Some(RequestKind::Send) {
                        return bad(format!("send wr_id {wr_id:#x} names a non-send request"));
                    }
                    self.settle(id, device, wr_id)?;
                }
                Ok(())
            }
            (Some(RequestKind::Send), Completion::RecvWithImm { .. }) => bad(format!(
                "receive completion wr_id {wr_id:#x} for a send request"
            )),
            (_, _) if wr_id > 0xff => {
                bad(format!("wr_id {wr_id:#x} packs several non-send requests"))
            }
            (Some(RequestKind::Recv), Completion::RecvWithImm { imm, .. }) => {
                if slot.nreqs == 1 {
                    self.slots[first.index()].size = u64::from(imm);
                }
                self.settle(first, device, wr_id)
            }
            (_, Completion::RecvWithImm { .. }) => bad(format!(
                "receive completion wr_id {wr_id:#x} for a flush request"
            )),
            (_, Completion::Send { .. }) => self.settle(first, device, wr_id),
        }
    }

    /// `test`: when every expected completion arrived, frees the request and says what it did;
    /// otherwise `None` (poll the devices in [`awaiting`](Self::awaiting) and test again).
    pub fn test(&mut self, id: ReqId) -> Result<Option<Finished>, ProtoError> {
        let s = *self.live(id, "test")?;
        if s.events.iter().any(|&e| e > 0) {
            return Ok(None);
        }
        let done = match s.kind {
            Some(RequestKind::Send) => Finished::Send { size: s.size },
            Some(RequestKind::Recv) => Finished::Recv {
                n: usize::from(s.nreqs),
                sizes: if s.nreqs == 1 && !s.sizes_in_fifo {
                    RecvSizes::Immediate(s.size as u32)
                } else {
                    RecvSizes::SizesFifo {
                        slot: usize::from(s.fifo_slot),
                    }
                },
            },
            _ => Finished::Flush,
        };
        self.slots[id.index()].kind = None;
        self.free.push(id.0);
        Ok(Some(done))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_id_packs_eight_indices() {
        let ids: Vec<ReqId> = [0u8, 255, 7, 128, 1, 2, 3, 254].map(ReqId).to_vec();
        let w = encode_wr_id(ids.iter().copied());
        for (r, id) in ids.iter().enumerate() {
            assert_eq!(wr_id_request(w, r), *id);
        }
        assert_eq!(encode_wr_id([ReqId(5)]), 5);
        assert_eq!(encode_wr_id([ReqId(1), ReqId(2)]), 0x0201);
    }

    #[test]
    fn indices_convert_both_ways() {
        for i in 0..MAX_REQUESTS {
            assert_eq!(ReqId::from_index(i).unwrap().index(), i);
        }
        assert!(ReqId::from_index(MAX_REQUESTS).is_err());
    }

    #[test]
    fn pool_holds_exactly_32_times_8() {
        let mut pool = RequestPool::new();
        let ids: Vec<ReqId> = (0..MAX_REQUESTS)
            .map(|_| pool.alloc(RequestKind::Flush, 1).unwrap())
            .collect();
        assert_eq!(pool.in_flight(), 256);
        assert!(matches!(
            pool.alloc(RequestKind::Flush, 1),
            Err(ProtoError::RequestsExhausted { capacity: 256 })
        ));
        // No events expected: each tests done at once and frees its slot.
        for id in ids {
            assert_eq!(pool.test(id).unwrap(), Some(Finished::Flush));
        }
        assert_eq!(pool.in_flight(), 0);
        assert!(
            pool.test(ReqId(3)).is_err(),
            "a freed request cannot be tested again"
        );
    }

    #[test]
    fn multi_send_completion_settles_every_packed_request() {
        let mut pool = RequestPool::new();
        let a = pool.alloc(RequestKind::Send, 2).unwrap();
        let b = pool.alloc(RequestKind::Send, 2).unwrap();
        for id in [a, b] {
            pool.expect(id, 0);
            pool.expect(id, 1);
        }
        pool.set_size(b, 77);
        let w = encode_wr_id([a, b]);
        pool.complete(1, Completion::Send { wr_id: w }).unwrap();
        assert_eq!(
            pool.awaiting(a).unwrap().iter().collect::<Vec<_>>(),
            vec![0]
        );
        assert_eq!(pool.test(b).unwrap(), None);
        pool.complete(0, Completion::Send { wr_id: w }).unwrap();
        assert!(pool.awaiting(b).unwrap().is_empty());
        assert_eq!(pool.test(b).unwrap(), Some(Finished::Send { size: 77 }));
        assert_eq!(pool.test(a).unwrap(), Some(Finished::Send { size: 0 }));
        // A further completion is a bookkeeping error, not a panic.
        assert!(pool.complete(0, Completion::Send { wr_id: w }).is_err());
    }

    #[test]
    fn receive_takes_its_size_from_the_immediate() {
        let mut pool = RequestPool::new();
        let one = pool.alloc(RequestKind::Recv, 1).unwrap();
        pool.expect(one, 2);
        pool.expect(one, 2);
        pool.complete(
            2,
            Completion::RecvWithImm {
                wr_id: encode_wr_id([one]),
                imm: 4096,
            },
        )
        .unwrap();
        assert_eq!(pool.test(one).unwrap(), None);
        pool.complete(
            2,
            Completion::RecvWithImm {
                wr_id: encode_wr_id([one]),
                imm: 4096,
            },
        )
        .unwrap();
        let done = pool.test(one).unwrap().unwrap();
        assert_eq!(
            done,
            Finished::Recv {
                n: 1,
                sizes: RecvSizes::Immediate(4096)
            }
        );

        let multi = pool.alloc(RequestKind::Recv, 3).unwrap();
        pool.set_fifo_slot(multi, 17);
        pool.expect(multi, 0);
        pool.complete(
            0,
            Completion::RecvWithImm {
                wr_id: encode_wr_id([multi]),
                imm: 0,
            },
        )
        .unwrap();
        let done = pool.test(multi).unwrap().unwrap();
        assert_eq!(
            done,
            Finished::Recv {
                n: 3,
                sizes: RecvSizes::SizesFifo { slot: 17 }
            }
        );
    }

    #[test]
    fn inconsistent_completions_are_errors() {
        let mut pool = RequestPool::new();
        let send = pool.alloc(RequestKind::Send, 1).unwrap();
        let flush = pool.alloc(RequestKind::Flush, 1).unwrap();
        pool.expect(send, 0);
        pool.expect(flush, 0);
        let imm = |wr_id| Completion::RecvWithImm { wr_id, imm: 1 };
        assert!(pool.complete(0, imm(u64::from(send.0))).is_err());
        assert!(pool.complete(0, imm(u64::from(flush.0))).is_err());
        assert!(
            pool.complete(
                1,
                Completion::Send {
                    wr_id: u64::from(flush.0)
                }
            )
            .is_err()
        );
        assert!(
            pool.complete(
                9,
                Completion::Send {
                    wr_id: u64::from(flush.0)
                }
            )
            .is_err()
        );
        assert!(
            pool.complete(0, Completion::Send { wr_id: 200 }).is_err(),
            "free request"
        );
        // A send wr_id that packs a second (free) request while the first says nreqs = 1.
        let w = encode_wr_id([send, ReqId(99)]);
        assert!(pool.complete(0, Completion::Send { wr_id: w }).is_err());
        pool.complete(
            0,
            Completion::Send {
                wr_id: u64::from(flush.0),
            },
        )
        .unwrap();
        assert_eq!(pool.test(flush).unwrap(), Some(Finished::Flush));
    }
}
