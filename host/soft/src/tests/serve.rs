//! Arrivals served by the thread polling the CQ (the `qp::serve` module), two QPs of this
//! process over TCP: which path a frame took is read from the CQ's served-frames counter, and
//! leases are held for as long as the test polls at all, so no result depends on how the
//! test's thread is scheduled.

use super::*;
use crate::abi::objects::qp_of;
use crate::ctx::CqState;

/// The CQ `n`'s QP completes to (one for both queues in these tests).
fn cq(n: &Node) -> &CqState {
    // SAFETY: a live QP made by `create_qp`.
    &unsafe { qp_of(n.qp) }.recv_cq
}

/// A connected pair whose CQs keep their leases while the test polls.
fn held_pair() -> (Node, Node) {
    let (a, b) = pair();
    hold(&a, &b);
    (a, b)
}

/// From now on, the leases of `a`'s and `b`'s CQs lapse only when the test stops polling.
fn hold(a: &Node, b: &Node) {
    cq(a).served.hold_leases();
    cq(b).served.hold_leases();
}

/// Buffers and registrations for `rounds` WRITE_WITH_IMMs of `len` bytes from a to b.
struct Traffic {
    src: Vec<u8>,
    dst: Vec<u8>,
    lkey: u32,
    rkey: u32,
    mrs: [*mut ibv_mr; 2],
}

impl Traffic {
    fn new(a: &Node, b: &Node, len: usize) -> Traffic {
        let mut src = vec![0u8; len];
        let mut dst = vec![0u8; len];
        let smr = a.reg(&mut src, LOCAL_WRITE);
        let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
        Traffic {
            lkey: mr_keys(smr).0,
            rkey: mr_keys(dmr).1,
            src,
            dst,
            mrs: [smr, dmr],
        }
    }

    /// One WRITE_WITH_IMM of message `i`, its receive completion at b and its send completion
    /// at a, each side polling only its own CQ; checks the bytes.
    fn round(&mut self, a: &Node, b: &Node, i: u64) {
        let len = self.src.len();
        self.src.fill(i as u8 ^ 0x5a);
        assert_eq!(b.post_recv(i, None), 0);
        let op = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        let raddr = self.dst.as_ptr() as u64;
        assert_eq!(
            a.post_send(i, op, Some((&self.src, self.lkey)), raddr, self.rkey, true),
            0
        );
        let at_b = b.wait(1);
        assert_eq!(
            (at_b[0].wr_id, at_b[0].status),
            (i, ibv_wc_status::IBV_WC_SUCCESS)
        );
        let at_a = a.wait(1);
        assert_eq!(
            (at_a[0].wr_id, at_a[0].status),
            (i, ibv_wc_status::IBV_WC_SUCCESS)
        );
        assert!(
            self.dst[..len].iter().all(|&x| x == i as u8 ^ 0x5a),
            "round {i}"
        );
    }

    /// [`Traffic::round`] for each message of `ids`.
    fn rounds(&mut self, a: &Node, b: &Node, ids: std::ops::Range<u64>) {
        ids.for_each(|i| self.round(a, b, i));
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.mrs.into_iter().for_each(dereg);
    }
}

#[test]
fn polled_arrivals_are_served_by_the_poller() {
    let (a, b) = held_pair();
    let mut t = Traffic::new(&a, &b, 64);
    t.rounds(&a, &b, 0..200);
    // Each thread reads frames itself until it has seen a poll of its CQ after one of them,
    // then parks for good: only the first few are its own.
    let requests = cq(&b).served.frames();
    let answers = cq(&a).served.frames();
    assert!(
        requests >= 190,
        "the poller served {requests} of 200 requests"
    );
    assert!(answers >= 190, "the poller served {answers} of 200 answers");
}

