//! The soft RC wire protocol and the raw socket I/O that moves payloads without copies.
//!
//! One TCP connection carries one QP direction: the requester writes [`Request`] frames
//! (header, then the payload straight from the source buffers in one `sendmsg`), the responder
//! answers with [`Response`] frames (ACK/NAK/RNR NAK, or a READ response followed by its data;
//! an atomic's original value comes back the same way, as 8 bytes of READ response).
//! Payloads are read with `read(2)` straight into registered memory, never through a buffer, so
//! the only copies are the kernel's. Headers are fixed-size little-endian records, modelled on
//! libfabric's tcp provider (`xnet_proto.h`) and the RC opcodes.

use std::io;
use std::os::fd::RawFd;

use crate::abi::memory::{self, Dst, Src};
use crate::abi::sys;

/// First bytes of a connection: who is calling, whom, and the proof that the caller learnt the
/// callee's secret through the out-of-band handshake (see the crate docs).
pub(crate) const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"SFT1");
pub const HELLO_LEN: usize = 16;

/// The listener's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloReply {
    Accepted = 0,
    /// The QP exists and the proof is right, but it is not in RTR yet (hardware would drop the
    /// packets and the requester would retry): try again.
    NotReady = 1,
    /// Unknown QP, wrong proof, wrong source or a second connection: a stranger.
    Refused = 2,
}

impl HelloReply {
    pub fn from_u32(v: u32) -> Option<HelloReply> {
        match v {
            0 => Some(HelloReply::Accepted),
            1 => Some(HelloReply::NotReady),
            2 => Some(HelloReply::Refused),
            _ => None,
        }
    }
}

/// `HELLO{magic, src_qpn, dst_qpn, proof}`.
pub fn encode_hello(src_qpn: u32, dst_qpn: u32, proof: u32) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&src_qpn.to_le_bytes());
    b[8..12].copy_from_slice(&dst_qpn.to_le_bytes());
    b[12..16].copy_from_slice(&proof.to_le_bytes());
    b
}

/// Parses a hello into `(src_qpn, dst_qpn, proof)`; `None` for anything that is not one.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Option<(u32, u32, u32)> {
    (le32(b, 0) == HELLO_MAGIC).then(|| (le32(b, 4), le32(b, 8), le32(b, 12)))
}

/// Requester → responder operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReqOp {
    Write = 1,
    WriteImm = 2,
    Send = 3,
    SendImm = 4,
    Read = 5,
    /// The requester's QP is being destroyed and everything it sent was acknowledged: the
    /// responder closes the connection in order, and neither side calls it an error.
    Bye = 6,
    /// The first frame of a connection whose requester offers same-host pull (the `pull`
    /// module): `rkey` carries its pid, `raddr` the address of its probe word (its QP's
    /// secret). Answered by [`RespOp::PullVerdict`]; never placed, never sequenced.
    PullOffer = 7,
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD` of the 8 bytes at `raddr` (`len` is 8): its
    /// [`AtomicArgs`] follow the header, the original value comes back as a READ response.
    FetchAdd = 8,
    /// `IBV_WR_ATOMIC_CMP_AND_SWP`, framed as [`ReqOp::FetchAdd`].
    CmpSwap = 9,
}

impl ReqOp {
    /// Whether the responder answers it with data (a [`RespOp::ReadResp`]) rather than an ACK:
    /// READs and atomics, which `max_rd_atomic` bounds together as on hardware.
    pub(crate) fn returns_data(self) -> bool {
        matches!(self, ReqOp::Read | ReqOp::FetchAdd | ReqOp::CmpSwap)
    }

    pub(crate) fn is_atomic(self) -> bool {
        matches!(self, ReqOp::FetchAdd | ReqOp::CmpSwap)
    }
}

/// The size of the word an atomic operates on, and of the value it returns.
pub(crate) const ATOMIC_WORD: u32 = 8;

pub const ATOMIC_ARGS_LEN: usize = 16;

/// The operands of an atomic, which follow its header on the wire: `{compare_add: u64, swap:
/// u64}` as posted (`wr.atomic`). A separate trailer rather than a longer header, so every other
/// request keeps its 32 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AtomicArgs {
    /// What FETCH_AND_ADD adds, what CMP_AND_SWP compares with.
    pub compare_add: u64,
    /// What CMP_AND_SWP stores when the comparison holds.
    pub swap: u64,
}

