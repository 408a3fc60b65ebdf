//! The handshake listener (`listenComm`, `ncclIbAccept`): admits connections until one of them
//! presents the nonce of this listener's handle, and drops every other one.
//!
//! The listener's port is open to the whole network, so what connects is not necessarily the
//! rank NCCL paired us with: a port scanner, a rank of a previous job holding a stale handle,
//! garbage, a connection closed at once or left half-open. None of them may fail `accept` (that
//! would abort the communicator) or stall it: each call accepts what is waiting, advances every
//! unproven connection without blocking (at most [`MAX_PENDING`], each for at most
//! [`HELLO_DEADLINE`], the oldest evicted when full — rules in
//! [`ncclwasm_admission`]), and drops the ones that fail with a rate-limited WARN. A
//! connection that presented the nonce is the real peer: its handshake runs to the end, and its
//! failure is `accept`'s.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Instant;

use crate::device::PortCtx;
use crate::net_error::NetError;
use crate::profile::Profiler;
use crate::recv::{Accepting, RecvComm};
use crate::socket::Stream;
use crate::telemetry::MeterSpec;
use ncclwasm_admission::{HELLO_DEADLINE, MAX_PENDING, Pending, Throttle, WARN_INTERVAL};
use ncclwasm_proto::handshake::{Acceptor, AcceptorConfig};

/// Connections taken from the kernel's queue per `accept` call, so a flood cannot keep one call
/// from returning (NCCL calls again at once).
const ACCEPT_BATCH: usize = 256;

/// A listening endpoint (`listenComm`). It owns only the TCP listener and the handshakes in
/// progress; the receive communicator it returns owns everything else, so NCCL may close the
/// listener right after `accept` succeeds.
#[derive(Debug)]
pub struct Listener {
    listener: TcpListener,
    /// Where it listens (in WARNs).
    addr: SocketAddr,
    config: AcceptorConfig,
    ports: Vec<PortCtx>,
    /// Whether connections accepted here flush GPU receives: the listening device's decision
    /// (its first port's device, as net_ib asks `ncclIbDmaBufSupport(lComm->dev)`).
    flush: bool,
    /// Connections that have not presented the nonce yet.
    unproven: Pending<Accepting>,
    /// Connections that did: their handshakes, oldest first.
    peers: Vec<Accepting>,
    /// A proven peer's handshake failed while its hello was read: `accept`'s error.
    peer_failed: Option<NetError>,
    dropped: u64,
    warn: Throttle,
    /// Who the accepted sides are in the telemetry.
    meter: MeterSpec,
    /// NCCL's profiler, for the accepted communicators.
    profiler: Option<Arc<dyn Profiler>>,
}

impl Listener {
    /// The NCCL device it listens for.
    pub fn device(&self) -> i64 {
        i64::from(self.meter.device)
    }

    pub(crate) fn new(
        listener: TcpListener,
        addr: SocketAddr,
        config: AcceptorConfig,
        ports: Vec<PortCtx>,
        meter: MeterSpec,
        profiler: Option<Arc<dyn Profiler>>,
    ) -> Self {
        let flush = ports.first().is_some_and(|p| p.dev.gpu.flush.value);
        Listener {
            listener,
            addr,
            config,
            ports,
            flush,
            unproven: Pending::new(MAX_PENDING, HELLO_DEADLINE),
            peers: Vec::new(),
            peer_failed: None,
            dropped: 0,
            warn: Throttle::new(WARN_INTERVAL),
            meter,
            profiler,
        }
    }

    /// `accept`: `Ok(None)` until a connector that knows this listener's nonce has completed
    /// the handshake (NCCL calls again). Strangers are dropped, never returned as errors.
    pub fn accept(&mut self) -> Result<Option<RecvComm>, NetError> {
        let now = Instant::now();
        for _ in 0..ACCEPT_BATCH {
            let Some(stream) = Stream::accept(&self.listener)? else {
                break;
            };
            let machine = Acceptor::new(self.config.clone())
                .map_err(NetError::protocol("accepting a connection"))?;
            self.admit(
                Accepting::new(
                    machine,
                    stream,
                    self.ports.clone(),
                    self.flush,
                    self.meter.clone(),
                    self.profiler.clone(),
                ),
                now,
            );
        }
        for (a, heard) in self.unproven.settle(|a| match a.pump_hello() {
            Ok(false) => None,
            heard => Some(heard),
        }) {
            self.sort(a, heard, now);
        }
        for a in self.unproven.expire(now) {
            self.drop_stranger(&a, &"no hello within the handshake deadline", now);
        }
        if let Some(e) = self.peer_failed.take() {
            return Err(e);
        }
        self.progress_peers()
    }

    /// Connections dropped as strangers since `listen` (tests and diagnostics).
    pub fn strangers_dropped(&self) -> u64 {
        self.dropped
    }

    /// Takes a freshly accepted connection in. It is read at once: a real connector sends its
    /// hello right after connecting, so it usually proves itself before occupying a slot.
    fn admit(&mut self, mut a: Accepting, now: Instant) {
        let heard = a.pump_hello();
        let Some(a) = self.sort(a, heard, now) else {
            return;
        };
        if let Some(mut oldest) = self.unproven.admit(a, now) {
            // Its last chance: the bytes may have arrived since the previous call.
            let heard = oldest.pump_hello();
            if let Some(oldest) = self.sort(oldest, heard, now) {
                let why = format!("evicted without a hello by {MAX_PENDING} newer connections");
                self.drop_stranger(&oldest, &why, now);
            }
        }
    }

    /// Files a connection by what reading it showed: a proven peer goes on with its handshake,
    /// a failed stranger is dropped, a proven peer's failure is kept for `accept` to return;
    /// one still waiting for its hello comes back.
    fn sort(
        &mut self,
        a: Accepting,
        heard: Result<bool, NetError>,
        now: Instant,
    ) -> Option<Accepting> {
        match heard {
            Ok(false) => return Some(a),
            Ok(true) => self.peers.push(a),
            Err(e) if a.proven() => {
                self.peer_failed.get_or_insert(e);
            }
            Err(e) => self.drop_stranger(&a, &e, now),
        }
        None
    }

    /// Advances the real peers' handshakes; the first established one is the communicator.
    fn progress_peers(&mut self) -> Result<Option<RecvComm>, NetError> {
        for i in 0..self.peers.len() {
            match self.peers[i].progress() {
                Ok(None) => {}
                Ok(Some(comm)) => {
                    self.peers.remove(i);
                    return Ok(Some(comm));
                }
                Err(e) => {
                    self.peers.remove(i);
                    return Err(e);
                }
            }
        }
        Ok(None)
    }

    fn drop_stranger(&mut self, a: &Accepting, why: &dyn std::fmt::Display, now: Instant) {
        self.dropped += 1;
        if let Some(held) = self.warn.hit(now) {
            tracing::warn!(
                "NET/WASM: handshake listener {}: dropped a connection from {} that is not the \
                 expected peer ({why}); {held} more dropped since the last such warning, {} in \
                 all",
                self.addr,
                a.peer(),
                self.dropped
            );
        }
    }
}
