//! The network interfaces of this host (its network namespace), read once with `getifaddrs`:
//! which interface holds an address, and whether an interface's link is up. What a RoCE GID's
//! netdev is (the `sysfs` module) and what a port's link is (the `link_watch` module) come
//! from here.

use std::io;
use std::net::IpAddr;

use crate::abi::sys;

/// One reading of the interfaces and their addresses.
#[derive(Debug, Default)]
pub(crate) struct Interfaces {
    /// Each configured address with the interface holding it.
    addresses: Vec<(IpAddr, String)>,
    /// Each interface with whether its link is up.
    links: Vec<(String, bool)>,
}

impl Interfaces {
    /// Reads them now. `getifaddrs` asks the kernel over netlink, so the answer is the calling
    /// thread's network namespace (unlike `/sys/class/net`, which is the mounter's).
    pub(crate) fn read() -> io::Result<Interfaces> {
        let mut out = Interfaces::default();
        sys::each_interface_address(|name, flags, addr| {
            if !out.links.iter().any(|(n, _)| *n == name) {
                out.links.push((name.clone(), link_up(flags)));
            }
            if let Some(addr) = addr {
                out.addresses.push((addr, name));
            }
        })?;
        Ok(out)
    }

    /// The interface that holds `addr`, if any does.
    pub(crate) fn holder(&self, addr: IpAddr) -> Option<&str> {
        let addr = addr.to_canonical();
        self.addresses
            .iter()
            .find(|(a, _)| *a == addr)
            .map(|(_, n)| n.as_str())
    }

    /// Whether interface `name` exists and its link is up.
    pub(crate) fn is_up(&self, name: &str) -> bool {
        self.links.iter().any(|(n, up)| n == name && *up)
    }
}

/// `IFF_RUNNING`, which the kernel sets for an interface that is administratively up and whose
/// operstate is `up` or `unknown` (loopback, and drivers that report no carrier): exactly "up"
/// in the sense of `/sys/class/net/<if>/operstate`. A veth whose peer is down reads
/// `lowerlayerdown` there and has no `IFF_RUNNING`.
fn link_up(flags: libc::c_uint) -> bool {
    flags & libc::IFF_RUNNING as libc::c_uint != 0
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn loopback_holds_its_address_and_counts_as_up() {
        let now = Interfaces::read().expect("getifaddrs");
        let lo = now.holder(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(lo, Some("lo"));
        // `lo` reports operstate `unknown`: up, as long as it is administratively up, which
        // the loopback topology needs anyway.
        assert!(now.is_up("lo"));
        assert!(!now.is_up("no-such-interface"));
        assert_eq!(now.holder("192.0.2.77".parse().expect("ip")), None);
    }
}
