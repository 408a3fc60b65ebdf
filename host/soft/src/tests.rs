//! Engine tests through the C entry points, two QPs in one process over loopback TCP.

use std::ptr;
use std::time::{Duration, Instant};

use ibverbs_sys::*;

use super::abi::device::new_context;
use super::abi::objects::ctx_of;
use super::abi::{self, cq::poll_cq};
use super::ctx::Ctx;
use super::fabric::Fabric;
use super::fault;
use super::mr::{LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE};

mod pull;
mod serve;

const ALL: u32 = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;

/// The fields of an `ibv_wc` the tests look at (`ibv_wc` itself is not `Clone`).
#[derive(Clone, Copy, Debug)]
struct Got {
    wr_id: u64,
    status: u32,
    opcode: u32,
    byte_len: u32,
    wc_flags: u32,
    imm: u32,
}

fn got(wc: &[ibv_wc]) -> impl Iterator<Item = Got> + '_ {
    wc.iter().map(|w| Got {
        wr_id: w.wr_id,
        status: w.status,
        opcode: w.opcode,
        byte_len: w.byte_len,
        wc_flags: w.wc_flags,
        // SAFETY: both union members are plain u32s.
        imm: unsafe { w.imm_data_invalidated_rkey_union.imm_data },
    })
}

/// One side: context, PD, one CQ for both queues, one QP.
struct Node {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    own_ctx: bool,
}

// SAFETY: verbs objects may be used from any thread (the table's contract); tests share a
// Node with one helper thread that only posts receives and polls.
unsafe impl Sync for Node {}

fn open_default(index: usize) -> *mut ibv_context {
    let mut n = 0;
    // SAFETY: valid out-pointer; the list is freed below and devices outlive it.
    unsafe {
        let list = abi::get_device_list(&mut n);
        assert!(n >= 2, "loopback topology has two devices");
        let ctx = abi::open_device(*list.add(index));
        abi::free_device_list(list);
        assert!(!ctx.is_null());
        ctx
    }
}

/// A context on a private fabric, for faults that would disturb other tests on the shared one.
fn open_private() -> *mut ibv_context {
    open_private_on(ncclwasm_model::Topology::loopback())
}

/// A context of the first device of a private fabric made from `topo`.
pub(crate) fn open_private_on(topo: ncclwasm_model::Topology) -> *mut ibv_context {
    let fabric: &'static Fabric = Box::leak(Box::new(Fabric::new(topo)));
    let dev = &fabric.devices[0];
    let ctx = Ctx::new(fabric, dev).expect("context");
    new_context(ctx, (&raw const dev.ibv).cast_mut())
}

/// The next async event of `ctx` (its kind and port number), or `None` if none comes within
/// `wait`.
pub(crate) fn next_event(ctx: *mut ibv_context, wait: Duration) -> Option<(ibv_event_type, i32)> {
    let mut p = libc::pollfd {
        // SAFETY: live context.
        fd: unsafe { (*ctx).async_fd },
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut p, 1, ms) } != 1 {
        return None;
    }
    // SAFETY: live context; event on the stack.
    unsafe {
        let mut ev: ibv_async_event = std::mem::zeroed();
        assert_eq!(abi::get_async_event(ctx, &mut ev), 0);
        let port = ev.element.port_num;
        abi::ack_async_event(&mut ev);
        Some((ev.event_type, port))
    }
}

/// The state `query_port` reports of port `port` of `ctx`, a live context.
pub(crate) fn query_port_state(ctx: *mut ibv_context, port: u8) -> ibv_port_state::Type {
    // SAFETY: a live context; the attributes on the stack (a full ibv_port_attr).
    unsafe {
        let mut pa: ibv_port_attr = std::mem::zeroed();
        assert_eq!(abi::query_port(ctx, port, (&raw mut pa).cast()), 0);
        pa.state
    }
}

/// Closes `ctx`, a context opened by the calling test and closed only here.
pub(crate) fn close(ctx: *mut ibv_context) {
    // SAFETY: per the function's contract.
    assert_eq!(unsafe { abi::close_device(ctx) }, 0);
}

impl Node {
    fn on(ctx: *mut ibv_context, own_ctx: bool, cqe: i32, max_send_wr: u32, sig_all: bool) -> Node {
        // SAFETY: a live context; init attr filled below.
        unsafe {
            let pd = abi::alloc_pd(ctx);
            let cq = abi::create_cq(ctx, cqe, ptr::null_mut(), ptr::null_mut(), 0);
            assert!(!pd.is_null() && !cq.is_null());
            let mut ia: ibv_qp_init_attr = std::mem::zeroed();
            ia.send_cq = cq;
            ia.recv_cq = cq;
            ia.qp_type = ibv_qp_type::IBV_QPT_RC;
            ia.sq_sig_all = i32::from(sig_all);
            ia.cap.max_send_wr = max_send_wr;
            ia.cap.max_recv_wr = 64;
            ia.cap.max_send_sge = 4;
            ia.cap.max_recv_sge = 4;
            ia.cap.max_inline_data = 64;
            let qp = abi::create_qp(pd, &mut ia);
            assert!(!qp.is_null());
            Node {
                ctx,
                pd,
                cq,
                qp,
                own_ctx,
            }
        }
    }

    fn new(dev: usize) -> Node {
        Node::on(open_default(dev), true, 256, 64, false)
    }

    fn reg(&self, buf: &mut [u8], access: u32) -> *mut ibv_mr {
        // SAFETY: live PD, the buffer outlives the MR in every test.
        let mr = unsafe { abi::reg_mr(self.pd, buf.as_mut_ptr().cast(), buf.len(), access as i32) };
        assert!(!mr.is_null());
        mr
    }

    fn modify(&self, a: &mut ibv_qp_attr, m: ibv_qp_attr_mask) -> i32 {
        // SAFETY: live QP, attr on the stack.
        unsafe { abi::modify_qp(self.qp, a, m.0 as i32) }
    }

    fn init(&self) {
        // SAFETY: zeroed attr is valid C data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.port_num = 1;
        a.qp_access_flags = ALL;
        use ibv_qp_attr_mask as m;
        assert_eq!(
            self.modify(
                &mut a,
                m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS
            ),
            0
        );
    }

    fn rtr(&self, peer: &Node, rnr_timer: u8) -> i32 {
        self.rtr_psn(peer, rnr_timer, 0)
    }

