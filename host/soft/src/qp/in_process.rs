//! Delivery to a peer QP in this process ([`crate::Delivery::InProcess`], chosen only
//! explicitly, for benches): the posting thread carries each WR out itself, running the
//! requester's local checks, then the peer responder's checks and placement over memory
//! instead of a socket, and both completions, before `post_send` returns.
//!
//! Separate because it bypasses the threads and the connection: it is the one path where a
//! requester calls into another QP's responder directly.

use std::cell::Cell;
use std::sync::{Arc, MutexGuard, Weak};

use ibverbs_sys::{ibv_qp_state, ibv_wc_status};

use super::ack_reader::nak_status;
use super::requester::InlineCopy;
use super::responder::{Admitted, Link};
use super::{Qp, Sge, St};
use crate::abi::memory::{self, Dst, Src};
use crate::mr::MrGuard;
use crate::wire::{Nak, ReqOp, Request};

/// Where a QP's requests go, decided at its first post after RTS.
#[derive(Debug, Default)]
pub(super) enum PeerPath {
    #[default]
    Unresolved,
    /// Over TCP (the default, and a peer outside this process).
    Tcp,
    /// Delivered in process to this QP.
    Local(Weak<Qp>),
}

/// The requester's side of an in-process delivery: its payload (the inline copy, an atomic's
/// operands, or its pinned SGEs) consumed in order, the destination of a READ's data or an
/// atomic's original value (its pinned SGEs), and the NAK a refusal answers.
pub(super) struct MemLink<'a> {
    pub(super) epoch: u64,
    /// The payload copied at post time, when the WR is an inline send; an atomic's operands.
    inline: Option<&'a [u8]>,
    /// The requester's checked SGEs, one guard per non-empty SGE: the payload of a WR that
    /// is not inline, or where a READ's or an atomic's answer goes.
    guards: &'a [MrGuard],
    /// Segment and offset in it where the next payload byte comes from.
    at: Cell<(usize, usize)>,
    pub(super) refused: Cell<Option<Nak>>,
}

impl MemLink<'_> {
    /// How many segments the requester's side has.
    fn segments(&self) -> usize {
        match self.inline {
            Some(_) => 1,
            None => self.guards.len(),
        }
    }

    /// Segment `seg`, to be read.
    fn source(&self, seg: usize) -> Src<'_> {
        match self.inline {
            Some(data) => Src::from(data),
            None => self.guards[seg].region().src(),
        }
    }

    /// Copies the next payload bytes from the segments into `dst`, as many as fit: how many
    /// there were.
    pub(super) fn read_into(&self, dst: Dst<'_>) -> usize {
        let (mut seg, mut off) = self.at.get();
        let mut done = 0;
        while done < dst.len() && seg < self.segments() {
            let from = self.source(seg);
            let n = memory::copy(from.skip(off), dst.skip(done));
            done += n;
            off += n;
            if off == from.len() {
                seg += 1;
                off = 0;
            }
        }
        self.at.set((seg, off));
        done
    }

    /// The answer to a READ or an atomic, all of it at once, into the requester's segments
    /// (checked locally writable before delivery).
    pub(super) fn write_from(&self, src: Src<'_>) {
        let (mut seg, mut off) = (0, 0);
        let mut done = 0;
        while done < src.len() && seg < self.guards.len() {
            let to = self.guards[seg].region().dst();
            let n = memory::copy(src.skip(done), to.skip(off));
            done += n;
            off += n;
            if off == to.len() {
                seg += 1;
                off = 0;
            }
        }
    }
}

impl Qp {
    /// With [`crate::Delivery::InProcess`], decides once (at the first post after RTS) whether
    /// the peer QP lives in this process: a QP of this copy of the provider whose number and
    /// address are the ones RTR named, that expects us (RTR/RTS, our number, our port's
    /// address — what `admit` checks of a TCP caller) and that accepts our proof.
    /// Resolved without holding our own lock, so two QPs resolving each other (or a loopback
    /// QP itself) never deadlock.
    pub(super) fn resolve_peer(&self) {
        let (remote, dest, proof, port) = {
            let st = self.lock();
            if !matches!(st.peer, PeerPath::Unresolved) || st.state != ibv_qp_state::IBV_QPS_RTS {
                return;
            }
            (
                st.remote,
                st.attrs.dest_qpn,
                Self::proof(&st),
                st.attrs.port,
            )
        };
        let mine = self.ctx.dev.port(port).map(|p| p.address);
        let found = remote.and_then(|r| crate::ctx::local_qp(self.ctx.fabric, r, dest));
        let path = match found {
            Some(peer) => {
                let pst = peer.lock();
                let expects_us = matches!(
                    pst.state,
                    ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS
                ) && peer.accepts(&pst, proof)
                    && pst.attrs.dest_qpn == self.qpn
                    && pst.remote.map(|r| r.to_canonical()) == mine.map(|m| m.to_canonical());
                drop(pst);
                if expects_us {
                    PeerPath::Local(Arc::downgrade(&peer))
                } else {
                    PeerPath::Tcp
                }
            }
            None => PeerPath::Tcp,
        };
        let mut st = self.lock();
        if matches!(st.peer, PeerPath::Unresolved) {
            st.peer = path;
        }
    }