impl AtomicArgs {
    pub fn encode(&self) -> [u8; ATOMIC_ARGS_LEN] {
        let mut b = [0u8; ATOMIC_ARGS_LEN];
        b[0..8].copy_from_slice(&self.compare_add.to_le_bytes());
        b[8..16].copy_from_slice(&self.swap.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; ATOMIC_ARGS_LEN]) -> AtomicArgs {
        AtomicArgs {
            compare_add: le64(b, 0),
            swap: le64(b, 8),
        }
    }
}

/// Set on requests whose completion the requester waits for (signaled WRs), like the BTH AckReq
/// bit: the responder acknowledges those at once. Every other placed request is acknowledged
/// too, coalesced: one ACK when the responder runs out of requests to read (see
/// `Qp::responder_loop`), so a requester never holds placed work it cannot tell is placed — a
/// connection closing after it is then never failed retroactively.
pub(crate) const FLAG_ACK_REQ: u8 = 1;
/// Set on a WRITE or SEND whose payload the responder pulls from the requester's memory (the
/// `pull` module): instead of the payload, [`SEG_LEN`]-byte segment descriptors follow the
/// header, as many as it takes to add up to `len`.
pub(crate) const FLAG_PULL: u8 = 2;
pub const REQ_LEN: usize = 32;

/// One segment of a pulled payload: `{addr: u64, len: u64}`, an address in the requester's
/// process.
pub(crate) const SEG_LEN: usize = 16;

/// A pulled payload's segment descriptor.
pub(crate) fn encode_seg(addr: u64, len: u64) -> [u8; SEG_LEN] {
    let mut b = [0u8; SEG_LEN];
    b[0..8].copy_from_slice(&addr.to_le_bytes());
    b[8..16].copy_from_slice(&len.to_le_bytes());
    b
}

/// `(addr, len)` of a segment descriptor.
pub(crate) fn decode_seg(b: &[u8; SEG_LEN]) -> (u64, u64) {
    (le64(b, 0), le64(b, 8))
}

/// A request header; `len` payload bytes follow for writes and sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: ReqOp,
    pub flags: u8,
    pub len: u32,
    pub seq: u64,
    pub raddr: u64,
    pub rkey: u32,
    /// Immediate data exactly as posted (network byte order).
    pub imm: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0] = self.op as u8;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.raddr.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b[28..32].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    /// `Err(seq)` for an unknown opcode: the responder answers REM_INV_REQ.
    pub fn decode(b: &[u8; REQ_LEN]) -> Result<Request, u64> {
        let op = match b[0] {
            1 => ReqOp::Write,
            2 => ReqOp::WriteImm,
            3 => ReqOp::Send,
            4 => ReqOp::SendImm,
            5 => ReqOp::Read,
            6 => ReqOp::Bye,
            7 => ReqOp::PullOffer,
            8 => ReqOp::FetchAdd,
            9 => ReqOp::CmpSwap,
            _ => return Err(le64(b, 8)),
        };
        Ok(Request {
            op,
            flags: b[1],
            len: le32(b, 4),
            seq: le64(b, 8),
            raddr: le64(b, 16),
            rkey: le32(b, 24),
            imm: le32(b, 28),
        })
    }

    /// Whether the request has a payload (on the wire, or pulled).
    pub(crate) fn carries_payload(&self) -> bool {
        matches!(
            self.op,
            ReqOp::Write | ReqOp::WriteImm | ReqOp::Send | ReqOp::SendImm
        )
    }

    /// Whether the responder pulls the payload (segment descriptors follow the header).
    pub(crate) fn pulled(&self) -> bool {
        self.flags & FLAG_PULL != 0
    }

    /// How many payload bytes follow the header on the wire: what a refused or discarded
    /// request leaves to drain (a pulled one's descriptors were read with its header; an
    /// atomic's payload is its [`AtomicArgs`]).
    pub(crate) fn payload_on_wire(&self) -> usize {
        match self.op.is_atomic() {
            true => ATOMIC_ARGS_LEN,
            false if self.carries_payload() && !self.pulled() => self.len as usize,
            false => 0,
        }
    }
}

