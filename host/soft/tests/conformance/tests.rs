//! The test bodies; each takes the backend it runs against.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Write,
    WriteImm,
    Read,
}

/// Checks a destination buffer laid out as `GUARD + DST_OFF` guard bytes, the payload, `GUARD`
/// guard bytes.
fn check_dst(dst: &DmaBuf, data: &[u8], what: &str) {
    let out = dst.to_vec();
    let start = GUARD + DST_OFF;
    assert_bytes(
        &out[..start],
        &vec![GUARD_BYTE; start],
        &format!("{what}: guard before"),
    );
    assert_bytes(
        &out[start..start + data.len()],
        data,
        &format!("{what}: payload"),
    );
    assert_bytes(
        &out[start + data.len()..],
        &[GUARD_BYTE; GUARD],
        &format!("{what}: guard after"),
    );
}

fn transfer(b: Backend, kind: Kind) {
    let _g = shared();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    for (i, &size) in SIZES.iter().enumerate() {
        let what = format!("{} {kind:?} of {size} bytes", b.name());
        let data = pattern(i as u64 + 1, size);
        // WRITE moves a → peer; READ pulls peer → a.
        let (src_end, dst_end) = if kind == Kind::Read {
            (&peer, &a)
        } else {
            (&a, &peer)
        };
        let src = DmaBuf::new(SRC_OFF + size);
        src.write(SRC_OFF, &data);
        let dst = DmaBuf::new(GUARD + DST_OFF + size + GUARD);
        dst.fill(GUARD_BYTE);
        let src_mr = src_end.reg(&src, ALL_ACCESS);
        let dst_mr = dst_end.reg(&dst, ALL_ACCESS);
        let wr_id = 100 + i as u64;
        let imm = 0xA000_0000 | i as u32;
        match kind {
            Kind::Write | Kind::WriteImm => {
                let sge = [src_mr.sge(SRC_OFF as u64, size as u32).unwrap()];
                let sges: &[Sge] = if size == 0 { &[] } else { &sge };
                let remote = Remote {
                    addr: dst_mr.addr() + (GUARD + DST_OFF) as u64,
                    rkey: dst_mr.rkey(),
                };
                let op = if kind == Kind::Write {
                    SendOp::Write(remote)
                } else {
                    SendOp::WriteImm(remote, imm)
                };
                if kind == Kind::WriteImm {
                    peer.qp
                        .post_recv(&[RecvWr {
                            wr_id: 1000 + i as u64,
                            sges: &[],
                        }])
                        .unwrap();
                }
                a.qp.post_send(&[sig(wr_id, op, sges)]).unwrap();
                let wc = wait(&a.cq, 1, &what)[0];
                assert_eq!(
                    (wc.wr_id, wc.status, wc.opcode),
                    (wr_id, WcStatus::Success, WcOpcode::RdmaWrite),
                    "{what}"
                );
                if kind == Kind::WriteImm {
                    let r = wait(&peer.cq, 1, &what)[0];
                    assert_eq!(r.status, WcStatus::Success, "{what}: receive");
                    assert_eq!(r.wr_id, 1000 + i as u64, "{what}: receive wr_id");
                    assert_eq!(
                        r.opcode,
                        WcOpcode::RecvRdmaWithImm,
                        "{what}: receive opcode"
                    );
                    assert_eq!(r.imm, Some(imm), "{what}: immediate");
                    assert_eq!(r.byte_len as usize, size, "{what}: receive byte_len");
                    assert_eq!(r.qp_num, peer.qp.qpn(), "{what}: receive qp_num");
                }
            }
            Kind::Read => {
                let sge = [dst_mr.sge((GUARD + DST_OFF) as u64, size as u32).unwrap()];
                let sges: &[Sge] = if size == 0 { &[] } else { &sge };
                let remote = Remote {
                    addr: src_mr.addr() + SRC_OFF as u64,
                    rkey: src_mr.rkey(),
                };
                a.qp.post_send(&[sig(wr_id, SendOp::Read(remote), sges)])
                    .unwrap();
                let wc = wait(&a.cq, 1, &what)[0];
                assert_eq!(
                    (wc.wr_id, wc.status, wc.opcode),
                    (wr_id, WcStatus::Success, WcOpcode::RdmaRead),
                    "{what}"
                );
                assert_eq!(wc.byte_len as usize, size, "{what}: byte_len");
            }
        }
        check_dst(&dst, &data, &what);
        // Nothing else may have completed on either side.
        quiet(&a.cq, Duration::ZERO, &what);
        quiet(&peer.cq, Duration::ZERO, &what);
    }
}

/// RDMA WRITE of 0 B … 64 MiB, unaligned on both sides; every byte and every guard checked.
pub fn rdma_write_sizes(b: Backend) {
    transfer(b, Kind::Write);
}

/// WRITE_WITH_IMM: data placed, the receive consumed with the immediate and the length.
pub fn rdma_write_with_imm_sizes(b: Backend) {
    transfer(b, Kind::WriteImm);
}

/// RDMA READ of every size into an unaligned local buffer.
pub fn rdma_read_sizes(b: Backend) {
    transfer(b, Kind::Read);
}

/// Inline payloads are copied at post time: overwriting the source right after the post must
/// not change what lands; oversize or unchecked inline SGEs are refused before the provider.
pub fn inline_write(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    let data = pattern(77, 200);
    let src = DmaBuf::new(SRC_OFF + 200);
    src.write(SRC_OFF, &data);
    let dst = DmaBuf::new(GUARD + DST_OFF + 200 + GUARD);
    dst.fill(GUARD_BYTE);
    let src_mr = a.reg(&src, ALL_ACCESS);
    let dst_mr = peer.reg(&dst, ALL_ACCESS);
    let remote = Remote {
        addr: dst_mr.addr() + (GUARD + DST_OFF) as u64,
        rkey: dst_mr.rkey(),
    };
    let sge = [src_mr.sge(SRC_OFF as u64, 200).unwrap()];
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::Write(remote),
        sges: &sge,
        signaled: true,
        inline: true,
    }])
    .unwrap();
    src.fill(0x11);
    let wc = wait(&a.cq, 1, "inline")[0];
    assert_eq!(wc.status, WcStatus::Success);
    check_dst(&dst, &data, "inline write");

    let max = a.qp.caps().max_inline_data;
    let big = DmaBuf::new(max as usize + 1);
    let big_mr = a.reg(&big, ALL_ACCESS);
    let too_big = [big_mr.sge(0, max + 1).unwrap()];
    let e = a.qp.post_send(&[SendWr {
        wr_id: 2,
        op: SendOp::Write(remote),
        sges: &too_big,
        signaled: true,
        inline: true,
    }]);
    assert!(
        matches!(e, Err(VerbsError::Invalid(_))),
        "inline of {} > {max}: {e:?}",
        max + 1
    );
    let raw = [Sge::raw(src_mr.addr(), 8, src_mr.lkey())];
    let e = a.qp.post_send(&[SendWr {
        wr_id: 3,
        op: SendOp::Write(remote),
        sges: &raw,
        signaled: true,
        inline: true,
    }]);
    assert!(
        matches!(e, Err(VerbsError::Invalid(_))),
        "inline from an unchecked SGE: {e:?}"
    );
    quiet(&a.cq, Duration::from_millis(50), "refused inline posts");
}

