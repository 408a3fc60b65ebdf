//! The handshake socket: a non-blocking TCP stream that moves bytes between the wire and a
//! handshake machine, never waiting. NCCL's proxy thread calls `connect`/`accept` again and again
//! until they return a communicator, so each call does what the socket allows and returns.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use socket2::{Domain, Protocol, Socket, Type};

use crate::net_error::NetError;
use ncclwasm_proto::ProtoError;
use ncclwasm_proto::handshake::{Acceptor, Connector, Control};

/// What a handshake machine offers the socket (both [`Connector`] and [`Acceptor`]).
pub(crate) trait Machine {
    fn transmit(&self) -> &[u8];
    fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError>;
    fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError>;
    fn handle_eof(&mut self) -> Result<(), ProtoError>;
}

macro_rules! machine {
    ($t:ty) => {
        impl Machine for $t {
            fn transmit(&self) -> &[u8] {
                <$t>::transmit(self)
            }
            fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError> {
                <$t>::advance_transmit(self, n)
            }
            fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError> {
                <$t>::handle_bytes(self, data)
            }
            fn handle_eof(&mut self) -> Result<(), ProtoError> {
                <$t>::handle_eof(self)
            }
        }
    };
}
machine!(Connector);
machine!(Acceptor);
machine!(Control);

/// A handshake stream, possibly still connecting.
/// The handshake socket of a connection still being made (a made connection may have taken it).
pub(crate) fn open(stream: &mut Option<Stream>) -> Result<&mut Stream, NetError> {
    stream
        .as_mut()
        .ok_or_else(|| NetError::Internal("the handshake socket is gone".into()))
}

#[derive(Debug)]
pub(crate) struct Stream {
    stream: TcpStream,
    connected: bool,
    peer: SocketAddr,
}

impl Stream {
    /// Starts a non-blocking connect to `peer`.
    pub(crate) fn connect(peer: SocketAddr) -> Result<Stream, NetError> {
        let what = || format!("connecting to the handshake listener {peer}");
        let sock = Socket::new(Domain::for_address(peer), Type::STREAM, Some(Protocol::TCP))
            .map_err(NetError::io(what()))?;
        sock.set_nonblocking(true).map_err(NetError::io(what()))?;
        sock.set_tcp_nodelay(true).map_err(NetError::io(what()))?;
        let connected = match sock.connect(&peer.into()) {
            Ok(()) => true,
            Err(e)
                if e.kind() == ErrorKind::WouldBlock
                    || e.raw_os_error() == Some(libc::EINPROGRESS) =>
            {
                false
            }
            Err(e) => return Err(NetError::io(what())(e)),
        };
        Ok(Stream {
            stream: sock.into(),
            connected,
            peer,
        })
    }

    /// The next connection waiting on `listener`, if any.
    pub(crate) fn accept(listener: &TcpListener) -> Result<Option<Stream>, NetError> {
        let what = "accepting a handshake connection";
        match listener.accept() {
            Ok((stream, peer)) => {
                stream.set_nonblocking(true).map_err(NetError::io(what))?;
                stream.set_nodelay(true).map_err(NetError::io(what))?;
                Ok(Some(Stream {
                    stream,
                    connected: true,
                    peer,
                }))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(None)
            }
            // A connection that went away while queued, or a network error Linux reports on the
            // next accept (accept(2): "treat them like EAGAIN"): nothing to accept this time.
            Err(e)
                if e.raw_os_error().is_some_and(|n| {
                    [
                        libc::ECONNABORTED,
                        libc::EPROTO,
                        libc::ENETDOWN,
                        libc::ENOPROTOOPT,
                        libc::EHOSTDOWN,
                        libc::ENONET,
                        libc::EHOSTUNREACH,
                        libc::EOPNOTSUPP,
                        libc::ENETUNREACH,
                    ]
                    .contains(&n)
                }) =>
            {
                Ok(None)
            }
            Err(e) => Err(NetError::io(what)(e)),
        }
    }

    /// The other end.
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether the non-blocking connect finished; its failure is an error.
    fn ready(&mut self) -> Result<bool, NetError> {
        if self.connected {
            return Ok(true);
        }
        let what = || format!("connecting to the handshake listener {}", self.peer);
        if let Some(e) = self.stream.take_error().map_err(NetError::io(what()))? {
            return Err(NetError::io(what())(e));
        }
        match self.stream.peer_addr() {
            Ok(_) => {
                self.connected = true;
                Ok(true)
            }
            Err(e) if e.kind() == ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(NetError::io(what())(e)),
        }
    }

    /// Writes what the machine has to say and feeds it what arrived, without blocking.
    pub(crate) fn pump(
        &mut self,
        m: &mut impl Machine,
        during: &'static str,
    ) -> Result<(), NetError> {
        if !self.ready()? {
            return Ok(());
        }
        let peer = self.peer;
        let io = |e| NetError::io(format!("handshake with {peer}"))(e);
        while !m.transmit().is_empty() {
            match self.stream.write(m.transmit()) {
                Ok(0) => break,
                Ok(n) => m.advance_transmit(n).map_err(NetError::protocol(during))?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        let mut buf = [0u8; 4096];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    m.handle_eof().map_err(NetError::protocol(during))?;
                    return Ok(());
                }
                Ok(n) => m
                    .handle_bytes(&buf[..n])
                    .map_err(NetError::protocol(during))?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
    }
}