/// Responder → requester answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RespOp {
    /// Everything up to and including `seq` is placed.
    Ack = 1,
    /// `seq` failed (syndrome: a [`Nak`]); everything before it is placed.
    Nak = 2,
    /// `seq` found no receive posted; retry after the timer in `syndrome` (IB RNR timer code).
    RnrNak = 3,
    /// The data of READ `seq` follows (`len` bytes), or the original value of atomic `seq` (8
    /// bytes, in the responder's byte order, as the word was in its memory).
    ReadResp = 4,
    /// The answer to a [`ReqOp::PullOffer`]; `syndrome` says whether the responder pulls and,
    /// if not, why (the `pull` module's `Verdict`).
    PullVerdict = 5,
}

/// NAK syndromes, mapped to the requester's completion status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Nak {
    /// rkey, PD, bounds or access flags: `IBV_WC_REM_ACCESS_ERR`.
    RemoteAccess = 1,
    /// Malformed request, or a SEND longer than the receive buffer: `IBV_WC_REM_INV_REQ_ERR`.
    InvalidRequest = 2,
    /// The responder failed to place the data (receive buffer not writable): `IBV_WC_REM_OP_ERR`.
    RemoteOperation = 3,
}

pub const RESP_LEN: usize = 24;

/// A response header; `len` bytes follow a READ response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub op: RespOp,
    pub syndrome: u8,
    pub len: u32,
    pub seq: u64,
}

impl Response {
    pub fn encode(&self) -> [u8; RESP_LEN] {
        let mut b = [0u8; RESP_LEN];
        b[0] = self.op as u8;
        b[1] = self.syndrome;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RESP_LEN]) -> Option<Response> {
        let op = match b[0] {
            1 => RespOp::Ack,
            2 => RespOp::Nak,
            3 => RespOp::RnrNak,
            4 => RespOp::ReadResp,
            5 => RespOp::PullVerdict,
            _ => return None,
        };
        Some(Response {
            op,
            syndrome: b[1],
            len: le32(b, 4),
            seq: le64(b, 8),
        })
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// How a blocking read ended when it did not fill the buffer.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// The socket's receive timeout fired before the first byte (only with `idle_ok`).
    Idle,
    /// Orderly EOF or a socket error: the connection is gone.
    Closed,
}

/// Reads exactly `dst.len()` bytes from `fd` into `dst`.
///
/// With `idle_ok`, a receive timeout before the first byte returns [`ReadEnd::Idle`] (the ack
/// reader uses it to check its retry timer); a timeout in the middle of a frame keeps reading,
/// because dropping half a frame would desynchronise the stream.
pub(crate) fn read_into(fd: RawFd, dst: Dst<'_>, idle_ok: bool) -> Result<(), ReadEnd> {
    let mut done = 0usize;
    while done < dst.len() {
        match dst.skip(done).read_from(fd) {
            Ok(0) => return Err(ReadEnd::Closed),
            Ok(n) => done += n,
            Err(err) => match err.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    if idle_ok && done == 0 {
                        return Err(ReadEnd::Idle);
                    }
                }
                _ => return Err(ReadEnd::Closed),
            },
        }
    }
    Ok(())
}

/// Whether bytes are waiting on `fd` (a read would not block). Errors and hang-ups count as
/// readable: the read that follows reports them.
pub(crate) fn readable(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    !matches!(sys::poll(&mut p, 0), Ok(0))
}

/// What a look into a socket found, without reading it.
#[derive(Debug)]
pub(crate) enum Look {
    /// This many bytes, copied and left in the socket.
    Bytes(usize),
    /// Nothing yet.
    Nothing,
    /// End of stream, or an error: the read that follows reports it.
    Ended,
}

/// Copies what waits on `fd` into `room` (as much as fits) without reading it or blocking.
pub(crate) fn look(fd: RawFd, room: &mut [u8]) -> Look {
    match sys::peek(fd, room) {
        Ok(0) => Look::Ended,
        Ok(n) => Look::Bytes(n),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            Look::Nothing
        }
        Err(_) => Look::Ended,
    }
}

/// Whether at least `len` bytes wait on `fd`: a frame that long can be read without blocking.
pub(crate) fn holds(fd: RawFd, len: usize) -> bool {
    sys::pending(fd).is_ok_and(|n| n >= len)
}

/// Reads a fixed-size header into a stack buffer.
pub(crate) fn read_exact<const N: usize>(fd: RawFd, idle_ok: bool) -> Result<[u8; N], ReadEnd> {
    let mut b = [0u8; N];
    read_into(fd, Dst::from(&mut b[..]), idle_ok)?;
    Ok(b)
}

