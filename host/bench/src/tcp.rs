//! The TCP baseline: the same traffic as through the plugin, over one plain, well-tuned TCP
//! connection on loopback, size by size right after the plugin's.

use std::io::{BufRead, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::cpu::CpuClock;
use super::wait::{moved, retry, stall};
use super::wire::{self, Msg, Part, RankArgs, Role, RoundTrips, Timing};
use super::workload::{fill, iterations, spoil, verify};
use crate::Error;

fn io_fail(what: &str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::run(format!("tcp baseline: {what}: {e}"))
}

/// The baseline's socket buffers, each way: those of the soft fabric's QP sockets, so the
/// plugin's TCP and the baseline's run on equal sockets and the ratio compares protocols, not
/// socket tuning. Fixed rather than autotuned, so the window does not depend on what the
/// connection carried before (the small sizes come first) nor on the host's `tcp_rmem`
/// ceiling, which can let tens of MiB queue up in the receiver, more than the caches hold.
const TCP_BUFFER: usize = 4 << 20;

/// The baseline's one TCP connection on loopback: the receiver listens, the sender connects to
/// the port the parent relays.
///
/// What makes it a well-tuned stream, so that a ratio of 1 means "as fast as one socket goes
/// here": `TCP_NODELAY` (a ping or the last segment of a message leaves at once), socket buffers
/// of [`TCP_BUFFER`], every message written whole from, and read straight into, a buffer
/// allocated and touched before the timing (no staging copy, no page fault, no allocation per
/// message; the kernel segments it), and the pattern check outside the timed loop.
pub fn tcp_connect(args: &RankArgs, stdin: &mut impl BufRead) -> Result<TcpStream, Error> {
    let stream = match args.role {
        Role::Recv => {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io_fail("bind"))?;
            let port = listener.local_addr().map_err(io_fail("bind"))?.port();
            listener.set_nonblocking(true).map_err(io_fail("listen"))?;
            wire::send(&Msg::TcpPort(port))?;
            let (s, _) = retry("tcp accept", || match listener.accept() {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(None)
                }
                Err(e) => Err(io_fail("accept")(e)),
            })?;
            s.set_nonblocking(false).map_err(io_fail("accept"))?;
            s
        }
        Role::Send => {
            let line = wire::read_line(stdin, "TCP port")?;
            let port: u16 = line
                .parse()
                .map_err(|_| Error::run(format!("not a port: {line:?}")))?;
            TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(io_fail("connect"))?
        }
    };
    stream.set_nodelay(true).map_err(io_fail("setup"))?;
    let socket = socket2::SockRef::from(&stream);
    socket
        .set_send_buffer_size(TCP_BUFFER)
        .and_then(|()| socket.set_recv_buffer_size(TCP_BUFFER))
        .map_err(io_fail("setup"))?;
    stream
        .set_read_timeout(Some(stall()))
        .and_then(|()| stream.set_write_timeout(Some(stall())))
        .map_err(io_fail("setup"))?;
    Ok(stream)
}

/// One repeat of one size of the TCP stream, `msg` its buffer on either rank: the checked
/// message and the warmup when it is the `first`, then a one-byte "go" from the receiver and
/// the timed messages back to back, timed by the receiver.
pub fn tcp_stream(
    args: &RankArgs,
    k: usize,
    first: bool,
    stream: &mut TcpStream,
    msg: &mut [u8],
) -> Result<(), Error> {
    let iters = iterations(msg.len() as u64, args.iters, args.repeats);
    match args.role {
        Role::Recv => {
            if first {
                spoil(msg, k);
                stream.read_exact(msg).map_err(io_fail("receive"))?;
                verify(msg, k, "tcp")?;
                for _ in 0..args.warmup {
                    stream.read_exact(msg).map_err(io_fail("receive"))?;
                    moved()?;
                }
            }
            let cpu = CpuClock::start()?;
            let start = Instant::now();
            stream.write_all(b"g").map_err(io_fail("go"))?;
            for _ in 0..iters {
                stream.read_exact(msg).map_err(io_fail("receive"))?;
                moved()?;
            }
            let timing = Timing::since(msg.len(), iters, start, first);
            cpu.report(Part::Tcp, msg.len(), iters)?;
            wire::send(&Msg::Tcp(timing))
        }
        Role::Send => {
            if first {
                fill(msg, k);
                for _ in 0..=args.warmup {
                    stream.write_all(msg).map_err(io_fail("send"))?;
                }
            }
            let mut go = [0u8; 1];
            stream.read_exact(&mut go).map_err(io_fail("go"))?;
            let cpu = CpuClock::start()?;
            for _ in 0..iters {
                stream.write_all(msg).map_err(io_fail("send"))?;
                moved()?;
            }
            cpu.report(Part::Tcp, msg.len(), iters)
        }
    }
}

/// The sender's half of one repeat of one size of the TCP ping-pong, the same shape as the
/// plugin's (`super::rank`): the checked exchange and the warmup when it is the `first`, then
/// each timed round trip alone.
pub fn tcp_ping(
    args: &RankArgs,
    k: usize,
    first: bool,
    stream: &mut TcpStream,
    out: &mut [u8],
    back: &mut [u8],
) -> Result<(), Error> {
    if first {
        fill(out, k);
        spoil(back, k);
        tcp_trip(stream, out, back)?;
        verify(back, k, "tcp ping-pong, the echo")?;
        for _ in 0..args.latency_warmup {
            tcp_trip(stream, out, back)?;
        }
    }
    let cpu = CpuClock::start()?;
    let trips = (0..args.latency_iters)
        .map(|_| tcp_trip(stream, out, back))
        .collect::<Result<Vec<_>, _>>()?;
    cpu.report(Part::TcpPingPong, out.len(), args.latency_iters)?;
    wire::send(&Msg::TcpPingPong(RoundTrips::new(out.len(), trips, first)))
}

fn tcp_trip(stream: &mut TcpStream, out: &[u8], back: &mut [u8]) -> Result<Duration, Error> {
    let start = Instant::now();
    stream.write_all(out).map_err(io_fail("ping"))?;
    stream.read_exact(back).map_err(io_fail("pong"))?;
    let elapsed = start.elapsed();
    moved()?;
    Ok(elapsed)
}

/// The receiver's half of one repeat of one size of the TCP ping-pong: it answers every ping
/// with the bytes that arrived; when it is the `first`, it checks the first ping and answers
/// the warmup's too.
pub fn tcp_pong(
    args: &RankArgs,
    k: usize,
    first: bool,
    stream: &mut TcpStream,
    msg: &mut [u8],
) -> Result<(), Error> {
    let pings = if first {
        spoil(msg, k);
        1 + args.latency_warmup + args.latency_iters
    } else {
        args.latency_iters
    };
    let cpu = CpuClock::start()?;
    for i in 0..pings {
        stream.read_exact(msg).map_err(io_fail("ping"))?;
        if first && i == 0 {
            verify(msg, k, "tcp ping-pong, the ping")?;
        }
        stream.write_all(msg).map_err(io_fail("pong"))?;
        moved()?;
    }
    cpu.report(Part::TcpPingPong, msg.len(), pings)
}
