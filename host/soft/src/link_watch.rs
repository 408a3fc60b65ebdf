//! Ports whose link follows their network interface, as a NIC reports its link.
//!
//! A soft port is bound to an IP address; the interface holding that address is the port's
//! "cable". When that interface's link goes down (`ip link set veth0 down`, or its veth peer
//! going down: operstate `lowerlayerdown`) the port goes DOWN and every context of the device
//! gets `IBV_EVENT_PORT_ERR`; when it comes back, ACTIVE and `IBV_EVENT_PORT_ACTIVE`. When the
//! interface gains or loses an address of the port's GID table (its bind address, or the IP of
//! a RoCE GID), `IBV_EVENT_GID_CHANGE`. A link already down when the device is opened makes the
//! port DOWN without an event, as a NIC reports it from the start.
//!
//! One thread per loaded copy of the provider, the *watcher*, runs while a context of a watched
//! device (below) is open: started by the first such `open_device`, stopped and joined by the
//! last such `close_device`, so nothing runs once the last context is closed. It sleeps on a netlink socket subscribed to
//! link and address changes (`RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR`) and,
//! woken, reads the interfaces once (the `ifaces` module) and compares; it never parses
//! netlink messages, so a lost message (`ENOBUFS`) costs nothing but the same re-read. The
//! socket, made by the thread that opens the first context, belongs to that thread's network
//! namespace, as does the interface list the watcher reads.
//!
//! A loopback address has no cable: a device whose ports are all bound to loopback (the
//! embedded default machine, and most tests) is not watched, so opening and closing it costs
//! nothing more and starts no thread. A device with one port elsewhere is watched whole; its
//! loopback ports simply stay up (`lo` reports operstate `unknown`, which counts as up).
//!
//! Only the port state and the events follow the link: QPs on a port whose link went down are
//! not failed at once but, as on a NIC, by their retry timer (`timeout`, `retry_cnt`), since
//! nothing they send arrives.

use std::io;
use std::io::{PipeReader, PipeWriter};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use ibverbs_sys::ibv_event_type;
use ncclwasm_model::PortState;
use ncclwasm_model::topology::DevicePort;

use super::event::Element;
use super::fabric::SoftDevice;
use super::ifaces::Interfaces;
use crate::abi::sys;

/// Netlink datagrams read per wake-up at most; more pending wake the next `poll` at once, so
/// a flood of changes elsewhere on the host cannot keep the watcher in one loop.
const READS_PER_WAKE: usize = 64;

/// What was last seen of one port's link. Kept on the device (`SoftDevice::links`), so a device
/// closed and opened again compares with what it saw before.
#[derive(Debug, Default)]
pub(crate) struct PortLink {
    /// The interface that held the port's address when last seen; kept when the address goes
    /// away, so that interface's link is still followed.
    iface: Option<String>,
    /// Whether that interface's link was up; `None` before the interface was found.
    up: Option<bool>,
    /// The port's GID addresses the interface held; `None` before the first look.
    gids: Option<Vec<IpAddr>>,
}

