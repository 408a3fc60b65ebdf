//! Atomics (`IBV_WR_ATOMIC_FETCH_AND_ADD`, `IBV_WR_ATOMIC_CMP_AND_SWP`) as RC hardware does
//! them: the original value back in the requester's 8-byte SGE, the word updated, the checks
//! (REMOTE_ATOMIC, alignment, SGE length), atomicity across QPs and ordering after earlier WRs.
//! Every test runs over TCP and, where the backend can be told, delivered in process.

use ncclwasm_soft::Delivery;

use super::*;

/// Where the remote word sits in its buffer: not at the start, so an access landing on the
/// buffer's base instead would be seen.
const AT: usize = 64;
const BUF: usize = 256;

/// Runs `test` on a fresh pair for each delivery the backend can be asked for: TCP always; in
/// process through the provider's own table only (the cdylib reads `NCCL_WASM_SOFT_DELIVERY`
/// once, at its first verb; `tests/verbs` runs its atomic case both ways). The delivery is
/// global and read when a QP is made, so in-process pairs are made and used alone (the write
/// lock), and TCP is restored before anyone else makes a QP.
fn each_delivery(b: Backend, test: impl Fn(&End, &End, &str)) {
    {
        let _g = shared();
        let (a, peer) = pair(&b.fabric(), default_caps());
        test(&a, &peer, "tcp");
    }
    if b == Backend::Soft {
        let _g = exclusive();
        ncclwasm_soft::set_delivery(Delivery::InProcess);
        let (a, peer) = pair(&b.fabric(), default_caps());
        ncclwasm_soft::set_delivery(Delivery::Tcp);
        test(&a, &peer, "in-process");
    }
}

/// A remote buffer of [`BUF`] guard bytes with `value` at [`AT`], registered on `peer` with
/// `access`, and where that word is.
fn target(peer: &End, value: u64, access: Access) -> (Arc<DmaBuf>, Mr, Remote) {
    let buf = DmaBuf::new(BUF);
    buf.fill(GUARD_BYTE);
    buf.store_u64_release(AT, value);
    let mr = peer.reg(&buf, access);
    let remote = Remote {
        addr: mr.addr() + AT as u64,
        rkey: mr.rkey(),
    };
    (buf, mr, remote)
}

/// The remote buffer holds `value` at [`AT`] and guard bytes everywhere else.
fn check_target(buf: &DmaBuf, value: u64, what: &str) {
    let mut want = vec![GUARD_BYTE; BUF];
    want[AT..AT + 8].copy_from_slice(&value.to_ne_bytes());
    assert_bytes(&buf.to_vec(), &want, what);
}

/// Posts one signaled atomic whose result lands in `result` at offset 0 and checks its
/// completion; returns the value it brought back.
fn atomic(a: &End, op: SendOp, result: &(Arc<DmaBuf>, Mr), what: &str) -> u64 {
    let sge = [result.1.sge(0, 8).unwrap()];
    a.qp.post_send(&[sig(7, op, &sge)]).unwrap();
    let wc = wait(&a.cq, 1, what)[0];
    let opcode = match op {
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        _ => WcOpcode::CompSwap,
    };
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (7, WcStatus::Success, opcode, 8),
        "{what}"
    );
    result.0.load_u64_acquire(0)
}

/// A local 8-byte result buffer, filled with a value no atomic returns here.
fn result_buf(a: &End) -> (Arc<DmaBuf>, Mr) {
    let buf = DmaBuf::new(8);
    buf.store_u64_release(0, 0xdead_dead_dead_dead);
    let mr = a.reg(&buf, ALL_ACCESS);
    (buf, mr)
}

