//! Same-host pull: the responder copies a large payload straight from the requester's memory
//! with `process_vm_readv` (cross memory attach) instead of reading it from the socket.
//!
//! Over loopback TCP a payload is copied twice (into the socket, out of it) by two threads
//! that hand each other 4 MiB of socket buffer at a time; pulled, it is copied once, by one
//! syscall, at memcpy-like speed. The request still travels on the connection — its header,
//! then one [`SEG_LEN`]-byte descriptor per source segment instead of
//! the payload ([`FLAG_PULL`](crate::wire::FLAG_PULL)) — and the responder runs every check
//! the socket path runs (rkey, PD, bounds, access, a posted receive) before it pulls, then
//! acknowledges as on the socket path: the requester completes the WR, and lets `dereg_mr` of
//! its source return, only once the responder said the bytes are placed. Until then the
//! requester keeps the source segments pinned (its MR guards ride on the WR, see
//! `Qp::hold_for_pull`).
//!
//! Decided once per connection, when it opens: the requester offers its pid and the address
//! of its probe word — its QP's ECE secret, which the responder learnt out of band
//! ([`ReqOp::PullOffer`]); the responder reads that word from that pid and answers a
//! [`Verdict`]. Any failure — another user or no `CAP_SYS_PTRACE`, Yama's `ptrace_scope`,
//! seccomp, another host or pid namespace (no such pid, or a process whose word differs), no
//! ECE exchanged — or [`crate::ENV_CMA`]`=0` on either side keeps the socket, and the
//! requester says why in one INFO line. Only payloads of at least [`PULL_MIN`] are pulled:
//! below that the syscall and the page walks cost as much as the copies they save.

use std::cell::Cell;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

use smallvec::SmallVec;

use super::Qp;
use crate::abi::memory::{Dst, RemoteSeg, Src};
use crate::wire::{self, RESP_LEN, ReadEnd, ReqOp, Request, RespOp, Response, SEG_LEN};

/// Smallest payload pulled rather than sent. Measured with `benches/soft_fabric.rs` (two
/// shared vCPUs, WRITEs, 1 and 4 QPs): at 16 KiB either path wins by turns, at 32 KiB the pull
/// matches or beats the socket, from 64 KiB on it moves 1.5–3× as much.
pub(crate) const PULL_MIN: u32 = 32 * 1024;

/// The responder's answer to an offer; on the wire as the verdict's syndrome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The responder pulls payloads of at least [`PULL_MIN`] on this connection.
    Granted = 0,
    /// The responder's side has it turned off ([`crate::ENV_CMA`]).
    Off = 1,
    /// `EPERM`: another user, no `CAP_SYS_PTRACE`, `ptrace_scope` or seccomp.
    NotPermitted = 2,
    /// `ESRCH`: no such process here — another host or pid namespace.
    NoProcess = 3,
    /// The word read differs, or cannot be read: another process with that pid (another host
    /// or pid namespace).
    Mismatch = 4,
    /// `process_vm_readv` failed otherwise (`ENOSYS`, ...).
    Unavailable = 5,
    /// No ECE was exchanged, so the responder does not know the word to expect.
    Unbound = 6,
}

impl Verdict {
    fn from_u8(v: u8) -> Verdict {
        match v {
            0 => Verdict::Granted,
            1 => Verdict::Off,
            2 => Verdict::NotPermitted,
            3 => Verdict::NoProcess,
            4 => Verdict::Mismatch,
            6 => Verdict::Unbound,
            _ => Verdict::Unavailable,
        }
    }

    /// The verdict's frame, the answer to an offer.
    pub(super) fn frame(self) -> Response {
        Response {
            op: RespOp::PullVerdict,
            syndrome: self as u8,
            len: 0,
            seq: 0,
        }
    }
}

/// Why the socket carries the payloads, for the INFO line.
impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Granted => write!(f, "granted"),
            Verdict::Off => write!(
                f,
                "turned off on the responder's side ({}=0)",
                crate::ENV_CMA
            ),
            Verdict::NotPermitted => write!(
                f,
                "process_vm_readv not permitted (another user, ptrace_scope or seccomp)"
            ),
            Verdict::NoProcess => {
                write!(f, "no such process here (another host or pid namespace)")
            }
            Verdict::Mismatch => write!(
                f,
                "the probe word differs (another host or pid namespace behind that pid)"
            ),
            Verdict::Unavailable => write!(f, "process_vm_readv unavailable"),
            Verdict::Unbound => write!(
                f,
                "no ECE exchanged, so the probe cannot prove who is calling"
            ),
        }
    }
}

