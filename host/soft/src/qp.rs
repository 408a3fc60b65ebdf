//! The RC queue pair engine: state machine, send and receive queues, and the three threads
//! that play the NIC for one QP.
//!
//! - **sender** (one per QP, from its first posted WR): takes WRs in order, checks their local
//!   keys, and sends header + payload in one `sendmsg` straight from the source buffers (a small
//!   WR posted to an idle queue is sent the same way by the posting thread itself).
//! - **ack reader** (one per outgoing connection): reads ACK / NAK / RNR NAK / READ responses,
//!   scatters READ data straight into the local buffers, retires WRs, runs the retry timer.
//! - **responder** (one per admitted connection): checks every request (rkey, PD, bounds, access,
//!   a receive for the ones that consume one), reads the payload straight into the registered
//!   memory, produces receive completions, answers.
//!
//! Completion semantics follow RC: a signaled WR completes when the responder acknowledged
//! placement (a READ when its data is scattered); unsignaled WRs hold their send-queue slot
//! until a later signaled WR completes; errors always complete; entering ERR flushes.

use std::cell::Cell;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_event_type, ibv_qp_attr_mask as mask, ibv_qp_state, ibv_wc_opcode, ibv_wc_status,
};
use smallvec::SmallVec;
use socket2::{Domain, SockRef, Socket, Type};

use super::ctx::{CqState, Ctx, Pool};
use super::event::{Element, Wc};
use super::mr::{LOCAL_WRITE, MrGuard, REMOTE_READ, REMOTE_WRITE};
use super::traffic::{self, Counter};
use super::wire::{
    self, FLAG_ACK_REQ, HELLO_LEN, HelloReply, Nak, REQ_LEN, RESP_LEN, ReadEnd, ReqOp, Request,
    RespOp, Response,
};

/// Largest message (`ibv_port_attr.max_msg_sz`).
pub(crate) const MAX_MSG: u64 = 1 << 31;
/// Send timeout on sockets: how often a writer blocked on a stalled peer checks for teardown.
const WRITE_TICK: Duration = Duration::from_millis(100);
/// Socket buffer size: large enough to keep a loopback stream busy while the peer places data.
const SOCK_BUF: usize = 4 << 20;
/// How long a QP being destroyed waits for the acknowledgement of what it already sent before
/// it says BYE: a live peer answers within a round trip; a stalled one is not waited for longer.
const DRAIN_ACKS: Duration = Duration::from_millis(500);
/// How long a QP being destroyed keeps reading its outgoing connection after BYE, waiting for
/// the peer's end of it (closing with unread bytes would reset the connection).
const DRAIN_EOF: Duration = Duration::from_millis(200);
/// Messages up to this size are sent by the posting thread itself when the send queue is idle
/// (no hand-off to the sender thread: one thread wake-up less per small message). Larger ones
/// always go through the sender thread, so `post_send` never waits on the network.
const DIRECT_SEND_MAX: u32 = 16 * 1024;
/// IB RNR timer codes (`min_rnr_timer`) in microseconds; code 0 is the longest, 655.36 ms.
const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// One scatter/gather element as posted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A WR's scatter/gather list. One entry is kept inline (NCCL's WRs carry at most one, and the
/// vector it replaces was as large), so posting such a WR allocates nothing; longer lists spill
/// to the heap.
pub(crate) type Sges = SmallVec<[Sge; 1]>;

/// Largest inline payload a QP may ask for (`max_inline_data`).
pub(crate) const MAX_INLINE: u32 = 1024;

/// A posted send WR.
#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub op: ReqOp,
    pub signaled: bool,
    pub sges: Sges,
    /// Payload copied at post time (`IBV_SEND_INLINE`), in a buffer of the QP's
    /// ([`Qp::inline_buffer`]) that goes back to it when the WR retires.
    pub inline: Option<Vec<u8>>,
    pub raddr: u64,
    pub rkey: u32,
    pub imm: u32,
    seq: u64,
    len: u32,
    acked: bool,
    sent_at: Option<Instant>,
}

impl SendWqe {
    pub(crate) fn new(wr_id: u64, op: ReqOp, signaled: bool, sges: Sges) -> SendWqe {
        SendWqe {
            wr_id,
            op,
            signaled,
            sges,
            inline: None,
            raddr: 0,
            rkey: 0,
            imm: 0,
            seq: 0,
            len: 0,
            acked: false,
            sent_at: None,
        }
    }

    /// Whether the requester waits for an answer to it (and so runs the retry timer).
    fn ack_req(&self) -> bool {
        self.signaled || self.op == ReqOp::Read
    }

    fn wc_opcode(&self) -> ibv_wc_opcode::Type {
        match self.op {
            ReqOp::Write | ReqOp::WriteImm => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
            ReqOp::Read => ibv_wc_opcode::IBV_WC_RDMA_READ,
            _ => ibv_wc_opcode::IBV_WC_SEND,
        }
    }
}

/// A posted receive WR.
#[derive(Debug)]
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub sges: Sges,
}

/// The requester's completion status for a NAK's syndrome.
fn nak_status(syndrome: u8) -> ibv_wc_status::Type {
    match syndrome {
        s if s == Nak::RemoteAccess as u8 => ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
        s if s == Nak::RemoteOperation as u8 => ibv_wc_status::IBV_WC_REM_OP_ERR,
        _ => ibv_wc_status::IBV_WC_REM_INV_REQ_ERR,
    }
}

/// Queue capacities granted at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
}

/// The attributes `modify_qp` sets, kept for `query_qp` and the engine.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Attrs {
    pub port: u8,
    pub pkey_index: u16,
    pub access: u32,
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub max_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// `ah_attr` as given: `Some(dgid)` when global, plus the DLID.
    pub dgid: Option<[u8; 16]>,
    pub sgid_index: u8,
    pub dlid: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub sl: u8,
}

/// One TCP connection (one QP direction).
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    epoch: u64,
    /// The payload this connection carries, counted for its local port and peer address.
    traffic: Arc<Counter>,
}

impl Conn {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn kill(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// How a request reaches its responder.
enum Link<'a> {
    /// Over the requester's TCP connection: the payload follows the header on it, and NAKs and
    /// READ data go back on it.
    Tcp(&'a Conn),
    /// Delivered in process ([`crate::Delivery::InProcess`]): the payload is read from, and
    /// READ data written to, the requester's memory.
    Memory(&'a MemLink<'a>),
}

/// The requester's side of an in-process delivery: its pinned payload (or READ destination)
/// segments, consumed in order, and the NAK a refusal answers.
struct MemLink<'a> {
    epoch: u64,
    segs: &'a [(*mut u8, usize)],
    /// Segment and offset in it where the next byte comes from or goes to.
    at: Cell<(usize, usize)>,
    refused: Cell<Option<Nak>>,
}

impl MemLink<'_> {
    /// Copies `len` bytes between the segments (in order, from the cursor) and `ptr`:
    /// `into == true` copies from the segments to `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for `len` bytes in the direction of the copy, and the segments for
    /// the other direction, without overlap.
    unsafe fn copy(&self, ptr: *mut u8, len: usize, into: bool) -> usize {
        let (mut seg, mut off) = self.at.get();
        let mut done = 0;
        while done < len && seg < self.segs.len() {
            let (base, seg_len) = self.segs[seg];
            let n = (seg_len - off).min(len - done);
            // SAFETY: both ranges are in bounds (the caller's contract and the segment's length).
            unsafe {
                let (here, there) = (base.add(off), ptr.add(done));
                if into {
                    std::ptr::copy_nonoverlapping(here, there, n);
                } else {
                    std::ptr::copy_nonoverlapping(there, here, n);
                }
            }
            done += n;
            off += n;
            if off == seg_len {
                seg += 1;
                off = 0;
            }
        }
        self.at.set((seg, off));
        done
    }

    /// A READ's data from the responder's memory into the requester's segments.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes.
    unsafe fn write_from(&self, src: *const u8, len: usize) {
        // SAFETY: per the caller's contract; the segments are pinned and locally writable.
        unsafe { self.copy(src.cast_mut(), len, false) };
    }
}

impl Link<'_> {
    /// The epoch of the responder QP the request was admitted in.
    fn epoch(&self) -> u64 {
        match self {
            Link::Tcp(c) => c.epoch,
            Link::Memory(m) => m.epoch,
        }
    }

    /// Reads the next `len` payload bytes into `dst`.
    ///
    /// # Safety
    /// `dst` must be writable for `len` bytes.
    unsafe fn read_into(&self, dst: *mut u8, len: usize) -> Result<(), ReadEnd> {
        match self {
            // SAFETY: per the caller's contract.
            Link::Tcp(c) => unsafe { wire::read_into(c.fd(), dst, len, false) },
            // SAFETY: per the caller's contract; the segments are pinned and readable.
            Link::Memory(m) => match unsafe { m.copy(dst, len, true) } == len {
                true => Ok(()),
                // Fewer bytes than the header said: as a connection cut mid-payload.
                false => Err(ReadEnd::Closed),
            },
        }
    }

    /// Counts payload received on the port: only what crossed it (in-process delivery
    /// crosses none).
    fn received(&self, bytes: u32) {
        if let Link::Tcp(c) = self {
            c.traffic.received(bytes);
        }
    }
}