/// One post of a chain: WRITE (unsignaled), WRITE_WITH_IMM, READ back — completions in order,
/// and a chain with a bad WR in the middle reports its index with the head posted.
pub fn chained_post(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    let n = 64 * 1024 + 7;
    let data = pattern(5, n);
    let src = DmaBuf::new(n);
    src.write(0, &data);
    let back = DmaBuf::new(n);
    let dst = DmaBuf::new(2 * n);
    let (src_mr, back_mr, dst_mr) = (
        a.reg(&src, ALL_ACCESS),
        a.reg(&back, ALL_ACCESS),
        peer.reg(&dst, ALL_ACCESS),
    );
    let s1 = [src_mr.sge(0, n as u32).unwrap()];
    let s3 = [back_mr.sge(0, n as u32).unwrap()];
    let r1 = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    let r2 = Remote {
        addr: dst_mr.addr() + n as u64,
        rkey: dst_mr.rkey(),
    };
    peer.qp
        .post_recv(&[RecvWr {
            wr_id: 9,
            sges: &[],
        }])
        .unwrap();
    a.qp.post_send(&[
        SendWr {
            wr_id: 1,
            op: SendOp::Write(r1),
            sges: &s1,
            signaled: false,
            inline: false,
        },
        sig(2, SendOp::WriteImm(r2, 42), &s1),
        sig(3, SendOp::Read(r1), &s3),
    ])
    .unwrap();
    let wcs = wait(&a.cq, 2, "chain");
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(2, WcStatus::Success), (3, WcStatus::Success)]
    );
    let r = wait(&peer.cq, 1, "chain receive")[0];
    assert_eq!((r.wr_id, r.imm, r.byte_len as usize), (9, Some(42), n));
    let out = dst.to_vec();
    assert_bytes(&out[..n], &data, "chain: first write");
    assert_bytes(&out[n..], &data, "chain: second write");
    assert_bytes(&back.to_vec(), &data, "chain: read back");

    // A WR with more SGEs than the QP allows, second in a chain: index 1, the first goes out.
    let too_many = vec![src_mr.sge(0, 1).unwrap(); a.qp.caps().max_send_sge as usize + 1];
    let e =
        a.qp.post_send(&[
            sig(4, SendOp::Write(r1), &s1),
            sig(5, SendOp::Write(r1), &too_many),
        ])
        .unwrap_err();
    let (index, errno) = post_err(e);
    assert_eq!((index, errno), (1, libc::EINVAL), "bad WR in a chain");
    let wc = wait(&a.cq, 1, "chain head")[0];
    assert_eq!((wc.wr_id, wc.status), (4, WcStatus::Success));
    quiet(&a.cq, Duration::from_millis(50), "refused chain tail");
}

/// Chains longer than a post lays out on its stack (the verbs wrapper's room is 16 WRs and 32
/// SGEs; longer ones go to the heap): 24 receives in one post, then 24 WRITE_WITH_IMM of two
/// SGEs each in one post, only the last signalled. Every receive completes in order with its
/// immediate and its bytes.
pub fn long_chained_post(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    const WRS: usize = 24;
    const CHUNK: usize = 96;
    let data = pattern(11, WRS * CHUNK);
    let src = DmaBuf::new(data.len());
    src.write(0, &data);
    let dst = DmaBuf::new(data.len());
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let recvs: Vec<RecvWr<'_>> = (0..WRS)
        .map(|i| RecvWr {
            wr_id: 100 + i as u64,
            sges: &[],
        })
        .collect();
    peer.qp.post_recv(&recvs).unwrap();
    // Each WR's chunk in two SGEs: 48 in the chain.
    let half = (CHUNK / 2) as u32;
    let sges: Vec<[Sge; 2]> = (0..WRS)
        .map(|i| {
            let at = (i * CHUNK) as u64;
            [
                src_mr.sge(at, half).unwrap(),
                src_mr.sge(at + u64::from(half), half).unwrap(),
            ]
        })
        .collect();
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| SendWr {
            wr_id: i as u64,
            op: SendOp::WriteImm(
                Remote {
                    addr: dst_mr.addr() + (i * CHUNK) as u64,
                    rkey: dst_mr.rkey(),
                },
                i as u32,
            ),
            sges: s,
            signaled: i == WRS - 1,
            inline: false,
        })
        .collect();
    a.qp.post_send(&wrs).unwrap();
    let wc = wait(&a.cq, 1, "long chain")[0];
    assert_eq!((wc.wr_id, wc.status), ((WRS - 1) as u64, WcStatus::Success));
    let got = wait(&peer.cq, WRS, "long chain's receives");
    assert_eq!(
        got.iter()
            .map(|w| (w.wr_id, w.status, w.imm, w.byte_len as usize))
            .collect::<Vec<_>>(),
        (0..WRS)
            .map(|i| (100 + i as u64, WcStatus::Success, Some(i as u32), CHUNK))
            .collect::<Vec<_>>()
    );
    assert_bytes(&dst.to_vec(), &data, "long chain");
    quiet(
        &a.cq,
        Duration::from_millis(50),
        "long chain's unsignalled WRs",
    );
}

/// A violating WR must fail with `status`, take the requester (and for remote errors the
/// responder) to ERR, leave `untouched` exactly as it was, and later WRs flush.
pub(super) fn expect_violation(
    a: &End,
    peer: &End,
    wr: SendWr<'_>,
    status: WcStatus,
    untouched: &DmaBuf,
    what: &str,
) {
    let before = untouched.to_vec();
    a.qp.post_send(&[wr]).unwrap();
    let wc = wait(&a.cq, 1, what)[0];
    assert_eq!((wc.wr_id, wc.status), (wr.wr_id, status), "{what}");
    wait_state(&a.qp, QpState::Err, what);
    if !matches!(status, WcStatus::LocProtErr | WcStatus::LocLenErr) {
        wait_state(&peer.qp, QpState::Err, &format!("{what} (responder)"));
    }
    assert_bytes(
        &untouched.to_vec(),
        &before,
        &format!("{what}: memory must be untouched"),
    );
    // After the error, new work is flushed, never executed.
    a.qp.post_send(&[sig(wr.wr_id + 1, wr.op, wr.sges)])
        .unwrap();
    let wc = wait(&a.cq, 1, what)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (wr.wr_id + 1, WcStatus::WrFlushErr),
        "{what}: WR after the error"
    );
    assert_bytes(
        &untouched.to_vec(),
        &before,
        &format!("{what}: memory after the flush"),
    );
}

