//! The ack reader (one thread per outgoing connection): reads the responder's ACKs, NAKs,
//! RNR NAKs and READ responses, scatters READ data straight into the local buffers, retires
//! WRs (completing the signaled ones), and runs the retry timer and the RNR back-off.
//!
//! Separate from the sender because it runs on its own thread, reading while the sender writes
//! the same connection; [`Qp::ack_upto`] is also how an in-process delivery retires its WR,
//! and what it does with one answer ([`Qp::answer`]) is also what a thread polling the send CQ
//! does while the connection is leased to it (the `serve` module).

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use ibverbs_sys::ibv_wc_status;
use smallvec::SmallVec;

use super::serve::{Role, Unparked};
use super::{Conn, DRAIN_ACKS, DRAIN_EOF, Qp, St};
use crate::mr::{LOCAL_WRITE, MrGuard};
use crate::wire::{self, Nak, RESP_LEN, ReadEnd, RespOp, Response};

/// IB RNR timer codes (`min_rnr_timer`) in microseconds; code 0 is the longest, 655.36 ms.
const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// The requester's completion status for a NAK's syndrome.
pub(super) fn nak_status(syndrome: u8) -> ibv_wc_status::Type {
    match syndrome {
        s if s == Nak::RemoteAccess as u8 => ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
        s if s == Nak::RemoteOperation as u8 => ibv_wc_status::IBV_WC_REM_OP_ERR,
        _ => ibv_wc_status::IBV_WC_REM_INV_REQ_ERR,
    }
}

impl Qp {
    /// The peer acknowledged everything up to `seq`: heard from now (the retry timer restarts),
    /// and those WRs retired ([`retire_upto`](Self::retire_upto)).
    pub(super) fn ack_upto(&self, st: &mut St, seq: u64) {
        st.last_heard = Instant::now();
        self.retire_upto(st, seq);
    }

