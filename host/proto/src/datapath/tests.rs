//! The data path over a simulated RC fabric ([`Wire`]): bytes, sizes, striping, work request
//! chains, FIFO wrap-around, limits. The failover runs are in `tests/failover.rs`.

use std::collections::VecDeque;

use super::*;
use crate::failover::CTS_WR_ID;
use crate::fifo::{ARRIVALS_OFFSET, CTS_FIFO_BYTES, CtsEntry, SIZES_SLOT_BYTES};
use crate::handshake::tests::{acceptor, connector, run_pair};
use crate::handshake::{RecvSetup, SendSetup};
use crate::message::tests::plan;
use crate::request::{Completion, Finished, RecvSizes, ReqId, encode_wr_id};
use crate::{MAX_MESSAGE_BYTES, MAX_QPS, MAX_RECVS, MAX_REQUESTS};

mod failover;

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
        let cts = post.cts.expect("a CTS write");
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

/// A peer that rewrites a slot after one of its receives was matched (here: shrinks that receive
/// to 0 bytes under a send already sized to it) is refused, rather than have the sender write
/// outside the buffer the receiver announced (found by the `cts` fuzz target).
#[test]
fn a_slot_rewritten_after_a_match_is_refused() {
    let mut w = Wire::new(rails, false);
    w.irecv(&[(0, 100, 1), (100, 100, 2)]).unwrap();
    w.isend(0, 100, 1).unwrap().unwrap();
    let slot = w.tx.head().slot();
    w.cts[slot][0].size = 0;
    let err = w.isend(0, 10, 2).unwrap_err();
    assert!(matches!(err, ProtoError::BadCts { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("the slot changed after a send matched"),
        "{err}"
    );
    assert!(w.posted.is_empty(), "nothing written");
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
        let (req, cts) = (post.req, post.cts.expect("a CTS write"));
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
