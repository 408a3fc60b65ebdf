//! The requester: `post_send` and `post_recv`, and the sender thread that takes WRs in order,
//! checks their local keys and sends header + payload in one `sendmsg` straight from the source
//! buffers (a small WR posted to an idle queue is sent the same way by the posting thread
//! itself), and says BYE when the QP is destroyed.
//!
//! Separate from the ack reader, which retires what this sends, and from the responder, which
//! serves the other direction: each is its own thread with its own connection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys::{ibv_qp_state, ibv_wc_opcode, ibv_wc_status};
use smallvec::SmallVec;

use super::admission::ConnectFail;
use super::in_process::PeerPath;
use super::pull;
use super::serve::Role;
use super::{Attrs, Conn, DRAIN_ACKS, MAX_INLINE, MAX_MSG, Qp, RecvWqe, SendWqe, Sge, Sges, St};
use crate::abi::memory::Src;
use crate::event::Wc;
use crate::mr::{LOCAL_WRITE, MrGuard};
use crate::wire::{self, ATOMIC_WORD, FLAG_ACK_REQ, FLAG_PULL, ReqOp, Request, SEG_LEN};

/// Messages up to this size are sent by the posting thread itself when the send queue is idle
/// (no hand-off to the sender thread: one thread wake-up less per small message). Larger ones
/// always go through the sender thread, so `post_send` never waits on the network.
const DIRECT_SEND_MAX: u32 = 64 * 1024;

/// Where a WR's inline payload or an atomic's operands are copied while it is sent (the WR
/// keeps its own): on the stack, room for the largest inline payload, and not zeroed first as
/// an array would be, a kilobyte per WR.
pub(super) type InlineCopy = SmallVec<[u8; MAX_INLINE as usize]>;

impl Qp {
    /// Takes back the inline buffer of a retired WR into `spare` (the QP's
    /// `St::inline_spare`, which `post_send` draws on).
    pub(super) fn recycle(&self, spare: &mut Vec<Vec<u8>>, w: SendWqe) {
        let Some(mut buf) = w.inline else { return };
        if spare.len() < self.caps.max_send_wr as usize {
            buf.clear();
            spare.push(buf);
        }
    }

