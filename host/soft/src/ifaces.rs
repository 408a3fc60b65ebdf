//! The network interfaces of this host (its network namespace), read once with `getifaddrs`:
//! which interface holds an address, and whether an interface's link is up. What a RoCE GID's
//! netdev is (the `sysfs` module) and what a port's link is (the `link_watch` module) come
//! from here.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        // SAFETY: getifaddrs fills `head` with a list we free below.
        if unsafe { libc::getifaddrs(&mut head) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut out = Interfaces::default();
        let mut cur = head;
        while !cur.is_null() {
            // SAFETY: `cur` is a node of the list getifaddrs returned.
            let ifa = unsafe { &*cur };
            cur = ifa.ifa_next;
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned();
            if !out.links.iter().any(|(n, _)| *n == name) {
                out.links.push((name.clone(), link_up(ifa.ifa_flags)));
            }
            // SAFETY: a non-NULL ifa_addr is a sockaddr of the family it names.
            if let Some(addr) = unsafe { ip_of(ifa.ifa_addr) } {
                out.addresses.push((addr, name));
            }
        }
        // SAFETY: `head` came from getifaddrs.
        unsafe { libc::freeifaddrs(head) };
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

/// The IP address in `sa`, for IPv4 and IPv6 sockaddrs.
///
/// # Safety
/// `sa` is NULL or points at a sockaddr as large as its family says.
unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: per the function contract; the family says which sockaddr it is.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
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