    /// Marks everything up to `seq` acknowledged and retires WRs up to the last signaled one
    /// among them (unsignaled WRs keep their slot until then, as on hardware). The in-process
    /// path calls it directly: its WRs complete before `post_send` returns, with no retry timer
    /// to restart, so it reads no clock.
    pub(super) fn retire_upto(&self, st: &mut St, seq: u64) {
        let cursor = st.send_cursor;
        let mut last_signaled = None;
        let mut progressed = false;
        for (i, w) in st.sq.iter_mut().enumerate() {
            if w.seq > seq || w.seq >= cursor {
                break;
            }
            progressed |= !w.acked;
            w.acked = true;
            // Placed: the responder is done reading a pulled WR's sources.
            w.pinned = None;
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
                self.recycle(&mut st.inline_spare, w);
                if let Some(wc) = wc {
                    self.send_cq.complete(wc);
                }
            }
        }
    }

    /// After the peer's end of the connection vanished: fails the oldest WR sent and not
    /// acknowledged with `IBV_WC_RETRY_EXC_ERR` once the retry budget has passed since it was
    /// sent (or since the peer was last heard), looking every `tick`; returns at once when
    /// nothing is outstanding (the next WR connects anew) or the QP moved on (reset, ERR,
    /// destroy). With no budget (`timeout` 0) the retries never end, as on a NIC.
    fn retries_run_out(&self, epoch: u64, tick: Duration) {
        loop {
            let mut st = self.lock();
            if st.epoch != epoch || st.destroying.is_some() {
                return;
            }
            let cursor = st.send_cursor;
            let heard = st.last_heard;
            let Some((seq, sent)) = st
                .sq
                .iter()
                .find(|w| !w.acked && w.seq < cursor)
                .map(|w| (w.seq, w.sent_at.unwrap_or(heard).max(heard)))
            else {
                return;
            };
            if Self::retry_budget(&st.attrs).is_some_and(|b| sent.elapsed() > b) {
                self.fail(
                    &mut st,
                    Some((seq, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)),
                    None,
                );
                return;
            }
            drop(st);
            std::thread::sleep(tick);
        }
    }

    pub(super) fn ack_loop(self: Arc<Self>, conn: Arc<Conn>) {
        let epoch = conn.epoch;
        let tick = {
            let st = self.lock();
            Self::retry_budget(&st.attrs).map_or(Duration::from_millis(100), |b| {
                (b / 4).clamp(Duration::from_millis(1), Duration::from_millis(100))
            })
        };
        let _ = conn.stream.set_read_timeout(Some(tick));
        let fd = conn.fd();
        // The send CQ's polls as last seen, and whether the connection may still be leased to
        // them (not once the QP moved on).
        let (mut polls, mut lease) = (0, true);
        loop {
            {
                let _turn = conn.turn();
                loop {
                    if lease && !wire::readable(fd) && self.send_cq.served.polled_since(&mut polls)
                    {
                        break;
                    }
                    let hdr = match wire::read_exact::<RESP_LEN>(fd, true) {
                        Ok(h) => h,
                        Err(ReadEnd::Idle) => {
                            let mut st = self.lock();
                            // Being destroyed: read on (acknowledgements, then the peer's end
                            // of the connection after our BYE), for a short while.
                            let drained = st
                                .destroying
                                .is_some_and(|t| t.elapsed() > DRAIN_ACKS + DRAIN_EOF);
                            if st.epoch != epoch || drained {
                                return;
                            }
                            if st.destroying.is_none() && self.overdue(&mut st) {
                                return;
                            }
                            continue;
                        }
                        Err(ReadEnd::Closed) => {
                            let mut st = self.lock();
                            if st.epoch != epoch || st.destroying.is_some() {
                                return;
                            }
                            // The peer vanished. Its end is gone for good: later WRs connect
                            // anew (and find nobody there), and what is outstanding fails when
                            // its retries would have run out — as on a NIC, which hears
                            // nothing either.
                            if st.req_conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                                st.req_conn = None;
                            }
                            // Nobody pulls from the sources of pulled WRs over it any more: a
                            // `dereg_mr` of them need not wait for the retries.
                            for w in &mut st.sq {
                                w.pinned = None;
                            }
                            drop(st);
                            self.retries_run_out(epoch, tick);
                            return;
                        }
                    };
                    let Some(resp) = Response::decode(&hdr) else {
                        self.bad_response(epoch);
                        return;
                    };
                    if !self.answer(&conn, resp) {
                        return;
                    }
                }
            }
            let mut overdue = |st: &mut St| {
                self.overdue(st);
            };
            let parked = self.park(&conn, Role::Acks, Some((tick, &mut overdue)));
            lease = parked == Unparked::Read;
        }
    }

    /// The retry timer, while nothing arrives: fails the QP when the oldest WR sent that asked
    /// for an answer has waited longer than the retry budget since it was sent (or since the
    /// peer was last heard). `true`: it failed.
    fn overdue(&self, st: &mut St) -> bool {
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
        let Some((seq, _)) = late else {
            return false;
        };
        self.fail(st, Some((seq, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)), None);
        true
    }

    /// What the ack reader does with one answer whose header it read, from its own thread or
    /// from a poller's (the `serve` module). `false`: stop reading the connection.
    pub(super) fn answer(&self, conn: &Conn, resp: Response) -> bool {
        let epoch = conn.epoch;
        match resp.op {
            RespOp::Ack => {
                let mut st = self.lock();
                if st.epoch != epoch {
                    return false;
                }
                self.ack_upto(&mut st, resp.seq);
                true
            }
            RespOp::ReadResp => self.read_response(conn, resp),
            RespOp::Nak => {
                let Some(mut st) = self.refused(epoch, resp.seq) else {
                    return false;
                };
                self.fail(&mut st, Some((resp.seq, nak_status(resp.syndrome))), None);
                false
            }
            // Only ever the answer to the offer, which `connect` read.
            RespOp::PullVerdict => {
                self.bad_response(epoch);
                false
            }
            RespOp::RnrNak => {
                let Some(mut st) = self.refused(epoch, resp.seq) else {
                    return false;
                };
                let infinite = st.attrs.rnr_retry == 7;
                if !infinite && st.rnr_tries >= st.attrs.rnr_retry {
                    self.fail(
                        &mut st,
                        Some((resp.seq, ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR)),
                        None,
                    );
                    return false;
                }
                st.rnr_tries = st.rnr_tries.saturating_add(1);
                st.last_heard = Instant::now();
                // Go back N: resend from the refused WR once the timer expires.
                st.send_cursor = st.send_cursor.min(resp.seq);
                let wait = RNR_TIMER_US[usize::from(resp.syndrome & 31)];
                st.rnr_resume = Some(Instant::now() + Duration::from_micros(u64::from(wait)));
                self.cv.notify_all();
                true
            }
        }
    }

    /// The QP's state for a NAK or an RNR NAK of `epoch` that refuses WR `seq`: every WR before
    /// it was placed, so they are acknowledged first. `None`: the QP moved on since.
    fn refused(&self, epoch: u64, seq: u64) -> Option<MutexGuard<'_, St>> {
        let mut st = self.lock();
        if st.epoch != epoch {
            return None;
        }
        if let Some(prev) = seq.checked_sub(1) {
            self.ack_upto(&mut st, prev);
        }
        Some(st)
    }

    /// An answer that makes no sense here: the oldest outstanding WR completes
    /// `IBV_WC_BAD_RESP_ERR` and the QP fails.
    fn bad_response(&self, epoch: u64) {
        let mut st = self.lock();
        if st.epoch == epoch {
            let first = st.sq.iter().find(|w| !w.acked).map(|w| w.seq);
            self.fail(
                &mut st,
                first.map(|s| (s, ibv_wc_status::IBV_WC_BAD_RESP_ERR)),
                None,
            );
        }
    }

    /// Scatters a READ response (or an atomic's original value) straight into the WR's local
    /// buffers. `false` = stop reading.
    fn read_response(&self, conn: &Conn, resp: Response) -> bool {
        let (epoch, fd) = (conn.epoch, conn.fd());
        let sges = {
            let st = self.lock();
            if st.epoch != epoch {
                return false;
            }
            match Self::wqe(&st, resp.seq) {
                Some(w) if w.op.returns_data() && w.len == resp.len => w.sges.clone(),
                _ => {
                    drop(st);
                    self.bad_response(epoch);
                    return false;
                }
            }
        };
        let mut guards: SmallVec<[MrGuard; 1]> = SmallVec::new();
        for s in sges.iter().filter(|s| s.len > 0) {
            match self
                .ctx
                .mrs
                .acquire(s.lkey, self.pd, s.addr, s.len as usize, LOCAL_WRITE)
            {
                Ok(g) => guards.push(g),
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
        for g in &guards {
            if wire::read_into(fd, g.region().dst(), false).is_err() {
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
}