/// Source and guarded destination of 4 KiB for the violation tests.
struct Bufs {
    src: Arc<DmaBuf>,
    dst: Arc<DmaBuf>,
}

const VLEN: usize = 4096;

fn bufs() -> Bufs {
    let src = DmaBuf::new(VLEN);
    src.write(0, &pattern(9, VLEN));
    let dst = DmaBuf::new(VLEN + 2 * GUARD);
    dst.fill(GUARD_BYTE);
    Bufs { src, dst }
}

/// A local SGE with a wrong lkey: local protection error, nothing sent.
pub fn bad_lkey(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let (src_mr, dst_mr) = (a.reg(&v.src, ALL_ACCESS), peer.reg(&v.dst, ALL_ACCESS));
    let sge = [Sge::raw(
        src_mr.addr(),
        VLEN as u32,
        src_mr.lkey() ^ 0x00ab_cd00,
    )];
    let remote = Remote {
        addr: dst_mr.addr() + GUARD as u64,
        rkey: dst_mr.rkey(),
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Write(remote), &sge),
        WcStatus::LocProtErr,
        &v.dst,
        "bad lkey",
    );
}

/// A remote key that does not exist: remote access error on both sides.
pub fn bad_rkey(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let (src_mr, dst_mr) = (a.reg(&v.src, ALL_ACCESS), peer.reg(&v.dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, VLEN as u32).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr() + GUARD as u64,
        rkey: dst_mr.rkey() ^ 0x00ab_cd00,
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Write(remote), &sge),
        WcStatus::RemAccessErr,
        &v.dst,
        "bad rkey",
    );
}

/// An rkey of an MR in another PD of the responder's context.
pub fn wrong_pd(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let other_pd = peer.ctx.alloc_pd().unwrap();
    let src_mr = a.reg(&v.src, ALL_ACCESS);
    let dst_mr = other_pd.reg_mr(Arc::clone(&v.dst), ALL_ACCESS).unwrap();
    let sge = [src_mr.sge(0, VLEN as u32).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr() + GUARD as u64,
        rkey: dst_mr.rkey(),
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Write(remote), &sge),
        WcStatus::RemAccessErr,
        &v.dst,
        "MR of another PD",
    );
}

/// One byte past the end of the remote MR (which covers only the middle of its buffer), and
/// one byte past the local MR.
pub fn out_of_bounds(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    {
        let (a, peer) = pair(&f, default_caps());
        let v = bufs();
        let src_mr = a.reg(&v.src, ALL_ACCESS);
        // SAFETY: the range is inside `v.dst`, which outlives the MR (dropped at scope end).
        let inner = unsafe { ForeignMemory::new((v.dst.addr() as *mut u8).add(GUARD), VLEN) };
        let dst_mr = peer.pd.reg_mr(inner, ALL_ACCESS).unwrap();
        let sge = [src_mr.sge(0, VLEN as u32).unwrap()];
        let remote = Remote {
            addr: dst_mr.addr() + 1,
            rkey: dst_mr.rkey(),
        };
        expect_violation(
            &a,
            &peer,
            sig(1, SendOp::Write(remote), &sge),
            WcStatus::RemAccessErr,
            &v.dst,
            "remote out of bounds",
        );
    }
    {
        let (a, peer) = pair(&f, default_caps());
        let v = bufs();
        let (src_mr, dst_mr) = (a.reg(&v.src, ALL_ACCESS), peer.reg(&v.dst, ALL_ACCESS));
        let sge = [Sge::raw(src_mr.addr() + 1, VLEN as u32, src_mr.lkey())];
        let remote = Remote {
            addr: dst_mr.addr() + GUARD as u64,
            rkey: dst_mr.rkey(),
        };
        expect_violation(
            &a,
            &peer,
            sig(1, SendOp::Write(remote), &sge),
            WcStatus::LocProtErr,
            &v.dst,
            "local out of bounds",
        );
    }
}

/// WRITE into an MR registered without REMOTE_WRITE.
pub fn missing_remote_write(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let src_mr = a.reg(&v.src, ALL_ACCESS);
    let dst_mr = peer.reg(&v.dst, Access::LOCAL_WRITE | Access::REMOTE_READ);
    let sge = [src_mr.sge(0, VLEN as u32).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr() + GUARD as u64,
        rkey: dst_mr.rkey(),
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Write(remote), &sge),
        WcStatus::RemAccessErr,
        &v.dst,
        "no REMOTE_WRITE",
    );
}

/// READ from an MR registered without REMOTE_READ; the local target stays untouched.
pub fn missing_remote_read(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let remote_mr = peer.reg(&v.src, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let local_mr = a.reg(&v.dst, ALL_ACCESS);
    let sge = [local_mr.sge(GUARD as u64, VLEN as u32).unwrap()];
    let remote = Remote {
        addr: remote_mr.addr(),
        rkey: remote_mr.rkey(),
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Read(remote), &sge),
        WcStatus::RemAccessErr,
        &v.dst,
        "no REMOTE_READ",
    );
}

/// READ into a local MR without LOCAL_WRITE.
pub fn read_without_local_write(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let v = bufs();
    let remote_mr = peer.reg(&v.src, ALL_ACCESS);
    let local_mr = a.reg(&v.dst, Access::REMOTE_READ);
    let sge = [local_mr.sge(GUARD as u64, VLEN as u32).unwrap()];
    let remote = Remote {
        addr: remote_mr.addr(),
        rkey: remote_mr.rkey(),
    };
    expect_violation(
        &a,
        &peer,
        sig(1, SendOp::Read(remote), &sge),
        WcStatus::LocProtErr,
        &v.dst,
        "no LOCAL_WRITE",
    );
}

