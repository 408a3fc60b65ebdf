//! Arrivals that wake nobody: a thread polling a CQ serves the connections of the CQ's QPs
//! while it polls, and their own threads stay parked.
//!
//! On a NIC an arriving request is placed, and an arriving ACK retires its WR, without any
//! thread of the host running. Here a responder and an ack reader thread play that part, and
//! waking one for each small message costs more than the message: on a machine whose cores
//! the pollers keep busy (NCCL's progress thread spins), the woken thread waits for a core,
//! then the poller waits for the thread. So while somebody polls the CQ a connection's
//! completions go to, that poller does the work itself, with the same checks and placement,
//! whenever a whole frame already waits in the socket buffer:
//!
//! - A connection is **leased** while its thread is parked. Each poll of the CQ renews the
//!   lease ([`Served::serve`] moves a counter). One lease watcher per process looks at every
//!   leased connection's counter each [`LEASE`] and hands back those whose CQ was not polled
//!   for a lease: their threads take the connections back and block in `read` as before, so
//!   a CQ nobody polls (a one-sided target, an idle communicator, a process stopped in a
//!   debugger) leaves its connections with their threads. Parked threads themselves wake
//!   only when told (the ack reader also for its retry timer).
//! - A poller reads a frame only once it is whole in the socket, so it never blocks on a peer:
//!   one look (`MSG_PEEK`) copies what waits, the poller serves every whole frame from the
//!   copy, and one read takes them off the socket; the responder acknowledges them with one
//!   ACK, or, when none of them asked for an answer, with the next poll that finds the
//!   connection quiet ([`Conn::owes_ack`]). A same-host pulled payload (the `pull` module) of
//!   up to [`SERVE_MAX`] is pulled by the poller too, its descriptors taken from the look. A
//!   frame it does not serve — a payload or a READ answer over [`SERVE_MAX`], a connection's
//!   first or last frame, anything malformed, the end of the stream — goes back to the
//!   thread: the lease ends, the thread wakes and reads it. It parks again once the CQ is
//!   polled and nothing waits in the socket.
//! - Whoever reads a connection holds its turn ([`Conn::turn`]), and with it what the reader
//!   keeps between frames (the responder's unacknowledged request). A poller only ever tries
//!   for the turn; the thread waits for it.
//! - A poller with nothing to do sleeps on the leased sockets too (the `activity` module), so
//!   an arrival wakes the poller, not a thread; one with bytes still waiting at its next
//!   attempt to sleep goes back to its thread ([`sleep_fds`]).
//!
//! Entering ERR, a reset, a destroy: they move the QP's epoch or set its `destroying`, and
//! wake the threads parked on the QP; a parked thread takes its connection back for good and
//! ends as it always did. A poller finds the same under the QP's lock before it places
//! anything.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::conn::{Conn, Turn};
use super::pull::Source;
use super::responder::Looked;
use super::{Qp, St};
use crate::abi::memory::Dst;
use crate::abi::sys;
use crate::wire::{self, FLAG_ACK_REQ, Look, REQ_LEN, RESP_LEN, ReqOp, Request, RespOp, Response};

/// How long a leased connection's CQ may go without a poll before the lease watcher hands the
/// connection back to its thread, and how often the watcher looks: how late an arrival is
/// served at worst once its CQ is no longer polled.
const LEASE: Duration = Duration::from_millis(1);

/// The largest payload (or READ answer) a poller moves itself: larger ones are its thread's,
/// which may block on the socket while the poller goes on polling.
const SERVE_MAX: usize = 64 * 1024;

/// How much of a socket a poller copies in one look: many small frames, served from the copy
/// and then taken off the socket with one read. A frame larger than this is read from the
/// socket once it is all there.
const LOOK: usize = 8 * 1024;

/// What a poller does after the frames one look held.
#[derive(Clone, Copy, Debug)]
enum Next {
    /// Look again: the look was full, more may wait.
    Look,
    /// The next frame is not all here yet.
    Wait,
    /// The next frame is larger than a look: read it from the socket, once this many bytes
    /// follow its header.
    Read(usize),
    /// The next frame is its thread's, or the QP moved on.
    HandBack,
}

