//! A connection prepared for failover over the simulated fabric: a port lost with slices in
//! every state, and the receiver's CTS rewrite.

use super::*;

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

    /// A prepared wire with QPs 0 and 2 on port 0, 1 and 3 on port 1 (stripes of 2), and `n`
    /// messages of `len` bytes received and sent (message `k` from and to offset `k * len`),
    /// each still held by the fabric.
    fn four_qps_streaming(n: u64, len: u64) -> (Wire, Vec<ReqId>, Vec<ReqId>) {
        fn four(_: &ncclwasm_model::Connection) -> ConnPlan {
            plan(&[(0, 0, 1), (1, 1, 1), (0, 0, 1), (1, 1, 1)], 2)
        }
        let mut w = Wire::prepared(four);
        let mut recvs = Vec::new();
        let mut sends = Vec::new();
        for k in 0..n {
            recvs.push(w.irecv(&[(k * len, len, 7)]).unwrap());
            sends.push(w.isend(k * len, len, 7).unwrap().unwrap());
        }
        (w, recvs, sends)
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

    /// Receive `k` of `recvs` completed once, with the `len` bytes sent from `k * len`.
    fn received_once(&mut self, recvs: &[ReqId], len: u64) {
        for (k, &r) in recvs.iter().enumerate() {
            assert_eq!(self.recv_sizes(r), [len], "receive {k}");
            let at = k as u64 * len;
            assert_eq!(self.received(at, len), self.sent(at, len), "bytes of {k}");
            assert!(self.rx.requests().test(r).is_err(), "completed twice");
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
    const N: u64 = 12;
    const LEN: u64 = 40_000;
    let (mut w, recvs, sends) = Wire::four_qps_streaming(N, LEN);
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
    w.received_once(&recvs, LEN);
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
/// through one surviving QP, which then carries every CTS write; once the last QP is lost too
/// (the sender holds its ports), CTS entries wait, and the first QP re-created carries them
/// all.
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
    assert_eq!(
        w.rx.qp_failed(1).unwrap(),
        [],
        "no QP left to write through"
    );
    assert_eq!(w.rx.cts_qp(), None);
    let stranded =
        w.rx.irecv(&[PostedRecv {
            addr: RECV_BASE + 300,
            size: 100,
            tag: 4,
            rkeys: [0; 8],
        }])
        .unwrap();
    assert!(stranded.cts.is_none(), "held back");
    let back = w.rx.qp_rejoined(1);
    assert_eq!(
        back.iter().map(|c| c.entries()[0].tag).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert!(back.iter().all(|c| c.qp == 1 && c.signaled));
    assert_eq!(w.rx.cts_qp(), Some(1));
    assert_eq!(w.rx.qp_rejoined(0), [], "written once");
    let _ = (a, b);
}

/// A `wait` answer holds port 0: nothing new starts while it is down and none of its traffic
/// crosses to port 1 (a probe over port 1 only confirms what landed); once its QPs are
/// re-created, the probe decides which of its slices landed, the others are written again on
/// their own QPs, and every receive completes once with its bytes.
#[test]
fn a_held_port_resumes_on_its_own_qps_and_loses_nothing() {
    const N: u64 = 8;
    const LEN: u64 = 40_000;
    let (mut w, recvs, sends) = Wire::four_qps_streaming(N, LEN);
    // Port 1 delivers everything. QP 0 lands 3 of its 4 chains, the receiver polls 2 of them,
    // the sender hears of 1; QP 2 lands nothing.
    w.deliver(1, N as usize);
    w.deliver(3, N as usize);
    w.deliver(0, 2);
    w.rx_poll();
    w.deliver(0, 1);
    let mut heard_on_0 = 0;
    w.acks.retain(|&(qp, _)| {
        heard_on_0 += usize::from(qp == 0);
        qp != 0 || heard_on_0 == 1
    });
    w.tx_poll();
    for q in [0, 2] {
        w.queued[q].clear();
    }
    w.tx.hold(0).unwrap();
    assert!(w.tx.failover().unwrap().is_held(0));
    // Held: nothing new starts. The probe runs over port 1 and confirms the chain the
    // receiver polled, but writes nothing of port 0's elsewhere.
    let extra = w.irecv(&[(N * LEN, LEN, 7)]).unwrap();
    assert!(w.isend(N * LEN, LEN, 7).unwrap().is_none());
    let (_, route) = w.tx.take_probe().unwrap();
    assert_eq!(route.local, 1);
    let words: [u64; MAX_REQUESTS] = w.records.clone().try_into().unwrap();
    assert_eq!(w.tx.probed(&words).unwrap(), []);
    assert!(
        w.tx.take_probe().is_none(),
        "nothing more to learn while held"
    );
    assert_eq!(w.send_size(sends[2]), LEN, "confirmed: its send completes");
    // Port 0 is back with fresh QPs at the same plan indices.
    w.tx.resume(0).unwrap();
    assert!(!w.tx.failover().unwrap().is_held(0));
    assert!(
        w.isend(N * LEN, LEN, 7).unwrap().is_none(),
        "the probe comes first"
    );
    w.tx.take_probe().unwrap();
    let words: [u64; MAX_REQUESTS] = w.records.clone().try_into().unwrap();
    let reposts = w.tx.probed(&words).unwrap();
    // Lost: QP 0's unpolled and unsent chains, all 4 of QP 2's.
    assert_eq!(reposts.len(), 2 + 4, "{reposts:?}");
    let c = w.tx.failover().unwrap().counters();
    let counted = (c.moves, c.waits, c.resumes, c.probes, c.confirmed);
    assert_eq!((counted, c.replayed), ((0, 1, 1, 2, 1), 6));
    for r in &reposts {
        // Message k went over QPs (0, 1) or (2, 3) by turns: its slice 0 over 0 or 2.
        assert_eq!(r.qp, 2 * (r.slot % 2), "{r:?} goes again on its own QP");
        let (post, reqs) = w.tx.replay(r).unwrap();
        w.execute(&post, &reqs);
    }
    assert!(
        w.isend(N * LEN, LEN, 7).unwrap().is_none(),
        "replays unacknowledged"
    );
    w.rx_poll();
    w.tx_poll();
    w.received_once(&recvs, LEN);
    for &s in sends.iter().filter(|&&s| s != sends[2]) {
        assert_eq!(w.send_size(s), LEN);
    }
    // New messages use port 0 again.
    let s = w.isend(N * LEN, LEN, 7).unwrap().unwrap();
    assert_eq!(w.queued[0].len() + w.queued[2].len(), 1);
    for q in 0..4 {
        w.deliver(q, 1);
    }
    w.rx_poll();
    w.tx_poll();
    assert_eq!(w.recv_sizes(extra), [LEN]);
    assert_eq!(w.received(N * LEN, LEN), w.sent(N * LEN, LEN));
    assert_eq!(w.send_size(s), LEN);
    assert!(w.tx.resume(0).is_err(), "port 0 is no longer held");
}