    /// `post_send` of one WR: EINVAL outside RTS (ERR flushes it instead, as hardware does),
    /// ENOMEM when the send queue is full. `inline` is the payload of an inline send
    /// (`IBV_SEND_INLINE`), in the caller's pieces: copied under the lock the post takes anyway,
    /// into a buffer a retired WR left.
    pub(crate) fn post_send(
        self: &Arc<Self>,
        mut w: SendWqe,
        inline: Option<&[&[u8]]>,
    ) -> Result<(), i32> {
        if w.sges.len() > self.caps.max_send_sge as usize {
            return Err(libc::EINVAL);
        }
        let len: u64 = match inline {
            Some(parts) => match parts.iter().map(|p| p.len()).sum::<usize>() {
                n if n > self.caps.max_inline as usize => return Err(libc::EINVAL),
                n => n as u64,
            },
            None => w.sges.iter().map(|s| u64::from(s.len)).sum(),
        };
        if len > MAX_MSG {
            return Err(libc::EINVAL);
        }
        let mut st = self.lock();
        if self.in_process
            && matches!(st.peer, PeerPath::Unresolved)
            && st.state == ibv_qp_state::IBV_QPS_RTS
        {
            drop(st);
            self.resolve_peer();
            st = self.lock();
        }
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
        if let Some(parts) = inline {
            let mut data = st
                .inline_spare
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(self.caps.max_inline as usize));
            for p in parts {
                data.extend_from_slice(p);
            }
            w.inline = Some(data);
        }
        w.len = len as u32;
        w.seq = st.next_seq;
        st.next_seq += 1;
        let seq = w.seq;
        st.sq.push_back(w);
        if let PeerPath::Local(_) = st.peer {
            // In process: carried out here and now (the sender thread never sees it).
            self.deliver_pending(st);
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
    pub(super) fn sender_needed(&self, st: &St) -> bool {
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

    /// The retry budget: `4.096 µs × 2^timeout × (retry_cnt + 1)`; `timeout = 0` is infinite.
    pub(super) fn retry_budget(a: &Attrs) -> Option<Duration> {
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
                    let now = Instant::now();
                    let paused = st.rnr_resume.filter(|t| *t > now);
                    let sendable = st.state == ibv_qp_state::IBV_QPS_RTS
                        && paused.is_none()
                        && st.send_cursor < st.next_seq
                        && !matches!(st.peer, PeerPath::Local(_));
                    if let Some(since) = st.destroying
                        && (!sendable || st.requester_stopped())
                    {
                        drop(st);
                        self.say_bye(since);
                        return;
                    }
                    if sendable {
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
                    // Being destroyed, the wait ends with the drain at the latest.
                    let until = match (paused, st.destroying) {
                        (Some(t), _) => Some(t),
                        (None, Some(since)) => Some(since + DRAIN_ACKS),
                        (None, None) => None,
                    };
                    st = match until {
                        Some(t) => {
                            self.cv
                                .wait_timeout(st, t.saturating_duration_since(now))
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
                        if st.epoch != epoch || st.requester_stopped() {
                            conn.kill();
                            continue;
                        }
                        st.req_conn = Some(Arc::clone(&conn));
                        drop(st);
                        self.send_cq.served.add(&self, &conn, Role::Acks);
                        self.spawn("ack", move |qp| qp.ack_loop(conn));
                    }
                    // Destroyed meanwhile, with a peer that no longer admits us: nothing
                    // posted can go out, so the drain ends here (not by knocking again).
                    Err(ConnectFail::Stale) => {
                        let destroying = self.lock().destroying;
                        if let Some(since) = destroying {
                            self.say_bye(since);
                            return;
                        }
                    }
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
    /// (at most [`DRAIN_ACKS`] after the destroy began) until everything sent is acknowledged,
    /// then BYE and close the writing side; the ack reader reads on until the peer closes its
    /// side. The sender loop comes here once what was posted before the destroy is sent, or
    /// when that time is up: work still not sent then is discarded.
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
        if wire::send_all(c.fd(), &mut [Src::from(&bye[..])], &|| true, false).is_ok() {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
    }

    /// READs and atomics in flight stay within `max_rd_atomic` (at least one).
    fn may_send(&self, st: &St) -> bool {
        let Some(w) = Self::wqe(st, st.send_cursor) else {
            return false;
        };
        if !w.op.returns_data() {
            return true;
        }
        let reads = st
            .sq
            .iter()
            .filter(|w| w.op.returns_data() && !w.acked && w.seq < st.send_cursor)
            .count();
        reads < usize::from(st.attrs.max_rd_atomic.max(1))
    }

    pub(super) fn wqe(st: &St, seq: u64) -> Option<&SendWqe> {
        let front = st.sq.front()?.seq;
        st.sq.get(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    fn wqe_mut(st: &mut St, seq: u64) -> Option<&mut SendWqe> {
        let front = st.sq.front()?.seq;
        st.sq
            .get_mut(usize::try_from(seq.checked_sub(front)?).ok()?)
    }

    /// Sends the WR at the cursor: local key checks, then header + payload in one `sendmsg`
    /// (or, pulled, header + segment descriptors, the sources staying pinned until answered).
    /// With `try_first` (a posting thread), a full socket buffer puts the WR back for the
    /// sender thread instead of waiting. The caller holds `tx_busy`.
    fn transmit(&self, epoch: u64, conn: &Conn, try_first: bool) {
        let mut inline_copy = InlineCopy::new();
        let Some((mut req, sges, inline)) =
            self.claim(epoch, &mut inline_copy, Some(Instant::now()))
        else {
            return;
        };
        let Some(guards) = self.pin_local(epoch, &req, &sges, inline.is_some()) else {
            return;
        };
        let pulled = pull::wanted(conn.pulls, &req, inline.is_some());
        if pulled {
            req.flags |= FLAG_PULL;
        }
        let hdr = req.encode();
        let mut segs: SmallVec<[[u8; SEG_LEN]; 1]> = SmallVec::new();
        let mut iov: SmallVec<[Src<'_>; 2]> = smallvec::smallvec![Src::from(&hdr[..])];
        if req.op != ReqOp::Read {
            match inline {
                Some(data) => iov.push(Src::from(data)),
                None => {
                    let mut gi = guards.iter();
                    for s in sges.iter().filter(|s| s.len > 0) {
                        let g = gi.next().expect("one guard per non-empty SGE");
                        match pulled {
                            true => {
                                segs.push(wire::encode_seg(g.region().addr(), u64::from(s.len)))
                            }
                            false => iov.push(g.region().src()),
                        }
                    }
                }
            }
        }
        if pulled {
            iov.push(Src::from(segs.as_flattened()));
        }
        let abort = || {
            let st = self.lock();
            st.requester_stopped() || st.epoch != epoch
        };
        let sent = wire::send_all(conn.fd(), &mut iov, &abort, try_first);
        // The iovecs borrow the guards, which may be held on now.
        drop(iov);
        if pulled && let Ok(true) = sent {
            self.hold_for_pull(conn, epoch, req.seq, guards);
        } else {
            drop(guards);
        }
        if let Ok(true) = sent
            && !req.op.returns_data()
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

    /// Keeps the sources of pulled WR `seq` pinned until the responder answers it: it reads
    /// them after the header left. Already answered (the answer can beat us here), or failed
    /// meanwhile: nothing reads them any more, and the guards drop.
    fn hold_for_pull(&self, conn: &Conn, epoch: u64, seq: u64, guards: SmallVec<[MrGuard; 1]>) {
        let mut st = self.lock();
        // The connection ended meanwhile (the ack reader let it go): nobody reads them.
        if st.epoch != epoch
            || !st
                .req_conn
                .as_deref()
                .is_some_and(|c| std::ptr::eq(c, conn))
        {
            return;
        }
        if let Some(w) = Self::wqe_mut(&mut st, seq).filter(|w| !w.acked) {
            w.pinned = Some(Box::new(guards));
        }
    }

    /// Takes the WR at the send cursor (see [`next_request`](Self::next_request)) unless the
    /// QP moved on meanwhile.
    fn claim<'b>(
        &self,
        epoch: u64,
        inline_copy: &'b mut InlineCopy,
        sent_at: Option<Instant>,
    ) -> Option<(Request, Sges, Option<&'b [u8]>)> {
        let mut st = self.lock();
        if st.epoch != epoch {
            return None;
        }
        Self::next_request(&mut st, inline_copy, sent_at)
    }

    /// Under the lock, takes the WR at the send cursor: its request header, its SGEs, and
    /// what it carries itself after the header — its inline payload, or an atomic's operands
    /// (encoded [`AtomicArgs`](crate::wire::AtomicArgs)) — copied into `inline_copy` (the WR
    /// keeps its own copy for a retransmission, and nothing here allocates). `sent_at` starts
    /// the WR's retry timer (over TCP; the in-process path completes it before returning and
    /// reads no clock). `None` when the queue no longer holds it (cleared by `destroy`).
    pub(super) fn next_request<'b>(
        st: &mut St,
        inline_copy: &'b mut InlineCopy,
        sent_at: Option<Instant>,
    ) -> Option<(Request, Sges, Option<&'b [u8]>)> {
        let seq = st.send_cursor;
        st.send_cursor += 1;
        let w = Self::wqe_mut(st, seq)?;
        w.sent_at = sent_at;
        let req = Request {
            op: w.op,
            flags: if w.ack_req() { FLAG_ACK_REQ } else { 0 },
            len: w.len,
            seq: w.seq,
            raddr: w.raddr,
            rkey: w.rkey,
            imm: w.imm,
        };
        let args = w.op.is_atomic().then(|| w.atomic.encode());
        let inline = match args.as_ref().map(|a| &a[..]).or(w.inline.as_deref()) {
            Some(data) => {
                inline_copy.clear();
                inline_copy.extend_from_slice(data);
                Some(&inline_copy[..])
            }
            None => None,
        };
        Some((req, w.sges.clone(), inline))
    }

    /// Local protection: every non-empty SGE of `req` inside an MR of our PD with the access
    /// it needs (a READ or an atomic writes them), pinned while the guards live. A violation
    /// fails the QP (`IBV_WC_LOC_PROT_ERR`; an atomic whose SGEs do not hold exactly the 8
    /// bytes it returns, `IBV_WC_LOC_LEN_ERR`) and returns `None`. Inline payloads were copied
    /// at post time and need no key (`inline` carrying an atomic's operands does not count).
    pub(super) fn pin_local(
        &self,
        epoch: u64,
        req: &Request,
        sges: &[Sge],
        inline: bool,
    ) -> Option<SmallVec<[MrGuard; 1]>> {
        let mut guards = SmallVec::new();
        if inline && !req.op.is_atomic() {
            return Some(guards);
        }
        let fail = |status| {
            let mut st = self.lock();
            if st.epoch == epoch {
                self.fail(&mut st, Some((req.seq, status)), None);
            }
            None
        };
        if req.op.is_atomic() && req.len != ATOMIC_WORD {
            return fail(ibv_wc_status::IBV_WC_LOC_LEN_ERR);
        }
        let need = if req.op.returns_data() {
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
                Err(_) => return fail(ibv_wc_status::IBV_WC_LOC_PROT_ERR),
            }
        }
        Some(guards)
    }
}
