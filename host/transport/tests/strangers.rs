//! A handshake listener no stranger can break: stray connections of every kind (connect and
//! close, reset, garbage, a hello with a stale nonce, half a hello) and slow or idle ones
//! (slowloris) are dropped and counted while `accept` goes on waiting; the real peer is
//! accepted quickly and its connection carries data.
//!
//! `NCCL_WASM_TEST_SLOWLORIS_SECS` sets how long the slow connections stay before the real
//! peer comes (default 5; the figure is 60).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::*;
use ncclwasm_proto::handle::ListenHandle;
use ncclwasm_transport::{CommConfig, HANDLE_SIZE, Listener, Net, NetError, RecvComm, SendComm};
use socket2::SockRef;

const STRAYS: usize = 30_000;
/// Half-open strays that stay connected until the real peer is in.
const KEPT_OPEN: usize = 50;
/// What the listener may still hold when the real peer is accepted
/// (`ncclwasm_admission::MAX_PENDING`).
const MAX_PENDING: u64 = 64;

/// One test at a time: each measures how fast a real peer gets in, on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

const CFG: CommConfig = CommConfig {
    comm_id: 0x5747,
    traffic_class: -1,
    net_attr: None,
    one_sided: None,
};

/// What the accepting thread saw.
struct Accepted {
    result: Result<RecvComm, NetError>,
    listener: Listener,
    at: Instant,
}

/// Calls `accept` as NCCL's proxy thread does until it returns a communicator or an error (or
/// 120 s pass: then the test fails instead of hanging).
fn accept_in_background(mut listener: Listener) -> JoinHandle<Accepted> {
    thread::spawn(move || {
        let end = Instant::now() + Duration::from_secs(120);
        loop {
            let result = match listener.accept() {
                Ok(None) if Instant::now() < end => {
                    thread::yield_now();
                    continue;
                }
                Ok(None) => panic!("no peer accepted in 120 s"),
                Ok(Some(comm)) => Ok(comm),
                Err(e) => Err(e),
            };
            return Accepted {
                result,
                listener,
                at: Instant::now(),
            };
        }
    })
}

/// The hello a connector sends for `handle`, captured on a socket of our own, with the nonce
/// changed: what a rank of an earlier job would send.
fn stale_hello(net: &Net, handle: &[u8; HANDLE_SIZE]) -> Vec<u8> {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    fake.set_nonblocking(true).unwrap();
    let mut target = ListenHandle::decode(handle).unwrap();
    target.addr = fake.local_addr().unwrap();
    target.nonce ^= 0x1;
    let mut tampered = target.encode().unwrap();
    let end = deadline();
    let mut conn: Option<TcpStream> = None;
    let mut hello = Vec::new();
    loop {
        assert!(Instant::now() < end, "no hello captured");
        assert!(net.connect(0, &mut tampered, CFG).unwrap().is_none());
        if conn.is_none() {
            conn = fake.accept().ok().map(|(s, _)| s);
        }
        let Some(c) = conn.as_mut() else { continue };
        c.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 4096];
        match c.read(&mut buf) {
            Ok(n) if n > 0 => hello.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock && !hello.is_empty() => break,
            _ => {}
        }
    }
    // The connector learns its peer went away and forgets the connection.
    drop(conn);
    while net
        .connect(0, &mut tampered, CFG)
        .is_ok_and(|c| c.is_none())
    {
        assert!(Instant::now() < end, "the abandoned connect never failed");
    }
    hello
}

fn reset_on_close(s: &TcpStream) {
    SockRef::from(s).set_linger(Some(Duration::ZERO)).unwrap();
}

/// Stray `i`: one of five kinds. Returns it when it must stay open.
fn stray(addr: SocketAddr, hello: &[u8], i: usize) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).expect("the listener's queue takes strays");
    match i % 5 {
        // Connect and close.
        0 => {}
        // Connect and reset.
        1 => reset_on_close(&s),
        // Garbage.
        2 => {
            reset_on_close(&s);
            let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        }
        // A whole hello with a stale nonce; the listener closes on us.
        3 => {
            s.write_all(hello).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(0) => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
                other => panic!("a stale hello got {other:?} instead of a closed socket"),
            }
        }
        // Half a hello: left open for the first few, reset for the others.
        _ => {
            let _ = s.write_all(&hello[..hello.len() / 2]);
            if i / 5 < KEPT_OPEN {
                return Some(s);
            }
            reset_on_close(&s);
        }
    }
    None
}