    /// RTR expecting the peer's packets from PSN `rq_psn` (what it gives as its `sq_psn`).
    fn rtr_psn(&self, peer: &Node, rnr_timer: u8, rq_psn: u32) -> i32 {
        let mut gid: ibv_gid = ibv_gid { raw: [0; 16] };
        // SAFETY: live context and QP; out-param on the stack.
        let qpn = unsafe {
            assert_eq!(abi::query_gid(peer.ctx, 1, 1, &mut gid), 0);
            (*peer.qp).qp_num
        };
        self.rtr_to(qpn, gid, rnr_timer, rq_psn)
    }

    /// RTR towards QP `dest_qpn` at GID `dgid` (GID index 1 of port 1 on this side).
    fn rtr_to(&self, dest_qpn: u32, dgid: ibv_gid, rnr_timer: u8, rq_psn: u32) -> i32 {
        // SAFETY: zeroed attr is valid C data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_4096;
        a.dest_qp_num = dest_qpn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = rnr_timer;
        a.rq_psn = rq_psn;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = dgid;
        a.ah_attr.grh.sgid_index = 1;
        a.ah_attr.grh.hop_limit = 255;
        a.ah_attr.port_num = 1;
        use ibv_qp_attr_mask as m;
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )
    }

    fn rts(&self, timeout: u8, retry: u8, rnr_retry: u8) -> i32 {
        self.rts_psn(timeout, retry, rnr_retry, 0)
    }

    /// RTS sending from PSN `sq_psn`.
    fn rts_psn(&self, timeout: u8, retry: u8, rnr_retry: u8, sq_psn: u32) -> i32 {
        // SAFETY: zeroed attr is valid C data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = sq_psn;
        a.timeout = timeout;
        a.retry_cnt = retry;
        a.rnr_retry = rnr_retry;
        a.max_rd_atomic = 1;
        use ibv_qp_attr_mask as m;
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    fn state(&self) -> u32 {
        // SAFETY: live QP, out-params on the stack.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            let mut ia: ibv_qp_init_attr = std::mem::zeroed();
            assert_eq!(abi::query_qp(self.qp, &mut a, 0, &mut ia), 0);
            a.qp_state
        }
    }

    fn post_send(
        &self,
        wr_id: u64,
        op: u32,
        sge: Option<(&[u8], u32)>,
        raddr: u64,
        rkey: u32,
        signaled: bool,
    ) -> i32 {
        // Immediate data: the WR id, in network order.
        let imm = (wr_id as u32).to_be();
        // SAFETY: WR and SGE on the stack, read during the call only.
        unsafe {
            let mut s: ibv_sge = std::mem::zeroed();
            let mut wr: ibv_send_wr = std::mem::zeroed();
            if let Some((buf, lkey)) = sge {
                s.addr = buf.as_ptr() as u64;
                s.length = buf.len() as u32;
                s.lkey = lkey;
                wr.sg_list = &mut s;
                wr.num_sge = 1;
            }
            wr.wr_id = wr_id;
            wr.opcode = op;
            wr.send_flags = if signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.imm_data_invalidated_rkey_union.imm_data = imm;
            wr.wr.rdma.remote_addr = raddr;
            wr.wr.rdma.rkey = rkey;
            let mut bad: *mut ibv_send_wr = ptr::null_mut();
            let rc = ((*(*self.qp).context).ops.post_send.expect("ops filled"))(
                self.qp, &mut wr, &mut bad,
            );
            if rc != 0 {
                assert_eq!(bad, &raw mut wr, "bad_wr names the refused WR");
            }
            rc
        }
    }

    fn post_recv(&self, wr_id: u64, sge: Option<(&mut [u8], u32)>) -> i32 {
        // SAFETY: WR and SGE on the stack.
        unsafe {
            let mut s: ibv_sge = std::mem::zeroed();
            let mut wr: ibv_recv_wr = std::mem::zeroed();
            if let Some((buf, lkey)) = sge {
                s.addr = buf.as_mut_ptr() as u64;
                s.length = buf.len() as u32;
                s.lkey = lkey;
                wr.sg_list = &mut s;
                wr.num_sge = 1;
            }
            wr.wr_id = wr_id;
            let mut bad = ptr::null_mut();
            ((*(*self.qp).context).ops.post_recv.expect("ops filled"))(self.qp, &mut wr, &mut bad)
        }
    }

    /// Polls until `want` completions arrived (or panics after 10 s).
    fn wait(&self, want: usize) -> Vec<Got> {
        self.wait_pausing(want, Duration::ZERO)
    }

    /// Like [`Node::wait`], sleeping `pause` after an empty poll (zero: just yield).
    fn wait_pausing(&self, want: usize, pause: Duration) -> Vec<Got> {
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < want {
            // SAFETY: zeroed wc array on the stack; live CQ.
            let n = unsafe {
                let mut wc: [ibv_wc; 8] = std::mem::zeroed();
                let n = ((*(*self.cq).context).ops.poll_cq.expect("ops filled"))(
                    self.cq,
                    8,
                    wc.as_mut_ptr(),
                );
                assert!(n >= 0, "poll_cq failed");
                out.extend(got(&wc[..n as usize]));
                n
            };
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {want} completions, got {}",
                out.len()
            );
            match (n, pause.is_zero()) {
                (0, false) => std::thread::sleep(pause),
                (0, true) => std::thread::yield_now(),
                _ => {}
            }
        }
        out
    }

    /// Polls for `d` and returns what arrived.
    fn drain_for(&self, d: Duration) -> Vec<Got> {
        let mut out = Vec::new();
        let until = Instant::now() + d;
        while Instant::now() < until {
            // SAFETY: as in `wait`.
            unsafe {
                let mut wc: [ibv_wc; 8] = std::mem::zeroed();
                let n = ((*(*self.cq).context).ops.poll_cq.expect("ops filled"))(
                    self.cq,
                    8,
                    wc.as_mut_ptr(),
                );
                out.extend(got(&wc[..n.max(0) as usize]));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    }

    fn next_event(&self) -> Option<(ibv_event_type, i32)> {
        next_event(self.ctx, Duration::from_secs(2))
    }

    /// A responder that refused a request: its QP goes to ERR (within a bounded wait) and its
    /// context reports `IBV_EVENT_QP_ACCESS_ERR`, as a NIC's.
    fn refused_as_a_responder(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.state() != ibv_qp_state::IBV_QPS_ERR {
            assert!(Instant::now() < deadline, "responder QP goes to ERR too");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            self.next_event().map(|e| e.0),
            Some(ibv_event_type::IBV_EVENT_QP_ACCESS_ERR)
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: tear down in verbs order; every pointer is live and freed once.
        unsafe {
            assert_eq!(abi::destroy_qp(self.qp), 0);
            assert_eq!(abi::destroy_cq(self.cq), 0);
            abi::dealloc_pd(self.pd);
            if self.own_ctx {
                assert_eq!(abi::close_device(self.ctx), 0);
            }
        }
    }
}

/// Exchanges ECE (the secret) and brings both QPs to RTS, as the transport's handshake does.
fn connect(a: &Node, b: &Node, rnr_timer: u8, timeout: u8, retry: u8, rnr_retry: u8) {
    // SAFETY: live QPs; ECE values on the stack.
    unsafe {
        let (mut ea, mut eb): (ibv_ece, ibv_ece) = (std::mem::zeroed(), std::mem::zeroed());
        assert_eq!(abi::query_ece(a.qp, &mut ea), 0);
        assert_eq!(abi::query_ece(b.qp, &mut eb), 0);
        assert_eq!(abi::set_ece(a.qp, &mut eb), 0);
        assert_eq!(abi::set_ece(b.qp, &mut ea), 0);
    }
    a.init();
    b.init();
    assert_eq!(a.rtr(b, rnr_timer), 0);
    assert_eq!(b.rtr(a, rnr_timer), 0);
    assert_eq!(a.rts(timeout, retry, rnr_retry), 0);
    assert_eq!(b.rts(timeout, retry, rnr_retry), 0);
}

fn pair() -> (Node, Node) {
    let (a, b) = (Node::new(0), Node::new(1));
    connect(&a, &b, 1, 14, 7, 7);
    (a, b)
}

fn mr_keys(mr: *mut ibv_mr) -> (u32, u32) {
    // SAFETY: live MR.
    unsafe { ((*mr).lkey, (*mr).rkey) }
}

fn dereg(mr: *mut ibv_mr) {
    // SAFETY: live MR, deregistered once.
    assert_eq!(unsafe { abi::dereg_mr(mr) }, 0);
}

#[test]
fn write_with_imm_read_and_send_move_the_bytes() {
    let (a, b) = pair();
    let mut src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; 100_000];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ);
    let (lkey, _) = mr_keys(smr);
    let (_, rkey) = mr_keys(dmr);
    assert_eq!(b.post_recv(9, None), 0);
    let imm = 1u32.to_be();
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            Some((&src, lkey)),
            dst.as_ptr() as u64,
            rkey,
            true
        ),
        0
    );
    let wc = a.wait(1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (
            1,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RDMA_WRITE
        )
    );
    let rc = b.wait(1);
    assert_eq!(
        (rc[0].wr_id, rc[0].opcode, rc[0].byte_len),
        (9, ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, 100_000)
    );
    assert_ne!(rc[0].wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0, 0);
    assert_eq!(rc[0].imm, imm);
    assert_eq!(src, dst);

    // READ it back into a fresh local buffer.
    let mut back = vec![0u8; 1000];
    let bmr = a.reg(&mut back, LOCAL_WRITE);
    assert_eq!(
        a.post_send(
            2,
            ibv_wr_opcode::IBV_WR_RDMA_READ,
            Some((&back, mr_keys(bmr).0)),
            dst.as_ptr() as u64 + 500,
            rkey,
            true
        ),
        0
    );
    let wc = a.wait(1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (
            2,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RDMA_READ
        )
    );
    assert_eq!(back[..], src[500..1500]);

    // SEND lands in the posted receive buffer.
    let mut rbuf = vec![0u8; 64];
    let rmr = b.reg(&mut rbuf, LOCAL_WRITE);
    assert_eq!(b.post_recv(10, Some((&mut rbuf, mr_keys(rmr).0))), 0);
    assert_eq!(
        a.post_send(
            3,
            ibv_wr_opcode::IBV_WR_SEND,
            Some((&src[..40], lkey)),
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].opcode, ibv_wc_opcode::IBV_WC_SEND);
    let rc = b.wait(1);
    assert_eq!(
        (rc[0].wr_id, rc[0].opcode, rc[0].byte_len),
        (10, ibv_wc_opcode::IBV_WC_RECV, 40)
    );
    assert_eq!(rbuf[..40], src[..40]);
    for mr in [smr, dmr, bmr, rmr] {
        dereg(mr);
    }
}