/// Sends are refused (EINVAL, index 0) before RTS; receives before INIT.
pub fn post_in_wrong_state(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let names = f.device_names();
    let me = End::new(&f, &names[0], default_caps());
    let buf = DmaBuf::new(64);
    let mr = me.reg(&buf, ALL_ACCESS);
    let sge = [mr.sge(0, 8).unwrap()];
    let remote = Remote {
        addr: mr.addr(),
        rkey: mr.rkey(),
    };
    let refused = |qp: &Qp, what: &str| {
        let e = qp
            .post_send(&[sig(1, SendOp::Write(remote), &sge)])
            .unwrap_err();
        assert_eq!(post_err(e), (0, libc::EINVAL), "post_send in {what}");
    };
    let fresh = me
        .pd
        .create_qp(&me.cq, &me.cq, default_caps(), false)
        .unwrap();
    assert_eq!(fresh.state().unwrap(), QpState::Reset);
    refused(&fresh, "RESET");
    let e = fresh
        .post_recv(&[RecvWr {
            wr_id: 1,
            sges: &[],
        }])
        .unwrap_err();
    assert_eq!(post_err(e), (0, libc::EINVAL), "post_recv in RESET");
    refused(&me.qp, "INIT");
    me.qp
        .post_recv(&[RecvWr {
            wr_id: 2,
            sges: &[],
        }])
        .expect("post_recv is legal from INIT");
    // RTR against a peer QP that exists (so addressing resolves) but is never used.
    let peer = End::new(&f, &names[1 % names.len()], default_caps());
    me.rtr(&peer.info());
    refused(&me.qp, "RTR");
    quiet(&me.cq, Duration::from_millis(20), "refused posts");
}

/// With no signaled WR, slots are never retired: after `max_send_wr` posts the queue is full.
pub fn send_queue_full_when_never_signaled(b: Backend) {
    let _g = shared();
    let caps = QpCaps {
        max_send_wr: 16,
        ..default_caps()
    };
    let (a, peer) = pair(&b.fabric(), caps);
    let n = a.qp.caps().max_send_wr;
    let (src, dst) = (DmaBuf::new(8), DmaBuf::new(8 * (n as usize + 1)));
    src.fill(0xA5);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 8).unwrap()];
    for i in 0..n {
        let remote = Remote {
            addr: dst_mr.addr() + 8 * u64::from(i),
            rkey: dst_mr.rkey(),
        };
        a.qp.post_send(&[SendWr {
            wr_id: u64::from(i),
            op: SendOp::Write(remote),
            sges: &sge,
            signaled: false,
            inline: false,
        }])
        .unwrap_or_else(|e| panic!("unsignaled post {i} of {n}: {e}"));
    }
    // Let them all execute (every write has landed): they still hold their slots.
    ncclwasm_testkit::wait_until("the unsignaled writes land", TIMEOUT, || {
        dst.to_vec()[..8 * n as usize].iter().all(|&b| b == 0xA5)
    });
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    let e =
        a.qp.post_send(&[sig(99, SendOp::Write(remote), &sge)])
            .unwrap_err();
    assert_eq!(
        post_err(e),
        (0, libc::ENOMEM),
        "post {} on a full never-signaled queue",
        n + 1
    );
    quiet(&a.cq, Duration::ZERO, "unsignaled writes");
}

/// A signaled WR retires the unsignaled ones before it: ten rounds of a full queue each.
pub fn unsignaled_retirement(b: Backend) {
    let _g = shared();
    let caps = QpCaps {
        max_send_wr: 16,
        ..default_caps()
    };
    let (a, peer) = pair(&b.fabric(), caps);
    let n = a.qp.caps().max_send_wr as usize;
    let src = DmaBuf::new(8 * n);
    let dst = DmaBuf::new(8 * n);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    for round in 0..10u64 {
        let data: Vec<u8> = (0..n as u64)
            .flat_map(|i| (round << 32 | i).to_le_bytes())
            .collect();
        src.write(0, &data);
        let sges: Vec<[Sge; 1]> = (0..n)
            .map(|i| [src_mr.sge(8 * i as u64, 8).unwrap()])
            .collect();
        let wrs: Vec<SendWr<'_>> = (0..n)
            .map(|i| SendWr {
                wr_id: round * 1000 + i as u64,
                op: SendOp::Write(Remote {
                    addr: dst_mr.addr() + 8 * i as u64,
                    rkey: dst_mr.rkey(),
                }),
                sges: &sges[i],
                signaled: i == n - 1,
                inline: false,
            })
            .collect();
        a.qp.post_send(&wrs)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let wc = wait(&a.cq, 1, "retirement")[0];
        assert_eq!(
            (wc.wr_id, wc.status),
            (round * 1000 + n as u64 - 1, WcStatus::Success),
            "round {round}"
        );
        assert_bytes(&dst.to_vec(), &data, &format!("round {round}"));
    }
    quiet(
        &a.cq,
        Duration::from_millis(20),
        "only signaled WRs complete",
    );
}

/// WRITE_WITH_IMM before the receive is posted: RNR NAKs and retries, then success once the
/// receive arrives — nothing completes in between.
pub fn rnr_then_success(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let data = pattern(3, 4096);
    let src = DmaBuf::new(4096);
    src.write(0, &data);
    let dst = DmaBuf::new(GUARD + DST_OFF + 4096 + GUARD);
    dst.fill(GUARD_BYTE);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 4096).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr() + (GUARD + DST_OFF) as u64,
        rkey: dst_mr.rkey(),
    };
    a.qp.post_send(&[sig(1, SendOp::WriteImm(remote, 7), &sge)])
        .unwrap();
    quiet(
        &a.cq,
        Duration::from_millis(300),
        "sender while the receiver has no receive",
    );
    quiet(&peer.cq, Duration::ZERO, "receiver without a receive");
    peer.qp
        .post_recv(&[RecvWr {
            wr_id: 2,
            sges: &[],
        }])
        .unwrap();
    let wc = wait(&a.cq, 1, "after RNR")[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    let r = wait(&peer.cq, 1, "receive after RNR")[0];
    assert_eq!((r.wr_id, r.status, r.imm), (2, WcStatus::Success, Some(7)));
    check_dst(&dst, &data, "write after RNR");
}

