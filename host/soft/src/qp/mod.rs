//! The RC queue pair engine: one [`Qp`] — its queues, its state, and the three threads that
//! play the NIC for it.
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
//!
//! # Where each part lives
//! All roles share one lock (`St`, below) and one condition variable (threads parked under a
//! lease, the `serve` module, a second one), so each file is an
//! `impl Qp` block of one role over that shared state. This file holds the type, its birth and
//! its orderly death; the roles are:
//! - `state`: the state machine (`modify_qp`'s transitions and attribute masks) and entering
//!   ERR, which every role ends in when something fails;
//! - `wqe`: the work requests as posted;
//! - `requester`: `post_send` / `post_recv` and the sender thread (and the posting thread's
//!   direct send);
//! - `admission`: the hello that opens a connection, both ends of it: the requester's proof
//!   and the responder's check of who may connect;
//! - `conn`: one TCP connection and its socket options;
//! - `ack_reader`: the requester's answers: ACKs, NAKs, RNR NAKs, READ data, the retry timer;
//! - `responder`: the checks and placement of incoming requests, and the answers;
//! - `serve`: a thread polling a CQ serves the connections of its QPs while their threads
//!   park (arrivals wake nobody);
//! - `pull`: same-host pull, the responder copying a large payload straight from the
//!   requester's memory (`process_vm_readv`) instead of the socket;
//! - `in_process`: delivery to a peer QP in this process ([`crate::Delivery::InProcess`]);
//! - `fault`: the fault-injection hooks (feature `fault-injection`).

mod ack_reader;
mod admission;
mod conn;
#[cfg(feature = "fault-injection")]
mod fault;
mod in_process;
mod pull;
mod requester;
mod responder;
mod serve;
mod state;
mod wqe;

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ibverbs_sys::{ibv_event_type, ibv_qp_state};

use super::ctx::{CqState, Ctx, Pool};
use super::event::Element;
use conn::Conn;
use in_process::PeerPath;

#[cfg(test)]
pub(crate) use pull::PULL_MIN;
pub(crate) use serve::{SLEEP_FDS, Served, sleep_fds};
pub(crate) use state::Attrs;
pub(crate) use wqe::{RecvWqe, SendWqe, Sge, Sges};

/// Largest message (`ibv_port_attr.max_msg_sz`).
pub(crate) const MAX_MSG: u64 = 1 << 31;

/// Largest inline payload a QP may ask for (`max_inline_data`).
pub(crate) const MAX_INLINE: u32 = 1024;

/// How long a QP being destroyed goes on sending what was posted before the destroy and waits
/// for the acknowledgement of what it sent before it says BYE: a live peer answers within a
/// round trip; a stalled one is not waited for longer.
const DRAIN_ACKS: Duration = Duration::from_millis(500);
/// How long a QP being destroyed keeps reading its outgoing connection after BYE, waiting for
/// the peer's end of it (closing with unread bytes would reset the connection).
const DRAIN_EOF: Duration = Duration::from_millis(200);

/// Queue capacities granted at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
}

/// Everything a QP's roles share, under its one lock: the state machine's part, then the
/// requester's, then the responder's.
#[derive(Debug)]
struct St {
    // The state machine (`state`) and the peer RTR and `set_ece` named.
    state: ibv_qp_state::Type,
    attrs: Attrs,
    /// Resolved address of the peer's port (RTR).
    remote: Option<IpAddr>,
    /// The peer QP's secret, learnt through `set_ece` (the out-of-band handshake).
    peer_secret: Option<u32>,
    /// Incremented on RESET and ERR: threads of an older epoch stop touching the queues.
    epoch: u64,
    /// Set when `destroy` starts: the threads drain and stop.
    destroying: Option<Instant>,
    peer: PeerPath,
    // The requester (`requester`, `ack_reader`).
    sq: VecDeque<SendWqe>,
    next_seq: u64,
    send_cursor: u64,
    rnr_resume: Option<Instant>,
    rnr_tries: u8,
    /// When the ack reader last heard from the responder: like ACKs of earlier packets on
    /// hardware, any answer restarts the retry timer.
    last_heard: Instant,
    req_conn: Option<Arc<Conn>>,
    sender_started: bool,
    /// Someone (the sender thread or a posting thread) is writing a request frame, or, in
    /// process, delivering one.
    tx_busy: bool,
    /// Inline-data buffers of retired WRs, handed to the next inline posts: a CTS written
    /// inline for every receive then costs no allocation. At most `max_send_wr` are kept, as
    /// many as the send queue can hold. Under the QP's lock, which the post and the retirement
    /// hold anyway.
    inline_spare: Vec<Vec<u8>>,
    // The responder (`responder`).
    rq: VecDeque<RecvWqe>,
    expected_seq: u64,
    resp_conn: Option<Arc<Conn>>,
    stall_until: Option<Instant>,
    /// Fault injection cut the link to the peer QP for good (`fault::cut`): neither end
    /// reaches the other any more, so the next work request of either fails as its retries
    /// would. Cleared by RESET.
    severed: bool,
}