/// Which end of a QP a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// The connection a peer's requester opened to us: requests in, answers out. Its
    /// completions go to the receive CQ.
    Responder,
    /// The connection our requester opened: answers in. Its completions go to the send CQ.
    Acks,
}

/// The connections a CQ's pollers serve, and the lease each poll renews.
#[derive(Debug, Default)]
pub(crate) struct Served {
    /// Moves on every poll of the CQ that serves connections.
    polls: AtomicU64,
    /// Frames pollers served (requests and answers): how tests see which path took them.
    #[cfg(test)]
    frames: AtomicU64,
    /// Tests hold leases for as long as they poll at all, so that whether a frame was served
    /// by a poller does not depend on how the test's thread is scheduled.
    #[cfg(test)]
    held: std::sync::atomic::AtomicBool,
    /// How many entries `conns` holds: a CQ with none (in-process delivery, nothing connected
    /// yet) costs a poll one load.
    count: AtomicUsize,
    conns: Mutex<Vec<Entry>>,
}

/// A leased connection a poll serves, held alive for the poll.
type Live = (Arc<Qp>, Arc<Conn>, Role);

#[derive(Debug)]
struct Entry {
    qp: Weak<Qp>,
    conn: Weak<Conn>,
    role: Role,
}

impl Served {
    /// Serves `conn` of `qp` from polls of this CQ from now on (while it is leased).
    pub(super) fn add(&self, qp: &Arc<Qp>, conn: &Arc<Conn>, role: Role) {
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        conns.retain(|e| e.conn.strong_count() > 0);
        conns.push(Entry {
            qp: Arc::downgrade(qp),
            conn: Arc::downgrade(conn),
            role,
        });
        self.count.store(conns.len(), Ordering::Release);
    }

    /// Frames the CQ's pollers served so far.
    #[cfg(test)]
    pub(crate) fn frames(&self) -> u64 {
        self.frames.load(Ordering::Relaxed)
    }

    /// From now on, a lease of this CQ lapses only after a minute without a poll.
    #[cfg(test)]
    pub(crate) fn hold_leases(&self) {
        self.held.store(true, Ordering::Relaxed);
    }

    /// How long this CQ may go without a poll before its leases lapse.
    fn lease(&self) -> Duration {
        #[cfg(test)]
        if self.held.load(Ordering::Relaxed) {
            return Duration::from_secs(60);
        }
        LEASE
    }