/// 10,000 WRITE_WITH_IMMs: receives complete in posting order, and each one's data (and all
/// earlier data) is in memory when its completion is seen.
pub fn order_across_10000_wrs(b: Backend) {
    const N: u32 = 10_000;
    const SLOTS: u32 = 512;
    const BATCH: u32 = 64;
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let src = DmaBuf::new(8 * N as usize);
    src.write(
        0,
        &(0..N)
            .flat_map(|i| u64::from(i).to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let dst = DmaBuf::new(8 * SLOTS as usize);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let recv_window = peer.qp.caps().max_recv_wr.min(256);
    assert!(
        recv_window < SLOTS,
        "slots must outnumber outstanding receives"
    );
    std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            let recvs: Vec<RecvWr<'_>> = (0..recv_window)
                .map(|i| RecvWr {
                    wr_id: u64::from(i),
                    sges: &[],
                })
                .collect();
            peer.qp.post_recv(&recvs).unwrap();
            let mut posted = recv_window;
            let mut next = 0u32;
            let mut buf = [Completion::default(); 64];
            let deadline = Instant::now() + TIMEOUT;
            while next < N {
                let k = peer.cq.poll(&mut buf).unwrap();
                for wc in &buf[..k] {
                    assert_eq!(wc.status, WcStatus::Success, "receive {next}");
                    assert_eq!(wc.imm, Some(next), "receive order");
                    assert_eq!(wc.wr_id, u64::from(next), "receive wr_id order");
                    let mut v = [0u8; 8];
                    dst.read(8 * (next % SLOTS) as usize, &mut v);
                    assert_eq!(
                        u64::from_le_bytes(v),
                        u64::from(next),
                        "data of WR {next} before its completion"
                    );
                    next += 1;
                    if posted < N {
                        peer.qp
                            .post_recv(&[RecvWr {
                                wr_id: u64::from(posted),
                                sges: &[],
                            }])
                            .unwrap();
                        posted += 1;
                    }
                }
                assert!(Instant::now() < deadline, "receiver stuck at {next}");
            }
        });
        // Batches of BATCH WRs (the last one shorter), each ending in its one signaled WR.
        let mut sent = 0u32;
        let mut in_flight = std::collections::VecDeque::new();
        let sq = a.qp.caps().max_send_wr;
        while sent < N || !in_flight.is_empty() {
            while sent < N
                && (sent - in_flight.front().map_or(sent, |&(first, _)| first)) + BATCH <= sq
            {
                let end = (sent + BATCH).min(N);
                let sges: Vec<[Sge; 1]> = (sent..end)
                    .map(|i| [src_mr.sge(8 * u64::from(i), 8).unwrap()])
                    .collect();
                let wrs: Vec<SendWr<'_>> = (sent..end)
                    .zip(&sges)
                    .map(|(i, sge)| SendWr {
                        wr_id: u64::from(i),
                        op: SendOp::WriteImm(
                            Remote {
                                addr: dst_mr.addr() + 8 * u64::from(i % SLOTS),
                                rkey: dst_mr.rkey(),
                            },
                            i,
                        ),
                        sges: sge,
                        signaled: i + 1 == end,
                        inline: false,
                    })
                    .collect();
                a.qp.post_send(&wrs).unwrap();
                in_flight.push_back((sent, end));
                sent = end;
            }
            let (_, end) = in_flight.pop_front().expect("a batch in flight");
            let wc = wait(&a.cq, 1, "sender")[0];
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(wc.wr_id, u64::from(end - 1), "send completion order");
        }
        receiver.join().unwrap();
    });
}

/// Entering ERR flushes every outstanding receive and send WR with `WR_FLUSH_ERR`.
pub fn flush_to_error(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let src = DmaBuf::new(4096);
    let dst = DmaBuf::new(4096);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let recvs: Vec<RecvWr<'_>> = (0..8)
        .map(|i| RecvWr {
            wr_id: 100 + i,
            sges: &[],
        })
        .collect();
    a.qp.post_recv(&recvs).unwrap();
    let sge = [src_mr.sge(0, 4096).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    // The first send waits for a receive the peer never posts (RNR forever), so all stay queued.
    let sends: Vec<SendWr<'_>> = (0..5)
        .map(|i| {
            sig(
                i,
                if i == 0 {
                    SendOp::WriteImm(remote, 1)
                } else {
                    SendOp::Write(remote)
                },
                &sge,
            )
        })
        .collect();
    a.qp.post_send(&sends).unwrap();
    quiet(&a.cq, Duration::from_millis(100), "queued behind RNR");
    a.qp.to_error().unwrap();
    let mut wcs = wait(&a.cq, 13, "flush");
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "all flushed: {wcs:?}"
    );
    wcs.sort_by_key(|w| w.wr_id);
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 105, 106, 107]
    );
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
    quiet(&a.cq, Duration::from_millis(50), "after the flush");
}

/// Port down: `PORT_ERR` event, port DOWN, work on it fails; port up: `PORT_ACTIVE`.
pub fn port_down_event(b: Backend) {
    let _g = exclusive();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    let src = DmaBuf::new(64);
    let dst = DmaBuf::new(64);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 64).unwrap()];
    // Outstanding work: RNR-blocked until the port goes away.
    a.qp.post_send(&[sig(
        1,
        SendOp::WriteImm(
            Remote {
                addr: dst_mr.addr(),
                rkey: dst_mr.rkey(),
            },
            0,
        ),
        &sge,
    )])
    .unwrap();
    assert!(a.ctx.inject_port_down(1).unwrap(), "port was up");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let ev = a
            .ctx
            .next_async_event(Duration::from_secs(5))
            .unwrap()
            .expect("an async event");
        assert_eq!(
            (ev.kind, ev.port),
            (ncclwasm_verbs::AsyncEventKind::PortErr, Some(1)),
            "{ev:?}"
        );
        assert!(!ev.description.is_empty());
        assert_eq!(
            a.ctx.query_port(1).unwrap().state,
            ncclwasm_model::PortState::Down
        );
        assert!(!a.ctx.inject_port_down(1).unwrap(), "already down");
        let wc = wait(&a.cq, 1, "work on a downed port")[0];
        assert_ne!(
            wc.status,
            WcStatus::Success,
            "a WR on a downed port must fail"
        );
        wait_state(&a.qp, QpState::Err, "QP on a downed port");
    }));
    assert!(a.ctx.inject_port_up(1).unwrap(), "port was down");
    let ev = a
        .ctx
        .next_async_event(Duration::from_secs(5))
        .unwrap()
        .expect("an async event");
    assert_eq!(
        (ev.kind, ev.port),
        (ncclwasm_verbs::AsyncEventKind::PortActive, Some(1)),
        "{ev:?}"
    );
    assert_eq!(
        a.ctx.query_port(1).unwrap().state,
        ncclwasm_model::PortState::Active
    );
    assert_eq!(
        a.ctx.next_async_event(Duration::from_millis(50)).unwrap(),
        None,
        "no more events"
    );
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