/// Reads and throws away `len` bytes (a request the responder refused or discards after a NAK).
pub(crate) fn drain(fd: RawFd, mut len: usize) -> Result<(), ReadEnd> {
    let mut scratch = [0u8; 16 * 1024];
    while len > 0 {
        let n = len.min(scratch.len());
        read_into(fd, Dst::from(&mut scratch[..n]), false)?;
        len -= n;
    }
    Ok(())
}

/// Sends every byte of `iov` with `sendmsg(2)`, resuming after partial writes.
///
/// `MSG_NOSIGNAL`: a vanished peer is an error here, never a SIGPIPE that kills the host
/// process (NCCL does not ignore SIGPIPE). The socket has a send timeout; on each expiry
/// `abort()` is asked whether to give up (QP destroyed or in error), so a writer blocked on a
/// stalled peer can still be stopped. With `try_first`, the first attempt does not wait:
/// `Ok(false)` means nothing could be sent (the caller hands the work to a thread that may
/// block); once a byte went out, the rest is sent like any other frame.
pub(crate) fn send_all(
    fd: RawFd,
    iov: &mut [Src<'_>],
    abort: &dyn Fn() -> bool,
    try_first: bool,
) -> io::Result<bool> {
    let mut first = 0usize;
    let mut dontwait = try_first;
    while first < iov.len() {
        if iov[first].len() == 0 {
            first += 1;
            continue;
        }
        let flags = libc::MSG_NOSIGNAL | if dontwait { libc::MSG_DONTWAIT } else { 0 };
        let mut n = match memory::sendmsg(fd, &iov[first..], flags) {
            Ok(n) => n,
            Err(err) => match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock if dontwait => return Ok(false),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut if !abort() => continue,
                _ => return Err(err),
            },
        };
        dontwait = false;
        while n > 0 && first < iov.len() {
            let take = n.min(iov[first].len());
            iov[first] = iov[first].skip(take);
            n -= take;
            if iov[first].len() == 0 {
                first += 1;
            }
        }
    }
    Ok(true)
}

/// Waits until one of `fds` is readable (or hung up, or in error), or `timeout` passed
/// (rounded up to whole milliseconds, so a deadline a few microseconds away is not a spin).
/// What became readable is for the caller to find out: it reads every socket without blocking.
pub(crate) fn wait_readable(fds: &[RawFd], timeout: std::time::Duration) {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = libc::c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
    // Its result is not needed (see above).
    let _ = sys::poll(&mut polled, ms);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let r = Request {
            op: ReqOp::WriteImm,
            flags: FLAG_ACK_REQ,
            len: 4096,
            seq: 7,
            raddr: 0xdead_beef_0000,
            rkey: 0x1234,
            imm: 0xaabb_ccdd,
        };
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let a = Response {
            op: RespOp::RnrNak,
            syndrome: 12,
            len: 0,
            seq: 99,
        };
        assert_eq!(Response::decode(&a.encode()), Some(a));
        assert_eq!(
            decode_hello(&encode_hello(0x10203, 0x40506, 77)),
            Some((0x10203, 0x40506, 77))
        );
        let mut junk = [0u8; REQ_LEN];
        junk[0] = 42;
        junk[8] = 9;
        assert_eq!(Request::decode(&junk), Err(9));
        assert_eq!(decode_hello(&[0u8; HELLO_LEN]), None);
        assert_eq!(
            decode_seg(&encode_seg(0x7fff_0000_1000, 1 << 20)),
            (0x7fff_0000_1000, 1 << 20)
        );
        let pulled = Request {
            flags: FLAG_PULL,
            ..r
        };
        assert_eq!((pulled.payload_on_wire(), r.payload_on_wire()), (0, 4096));
        let cas = Request {
            op: ReqOp::CmpSwap,
            len: ATOMIC_WORD,
            ..r
        };
        assert_eq!(Request::decode(&cas.encode()), Ok(cas));
        assert_eq!(cas.payload_on_wire(), ATOMIC_ARGS_LEN);
        let args = AtomicArgs {
            compare_add: 0x0102_0304_0506_0708,
            swap: u64::MAX - 1,
        };
        assert_eq!(AtomicArgs::decode(&args.encode()), args);
    }
}
