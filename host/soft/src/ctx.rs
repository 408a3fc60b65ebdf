//! A device context: its MRs, async events, QPs, and the TCP listeners that admit peers.
//!
//! # QP numbers carry the listener
//! A QPN is `tcp_port << 8 | slot`: each listener pool owns 256 QP slots and one TCP port
//! (the same port on every distinct address of the device's ports). A requester therefore
//! needs nothing beyond what RC addressing already exchanges — the peer's GID or LID (→ IP)
//! and QPN (→ TCP port, slot) — and several processes, or two copies of this code loaded in one
//! process, share an IP address without colliding, because each binds its own ephemeral ports.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ncclwasm_admission::{MAX_PENDING, Throttle, WARN_INTERVAL};

use ibverbs_sys::ibv_event_type;

use super::event::{Cq, Element, EventQueue, Overrun, Wc};
use super::fabric::{Fabric, SoftDevice};
use super::hello::{Caller, HELLO_TIMEOUT, Heard, Pending};
use super::link_watch;
use super::mr::MrTable;
use super::qp::Qp;
use super::wire::{self, HELLO_LEN, HelloReply};

/// QP slots per listener (the low 8 bits of a QPN).
const SLOTS: usize = 256;
/// Connections taken from the kernel's queue per wake-up, so a flood of callers cannot keep
/// the hellos already waiting from being read.
const ACCEPT_BATCH: usize = 64;
/// The longest an accept thread sleeps without looking at its stop flag (closing a context
/// also wakes it at once by shutting its listener down).
const IDLE_WAKE: Duration = Duration::from_millis(500);

/// One open `ibv_context`.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub dev: &'static SoftDevice,
    pub fabric: &'static Fabric,
    pub mrs: MrTable,
    pub events: EventQueue,
    pools: Mutex<Vec<Arc<Pool>>>,
    qps: Mutex<Vec<Weak<Qp>>>,
    /// Connections refused as strangers (unknown QP, wrong secret, wrong source).
    pub refused: Arc<AtomicU64>,
    /// Every thread started for this context (QPs and listeners).
    pub threads: Threads,
    next_pd: AtomicU32,
}

/// Starts threads and counts the live ones, so a test can prove that closing a context stops
/// everything it started.
#[derive(Clone, Debug, Default)]
pub(crate) struct Threads(Arc<AtomicUsize>);

impl Threads {
    pub(crate) fn spawn(
        &self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<JoinHandle<()>> {
        struct Live(Arc<AtomicUsize>);
        impl Drop for Live {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.0.fetch_add(1, Ordering::AcqRel);
        let live = Live(Arc::clone(&self.0));
        std::thread::Builder::new().name(name).spawn(move || {
            let _live = live;
            f();
        })
    }

    /// Threads started and not yet finished.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

impl Ctx {
    pub(crate) fn new(
        fabric: &'static Fabric,
        dev: &'static SoftDevice,
    ) -> std::io::Result<Arc<Ctx>> {
        let events = EventQueue::new()?;
        // Before the context is listed: a link already down at open is no event.
        link_watch::attach(dev);
        let ctx = Arc::new(Ctx {
            dev,
            fabric,
            mrs: MrTable::default(),
            events,
            pools: Mutex::new(Vec::new()),
            qps: Mutex::new(Vec::new()),
            refused: Arc::new(AtomicU64::new(0)),
            threads: Threads::default(),
            next_pd: AtomicU32::new(1),
        });
        let mut list = dev.contexts.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&ctx));
        Ok(ctx)
    }

    pub(crate) fn alloc_pd_id(&self) -> u32 {
        self.next_pd.fetch_add(1, Ordering::Relaxed)
    }

    /// Reserves a QP slot, opening a new listener pool when all are taken; returns the QPN.
    pub(crate) fn reserve_qpn(&self) -> std::io::Result<(Arc<Pool>, u32)> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        for pool in pools.iter() {
            if let Some(slot) = pool.reserve() {
                return Ok((Arc::clone(pool), pool.qpn(slot)));
            }
        }
        let pool = Pool::open(
            &self.dev.addresses(),
            Arc::clone(&self.refused),
            &self.threads,
        )?;
        let slot = pool.reserve().expect("a new pool has free slots");
        let qpn = pool.qpn(slot);
        pools.push(Arc::clone(&pool));
        Ok((pool, qpn))
    }

    pub(crate) fn add_qp(&self, qp: &Arc<Qp>) {
        let mut qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        qps.retain(|w| w.strong_count() > 0);
        qps.push(Arc::downgrade(qp));
    }

    /// The live QPs of this context.
    pub(crate) fn qps(&self) -> Vec<Arc<Qp>> {
        let qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        qps.iter().filter_map(Weak::upgrade).collect()
    }