/// Discovery through the table (verbs + the provider's sysfs tree) reproduces the topology
/// file the provider was built from.
pub fn discovery_matches_topology(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let path = std::env::var("NCCL_WASM_TOPOLOGY").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../topologies/loopback.toml"
        )
        .to_owned()
    });
    let want = ncclwasm_model::Topology::load(&path).unwrap().ports();
    let got = f.discover(true);
    assert_eq!(got.len(), want.len(), "ports: {got:#?}");
    for (g, w) in got.iter().zip(&want) {
        let strip = |p: &ncclwasm_model::Port| {
            let mut p = p.clone();
            // The prefix length comes from the interface on a real host; the file's is a model.
            p.gids.iter_mut().for_each(|g| g.prefix_len = 0);
            // A file without a PCI path leaves the provider to invent one (its tree needs a
            // device directory for numa_node and driver).
            if w.pci_path.is_empty() {
                p.pci_path.clear();
                p.full_pci_path.clear();
            }
            p
        };
        assert_eq!(strip(g), strip(w), "discovered port vs topology");
    }
}

/// The soft provider only admits peers that present the callee QP's secret (the ECE value):
/// without it, or with a wrong one, the requester fails with RETRY_EXC_ERR and nothing lands.
pub fn peer_without_secret_is_refused(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    if !f.capabilities().ece {
        ncclwasm_testkit::skip(&format!("the {} fabric has no ECE", f.name()));
        return;
    }
    let names = f.device_names();
    for wrong in [None, Some(1u32)] {
        let a = End::new(&f, &names[0], default_caps());
        let peer = End::new(&f, &names[1 % names.len()], default_caps());
        let (ia, mut ip) = (a.info(), peer.info());
        ip.ece = wrong.and_then(|x| {
            ip.ece.map(|e| Ece {
                options: e.options ^ x,
                ..e
            })
        });
        a.rtr(&ip);
        peer.rtr(&ia);
        a.rts();
        peer.rts();
        let refused_before = peer.ctx.refused_connections().unwrap();
        let dst = DmaBuf::new(64);
        dst.fill(GUARD_BYTE);
        let src = DmaBuf::new(64);
        let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
        let sge = [src_mr.sge(0, 64).unwrap()];
        a.qp.post_send(&[sig(
            1,
            SendOp::Write(Remote {
                addr: dst_mr.addr(),
                rkey: dst_mr.rkey(),
            }),
            &sge,
        )])
        .unwrap();
        let wc = wait(&a.cq, 1, "stranger")[0];
        assert_eq!(wc.status, WcStatus::RetryExcErr, "secret {wrong:?}");
        assert_bytes(&dst.to_vec(), &[GUARD_BYTE; 64], "refused peer wrote");
        // Without a secret the requester does not even knock; with a wrong one it is refused.
        if wrong.is_some() {
            assert!(
                peer.ctx.refused_connections().unwrap() > refused_before,
                "the stranger was not counted"
            );
        }
    }
}

/// A link cut for good without a goodbye (a crashed peer, a pulled cable): each side learns
/// of it from its own next work request, which fails with RETRY_EXC_ERR (or flushed) and takes
/// that QP to ERR; a responder hears nothing, as on RC hardware — no async event, no state
/// change while it does not send.
pub fn cut_connection(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let src = DmaBuf::new(4096);
    let dst = DmaBuf::new(4096);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 4096).unwrap()];
    let back = [dst_mr.sge(0, 4096).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    let remote_back = Remote {
        addr: src_mr.addr(),
        rkey: src_mr.rkey(),
    };
    // The connections exist once a first WR went through, each way.
    a.qp.post_send(&[sig(1, SendOp::Write(remote), &sge)])
        .unwrap();
    assert_eq!(
        wait(&a.cq, 1, "before the cut")[0].status,
        WcStatus::Success
    );
    peer.qp
        .post_send(&[sig(1, SendOp::Write(remote_back), &back)])
        .unwrap();
    assert_eq!(
        wait(&peer.cq, 1, "before the cut, back")[0].status,
        WcStatus::Success
    );
    a.qp.inject_cut().unwrap();
    a.qp.post_send(&[sig(2, SendOp::Write(remote), &sge)])
        .unwrap();
    let wc = wait(&a.cq, 1, "after the cut")[0];
    assert_eq!(wc.wr_id, 2);
    assert!(
        matches!(wc.status, WcStatus::RetryExcErr | WcStatus::WrFlushErr),
        "{wc:?}"
    );
    wait_state(&a.qp, QpState::Err, "requester after the cut");
    assert_eq!(
        peer.qp.state().unwrap(),
        QpState::Rts,
        "a responder does not hear of the cut"
    );
    peer.qp
        .post_send(&[sig(3, SendOp::Write(remote_back), &back)])
        .unwrap();
    let wc = wait(&peer.cq, 1, "the peer after the cut")[0];
    assert_eq!(wc.wr_id, 3);
    assert!(
        matches!(wc.status, WcStatus::RetryExcErr | WcStatus::WrFlushErr),
        "{wc:?}"
    );
    wait_state(&peer.qp, QpState::Err, "the peer after its failed WR");
    for (side, ctx) in [("requester", &a.ctx), ("peer", &peer.ctx)] {
        let ev = ctx.next_async_event(Duration::from_millis(100)).unwrap();
        assert!(ev.is_none(), "{side}: no async event on a cut: {ev:?}");
    }
}

/// With a finite `rnr_retry`, a receiver that never posts makes the sender fail with
/// RNR_RETRY_EXC_ERR (and go to ERR) instead of retrying forever.
pub fn rnr_retries_exhausted(b: Backend) {
    let _g = shared();
    let rts = RtsAttr {
        rnr_retry: 1,
        ..NCCL_RTS
    };
    let (a, peer) = pair_with(&b.fabric(), default_caps(), rts);
    let (src, dst) = (DmaBuf::new(64), DmaBuf::new(64));
    dst.fill(GUARD_BYTE);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 64).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    a.qp.post_send(&[sig(1, SendOp::WriteImm(remote, 5), &sge)])
        .unwrap();
    let wc = wait(&a.cq, 1, "RNR retries")[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RnrRetryExcErr));
    wait_state(&a.qp, QpState::Err, "requester after RNR_RETRY_EXC");
    quiet(&peer.cq, Duration::ZERO, "receiver without receives");
}