impl St {
    /// Whether the QP's requester has stopped for good: destroyed, and past [`DRAIN_ACKS`].
    /// Until then a QP being destroyed still connects and sends what was posted before: a NIC
    /// has sent a work request long before a `destroy_qp` that follows its doorbell reaches
    /// it, and a peer may already count on it (the clear-to-send of a receive posted just
    /// before a close).
    pub(super) fn requester_stopped(&self) -> bool {
        self.destroying.is_some_and(|t| t.elapsed() >= DRAIN_ACKS)
    }
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
    /// Same-host pull was on when the QP was made ([`crate::set_same_host_pull`]): its
    /// requester offers it, its responder grants it (the `pull` module).
    pull: bool,
    /// Payload bytes this QP's responder pulled: how tests see which path a connection took.
    pulled: AtomicU64,
    pub send_cq: Arc<CqState>,
    pub recv_cq: Arc<CqState>,
    /// Address of the `ibv_qp`, for async events.
    pub ibv: AtomicUsize,
    pool: Arc<Pool>,
    st: Mutex<St>,
    cv: Condvar,
    /// Where a thread parked under a lease waits (the `serve` module), on the same lock: woken
    /// by a hand-back, and when the QP moves on (its connections dropped, a destroy), not by
    /// everything that wakes the sender.
    park_cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
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
                let s = crate::abi::sys::rand_u32();
                if s != 0 {
                    break s;
                }
            },
            in_process: super::delivery() == super::Delivery::InProcess,
            pull: super::same_host_pull(),
            pulled: AtomicU64::new(0),
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
                destroying: None,
                peer: PeerPath::Unresolved,
                sq: VecDeque::new(),
                next_seq: 0,
                send_cursor: 0,
                rnr_resume: None,
                rnr_tries: 0,
                last_heard: Instant::now(),
                req_conn: None,
                sender_started: false,
                tx_busy: false,
                inline_spare: Vec::new(),
                rq: VecDeque::new(),
                expected_seq: 0,
                resp_conn: None,
                stall_until: None,
                severed: false,
            }),
            cv: Condvar::new(),
            park_cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
        });
        qp.pool.install(qpn, &qp);
        ctx.add_qp(&qp);
        for cq in [&qp.send_cq, &qp.recv_cq] {
            cq.qps.fetch_add(1, Ordering::AcqRel);
        }
        serve::qp_born();
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

    /// Payload bytes this QP's responder pulled from its requester's memory.
    #[cfg(test)]
    pub(crate) fn pulled_bytes(&self) -> u64 {
        self.pulled.load(Ordering::Relaxed)
    }

    /// Whether a pulled WR of this requester still pins its sources (not answered yet).
    #[cfg(test)]
    pub(crate) fn pins_sources(&self) -> bool {
        self.lock().sq.iter().any(|w| w.pinned.is_some())
    }

    /// How many WRs this requester sent that its peer has not acknowledged yet.
    #[cfg(test)]
    pub(crate) fn unacknowledged(&self) -> usize {
        self.lock().sq.iter().filter(|w| !w.acked).count()
    }

    pub(crate) fn set_peer_secret(&self, secret: u32) {
        self.lock().peer_secret = Some(secret);
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
            self.park_cv.notify_all();
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
            // Its WRs never complete now; dropping them unpins the sources of pulled ones, so
            // a `dereg_mr` after `destroy_qp` does not wait for an answer that cannot come.
            st.sq.clear();
        }
        self.pool.release(self.qpn);
        self.ctx
            .events
            .forget(Element::Qp(self.ibv.load(Ordering::Acquire)));
        for cq in [&self.send_cq, &self.recv_cq] {
            cq.qps.fetch_sub(1, Ordering::AcqRel);
        }
        serve::qp_gone();
    }
}