    /// Stops everything this context started: QP threads, then listener threads, and the link
    /// watcher if this was the last open context.
    pub(crate) fn close(&self) {
        for qp in self.qps() {
            qp.destroy();
        }
        let pools = std::mem::take(&mut *self.pools.lock().unwrap_or_else(|e| e.into_inner()));
        for pool in pools {
            pool.stop();
        }
        self.events.close();
        link_watch::detach(self.dev);
    }
}

/// The live QP numbered `qpn` whose pool listens on `addr`, in any open context of this copy
/// of the provider: how a QP finds a peer in the same process (see
/// [`crate::Delivery::InProcess`]). Called once per QP, not per WR.
pub(crate) fn local_qp(fabric: &Fabric, addr: IpAddr, qpn: u32) -> Option<Arc<Qp>> {
    let port = u16::try_from(qpn >> 8).ok()?;
    let addr = addr.to_canonical();
    fabric.devices.iter().find_map(|dev| {
        let contexts = dev
            .contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        contexts.iter().filter_map(Weak::upgrade).find_map(|ctx| {
            let pools = ctx.pools.lock().unwrap_or_else(|e| e.into_inner());
            pools
                .iter()
                .filter(|p| p.port == port)
                .filter(|p| {
                    p.listeners
                        .iter()
                        .any(|l| l.local_addr().is_ok_and(|a| a.ip().to_canonical() == addr))
                })
                .find_map(|p| p.qp(qpn))
        })
    })
}

/// A CQ with the context it reports overruns to.
#[derive(Debug)]
pub(crate) struct CqState {
    pub cq: Cq,
    /// Address of the `ibv_cq` (for `IBV_EVENT_CQ_ERR`).
    pub ibv: AtomicUsize,
    pub ctx: Arc<Ctx>,
    /// The connections whose completions come here, which its pollers serve while they poll.
    pub served: crate::qp::Served,
    /// QPs created with this CQ (once per queue) and not destroyed yet: `destroy_cq` is EBUSY
    /// while there are any. Not the `Arc`'s count, which a poller or the lease watcher may
    /// hold for a moment after its QP is gone.
    pub qps: AtomicUsize,
}

impl CqState {
    /// Adds a completion; an overrun raises `IBV_EVENT_CQ_ERR` once.
    pub(crate) fn complete(&self, wc: Wc) {
        if let Err(Overrun) = self.cq.push(wc) {
            self.ctx.events.push(
                ibv_event_type::IBV_EVENT_CQ_ERR,
                Element::Cq(self.ibv.load(Ordering::Acquire)),
            );
        }
    }
}

/// 256 QP slots behind one TCP port, listened on at each address of the device.
#[derive(Debug)]
pub(crate) struct Pool {
    pub port: u16,
    listeners: Vec<TcpListener>,
    /// `None` free, `Some(Weak::new())` reserved, `Some(qp)` live.
    slots: Mutex<Vec<Option<Weak<Qp>>>>,
    stop: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    refused: Arc<AtomicU64>,
}

