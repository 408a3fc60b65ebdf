//! Same-host pull (the `qp::pull` module) between two QPs of this process over TCP: which
//! path a connection took is read from the responder QP's pulled-bytes counter.

use std::sync::{Mutex, MutexGuard};

use super::*;
use crate::abi::objects::qp_of;
use crate::qp::PULL_MIN;

/// Serialises the tests that switch pull off for the QPs they create (the switch is
/// process-wide) with those that need it on.
static SWITCH: Mutex<()> = Mutex::new(());

/// A connected pair created with pull `on`, and the lock that kept the switch there.
pub(super) fn pair_with_pull(on: bool) -> (Node, Node, MutexGuard<'static, ()>) {
    let held = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    crate::set_same_host_pull(on);
    let (a, b) = (Node::new(0), Node::new(1));
    crate::set_same_host_pull(true);
    connect(&a, &b, 1, 14, 7, 7);
    (a, b, held)
}

/// Payload bytes `n`'s responder pulled.
pub(super) fn pulled(n: &Node) -> u64 {
    // SAFETY: a live QP made by `create_qp`.
    unsafe { qp_of(n.qp) }.pulled_bytes()
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u8)
        .collect()
}

/// WRITE, WRITE_WITH_IMM and SEND of `len` bytes from a to b; checks completions and bytes.
fn write_imm_send(a: &Node, b: &Node, len: usize) {
    let mut src = pattern(len, 1);
    let mut dst = vec![0u8; len];
    let mut rbuf = vec![0u8; len];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let rmr = b.reg(&mut rbuf, LOCAL_WRITE);
    let (lkey, (_, rkey)) = (mr_keys(smr).0, mr_keys(dmr));
    let write = |wr_id, op, from: &[u8]| {
        assert_eq!(
            a.post_send(
                wr_id,
                op,
                Some((from, lkey)),
                dst.as_ptr() as u64,
                rkey,
                true
            ),
            0
        );
        let wc = a.wait(1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (wr_id, ibv_wc_status::IBV_WC_SUCCESS)
        );
    };
    write(1, ibv_wr_opcode::IBV_WR_RDMA_WRITE, &src);
    assert!(dst == src, "WRITE placed the bytes");

    src.reverse();
    assert_eq!(b.post_recv(20, None), 0);
    write(2, ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, &src);
    let rc = b.wait(1);
    assert_eq!(
        (rc[0].wr_id, rc[0].opcode, rc[0].byte_len, rc[0].imm),
        (
            20,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            len as u32,
            2u32.to_be()
        )
    );
    assert!(dst == src, "WRITE_WITH_IMM placed the bytes");

    src.rotate_left(12_345);
    assert_eq!(b.post_recv(21, Some((&mut rbuf, mr_keys(rmr).0))), 0);
    assert_eq!(
        a.post_send(
            3,
            ibv_wr_opcode::IBV_WR_SEND,
            Some((&src, lkey)),
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    let rc = b.wait(1);
    assert_eq!(
        (rc[0].wr_id, rc[0].opcode, rc[0].byte_len),
        (21, ibv_wc_opcode::IBV_WC_RECV, len as u32)
    );
    assert!(rbuf == src, "SEND placed the bytes");
    for mr in [smr, dmr, rmr] {
        dereg(mr);
    }
}

#[test]
fn large_writes_and_sends_are_pulled_small_ones_are_not() {
    let (a, b, _held) = pair_with_pull(true);
    let len = 3 << 20;
    write_imm_send(&a, &b, len);
    assert_eq!(pulled(&b), 3 * len as u64, "all three were pulled");
    write_imm_send(&a, &b, PULL_MIN as usize - 1);
    assert_eq!(
        pulled(&b),
        3 * len as u64,
        "below the threshold: the socket"
    );
    write_imm_send(&a, &b, PULL_MIN as usize);
    assert_eq!(pulled(&b), 3 * (len as u64 + u64::from(PULL_MIN)));
}

#[test]
fn turned_off_the_socket_carries_large_payloads() {
    let (a, b, _held) = pair_with_pull(false);
    write_imm_send(&a, &b, 3 << 20);
    assert_eq!(pulled(&b), 0);
}

#[test]
fn without_ece_the_probe_is_unbound_and_the_socket_carries_large_payloads() {
    let _held = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = (Node::new(0), Node::new(1));
    connect_without_ece(&a, &b, 0x12_3456, 0x12_3456);
    write_imm_send(&a, &b, 1 << 20);
    assert_eq!(pulled(&b), 0);
}

#[test]
fn a_pulled_source_stays_pinned_until_the_responder_answered() {
    let (a, b, _held) = pair_with_pull(true);
    let len = 32 << 20;
    let mut src = vec![7u8; len];
    let mut dst = vec![0u8; len];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let write = |wr_id, len: usize| {
        let rc = a.post_send(
            wr_id,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src[..len], mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true,
        );
        assert_eq!(rc, 0);
    };
    // Connected first, so the large WR leaves at once.
    write(1, 16);
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    // SAFETY: a live QP.
    unsafe { fault::stall(b.qp, Duration::from_millis(300)) };
    write(2, len);
    // SAFETY: a live QP made by `create_qp`.
    let requester = unsafe { qp_of(a.qp) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !requester.pins_sources() {
        assert!(Instant::now() < deadline, "the pulled WR pins its source");
        std::thread::yield_now();
    }
    // The responder reads the source after the header left: deregistering it returns only
    // once the bytes were placed, so scribbling on it afterwards changes nothing.
    dereg(smr);
    src.fill(0xee);
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert!(dst.iter().all(|&x| x == 7), "the bytes as posted");
    assert_eq!(pulled(&b), len as u64);
    assert!(!requester.pins_sources(), "answered: unpinned");
    dereg(dmr);
}

/// A large WRITE (case 0: past the MR's end, 1: an unknown rkey) after one that succeeds;
/// returns the failed WR's status and what was pulled.
fn violation(pull: bool, case: u32) -> (u32, u64) {
    let (a, b, _held) = pair_with_pull(pull);
    let len = 1 << 20;
    let mut src = pattern(len, 3);
    let mut big = vec![0u8; 3 * len];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    // The target MR is the middle third of `big`; the thirds around it must stay untouched.
    // SAFETY: `big` outlives the MR.
    let mr = unsafe {
        abi::reg_mr(
            b.pd,
            big.as_mut_ptr().add(len).cast(),
            len,
            (LOCAL_WRITE | REMOTE_WRITE) as i32,
        )
    };
    let base = big.as_ptr() as u64 + len as u64;
    let (lkey, rkey) = (mr_keys(smr).0, mr_keys(mr).1);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, lkey)),
            base,
            rkey,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    let placed = pulled(&b);
    let (raddr, rkey) = match case {
        0 => (base + 4096, rkey),
        _ => (base, rkey ^ 0x5a5a),
    };
    // One WR only: over the socket, a second one's payload still unread when the responder
    // closes makes the close a reset, which can overtake the NAK (RETRY_EXC_ERR instead).
    assert_eq!(
        a.post_send(
            2,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, lkey)),
            raddr,
            rkey,
            true
        ),
        0
    );
    let status = a.wait(1)[0].status;
    let outside = big[..len].iter().chain(&big[2 * len..]);
    assert!(outside.copied().all(|x| x == 0), "no byte outside the MR");
    assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
    b.refused_as_a_responder();
    assert_eq!(pulled(&b), placed, "nothing pulled for a refused request");
    dereg(smr);
    dereg(mr);
    (status, placed)
}

#[test]
fn a_pulled_violation_completes_as_on_the_socket() {
    for case in 0..2 {
        let pulled = violation(true, case);
        let socket = violation(false, case);
        assert_eq!(
            pulled.0,
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            "case {case}"
        );
        assert_eq!(pulled.0, socket.0, "case {case}");
        assert_eq!(
            (pulled.1, socket.1),
            (1 << 20, 0),
            "case {case}: the paths taken"
        );
    }
}