/// A responder that stops answering (stalled peer) exhausts a short `timeout`/`retry_cnt`:
/// RETRY_EXC_ERR, requester in ERR.
pub fn retry_timeout_on_a_stalled_peer(b: Backend) {
    let _g = shared();
    // 4.096 µs · 2^8 · (1 + 1) ≈ 2 ms before giving up.
    let rts = RtsAttr {
        timeout: 8,
        retry_cnt: 1,
        ..NCCL_RTS
    };
    let (a, peer) = pair_with(&b.fabric(), default_caps(), rts);
    let (src, dst) = (DmaBuf::new(64), DmaBuf::new(64));
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 64).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    a.qp.post_send(&[sig(1, SendOp::Write(remote), &sge)])
        .unwrap();
    assert_eq!(
        wait(&a.cq, 1, "before the stall")[0].status,
        WcStatus::Success
    );
    peer.qp.inject_stall(Duration::from_secs(2)).unwrap();
    a.qp.post_send(&[sig(2, SendOp::Write(remote), &sge)])
        .unwrap();
    let wc = wait(&a.cq, 1, "stalled peer")[0];
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RetryExcErr));
    wait_state(&a.qp, QpState::Err, "requester after RETRY_EXC");
}

/// SEND lands in the posted receive's buffer: data, length, opcode, nothing past it.
pub fn send_into_posted_receive(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let data = pattern(21, 1000);
    let src = DmaBuf::new(1000);
    src.write(0, &data);
    let dst = DmaBuf::new(GUARD + DST_OFF + 1000 + GUARD);
    dst.fill(GUARD_BYTE);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    // The receive buffer is larger than the message: only 1000 bytes may change.
    let rsge = [dst_mr
        .sge((GUARD + DST_OFF) as u64, 1000 + GUARD as u32 / 2)
        .unwrap()];
    peer.qp
        .post_recv(&[RecvWr {
            wr_id: 7,
            sges: &rsge,
        }])
        .unwrap();
    a.qp.post_send(&[sig(1, SendOp::Send, &[src_mr.sge(0, 1000).unwrap()])])
        .unwrap();
    assert_eq!(wait(&a.cq, 1, "send")[0].status, WcStatus::Success);
    let r = wait(&peer.cq, 1, "send receive")[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len, r.imm),
        (7, WcStatus::Success, WcOpcode::Recv, 1000, None)
    );
    check_dst(&dst, &data, "send");
}

/// A SEND longer than the receive buffer: REM_INV_REQ_ERR at the sender, nothing written
/// past the receive buffer.
pub fn send_longer_than_receive(b: Backend) {
    let _g = shared();
    let (a, peer) = pair(&b.fabric(), default_caps());
    let src = DmaBuf::new(128);
    src.write(0, &pattern(22, 128));
    let dst = DmaBuf::new(128 + GUARD);
    dst.fill(GUARD_BYTE);
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let rsge = [dst_mr.sge(0, 64).unwrap()];
    peer.qp
        .post_recv(&[RecvWr {
            wr_id: 7,
            sges: &rsge,
        }])
        .unwrap();
    a.qp.post_send(&[sig(1, SendOp::Send, &[src_mr.sge(0, 128).unwrap()])])
        .unwrap();
    let wc = wait(&a.cq, 1, "oversized send")[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemInvReqErr));
    wait_state(&a.qp, QpState::Err, "requester after REM_INV_REQ");
    let out = dst.to_vec();
    assert_bytes(
        &out[64..],
        &[GUARD_BYTE; 64 + GUARD],
        "past the receive buffer",
    );
}

/// More completions than the CQ holds: reported as an error (poll_cq fails or CQ_ERR), never
/// silently dropped.
pub fn cq_overrun_is_reported(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    let names = f.device_names();
    let a = End::new(&f, &names[0], default_caps());
    let peer = End::new(&f, &names[1 % names.len()], default_caps());
    // Replace a's CQ with a tiny one: a fresh QP on it, connected to the peer.
    let small = a.ctx.create_cq(4).unwrap();
    let qp =
        a.pd.create_qp(&small, &small, default_caps(), false)
            .unwrap();
    qp.to_init(&InitAttr {
        pkey_index: 0,
        port: 1,
        access: ALL_ACCESS,
    })
    .unwrap();
    let a = End {
        qp,
        cq: Arc::clone(&small),
        ..a
    };
    let (ia, ip) = (a.info(), peer.info());
    a.rtr(&ip);
    peer.rtr(&ia);
    a.rts();
    peer.rts();
    let (src, dst) = (DmaBuf::new(8), DmaBuf::new(8));
    let (src_mr, dst_mr) = (a.reg(&src, ALL_ACCESS), peer.reg(&dst, ALL_ACCESS));
    let sge = [src_mr.sge(0, 8).unwrap()];
    let remote = Remote {
        addr: dst_mr.addr(),
        rkey: dst_mr.rkey(),
    };
    let n = small.depth() as u64 + 8;
    let wrs: Vec<SendWr<'_>> = (0..n)
        .map(|i| sig(i, SendOp::Write(remote), &sge))
        .collect();
    a.qp.post_send(&wrs).unwrap();
    // Waits for the report rather than a guessed time. Polling before the overrun would take
    // completions out and prevent it, so the event is awaited first; a backend that only fails
    // poll_cq still passes, once the deadline has passed.
    let event = a.ctx.next_async_event(TIMEOUT).unwrap();
    let mut buf = [Completion::default(); 64];
    let polled = small.poll(&mut buf);
    let reported = polled.is_err()
        || event
            .as_ref()
            .is_some_and(|e| e.kind == ncclwasm_verbs::AsyncEventKind::CqErr);
    assert!(
        reported,
        "{n} completions into a CQ of {}: poll {polled:?}, event {event:?}",
        small.depth()
    );
}