impl Pool {
    /// Binds the same TCP port on every address (retrying when another process holds it on one
    /// of them) and starts one accept thread per address.
    fn open(
        addrs: &[IpAddr],
        refused: Arc<AtomicU64>,
        spawner: &Threads,
    ) -> std::io::Result<Arc<Pool>> {
        let mut last_err = None;
        for _ in 0..16 {
            let first = match TcpListener::bind(SocketAddr::new(addrs[0], 0)) {
                Ok(l) => l,
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("soft: cannot listen on {}: {e}", addrs[0]),
                    ));
                }
            };
            let port = first.local_addr()?.port();
            let mut listeners = vec![first];
            let mut ok = true;
            for a in &addrs[1..] {
                match TcpListener::bind(SocketAddr::new(*a, port)) {
                    Ok(l) => listeners.push(l),
                    Err(e) => {
                        last_err = Some(e);
                        ok = false;
                        break;
                    }
                }
            }
            if !ok {
                continue;
            }
            let pool = Arc::new(Pool {
                port,
                listeners,
                slots: Mutex::new(vec![None; SLOTS]),
                stop: AtomicBool::new(false),
                threads: Mutex::new(Vec::new()),
                refused,
            });
            for i in 0..pool.listeners.len() {
                let p = Arc::clone(&pool);
                match spawner.spawn(format!("soft-accept-{port}"), move || p.accept_loop(i)) {
                    Ok(t) => pool
                        .threads
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(t),
                    Err(e) => {
                        pool.stop();
                        return Err(e);
                    }
                }
            }
            return Ok(pool);
        }
        Err(last_err.unwrap_or_else(|| std::io::ErrorKind::AddrInUse.into()))
    }

    fn qpn(&self, slot: usize) -> u32 {
        u32::from(self.port) << 8 | slot as u32
    }

    fn reserve(&self) -> Option<usize> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let i = slots.iter().position(Option::is_none)?;
        slots[i] = Some(Weak::new());
        Some(i)
    }

    /// Makes a reserved slot point at its QP.
    pub(crate) fn install(&self, qpn: u32, qp: &Arc<Qp>) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[(qpn & 0xff) as usize] = Some(Arc::downgrade(qp));
    }

    /// The live QP in `qpn`'s slot.
    fn qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[(qpn & 0xff) as usize].as_ref()?.upgrade()
    }

    pub(crate) fn release(&self, qpn: u32) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[(qpn & 0xff) as usize] = None;
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        for l in &self.listeners {
            // Wakes the blocked accept.
            let _ = socket2::SockRef::from(l).shutdown(std::net::Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }

    /// Accepts callers and reads their hellos, many at once (see the `hello` module).
    fn accept_loop(&self, index: usize) {
        let listener = &self.listeners[index];
        if let Err(e) = listener.set_nonblocking(true) {
            tracing::warn!(port = self.port, "soft: a QP port stops accepting: {e}");
            return;
        }
        let mut waiting = Pending::new(MAX_PENDING, HELLO_TIMEOUT);
        let mut warn = Throttle::new(WARN_INTERVAL);
        while !self.stop.load(Ordering::Acquire) {
            let fds: Vec<RawFd> = std::iter::once(listener.as_raw_fd())
                .chain(waiting.iter().map(Caller::fd))
                .collect();
            let sleep = waiting.next_deadline().map_or(IDLE_WAKE, |d| {
                d.saturating_duration_since(Instant::now()).min(IDLE_WAKE)
            });
            wire::wait_readable(&fds, sleep);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let now = Instant::now();
            for _ in 0..ACCEPT_BATCH {
                match listener.accept() {
                    Ok((stream, peer)) => match Caller::new(stream, peer) {
                        Ok(c) => self.admit(c, &mut waiting, &mut warn, now),
                        Err(_) => self.refuse(peer, "its socket failed", &mut warn, now),
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                }
            }
            for (c, heard) in waiting.settle(Caller::read) {
                self.answer(c, heard, &mut warn, now);
            }
            for c in waiting.expire(now) {
                self.answer(c, Err("no hello within the deadline"), &mut warn, now);
            }
        }
    }

    /// A new caller: answered at once when its hello is already there (a requester sends it
    /// right after connecting), else it waits, evicting the oldest waiter when all slots are
    /// taken.
    fn admit(
        &self,
        mut c: Caller,
        waiting: &mut Pending<Caller>,
        warn: &mut Throttle,
        now: Instant,
    ) {
        if let Some(heard) = c.read() {
            return self.answer(c, heard, warn, now);
        }
        if let Some(mut oldest) = waiting.admit(c, now) {
            // Its last chance: the bytes may have arrived since the last wake-up.
            let heard = oldest
                .read()
                .unwrap_or(Err("evicted without a hello by newer callers"));
            self.answer(oldest, heard, warn, now);
        }
    }

    /// Lets the QP named in the hello decide, answers, and counts strangers.
    fn answer(&self, c: Caller, heard: Heard, warn: &mut Throttle, now: Instant) {
        let (stream, peer) = c.into_stream();
        let verdict = match (heard, &stream) {
            (Ok(hello), Ok(stream)) => self.verdict(&hello, peer, stream),
            (Err(why), _) => Err(why),
            (Ok(_), Err(_)) => Err("its socket failed"),
        };
        let reply = match verdict {
            Ok(reply) => reply,
            Err(why) => {
                self.refuse(peer, why, warn, now);
                HelloReply::Refused
            }
        };
        if let Ok(mut stream) = stream {
            let _ = stream.write_all(&(reply as u32).to_le_bytes());
        }
    }

    /// What the QP named in `hello` says; `Err` says why the caller is a stranger.
    fn verdict(
        &self,
        hello: &[u8; HELLO_LEN],
        peer: SocketAddr,
        stream: &TcpStream,
    ) -> Result<HelloReply, &'static str> {
        let Some((src, dst, proof)) = wire::decode_hello(hello) else {
            return Err("not a hello");
        };
        if dst >> 8 != u32::from(self.port) {
            return Err("a hello for a QP of another port");
        }
        let qp = {
            let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots[(dst & 0xff) as usize]
                .as_ref()
                .and_then(Weak::upgrade)
        };
        match qp.map(|qp| qp.admit(src, proof, peer.ip(), stream)) {
            Some(HelloReply::Refused) | None => Err("a hello no QP in RTR expects"),
            Some(reply) => Ok(reply),
        }
    }

    /// Counts a stranger, with one WARN per interval.
    fn refuse(&self, peer: SocketAddr, why: &str, warn: &mut Throttle, now: Instant) {
        let all = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(held) = warn.hit(now) {
            tracing::warn!(
                %peer,
                "soft: QP port {} refused a connection ({why}); {held} more refused since the \
                 last such warning, {all} by this context in all",
                self.port
            );
        }
    }
}