/// FETCH_AND_ADD adds (wrapping) and returns the original; CMP_AND_SWP returns the original
/// whether the compare holds or not, and swaps only when it does.
pub fn atomic_fetch_add_and_cmp_swap(b: Backend) {
    each_delivery(b, |a, peer, how| {
        let start = u64::MAX - 2;
        let (buf, _mr, remote) = target(peer, start, ALL_ACCESS);
        let res = result_buf(a);
        let add = SendOp::FetchAdd { remote, add: 5 };
        let got = atomic(a, add, &res, &format!("{how}: fetch-add"));
        assert_eq!(got, start, "{how}: fetch-add returns the original");
        check_target(&buf, 2, &format!("{how}: fetch-add wraps"));

        let miss = SendOp::CmpSwap {
            remote,
            compare: 3,
            swap: 99,
        };
        let got = atomic(a, miss, &res, &format!("{how}: failed compare"));
        assert_eq!(got, 2, "{how}: failed compare returns the original");
        check_target(&buf, 2, &format!("{how}: failed compare stores nothing"));

        let hit = SendOp::CmpSwap {
            remote,
            compare: 2,
            swap: 0x0123_4567_89ab_cdef,
        };
        let got = atomic(a, hit, &res, &format!("{how}: compare and swap"));
        assert_eq!(got, 2, "{how}: compare and swap returns the original");
        check_target(&buf, 0x0123_4567_89ab_cdef, &format!("{how}: swapped"));
    });
}

/// RC ordering: an atomic executes after the earlier WRs of its QP, so it sees an unsignaled
/// WRITE posted just before it in the same chain, and a READ after it sees its result.
pub fn atomic_after_write_sees_it(b: Backend) {
    each_delivery(b, |a, peer, how| {
        let (buf, _mr, remote) = target(peer, 1, ALL_ACCESS);
        let src = DmaBuf::new(8);
        src.store_u64_release(0, 1000);
        let src_mr = a.reg(&src, ALL_ACCESS);
        let res = result_buf(a);
        let back = result_buf(a);
        let (wsge, asge, rsge) = (
            [src_mr.sge(0, 8).unwrap()],
            [res.1.sge(0, 8).unwrap()],
            [back.1.sge(0, 8).unwrap()],
        );
        let mut write = sig(1, SendOp::Write(remote), &wsge);
        write.signaled = false;
        a.qp.post_send(&[
            write,
            sig(2, SendOp::FetchAdd { remote, add: 7 }, &asge),
            sig(3, SendOp::Read(remote), &rsge),
        ])
        .unwrap();
        let wcs = wait(&a.cq, 2, how);
        let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            [(2, WcStatus::Success), (3, WcStatus::Success)],
            "{how}"
        );
        assert_eq!(res.0.load_u64_acquire(0), 1000, "{how}: saw the WRITE");
        assert_eq!(
            back.0.load_u64_acquire(0),
            1007,
            "{how}: the READ saw the add"
        );
        check_target(&buf, 1007, how);
    });
}

/// A remote address not 8-byte aligned: `IBV_WC_REM_INV_REQ_ERR` (what hardware and rxe
/// answer), both QPs to ERR, nothing changed.
pub fn atomic_misaligned(b: Backend) {
    each_delivery(b, |a, peer, how| {
        let (buf, _mr, remote) = target(peer, 5, ALL_ACCESS);
        let res = result_buf(a);
        let sge = [res.1.sge(0, 8).unwrap()];
        let remote = Remote {
            addr: remote.addr + 4,
            ..remote
        };
        super::tests::expect_violation(
            a,
            peer,
            sig(1, SendOp::FetchAdd { remote, add: 1 }, &sge),
            WcStatus::RemInvReqErr,
            &buf,
            &format!("{how}: misaligned atomic"),
        );
        assert_eq!(res.0.load_u64_acquire(0), 0xdead_dead_dead_dead, "{how}");
    });
}

/// An MR without REMOTE_ATOMIC: remote access error, both QPs to ERR, nothing changed.
pub fn atomic_without_remote_atomic(b: Backend) {
    each_delivery(b, |a, peer, how| {
        let no_atomic = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let (buf, _mr, remote) = target(peer, 5, no_atomic);
        let res = result_buf(a);
        let sge = [res.1.sge(0, 8).unwrap()];
        let cas = SendOp::CmpSwap {
            remote,
            compare: 5,
            swap: 6,
        };
        super::tests::expect_violation(
            a,
            peer,
            sig(1, cas, &sge),
            WcStatus::RemAccessErr,
            &buf,
            &format!("{how}: no REMOTE_ATOMIC"),
        );
        assert_eq!(res.0.load_u64_acquire(0), 0xdead_dead_dead_dead, "{how}");
    });
}

