//! The callers of a QP port before they said who they are: many at once, each for a short
//! time.
//!
//! A QP port is a TCP port anyone can reach, and the hello that proves a caller is expected
//! comes only after the connection is up. Were hellos read one at a time, a hundred idle sockets
//! (no secret needed to open one) would hold up a legitimate QP for a hundred hello timeouts and
//! its retry budget would run out. So the listener keeps every caller that has not sent its
//! hello in a bounded [`Pending`] set (the rules are `ncclwasm_admission`'s: at most
//! `MAX_PENDING`, the oldest evicted, each for at most [`HELLO_TIMEOUT`]) and reads whichever
//! has bytes, without blocking.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

pub(crate) use ncclwasm_admission::Pending;

use super::wire::HELLO_LEN;

/// How long a caller may take to send its hello: a requester sends it in the same breath as
/// its connect, so a second is generous, and a stranger holds a slot no longer than that.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(1);

/// An accepted connection whose hello is still (partly) to come.
#[derive(Debug)]
pub(crate) struct Caller {
    stream: TcpStream,
    peer: SocketAddr,
    buf: [u8; HELLO_LEN],
    got: usize,
}

/// What became of a caller: its whole hello, or why it has none.
pub(crate) type Heard = Result<[u8; HELLO_LEN], &'static str>;

impl Caller {
    /// A freshly accepted connection, switched to non-blocking reads.
    pub(crate) fn new(stream: TcpStream, peer: SocketAddr) -> std::io::Result<Caller> {
        stream.set_nonblocking(true)?;
        Ok(Caller {
            stream,
            peer,
            buf: [0; HELLO_LEN],
            got: 0,
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Reads what arrived; `None` while the hello is incomplete and the socket has nothing
    /// more for now.
    pub(crate) fn read(&mut self) -> Option<Heard> {
        loop {
            match self.stream.read(&mut self.buf[self.got..]) {
                Ok(0) => return Some(Err("closed before its hello")),
                Ok(n) => {
                    self.got += n;
                    if self.got == HELLO_LEN {
                        return Some(Ok(self.buf));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Some(Err("connection failed before its hello")),
            }
        }
    }

    /// The connection back in blocking mode (what the responder and the answer expect), and
    /// who is calling.
    pub(crate) fn into_stream(self) -> (std::io::Result<TcpStream>, SocketAddr) {
        let Caller { stream, peer, .. } = self;
        let stream = stream.set_nonblocking(false).map(|()| stream);
        (stream, peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{Shutdown, TcpListener};

    fn pair() -> (TcpStream, Caller) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        (client, Caller::new(s, peer).unwrap())
    }

    #[test]
    fn a_hello_in_pieces_completes_once_whole() {
        let (mut client, mut c) = pair();
        assert_eq!(c.read(), None, "nothing sent yet: no blocking, no verdict");
        client.write_all(&[7; 5]).unwrap();
        // Loopback delivers before write returns; read until it is seen.
        while c.got < 5 {
            assert_eq!(c.read(), None);
        }
        client.write_all(&[8; HELLO_LEN - 5]).unwrap();
        let heard = loop {
            if let Some(h) = c.read() {
                break h;
            }
        };
        let mut want = [8u8; HELLO_LEN];
        want[..5].fill(7);
        assert_eq!(heard, Ok(want));
    }

    #[test]
    fn closing_early_is_no_hello() {
        let (mut client, mut c) = pair();
        client.write_all(&[1; 3]).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let heard = loop {
            if let Some(h) = c.read() {
                break h;
            }
        };
        assert_eq!(heard, Err("closed before its hello"));
    }
}
