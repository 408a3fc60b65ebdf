//! The listen handle: what `listen` writes into NCCL's 128-byte `ncclNetHandle_t` and `connect`
//! reads back on the other rank.
//!
//! As in `ncclIbListen`, the handle tells the connecting rank where the listener's handshake
//! socket is. Ours also carries a magic and the protocol version, so a handle produced by another
//! plugin or another build is refused with a clear message instead of a connection to a wrong
//! address, and a random per-listener nonce, which the connector echoes in its first message so
//! the listener can refuse stray connections. A checksum catches any corruption of the handle on
//! its way through NCCL's bootstrap (a flipped family byte would otherwise still decode).
//!
//! Layout (integers little-endian, the address in network byte order):
//!
//! | bytes    | field                                                      |
//! |----------|------------------------------------------------------------|
//! | 0..8     | magic `NCCLWASM`                                           |
//! | 8..10    | protocol version                                           |
//! | 10       | address family: 4 or 6                                     |
//! | 11       | zero                                                       |
//! | 12..14   | TCP port (non-zero)                                        |
//! | 14..16   | zero                                                       |
//! | 16..32   | IPv4 octets then zeros, or the IPv6 address                |
//! | 32..36   | IPv6 scope id (zero for IPv4)                              |
//! | 36..40   | checksum: FNV-1a over bytes 0..36 and 40..64               |
//! | 40..48   | listener nonce                                             |
//! | 48..64   | zero                                                       |
//! | 64..128  | [`HANDLE_SCRATCH`]: left to the connecting side            |
//!
//! NCCL hands the same buffer to every `connect` call of one connection; `ncclIbConnect` keeps its
//! in-progress stage inside the handle. The scratch range serves that purpose for the I/O shell:
//! decoding ignores it, and encoding leaves it zeroed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ops::Range;

use super::PROTOCOL_VERSION;
use crate::error::ProtoError;

/// Size of NCCL's handle buffer (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_SIZE: usize = 128;
/// Bytes of the handle the connecting side may use for its own progress state.
pub const HANDLE_SCRATCH: Range<usize> = 64..HANDLE_SIZE;

const MAGIC: [u8; 8] = *b"NCCLWASM";
/// Everything before the scratch range that is not a field must be zero.
const RESERVED: [Range<usize>; 3] = [11..12, 14..16, 48..64];
const CHECKSUM: Range<usize> = 36..40;