#[test]
fn unsignaled_reads_stay_within_max_rd_atomic_and_complete() {
    let (a, b) = pair();
    let mut remote: Vec<u8> = (0..64u8).collect();
    let rmr = b.reg(&mut remote, LOCAL_WRITE | REMOTE_READ);
    let mut local = vec![0u8; 64];
    let lmr = a.reg(&mut local, LOCAL_WRITE);
    // max_rd_atomic is 1: each READ waits for the previous one's response.
    for i in 0..4u64 {
        let at = 16 * i as usize;
        assert_eq!(
            a.post_send(
                i,
                ibv_wr_opcode::IBV_WR_RDMA_READ,
                Some((&local[at..at + 16], mr_keys(lmr).0)),
                remote.as_ptr() as u64 + at as u64,
                mr_keys(rmr).1,
                i == 3,
            ),
            0
        );
    }
    let wc = a.wait(1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status),
        (3, ibv_wc_status::IBV_WC_SUCCESS)
    );
    assert_eq!(local, remote);
    dereg(rmr);
    dereg(lmr);
}

#[test]
fn state_machine_follows_attr_masks() {
    let (a, b) = (Node::new(0), Node::new(1));
    let mut buf = vec![0u8; 8];
    let mr = a.reg(&mut buf, LOCAL_WRITE);
    // Posting before RTS: EINVAL with bad_wr set (checked inside post_send).
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&buf, mr_keys(mr).0)),
            0,
            0,
            true
        ),
        libc::EINVAL
    );
    assert_eq!(a.post_recv(1, None), libc::EINVAL, "no receives in RESET");
    // RESET→RTR skips INIT: refused.
    assert_eq!(a.rtr(&b, 1), libc::EINVAL);
    // RESET→INIT without the port: refused.
    // SAFETY: zeroed attr is valid C data.
    let mut at: ibv_qp_attr = unsafe { std::mem::zeroed() };
    at.qp_state = ibv_qp_state::IBV_QPS_INIT;
    use ibv_qp_attr_mask as m;
    assert_eq!(
        a.modify(
            &mut at,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_ACCESS_FLAGS
        ),
        libc::EINVAL
    );
    a.init();
    assert_eq!(a.state(), ibv_qp_state::IBV_QPS_INIT);
    assert_eq!(a.post_recv(2, None), 0, "receives allowed from INIT");
    assert_eq!(a.rts(14, 7, 7), libc::EINVAL, "INIT→RTS skips RTR");
    b.init();
    assert_eq!(a.rtr(&b, 1), 0);
    // SAFETY: live QP.
    assert_eq!(unsafe { (*a.qp).state }, ibv_qp_state::IBV_QPS_RTR);
    // RTR→RTS with an attribute RTS does not accept (DEST_QPN): refused.
    at.qp_state = ibv_qp_state::IBV_QPS_RTS;
    assert_eq!(
        a.modify(
            &mut at,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC
                | m::IBV_QP_DEST_QPN
        ),
        libc::EINVAL
    );
    assert_eq!(a.rts(14, 7, 7), 0);
    // Any state → ERR flushes the pending receive.
    at.qp_state = ibv_qp_state::IBV_QPS_ERR;
    assert_eq!(a.modify(&mut at, m::IBV_QP_STATE), 0);
    let wc = a.wait(1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status),
        (2, ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
    );
    // Posting in ERR completes with a flush, as hardware does.
    assert_eq!(
        a.post_send(
            3,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&buf, mr_keys(mr).0)),
            0,
            0,
            false
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
    // ERR → RESET → INIT again.
    at.qp_state = ibv_qp_state::IBV_QPS_RESET;
    assert_eq!(a.modify(&mut at, m::IBV_QP_STATE), 0);
    a.init();
    dereg(mr);
}