/// The devices with open contexts (and how many each) and the watcher following them.
struct Watch {
    devices: Vec<(&'static SoftDevice, usize)>,
    watcher: Option<Watcher>,
}

static WATCH: Mutex<Watch> = Mutex::new(Watch {
    devices: Vec::new(),
    watcher: None,
});

fn watch() -> MutexGuard<'static, Watch> {
    WATCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// A context of `dev` is being opened (before it can receive events): follow its ports,
/// starting the watcher if none runs. The first context of a device takes the link's state as
/// it is now, without events.
pub(crate) fn attach(dev: &'static SoftDevice) {
    if !has_cable(dev) {
        return;
    }
    let mut w = watch();
    if let Some(entry) = w.devices.iter_mut().find(|(d, _)| std::ptr::eq(*d, dev)) {
        entry.1 += 1;
        return;
    }
    w.devices.push((dev, 1));
    if w.watcher.is_none() {
        w.watcher = Watcher::start();
    }
    if w.watcher.is_some()
        && let Ok(now) = Interfaces::read()
    {
        follow(dev, &now);
    }
}

/// A context of `dev` was closed: the last one of the last device stops the watcher and waits
/// for it to end.
pub(crate) fn detach(dev: &'static SoftDevice) {
    if !has_cable(dev) {
        return;
    }
    let mut w = watch();
    if let Some(i) = w.devices.iter().position(|(d, _)| std::ptr::eq(*d, dev)) {
        w.devices[i].1 -= 1;
        if w.devices[i].1 == 0 {
            w.devices.swap_remove(i);
        }
    }
    let stopping = if w.devices.is_empty() {
        w.watcher.take()
    } else {
        None
    };
    // The watcher takes the lock to compare; it must be free while we wait for it.
    drop(w);
    if let Some(watcher) = stopping {
        watcher.stop();
    }
}

/// Whether `dev` has a port bound to an address that is not loopback: one worth watching.
fn has_cable(dev: &SoftDevice) -> bool {
    dev.desc
        .ports
        .iter()
        .any(|p| !p.address.to_canonical().is_loopback())
}

/// The watcher thread and the pipe whose closing tells it to end.
struct Watcher {
    stop: PipeWriter,
    thread: JoinHandle<()>,
}

impl Watcher {
    /// Subscribes to link and address changes and starts the thread; `None` (and link state
    /// left as it is) where netlink or threads are unavailable.
    fn start() -> Option<Watcher> {
        let started = subscribe().and_then(|netlink| {
            let (wake, stop) = std::io::pipe()?;
            let thread = std::thread::Builder::new()
                .name("soft-link-watch".to_owned())
                .spawn(move || run(&netlink, &wake))?;
            Ok(Watcher { stop, thread })
        });
        started
            .inspect_err(|e| tracing::debug!("soft: ports do not follow their interfaces: {e}"))
            .ok()
    }

    fn stop(self) {
        // Closing the write end makes the read end readable (end of file).
        drop(self.stop);
        let _ = self.thread.join();
    }
}

/// A netlink socket that hears of every link and address change in this network namespace.
fn subscribe() -> io::Result<OwnedFd> {
    sys::netlink_route(
        (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32,
    )
}

/// The watcher: sleeps until netlink says something changed (or `wake` ends), then compares.
fn run(netlink: &OwnedFd, wake: &PipeReader) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let mut fds = [netlink.as_raw_fd(), wake.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        if let Err(e) = sys::poll(&mut fds, -1) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::warn!("soft: ports stop following their interfaces: poll: {e}");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if heard(netlink, &mut buf) {
            let w = watch();
            if let Ok(now) = Interfaces::read() {
                for (dev, _) in &w.devices {
                    follow(dev, &now);
                }
            }
        }
    }
}

/// Reads what the kernel sent, at most [`READS_PER_WAKE`] datagrams: whether anything came
/// (a lost message, `ENOBUFS`, counts: something changed).
fn heard(netlink: &OwnedFd, buf: &mut [u8]) -> bool {
    let mut any = false;
    for _ in 0..READS_PER_WAKE {
        match sys::recv_nowait(netlink, buf) {
            Ok(0) => break,
            Ok(_) => any = true,
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::ENOBUFS) => any = true,
                _ => break,
            },
        }
    }
    any
}

/// Compares `dev`'s ports with the interfaces `now`, changing port states and raising events
/// where they differ from what was last seen.
fn follow(dev: &SoftDevice, now: &Interfaces) {
    let mut links = dev.links.lock().unwrap_or_else(|e| e.into_inner());
    for (port, seen) in dev.desc.ports.iter().zip(links.iter_mut()) {
        if let Some(name) = now.holder(port.address) {
            seen.iface = Some(name.to_owned());
        }
        let iface = seen.iface.as_deref();
        // Before any interface held the port's address, it holds none of its GIDs: an address
        // configured after the open is a change too.
        let held: Vec<IpAddr> = match iface {
            Some(_) => gid_addresses(port)
                .into_iter()
                .filter(|a| now.holder(*a) == iface)
                .collect(),
            None => Vec::new(),
        };
        if seen.gids.as_ref().is_some_and(|before| *before != held) {
            dev.each_context(|c| {
                c.events.push(
                    ibv_event_type::IBV_EVENT_GID_CHANGE,
                    Element::Port(port.port),
                );
            });
        }
        seen.gids = Some(held);
        let Some(iface) = iface else {
            continue;
        };
        let up = now.is_up(iface);
        let was = seen.up.replace(up);
        // A link first seen up changes nothing: the port keeps the state its topology gives.
        if was != Some(up) && (was.is_some() || !up) {
            link_changed(dev, port.port, up, iface);
        }
    }
}

