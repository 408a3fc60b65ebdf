//! The responder (one thread per admitted connection): applies requests strictly in sequence,
//! checks each (rkey, PD, bounds, access flags, a posted receive for the ones that consume
//! one), reads the payload straight into registered memory, serves READs and atomics, produces
//! receive completions, and answers: coalesced ACKs, NAKs that move both QPs to ERR, RNR NAKs.
//!
//! Separate because it is the target side of a QP, with its own connection and thread; its
//! checks and placement ([`Qp::place`]) are also what an in-process delivery runs, and what it
//! does with one request ([`Qp::request`]) is also what a thread polling the receive CQ does
//! while the connection is leased to it (the `serve` module).

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use ibverbs_sys::{ibv_event_type, ibv_qp_state, ibv_wc_opcode, ibv_wc_status};
use smallvec::SmallVec;

use super::conn::Turn;
use super::in_process::MemLink;
use super::pull::Source;
use super::serve::{Role, Unparked};
use super::{Conn, DRAIN_ACKS, Qp, RecvWqe, St};
use crate::abi::memory::{AtomicOp, Dst, Src, copy};
use crate::event::Wc;
use crate::mr::{LOCAL_WRITE, MrGuard, REMOTE_ATOMIC, REMOTE_READ, REMOTE_WRITE};
use crate::wire::{
    self, ATOMIC_ARGS_LEN, ATOMIC_WORD, AtomicArgs, FLAG_ACK_REQ, Nak, REQ_LEN, ReadEnd, ReqOp,
    Request, RespOp, Response,
};

/// What follows a request's header when a poller's look copied the whole frame (the `serve`
/// module).
pub(super) enum Looked<'a> {
    /// The payload (empty for a request without one).
    Payload(&'a [u8]),
    /// A pulled payload's descriptors, as the look decoded them.
    Pulled(Source),
}

/// How a request reaches its responder.
pub(super) enum Link<'a> {
    /// Over the requester's TCP connection: the payload follows the header on it, and NAKs and
    /// READ data go back on it.
    Tcp(&'a Conn),
    /// Over the requester's TCP connection, the payload pulled from the requester's memory
    /// (same-host pull, the `pull` module).
    Pulled(&'a Conn, &'a Source),
    /// Over the requester's TCP connection, the payload already copied out of the socket by a
    /// poller's look (the `serve` module), which takes the frame off the socket afterwards:
    /// what is left of it to read.
    Looked(&'a Conn, Cell<&'a [u8]>),
    /// Delivered in process ([`crate::Delivery::InProcess`]): the payload is read from, and
    /// READ data written to, the requester's memory.
    Memory(&'a MemLink<'a>),
}

impl Link<'_> {
    /// The epoch of the responder QP the request was admitted in.
    fn epoch(&self) -> u64 {
        match self {
            Link::Tcp(c) | Link::Pulled(c, _) | Link::Looked(c, _) => c.epoch,
            Link::Memory(m) => m.epoch,
        }
    }

    /// Reads the next `dst.len()` payload bytes into `dst`.
    fn read_into(&self, dst: Dst<'_>) -> Result<(), ReadEnd> {
        match self {
            Link::Tcp(c) => wire::read_into(c.fd(), dst, false),
            Link::Pulled(_, src) => src.read_into(dst),
            Link::Looked(_, rest) => {
                let (now, later) = rest
                    .get()
                    .split_at_checked(dst.len())
                    .ok_or(ReadEnd::Closed)?;
                copy(Src::from(now), dst);
                rest.set(later);
                Ok(())
            }
            Link::Memory(m) => match m.read_into(dst) == dst.len() {
                true => Ok(()),
                // Fewer bytes than the header said: as a connection cut mid-payload.
                false => Err(ReadEnd::Closed),
            },
        }
    }

    /// Throws away `len` payload bytes that are not placed (a refused or discarded request):
    /// read off the socket; nothing to do in process, or for a frame a poller looked at, which
    /// it takes off the socket whole afterwards. `false`: the connection broke.
    fn discard(&self, len: usize) -> bool {
        match self {
            Link::Tcp(c) | Link::Pulled(c, _) => wire::drain(c.fd(), len).is_ok(),
            Link::Looked(..) | Link::Memory(_) => true,
        }
    }

    /// Counts payload received on the port: what a NIC's counters would show, pulled or not
    /// (in-process delivery crosses no port).
    fn received(&self, bytes: u32) {
        if let Link::Tcp(c) | Link::Pulled(c, _) | Link::Looked(c, _) = self {
            c.traffic.received(bytes);
        }
    }
}