/// FNV-1a (32 bit) over the handle outside the checksum and scratch ranges. Any single changed
/// byte changes the result, which is all a handle copied through a bootstrap network needs.
fn checksum(h: &[u8; HANDLE_SIZE]) -> [u8; 4] {
    let covered = h[..CHECKSUM.start]
        .iter()
        .chain(&h[CHECKSUM.end..HANDLE_SCRATCH.start]);
    let sum = covered.fold(0x811c_9dc5_u32, |acc, &b| {
        (acc ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    sum.to_le_bytes()
}

/// Where a listener waits for the handshake, and the nonce that identifies it.
///
/// ```
/// use ncclwasm_proto::handle::ListenHandle;
///
/// let handle = ListenHandle { addr: "10.0.0.1:50000".parse().unwrap(), nonce: 0x5eed };
/// let bytes: [u8; 128] = handle.encode().unwrap();
/// assert_eq!(ListenHandle::decode(&bytes).unwrap(), handle);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenHandle {
    /// The listener's handshake socket: a concrete address the peer can reach.
    pub addr: SocketAddr,
    /// A random value chosen per listener (by the I/O shell, which owns randomness).
    pub nonce: u64,
}

impl ListenHandle {
    /// Writes the handle into NCCL's buffer. Refuses addresses the peer could not connect to
    /// (unspecified address, port 0), so the mistake shows on the listening rank.
    pub fn encode(&self) -> Result<[u8; HANDLE_SIZE], ProtoError> {
        if self.addr.ip().is_unspecified() || self.addr.port() == 0 {
            return Err(ProtoError::BadLocalInput {
                detail: format!(
                    "listen address {} cannot be reached by a peer; bind to a concrete address and port",
                    self.addr
                ),
            });
        }
        let mut h = [0u8; HANDLE_SIZE];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[12..14].copy_from_slice(&self.addr.port().to_le_bytes());
        match self.addr {
            SocketAddr::V4(a) => {
                h[10] = 4;
                h[16..20].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                h[10] = 6;
                h[16..32].copy_from_slice(&a.ip().octets());
                h[32..36].copy_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        h[40..48].copy_from_slice(&self.nonce.to_le_bytes());
        let sum = checksum(&h);
        h[CHECKSUM].copy_from_slice(&sum);
        Ok(h)
    }

    /// Reads a handle from NCCL's buffer, checking every byte outside the scratch range.
    pub fn decode(h: &[u8; HANDLE_SIZE]) -> Result<Self, ProtoError> {
        let bad = |detail: String| ProtoError::BadHandle { detail };
        let field = |r: Range<usize>| &h[r];
        if field(0..8) != MAGIC {
            return Err(bad(format!(
                "magic is {:02x?}, expected \"NCCLWASM\"",
                field(0..8)
            )));
        }
        let version = u16::from_le_bytes([h[8], h[9]]);
        if version != PROTOCOL_VERSION {
            return Err(ProtoError::VersionMismatch {
                what: "the listen handle",
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        if h[CHECKSUM] != checksum(h) {
            return Err(bad(
                "checksum mismatch: the handle was corrupted in transit".to_owned(),
            ));
        }
        if let Some(r) = RESERVED
            .iter()
            .find(|r| h[(*r).clone()].iter().any(|&b| b != 0))
        {
            return Err(bad(format!("reserved bytes {r:?} are not zero")));
        }
        let port = u16::from_le_bytes([h[12], h[13]]);
        let scope_id = u32::from_le_bytes([h[32], h[33], h[34], h[35]]);
        let mut ip6 = [0u8; 16];
        ip6.copy_from_slice(field(16..32));
        let ip = match h[10] {
            4 => {
                if ip6[4..].iter().any(|&b| b != 0) || scope_id != 0 {
                    return Err(bad("IPv4 handle has bytes set after the address".to_owned()));
                }
                IpAddr::V4(Ipv4Addr::new(ip6[0], ip6[1], ip6[2], ip6[3]))
            }
            6 => IpAddr::V6(Ipv6Addr::from(ip6)),
            f => return Err(bad(format!("address family {f}, expected 4 or 6"))),
        };
        if ip.is_unspecified() || port == 0 {
            return Err(bad(format!("address {ip} port {port} is not connectable")));
        }
        let addr = match ip {
            IpAddr::V4(v4) => SocketAddr::V4(SocketAddrV4::new(v4, port)),
            IpAddr::V6(v6) => SocketAddr::V6(SocketAddrV6::new(v6, port, 0, scope_id)),
        };
        let nonce = u64::from_le_bytes(h[40..48].try_into().expect("8-byte range"));
        Ok(ListenHandle { addr, nonce })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4() -> ListenHandle {
        ListenHandle {
            addr: "10.1.2.3:40000".parse().unwrap(),
            nonce: 0x1122_3344_5566_7788,
        }
    }

    #[test]
    fn round_trips_v4_and_v6() {
        let h = v4();
        assert_eq!(ListenHandle::decode(&h.encode().unwrap()).unwrap(), h);
        let v6 = ListenHandle {
            addr: SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 7, 0, 3)),
            nonce: 9,
        };
        assert_eq!(ListenHandle::decode(&v6.encode().unwrap()).unwrap(), v6);
    }

    #[test]
    fn scratch_is_ignored_and_zeroed() {
        let mut bytes = v4().encode().unwrap();
        assert!(bytes[HANDLE_SCRATCH].iter().all(|&b| b == 0));
        bytes[HANDLE_SCRATCH].fill(0xa5);
        assert_eq!(ListenHandle::decode(&bytes).unwrap(), v4());
    }

    #[test]
    fn refuses_unreachable_listen_addresses() {
        for addr in ["0.0.0.0:1", "10.0.0.1:0", "[::]:5"] {
            let h = ListenHandle {
                addr: addr.parse().unwrap(),
                nonce: 1,
            };
            assert!(
                matches!(h.encode(), Err(ProtoError::BadLocalInput { .. })),
                "{addr}"
            );
        }
    }

    #[test]
    fn strict_decoding() {
        let good = v4().encode().unwrap();
        // Change byte `i` and repair the checksum, to reach the field checks behind it.
        let with = |i: usize, v: u8| {
            let mut b = good;
            b[i] = v;
            let sum = checksum(&b);
            b[CHECKSUM].copy_from_slice(&sum);
            ListenHandle::decode(&b)
        };
        assert!(matches!(with(0, b'X'), Err(ProtoError::BadHandle { .. })));
        let other = PROTOCOL_VERSION + 1;
        assert!(matches!(
            with(8, other as u8),
            Err(ProtoError::VersionMismatch {
                theirs,
                ours: PROTOCOL_VERSION,
                ..
            }) if theirs == other
        ));
        assert!(
            with(10, 5)
                .unwrap_err()
                .to_string()
                .contains("address family 5")
        );
        assert!(with(11, 1).unwrap_err().to_string().contains("reserved"));
        assert!(with(50, 1).unwrap_err().to_string().contains("reserved"));
        assert!(
            with(20, 1)
                .unwrap_err()
                .to_string()
                .contains("after the address")
        );
        assert!(ListenHandle::decode(&[0u8; HANDLE_SIZE]).is_err());
        // Every single-bit flip outside the scratch range is caught.
        for i in 0..HANDLE_SCRATCH.start {
            for bit in 0..8 {
                let mut b = good;
                b[i] ^= 1 << bit;
                assert!(
                    ListenHandle::decode(&b).is_err(),
                    "flip of byte {i} bit {bit} accepted"
                );
            }
        }
    }
}