/// Whether the 32-bit word at `addr` in process `pid` reads back as `value`.
fn probe(pid: libc::pid_t, addr: u64, value: u32) -> Verdict {
    let mut got = [0u8; 4];
    let remote = [RemoteSeg { addr, len: 4 }];
    match Dst::from(&mut got[..]).pull(pid, &remote, (0, 0)) {
        Ok(_) if u32::from_ne_bytes(got) == value => Verdict::Granted,
        Ok(_) => Verdict::Mismatch,
        Err(e) => match e.raw_os_error() {
            Some(libc::EPERM) => Verdict::NotPermitted,
            Some(libc::ESRCH) => Verdict::NoProcess,
            Some(libc::EFAULT) => Verdict::Mismatch,
            _ => Verdict::Unavailable,
        },
    }
}

/// Whether the requester has the responder pull `req`, on a connection that agreed to it
/// (`pulls`): a WRITE or SEND from registered memory (not inline) of at least [`PULL_MIN`].
pub(super) fn wanted(pulls: bool, req: &Request, inline: bool) -> bool {
    pulls && !inline && req.carries_payload() && req.len >= PULL_MIN
}

/// The requester's segments of one pulled payload, consumed in order as the responder places
/// them.
pub(super) struct Source {
    pid: libc::pid_t,
    segs: SmallVec<[RemoteSeg; 1]>,
    /// The first segment not consumed, and how much of it was.
    at: Cell<(usize, usize)>,
}

impl Source {
    /// Reads the descriptors that follow a pulled request's header: as many as add up to its
    /// `len`. `Err(None)`: they do not add up (a malformed request); `Err(Some(_))`: the
    /// connection broke.
    pub(super) fn read(fd: RawFd, pid: libc::pid_t, len: u32) -> Result<Source, Option<ReadEnd>> {
        Self::gather(pid, len, || {
            wire::read_exact::<SEG_LEN>(fd, false).map_err(Some)
        })
    }

    /// The descriptors at the start of `bytes` (what a poller's look copied after the header,
    /// the `serve` module), with how many bytes they take. `Ok(None)`: not all of them are
    /// there yet; `Err(())`: they do not add up (a malformed request).
    pub(super) fn looked(
        bytes: &[u8],
        pid: libc::pid_t,
        len: u32,
    ) -> Result<Option<(Source, usize)>, ()> {
        let mut at = 0;
        let found = Self::gather(pid, len, || {
            let seg = bytes[at..].first_chunk::<SEG_LEN>().ok_or(Some(()))?;
            at += SEG_LEN;
            Ok(*seg)
        });
        match found {
            Ok(src) => Ok(Some((src, at))),
            Err(Some(())) => Ok(None),
            Err(None) => Err(()),
        }
    }

    /// The descriptors `next` gives, one at a time, as many as add up to `len`. `Err(None)`:
    /// they do not add up; `Err(Some(_))`: `next` had none to give.
    fn gather<E>(
        pid: libc::pid_t,
        len: u32,
        mut next: impl FnMut() -> Result<[u8; SEG_LEN], Option<E>>,
    ) -> Result<Source, Option<E>> {
        let mut segs = SmallVec::new();
        let mut left = u64::from(len);
        while left > 0 {
            let (addr, n) = wire::decode_seg(&next()?);
            if n == 0 || n > left {
                return Err(None);
            }
            segs.push(RemoteSeg {
                addr,
                len: n as usize,
            });
            left -= n;
        }
        Ok(Source {
            pid,
            segs,
            at: Cell::new((0, 0)),
        })
    }

    /// Pulls the next `dst.len()` bytes into `dst`.
    pub(super) fn read_into(&self, dst: Dst<'_>) -> Result<(), ReadEnd> {
        let (seg, off) = self.at.get();
        if seg >= self.segs.len() {
            return Err(ReadEnd::Closed);
        }
        let available = self.segs[seg..].iter().map(|r| r.len).sum::<usize>() - off;
        if available < dst.len() {
            return Err(ReadEnd::Closed);
        }
        match dst.pull(self.pid, &self.segs, (seg, off)) {
            Ok(at) => {
                self.at.set(at);
                Ok(())
            }
            // The requester's memory is gone (it holds the segments pinned until we answer, so
            // only its process can have gone): as a connection cut mid-payload.
            Err(_) => Err(ReadEnd::Closed),
        }
    }
}