#[test]
fn requests_that_ask_for_no_answer_are_acknowledged_by_the_next_quiet_poll() {
    let (a, b) = held_pair();
    let mut t = Traffic::new(&a, &b, 64);
    // Both ways, so that each CQ serves two connections and a poll looks at which have bytes.
    let mut back = Traffic::new(&b, &a, 64);
    for i in 0..20 {
        t.round(&a, &b, i);
        back.round(&b, &a, i);
    }
    let frames = cq(&b).served.frames();
    // Unsignaled WRITEs: no completion anywhere, and no request for an answer.
    let op = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    let raddr = t.dst.as_ptr() as u64;
    for i in 100..105 {
        let from = Some((&t.src[..], t.lkey));
        assert_eq!(a.post_send(i, op, from, raddr, t.rkey, false), 0);
    }
    // SAFETY: a live QP made by `create_qp`.
    let requester = unsafe { qp_of(a.qp) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while requester.unacknowledged() > 0 {
        assert!(Instant::now() < deadline, "never acknowledged");
        assert!(b.drain_for(Duration::from_millis(1)).is_empty());
        assert!(a.drain_for(Duration::from_millis(1)).is_empty());
    }
    // Placed by b's poller (its thread stays parked while the lease is held), and so
    // acknowledged by it.
    assert_eq!(cq(&b).served.frames(), frames + 5);
}

#[test]
fn a_frame_larger_than_a_poller_serves_goes_to_the_thread_and_the_lease_comes_back() {
    let (a, b) = held_pair();
    let mut small = Traffic::new(&a, &b, 64);
    small.rounds(&a, &b, 0..20);
    let before = cq(&b).served.frames();
    // 1 MiB: read by the responder thread, which the poller wakes for it.
    let mut large = Traffic::new(&a, &b, 1 << 20);
    large.round(&a, &b, 20);
    assert_eq!(
        cq(&b).served.frames(),
        before,
        "a large request is its thread's"
    );
    small.rounds(&a, &b, 21..60);
    let after = cq(&b).served.frames();
    assert!(after >= before + 35, "leased again: {after} after {before}");
}

#[test]
fn a_poller_pulls_a_leased_connections_payloads_from_the_same_host() {
    let (a, b, _switch) = super::pull::pair_with_pull(true);
    hold(&a, &b);
    let mut small = Traffic::new(&a, &b, 64);
    small.rounds(&a, &b, 0..20);
    let (frames, pulled) = (cq(&b).served.frames(), super::pull::pulled(&b));
    let len = crate::qp::PULL_MIN as usize;
    let mut t = Traffic::new(&a, &b, len);
    t.rounds(&a, &b, 20..40);
    assert_eq!(super::pull::pulled(&b) - pulled, 20 * len as u64);
    let served = cq(&b).served.frames() - frames;
    assert!(served >= 18, "the poller pulled {served} of 20");
}

#[test]
fn err_while_leased_flushes_and_the_parked_threads_end() {
    let (a, b) = held_pair();
    let mut t = Traffic::new(&a, &b, 64);
    t.rounds(&a, &b, 0..20);
    for i in 100..104 {
        assert_eq!(b.post_recv(i, None), 0);
    }
    // SAFETY: zeroed attr is valid C data.
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
    assert_eq!(b.modify(&mut attr, ibv_qp_attr_mask::IBV_QP_STATE), 0);
    let flushed = b.wait(4);
    assert!(
        flushed
            .iter()
            .all(|g| g.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
        "{flushed:?}"
    );
    // Polling on does not touch the failed QP's connections.
    assert!(b.drain_for(Duration::from_millis(20)).is_empty());
    drop(t);
    // Dropping the nodes destroys both QPs, which joins every thread: a parked thread that
    // missed the move to ERR would hang here.
}

#[test]
fn a_reset_while_leased_starts_a_new_epoch_that_is_served_again() {
    let (a, b) = held_pair();
    let mut t = Traffic::new(&a, &b, 64);
    t.rounds(&a, &b, 0..20);
    // SAFETY: zeroed attr is valid C data.
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = ibv_qp_state::IBV_QPS_RESET;
    for n in [&a, &b] {
        assert_eq!(n.modify(&mut attr, ibv_qp_attr_mask::IBV_QP_STATE), 0);
    }
    connect(&a, &b, 1, 14, 7, 7);
    let before = cq(&b).served.frames();
    t.rounds(&a, &b, 20..80);
    let after = cq(&b).served.frames();
    assert!(after >= before + 50, "served again: {after} after {before}");
}

#[test]
fn a_cq_nobody_polls_leaves_its_connections_to_their_threads() {
    let (a, b) = pair();
    let mut t = Traffic::new(&a, &b, 64);
    t.rounds(&a, &b, 0..20);
    // b stops polling. A WRITE completes nothing at b, yet must land and be acknowledged:
    // once b's lease lapses, its responder thread takes the connection back.
    t.src.fill(0xc3);
    let op = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    let raddr = t.dst.as_ptr() as u64;
    assert_eq!(
        a.post_send(99, op, Some((&t.src, t.lkey)), raddr, t.rkey, true),
        0
    );
    let at_a = a.wait(1);
    assert_eq!(
        (at_a[0].wr_id, at_a[0].status),
        (99, ibv_wc_status::IBV_WC_SUCCESS)
    );
    assert!(t.dst.iter().all(|&x| x == 0xc3));
}
