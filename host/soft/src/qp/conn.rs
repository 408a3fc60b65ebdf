//! One TCP connection (one direction of a QP) and the socket options every data connection
//! gets.
//!
//! Separate because both ends make one (the requester when it connects, the responder when it
//! admits a caller), all three threads use it, and a thread polling a CQ may read it (the
//! `serve` module).

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use socket2::SockRef;

use crate::traffic::Counter;

/// Send timeout on sockets: how often a writer blocked on a stalled peer checks for teardown.
const WRITE_TICK: Duration = Duration::from_millis(100);
/// Socket buffer size: large enough to keep a loopback stream busy while the peer places data.
const SOCK_BUF: usize = 4 << 20;

/// One TCP connection (one QP direction).
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) epoch: u64,
    /// The payload this connection carries, counted for its local port and peer address.
    pub(super) traffic: Arc<Counter>,
    /// The requester's end: the responder agreed to pull large payloads from our memory (the
    /// `pull` module). Always `false` at the responder's end, which keeps whom it pulls from.
    pub(super) pulls: bool,
    /// The right to read the connection (and, at the responder's end, to answer on it), with
    /// what its reader keeps between frames. Its own thread holds it while it reads; a thread
    /// polling the QP's CQ takes it for a look while the connection is leased.
    turn: Mutex<Turn>,
    /// Leased: the connection's thread is parked, and threads polling the CQ read it (the
    /// `serve` module). Cleared by the thread when it takes the connection back, or by a
    /// poller that hands a frame to it.
    pub(super) leased: AtomicBool,
    /// A poller placed requests that asked for no answer and left their ACK for its next
    /// poll of the CQ (the `serve` module): that poll acknowledges them once the connection
    /// is quiet, even if nothing new arrived.
    pub(super) owes_ack: AtomicBool,
}

/// What the reader of a connection keeps from one frame to the next, whichever thread it is.
#[derive(Debug, Default)]
pub(super) struct Turn {
    /// The responder's last placed request not acknowledged yet. Acknowledged before the
    /// reader waits for the next request, so nothing placed stays unacknowledged while the
    /// connection is quiet (and a stream of requests costs one ACK per burst, not one per
    /// request).
    pub(super) unacked: Option<u64>,
    /// The requester's pid once it offered same-host pull and the probe succeeded.
    pub(super) pull_from: Option<libc::pid_t>,
}

impl Conn {
    pub(super) fn new(stream: TcpStream, epoch: u64, traffic: Arc<Counter>, pulls: bool) -> Conn {
        Conn {
            stream,
            epoch,
            traffic,
            pulls,
            turn: Mutex::new(Turn::default()),
            leased: AtomicBool::new(false),
            owes_ack: AtomicBool::new(false),
        }
    }

    /// Waits for the turn to read (its own thread).
    pub(super) fn turn(&self) -> MutexGuard<'_, Turn> {
        self.turn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The turn to read, unless somebody has it (a poller never waits for it).
    pub(super) fn try_turn(&self) -> Option<MutexGuard<'_, Turn>> {
        match self.turn.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub(super) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    pub(super) fn kill(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Socket options for a data connection: no Nagle (headers and payloads go out in one
/// `sendmsg`, small messages must not wait), large buffers, and a send timeout so a writer
/// blocked on a stalled peer can notice teardown.
pub(super) fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(WRITE_TICK));
    let s = SockRef::from(stream);
    let _ = s.set_send_buffer_size(SOCK_BUF);
    let _ = s.set_recv_buffer_size(SOCK_BUF);
}
