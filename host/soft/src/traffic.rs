//! Per-port traffic counters: the payload bytes each local port sent to and received from each
//! peer address, like a NIC's port counters (`port_xmit_data`, `port_rcv_data`) split by the
//! peer they went to.
//!
//! Why by peer: whether a connection stays on its rail is a property of the pair (local port,
//! peer port) that carried it — a byte crossed rails when the local port's subnet differs from
//! the peer address's subnet. A policy's plan says which pairs it *meant* to use; these counters
//! say which pairs the bytes *took*, so a test can judge the plan by what happened on the wire.
//!
//! Counted: RDMA payload — WRITE / WRITE_WITH_IMM / SEND data on the requester (sent) and the
//! responder (received), READ response data on the responder (sent) and the requester
//! (received). Not counted: frame headers, ACKs, connection hellos. A payload counts once it is
//! wholly on the socket (sent) or wholly placed in memory (received).
//!
//! Cost: a connection looks its counter up once, when it is made (one lock, one allocation for
//! a new key); each message is then one relaxed atomic add. Counters live as long as the
//! process (per loaded copy of this crate, like the rest of the provider's state) and never
//! reset, so a reader takes differences when it wants an interval.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The bytes one local port exchanged with one peer address, as [`traffic`] reports them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortTraffic {
    /// The local device (`mlx5_0`).
    pub device: String,
    /// The local port number (1-based, as in the topology file).
    pub port: u8,
    /// The local port's address (the topology's `address`).
    pub local: IpAddr,
    /// The address of the peer port at the other end.
    pub peer: IpAddr,
    /// Payload bytes this port sent to `peer`.
    pub sent: u64,
    /// Payload bytes this port received from `peer`.
    pub received: u64,
}

/// One key's live counters, shared by every connection on that (device, port, peer).
#[derive(Debug)]
pub(crate) struct Counter {
    device: String,
    port: u8,
    local: IpAddr,
    peer: IpAddr,
    sent: AtomicU64,
    received: AtomicU64,
}

impl Counter {
    pub(crate) fn sent(&self, bytes: u32) {
        self.sent.fetch_add(u64::from(bytes), Ordering::Relaxed);
    }

    pub(crate) fn received(&self, bytes: u32) {
        self.received.fetch_add(u64::from(bytes), Ordering::Relaxed);
    }
}

/// Every key seen so far; few (ports × peers), searched only when a connection is made.
static COUNTERS: Mutex<Vec<Arc<Counter>>> = Mutex::new(Vec::new());

/// The counter of (`device`, `port`, `peer`), created on first use. Addresses are canonical
/// (an IPv4-mapped IPv6 peer is its IPv4 address), so one peer is one key.
pub(crate) fn counter(device: &str, port: u8, local: IpAddr, peer: IpAddr) -> Arc<Counter> {
    let (local, peer) = (local.to_canonical(), peer.to_canonical());
    let mut all = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = all
        .iter()
        .find(|c| c.device == device && c.port == port && c.peer == peer)
    {
        return Arc::clone(c);
    }
    let c = Arc::new(Counter {
        device: device.to_owned(),
        port,
        local,
        peer,
        sent: AtomicU64::new(0),
        received: AtomicU64::new(0),
    });
    all.push(Arc::clone(&c));
    c
}

/// What every local port of this process has sent to and received from each peer address so
/// far, one entry per (device, port, peer) that ever had a connection, in the order they first
/// did. Counts only this copy of the provider (the in-process [`fabric`](crate::fabric), not a
/// separately loaded `libibverbs.so.1` build of it).
pub fn traffic() -> Vec<PortTraffic> {
    COUNTERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|c| PortTraffic {
            device: c.device.clone(),
            port: c.port,
            local: c.local,
            peer: c.peer,
            sent: c.sent.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One key per (device, port, peer), whatever form the peer's address came in; adds land
    /// on the key's entry only.
    #[test]
    fn one_entry_per_port_and_peer() {
        let local: IpAddr = "10.9.0.1".parse().unwrap();
        let peer: IpAddr = "10.9.0.2".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.9.0.2".parse().unwrap();
        let a = counter("traffic-test", 1, local, peer);
        let b = counter("traffic-test", 1, local, mapped);
        let other = counter("traffic-test", 2, local, peer);
        assert!(Arc::ptr_eq(&a, &b));
        a.sent(5);
        b.sent(7);
        b.received(3);
        other.received(1);
        let mine: Vec<PortTraffic> = traffic()
            .into_iter()
            .filter(|t| t.device == "traffic-test")
            .collect();
        assert_eq!(
            mine,
            [
                PortTraffic {
                    device: "traffic-test".into(),
                    port: 1,
                    local,
                    peer,
                    sent: 12,
                    received: 3,
                },
                PortTraffic {
                    device: "traffic-test".into(),
                    port: 2,
                    local,
                    peer,
                    sent: 0,
                    received: 1,
                },
            ]
        );
    }
}
