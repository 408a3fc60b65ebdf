//! In-process delivery ([`Delivery::InProcess`]) where its locking could go wrong: the posting
//! thread delivers, so concurrent posters on one QP must keep the queue's order, two QPs
//! delivering to each other from two threads must not deadlock, and a QP connected to itself
//! delivers to itself. Only the provider's own table can be told to deliver in process (the
//! cdylib reads `NCCL_WASM_SOFT_DELIVERY` once), so on other backends these do nothing.

use ncclwasm_soft::Delivery;

use super::*;

/// Runs `test` with a fabric whose QPs made meanwhile deliver in process; alone, as the
/// delivery is global (see `atomics::each_delivery`), and TCP restored before the test runs.
fn in_process(b: Backend, make: impl FnOnce(&Arc<Fabric>) -> Vec<End>, test: impl FnOnce(&[End])) {
    if b != Backend::Soft {
        return;
    }
    let _g = exclusive();
    ncclwasm_soft::set_delivery(Delivery::InProcess);
    let ends = make(&b.fabric());
    ncclwasm_soft::set_delivery(Delivery::Tcp);
    test(&ends);
}

/// Four threads post 256 zero-length WRITE_WITH_IMMs each on one QP at once, while one of
/// them is delivering: the receiver's completions come in the order of the sender's (its send
/// queue's order), every WR once.
pub fn in_process_concurrent_posters_keep_order(b: Backend) {
    const THREADS: u64 = 4;
    const EACH: u64 = 256;
    const ALL: usize = (THREADS * EACH) as usize;
    let caps = QpCaps {
        max_send_wr: ALL as u32,
        max_recv_wr: ALL as u32,
        ..default_caps()
    };
    let make = |f: &Arc<Fabric>| {
        let (a, peer) = pair(f, caps);
        vec![a, peer]
    };
    in_process(b, make, |ends| {
        let (a, peer) = (&ends[0], &ends[1]);
        let buf = DmaBuf::new(8);
        let mr = peer.reg(&buf, ALL_ACCESS);
        let remote = Remote {
            addr: mr.addr(),
            rkey: mr.rkey(),
        };
        for i in 0..ALL as u64 {
            peer.qp
                .post_recv(&[RecvWr {
                    wr_id: i,
                    sges: &[],
                }])
                .unwrap();
        }
        std::thread::scope(|s| {
            for t in 0..THREADS {
                s.spawn(move || {
                    for i in 0..EACH {
                        let id = (t << 16 | i) as u32;
                        a.qp.post_send(&[sig(u64::from(id), SendOp::WriteImm(remote, id), &[])])
                            .unwrap();
                    }
                });
            }
        });
        let sent = wait(&a.cq, ALL, "in process: sends");
        let received = wait(&peer.cq, ALL, "in process: receives");
        assert!(
            sent.iter()
                .chain(&received)
                .all(|c| c.status == WcStatus::Success)
        );
        let sent: Vec<u64> = sent.iter().map(|c| c.wr_id).collect();
        let received: Vec<u64> = received
            .iter()
            .map(|c| u64::from(c.imm.expect("imm")))
            .collect();
        assert_eq!(sent, received, "delivered in the send queue's order");
        for t in 0..THREADS {
            let mine: Vec<u64> = sent.iter().copied().filter(|id| id >> 16 == t).collect();
            assert!(
                mine.iter().copied().eq((0..EACH).map(|i| t << 16 | i)),
                "thread {t}'s WRs in its order, each once"
            );
        }
    });
}

/// Two QPs connected to each other write into each other from two threads at once, 5000
/// signaled 8-byte WRITEs each, so each thread delivers into the QP the other posts on: all
/// complete (a lock taken in the wrong order would hang here).
pub fn in_process_both_ways_from_two_threads(b: Backend) {
    const EACH: u64 = 5000;
    const WINDOW: u64 = 64;
    let make = |f: &Arc<Fabric>| {
        let (a, peer) = pair(f, default_caps());
        vec![a, peer]
    };
    in_process(b, make, |ends| {
        let bufs: Vec<(Arc<DmaBuf>, Mr)> = ends
            .iter()
            .map(|e| {
                let buf = DmaBuf::new(16);
                let mr = e.reg(&buf, ALL_ACCESS);
                (buf, mr)
            })
            .collect();
        std::thread::scope(|s| {
            for (me, other) in [(0, 1), (1, 0)] {
                let (end, src, dst) = (&ends[me], &bufs[me].1, &bufs[other].1);
                s.spawn(move || {
                    let remote = Remote {
                        addr: dst.addr() + 8 * me as u64,
                        rkey: dst.rkey(),
                    };
                    let sge = [src.sge(0, 8).unwrap()];
                    let mut done = 0;
                    for i in 0..EACH {
                        end.qp
                            .post_send(&[sig(i, SendOp::Write(remote), &sge)])
                            .unwrap();
                        if i + 1 - done >= WINDOW {
                            done +=
                                wait(&end.cq, WINDOW as usize, "in process: writes").len() as u64;
                        }
                    }
                    let rest = wait(&end.cq, (EACH - done) as usize, "in process: writes");
                    assert!(rest.iter().all(|c| c.status == WcStatus::Success));
                });
            }
        });
    });
}

/// A QP whose peer is itself delivers to itself in process: a WRITE and a WRITE_WITH_IMM
/// within its own memory, a READ back, each byte checked; then a WRITE_WITH_IMM with no
/// receive posted fails at once (`IBV_WC_RNR_RETRY_EXC_ERR`), as only in-process delivery
/// fails it (over TCP, with NCCL's infinite RNR retries, it would wait).
pub fn in_process_loopback(b: Backend) {
    let make = |f: &Arc<Fabric>| {
        let names = f.device_names();
        let a = End::new(f, &names[0], default_caps());
        a.rtr(&a.info());
        a.rts();
        vec![a]
    };
    in_process(b, make, |ends| {
        let a = &ends[0];
        let buf = DmaBuf::new(4096);
        let data = pattern(17, 1000);
        buf.write(0, &data);
        let mr = a.reg(&buf, ALL_ACCESS);
        let at = |off: u64| Remote {
            addr: mr.addr() + off,
            rkey: mr.rkey(),
        };
        a.qp.post_recv(&[RecvWr {
            wr_id: 9,
            sges: &[],
        }])
        .unwrap();
        let src = [mr.sge(0, 1000).unwrap()];
        let back = [mr.sge(3000, 1000).unwrap()];
        a.qp.post_send(&[
            sig(1, SendOp::Write(at(1000)), &src),
            sig(2, SendOp::WriteImm(at(2000), 7), &src),
            sig(3, SendOp::Read(at(1000)), &back),
        ])
        .unwrap();
        let got = wait(&a.cq, 4, "loopback");
        assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
        let recv = got.iter().find(|c| c.wr_id == 9).expect("the receive");
        assert_eq!((recv.imm, recv.byte_len), (Some(7), 1000));
        let bytes = buf.to_vec();
        for off in [1000, 2000, 3000] {
            assert_bytes(
                &bytes[off..off + 1000],
                &data,
                &format!("loopback at {off}"),
            );
        }
        a.qp.post_send(&[sig(4, SendOp::WriteImm(at(0), 8), &[])])
            .unwrap();
        let c = wait(&a.cq, 1, "loopback without a receive");
        assert_eq!((c[0].wr_id, c[0].status), (4, WcStatus::RnrRetryExcErr));
    });
}