impl Qp {
    /// The requester's half of the decision, on a connection just admitted (its read timeout
    /// set to how long an answer may take): offers the pull unless this QP has it off, and
    /// returns whether the responder pulls. One INFO line when it does not. `Err`: no answer,
    /// the connection is unusable.
    pub(super) fn offer_pull(&self, stream: &TcpStream) -> Result<bool, ()> {
        if !self.pull {
            tracing::info!(
                qpn = self.qpn,
                "soft: same-host pull turned off ({}=0): payloads go through the socket",
                crate::ENV_CMA
            );
            return Ok(false);
        }
        let offer = Request {
            op: ReqOp::PullOffer,
            flags: 0,
            len: 0,
            seq: 0,
            raddr: std::ptr::from_ref(&self.secret) as u64,
            rkey: std::process::id(),
            imm: 0,
        }
        .encode();
        let mut iov = [Src::from(&offer[..])];
        wire::send_all(stream.as_raw_fd(), &mut iov, &|| true, false).map_err(|_| ())?;
        // `idle_ok`: a responder that never answers fails the attempt, not the thread.
        let answer = wire::read_exact::<RESP_LEN>(stream.as_raw_fd(), true).map_err(|_| ())?;
        let verdict = match Response::decode(&answer) {
            Some(r) if r.op == RespOp::PullVerdict => Verdict::from_u8(r.syndrome),
            _ => return Err(()),
        };
        if verdict == Verdict::Granted {
            tracing::debug!(qpn = self.qpn, "soft: same-host pull granted");
        } else {
            tracing::info!(
                qpn = self.qpn,
                "soft: no same-host pull, payloads go through the socket: {verdict}"
            );
        }
        Ok(verdict == Verdict::Granted)
    }

    /// The responder's half: reads the offered probe word — the requester QP's secret, which
    /// ECE gave us — from the offering process, and answers. Returns the pid to pull from
    /// when granted. Bound to the secret, the probe proves the pid is the admitted peer's: a
    /// caller cannot have us pull from a third process's memory into an MR it may read back.
    pub(super) fn judge_offer(&self, offer: &Request) -> (Verdict, Option<libc::pid_t>) {
        let pid = offer.rkey as libc::pid_t;
        let expected = self.lock().peer_secret;
        let verdict = match (self.pull, expected) {
            (false, _) => Verdict::Off,
            (true, None) => Verdict::Unbound,
            (true, Some(secret)) => probe(pid, offer.raddr, secret),
        };
        (verdict, (verdict == Verdict::Granted).then_some(pid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_tells_this_process_from_others() {
        let me = std::process::id() as libc::pid_t;
        let word = crate::abi::sys::rand_u32();
        let addr = std::ptr::from_ref(&word) as u64;
        assert_eq!(probe(me, addr, word), Verdict::Granted);
        assert_eq!(probe(me, addr, !word), Verdict::Mismatch);
        assert_eq!(probe(me, 8, word), Verdict::Mismatch, "unmapped: EFAULT");
        // Above pid_max (at most 2^22): no such process.
        assert_eq!(probe(1 << 30, addr, word), Verdict::NoProcess);
    }

    #[test]
    fn a_source_is_pulled_across_segments_in_pieces() {
        let me = std::process::id() as libc::pid_t;
        let a: Vec<u8> = (0..100u8).collect();
        let b: Vec<u8> = (100..250u8).collect();
        let src = Source {
            pid: me,
            segs: smallvec::smallvec![
                RemoteSeg {
                    addr: a.as_ptr() as u64,
                    len: a.len()
                },
                RemoteSeg {
                    addr: b.as_ptr() as u64,
                    len: b.len()
                }
            ],
            at: Cell::new((0, 0)),
        };
        let mut dst = [0u8; 250];
        for (from, to) in [(0, 60), (60, 180), (180, 250)] {
            src.read_into(Dst::from(&mut dst[from..to])).unwrap();
        }
        assert!(dst.iter().enumerate().all(|(i, &x)| x == i as u8));
        // Nothing is left to pull.
        assert!(src.read_into(Dst::from(&mut dst[..1])).is_err());
    }
}