/// Where a QP's requests go, decided at its first post after RTS.
#[derive(Debug, Default)]
enum PeerPath {
    #[default]
    Unresolved,
    /// Over TCP (the default, and a peer outside this process).
    Tcp,
    /// Delivered in process to this QP.
    Local(Weak<Qp>),
}

#[derive(Debug)]
struct St {
    state: ibv_qp_state::Type,
    attrs: Attrs,
    /// Resolved address of the peer's port (RTR).
    remote: Option<IpAddr>,
    /// The peer QP's secret, learnt through `set_ece` (the out-of-band handshake).
    peer_secret: Option<u32>,
    /// Incremented on RESET and ERR: threads of an older epoch stop touching the queues.
    epoch: u64,
    sq: VecDeque<SendWqe>,
    next_seq: u64,
    send_cursor: u64,
    rnr_resume: Option<Instant>,
    rnr_tries: u8,
    /// When the ack reader last heard from the responder: like ACKs of earlier packets on
    /// hardware, any answer restarts the retry timer.
    last_heard: Instant,
    rq: VecDeque<RecvWqe>,
    expected_seq: u64,
    req_conn: Option<Arc<Conn>>,
    resp_conn: Option<Arc<Conn>>,
    stall_until: Option<Instant>,
    sender_started: bool,
    /// Someone (the sender thread or a posting thread) is writing a request frame.
    tx_busy: bool,
    /// Set when `destroy` starts: the threads drain and stop.
    destroying: Option<Instant>,
    peer: PeerPath,
}

/// One RC queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    pub qpn: u32,
    pub ctx: Arc<Ctx>,
    pub pd: u32,
    pub caps: Caps,
    pub sq_sig_all: bool,
    /// This QP's secret: a requester must present it to be admitted (see the module docs).
    pub secret: u32,
    /// [`crate::Delivery::InProcess`] was on when the QP was made: WRs to a peer QP in this
    /// process are carried out by the posting thread.
    in_process: bool,
    pub send_cq: Arc<CqState>,
    pub recv_cq: Arc<CqState>,
    /// Address of the `ibv_qp`, for async events.
    pub ibv: AtomicUsize,
    pool: Arc<Pool>,
    st: Mutex<St>,
    cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Inline-data buffers of retired WRs, handed to the next inline posts: a CTS written
    /// inline for every receive then costs no allocation. At most `max_send_wr` are kept, as
    /// many as the send queue can hold.
    inline_spare: Mutex<Vec<Vec<u8>>>,
}

/// Why a connection attempt ended without a connection.
enum ConnectFail {
    /// The QP was reset, destroyed or failed meanwhile: nothing to report.
    Stale,
    /// Refused or no answer before the retry budget ran out.
    Exhausted,
}

impl Qp {
    /// `slot` is the listener pool and QPN [`Ctx::reserve_qpn`] handed out.
    pub(crate) fn new(
        ctx: Arc<Ctx>,
        (pool, qpn): (Arc<Pool>, u32),
        pd: u32,
        caps: Caps,
        sq_sig_all: bool,
        send_cq: Arc<CqState>,
        recv_cq: Arc<CqState>,
    ) -> Arc<Qp> {
        let qp = Arc::new(Qp {
            qpn,
            ctx: Arc::clone(&ctx),
            pd,
            caps,
            sq_sig_all,
            secret: loop {
                let s = super::rand_u32();
                if s != 0 {
                    break s;
                }
            },
            in_process: super::delivery() == super::Delivery::InProcess,
            send_cq,
            recv_cq,
            ibv: AtomicUsize::new(0),
            pool,
            st: Mutex::new(St {
                state: ibv_qp_state::IBV_QPS_RESET,
                attrs: Attrs::default(),
                remote: None,
                peer_secret: None,
                epoch: 0,
                sq: VecDeque::new(),
                next_seq: 0,
                send_cursor: 0,
                rnr_resume: None,
                rnr_tries: 0,
                last_heard: Instant::now(),
                rq: VecDeque::new(),
                expected_seq: 0,
                req_conn: None,
                resp_conn: None,
                stall_until: None,
                sender_started: false,
                tx_busy: false,
                destroying: None,
                peer: PeerPath::Unresolved,
            }),
            cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            inline_spare: Mutex::new(Vec::new()),
        });
        qp.pool.install(qpn, &qp);
        ctx.add_qp(&qp);
        qp
    }

