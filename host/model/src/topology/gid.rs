//! What a GID *is*, read from its 16 bytes: the classifications NCCL's GID selection and the WIT
//! `gid` record need (family, link-local, unconfigured, RoCE version).
//!
//! They live beside the topology code because the topology loader is the first producer of GIDs;
//! every layer (discovery on real NICs, the policy marshalling, the built-in default) uses these
//! same predicates so they can never disagree about what a GID is.

use std::net::Ipv6Addr;

use crate::{AddrFamily, Gid, GidType};

/// The first 32-bit word of a link-local (`fe80::/64`) address, in network order.
const LINK_LOCAL_WORD: [u8; 4] = [0xfe, 0x80, 0, 0];

impl Gid {
    /// A GID from its textual IPv6 form (`fe80::1`, `::ffff:10.0.0.1`, …).
    pub fn new(index: u32, addr: Ipv6Addr, gid_type: GidType, prefix_len: u8) -> Gid {
        Gid {
            index,
            raw: addr.octets(),
            gid_type,
            prefix_len,
        }
    }

    /// An all-zero slot: what the kernel reports for a GID table entry nobody configured. Its type
    /// is `unknown` because reading `gid_attrs/types/<i>` of such a slot fails.
    pub fn unconfigured(index: u32) -> Gid {
        Gid {
            index,
            raw: [0; 16],
            gid_type: GidType::Unknown,
            prefix_len: 0,
        }
    }

    /// The GID as an IPv6 address (its textual form is how topology files and logs show it).
    pub fn addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.raw)
    }

    /// Bytes 0..8 as a big-endian number: the IB subnet prefix (WIT `gid.hi`).
    pub fn hi(&self) -> u64 {
        u64::from_be_bytes(self.raw[..8].try_into().expect("8 bytes"))
    }

    /// Bytes 8..16 as a big-endian number: the interface id (WIT `gid.lo`).
    pub fn lo(&self) -> u64 {
        u64::from_be_bytes(self.raw[8..].try_into().expect("8 bytes"))
    }

    /// IPv4-mapped unicast (`::ffff:a.b.c.d`) and IPv4-mapped multicast (`ff0e::ffff:a.b.c.d`)
    /// GIDs are `Ipv4`, everything else `Ipv6`; as `getGidAddrFamily`.
    pub fn family(&self) -> AddrFamily {
        let r = &self.raw;
        let mapped_tail = r[8..10] == [0, 0] && r[10..12] == [0xff, 0xff];
        let unicast = r[..8] == [0; 8];
        let multicast = r[..4] == [0xff, 0x0e, 0, 0] && r[4..8] == [0; 4];
        if mapped_tail && (unicast || multicast) {
            AddrFamily::Ipv4
        } else {
            AddrFamily::Ipv6
        }
    }

    /// In `fe80::/64`; as `linkLocalGid`. Such GIDs do not route across nodes on RoCEv2
    /// (NVIDIA/nccl#769: Broadcom NICs list them first), so GID selection skips them.
    pub fn is_link_local(&self) -> bool {
        self.raw[..4] == LINK_LOCAL_WORD && self.raw[4..8] == [0; 4]
    }

    /// All zero, or `fe80::` with nothing after it: a slot nobody configured; the negation of
    /// `configuredGid`.
    pub fn is_unconfigured(&self) -> bool {
        let trailer_zero = self.raw[4..] == [0; 12];
        trailer_zero && (self.raw[..4] == [0; 4] || self.raw[..4] == LINK_LOCAL_WORD)
    }

    /// Configured and not link-local: the only GIDs the RoCE scan may prefer on version grounds;
    /// as `validGid`.
    pub fn is_routable(&self) -> bool {
        !self.is_unconfigured() && !self.is_link_local()
    }

    /// The RoCE version number the kernel reports for this entry (`IB/RoCE v1` and `RoCE v1` are
    /// 1, `RoCE v2` is 2), `None` when the type could not be read; as `ncclIbRoceGetVersionNum`.
    pub fn roce_version(&self) -> Option<u8> {
        match self.gid_type {
            GidType::Ib | GidType::RoceV1 => Some(1),
            GidType::RoceV2 => Some(2),
            GidType::Unknown => None,
        }
    }

    /// The IB fabric-local id (bytes 4..6 of the subnet prefix); non-zero when a router assigned
    /// a routable FLID; as `ncclIbExtractFlid`.
    pub fn flid(&self) -> u16 {
        u16::from_be_bytes([self.raw[4], self.raw[5]])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(text: &str) -> Gid {
        Gid::new(0, text.parse().unwrap(), GidType::RoceV2, 0)
    }

    #[test]
    fn family_detects_ipv4_mapped_unicast_and_multicast() {
        assert_eq!(gid("::ffff:10.1.2.3").family(), AddrFamily::Ipv4);
        assert_eq!(gid("ff0e::ffff:239.1.1.1").family(), AddrFamily::Ipv4);
        assert_eq!(gid("fe80::1").family(), AddrFamily::Ipv6);
        assert_eq!(gid("::").family(), AddrFamily::Ipv6);
        assert_eq!(gid("2001:db8::ffff:10.1.2.3").family(), AddrFamily::Ipv6);
    }

    #[test]
    fn link_local_and_unconfigured_follow_the_reference_predicates() {
        assert!(gid("fe80::1").is_link_local());
        assert!(!gid("fe80::1").is_unconfigured());
        assert!(gid("fe80::").is_unconfigured());
        assert!(gid("::").is_unconfigured());
        // fe80:0:0:1:: is neither link-local (word 1 non-zero) nor unconfigured.
        assert!(!gid("fe80:0:0:1::").is_link_local());
        assert!(gid("fe80:0:0:1::").is_routable());
        assert!(gid("::ffff:10.0.0.1").is_routable());
        assert!(!gid("fe80::1").is_routable());
    }

    #[test]
    fn halves_and_flid() {
        let g = gid("fe80:0:1234:5::abcd");
        assert_eq!(g.hi(), 0xfe80_0000_1234_0005);
        assert_eq!(g.lo(), 0xabcd);
        assert_eq!(g.flid(), 0x1234);
    }
}