/// Port `port` of `dev` follows its interface's link: a state that changes is logged and
/// raised on every context of the device.
fn link_changed(dev: &SoftDevice, port: u8, up: bool, iface: &str) {
    let (state, event, what) = match up {
        true => (
            PortState::Active,
            ibv_event_type::IBV_EVENT_PORT_ACTIVE,
            "up",
        ),
        false => (PortState::Down, ibv_event_type::IBV_EVENT_PORT_ERR, "down"),
    };
    if dev.set_port_state(port, state) {
        tracing::info!(
            "soft: {} port {port} is {what}: the link of {iface}, which holds its address, is {what}",
            dev.desc.name
        );
        dev.each_context(|c| c.events.push(event, Element::Port(port)));
    }
}

/// The addresses a port's GID table stands for: its bind address and the IP of every
/// configured GID (an IPv4-mapped GID is its IPv4 address), each once.
fn gid_addresses(port: &DevicePort) -> Vec<IpAddr> {
    let mut out = vec![port.address.to_canonical()];
    for g in port.gids.iter().filter(|g| !g.is_unconfigured()) {
        let a = IpAddr::V6(g.addr()).to_canonical();
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ibverbs_sys::{ibv_context, ibv_event_type, ibv_port_state};
    use ncclwasm_model::Topology;
    use ncclwasm_testkit::netns::ip;
    use ncclwasm_testkit::{child, netns};

    use super::watch;
    use crate::tests::{close, next_event, open_private_on, query_port_state};

    /// How long an event may take: a bound for a hang, never a measurement.
    const WAIT: Duration = Duration::from_secs(10);
    /// Names, in the child, the namespace of the veth's other end.
    const PEER_NS: &str = "NCCLWASM_LINK_WATCH_PEER_NS";

    /// One RoCE device whose port 1 is bound to `addr` (its GIDs derived from it).
    fn topology(addr: &str) -> Topology {
        let text = format!(
            "name = \"link-watch\"\n[[devices]]\nname = \"soft_0\"\nguid = \"0x02005e00000000b0\"\n\
             [[devices.ports]]\nport = 1\nlink-layer = \"ethernet\"\nspeed-mbps = 100000\n\
             address = \"{addr}\"\n"
        );
        Topology::parse(&text, "link-watch").expect("a valid topology")
    }

    fn port_state(ctx: *mut ibv_context) -> ibv_port_state::Type {
        query_port_state(ctx, 1)
    }

    /// Threads of this process named as the watcher is.
    fn watchers() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter(|t| {
                t.as_ref().is_ok_and(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end() == "soft-link-watch")
                })
            })
            .count()
    }

    /// Issue 19, point 6: a port bound to a veth's address follows that veth as a NIC's port
    /// follows its cable — its own link, its peer's (operstate `lowerlayerdown`), and its
    /// addresses — in a network namespace of its own, a child process in it.
    #[test]
    fn a_port_follows_the_link_and_addresses_of_its_veth() {
        const TEST: &str = "link_watch::tests::a_port_follows_the_link_and_addresses_of_its_veth";
        if !child::enter(TEST) {
            if let Some(why) = netns::unavailable() {
                ncclwasm_testkit::skip(why);
                return;
            }
            let hosts = netns::Hosts::new(2);
            hosts.link(0, ("rail0", "192.0.2.1/24"), 1, ("rail1", "192.0.2.2/24"));
            let mut cmd = child::command_via(hosts.exec(0), TEST);
            cmd.env(PEER_NS, hosts.name(1));
            child::run(cmd, TEST);
            return;
        }
        let peer = std::env::var(PEER_NS).expect("the peer's namespace");
        let ctx = open_private_on(topology("192.0.2.1"));
        let expect = |event: ibv_event_type, after: &str| {
            assert_eq!(next_event(ctx, WAIT), Some((event, 1)), "after {after}");
        };
        use ibv_event_type::{IBV_EVENT_GID_CHANGE, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR};
        use ibv_port_state::{IBV_PORT_ACTIVE, IBV_PORT_DOWN};
        assert_eq!(port_state(ctx), IBV_PORT_ACTIVE);
        assert_eq!(
            next_event(ctx, Duration::ZERO),
            None,
            "an up link is no event"
        );

        ip(&["link", "set", "rail0", "down"]);
        expect(IBV_EVENT_PORT_ERR, "rail0 went down");
        assert_eq!(port_state(ctx), IBV_PORT_DOWN);
        ip(&["link", "set", "rail0", "up"]);
        expect(IBV_EVENT_PORT_ACTIVE, "rail0 came up");
        assert_eq!(port_state(ctx), IBV_PORT_ACTIVE);

        ip(&["-n", &peer, "link", "set", "rail1", "down"]);
        expect(IBV_EVENT_PORT_ERR, "the peer went down (lowerlayerdown)");
        assert_eq!(port_state(ctx), IBV_PORT_DOWN);
        ip(&["-n", &peer, "link", "set", "rail1", "up"]);
        expect(IBV_EVENT_PORT_ACTIVE, "the peer came up");
        assert_eq!(port_state(ctx), IBV_PORT_ACTIVE);

        ip(&["addr", "del", "192.0.2.1/24", "dev", "rail0"]);
        expect(IBV_EVENT_GID_CHANGE, "the port's address was removed");
        assert_eq!(port_state(ctx), IBV_PORT_ACTIVE, "the link is still up");
        ip(&["addr", "add", "192.0.2.1/24", "dev", "rail0"]);
        expect(IBV_EVENT_GID_CHANGE, "the port's address came back");

        // A device whose address is configured only after it was opened, and lands on a link
        // that is down.
        ip(&["link", "set", "rail0", "down"]);
        expect(IBV_EVENT_PORT_ERR, "rail0 went down again");
        let late = open_private_on(topology("192.0.2.3"));
        assert_eq!(
            port_state(late),
            IBV_PORT_ACTIVE,
            "no interface holds its address"
        );
        ip(&["addr", "add", "192.0.2.3/24", "dev", "rail0"]);
        let expect_late = |event: ibv_event_type, after: &str| {
            assert_eq!(next_event(late, WAIT), Some((event, 1)), "after {after}");
        };
        expect_late(IBV_EVENT_GID_CHANGE, "its address was configured");
        expect_late(
            IBV_EVENT_PORT_ERR,
            "its address landed on a link that is down",
        );
        assert_eq!(port_state(late), IBV_PORT_DOWN);
        ip(&["link", "set", "rail0", "up"]);
        expect(IBV_EVENT_PORT_ACTIVE, "rail0 came up again");
        expect_late(IBV_EVENT_PORT_ACTIVE, "rail0 came up again");
        assert_eq!(port_state(late), IBV_PORT_ACTIVE);
        for c in [ctx, late] {
            assert_eq!(next_event(c, Duration::ZERO), None, "one event per change");
            close(c);
        }
    }

    /// The watcher runs from the first open context of a watched device to the last close; a
    /// loopback-only device starts nothing and raises nothing. In a child, so no other test's
    /// contexts are open; the watched device's address (TEST-NET-1) is on no interface here,
    /// so it has no link to follow and nothing is sent anywhere.
    #[test]
    fn the_watcher_lives_while_a_watched_context_is_open() {
        const TEST: &str = "link_watch::tests::the_watcher_lives_while_a_watched_context_is_open";
        if !child::enter(TEST) {
            child::run(child::command(TEST), TEST);
            return;
        }
        let running = || watch().watcher.is_some();
        // The thread names itself once it runs, and leaves the task list a moment after its
        // join returns: waited for, both.
        let watchers_are = |n: usize, what: &str| {
            ncclwasm_testkit::wait_until(what, WAIT, || watchers() == n);
        };
        let lo = open_private_on(Topology::loopback());
        assert!(!running(), "loopback has no cable to watch");
        assert_eq!(port_state(lo), ibv_port_state::IBV_PORT_ACTIVE);
        assert_eq!(next_event(lo, Duration::ZERO), None);

        let a = open_private_on(topology("192.0.2.99"));
        assert!(running(), "started by the first watched context");
        watchers_are(1, "the watcher runs");
        let b = open_private_on(topology("192.0.2.99"));
        close(a);
        assert!(running(), "a context is still open");
        assert_eq!(port_state(b), ibv_port_state::IBV_PORT_ACTIVE);
        assert_eq!(next_event(b, Duration::ZERO), None);
        close(b);
        assert!(!running(), "stopped with the last watched context");
        watchers_are(0, "the watcher ended");
        close(lo);
    }
}