#[test]
fn remote_violations_write_nothing_and_fail_both_qps() {
    for case in 0..3 {
        let (a, b) = pair();
        let src = vec![0xabu8; 64];
        let mut src = src;
        let mut big = vec![0u8; 256];
        let smr = a.reg(&mut src, LOCAL_WRITE);
        // The target MR is the middle 64 bytes of `big`; guard bytes around it must stay zero.
        let (mr, raddr, rkey) = {
            let access = if case == 2 {
                LOCAL_WRITE | REMOTE_READ
            } else {
                LOCAL_WRITE | REMOTE_WRITE
            };
            // SAFETY: `big` outlives the MR.
            let mr =
                unsafe { abi::reg_mr(b.pd, big.as_mut_ptr().add(96).cast(), 64, access as i32) };
            let base = big.as_ptr() as u64 + 96;
            match case {
                0 => (mr, base + 32, mr_keys(mr).1), // 64 bytes from +32: past the end
                1 => (mr, base, mr_keys(mr).1 ^ 0x5a5a), // unknown rkey
                _ => (mr, base, mr_keys(mr).1),      // no REMOTE_WRITE
            }
        };
        assert_eq!(
            a.post_send(
                1,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((&src, mr_keys(smr).0)),
                raddr,
                rkey,
                true
            ),
            0
        );
        assert_eq!(
            a.post_send(
                2,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((&src, mr_keys(smr).0)),
                raddr,
                rkey,
                true
            ),
            0
        );
        let wc = a.wait(2);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (1, ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            "case {case}"
        );
        assert_eq!(
            (wc[1].wr_id, wc[1].status),
            (2, ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
        );
        assert!(big.iter().all(|&x| x == 0), "case {case}: no byte written");
        assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
        b.refused_as_a_responder();
        dereg(smr);
        dereg(mr);
    }
}

#[test]
fn local_protection_error_on_bad_lkey() {
    let (a, b) = pair();
    let mut dst = vec![0u8; 16];
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let src = vec![1u8; 16];
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, 0xdead_beef)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_LOC_PROT_ERR);
    assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
    assert!(dst.iter().all(|&x| x == 0));
    dereg(dmr);
}

#[test]
fn rnr_is_retried_then_succeeds_or_exhausts() {
    // Infinite retries (7): the write waits until a receive is posted.
    let (a, b) = pair();
    let mut dst = vec![0u8; 8];
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let mut src = vec![7u8; 8];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    assert!(
        a.drain_for(Duration::from_millis(100)).is_empty(),
        "no completion without a receive"
    );
    assert!(dst.iter().all(|&x| x == 0), "nothing placed while RNR");
    assert_eq!(b.post_recv(4, None), 0);
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(b.wait(1)[0].wr_id, 4);
    assert_eq!(dst, src);
    dereg(dmr);
    dereg(smr);
    drop((a, b));

    // rnr_retry = 2: exhausted.
    let (a, b) = (Node::new(0), Node::new(1));
    connect(&a, &b, 1, 14, 7, 2);
    let mut dst = vec![0u8; 8];
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let mut src = vec![7u8; 8];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR);
    dereg(dmr);
    dereg(smr);
}

#[test]
fn writes_land_before_a_later_imm_completes_and_unsignaled_retire_late() {
    let (a, b) = pair();
    let n = 32usize;
    let chunk = 64 * 1024;
    let mut src: Vec<u8> = (0..n * chunk).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; n * chunk];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    assert_eq!(b.post_recv(77, None), 0);
    for i in 0..n {
        let s = &src[i * chunk..(i + 1) * chunk];
        assert_eq!(
            a.post_send(
                i as u64,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((s, mr_keys(smr).0)),
                dst.as_ptr() as u64 + (i * chunk) as u64,
                mr_keys(dmr).1,
                false
            ),
            0
        );
    }
    assert_eq!(
        a.post_send(
            100,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    let rc = b.wait(1);
    assert_eq!(rc[0].wr_id, 77);
    // The imm's completion implies every earlier write is in memory.
    assert!(
        src == dst,
        "earlier WRITE data visible at the WRITE_WITH_IMM completion"
    );
    let wc = a.wait(1);
    assert_eq!(
        (wc.len(), wc[0].wr_id),
        (1, 100),
        "only the signaled WR completes"
    );
    dereg(smr);
    dereg(dmr);
}

#[test]
fn go_back_n_after_rnr_keeps_order_and_data() {
    let (a, b) = pair();
    let n = 300usize;
    let slot = 4096usize;
    let mut src: Vec<u8> = (0..n * slot)
        .map(|i| (i / slot) as u8 ^ (i % 253) as u8)
        .collect();
    let mut dst = vec![0u8; n * slot];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let dst_addr = dst.as_ptr() as u64;
    std::thread::scope(|s| {
        // The receiver posts receives in small, late batches: the sender keeps hitting RNR.
        let rx = s.spawn(|| {
            let mut seen = 0u64;
            while seen < n as u64 {
                for _ in 0..7 {
                    assert_eq!(b.post_recv(seen, None), 0);
                }
                std::thread::sleep(Duration::from_millis(1));
                for wc in b.wait(7.min(n - seen as usize)) {
                    assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
                    assert_eq!(wc.imm, (seen as u32).to_be(), "receive order");
                    seen += 1;
                }
            }
        });
        for i in 0..n {
            let sge = &src[i * slot..(i + 1) * slot];
            let signaled = i % 10 == 9 || i == n - 1;
            let remote = dst_addr + (i * slot) as u64;
            let op = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            while a.post_send(
                i as u64,
                op,
                Some((sge, mr_keys(smr).0)),
                remote,
                mr_keys(dmr).1,
                signaled,
            ) == libc::ENOMEM
            {
                a.wait(1);
            }
        }
        rx.join().expect("receiver");
    });
    assert!(src == dst, "every write landed exactly once, in place");
    dereg(smr);
    dereg(dmr);
}

#[test]
fn never_signaled_queue_fills_up() {
    let (a, b) = (Node::on(open_default(0), true, 64, 4, false), Node::new(1));
    connect(&a, &b, 1, 14, 7, 7);
    let mut dst = vec![0u8; 8];
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    let mut src = vec![1u8; 8];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let post = |id| {
        a.post_send(
            id,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            false,
        )
    };
    for id in 0..4 {
        assert_eq!(post(id), 0);
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(post(4), libc::ENOMEM, "unsignaled WRs hold their slots");
    assert!(a.drain_for(Duration::from_millis(20)).is_empty());
    dereg(dmr);
    dereg(smr);
}

#[test]
fn strangers_are_refused_and_counted() {
    let (a, b) = pair();
    // SAFETY: live context.
    let before = unsafe { fault::refused_connections(b.ctx) };
    // SAFETY: live QPs.
    let (qpn, src_qpn) = unsafe { ((*b.qp).qp_num, (*a.qp).qp_num) };
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], (qpn >> 8) as u16));
    use std::io::{Read, Write};
    // Right QPN, wrong proof.
    let mut s = std::net::TcpStream::connect(target).expect("listener up");
    s.write_all(&super::wire::encode_hello(src_qpn, qpn, 0x1234))
        .expect("send hello");
    let mut r = [0u8; 4];
    s.read_exact(&mut r).expect("verdict");
    assert_eq!(
        u32::from_le_bytes(r),
        super::wire::HelloReply::Refused as u32
    );
    // Garbage.
    let mut s = std::net::TcpStream::connect(target).expect("listener up");
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").expect("send");
    let _ = s.read(&mut r);
    // SAFETY: live context.
    assert_eq!(unsafe { fault::refused_connections(b.ctx) }, before + 2);
    // The real pair still works.
    let mut buf = vec![3u8; 8];
    let mr = b.reg(&mut buf, LOCAL_WRITE | REMOTE_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(b.post_recv(1, None), 0);
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    dereg(mr);
}