    /// Counts a frame a poller served.
    fn served_one(&self) {
        #[cfg(test)]
        self.frames.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the CQ was polled since `seen` (which it updates): a thread holding its
    /// connection parks when it was.
    pub(super) fn polled_since(&self, seen: &mut u64) -> bool {
        let now = self.polls.load(Ordering::Relaxed);
        std::mem::replace(seen, now) != now
    }

    /// The poller's part of `poll_cq`, before it takes completions: renews the lease and
    /// serves every leased connection whose turn is free.
    pub(crate) fn serve(&self) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        // Not an atomic add: two pollers may both store the same value, and any change renews.
        self.polls.store(
            self.polls.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
        let mut leased: SmallVec<[Live; 4]> = SmallVec::new();
        {
            // Another poller of the same CQ is serving: this poll takes completions only.
            let Ok(mut conns) = self.conns.try_lock() else {
                return;
            };
            conns.retain(|e| {
                let Some(conn) = e.conn.upgrade() else {
                    return false;
                };
                if let Some(qp) =
                    e.qp.upgrade()
                        .filter(|_| conn.leased.load(Ordering::Acquire))
                {
                    leased.push((qp, conn, e.role));
                }
                true
            });
            self.count.store(conns.len(), Ordering::Release);
        }
        // One look for whether any of them has bytes waiting, rather than one per connection:
        // most polls find nothing.
        let mut ready = SmallVec::<[libc::pollfd; 4]>::new();
        let owed = |c: &Conn| c.owes_ack.load(Ordering::Relaxed);
        if leased.len() > 1 {
            ready.extend(leased.iter().map(|(_, c, _)| libc::pollfd {
                fd: c.fd(),
                events: libc::POLLIN,
                revents: 0,
            }));
            if !sys::poll(&mut ready, 0).is_ok_and(|n| n > 0)
                && !leased.iter().any(|(_, c, _)| owed(c))
            {
                return;
            }
        }
        for (i, (qp, conn, role)) in leased.iter().enumerate() {
            if ready.get(i).is_none_or(|p| p.revents != 0) || owed(conn) {
                qp.serve(conn, *role);
            }
        }
    }
}

/// The most leased sockets a sleeping poller waits on (plus the bell).
pub(crate) const SLEEP_FDS: usize = 31;

/// Connections whose threads are parked, process-wide: a poller about to sleep waits on them,
/// and the lease watcher hands back those whose CQ stopped being polled.
static WATCH: Mutex<Watch> = Mutex::new(Watch {
    leased: Vec::new(),
    qps: 0,
    watcher: None,
    generation: 0,
});

/// Where the lease watcher sleeps between its looks, and is told to end.
static WATCH_CV: Condvar = Condvar::new();

#[derive(Debug)]
struct Watch {
    leased: Vec<Leased>,
    /// Soft QPs alive in the process: the watcher ends with the last one, so that a process
    /// that destroyed every QP has none of this crate's threads left.
    qps: usize,
    /// The watcher thread, started by the first lease.
    watcher: Option<JoinHandle<()>>,
    /// Moves when a watcher is told to end: it runs while it still reads its own.
    generation: u64,
}

/// A leased connection, as the lease watcher sees it.
#[derive(Debug)]
struct Leased {
    qp: Weak<Qp>,
    conn: Weak<Conn>,
    role: Role,
    /// The CQ's polls as the watcher last saw them, and when they last moved.
    seen: u64,
    renewed: Instant,
}

fn watch() -> MutexGuard<'static, Watch> {
    WATCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// A soft QP was made.
pub(super) fn qp_born() {
    watch().qps += 1;
}

/// A soft QP was destroyed: with the last one, the lease watcher ends (joined here).
pub(super) fn qp_gone() {
    let ending = {
        let mut w = watch();
        w.qps = w.qps.saturating_sub(1);
        if w.qps > 0 {
            return;
        }
        w.generation += 1;
        w.watcher.take()
    };
    WATCH_CV.notify_all();
    if let Some(t) = ending.filter(|t| t.thread().id() != std::thread::current().id()) {
        let _ = t.join();
    }
}

/// The lease watcher (one thread per process, from the first lease to the last QP): every
/// [`LEASE`] it looks at each leased connection's CQ and hands back those whose CQ was not
/// polled for a lease. One thread's wake-up a millisecond, however many threads are parked.
fn watch_leases(generation: u64) {
    let mut w = watch();
    loop {
        w = WATCH_CV
            .wait_timeout(w, LEASE)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if w.generation != generation {
            return;
        }
        let now = Instant::now();
        let mut lapsed = Vec::new();
        w.leased.retain_mut(|l| {
            let (Some(qp), Some(conn)) = (l.qp.upgrade(), l.conn.upgrade()) else {
                return false;
            };
            let cq = qp.served(l.role);
            let polls = cq.polls.load(Ordering::Relaxed);
            if polls != l.seen {
                (l.seen, l.renewed) = (polls, now);
            } else if now.duration_since(l.renewed) >= cq.lease() {
                lapsed.push((qp, conn));
            }
            true
        });
        if lapsed.is_empty() {
            continue;
        }
        drop(w);
        for (qp, conn) in lapsed {
            qp.hand_back(&conn);
        }
        w = watch();
    }
}

thread_local! {
    /// This thread's last attempt to sleep found bytes waiting on a leased connection.
    static FOUND_WAITING: Cell<bool> = const { Cell::new(false) };
}

/// For a poller about to sleep: the leased sockets to wake on, or `false`: do not sleep yet.
///
/// A connection with bytes already waiting is most likely the next poll's to serve (of this
/// thread or another, of its CQ): the first time, the poller polls on instead of sleeping. If
/// the bytes are still there at its next attempt (a frame nobody's polls take, or part of one
/// that stays partial), the connection goes back to its thread, so that the sleep neither ends
/// at once nor waits for a poll the sleeper may not be the one to make. Going to sleep is as
/// quiet as it gets: the ACKs pollers owe on the other connections go out.
///
/// At most [`SLEEP_FDS`] connections, looked at with one `poll(2)`, so that the sleep
/// allocates nothing and costs the same however many are leased; an arrival on one past them
/// ends the sleep at its bound.
pub(crate) fn sleep_fds(out: &mut SmallVec<[libc::pollfd; SLEEP_FDS + 1]>) -> bool {
    let live: SmallVec<[(Arc<Qp>, Arc<Conn>); SLEEP_FDS]> = watch()
        .leased
        .iter()
        .take(SLEEP_FDS)
        .filter_map(|l| Some((l.qp.upgrade()?, l.conn.upgrade()?)))
        .collect();
    out.extend(live.iter().map(|(_, conn)| libc::pollfd {
        fd: conn.fd(),
        events: libc::POLLIN,
        revents: 0,
    }));
    let waiting = sys::poll(out, 0).is_ok_and(|n| n > 0);
    if waiting && !FOUND_WAITING.replace(true) {
        return false;
    }
    FOUND_WAITING.set(false);
    for ((qp, conn), p) in live.iter().zip(out.iter()) {
        if p.revents != 0 {
            qp.hand_back(conn);
        } else if conn.owes_ack.load(Ordering::Relaxed) {
            qp.serve(conn, Role::Responder);
        }
    }
    if waiting {
        out.retain(|p| p.revents == 0);
    }
    true
}

/// What a parked thread does meanwhile, at least this often, under its QP's lock: the ack
/// reader's retry timer.
pub(super) type Tick<'a> = (Duration, &'a mut dyn FnMut(&mut St));