/// A local SGE that is not the 8 bytes an atomic returns: a local length error, nothing sent.
pub fn atomic_wrong_sge_length(b: Backend) {
    each_delivery(b, |a, peer, how| {
        let (buf, _mr, remote) = target(peer, 5, ALL_ACCESS);
        let local = DmaBuf::new(16);
        let local_mr = a.reg(&local, ALL_ACCESS);
        let sge = [local_mr.sge(0, 16).unwrap()];
        super::tests::expect_violation(
            a,
            peer,
            sig(1, SendOp::FetchAdd { remote, add: 1 }, &sge),
            WcStatus::LocLenErr,
            &buf,
            &format!("{how}: 16-byte SGE"),
        );
    });
}

/// Four QPs (two devices, four PDs, one buffer registered in each) add 1 to one word 4000
/// times each from four threads, 16 atomics in flight per QP (`max_rd_atomic`) so the
/// responders keep colliding: the word ends at exactly 16000 and the values brought back are
/// 0..16000, each once — no two atomics saw the same value.
pub fn atomics_from_many_qps_sum_exactly(b: Backend) {
    const QPS: usize = 4;
    const EACH: usize = 4000;
    const BATCH: usize = 200;
    let rts = RtsAttr {
        max_rd_atomic: 16,
        ..NCCL_RTS
    };
    let run = |how: &str, pairs: Vec<(End, End)>| {
        let word = DmaBuf::new(8);
        let mrs: Vec<Mr> = pairs
            .iter()
            .map(|(_, p)| p.reg(&word, ALL_ACCESS))
            .collect();
        let mut seen: Vec<u64> = std::thread::scope(|s| {
            let threads: Vec<_> = pairs
                .iter()
                .zip(&mrs)
                .map(|((a, _), mr)| {
                    s.spawn(move || {
                        let out = DmaBuf::new(EACH * 8);
                        let out_mr = a.reg(&out, ALL_ACCESS);
                        let remote = Remote {
                            addr: mr.addr(),
                            rkey: mr.rkey(),
                        };
                        for first in (0..EACH).step_by(BATCH) {
                            let sges: Vec<[Sge; 1]> = (first..first + BATCH)
                                .map(|i| [out_mr.sge(i as u64 * 8, 8).unwrap()])
                                .collect();
                            let wrs: Vec<SendWr<'_>> = sges
                                .iter()
                                .zip(first as u64..)
                                .map(|(sge, id)| sig(id, SendOp::FetchAdd { remote, add: 1 }, sge))
                                .collect();
                            a.qp.post_send(&wrs).unwrap();
                            for wc in wait(&a.cq, BATCH, how) {
                                assert_eq!(wc.status, WcStatus::Success, "{how}: {wc:?}");
                            }
                        }
                        (0..EACH)
                            .map(|i| out.load_u64_acquire(i * 8))
                            .collect::<Vec<u64>>()
                    })
                })
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().expect("no panic"))
                .collect()
        });
        assert_eq!(word.load_u64_acquire(0), (QPS * EACH) as u64, "{how}: sum");
        seen.sort_unstable();
        assert!(
            seen.iter().copied().eq(0..(QPS * EACH) as u64),
            "{how}: every value brought back once"
        );
    };
    let f = b.fabric();
    {
        let _g = shared();
        run(
            "tcp",
            (0..QPS)
                .map(|_| pair_with(&f, default_caps(), rts))
                .collect(),
        );
    }
    if b == Backend::Soft {
        let _g = exclusive();
        ncclwasm_soft::set_delivery(Delivery::InProcess);
        let pairs = (0..QPS)
            .map(|_| pair_with(&f, default_caps(), rts))
            .collect();
        ncclwasm_soft::set_delivery(Delivery::Tcp);
        run("in-process", pairs);
    }
}

/// `ibv_query_device` reports `IBV_ATOMIC_HCA`: atomic between the device's QPs.
pub fn atomic_cap_reported(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    for name in f.device_names() {
        let attr = f.open(&name).unwrap().query_device().unwrap();
        assert_eq!(
            attr.atomic_cap,
            ibverbs_sys::ibv_atomic_cap::IBV_ATOMIC_HCA,
            "{name}"
        );
    }
}
