//! Who may connect to a QP: the hello that opens a connection, both ends of it.
//!
//! The requester connects to the port its peer's QPN names and presents its own QPN, the QPN
//! it wants and a proof ([`Qp::connect`], retried within the retry budget while the peer is not
//! ready): the peer QP's secret when `set_ece` gave it, else its own starting PSN, tagged
//! ([`PSN_PROOF`]). The responder's listener hands the hello to the QP it names, which admits the
//! caller only in RTR/RTS, from the QPN and address its RTR named, only once, and with the
//! proof it expects ([`Qp::accepts`]): its own secret when it was given the caller's ECE (the
//! handshake carried ECE both ways), else the PSN its RTR expects (`rq_psn`), which a NIC checks
//! too. The listener (the `ctx` and `hello` modules) counts and WARNs about the refused; the
//! crate docs ("Who can connect") give the threat model.
//!
//! Separate so the whole admission rule reads in one place; what a connection then carries is
//! the requester's, ack reader's and responder's business.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys::ibv_qp_state;
use socket2::{Domain, Socket, Type};

use super::conn::{Conn, tune};
use super::serve::Role;
use super::{Qp, St};
use crate::abi::memory::Src;
use crate::traffic;
use crate::wire::{self, HelloReply};

/// Marks a PSN presented as the proof (PSNs are 24 bits): a caller that was given no secret
/// proves it knows the PSN the callee's RTR expects, as a NIC admits packets.
pub(super) const PSN_PROOF: u32 = 1 << 31;

/// How long a QP without a retry budget (`timeout` 0: retry forever) waits for one reply before
/// it knocks again: a listener that never answers is a failed attempt, not a hang.
const UNBOUNDED_REPLY_WAIT: Duration = Duration::from_secs(2);

/// Why a connection attempt ended without a connection.
pub(super) enum ConnectFail {
    /// The QP was reset, destroyed or failed meanwhile: nothing to report.
    Stale,
    /// Refused, or no answer, until the retry budget ran out.
    Exhausted,
}