/// `reg_mr_iova2` with relaxed ordering: remote addresses are IOVAs, data lands at the right
/// CPU address; an IOVA MR is never read inline. `reg_dmabuf_mr` fails cleanly (no dma-buf).
pub fn iova_and_dmabuf_registration(b: Backend) {
    let _g = shared();
    let f = b.fabric();
    if !f.capabilities().reg_mr_iova2 {
        ncclwasm_testkit::skip(&format!("the {} fabric has no reg_mr_iova2", f.name()));
        return;
    }
    let (a, peer) = pair(&f, default_caps());
    let data = pattern(31, 5000);
    let src = DmaBuf::new(5000);
    src.write(0, &data);
    let dst = DmaBuf::new(GUARD + DST_OFF + 5000 + GUARD);
    dst.fill(GUARD_BYTE);
    let src_mr = a.reg(&src, ALL_ACCESS);
    const IOVA: u64 = 0x7700_0000_0000;
    let dst_mr = peer
        .pd
        .reg_mr_iova2(
            Arc::clone(&dst),
            IOVA,
            ALL_ACCESS | Access::RELAXED_ORDERING,
        )
        .unwrap();
    assert_eq!(dst_mr.addr(), IOVA);
    let remote = Remote {
        addr: IOVA + (GUARD + DST_OFF) as u64,
        rkey: dst_mr.rkey(),
    };
    a.qp.post_send(&[sig(
        1,
        SendOp::Write(remote),
        &[src_mr.sge(0, 5000).unwrap()],
    )])
    .unwrap();
    assert_eq!(
        wait(&a.cq, 1, "write to an IOVA MR")[0].status,
        WcStatus::Success
    );
    check_dst(&dst, &data, "write to an IOVA MR");
    let iova_sge = [dst_mr.sge(0, 8).unwrap()];
    let e = peer.qp.post_send(&[SendWr {
        wr_id: 2,
        op: SendOp::Write(remote),
        sges: &iova_sge,
        signaled: true,
        inline: true,
    }]);
    assert!(
        matches!(e, Err(VerbsError::Invalid(_))),
        "inline from an IOVA MR: {e:?}"
    );

    if f.capabilities().reg_dmabuf_mr {
        let file = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        match peer.pd.reg_dmabuf_mr(file.as_fd(), 0, 4096, 0, ALL_ACCESS) {
            Err(VerbsError::Verb {
                verb: "reg_dmabuf_mr",
                errno,
                ..
            }) => {
                assert!(
                    [
                        libc::EOPNOTSUPP,
                        libc::EPROTONOSUPPORT,
                        libc::EBADF,
                        libc::EINVAL
                    ]
                    .contains(&errno),
                    "errno {errno}"
                )
            }
            other => panic!("a dma-buf registration of /dev/null: {other:?}"),
        }
    }
}

pub use super::peer::{
    discovery_matches_every_topology_file, two_network_namespaces, two_processes,
};

/// A memfd of `len` bytes and one shared mapping of it (the test's own view, as a GPU buffer's
/// CPU mapping would be); the fd is closed and the mapping removed when the value drops.
struct MemfdView {
    fd: std::os::fd::OwnedFd,
    ptr: *mut u8,
    len: usize,
}

impl MemfdView {
    fn new(len: usize) -> MemfdView {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a NUL-terminated name, no flags.
        let raw = unsafe { libc::memfd_create(c"conformance-dmabuf".as_ptr(), 0) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: a fresh fd owned by nobody else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        // SAFETY: the fd just made.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) }, 0);
        // SAFETY: a fresh shared mapping of the whole memfd.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap of the memfd");
        MemfdView {
            fd,
            ptr: p.cast(),
            len,
        }
    }

    fn read(&self, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= self.len);
        // SAFETY: inside the mapping; the device writes were completed before.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }.to_vec()
    }

    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: inside the mapping; no device access is in flight.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
}

impl Drop for MemfdView {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A dma-buf registration (a memfd standing in for GPU memory): NCCL's fd -1 probe says
/// "supported", bytes written by RDMA WRITE appear in the test's own mapping of the fd, bytes the
/// test writes there are what an RDMA READ returns, and addressing is by the IOVA alone.
pub fn dmabuf_registration(b: Backend) {
    use std::os::fd::AsFd;
    let _g = shared();
    let f = b.fabric();
    let (a, peer) = pair(&f, default_caps());
    assert!(peer.pd.dmabuf_supported(), "the fd -1 probe");
    let view = MemfdView::new(4 * 4096);
    const IOVA: u64 = 0x5500_0000_1000;
    const OFF: u64 = 4096;
    const LEN: usize = 2 * 4096;
    let mr = peer
        .pd
        .reg_dmabuf_mr(view.fd.as_fd(), OFF, LEN, IOVA, ALL_ACCESS)
        .expect("a memfd registers as a dma-buf");
    assert_eq!(mr.addr(), IOVA);
    view.write(0, &vec![GUARD_BYTE; 4 * 4096]);

    let data = pattern(77, 5000);
    let src = DmaBuf::new(5000);
    src.write(0, &data);
    let src_mr = a.reg(&src, ALL_ACCESS);
    let remote = Remote {
        addr: IOVA + 100,
        rkey: mr.rkey(),
    };
    let sge = [src_mr.sge(0, 5000).unwrap()];
    a.qp.post_send(&[sig(1, SendOp::Write(remote), &sge)])
        .unwrap();
    assert_eq!(
        wait(&a.cq, 1, "write into a dma-buf")[0].status,
        WcStatus::Success
    );
    let at = OFF as usize + 100;
    assert_bytes(
        &view.read(at, 5000),
        &data,
        "dma-buf bytes seen through the fd",
    );
    assert_bytes(&view.read(at - 1, 1), &[GUARD_BYTE], "guard before");
    assert_bytes(&view.read(at + 5000, 1), &[GUARD_BYTE], "guard after");

    let back = pattern(78, 300);
    view.write(OFF as usize + 7000, &back);
    let dst = DmaBuf::new(300);
    let dst_mr = a.reg(&dst, ALL_ACCESS);
    let sge = [dst_mr.sge(0, 300).unwrap()];
    let remote = Remote {
        addr: IOVA + 7000,
        rkey: mr.rkey(),
    };
    a.qp.post_send(&[sig(2, SendOp::Read(remote), &sge)])
        .unwrap();
    assert_eq!(
        wait(&a.cq, 1, "read from a dma-buf")[0].status,
        WcStatus::Success
    );
    assert_bytes(&dst.to_vec(), &back, "read from a dma-buf");

    // Past the registered pages is out of bounds, like any MR.
    let remote = Remote {
        addr: IOVA + LEN as u64 - 10,
        rkey: mr.rkey(),
    };
    a.qp.post_send(&[sig(3, SendOp::Write(remote), &sge)])
        .unwrap();
    assert_ne!(
        wait(&a.cq, 1, "write past a dma-buf")[0].status,
        WcStatus::Success
    );
    drop(mr);

    // Past the end of the dma-buf: refused, as the kernel refuses it.
    match peer
        .pd
        .reg_dmabuf_mr(view.fd.as_fd(), 3 * 4096, 2 * 4096, 0, ALL_ACCESS)
    {
        Err(VerbsError::Verb { errno, .. }) => assert_eq!(errno, libc::EINVAL),
        other => panic!("a registration past the memfd's end: {other:?}"),
    }

    // An fd the provider cannot map: as a kernel without dma-buf support.
    let (r, _w) = std::io::pipe().unwrap();
    match peer.pd.reg_dmabuf_mr(r.as_fd(), 0, 4096, 0, ALL_ACCESS) {
        Err(VerbsError::Verb { errno, .. }) => assert_eq!(errno, libc::EOPNOTSUPP),
        other => panic!("a pipe registered as a dma-buf: {other:?}"),
    }
}