    /// Carries out every WR posted and not yet started, on this thread, against the peer QP
    /// in this process; `post_send` calls it with the lock it holds. Whoever holds `tx_busy`
    /// delivers, so concurrent posters keep the queue's order: the holder looks again after
    /// each WR. Per WR that is two rounds of our lock: the post's, which claims it (when
    /// nobody else is delivering), and one once the peer placed it, which retires it and
    /// claims the next. Between them the peer's responder takes the peer's lock, never while
    /// we hold ours, so two QPs delivering to each other from two threads, or a QP to itself,
    /// cannot deadlock.
    pub(super) fn deliver_pending<'a>(&'a self, mut st: MutexGuard<'a, St>) {
        let mut inline_copy = InlineCopy::new();
        loop {
            if st.tx_busy || st.send_cursor >= st.next_seq || st.state != ibv_qp_state::IBV_QPS_RTS
            {
                return;
            }
            let PeerPath::Local(peer) = &st.peer else {
                // Reset and resolved anew meanwhile, to TCP: the sender thread's work now.
                self.cv.notify_all();
                return;
            };
            let Some(peer) = peer.upgrade().filter(|_| !st.severed) else {
                // The peer QP is gone or cut off: as a peer that never answers.
                let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
                self.fail(
                    &mut st,
                    first.map(|s| (s, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                    None,
                );
                return;
            };
            let epoch = st.epoch;
            let Some((req, sges, inline)) = Self::next_request(&mut st, &mut inline_copy, None)
            else {
                continue;
            };
            st.tx_busy = true;
            drop(st);
            let result = self.deliver(epoch, &peer, &req, &sges, inline);
            drop(peer);
            st = self.lock();
            st.tx_busy = false;
            if st.epoch != epoch {
                continue;
            }
            match result {
                Some(Ok(())) => self.retire_upto(&mut st, req.seq),
                Some(Err(status)) => self.fail(&mut st, Some((req.seq, status)), None),
                None => {}
            }
        }
    }

    /// One WR delivered in process, without our lock: the same local checks as
    /// [`transmit`](Self::transmit), then the peer's responder checks and places it straight
    /// from (or, for a READ, into) our pinned memory. The peer's answer: `Ok` completes the WR
    /// as if acknowledged, `Err` is its completion status; `None` when a local check failed
    /// (which failed the QP).
    fn deliver(
        &self,
        epoch: u64,
        peer: &Qp,
        req: &Request,
        sges: &[Sge],
        inline: Option<&[u8]>,
    ) -> Option<Result<(), ibv_wc_status::Type>> {
        let guards = self.pin_local(epoch, req, sges, inline.is_some())?;
        Some(peer.accept_local(self.qpn, req, inline, &guards))
    }

    /// The responder's side of an in-process delivery from QP `src_qpn`: the checks and the
    /// placement of the TCP responder ([`place`](Self::place)), the payload read from `inline`
    /// or from the requester's `guards` (which a READ or an atomic writes).
    /// `Err` is the requester's completion status. Unlike over TCP, a missing receive is not
    /// retried: it fails the WR with `IBV_WC_RNR_RETRY_EXC_ERR` at once.
    ///
    /// One round of our lock: the request is counted placed (`expected_seq`) when admitted,
    /// not after. Its requester delivers one WR at a time (`tx_busy`), so nothing else comes
    /// meanwhile, and one that is then not placed fails its WR, which takes the requester to
    /// ERR: in process nothing is retransmitted, so no request comes with that number again.
    fn accept_local(
        &self,
        src_qpn: u32,
        req: &Request,
        inline: Option<&[u8]>,
        guards: &[MrGuard],
    ) -> Result<(), ibv_wc_status::Type> {
        let (admitted, epoch) = {
            let mut st = self.lock();
            let ready = matches!(
                st.state,
                ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS
            ) && st.destroying.is_none()
                && !st.severed
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
            st.expected_seq += 1;
            let admitted = Admitted {
                access: st.attrs.access,
                recv,
                src_qp: src_qpn,
            };
            (admitted, st.epoch)
        };
        let mem = MemLink {
            epoch,
            inline,
            guards,
            at: Cell::new((0, 0)),
            refused: Cell::new(None),
        };
        match self.place(&Link::Memory(&mem), req, admitted) {
            true => Ok(()),
            false => Err(mem
                .refused
                .get()
                .map_or(ibv_wc_status::IBV_WC_REM_OP_ERR, |n| nak_status(n as u8))),
        }
    }
}
