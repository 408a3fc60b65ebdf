//! IP subnets over GIDs: "is this GID on 10.1.0.0/16", "are these two GIDs on one subnet".
//! RoCE GIDs of IPv4 interfaces are IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`); IB GIDs are a
//! 64-bit subnet prefix plus a port GUID. Working on the 16 raw bytes covers all three.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::{AddrFamily, Gid};

/// The first 96 bits of an IPv4-mapped IPv6 address.
const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// A network prefix over 128-bit GIDs (bits past `len` are zero). Ordered by prefix bytes,
/// then length, so every node ranks the same subnets the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Subnet {
    prefix: [u8; 16],
    len: u8,
}

impl Subnet {
    /// The prefix of `addr` of `len` bits; `None` when `len` > 128.
    pub fn new(addr: [u8; 16], len: u8) -> Option<Self> {
        if len > 128 {
            return None;
        }
        let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
        let prefix = (u128::from_be_bytes(addr) & mask).to_be_bytes();
        Some(Subnet { prefix, len })
    }

    /// The subnet a GID sits in, from its `prefix_len`; `None` when the host does not know it
    /// (prefix length 0), so two GIDs of unknown subnets never count as neighbours.
    ///
    /// The prefix length of an IPv4-mapped GID counts bits of the IPv4 address (`/24`, as the
    /// interface is configured), that of any other GID bits of the 128-bit GID.
    pub fn of(gid: &Gid) -> Option<Self> {
        let len = match (gid.prefix_len, gid.family()) {
            (0, _) => return None,
            (len, AddrFamily::Ipv4) => len.checked_add(96)?,
            (len, AddrFamily::Ipv6) => len,
        };
        Subnet::new(gid.raw, len)
    }

    /// Whether the GID's address starts with this prefix.
    pub fn contains(&self, gid: &Gid) -> bool {
        Subnet::new(gid.raw, self.len) == Some(*self)
    }

    /// Prefix length in bits, over the 128-bit GID.
    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    fn is_v4(&self) -> bool {
        self.len >= 96 && self.prefix[..12] == V4_MAPPED
    }
}

/// `a.b.c.d/n` for IPv4-mapped subnets, `x:y::/n` otherwise.
impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_v4() {
            let [a, b, c, d] = self.prefix[12..] else {
                unreachable!("4 bytes")
            };
            write!(f, "{}/{}", Ipv4Addr::new(a, b, c, d), self.len - 96)
        } else {
            write!(f, "{}/{}", Ipv6Addr::from(self.prefix), self.len)
        }
    }
}

/// Parses `10.1.0.0/16` (matched against IPv4-mapped GIDs) or `fd00:1::/64`.
impl FromStr for Subnet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || format!("`{s}` is not a subnet like 10.1.0.0/16 or fd00::/64");
        let (addr, len) = s.trim().split_once('/').ok_or_else(usage)?;
        let len: u8 = len.parse().map_err(|_| usage())?;
        let (raw, len) = if let Ok(v4) = addr.parse::<Ipv4Addr>() {
            if len > 32 {
                return Err(usage());
            }
            (v4.to_ipv6_mapped().octets(), len + 96)
        } else {
            let v6: Ipv6Addr = addr.parse().map_err(|_| usage())?;
            (v6.octets(), len)
        };
        Subnet::new(raw, len).ok_or_else(usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GidType;

    fn gid(addr: &str, prefix_len: u8) -> Gid {
        let raw = match addr.parse::<Ipv4Addr>() {
            Ok(v4) => v4.to_ipv6_mapped().octets(),
            Err(_) => addr.parse::<Ipv6Addr>().unwrap().octets(),
        };
        Gid {
            index: 0,
            raw,
            gid_type: GidType::RoceV2,
            prefix_len,
        }
    }

    #[test]
    fn ipv4_subnets_parse_match_and_print() {
        let s: Subnet = "10.1.0.0/16".parse().unwrap();
        assert_eq!(s.prefix_len(), 112);
        assert!(s.contains(&gid("10.1.200.7", 0)));
        assert!(!s.contains(&gid("10.2.0.7", 16)));
        assert!(!s.contains(&gid("fe80::1", 64)));
        assert_eq!(s.to_string(), "10.1.0.0/16");
        // Host bits in the text are dropped, as `ip route` does.
        assert_eq!("10.1.2.3/16".parse::<Subnet>().unwrap(), s);
    }

    #[test]
    fn ib_gids_compare_the_64_bit_subnet_prefix() {
        let a = Subnet::of(&gid("fe80::1:2:3:4", 64)).unwrap();
        let b = Subnet::of(&gid("fe80::9:9:9:9", 64)).unwrap();
        let c = Subnet::of(&gid("fec0::1:2:3:4", 64)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.to_string(), "fe80::/64");
    }

    #[test]
    fn gid_subnet_uses_its_prefix_len() {
        let a = Subnet::of(&gid("10.0.0.1", 24)).unwrap();
        assert_eq!(a.to_string(), "10.0.0.0/24");
        assert_eq!(Some(a), Subnet::of(&gid("10.0.0.200", 24)));
        assert_ne!(Some(a), Subnet::of(&gid("10.0.1.1", 24)));
        assert_ne!(Some(a), Subnet::of(&gid("10.0.0.1", 16)));
        assert_eq!(Subnet::of(&gid("10.0.0.1", 0)), None);
        let v6 = Subnet::of(&gid("fd00:0:0:1::21", 64)).unwrap();
        assert_eq!(v6.to_string(), "fd00:0:0:1::/64");
    }

    #[test]
    fn refuses_malformed_subnets() {
        for bad in [
            "10.1.0.0",
            "10.1.0.0/33",
            "10.1.0/16",
            "fd00::/129",
            "x/8",
            "10.0.0.0/-1",
        ] {
            assert!(bad.parse::<Subnet>().is_err(), "{bad}");
        }
        assert_eq!(Subnet::new([0; 16], 129), None);
        assert_eq!("::/0".parse::<Subnet>().unwrap().prefix_len(), 0);
    }
}