impl Qp {
    /// Opens the connection to the peer's responder and proves we are the expected peer.
    pub(super) fn connect(&self, epoch: u64) -> Result<Conn, ConnectFail> {
        let (remote, local, budget, dest_qpn, proof, port) = {
            let st = self.lock();
            let local = self.ctx.dev.port(st.attrs.port).map(|p| p.address);
            (
                st.remote,
                local,
                Self::retry_budget(&st.attrs),
                st.attrs.dest_qpn,
                Self::proof(&st),
                st.attrs.port,
            )
        };
        let (Some(remote), Some(local)) = (remote, local) else {
            return Err(ConnectFail::Exhausted);
        };
        let target = SocketAddr::new(remote, (dest_qpn >> 8) as u16);
        let deadline = budget.map(|b| Instant::now() + b);
        let mut backoff = Duration::from_millis(1);
        // Refused: nobody there admits us (the peer QP is gone, failed or cut off). A NIC's
        // packets to it go unanswered until the retries run out, so the attempt ends then, not
        // at once — without knocking again.
        let mut refused = false;
        loop {
            {
                let st = self.lock();
                refused |= st.severed;
                // Being destroyed, a QP sends on what was posted only to a peer still there.
                if st.epoch != epoch
                    || st.requester_stopped()
                    || (refused && st.destroying.is_some())
                {
                    return Err(ConnectFail::Stale);
                }
            }
            if self.ctx.dev.port_active(port) && !refused {
                match self.try_connect(target, local, dest_qpn, proof, deadline) {
                    Ok(Some((stream, pulls))) => {
                        let name = &self.ctx.dev.desc.name;
                        return Ok(Conn::new(
                            stream,
                            epoch,
                            traffic::counter(name, port, local, remote),
                            pulls,
                        ));
                    }
                    Ok(None) => {}
                    Err(()) => refused = true,
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ConnectFail::Exhausted);
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }

    /// One attempt: the connection and whether its responder pulls large payloads (offered
    /// as soon as we are admitted, the `pull` module); `Ok(None)` = try again later, `Err` =
    /// refused for good, or admitted and then silent.
    ///
    /// The reply is awaited until `deadline` (the retry budget's end), not for a fixed while: a
    /// listener slow to answer (its QP's lock held by a teardown, a loaded machine) may already
    /// have admitted us, and a second connection for one QP is refused for good — so giving up
    /// on a late reply and knocking again turned a slow accept into `RETRY_EXC_ERR`.
    fn try_connect(
        &self,
        target: SocketAddr,
        local: IpAddr,
        dest_qpn: u32,
        proof: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<(TcpStream, bool)>, ()> {
        let reply_wait = deadline.map_or(UNBOUNDED_REPLY_WAIT, |d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        let attempt = || -> std::io::Result<(TcpStream, Option<HelloReply>)> {
            let sock = Socket::new(Domain::for_address(target), Type::STREAM, None)?;
            if local.is_ipv4() == target.is_ipv4() {
                sock.bind(&SocketAddr::new(local, 0).into())?;
            }
            sock.connect_timeout(&target.into(), Duration::from_secs(1))?;
            let stream: TcpStream = sock.into();
            tune(&stream);
            let hello = wire::encode_hello(self.qpn, dest_qpn, proof);
            let mut iov = [Src::from(&hello[..])];
            wire::send_all(stream.as_raw_fd(), &mut iov, &|| true, false)?;
            stream.set_read_timeout(Some(reply_wait))?;
            // `idle_ok`: a listener that never answers is a failed attempt, not a hang.
            let reply = wire::read_exact::<4>(stream.as_raw_fd(), true)
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::ConnectionAborted))?;
            Ok((stream, HelloReply::from_u32(u32::from_le_bytes(reply))))
        };
        match attempt() {
            // The responder now serves this connection alone: no answer to the offer means
            // the connection is lost, not worth another knock.
            Ok((s, Some(HelloReply::Accepted))) => self.offer_pull(&s).map(|p| Some((s, p))),
            Ok((_, Some(HelloReply::NotReady))) | Err(_) => Ok(None),
            Ok((_, _)) => Err(()),
        }
    }

    /// What this QP presents when it connects: the peer's secret when `set_ece` gave it, else its
    /// own starting PSN, tagged, which the peer's RTR learnt out of band.
    pub(super) fn proof(st: &St) -> u32 {
        st.peer_secret.unwrap_or(PSN_PROOF | st.attrs.sq_psn)
    }

    /// Whether `proof` is the one this QP (in RTR/RTS) expects of its caller: its own secret when
    /// it was given the caller's ECE — the handshake carried ECE, so the caller has ours — else
    /// the PSN its RTR expects.
    pub(super) fn accepts(&self, st: &St, proof: u32) -> bool {
        match st.peer_secret {
            Some(_) => proof == self.secret,
            None => proof == PSN_PROOF | st.attrs.rq_psn,
        }
    }

    /// The listener asks whether to admit a caller claiming to be QP `src_qpn` with `proof`.
    pub(crate) fn admit(
        self: &Arc<Self>,
        src_qpn: u32,
        proof: u32,
        peer: IpAddr,
        stream: &TcpStream,
    ) -> HelloReply {
        let mut st = self.lock();
        if st.destroying.is_some() {
            return HelloReply::Refused;
        }
        match st.state {
            // Before RTR the PSN to expect is unknown: a PSN proof can only be told to retry.
            ibv_qp_state::IBV_QPS_RESET | ibv_qp_state::IBV_QPS_INIT
                if proof == self.secret || proof & PSN_PROOF != 0 =>
            {
                HelloReply::NotReady
            }
            ibv_qp_state::IBV_QPS_RTR | ibv_qp_state::IBV_QPS_RTS => {
                let expected = st.remote.map(|r| r.to_canonical());
                if st.severed
                    || !self.accepts(&st, proof)
                    || st.attrs.dest_qpn != src_qpn
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
                let conn = Arc::new(Conn::new(
                    mine,
                    st.epoch,
                    traffic::counter(&self.ctx.dev.desc.name, st.attrs.port, local, peer),
                    false,
                ));
                st.resp_conn = Some(Arc::clone(&conn));
                drop(st);
                self.recv_cq.served.add(self, &conn, Role::Responder);
                self.spawn("resp", move |qp| qp.responder_loop(conn));
                HelloReply::Accepted
            }
            _ => HelloReply::Refused,
        }
    }
}