    fn lock(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn state(&self) -> ibv_qp_state::Type {
        self.lock().state
    }

    pub(crate) fn attrs(&self) -> Attrs {
        self.lock().attrs
    }

    pub(crate) fn set_peer_secret(&self, secret: u32) {
        self.lock().peer_secret = Some(secret);
    }

    /// An empty buffer for a WR's inline payload: a retired WR's, or a new one with room for
    /// this QP's largest inline payload.
    pub(crate) fn inline_buffer(&self) -> Vec<u8> {
        let spare = self
            .inline_spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        spare.unwrap_or_else(|| Vec::with_capacity(self.caps.max_inline as usize))
    }

    /// Takes back the inline buffer of a retired WR (see [`Qp::inline_buffer`]).
    fn recycle(&self, w: SendWqe) {
        let Some(mut buf) = w.inline else { return };
        let mut spare = self.inline_spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < self.caps.max_send_wr as usize {
            buf.clear();
            spare.push(buf);
        }
    }

    fn spawn(self: &Arc<Self>, role: &str, f: impl FnOnce(Arc<Qp>) + Send + 'static) {
        let qp = Arc::clone(self);
        let handle = self
            .ctx
            .threads
            .spawn(format!("soft-{role}-{:x}", self.qpn), move || f(qp));
        match handle {
            Ok(h) => self
                .threads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(h),
            Err(e) => {
                tracing::error!(qpn = self.qpn, "soft: cannot start a QP thread: {e}");
                let mut st = self.lock();
                self.fail(&mut st, None, Some(ibv_event_type::IBV_EVENT_QP_FATAL));
            }
        }
    }

    // ----------------------------------------------------------------------------------------
    // State machine

    /// `ibv_modify_qp`: validates the transition and its attribute mask as the kernel's
    /// `ib_modify_qp_is_ok` does, then applies it. Returns an errno.
    pub(crate) fn modify(
        self: &Arc<Self>,
        a: &Attrs,
        state: Option<ibv_qp_state::Type>,
        m: u32,
        cur: Option<ibv_qp_state::Type>,
    ) -> Result<(), i32> {
        let has = |bit: mask| m & bit.0 != 0;
        let mut st = self.lock();
        if st.destroying.is_some() || !super::fabric::alive(self.ctx.dev) {
            return Err(libc::EIO);
        }
        if cur.is_some_and(|c| c != st.state) {
            return Err(libc::EINVAL);
        }
        let from = st.state;
        let to = state.unwrap_or(from);
        use ibv_qp_state::*;
        let (required, optional) = match (from, to) {
            (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
            (IBV_QPS_RESET, IBV_QPS_INIT) => (
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_PORT.0 | mask::IBV_QP_ACCESS_FLAGS.0,
                0,
            ),
            (IBV_QPS_INIT, IBV_QPS_INIT) => (
                0,
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_PORT.0 | mask::IBV_QP_ACCESS_FLAGS.0,
            ),
            (IBV_QPS_INIT, IBV_QPS_RTR) => (
                mask::IBV_QP_AV.0
                    | mask::IBV_QP_PATH_MTU.0
                    | mask::IBV_QP_DEST_QPN.0
                    | mask::IBV_QP_RQ_PSN.0
                    | mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0,
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_ACCESS_FLAGS.0 | mask::IBV_QP_ALT_PATH.0,
            ),
            (IBV_QPS_RTR, IBV_QPS_RTS) => (
                mask::IBV_QP_SQ_PSN.0
                    | mask::IBV_QP_TIMEOUT.0
                    | mask::IBV_QP_RETRY_CNT.0
                    | mask::IBV_QP_RNR_RETRY.0
                    | mask::IBV_QP_MAX_QP_RD_ATOMIC.0,
                mask::IBV_QP_CUR_STATE.0
                    | mask::IBV_QP_ACCESS_FLAGS.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0
                    | mask::IBV_QP_ALT_PATH.0
                    | mask::IBV_QP_PATH_MIG_STATE.0,
            ),
            (IBV_QPS_RTS, IBV_QPS_RTS) => (
                0,
                mask::IBV_QP_CUR_STATE.0
                    | mask::IBV_QP_ACCESS_FLAGS.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0
                    | mask::IBV_QP_ALT_PATH.0
                    | mask::IBV_QP_PATH_MIG_STATE.0,
            ),
            _ => return Err(libc::EINVAL),
        };
        let given = m & !(mask::IBV_QP_STATE.0 | mask::IBV_QP_CUR_STATE.0);
        if given & required != required
            || (to != IBV_QPS_RESET && to != IBV_QPS_ERR && given & !(required | optional) != 0)
        {
            return Err(libc::EINVAL);
        }
        let mut next = st.attrs;
        if has(mask::IBV_QP_PORT) {
            if self.ctx.dev.port(a.port).is_none() {
                return Err(libc::EINVAL);
            }
            next.port = a.port;
        }
        if has(mask::IBV_QP_PKEY_INDEX) {
            if a.pkey_index != 0 {
                return Err(libc::EINVAL);
            }
            next.pkey_index = a.pkey_index;
        }
        if has(mask::IBV_QP_ACCESS_FLAGS) {
            next.access = a.access;
        }
        if has(mask::IBV_QP_PATH_MTU) {
            if !(1..=5).contains(&a.path_mtu) {
                return Err(libc::EINVAL);
            }
            next.path_mtu = a.path_mtu;
        }
        if has(mask::IBV_QP_DEST_QPN) {
            next.dest_qpn = a.dest_qpn & 0xff_ffff;
        }
        if has(mask::IBV_QP_RQ_PSN) {
            next.rq_psn = a.rq_psn & 0xff_ffff;
        }
        if has(mask::IBV_QP_SQ_PSN) {
            next.sq_psn = a.sq_psn & 0xff_ffff;
        }
        if has(mask::IBV_QP_MAX_DEST_RD_ATOMIC) {
            next.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if has(mask::IBV_QP_MAX_QP_RD_ATOMIC) {
            next.max_rd_atomic = a.max_rd_atomic;
        }
        if has(mask::IBV_QP_MIN_RNR_TIMER) {
            next.min_rnr_timer = a.min_rnr_timer & 31;
        }
        if has(mask::IBV_QP_TIMEOUT) {
            next.timeout = a.timeout & 31;
        }
        if has(mask::IBV_QP_RETRY_CNT) {
            next.retry_cnt = a.retry_cnt.min(7);
        }
        if has(mask::IBV_QP_RNR_RETRY) {
            next.rnr_retry = a.rnr_retry.min(7);
        }
        let mut remote = st.remote;
        if has(mask::IBV_QP_AV) {
            let port = self.ctx.dev.port(next.port).ok_or(libc::EINVAL)?;
            if let Some(_gid) = a.dgid {
                if usize::from(a.sgid_index) >= port.gids.len()
                    || port.gids[usize::from(a.sgid_index)].is_unconfigured()
                {
                    return Err(libc::EINVAL);
                }
            } else if port.link_layer == ncclwasm_model::LinkLayer::Ethernet {
                // RoCE has no LIDs: the GRH is mandatory.
                return Err(libc::EINVAL);
            }
            remote = Some(
                self.ctx
                    .fabric
                    .resolve(port, a.dgid, a.dlid)
                    .ok_or(libc::EINVAL)?,
            );
            next.dgid = a.dgid;
            next.sgid_index = a.sgid_index;
            next.dlid = a.dlid;
            next.hop_limit = a.hop_limit;
            next.traffic_class = a.traffic_class;
            next.sl = a.sl;
        }
        st.attrs = next;
        st.remote = remote;
        match to {
            IBV_QPS_RESET => {
                self.drop_conns(&mut st);
                st.epoch += 1;
                st.sq.clear();
                st.rq.clear();
                st.next_seq = 0;
                st.send_cursor = 0;
                st.expected_seq = 0;
                st.rnr_resume = None;
                st.rnr_tries = 0;
                st.attrs = Attrs::default();
                st.remote = None;
                st.peer = PeerPath::Unresolved;
                st.state = IBV_QPS_RESET;
            }
            IBV_QPS_ERR => self.fail(&mut st, None, None),
            IBV_QPS_RTS => {
                st.state = to;
                self.cv.notify_all();
            }
            _ => st.state = to,
        }
        Ok(())
    }

    /// Moves to ERR: `first` (if any) completes with its status, every other outstanding WR
    /// with `IBV_WC_WR_FLUSH_ERR`, connections close, and `event` is raised.
    fn fail(
        &self,
        st: &mut St,
        first: Option<(u64, ibv_wc_status::Type)>,
        event: Option<ibv_event_type>,
    ) {
        if st.state == ibv_qp_state::IBV_QPS_ERR {
            return;
        }
        st.state = ibv_qp_state::IBV_QPS_ERR;
        st.epoch += 1;
        for w in st.sq.drain(..) {
            if w.acked {
                continue;
            }
            let status = match first {
                Some((seq, s)) if seq == w.seq => s,
                _ => ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
            };
            self.send_cq
                .complete(self.send_wc(&w, status, st.attrs.dest_qpn));
        }
        for r in st.rq.drain(..) {
            self.recv_cq.complete(Wc {
                wr_id: r.wr_id,
                status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                opcode: ibv_wc_opcode::IBV_WC_RECV,
                byte_len: 0,
                imm: None,
                qp_num: self.qpn,
                src_qp: st.attrs.dest_qpn,
            });
        }
        st.send_cursor = st.next_seq;
        self.drop_conns(st);
        if let Some(ev) = event {
            self.ctx
                .events
                .push(ev, Element::Qp(self.ibv.load(Ordering::Acquire)));
        }
        self.cv.notify_all();
    }

    fn drop_conns(&self, st: &mut St) {
        for c in [st.req_conn.take(), st.resp_conn.take()]
            .into_iter()
            .flatten()
        {
            c.kill();
        }
    }

    fn send_wc(&self, w: &SendWqe, status: ibv_wc_status::Type, src_qp: u32) -> Wc {
        Wc {
            wr_id: w.wr_id,
            status,
            opcode: w.wc_opcode(),
            byte_len: if w.op == ReqOp::Read { w.len } else { 0 },
            imm: None,
            qp_num: self.qpn,
            src_qp,
        }
    }

    // ----------------------------------------------------------------------------------------
    // Posting

    /// `post_send` of one WR: EINVAL outside RTS (ERR flushes it instead, as hardware does),
    /// ENOMEM when the send queue is full.
    pub(crate) fn post_send(self: &Arc<Self>, mut w: SendWqe) -> Result<(), i32> {
        if w.sges.len() > self.caps.max_send_sge as usize {
            return Err(libc::EINVAL);
        }
        let len: u64 = match &w.inline {
            Some(data) if data.len() > self.caps.max_inline as usize => return Err(libc::EINVAL),
            Some(data) => data.len() as u64,
            None => w.sges.iter().map(|s| u64::from(s.len)).sum(),
        };
        if len > MAX_MSG {
            return Err(libc::EINVAL);
        }
        if self.in_process {
            self.resolve_peer();
        }
        let mut st = self.lock();
        match st.state {
            ibv_qp_state::IBV_QPS_RTS => {}
            ibv_qp_state::IBV_QPS_ERR => {
                self.send_cq.complete(self.send_wc(
                    &w,
                    ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                    st.attrs.dest_qpn,
                ));
                return Ok(());
            }
            _ => return Err(libc::EINVAL),
        }
        if st.sq.len() >= self.caps.max_send_wr as usize {
            return Err(libc::ENOMEM);
        }
        w.len = len as u32;
        w.seq = st.next_seq;
        st.next_seq += 1;
        let seq = w.seq;
        st.sq.push_back(w);
        if let PeerPath::Local(peer) = &st.peer {
            // In process: carried out here and now (the sender thread never sees it).
            let peer = Weak::clone(peer);
            drop(st);
            self.deliver_pending(&peer);
            return Ok(());
        }
        // Idle queue and a small message: send it from this thread, without blocking.
        let direct = match &st.req_conn {
            Some(c)
                if len <= u64::from(DIRECT_SEND_MAX)
                    && !st.tx_busy
                    && st.send_cursor == seq
                    && st.rnr_resume.is_none_or(|t| t <= Instant::now())
                    && self.may_send(&st) =>
            {
                Some((Arc::clone(c), st.epoch))
            }
            _ => None,
        };
        match direct {
            Some((conn, epoch)) => {
                st.tx_busy = true;
                drop(st);
                self.transmit(epoch, &conn, true);
                let mut st = self.lock();
                st.tx_busy = false;
                // Sent whole: the sender thread has nothing to do, so it is not woken (a
                // wake-up per message is a context switch per message on a busy host).
                if self.sender_needed(&st) {
                    self.cv.notify_all();
                }
            }
            // The sender thread starts with the first WR (which it sends after connecting), not
            // at RTS: a QP that never sends (NCCL opens many connections, and a flush QP or a
            // connection's reverse direction may stay idle) costs no thread.
            None if !st.sender_started => {
                st.sender_started = true;
                drop(st);
                self.spawn("send", |qp| qp.sender_loop());
            }
            None => {
                drop(st);
                self.cv.notify_all();
            }
        }
        Ok(())
    }

    /// Whether a thread waiting on `cv` may have something to do: WRs not sent yet (the sender
    /// thread), or a teardown waiting for acknowledgements ([`Qp::say_bye`]).
    fn sender_needed(&self, st: &St) -> bool {
        st.send_cursor < st.next_seq || st.destroying.is_some()
    }

    /// `post_recv` of one WR: EINVAL in RESET, ENOMEM when full; flushed in ERR.
    pub(crate) fn post_recv(&self, r: RecvWqe) -> Result<(), i32> {
        if r.sges.len() > self.caps.max_recv_sge as usize {
            return Err(libc::EINVAL);
        }
        let mut st = self.lock();
        match st.state {
            ibv_qp_state::IBV_QPS_RESET => return Err(libc::EINVAL),
            ibv_qp_state::IBV_QPS_ERR => {
                self.recv_cq.complete(Wc {
                    wr_id: r.wr_id,
                    status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                    opcode: ibv_wc_opcode::IBV_WC_RECV,
                    byte_len: 0,
                    imm: None,
                    qp_num: self.qpn,
                    src_qp: st.attrs.dest_qpn,
                });
                return Ok(());
            }
            _ => {}
        }
        if st.rq.len() >= self.caps.max_recv_wr as usize {
            return Err(libc::ENOMEM);
        }
        st.rq.push_back(r);
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // Requester

    /// The retry budget: `4.096 µs × 2^timeout × (retry_cnt + 1)`; `timeout = 0` is infinite.
    fn retry_budget(a: &Attrs) -> Option<Duration> {
        (a.timeout != 0)
            .then(|| Duration::from_nanos(4096u64 << a.timeout) * (u32::from(a.retry_cnt) + 1))
    }

    fn sender_loop(self: Arc<Self>) {
        enum Job {
            Connect(u64),
            Send(u64, Arc<Conn>),
        }
        loop {
            let job = {
                let mut st = self.lock();
                loop {
                    if let Some(since) = st.destroying {
                        drop(st);
                        self.say_bye(since);
                        return;
                    }
                    let now = Instant::now();
                    let paused = st.rnr_resume.filter(|t| *t > now);
                    if st.state == ibv_qp_state::IBV_QPS_RTS
                        && paused.is_none()
                        && st.send_cursor < st.next_seq
                        && !matches!(st.peer, PeerPath::Local(_))
                    {
                        match &st.req_conn {
                            None => break Job::Connect(st.epoch),
                            Some(c) if !st.tx_busy && self.may_send(&st) => {
                                let job = Job::Send(st.epoch, Arc::clone(c));
                                st.tx_busy = true;
                                break job;
                            }
                            Some(_) => {}
                        }
                    }
                    st = match paused {
                        Some(t) => {
                            self.cv
                                .wait_timeout(st, t - now)
                                .unwrap_or_else(|e| e.into_inner())
                                .0
                        }
                        None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                    };
                }
            };
            match job {
                Job::Connect(epoch) => match self.connect(epoch) {
                    Ok(conn) => {
                        let conn = Arc::new(conn);
                        let mut st = self.lock();
                        if st.epoch != epoch || st.destroying.is_some() {
                            conn.kill();
                            continue;
                        }
                        st.req_conn = Some(Arc::clone(&conn));
                        drop(st);
                        self.spawn("ack", move |qp| qp.ack_loop(conn));
                    }
                    Err(ConnectFail::Stale) => {}
                    Err(ConnectFail::Exhausted) => {
                        let mut st = self.lock();
                        if st.epoch == epoch {
                            let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                            self.fail(
                                &mut st,
                                first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                                None,
                            );
                        }
                    }
                },
                Job::Send(epoch, conn) => {
                    self.transmit(epoch, &conn, false);
                    self.lock().tx_busy = false;
                }
            }
        }
    }

    /// The orderly end of the outgoing connection, as a NIC's transport layer ends it: wait
    /// (at most [`DRAIN_ACKS`]) until everything sent is acknowledged, then BYE and close the
    /// writing side; the ack reader reads on until the peer closes its side. Work posted but
    /// not sent yet is not started (destroying a QP discards it).
    fn say_bye(&self, since: Instant) {
        let mut st = self.lock();
        loop {
            let cursor = st.send_cursor;
            let waiting = st.tx_busy || st.sq.iter().any(|w| !w.acked && w.seq < cursor);
            let left = DRAIN_ACKS.saturating_sub(since.elapsed());
            if !waiting || left.is_zero() || st.req_conn.is_none() {
                break;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let Some(c) = st.req_conn.clone() else {
            return;
        };
        let bye = Request {
            op: ReqOp::Bye,
            flags: 0,
            len: 0,
            seq: st.next_seq,
            raddr: 0,
            rkey: 0,
            imm: 0,
        }
        .encode();
        drop(st);
        let mut iov = [wire::iovec(bye.as_ptr(), bye.len())];
        // SAFETY: the iovec covers the local `bye` array.
        if unsafe { wire::send_all(c.fd(), &mut iov, &|| true, false) }.is_ok() {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
    }

    /// READs in flight stay within `max_rd_atomic` (at least one).
    fn may_send(&self, st: &St) -> bool {
        let Some(w) = Self::wqe(st, st.send_cursor) else {
            return false;
        };
        if w.op != ReqOp::Read {
            return true;
        }
        let reads = st
            .sq
            .iter()
            .filter(|w| w.op == ReqOp::Read && !w.acked && w.seq < st.send_cursor)
            .count();
        reads < usize::from(st.attrs.max_rd_atomic.max(1))
    }

    fn wqe(st: &St, seq: u64) -> Option<&SendWqe> {
        let front = st.sq.front()?.seq;
        st.sq.get(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    fn wqe_mut(st: &mut St, seq: u64) -> Option<&mut SendWqe> {
        let front = st.sq.front()?.seq;
        st.sq
            .get_mut(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    /// Sends the WR at the cursor: local key checks, then header + payload in one `sendmsg`.
    /// With `try_first` (a posting thread), a full socket buffer puts the WR back for the
    /// sender thread instead of waiting. The caller holds `tx_busy`.
    fn transmit(&self, epoch: u64, conn: &Conn, try_first: bool) {
        let mut inline_copy = [0u8; MAX_INLINE as usize];
        let Some((req, sges, inline)) = self.claim(epoch, &mut inline_copy) else {
            return;
        };
        let Some(guards) = self.pin_local(epoch, &req, &sges, inline.is_some()) else {
            return;
        };
        let hdr = req.encode();
        let mut iov: SmallVec<[libc::iovec; 2]> =
            smallvec::smallvec![wire::iovec(hdr.as_ptr(), hdr.len())];
        if req.op != ReqOp::Read {
            match inline {
                Some(data) => iov.push(wire::iovec(data.as_ptr(), data.len())),
                None => {
                    let mut gi = guards.iter();
                    for s in sges.iter().filter(|s| s.len > 0) {
                        let g = gi.next().expect("one guard per non-empty SGE");
                        iov.push(wire::iovec(g.ptr, s.len as usize));
                    }
                }
            }
        }
        let abort = || {
            let st = self.lock();
            st.destroying.is_some() || st.epoch != epoch
        };
        // SAFETY: the iovecs cover `hdr`, the inline copy or MR memory pinned by `guards`, all
        // alive until after the call.
        let sent = unsafe { wire::send_all(conn.fd(), &mut iov, &abort, try_first) };
        drop(guards);
        if let Ok(true) = sent
            && req.op != ReqOp::Read
        {
            conn.traffic.sent(req.len);
        }
        if let Ok(false) = sent {
            let mut st = self.lock();
            st.send_cursor = st.send_cursor.min(req.seq);
            return;
        }
        if sent.is_err() {
            let mut st = self.lock();
            if st.epoch == epoch && st.destroying.is_none() {
                let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                self.fail(
                    &mut st,
                    first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                    None,
                );
            }
        }
    }

    /// Takes the WR at the send cursor: its request header, its SGEs, and its inline payload
    /// copied into `inline_copy` (the WR keeps its own copy for a retransmission, and nothing
    /// here allocates). `None` when the QP moved on meanwhile.
    fn claim<'b>(
        &self,
        epoch: u64,
        inline_copy: &'b mut [u8; MAX_INLINE as usize],
    ) -> Option<(Request, Sges, Option<&'b [u8]>)> {
        let mut st = self.lock();
        if st.epoch != epoch {
            return None;
        }
        let seq = st.send_cursor;
        st.send_cursor += 1;
        let w = Self::wqe_mut(&mut st, seq)?;
        w.sent_at = Some(Instant::now());
        let req = Request {
            op: w.op,
            flags: if w.ack_req() { FLAG_ACK_REQ } else { 0 },
            len: w.len,
            seq: w.seq,
            raddr: w.raddr,
            rkey: w.rkey,
            imm: w.imm,
        };
        let inline = w.inline.as_ref().map(|data| {
            let copy = &mut inline_copy[..data.len()];
            copy.copy_from_slice(data);
            &*copy
        });
        Some((req, w.sges.clone(), inline))
    }

    /// Local protection: every non-empty SGE of `req` inside an MR of our PD with the access
    /// it needs (a READ writes them), pinned while the guards live. A violation fails the QP
    /// (`IBV_WC_LOC_PROT_ERR`) and returns `None`. Inline payloads were copied at post time
    /// and need no key.
    fn pin_local(
        &self,
        epoch: u64,
        req: &Request,
        sges: &[Sge],
        inline: bool,
    ) -> Option<SmallVec<[MrGuard; 1]>> {
        let mut guards = SmallVec::new();
        if inline {
            return Some(guards);
        }
        let need = if req.op == ReqOp::Read {
            LOCAL_WRITE
        } else {
            0
        };
        for s in sges.iter().filter(|s| s.len > 0) {
            match self
                .ctx
                .mrs
                .acquire(s.lkey, self.pd, s.addr, s.len as usize, need)
            {
                Ok(g) => guards.push(g),
                Err(_) => {
                    let mut st = self.lock();
                    if st.epoch == epoch {
                        self.fail(
                            &mut st,
                            Some((req.seq, ibv_wc_status::IBV_WC_LOC_PROT_ERR)),
                            None,
                        );
                    }
                    return None;
                }
            }
        }
        Some(guards)
    }

    // ----------------------------------------------------------------------------------------
    // In-process delivery

    /// With [`crate::Delivery::InProcess`], decides once (at the first post after RTS) whether
    /// the peer QP lives in this process: a QP of this copy of the provider whose number and
    /// address are the ones RTR named, that expects us (RTR/RTS, our number, our port's
    /// address — what `admit` checks of a TCP caller) and whose secret we were given.
    /// Resolved without holding our own lock, so two QPs resolving each other (or a loopback
    /// QP itself) never deadlock.
    fn resolve_peer(&self) {
        let (remote, dest, secret, port) = {
            let st = self.lock();
            if !matches!(st.peer, PeerPath::Unresolved) || st.state != ibv_qp_state::IBV_QPS_RTS {
                return;
            }
            (st.remote, st.attrs.dest_qpn, st.peer_secret, st.attrs.port)
        };
        let mine = self.ctx.dev.port(port).map(|p| p.address);
        let found = remote.and_then(|r| super::ctx::local_qp(self.ctx.fabric, r, dest));
        let path = match found {
            Some(peer) if Some(peer.secret) == secret => {
                let pst = peer.lock();
                let expects_us = matches!(
                    pst.state,
                    ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS
                ) && pst.attrs.dest_qpn == self.qpn
                    && pst.remote.map(|r| r.to_canonical()) == mine.map(|m| m.to_canonical());
                drop(pst);
                if expects_us {
                    PeerPath::Local(Arc::downgrade(&peer))
                } else {
                    PeerPath::Tcp
                }
            }
            _ => PeerPath::Tcp,
        };
        let mut st = self.lock();
        if matches!(st.peer, PeerPath::Unresolved) {
            st.peer = path;
        }
    }

    /// Carries out every WR posted and not yet started, on this thread, against the peer QP
    /// in this process. Whoever holds `tx_busy` delivers, so concurrent posters keep the
    /// queue's order: the holder looks again after each WR.
    fn deliver_pending(&self, peer: &Weak<Qp>) {
        loop {
            let epoch = {
                let mut st = self.lock();
                if st.tx_busy
                    || st.send_cursor >= st.next_seq
                    || st.state != ibv_qp_state::IBV_QPS_RTS
                {
                    return;
                }
                st.tx_busy = true;
                st.epoch
            };
            match peer.upgrade() {
                Some(p) => self.deliver(epoch, &p),
                None => {
                    // The peer QP is gone: as a peer that never answers.
                    let mut st = self.lock();
                    let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                    self.fail(
                        &mut st,
                        first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                        None,
                    );
                }
            }
            self.lock().tx_busy = false;
        }
    }

    /// One WR delivered in process: the same local checks as [`transmit`](Self::transmit),
    /// then the peer's responder checks and places it straight from (or, for a READ, into)
    /// our pinned memory, and the WR completes as if acknowledged.
    fn deliver(&self, epoch: u64, peer: &Qp) {
        let mut inline_copy = [0u8; MAX_INLINE as usize];
        let Some((req, sges, inline)) = self.claim(epoch, &mut inline_copy) else {
            return;
        };
        let Some(guards) = self.pin_local(epoch, &req, &sges, inline.is_some()) else {
            return;
        };
        let mut segs: SmallVec<[(*mut u8, usize); 1]> = SmallVec::new();
        match inline {
            Some(data) => segs.push((data.as_ptr().cast_mut(), data.len())),
            None => {
                let nonempty = sges.iter().filter(|s| s.len > 0);
                segs.extend(
                    guards
                        .iter()
                        .zip(nonempty)
                        .map(|(g, s)| (g.ptr, s.len as usize)),
                );
            }
        }
        let result = peer.accept_local(self.qpn, &req, &segs);
        drop(guards);
        let mut st = self.lock();
        if st.epoch != epoch {
            return;
        }
        match result {
            Ok(()) => self.ack_upto(&mut st, req.seq),
            Err(status) => self.fail(&mut st, Some((req.seq, status)), None),
        }
    }

    /// The responder's side of an in-process delivery from QP `src_qpn`: the checks and the
    /// placement of the TCP responder ([`place`](Self::place)), the payload read from `segs`.
    /// `Err` is the requester's completion status. Unlike over TCP, a missing receive is not
    /// retried: it fails the WR with `IBV_WC_RNR_RETRY_EXC_ERR` at once.
    fn accept_local(
        &self,
        src_qpn: u32,
        req: &Request,
        segs: &[(*mut u8, usize)],
    ) -> Result<(), ibv_wc_status::Type> {
        let (access, recv, epoch) = {
            let mut st = self.lock();
            let ready = matches!(
                st.state,
                ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS
            ) && st.destroying.is_none()
                && st.attrs.dest_qpn == src_qpn;
            if !ready {
                return Err(ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
            }
            if req.seq != st.expected_seq {
                return Err(ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
            }
            let consumes = matches!(req.op, ReqOp::WriteImm | ReqOp::Send | ReqOp::SendImm);
            let recv = match consumes {
                true => match st.rq.pop_front() {
                    Some(r) => Some(r),
                    None => return Err(ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR),
                },
                false => None,
            };
            (st.attrs.access, recv, st.epoch)
        };
        let mem = MemLink {
            epoch,
            segs,
            at: Cell::new((0, 0)),
            refused: Cell::new(None),
        };
        if !self.place(&Link::Memory(&mem), req, access, recv) {
            return Err(mem
                .refused
                .get()
                .map_or(ibv_wc_status::IBV_WC_REM_OP_ERR, |n| nak_status(n as u8)));
        }
        let mut st = self.lock();
        if st.epoch == epoch {
            st.expected_seq += 1;
        }
        Ok(())
    }

    /// Opens the connection to the peer's responder and proves we are the expected peer.
    fn connect(&self, epoch: u64) -> Result<Conn, ConnectFail> {
        let (remote, local, budget, dest_qpn, proof, port) = {
            let st = self.lock();
            let local = self.ctx.dev.port(st.attrs.port).map(|p| p.address);
            (
                st.remote,
                local,
                Self::retry_budget(&st.attrs),
                st.attrs.dest_qpn,
                st.peer_secret,
                st.attrs.port,
            )
        };
        let (Some(remote), Some(local)) = (remote, local) else {
            return Err(ConnectFail::Exhausted);
        };
        // Without the peer's secret we still knock, like a hardware QP whose packets the peer
        // drops: the peer counts a stranger and our retries run out.
        let proof = proof.unwrap_or_else(|| {
            tracing::warn!(
                qpn = self.qpn,
                "soft: QP has no peer secret; the handshake must carry query_ece/set_ece"
            );
            0
        });
        let target = SocketAddr::new(remote, (dest_qpn >> 8) as u16);
        let deadline = budget.map(|b| Instant::now() + b);
        let mut backoff = Duration::from_millis(1);
        loop {
            {
                let st = self.lock();
                if st.epoch != epoch || st.destroying.is_some() {
                    return Err(ConnectFail::Stale);
                }
            }
            if self.ctx.dev.port_active(port) {
                match self.try_connect(target, local, dest_qpn, proof) {
                    Ok(Some(stream)) => {
                        let name = &self.ctx.dev.desc.name;
                        return Ok(Conn {
                            stream,
                            epoch,
                            traffic: traffic::counter(name, port, local, remote),
                        });
                    }
                    Ok(None) => {}
                    Err(()) => return Err(ConnectFail::Exhausted),
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ConnectFail::Exhausted);
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }

    /// One attempt: `Ok(None)` = try again later, `Err` = refused for good.
    fn try_connect(
        &self,
        target: SocketAddr,
        local: IpAddr,
        dest_qpn: u32,
        proof: u32,
    ) -> Result<Option<TcpStream>, ()> {
        let attempt = || -> std::io::Result<(TcpStream, Option<HelloReply>)> {
            let sock = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
            if local.is_ipv4() == target.is_ipv4() {
                sock.bind(&SocketAddr::new(local, 0).into())?;
            }
            sock.connect_timeout(&target.into(), Duration::from_secs(1))?;
            let stream: TcpStream = sock.into();
            tune(&stream);
            let hello = wire::encode_hello(self.qpn, dest_qpn, proof);
            let mut iov = [wire::iovec(hello.as_ptr(), HELLO_LEN)];
            // SAFETY: the iovec covers the local `hello` array.
            unsafe { wire::send_all(stream.as_raw_fd(), &mut iov, &|| true, false) }?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            // `idle_ok`: a listener that never answers is a failed attempt, not a hang.
            let reply = wire::read_exact::<4>(stream.as_raw_fd(), true)
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::ConnectionAborted))?;
            Ok((stream, HelloReply::from_u32(u32::from_le_bytes(reply))))
        };
        match attempt() {
            Ok((s, Some(HelloReply::Accepted))) => Ok(Some(s)),
            Ok((_, Some(HelloReply::NotReady))) | Err(_) => Ok(None),
            Ok((_, _)) => Err(()),
        }
    }

    /// Marks everything up to `seq` acknowledged and retires WRs up to the last signaled one
    /// among them (unsignaled WRs keep their slot until then, as on hardware).
    fn ack_upto(&self, st: &mut St, seq: u64) {
        st.last_heard = Instant::now();
        let cursor = st.send_cursor;
        let mut last_signaled = None;
        let mut progressed = false;
        for (i, w) in st.sq.iter_mut().enumerate() {
            if w.seq > seq || w.seq >= cursor {
                break;
            }
            progressed |= !w.acked;
            w.acked = true;
            if w.signaled {
                last_signaled = Some(i);
            }
        }
        if progressed {
            st.rnr_tries = 0;
            // A READ leaving flight may unblock the sender (max_rd_atomic); a teardown waits
            // for this. Otherwise nobody waits for an acknowledgement on `cv` (delivered in
            // process, nothing is ever left unsent).
            if self.sender_needed(st) {
                self.cv.notify_all();
            }
        }
        if let Some(last) = last_signaled {
            let dest = st.attrs.dest_qpn;
            for w in st.sq.drain(..=last) {
                let wc = w
                    .signaled
                    .then(|| self.send_wc(&w, ibv_wc_status::IBV_WC_SUCCESS, dest));
                // Recycled before the completion is seen, so the poster's next inline WR finds
                // the buffer back.
                self.recycle(w);
                if let Some(wc) = wc {
                    self.send_cq.complete(wc);
                }
            }
        }
    }

    fn ack_loop(self: Arc<Self>, conn: Arc<Conn>) {
        let epoch = conn.epoch;
        let tick = {
            let st = self.lock();
            Self::retry_budget(&st.attrs).map_or(Duration::from_millis(100), |b| {
                (b / 4).clamp(Duration::from_millis(1), Duration::from_millis(100))
            })
        };
        let _ = conn.stream.set_read_timeout(Some(tick));
        let fd = conn.fd();
        loop {
            let hdr = match wire::read_exact::<RESP_LEN>(fd, true) {
                Ok(h) => h,
                Err(ReadEnd::Idle) => {
                    let mut st = self.lock();
                    // Being destroyed: read on (acknowledgements, then the peer's end of the
                    // connection after our BYE), for a short while.
                    let drained = st
                        .destroying
                        .is_some_and(|t| t.elapsed() > DRAIN_ACKS + DRAIN_EOF);
                    if st.epoch != epoch || drained {
                        return;
                    }
                    if st.destroying.is_some() {
                        continue;
                    }
                    // An RNR wait is not a transport timeout.
                    let waiting_rnr = st.rnr_resume.is_some_and(|t| t > Instant::now());
                    let budget = Self::retry_budget(&st.attrs).filter(|_| !waiting_rnr);
                    let cursor = st.send_cursor;
                    let heard = st.last_heard;
                    let late = st
                        .sq
                        .iter()
                        .find(|w| !w.acked && w.ack_req() && w.seq < cursor)
                        .and_then(|w| Some((w.seq, w.sent_at?.max(heard))))
                        .filter(|(_, t)| budget.is_some_and(|b| t.elapsed() > b));
                    if let Some((seq, _)) = late {
                        self.fail(
                            &mut st,
                            Some((seq, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                            None,
                        );
                        return;
                    }
                    continue;
                }
                Err(ReadEnd::Closed) => {
                    let mut st = self.lock();
                    if st.epoch != epoch || st.destroying.is_some() {
                        return;
                    }
                    let cursor = st.send_cursor;
                    match st
                        .sq
                        .iter()
                        .find(|w| !w.acked && w.seq < cursor)
                        .map(|w| w.seq)
                    {
                        // The peer vanished with work outstanding: the retries would exhaust.
                        Some(seq) => self.fail(
                            &mut st,
                            Some((seq, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                            None,
                        ),
                        // Nothing outstanding (the peer QP was destroyed): like hardware, notice
                        // only when the next WR finds nobody there.
                        None => {
                            if st.req_conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                                st.req_conn = None;
                            }
                        }
                    }
                    return;
                }
            };
            let Some(resp) = Response::decode(&hdr) else {
                let mut st = self.lock();
                if st.epoch == epoch {
                    let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                    self.fail(
                        &mut st,
                        first.map(|s| (s, ibv_wc_status::IBV_WC_BAD_RESP_ERR)),
                        None,
                    );
                }
                return;
            };
            match resp.op {
                RespOp::Ack => {
                    let mut st = self.lock();
                    if st.epoch != epoch {
                        return;
                    }
                    self.ack_upto(&mut st, resp.seq);
                }
                RespOp::ReadResp => {
                    if !self.read_response(&conn, resp) {
                        return;
                    }
                }
                RespOp::Nak => {
                    let mut st = self.lock();
                    if st.epoch != epoch {
                        return;
                    }
                    if let Some(prev) = resp.seq.checked_sub(1) {
                        self.ack_upto(&mut st, prev);
                    }
                    self.fail(&mut st, Some((resp.seq, nak_status(resp.syndrome))), None);
                    return;
                }
                RespOp::RnrNak => {
                    let mut st = self.lock();
                    if st.epoch != epoch {
                        return;
                    }
                    if let Some(prev) = resp.seq.checked_sub(1) {
                        self.ack_upto(&mut st, prev);
                    }
                    let infinite = st.attrs.rnr_retry == 7;
                    if !infinite && st.rnr_tries >= st.attrs.rnr_retry {
                        self.fail(
                            &mut st,
                            Some((resp.seq, ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR)),
                            None,
                        );
                        return;
                    }
                    st.rnr_tries = st.rnr_tries.saturating_add(1);
                    st.last_heard = Instant::now();
                    // Go back N: resend from the refused WR once the timer expires.
                    st.send_cursor = st.send_cursor.min(resp.seq);
                    let wait = RNR_TIMER_US[usize::from(resp.syndrome & 31)];
                    st.rnr_resume = Some(Instant::now() + Duration::from_micros(u64::from(wait)));
                    self.cv.notify_all();
                }
            }
        }
    }

    /// Scatters a READ response straight into the WR's local buffers. `false` = stop reading.
    fn read_response(&self, conn: &Conn, resp: Response) -> bool {
        let (epoch, fd) = (conn.epoch, conn.fd());
        let sges = {
            let st = self.lock();
            if st.epoch != epoch {
                return false;
            }
            match Self::wqe(&st, resp.seq) {
                Some(w) if w.op == ReqOp::Read && w.len == resp.len => w.sges.clone(),
                _ => {
                    drop(st);
                    let mut st = self.lock();
                    let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                    self.fail(
                        &mut st,
                        first.map(|s| (s, ibv_wc_status::IBV_WC_BAD_RESP_ERR)),
                        None,
                    );
                    return false;
                }
            }
        };
        let mut guards: SmallVec<[(MrGuard, usize); 1]> = SmallVec::new();
        for s in sges.iter().filter(|s| s.len > 0) {
            match self
                .ctx
                .mrs
                .acquire(s.lkey, self.pd, s.addr, s.len as usize, LOCAL_WRITE)
            {
                Ok(g) => guards.push((g, s.len as usize)),
                Err(_) => {
                    let _ = wire::drain(fd, resp.len as usize);
                    let mut st = self.lock();
                    if st.epoch == epoch {
                        self.fail(
                            &mut st,
                            Some((resp.seq, ibv_wc_status::IBV_WC_LOC_PROT_ERR)),
                            None,
                        );
                    }
                    return false;
                }
            }
        }
        for (g, len) in &guards {
            // SAFETY: the guard pins `len` writable bytes (LOCAL_WRITE checked) at `g.ptr`.
            if unsafe { wire::read_into(fd, g.ptr, *len, false) }.is_err() {
                return false;
            }
        }
        drop(guards);
        conn.traffic.received(resp.len);
        let mut st = self.lock();
        if st.epoch != epoch {
            return false;
        }
        self.ack_upto(&mut st, resp.seq);
        true
    }

    // ----------------------------------------------------------------------------------------
    // Responder

    /// The listener asks whether to admit a caller claiming to be QP `src_qpn` with `proof`.
    pub(crate) fn admit(
        self: &Arc<Self>,
        src_qpn: u32,
        proof: u32,
        peer: IpAddr,
        stream: &TcpStream,
    ) -> HelloReply {
        let mut st = self.lock();
        if st.destroying.is_some() || proof != self.secret {
            return HelloReply::Refused;
        }
        match st.state {
            ibv_qp_state::IBV_QPS_RESET | ibv_qp_state::IBV_QPS_INIT => HelloReply::NotReady,
            ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS => {
                let expected = st.remote.map(|r| r.to_canonical());
                if st.attrs.dest_qpn != src_qpn
                    || expected != Some(peer.to_canonical())
                    || st.resp_conn.is_some()
                {
                    return HelloReply::Refused;
                }
                let local = match self.ctx.dev.port(st.attrs.port) {
                    Some(p) if self.ctx.dev.port_active(p.port) => p.address,
                    _ => return HelloReply::NotReady,
                };
                let Ok(mine) = stream.try_clone() else {
                    return HelloReply::NotReady;
                };
                let _ = mine.set_read_timeout(None);
                tune(&mine);
                let conn = Arc::new(Conn {
                    stream: mine,
                    epoch: st.epoch,
                    traffic: traffic::counter(&self.ctx.dev.desc.name, st.attrs.port, local, peer),
                });
                st.resp_conn = Some(Arc::clone(&conn));
                drop(st);
                self.spawn("resp", move |qp| qp.responder_loop(conn));
                HelloReply::Accepted
            }
            _ => HelloReply::Refused,
        }
    }

    fn respond(&self, conn: &Conn, resp: Response, data: Option<&MrGuard>) -> bool {
        let hdr = resp.encode();
        let mut iov = vec![wire::iovec(hdr.as_ptr(), hdr.len())];
        if let Some(g) = data {
            iov.push(wire::iovec(g.ptr, resp.len as usize));
        }
        let abort = || {
            let st = self.lock();
            st.destroying.is_some() || st.epoch != conn.epoch
        };
        // SAFETY: the iovecs cover `hdr` and `resp.len` bytes pinned by the guard.
        unsafe { wire::send_all(conn.fd(), &mut iov, &abort, false) }.is_ok()
    }

    /// Refuses `req`: NAKs it (over TCP, after draining its payload; in process, by telling the
    /// requester), and moves this QP to ERR with `event`.
    fn refuse(&self, link: &Link<'_>, req: &Request, nak: Nak, event: Option<ibv_event_type>) {
        match link {
            Link::Tcp(conn) => {
                if req.carries_payload() {
                    let _ = wire::drain(conn.fd(), req.len as usize);
                }
                self.respond(
                    conn,
                    Response {
                        op: RespOp::Nak,
                        syndrome: nak as u8,
                        len: 0,
                        seq: req.seq,
                    },
                    None,
                );
            }
            Link::Memory(m) => m.refused.set(Some(nak)),
        }
        let mut st = self.lock();
        if st.epoch == link.epoch() {
            self.fail(&mut st, None, event);
        }
    }

    /// ACKs everything up to `seq` (placed, not yet acknowledged); `false` = stop.
    fn ack(&self, conn: &Conn, seq: u64) -> bool {
        self.respond(
            conn,
            Response {
                op: RespOp::Ack,
                syndrome: 0,
                len: 0,
                seq,
            },
            None,
        )
    }

    fn responder_loop(self: Arc<Self>, conn: Arc<Conn>) {
        let fd = conn.fd();
        // The last placed request not acknowledged yet. Acknowledged before this thread waits
        // for the next request, so nothing placed stays unacknowledged while the connection is
        // quiet (and a stream of requests costs one ACK per burst, not one per request).
        let mut unacked: Option<u64> = None;
        loop {
            if let Some(seq) = unacked.filter(|_| !wire::readable(fd)) {
                if !self.ack(&conn, seq) {
                    return;
                }
                unacked = None;
            }
            let req = match wire::read_exact::<REQ_LEN>(fd, false) {
                Ok(b) => Request::decode(&b),
                Err(_) => {
                    // EOF without BYE: the requester vanished (cut, crash): a fatal QP error,
                    // unless this QP is being destroyed (its destroy shut the reading side).
                    let mut st = self.lock();
                    if st.epoch == conn.epoch && st.destroying.is_none() {
                        self.fail(&mut st, None, Some(ibv_event_type::IBV_EVENT_QP_FATAL));
                    }
                    return;
                }
            };
            let stall = self.lock().stall_until;
            if let Some(until) = stall {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
            }
            let req = match req {
                Ok(r) => r,
                Err(seq) => {
                    self.respond(
                        &conn,
                        Response {
                            op: RespOp::Nak,
                            syndrome: Nak::InvalidRequest as u8,
                            len: 0,
                            seq,
                        },
                        None,
                    );
                    let mut st = self.lock();
                    if st.epoch == conn.epoch {
                        self.fail(&mut st, None, Some(ibv_event_type::IBV_EVENT_QP_REQ_ERR));
                    }
                    return;
                }
            };
            if req.op == ReqOp::Bye {
                // An orderly close: the requester waited for its acknowledgements and sends
                // nothing more. Close our side too, so its ack reader sees the end and stops.
                if let Some(seq) = unacked {
                    self.ack(&conn, seq);
                }
                let mut st = self.lock();
                if st.resp_conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                    st.resp_conn = None;
                }
                drop(st);
                conn.kill();
                return;
            }
            let (access, recv) = {
                let mut st = self.lock();
                if st.epoch != conn.epoch || st.destroying.is_some() {
                    return;
                }
                if req.seq != st.expected_seq {
                    // Go back N: after a NAK everything up to the retransmission is discarded.
                    drop(st);
                    if req.carries_payload() && wire::drain(fd, req.len as usize).is_err() {
                        return;
                    }
                    continue;
                }
                let consumes = matches!(req.op, ReqOp::WriteImm | ReqOp::Send | ReqOp::SendImm);
                let recv = if consumes {
                    match st.rq.pop_front() {
                        Some(r) => Some(r),
                        None => {
                            let timer = st.attrs.min_rnr_timer;
                            drop(st);
                            if req.carries_payload() && wire::drain(fd, req.len as usize).is_err() {
                                return;
                            }
                            if !self.respond(
                                &conn,
                                Response {
                                    op: RespOp::RnrNak,
                                    syndrome: timer,
                                    len: 0,
                                    seq: req.seq,
                                },
                                None,
                            ) {
                                return;
                            }
                            continue;
                        }
                    }
                } else {
                    None
                };
                (st.attrs.access, recv)
            };
            if !self.place(&Link::Tcp(&conn), &req, access, recv) {
                return;
            }
            let mut st = self.lock();
            if st.epoch != conn.epoch {
                return;
            }
            st.expected_seq += 1;
            drop(st);
            // A READ response acknowledges everything before it, as an ACK would.
            unacked = (req.op != ReqOp::Read).then_some(req.seq);
            if req.flags & FLAG_ACK_REQ != 0 && req.op != ReqOp::Read {
                if !self.ack(&conn, req.seq) {
                    return;
                }
                unacked = None;
            }
        }
    }

    /// Carries out an admitted request in sequence: places a write or send, serves a read.
    /// `false`: refused, or the link broke (this QP has failed).
    fn place(&self, link: &Link<'_>, req: &Request, access: u32, recv: Option<RecvWqe>) -> bool {
        match req.op {
            ReqOp::Write | ReqOp::WriteImm => self.place_write(link, req, access, recv),
            ReqOp::Send | ReqOp::SendImm => self.place_send(link, req, recv),
            ReqOp::Read => self.serve_read(link, req, access),
            // Ends a connection; the responder loop handles it before anything is placed.
            ReqOp::Bye => false,
        }
    }

    /// Gives a consumed receive back to the front of the queue (its request was refused).
    fn unconsume(&self, epoch: u64, recv: Option<RecvWqe>) {
        if let Some(r) = recv {
            let mut st = self.lock();
            if st.epoch == epoch {
                st.rq.push_front(r);
            }
        }
    }

    fn place_write(
        &self,
        link: &Link<'_>,
        req: &Request,
        access: u32,
        recv: Option<RecvWqe>,
    ) -> bool {
        let len = req.len as usize;
        if len > 0 {
            let guard = if access & REMOTE_WRITE == 0 {
                None
            } else {
                self.ctx
                    .mrs
                    .acquire(req.rkey, self.pd, req.raddr, len, REMOTE_WRITE)
                    .ok()
            };
            let Some(guard) = guard else {
                self.unconsume(link.epoch(), recv);
                self.refuse(
                    link,
                    req,
                    Nak::RemoteAccess,
                    Some(ibv_event_type::IBV_EVENT_QP_ACCESS_ERR),
                );
                return false;
            };
            // SAFETY: the guard pins `len` bytes of remotely writable registered memory.
            if unsafe { link.read_into(guard.ptr, len) }.is_err() {
                self.unconsume(link.epoch(), recv);
                return self.closed(link);
            }
            link.received(req.len);
        }
        let Some(r) = recv else {
            // No completion tells a poller about this write (a clear-to-send entry it checks).
            super::activity::happened();
            return true;
        };
        self.recv_cq.complete(Wc {
            wr_id: r.wr_id,
            status: ibv_wc_status::IBV_WC_SUCCESS,
            opcode: ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: req.len,
            imm: Some(req.imm),
            qp_num: self.qpn,
            src_qp: self.attrs().dest_qpn,
        });
        true
    }

    fn place_send(&self, link: &Link<'_>, req: &Request, recv: Option<RecvWqe>) -> bool {
        let r = recv.expect("sends consume a receive");
        let capacity: u64 = r.sges.iter().map(|s| u64::from(s.len)).sum();
        let src_qp = self.attrs().dest_qpn;
        let recv_error = |status| Wc {
            wr_id: r.wr_id,
            status,
            opcode: ibv_wc_opcode::IBV_WC_RECV,
            byte_len: 0,
            imm: None,
            qp_num: self.qpn,
            src_qp,
        };
        if u64::from(req.len) > capacity {
            self.recv_cq
                .complete(recv_error(ibv_wc_status::IBV_WC_LOC_LEN_ERR));
            self.refuse(link, req, Nak::InvalidRequest, None);
            return false;
        }
        let mut left = req.len as usize;
        let mut guards: SmallVec<[(MrGuard, usize); 1]> = SmallVec::new();
        for s in &r.sges {
            if left == 0 {
                break;
            }
            let take = left.min(s.len as usize);
            match self
                .ctx
                .mrs
                .acquire(s.lkey, self.pd, s.addr, take, LOCAL_WRITE)
            {
                Ok(g) => guards.push((g, take)),
                Err(_) => {
                    self.recv_cq
                        .complete(recv_error(ibv_wc_status::IBV_WC_LOC_PROT_ERR));
                    self.refuse(link, req, Nak::RemoteOperation, None);
                    return false;
                }
            }
            left -= take;
        }
        for (g, take) in &guards {
            // SAFETY: the guard pins `take` locally writable bytes of the receive buffer.
            if unsafe { link.read_into(g.ptr, *take) }.is_err() {
                return self.closed(link);
            }
        }
        link.received(req.len);
        self.recv_cq.complete(Wc {
            wr_id: r.wr_id,
            status: ibv_wc_status::IBV_WC_SUCCESS,
            opcode: ibv_wc_opcode::IBV_WC_RECV,
            byte_len: req.len,
            imm: (req.op == ReqOp::SendImm).then_some(req.imm),
            qp_num: self.qpn,
            src_qp,
        });
        true
    }

    fn serve_read(&self, link: &Link<'_>, req: &Request, access: u32) -> bool {
        let len = req.len as usize;
        let guard = if len == 0 {
            None
        } else if access & REMOTE_READ == 0 {
            self.refuse(
                link,
                req,
                Nak::RemoteAccess,
                Some(ibv_event_type::IBV_EVENT_QP_ACCESS_ERR),
            );
            return false;
        } else {
            match self
                .ctx
                .mrs
                .acquire(req.rkey, self.pd, req.raddr, len, REMOTE_READ)
            {
                Ok(g) => Some(g),
                Err(_) => {
                    self.refuse(
                        link,
                        req,
                        Nak::RemoteAccess,
                        Some(ibv_event_type::IBV_EVENT_QP_ACCESS_ERR),
                    );
                    return false;
                }
            }
        };
        let resp = Response {
            op: RespOp::ReadResp,
            syndrome: 0,
            len: req.len,
            seq: req.seq,
        };
        let sent = match link {
            Link::Tcp(conn) => {
                let sent = self.respond(conn, resp, guard.as_ref());
                if sent {
                    conn.traffic.sent(req.len);
                }
                sent
            }
            Link::Memory(m) => {
                if let Some(g) = &guard {
                    // SAFETY: the guard pins `len` remotely readable bytes; the requester's
                    // pinned segments are locally writable (checked before delivery).
                    unsafe { m.write_from(g.ptr, len) };
                }
                true
            }
        };
        sent || self.closed(link)
    }

    /// The connection broke mid-request: a fatal error unless we are going away anyway.
    fn closed(&self, link: &Link<'_>) -> bool {
        let mut st = self.lock();
        if st.epoch == link.epoch() && st.destroying.is_none() {
            self.fail(&mut st, None, Some(ibv_event_type::IBV_EVENT_QP_FATAL));
        }
        false
    }

    // ----------------------------------------------------------------------------------------
    // Teardown and faults

    /// Stops every thread of this QP and frees its QPN, closing both connections in order so
    /// the peer never fails work this QP acknowledged or was acknowledged for: the sender waits
    /// for its acknowledgements and says BYE, the ack reader reads to the peer's end of that
    /// connection, and the responder (which acknowledges everything it placed before it waits
    /// for more) stops reading before its connection closes.
    pub(crate) fn destroy(&self) {
        {
            let mut st = self.lock();
            if st.destroying.is_some() {
                return;
            }
            st.destroying = Some(Instant::now());
            self.cv.notify_all();
        }
        // The sender is the only writer of the outgoing connection: let it say BYE and stop
        // before the sockets close.
        let sender = {
            let mut threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
            let pos = threads.iter().position(|t| {
                t.thread()
                    .name()
                    .is_some_and(|n| n.starts_with("soft-send"))
            });
            pos.map(|p| threads.remove(p))
        };
        let me = std::thread::current().id();
        if let Some(t) = sender.filter(|t| t.thread().id() != me) {
            let _ = t.join();
        }
        // Wake the responder (its read ends as at EOF), and let it and the ack reader finish.
        if let Some(c) = self.lock().resp_conn.clone() {
            let _ = c.stream.shutdown(std::net::Shutdown::Read);
        }
        let rest = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in rest {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        {
            let mut st = self.lock();
            st.epoch += 1;
            self.drop_conns(&mut st);
        }
        self.pool.release(self.qpn);
        self.ctx
            .events
            .forget(Element::Qp(self.ibv.load(Ordering::Acquire)));
    }

    /// Fault injection: breaks both connections of this QP without a BYE, like a cable pull.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn cut(&self) {
        let st = self.lock();
        for c in [&st.req_conn, &st.resp_conn].into_iter().flatten() {
            c.kill();
        }
    }

    /// Fault injection: this QP's responder goes silent for `d` (requests wait, no answers).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn stall(&self, d: Duration) {
        self.lock().stall_until = Some(Instant::now() + d);
    }

    /// Port down or device fatal: outstanding work fails as if the retries ran out.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn link_lost(&self, port: Option<u8>) {
        let mut st = self.lock();
        if port.is_some_and(|p| p != st.attrs.port) {
            return;
        }
        let first = st
            .sq
            .iter()
            .find(|w| !w.acked && w.seq < st.send_cursor)
            .map(|w| w.seq);
        self.fail(
            &mut st,
            first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
            None,
        );
    }
}

/// Socket options for a data connection: no Nagle (headers and payloads go out in one
/// `sendmsg`, small messages must not wait), large buffers, and a send timeout so a writer
/// blocked on a stalled peer can notice teardown.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(WRITE_TICK));
    let s = SockRef::from(stream);
    let _ = s.set_send_buffer_size(SOCK_BUF);
    let _ = s.set_recv_buffer_size(SOCK_BUF);
}