/// Connects the real peer; returns its send communicator, the receive side and how long
/// connect+accept took.
fn real_peer(
    net: &Net,
    handle: &mut [u8; HANDLE_SIZE],
    acceptor: JoinHandle<Accepted>,
) -> (SendComm, Accepted, Duration) {
    let start = Instant::now();
    let end = deadline();
    let send = loop {
        assert!(Instant::now() < end, "connect stuck");
        if let Some(s) = net.connect(0, handle, CFG).unwrap() {
            break s;
        }
    };
    let connected = Instant::now();
    let accepted = acceptor.join().expect("the accepting thread");
    let took = accepted.at.max(connected) - start;
    (send, accepted, took)
}

#[test]
fn thirty_thousand_strangers_then_the_real_peer() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let net = net();
    let (listener, mut handle) = net.listen(1).unwrap();
    let addr = ListenHandle::decode(&handle).unwrap().addr;
    let hello = stale_hello(&net, &handle);
    let acceptor = accept_in_background(listener);

    let t0 = Instant::now();
    let kept: Vec<TcpStream> = (0..STRAYS).filter_map(|i| stray(addr, &hello, i)).collect();
    let strays_took = t0.elapsed();
    assert!(
        !acceptor.is_finished(),
        "accept returned before the real peer came"
    );

    let (send, accepted, took) = real_peer(&net, &mut handle, acceptor);
    let recv = accepted
        .result
        .expect("accept returns the real peer, not an error");
    let dropped = accepted.listener.strangers_dropped();
    println!(
        "{STRAYS} strays in {strays_took:.2?}; real connect+accept {took:.2?}; \
         {dropped} strangers dropped"
    );
    assert!(
        took < Duration::from_secs(1),
        "real connect+accept took {took:?}"
    );
    assert!(
        dropped >= STRAYS as u64 - MAX_PENDING && dropped <= STRAYS as u64,
        "{dropped} of {STRAYS} strays dropped"
    );
    drop(kept);
    small_message(&send, &recv);
}

/// A connection that sends one byte of a (stale) hello per second, reconnecting when dropped.
fn trickle(addr: SocketAddr, hello: Vec<u8>, stop: &AtomicBool) {
    'conn: while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(addr) else {
            return;
        };
        for b in hello.iter().cycle() {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if s.write_all(std::slice::from_ref(b)).is_err() {
                continue 'conn;
            }
            thread::sleep(Duration::from_secs(1));
        }
    }
}

/// A connection that sends nothing, reconnecting when dropped.
fn idle(addr: SocketAddr, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(addr) else {
            return;
        };
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut b = [0u8; 1];
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match s.read(&mut b) {
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {}
                _ => break, // dropped: come back
            }
        }
    }
}

#[test]
fn slowloris_and_idle_sockets_do_not_delay_the_real_peer() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let secs: u64 = std::env::var("NCCL_WASM_TEST_SLOWLORIS_SECS")
        .ok()
        .map(|v| {
            v.parse()
                .expect("NCCL_WASM_TEST_SLOWLORIS_SECS: whole seconds")
        })
        .unwrap_or(5);
    let net = net();
    let (listener, mut handle) = net.listen(1).unwrap();
    let addr = ListenHandle::decode(&handle).unwrap().addr;
    let hello = stale_hello(&net, &handle);
    let acceptor = accept_in_background(listener);

    let stop = AtomicBool::new(false);
    let (send, accepted, took) = thread::scope(|scope| {
        scope.spawn(|| trickle(addr, hello, &stop));
        scope.spawn(|| idle(addr, &stop));
        thread::sleep(Duration::from_secs(secs));
        assert!(
            !acceptor.is_finished(),
            "accept returned before the real peer came"
        );
        let out = real_peer(&net, &mut handle, acceptor);
        stop.store(true, Ordering::Relaxed);
        out
    });
    let recv = accepted
        .result
        .expect("accept returns the real peer, not an error");
    println!(
        "after {secs} s of a 1 byte/s connection and an idle one: real connect+accept {took:.2?}; \
         {} strangers dropped",
        accepted.listener.strangers_dropped()
    );
    assert!(
        took < Duration::from_secs(1),
        "real connect+accept took {took:?}"
    );
    small_message(&send, &recv);
}
