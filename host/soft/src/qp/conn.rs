//! One TCP connection (one direction of a QP) and the socket options every data connection
//! gets.
//!
//! Separate because both ends make one (the requester when it connects, the responder when it
//! admits a caller) and all three threads use it.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
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
}

impl Conn {
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