/// How a parked thread's wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unparked {
    /// The lease lapsed, or a poller handed a frame back: read the connection again.
    Read,
    /// The QP moved on (ERR, reset, destroy), or no lease can be kept (the watcher cannot
    /// start): read the connection to its end, and never park again.
    MovedOn,
}

impl Qp {
    /// The connection's own thread, not holding its turn: leases `conn` (this QP's `role`
    /// end) to the pollers of its CQ and parks until the lease lapses (the lease watcher sees
    /// no poll for [`LEASE`]), a poller hands it back, or the QP moves on. `tick`, if any, runs
    /// under the QP's lock at least that often meanwhile (the ack reader's retry timer).
    pub(super) fn park(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        role: Role,
        mut tick: Option<Tick<'_>>,
    ) -> Unparked {
        {
            let mut w = watch();
            if w.watcher.is_none() {
                let generation = w.generation;
                let started = std::thread::Builder::new()
                    .name("soft-leases".to_owned())
                    .spawn(move || watch_leases(generation));
                match started {
                    Ok(t) => w.watcher = Some(t),
                    Err(e) => {
                        // Without a watcher nothing would end a lease: the thread keeps its
                        // connection, as before leases.
                        tracing::warn!("soft: cannot start the lease watcher ({e}); threads read");
                        return Unparked::MovedOn;
                    }
                }
            }
            // Leased before the watcher can see it, so that a hand-back is never lost.
            conn.leased.store(true, Ordering::Release);
            w.leased.push(Leased {
                qp: Arc::downgrade(self),
                conn: Arc::downgrade(conn),
                role,
                seen: self.served(role).polls.load(Ordering::Relaxed),
                renewed: Instant::now(),
            });
        }
        let mut st = self.lock();
        let end = loop {
            if st.epoch != conn.epoch || st.destroying.is_some() {
                break Unparked::MovedOn;
            }
            if !conn.leased.load(Ordering::Acquire) {
                break Unparked::Read;
            }
            st = match &mut tick {
                Some((every, tick)) => {
                    tick(&mut st);
                    self.park_cv
                        .wait_timeout(st, *every)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.park_cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        };
        drop(st);
        conn.leased.store(false, Ordering::Release);
        watch()
            .leased
            .retain(|l| l.conn.strong_count() > 0 && !ptr_is(&l.conn, conn));
        end
    }

    /// The CQ whose pollers serve this QP's `role` end.
    fn served(&self, role: Role) -> &Served {
        match role {
            Role::Responder => &self.recv_cq.served,
            Role::Acks => &self.send_cq.served,
        }
    }

    /// A poller gives `conn` back to its thread, which wakes and reads it.
    pub(super) fn hand_back(&self, conn: &Conn) {
        conn.leased.store(false, Ordering::Release);
        // Under the lock the parked thread checks `leased` under, so the wake is not lost.
        let _st = self.lock();
        self.park_cv.notify_all();
    }

    /// A poll of `conn`'s CQ: serves what waits whole in the socket, if `conn` is still
    /// leased and nobody else reads it.
    fn serve(&self, conn: &Conn, role: Role) {
        let Some(mut turn) = conn.try_turn() else {
            return;
        };
        if !conn.leased.load(Ordering::Acquire) {
            return;
        }
        let served = match role {
            Role::Responder => self.serve_requests(conn, &mut turn),
            Role::Acks => self.serve_answers(conn),
        };
        if !served {
            self.hand_back(conn);
        }
    }

    /// Places every request waiting whole in the socket, then acknowledges as the responder's
    /// thread would. `false`: a frame for the thread (or the QP moved on), hand it back.
    fn serve_requests(&self, conn: &Conn, turn: &mut Turn) -> bool {
        let fd = conn.fd();
        let mut room = [0u8; LOOK];
        // Whether a frame arrived, and whether one asked for an answer.
        let (mut served, mut asked) = (false, false);
        let quiet = loop {
            let n = match wire::look(fd, &mut room) {
                Look::Bytes(n) => n,
                Look::Nothing => break true,
                Look::Ended => return false,
            };
            // Every whole frame the look holds is served from the copy, then taken off the
            // socket at once.
            let (mut at, mut next) = (0, Next::Look);
            served |= n >= REQ_LEN;
            while let Some(hdr) = room[at..n].first_chunk::<REQ_LEN>() {
                let Some(req) = Request::decode(hdr).ok().filter(Self::servable) else {
                    next = Next::HandBack;
                    break;
                };
                // What follows the header: the payload, or a pulled payload's descriptors.
                let (body, pulled) = match (req.pulled(), turn.pull_from) {
                    (false, _) => (req.payload_on_wire(), None),
                    (true, Some(pid)) => match Source::looked(&room[at + REQ_LEN..n], pid, req.len)
                    {
                        Ok(Some((src, used))) => (used, Some(src)),
                        Ok(None) if n < LOOK => {
                            next = Next::Wait;
                            break;
                        }
                        _ => {
                            next = Next::HandBack;
                            break;
                        }
                    },
                    (true, None) => {
                        next = Next::HandBack;
                        break;
                    }
                };
                let end = at + REQ_LEN + body;
                if end > n {
                    // Larger than a look, or not all here yet.
                    next = match end - at > LOOK {
                        true => Next::Read(body),
                        false => Next::Wait,
                    };
                    break;
                }
                if cfg!(feature = "fault-injection") && self.stalled() {
                    next = Next::HandBack;
                    break;
                }
                asked |= req.flags & FLAG_ACK_REQ != 0;
                let looked = match pulled {
                    Some(src) => Looked::Pulled(src),
                    None => Looked::Payload(&room[at + REQ_LEN..end]),
                };
                let placed = self.request(conn, turn, Ok(req), Some(looked));
                at = end;
                if !placed {
                    next = Next::HandBack;
                    break;
                }
                self.recv_cq.served.served_one();
            }
            if wire::read_into(fd, Dst::from(&mut room[..at]), false).is_err() {
                return false;
            }
            match next {
                Next::HandBack => return false,
                Next::Wait => break false,
                // One frame larger than a look: read from the socket once it is all there.
                Next::Read(body) if wire::holds(fd, REQ_LEN + body) => {
                    let Ok(hdr) = wire::read_exact::<REQ_LEN>(fd, false) else {
                        return false;
                    };
                    if !self.request(conn, turn, Request::decode(&hdr), None) {
                        return false;
                    }
                    self.recv_cq.served.served_one();
                }
                Next::Read(_) => break false,
                // The look took all there was: nothing more waits.
                Next::Look if n < LOOK && at == n => break true,
                Next::Look if at == 0 => break false,
                Next::Look => {}
            }
        };
        // A request that asked for an answer is acknowledged now, with everything before it;
        // requests that did not (a clear-to-send written unsignaled) are acknowledged by the
        // next poll that finds the connection quiet, so the ACK is not in the way of what the
        // caller does with this poll's completions. A CQ that is not polled again passes the
        // connection back to its thread within a lease, which acknowledges before it waits.
        if !quiet || turn.unacked.is_none() {
            return true;
        }
        if asked || !served {
            return self.settle(conn, turn);
        }
        conn.owes_ack.store(true, Ordering::Relaxed);
        true
    }

    /// Whether a poller serves `req` itself: placements (sent or pulled) and READs and
    /// atomics of up to [`SERVE_MAX`]; not the frames that open or close a connection.
    fn servable(req: &Request) -> bool {
        let placed = matches!(
            req.op,
            ReqOp::Write
                | ReqOp::WriteImm
                | ReqOp::Send
                | ReqOp::SendImm
                | ReqOp::Read
                | ReqOp::FetchAdd
                | ReqOp::CmpSwap
        );
        placed
            && req.payload_on_wire() <= SERVE_MAX
            && (!(req.op.returns_data() || req.pulled()) || req.len as usize <= SERVE_MAX)
    }

    /// Takes every ACK and small READ answer waiting whole in the socket. `false`: a frame for
    /// the thread (or the QP moved on), hand it back.
    fn serve_answers(&self, conn: &Conn) -> bool {
        let fd = conn.fd();
        let mut room = [0u8; LOOK];
        loop {
            let n = match wire::look(fd, &mut room) {
                Look::Bytes(n) => n,
                Look::Nothing => return true,
                Look::Ended => return false,
            };
            let (mut at, mut next) = (0, Next::Look);
            while let Some(hdr) = room[at..n].first_chunk::<RESP_LEN>() {
                next = match Response::decode(hdr) {
                    Some(resp) if resp.op == RespOp::Ack => {
                        at += RESP_LEN;
                        if self.answer(conn, resp) {
                            self.send_cq.served.served_one();
                            continue;
                        }
                        Next::HandBack
                    }
                    // READ data goes straight from the socket to the WR's buffers.
                    Some(resp) if resp.op == RespOp::ReadResp && resp.len as usize <= SERVE_MAX => {
                        Next::Read(resp.len as usize)
                    }
                    _ => Next::HandBack,
                };
                break;
            }
            if wire::read_into(fd, Dst::from(&mut room[..at]), false).is_err() {
                return false;
            }
            match next {
                Next::HandBack => return false,
                Next::Read(body) if wire::holds(fd, RESP_LEN + body) => {
                    let resp = wire::read_exact::<RESP_LEN>(fd, false)
                        .ok()
                        .and_then(|h| Response::decode(&h));
                    if !resp.is_some_and(|r| self.answer(conn, r)) {
                        return false;
                    }
                    self.send_cq.served.served_one();
                }
                Next::Read(_) | Next::Wait => return true,
                Next::Look if (n < LOOK && at == n) || at == 0 => return true,
                Next::Look => {}
            }
        }
    }

    /// Whether fault injection stalls the responder now (`fault::stall`): its thread waits it
    /// out.
    fn stalled(&self) -> bool {
        self.lock().stall_until.is_some_and(|u| u > Instant::now())
    }
}

fn ptr_is(weak: &Weak<Conn>, conn: &Arc<Conn>) -> bool {
    std::ptr::eq(weak.as_ptr(), Arc::as_ptr(conn))
}
