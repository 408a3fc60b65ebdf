//! Who may connect to a QP: the hello that opens a connection, both ends of it.
//!
//! The requester connects to the port its peer's QPN names and presents its own QPN, the QPN
//! it wants and a proof, the peer QP's secret learnt through `set_ece` ([`Qp::connect`],
//! retried within the retry budget while the peer is not ready). The responder's listener
//! hands the hello to the QP it names, which admits the caller only in RTR/RTS, with the right
//! secret, from the QPN and address its RTR named, and only once ([`Qp::admit`]); the listener
//! (the `ctx` and `hello` modules) counts and WARNs about the refused.
//!
//! Separate so the whole admission rule reads in one place; what a connection then carries is
//! the requester's, ack reader's and responder's business.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys::ibv_qp_state;
use socket2::{Domain, Socket, Type};

use super::Qp;
use super::conn::{Conn, tune};
use crate::traffic;
use crate::wire::{self, HELLO_LEN, HelloReply};

/// Why a connection attempt ended without a connection.
pub(super) enum ConnectFail {
    /// The QP was reset, destroyed or failed meanwhile: nothing to report.
    Stale,
    /// Refused or no answer before the retry budget ran out.
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
}