/// What the responder read under the QP's lock when it admitted a request, so that placing
/// it takes the lock no more.
pub(super) struct Admitted {
    /// The QP's access flags (`IBV_ACCESS_REMOTE_*`).
    pub(super) access: u32,
    /// The receive a WRITE_WITH_IMM or a SEND consumes.
    pub(super) recv: Option<RecvWqe>,
    /// The requester's QP number, for the receive completion.
    pub(super) src_qp: u32,
}

impl Qp {
    /// Sends one answer, followed by `data` (a READ's, or an atomic's original value);
    /// `false`: the connection broke, or a blocked write was given up because this QP is going
    /// away or moved on.
    fn respond(&self, conn: &Conn, resp: Response, data: Option<Src<'_>>) -> bool {
        let hdr = resp.encode();
        // On the stack: a poller serving a connection answers on the caller's thread, which
        // allocates nothing per message.
        let mut iov: SmallVec<[Src<'_>; 2]> = smallvec::smallvec![Src::from(&hdr[..])];
        iov.extend(data);
        let abort = || {
            let st = self.lock();
            st.destroying.is_some() || st.epoch != conn.epoch
        };
        wire::send_all(conn.fd(), &mut iov, &abort, false).is_ok()
    }

    /// Refuses `req`: NAKs it (over TCP, after draining its payload; in process, by telling the
    /// requester), and moves this QP to ERR with `event`.
    fn refuse(&self, link: &Link<'_>, req: &Request, nak: Nak, event: Option<ibv_event_type>) {
        if let Link::Tcp(_) | Link::Pulled(..) | Link::Looked(..) = link {
            drop(self.posted_placed(self.lock(), link.epoch()));
        }
        match link {
            Link::Tcp(conn) | Link::Pulled(conn, _) | Link::Looked(conn, _) => {
                link.discard(req.payload_on_wire());
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

    /// Waits (at most [`DRAIN_ACKS`]) until every WR this QP's requester has posted so far
    /// was placed at the peer (acknowledged), before the responder refuses a request — which
    /// takes both QPs to ERR. A NIC sends a posted WR within a microsecond, and a request that
    /// depends on it arrives a round trip later at the earliest: a receiver's clear-to-send on
    /// one QP lets the sender write into a buffer the receiver has deregistered since, over
    /// another QP whose own clear-to-send entries a NIC delivered long before. Here they may
    /// still wait for a thread or a connection; refusing first would lose them.
    fn posted_placed<'a>(&'a self, mut st: MutexGuard<'a, St>, epoch: u64) -> MutexGuard<'a, St> {
        let posted = st.next_seq;
        let end = Instant::now() + DRAIN_ACKS;
        while st.epoch == epoch
            && st.state == ibv_qp_state::IBV_QPS_RTS
            && !st.requester_stopped()
            && st.sq.iter().any(|w| w.seq < posted && !w.acked)
        {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // Nobody signals an acknowledgement: look again every millisecond, on an error path.
            st = self
                .cv
                .wait_timeout(st, left.min(Duration::from_millis(1)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st
    }

    /// Acknowledges what the reader of `conn` placed and has not acknowledged yet, if
    /// anything; `false` = stop.
    pub(super) fn settle(&self, conn: &Conn, turn: &mut Turn) -> bool {
        let Some(seq) = turn.unacked else {
            return true;
        };
        conn.owes_ack.store(false, Ordering::Relaxed);
        turn.unacked = None;
        self.ack(conn, seq)
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

    /// The responder's side of fault injection's `Qp::stall`, after it read a request of connection epoch
    /// `epoch`: waits while the stall lasts, and no longer once that connection is gone (the
    /// QP failed, was reset or is being destroyed: the request is discarded anyway).
    fn wait_out_stall(&self, epoch: u64) {
        let mut st = self.lock();
        while let Some(left) = st
            .stall_until
            .and_then(|u| u.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero() && st.epoch == epoch && st.destroying.is_none())
        {
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(super) fn responder_loop(self: Arc<Self>, conn: Arc<Conn>) {
        let fd = conn.fd();
        // The receive CQ's polls as last seen, and whether the connection may still be leased
        // to them (not once the QP moved on).
        let (mut polls, mut lease) = (0, true);
        loop {
            {
                let mut turn = conn.turn();
                loop {
                    let quiet = !wire::readable(fd);
                    if quiet && !self.settle(&conn, &mut turn) {
                        return;
                    }
                    if lease && quiet && self.recv_cq.served.polled_since(&mut polls) {
                        break;
                    }
                    let req = match wire::read_exact::<REQ_LEN>(fd, false) {
                        Ok(b) => Request::decode(&b),
                        Err(_) => {
                            // EOF without BYE: the requester vanished (cut, crash, its QP
                            // failed).
                            self.closed(&Link::Tcp(&conn));
                            return;
                        }
                    };
                    self.wait_out_stall(conn.epoch);
                    if !self.request(&conn, &mut turn, req, None) {
                        return;
                    }
                }
            }
            lease = self.park(&conn, Role::Responder, None) == Unparked::Read;
        }
    }

    /// What the responder does with one request whose header it read, from its own thread or
    /// from a poller's (the `serve` module): the checks, the placement, the answers.
    /// `looked`: what follows the header, when a poller's look already copied the whole frame
    /// out of the socket (it takes the frame off afterwards, and acknowledges once for all it
    /// looked at). `false`: stop serving the connection.
    pub(super) fn request(
        &self,
        conn: &Conn,
        turn: &mut Turn,
        req: Result<Request, u64>,
        looked: Option<Looked<'_>>,
    ) -> bool {
        let req = match req {
            Ok(r) => r,
            Err(seq) => {
                self.malformed(conn, seq);
                return false;
            }
        };
        if req.op == ReqOp::PullOffer {
            let (verdict, pid) = self.judge_offer(&req);
            turn.pull_from = pid;
            return self.respond(conn, verdict.frame(), None);
        }
        let by_poller = looked.is_some();
        // A pulled payload's descriptors are part of its request, whatever becomes of it.
        let (source, payload) = match (req.pulled(), turn.pull_from, looked) {
            (false, _, None) => (None, None),
            (false, _, Some(Looked::Payload(bytes))) => (None, Some(bytes)),
            (true, Some(_), Some(Looked::Pulled(src))) if req.carries_payload() => {
                (Some(src), None)
            }
            (true, Some(pid), None) if req.carries_payload() => {
                match Source::read(conn.fd(), pid, req.len) {
                    Ok(s) => (Some(s), None),
                    Err(None) => {
                        self.malformed(conn, req.seq);
                        return false;
                    }
                    Err(Some(_)) => return self.closed(&Link::Tcp(conn)),
                }
            }
            // Pulled without an agreement, or a pulled READ (which a poller's look never
            // decodes either).
            _ => {
                self.malformed(conn, req.seq);
                return false;
            }
        };
        let link = match (&source, payload) {
            (Some(src), _) => Link::Pulled(conn, src),
            (None, Some(body)) => Link::Looked(conn, Cell::new(body)),
            (None, None) => Link::Tcp(conn),
        };
        if req.op == ReqOp::Bye {
            // An orderly close: the requester waited for its acknowledgements and sends
            // nothing more. Close our side too, so its ack reader sees the end and stops.
            self.settle(conn, turn);
            return self.closed(&Link::Tcp(conn));
        }
        let admitted = {
            let mut st = self.lock();
            if st.epoch != conn.epoch || st.destroying.is_some() {
                return false;
            }
            if req.seq != st.expected_seq {
                // Go back N: after a NAK everything up to the retransmission is discarded.
                drop(st);
                return link.discard(req.payload_on_wire());
            }
            let consumes = matches!(req.op, ReqOp::WriteImm | ReqOp::Send | ReqOp::SendImm);
            let recv = if consumes {
                match st.rq.pop_front() {
                    Some(r) => Some(r),
                    None => {
                        let timer = st.attrs.min_rnr_timer;
                        drop(st);
                        return link.discard(req.payload_on_wire())
                            && self.respond(
                                conn,
                                Response {
                                    op: RespOp::RnrNak,
                                    syndrome: timer,
                                    len: 0,
                                    seq: req.seq,
                                },
                                None,
                            );
                    }
                }
            } else {
                None
            };
            Admitted {
                access: st.attrs.access,
                recv,
                src_qp: st.attrs.dest_qpn,
            }
        };
        if !self.place(&link, &req, admitted) {
            return false;
        }
        if source.is_some() {
            self.pulled.fetch_add(u64::from(req.len), Ordering::Relaxed);
        }
        let mut st = self.lock();
        if st.epoch != conn.epoch {
            return false;
        }
        st.expected_seq += 1;
        drop(st);
        // A READ (or atomic) response acknowledges everything before it, as an ACK would.
        turn.unacked = (!req.op.returns_data()).then_some(req.seq);
        if req.flags & FLAG_ACK_REQ != 0 && !req.op.returns_data() && !by_poller {
            if !self.ack(conn, req.seq) {
                return false;
            }
            turn.unacked = None;
        }
        true
    }

    /// A request that cannot be parsed: NAK it (`IBV_WC_REM_INV_REQ_ERR`) and fail; nothing
    /// after it on the connection can be trusted to be framed right.
    fn malformed(&self, conn: &Conn, seq: u64) {
        self.respond(
            conn,
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
    }

    /// Carries out an admitted request in sequence: places a write or send, serves a read or
    /// an atomic.
    /// `false`: refused, or the link broke (this QP has failed).
    pub(super) fn place(&self, link: &Link<'_>, req: &Request, admitted: Admitted) -> bool {
        match req.op {
            ReqOp::Write | ReqOp::WriteImm => self.place_write(link, req, admitted),
            ReqOp::Send | ReqOp::SendImm => self.place_send(link, req, admitted),
            ReqOp::Read => self.serve_read(link, req, admitted.access),
            ReqOp::FetchAdd | ReqOp::CmpSwap => self.serve_atomic(link, req, admitted.access),
            // End or open a connection; the responder loop handles them before anything is
            // placed.
            ReqOp::Bye | ReqOp::PullOffer => false,
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

    fn place_write(&self, link: &Link<'_>, req: &Request, admitted: Admitted) -> bool {
        let Admitted {
            access,
            recv,
            src_qp,
        } = admitted;
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
            if link.read_into(guard.region().dst()).is_err() {
                self.unconsume(link.epoch(), recv);
                return self.closed(link);
            }
            link.received(req.len);
        }
        let Some(r) = recv else {
            // No completion tells a poller about this write (a clear-to-send entry it checks).
            crate::activity::happened();
            return true;
        };
        self.recv_cq.complete(Wc {
            wr_id: r.wr_id,
            status: ibv_wc_status::IBV_WC_SUCCESS,
            opcode: ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: req.len,
            imm: Some(req.imm),
            qp_num: self.qpn,
            src_qp,
        });
        true
    }

    fn place_send(&self, link: &Link<'_>, req: &Request, admitted: Admitted) -> bool {
        let r = admitted.recv.expect("sends consume a receive");
        let capacity: u64 = r.sges.iter().map(|s| u64::from(s.len)).sum();
        let src_qp = admitted.src_qp;
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
        let mut guards: SmallVec<[MrGuard; 1]> = SmallVec::new();
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
                Ok(g) => guards.push(g),
                Err(_) => {
                    self.recv_cq
                        .complete(recv_error(ibv_wc_status::IBV_WC_LOC_PROT_ERR));
                    self.refuse(link, req, Nak::RemoteOperation, None);
                    return false;
                }
            }
            left -= take;
        }
        for g in &guards {
            if link.read_into(g.region().dst()).is_err() {
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
        self.answer_with_data(link, req, guard.as_ref().map(|g| g.region().src()))
    }

    /// An atomic (FETCH_AND_ADD, CMP_AND_SWP) on 8 bytes of our memory: the checks of a READ
    /// with `IBV_ACCESS_REMOTE_ATOMIC` instead (a violation is `IBV_WC_REM_ACCESS_ERR`), then an
    /// 8-byte-aligned address and an 8-byte length (else `IBV_WC_REM_INV_REQ_ERR`, what a NIC —
    /// and rxe — answers a misaligned atomic with), all before its operands are read off the
    /// link. The operation itself is one 64-bit atomic instruction on the memory (the `memory`
    /// module's `Word`), so it is atomic against every QP's atomics on that address; the
    /// original value goes back as a READ response.
    fn serve_atomic(&self, link: &Link<'_>, req: &Request, access: u32) -> bool {
        let guard = match access & REMOTE_ATOMIC {
            0 => None,
            _ => self
                .ctx
                .mrs
                .acquire(
                    req.rkey,
                    self.pd,
                    req.raddr,
                    ATOMIC_WORD as usize,
                    REMOTE_ATOMIC,
                )
                .ok(),
        };
        let Some(guard) = guard else {
            self.refuse(
                link,
                req,
                Nak::RemoteAccess,
                Some(ibv_event_type::IBV_EVENT_QP_ACCESS_ERR),
            );
            return false;
        };
        let word = guard
            .region()
            .word()
            .filter(|_| req.raddr.is_multiple_of(u64::from(ATOMIC_WORD)) && req.len == ATOMIC_WORD);
        let Some(word) = word else {
            self.refuse(
                link,
                req,
                Nak::InvalidRequest,
                Some(ibv_event_type::IBV_EVENT_QP_REQ_ERR),
            );
            return false;
        };
        let mut args = [0u8; ATOMIC_ARGS_LEN];
        if link.read_into(Dst::from(&mut args[..])).is_err() {
            return self.closed(link);
        }
        let AtomicArgs { compare_add, swap } = AtomicArgs::decode(&args);
        let op = match req.op {
            ReqOp::FetchAdd => AtomicOp::FetchAdd(compare_add),
            _ => AtomicOp::CompareSwap {
                compare: compare_add,
                swap,
            },
        };
        let original = word.apply(op).to_ne_bytes();
        drop(guard);
        self.answer_with_data(link, req, Some(Src::from(&original[..])))
    }

    /// Answers READ or atomic `req` with `data` (none for an empty READ): over TCP as a READ
    /// response, in process straight into the requester's buffers.
    fn answer_with_data(&self, link: &Link<'_>, req: &Request, data: Option<Src<'_>>) -> bool {
        let resp = Response {
            op: RespOp::ReadResp,
            syndrome: 0,
            len: req.len,
            seq: req.seq,
        };
        let sent = match link {
            Link::Tcp(conn) | Link::Pulled(conn, _) | Link::Looked(conn, _) => {
                let sent = self.respond(conn, resp, data);
                if sent {
                    conn.traffic.sent(req.len);
                }
                sent
            }
            Link::Memory(m) => {
                if let Some(src) = data {
                    m.write_from(src);
                }
                true
            }
        };
        sent || self.closed(link)
    }

    /// The requester's connection ended: after BYE, or without (a crash, a cut, its QP
    /// failed), maybe mid-request. A responder on RC hardware notices nothing when its
    /// requester goes away — no event, no state change; its own requests find out, by their
    /// retries — so this one only lets the connection go (a requester that comes back may
    /// connect again) and drops what was half received, which nobody acknowledged. Always
    /// `false`: stop serving it.
    fn closed(&self, link: &Link<'_>) -> bool {
        if let Link::Tcp(conn) | Link::Pulled(conn, _) | Link::Looked(conn, _) = link {
            let mut st = self.lock();
            if st
                .resp_conn
                .as_ref()
                .is_some_and(|c| std::ptr::eq(c.as_ref(), *conn))
            {
                st.resp_conn = None;
            }
            drop(st);
            conn.kill();
        }
        false
    }
}