/// A callee that was given its caller's ECE demands its secret: a caller that never called
/// `set_ece` is refused, counted, and its WR completes with RETRY_EXC_ERR.
#[test]
fn a_callee_that_exchanged_ece_refuses_a_caller_without_its_secret() {
    let (a, b) = (Node::new(0), Node::new(1));
    // SAFETY: live QPs; ECE values on the stack. Only the callee learns the caller's ECE.
    unsafe {
        let mut ea: ibv_ece = std::mem::zeroed();
        assert_eq!(abi::query_ece(a.qp, &mut ea), 0);
        assert_eq!(abi::set_ece(b.qp, &mut ea), 0);
    }
    a.init();
    b.init();
    assert_eq!(a.rtr(&b, 1), 0);
    assert_eq!(b.rtr(&a, 1), 0);
    assert_eq!(a.rts(10, 1, 7), 0);
    // SAFETY: live context.
    let before = unsafe { fault::refused_connections(b.ctx) };
    assert_eq!(
        a.post_send(1, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    // SAFETY: live context.
    let after = unsafe { fault::refused_connections(b.ctx) };
    assert!(after > before, "the peer counted us");
}

/// Brings two QPs that never exchanged ECE to RTS with the PSNs each told the other out of band
/// (`a` sends from `a_psn`, `b` expects `b_expects`), as a verbs program without ECE does.
fn connect_without_ece(a: &Node, b: &Node, a_psn: u32, b_expects: u32) {
    a.init();
    b.init();
    assert_eq!(a.rtr_psn(b, 1, 0x00ab_cdef), 0);
    assert_eq!(b.rtr_psn(a, 1, b_expects), 0);
    assert_eq!(a.rts_psn(10, 1, 7, a_psn), 0);
    assert_eq!(b.rts_psn(10, 1, 7, 0x00ab_cdef), 0);
}

/// Without ECE a connection is admitted as RC hardware admits it, by QPN, address and PSN:
/// WRITE_WITH_IMM and SEND/RECV both ways move every byte.
#[test]
fn without_ece_the_psn_admits_a_connection() {
    let (a, b) = (Node::new(0), Node::new(1));
    connect_without_ece(&a, &b, 0x0012_3456, 0x0012_3456);
    let mut src: Vec<u8> = (0..65_536u32).map(|i| (i * 11) as u8).collect();
    let mut dst = vec![0u8; 65_536];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    assert_eq!(b.post_recv(7, None), 0);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(b.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(src, dst);

    // SEND from b to a: b's own connection, admitted by the PSN a's RTR expects.
    let mut msg: Vec<u8> = (0..1000u32).map(|i| (i * 3) as u8).collect();
    let mut got = vec![0u8; 1000];
    let mmr = b.reg(&mut msg, LOCAL_WRITE);
    let gmr = a.reg(&mut got, LOCAL_WRITE);
    let glkey = mr_keys(gmr).0;
    assert_eq!(a.post_recv(8, Some((&mut got, glkey))), 0);
    assert_eq!(
        b.post_send(
            2,
            ibv_wr_opcode::IBV_WR_SEND,
            Some((&msg, mr_keys(mmr).0)),
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(b.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    let rc = a.wait(1);
    assert_eq!(
        (rc[0].status, rc[0].byte_len),
        (ibv_wc_status::IBV_WC_SUCCESS, 1000)
    );
    assert_eq!(msg, got);
    for mr in [smr, dmr, mmr, gmr] {
        dereg(mr);
    }
}

/// Without ECE a caller whose PSN is not the one the callee's RTR expects is a stranger.
#[test]
fn without_ece_a_wrong_psn_is_refused() {
    let (a, b) = (Node::new(0), Node::new(1));
    connect_without_ece(&a, &b, 0x0012_3456, 0x0065_4321);
    // SAFETY: live context.
    let before = unsafe { fault::refused_connections(b.ctx) };
    assert_eq!(
        a.post_send(1, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    // SAFETY: live context.
    assert!(unsafe { fault::refused_connections(b.ctx) } > before);
}

/// A QP connected to itself, as NCCL's IB transport connects its GPU-flush QP (no ECE): an RDMA
/// READ of its own MR completes with the bytes.
#[test]
fn a_qp_connected_to_itself_reads_its_own_memory() {
    let a = Node::new(0);
    a.init();
    assert_eq!(a.rtr_psn(&a, 1, 0x0000_0777), 0);
    assert_eq!(a.rts_psn(10, 1, 7, 0x0000_0777), 0);
    let mut remote: Vec<u8> = (0..8192u32).map(|i| (i * 5) as u8).collect();
    let mut local = vec![0u8; 8192];
    let rmr = a.reg(&mut remote, LOCAL_WRITE | REMOTE_READ);
    let lmr = a.reg(&mut local, LOCAL_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_READ,
            Some((&local, mr_keys(lmr).0)),
            remote.as_ptr() as u64,
            mr_keys(rmr).1,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(local, remote);
    dereg(rmr);
    dereg(lmr);
}

/// A listener slow to answer a hello (over the 2 s a requester used to wait) may already have
/// admitted the caller; knocking again would be a second connection for one QP, refused for
/// good, and the WR would fail with RETRY_EXC_ERR (the churn hang's refused hellos). The
/// requester waits for the reply within its retry budget instead: one connection. The peer
/// here is a fake QP port that answers "accepted" after 2.5 s and counts connections.
#[test]
fn a_late_hello_reply_is_awaited_not_knocked_again() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        let mut hello = [0u8; super::wire::HELLO_LEN];
        first.read_exact(&mut hello).unwrap();
        std::thread::sleep(Duration::from_millis(2500));
        first
            .write_all(&(super::wire::HelloReply::Accepted as u32).to_le_bytes())
            .unwrap();
        // Any further connection within the next 1.5 s is a knock again.
        listener.set_nonblocking(true).unwrap();
        let end = Instant::now() + Duration::from_millis(1500);
        let mut again = 0;
        while Instant::now() < end {
            if listener.accept().is_ok() {
                again += 1;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        (again, first)
    });
    let a = Node::new(0);
    a.init();
    let mut gid: ibv_gid = ibv_gid { raw: [0; 16] };
    // SAFETY: live context; out-param on the stack.
    assert_eq!(unsafe { abi::query_gid(a.ctx, 1, 1, &mut gid) }, 0);
    // The fake port's QPN: its TCP port in the high bits (see the `ctx` module); its address
    // is ours, 127.0.0.1.
    assert_eq!(a.rtr_to(u32::from(port) << 8 | 1, gid, 1, 0), 0);
    // Retry budget 4.096 µs·2^18·(3+1) ≈ 4.3 s: room for the late reply.
    assert_eq!(a.rts(18, 3, 7), 0);
    assert_eq!(
        a.post_send(1, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
        0
    );
    let (again, _held) = fake.join().unwrap();
    assert_eq!(again, 0, "the requester knocked again after a late reply");
    // The fake never acknowledges the write: it fails when the budget runs out.
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
}

#[test]
fn idle_sockets_on_a_qp_port_do_not_stop_a_legitimate_qp() {
    let (a, b) = (Node::new(0), Node::new(1));
    // SAFETY: live QP and context.
    let (qpn, before) = unsafe { ((*b.qp).qp_num, fault::refused_connections(b.ctx)) };
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], (qpn >> 8) as u16));
    // No secret is needed to open a socket: 100 of them, saying nothing.
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(target).expect("listener up"))
        .collect();
    let t0 = Instant::now();
    // Retry budget 4.096 µs·2^16·(3+1) ≈ 1.1 s: hellos read one at a time (1 s each) miss it.
    connect(&a, &b, 1, 16, 3, 7);
    let mut src: Vec<u8> = (0..4096u32).map(|i| (i * 13) as u8).collect();
    let mut dst = vec![0u8; 4096];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    let wc = a.wait(1);
    let took = t0.elapsed();
    println!("with 100 idle sockets on the port: RTS and a 4 KiB write in {took:.2?}");
    assert_eq!(
        wc[0].status,
        ibv_wc_status::IBV_WC_SUCCESS,
        "the write failed after {took:?} with 100 idle sockets on the port"
    );
    assert_eq!(src, dst);
    assert!(
        took < Duration::from_secs(1),
        "RTS and a write took {took:?}"
    );
    // The idle sockets are strangers: evicted or timed out, each counted once.
    let end = Instant::now() + Duration::from_secs(5);
    // SAFETY: live context.
    while unsafe { fault::refused_connections(b.ctx) } < before + 100 {
        assert!(
            Instant::now() < end,
            "idle sockets not refused within their deadline"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(idle);
    dereg(smr);
    dereg(dmr);
}

#[test]
fn stalled_peer_times_out_and_a_cut_fails_each_sides_next_work() {
    let (a, b) = (Node::new(0), Node::new(1));
    // timeout 13 ≈ 34 ms, retry_cnt 1: ≈ 67 ms budget, far below the stall.
    connect(&a, &b, 1, 13, 1, 7);
    assert_eq!(b.post_recv(1, None), 0);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    // SAFETY: live QP.
    unsafe { fault::stall(b.qp, Duration::from_millis(600)) };
    assert_eq!(b.post_recv(2, None), 0);
    assert_eq!(
        a.post_send(
            2,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    drop((a, b));

    let (a, b) = pair();
    // Connections open lazily, at the first WR.
    assert_eq!(b.post_recv(1, None), 0);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(
        b.wait(1)[0].status,
        ibv_wc_status::IBV_WC_SUCCESS,
        "the receive"
    );
    // SAFETY: live QP.
    unsafe { fault::cut_connection(a.qp) };
    // Each side learns of the cut from its own next work request, as on RC hardware.
    let write =
        |n: &Node, wr_id| n.post_send(wr_id, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true);
    assert_eq!(write(&a, 2), 0);
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
    assert_eq!(
        b.state(),
        ibv_qp_state::IBV_QPS_RTS,
        "b has not sent anything"
    );
    assert_eq!(write(&b, 3), 0);
    assert_eq!(b.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    assert_eq!(b.state(), ibv_qp_state::IBV_QPS_ERR);
    let quiet = Duration::from_millis(100);
    assert_eq!(
        next_event(a.ctx, quiet),
        None,
        "a responder never hears of the cut"
    );
    assert_eq!(
        next_event(b.ctx, quiet),
        None,
        "a responder never hears of the cut"
    );
}

/// What was posted before `destroy_qp` goes out, as from a NIC that had the doorbell long
/// before the destroy: here the QP never sent before, so its connection opens only after the
/// destroy began. A receiver posting its clear-to-send and closing at once relies on it.
#[test]
fn work_posted_right_before_destroy_still_lands() {
    let (a, b) = pair();
    assert_eq!(b.post_recv(1, None), 0);
    assert_eq!(
        a.post_send(
            7,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            false
        ),
        0
    );
    drop(a);
    let got = b.wait(1);
    assert_eq!(got[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(got[0].imm, 7u32.to_be());
}

/// A peer QP that goes away — destroyed in order, or failed — raises nothing on its partner
/// (a fatal event there is what made NCCL's sender fail after an unsynchronised close, where
/// a NIC stays silent); the partner's next work request finds nobody there, and what the peer
/// acknowledged before it went stays placed.
#[test]
fn a_vanished_peer_is_silent_until_the_next_work_request() {
    for destroyed in [true, false] {
        let (a, b) = pair();
        let mut dst = vec![0u8; 64];
        let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
        let mut src = vec![7u8; 64];
        let smr = a.reg(&mut src, LOCAL_WRITE);
        assert_eq!(
            a.post_send(
                1,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((&src, mr_keys(smr).0)),
                dst.as_ptr() as u64,
                mr_keys(dmr).1,
                true
            ),
            0
        );
        assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!(dst, [7u8; 64], "placed before the peer went");
        // Both directions in use: `a`'s responder serves `b`'s requester too.
        assert_eq!(
            b.post_send(9, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
            0
        );
        assert_eq!(b.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
        let b = match destroyed {
            true => {
                drop(b);
                None
            }
            false => {
                // SAFETY: live QP.
                unsafe { fault::cut_connection(b.qp) };
                Some(b)
            }
        };
        let quiet = Duration::from_millis(100);
        assert_eq!(next_event(a.ctx, quiet), None, "destroyed: {destroyed}");
        assert_eq!(
            a.state(),
            ibv_qp_state::IBV_QPS_RTS,
            "destroyed: {destroyed}"
        );
        assert_eq!(
            a.post_send(
                2,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((&src, mr_keys(smr).0)),
                dst.as_ptr() as u64,
                mr_keys(dmr).1,
                true
            ),
            0
        );
        assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
        assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
        dereg(smr);
        dereg(dmr);
        drop(b);
    }
}

#[test]
fn port_down_up_and_device_fatal_raise_events() {
    let ctx_a = open_private();
    let ctx_b = open_private();
    {
        let a = Node::on(ctx_a, false, 64, 16, false);
        let b = Node::on(ctx_b, false, 64, 16, false);
        connect(&a, &b, 1, 14, 7, 7);
        // SAFETY: live contexts.
        unsafe {
            assert!(fault::port_down(a.ctx, 1));
            assert!(!fault::port_down(a.ctx, 1), "already down");
            let mut pa: ibv_port_attr = std::mem::zeroed();
            assert_eq!(abi::query_port(a.ctx, 1, (&raw mut pa).cast()), 0);
            assert_eq!(pa.state, ibv_port_state::IBV_PORT_DOWN);
        }
        assert_eq!(
            a.next_event(),
            Some((ibv_event_type::IBV_EVENT_PORT_ERR, 1))
        );
        assert_eq!(a.state(), ibv_qp_state::IBV_QPS_ERR);
        // SAFETY: live context.
        assert!(unsafe { fault::port_up(a.ctx, 1) });
        assert_eq!(
            a.next_event(),
            Some((ibv_event_type::IBV_EVENT_PORT_ACTIVE, 1))
        );
        // SAFETY: live context.
        unsafe { fault::kill_device(b.ctx) };
        assert_eq!(
            b.next_event().map(|e| e.0),
            Some(ibv_event_type::IBV_EVENT_DEVICE_FATAL)
        );
        assert!(
            // SAFETY: live context.
            unsafe { abi::alloc_pd(b.ctx) }.is_null(),
            "dead device refuses new resources"
        );
    }
    // SAFETY: contexts opened above, closed once.
    unsafe {
        assert_eq!(abi::close_device(ctx_a), 0);
        assert_eq!(abi::close_device(ctx_b), 0);
    }
}

#[test]
fn a_cq_is_busy_while_a_qp_made_with_it_lives_and_free_once_it_is_destroyed() {
    let (a, b) = pair();
    // SAFETY: a's CQ is live and its QP still uses it.
    assert_eq!(unsafe { abi::destroy_cq(a.cq) }, libc::EBUSY);
    drop(b);
    // SAFETY: the QP is destroyed once here; the CQ then has no QP, and is destroyed once.
    unsafe {
        assert_eq!(abi::destroy_qp(a.qp), 0);
        assert_eq!(abi::destroy_cq(a.cq), 0);
        abi::dealloc_pd(a.pd);
        assert_eq!(abi::close_device(a.ctx), 0);
    }
    // Its objects are freed above.
    std::mem::forget(a);
}

#[test]
fn cq_overrun_raises_cq_err() {
    let (a, b) = (Node::on(open_default(0), true, 2, 8, true), Node::new(1));
    connect(&a, &b, 1, 14, 7, 7);
    for id in 0..3 {
        assert_eq!(
            a.post_send(id, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
            0
        );
    }
    assert_eq!(
        a.next_event().map(|e| e.0),
        Some(ibv_event_type::IBV_EVENT_CQ_ERR)
    );
    // SAFETY: live CQ, wc on the stack.
    let rc = unsafe {
        let mut wc: [ibv_wc; 4] = std::mem::zeroed();
        poll_cq(a.cq, 4, wc.as_mut_ptr())
    };
    assert_eq!(rc, -1, "an overrun CQ reports an error");
}

#[test]
fn dereg_waits_for_an_inflight_remote_write() {
    let (a, b) = pair();
    let len = 32 << 20;
    let mut src = vec![9u8; len];
    let mut dst = vec![0u8; len];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((&src, mr_keys(smr).0)),
            dst.as_ptr() as u64,
            mr_keys(dmr).1,
            true
        ),
        0
    );
    dereg(dmr);
    // Either the write finished before dereg returned, or it was refused; never after.
    let wc = a.wait(1);
    let status = wc[0].status;
    assert!(
        status == ibv_wc_status::IBV_WC_SUCCESS || status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
        "status {status}"
    );
    let snapshot = dst.clone();
    std::thread::sleep(Duration::from_millis(20));
    assert!(snapshot == dst, "no write after dereg returned");
    dereg(smr);
}

#[test]
fn closing_the_context_stops_every_thread() {
    let (ctx_a, ctx_b) = (open_default(0), open_default(1));
    // SAFETY: live contexts.
    let (ta, tb) = unsafe { (ctx_of(ctx_a).threads.clone(), ctx_of(ctx_b).threads.clone()) };
    let a = Node::on(ctx_a, false, 64, 16, false);
    let b = Node::on(ctx_b, false, 64, 16, false);
    connect(&a, &b, 1, 14, 7, 7);
    assert_eq!(b.post_recv(1, None), 0);
    assert_eq!(
        a.post_send(
            1,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            None,
            0,
            0,
            true
        ),
        0
    );
    assert_eq!(
        b.post_send(2, ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, 0, 0, true),
        0
    );
    assert_eq!(a.wait(1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(b.wait(2).len(), 2);
    // Listener + sender + ack reader + responder on each side.
    assert_eq!((ta.live(), tb.live()), (4, 4));
    // Close with the QPs still there: close_device stops their threads too.
    // SAFETY: contexts closed once; the Nodes below only free their own objects.
    unsafe {
        assert_eq!(abi::close_device(ctx_a), 0);
        assert_eq!(abi::close_device(ctx_b), 0);
    }
    assert_eq!((ta.live(), tb.live()), (0, 0));
}

#[test]
fn qpns_name_a_listener_port_and_slot() {
    let n = Node::new(0);
    // SAFETY: live PD/CQ; init attr on the stack; every QP destroyed below.
    let qps: Vec<*mut ibv_qp> = (0..300)
        .map(|_| unsafe {
            let mut ia: ibv_qp_init_attr = std::mem::zeroed();
            ia.send_cq = n.cq;
            ia.recv_cq = n.cq;
            ia.qp_type = ibv_qp_type::IBV_QPT_RC;
            let qp = abi::create_qp(n.pd, &mut ia);
            assert!(!qp.is_null());
            assert_eq!(
                (ia.cap.max_send_wr, ia.cap.max_send_sge),
                (1, 1),
                "granted caps written back"
            );
            qp
        })
        .collect();
    // SAFETY: live QPs.
    let nums: std::collections::HashSet<u32> =
        qps.iter().map(|&q| unsafe { (*q).qp_num }).collect();
    assert_eq!(nums.len(), 300, "unique QPNs");
    let ports: std::collections::HashSet<u32> = nums.iter().map(|q| q >> 8).collect();
    assert!(
        ports.len() >= 2,
        "256 QPs per listener: a second one opened"
    );
    for p in &ports {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", *p as u16)).is_ok(),
            "QPN {p:#x}.. names a live listener"
        );
    }
    for q in qps {
        // SAFETY: created above, destroyed once.
        assert_eq!(unsafe { abi::destroy_qp(q) }, 0);
    }
}

#[test]
fn contexts_report_device_port_and_gids() {
    let ctx = open_default(0);
    // SAFETY: live context; out-params on the stack.
    unsafe {
        let mut da: ibv_device_attr = std::mem::zeroed();
        assert_eq!(abi::query_device(ctx, &mut da), 0);
        assert_eq!(da.phys_port_cnt, 1);
        let mut pa: ibv_port_attr = std::mem::zeroed();
        assert_eq!(abi::query_port(ctx, 1, (&raw mut pa).cast()), 0);
        assert_eq!(
            (pa.state, pa.link_layer, pa.gid_tbl_len),
            (ibv_port_state::IBV_PORT_ACTIVE, 2, 256)
        );
        assert_eq!((pa.active_width, pa.active_speed), (2, 32), "100G = 4X EDR");
        let mut gid = ibv_gid { raw: [0; 16] };
        assert_eq!(abi::query_gid(ctx, 1, 1, &mut gid), 0);
        assert_eq!(gid.raw[10..], [0xff, 0xff, 127, 0, 0, 1]);
        assert_eq!(
            abi::query_gid(ctx, 1, 5, &mut gid),
            0,
            "an unconfigured slot"
        );
        assert_eq!(gid.raw, [0; 16]);
        assert_ne!(abi::query_gid(ctx, 1, 256, &mut gid), 0);
        assert_ne!(abi::query_port(ctx, 2, (&raw mut pa).cast()), 0);
        let name = std::ffi::CStr::from_ptr(abi::get_device_name((*ctx).device));
        assert_eq!(name.to_str(), Ok("soft_0"));
        assert_eq!(abi::close_device(ctx), 0);
    }
}

/// Large WRITE bandwidth against a raw TCP stream measured in the same run (loopback),
/// alternating rounds and comparing the best of each, since the cores are shared.
/// Run with `cargo test -p ncclwasm-verbs --release -- --ignored bandwidth --nocapture`.
#[test]
#[ignore = "benchmark: needs idle cores and a release build"]
fn bandwidth_vs_raw_tcp() {
    let total: usize = 2 << 30;
    let msg = 4 << 20;
    let raw_round = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let rx = std::thread::spawn(move || {
            use std::io::Read;
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = vec![0u8; msg];
            let mut got = 0;
            while got < total {
                got += s.read(&mut buf).expect("read");
            }
        });
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let buf = vec![1u8; msg];
        let t = Instant::now();
        for _ in 0..total / msg {
            s.write_all(&buf).expect("write");
        }
        rx.join().expect("rx");
        total as f64 / t.elapsed().as_secs_f64()
    };
    let (a, b) = (
        Node::on(open_default(0), true, 1024, 256, false),
        Node::new(1),
    );
    connect(&a, &b, 1, 14, 7, 7);
    let mut src = vec![1u8; msg];
    let mut dst = vec![0u8; msg];
    let smr = a.reg(&mut src, LOCAL_WRITE);
    let dmr = b.reg(&mut dst, LOCAL_WRITE | REMOTE_WRITE);
    // The poller sleeps between empty polls so it does not take a core from the data path.
    let pause = Duration::from_micros(50);
    let soft_round = || {
        let t = Instant::now();
        let n = total / msg;
        let window = 8;
        let mut done = 0;
        for i in 0..n {
            if i >= window {
                done += a.wait_pausing(1, pause).len();
            }
            let wr = (
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Some((&src[..], mr_keys(smr).0)),
            );
            assert_eq!(
                a.post_send(
                    i as u64,
                    wr.0,
                    wr.1,
                    dst.as_ptr() as u64,
                    mr_keys(dmr).1,
                    true
                ),
                0
            );
        }
        a.wait_pausing(n - done, pause);
        total as f64 / t.elapsed().as_secs_f64()
    };
    let (mut raw, mut soft) = (0f64, 0f64);
    for _ in 0..3 {
        raw = raw.max(raw_round());
        soft = soft.max(soft_round());
    }
    println!(
        "raw TCP {:.2} GB/s, soft RDMA WRITE {:.2} GB/s, ratio {:.2} (best of 3 each)",
        raw / 1e9,
        soft / 1e9,
        soft / raw
    );
    assert!(soft >= 0.8 * raw, "soft {soft} < 0.8 × raw {raw}");
    dereg(smr);
    dereg(dmr);
}

#[test]
fn verbs_table_is_complete() {
    let t = super::table();
    assert!(t.query_ece.is_some() && t.set_ece.is_some() && t.reg_mr_iova2.is_some());
}
