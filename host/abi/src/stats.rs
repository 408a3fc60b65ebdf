//! `ncclwasm_send_comm_stats`: what a send communicator of this plugin runs, and what it has sent.
//!
//! ```c
//! ncclResult_t ncclwasm_send_comm_stats(void *sendComm, ncclwasmSendStats_v1_t *out);
//! ```
//!
//! An extra export next to the `ncclNetPlugin_vN` tables. NCCL looks its symbols up by name and
//! never asks for this one; tools that drive the library themselves (`ncclwasm bench`) `dlsym` it
//! to report the plan the connection really runs — the one the policy made in that process, or
//! the built-in default that replaced it — and the payload bytes it has posted on each QP, rather
//! than recomputing either. The caller sets `version` to [`SEND_STATS_VERSION`]; the plugin
//! refuses any other value without writing (an error result, as for any misuse), and otherwise
//! overwrites the whole struct, on error too. Strings are NUL-terminated, cut at a character
//! boundary when longer than their array; QPs refer to the endpoints by index, as the plan does.

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

use crate::layout::NcclResult;

/// The exported name.
pub const SEND_STATS_SYMBOL: &std::ffi::CStr = c"ncclwasm_send_comm_stats";

/// The layout [`SendStatsV1`] is: a changed layout gets a new version and a new struct.
pub const SEND_STATS_VERSION: u32 = 1;

/// QPs one connection may have (`NCCL_IB_MAX_QPS`).
pub const STATS_MAX_QPS: usize = 128;
/// Ports one (possibly fused) device may have.
pub const STATS_MAX_ENDPOINTS: usize = 8;
/// A device name with its NUL (`IBV_SYSFS_NAME_MAX`).
pub const STATS_NAME_BYTES: usize = 64;
pub const STATS_SOURCE_BYTES: usize = 256;
pub const STATS_REASON_BYTES: usize = 4096;

/// The export's signature.
pub type SendStatsFn = unsafe extern "C" fn(*mut c_void, *mut SendStatsV1) -> NcclResult;

/// One port of the connection, local or remote.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StatsEndpoint {
    pub device: [c_char; STATS_NAME_BYTES],
    pub port: u32,
}

/// One QP of the plan and what it carried.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StatsQp {
    /// Index into `local`.
    pub local: u32,
    /// Index into `peer`.
    pub remote: u32,
    /// Its relative share of each striped message.
    pub weight: u32,
    pub reserved: u32,
    /// Payload bytes posted on this QP since the connection was made.
    pub bytes: u64,
}

/// `ncclwasmSendStats_v1_t`: the plan a send communicator runs, who made it and why, and the
/// bytes posted per QP. Booleans are 0 or 1.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SendStatsV1 {
    /// In: [`SEND_STATS_VERSION`].
    pub version: u32,
    pub nqps: u32,
    pub nlocal: u32,
    pub npeer: u32,
    /// QPs each message is striped over.
    pub stripe_width: u32,
    /// Stripe alignment, bytes.
    pub align: u32,
    pub ar_threshold: u64,
    pub adaptive_routing: u8,
    pub tc: u8,
    pub sl: u8,
    pub fifo_tc: u8,
    pub ece: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub reserved: u8,
    /// Who made the plan: the policy (`name@version`), the built-in default, or the built-in
    /// default standing in for a policy's plan the handshake refused.
    pub source: [c_char; STATS_SOURCE_BYTES],
    /// Why the plan is what it is, as its maker said.
    pub reason: [c_char; STATS_REASON_BYTES],
    pub local: [StatsEndpoint; STATS_MAX_ENDPOINTS],
    pub peer: [StatsEndpoint; STATS_MAX_ENDPOINTS],
    pub qps: [StatsQp; STATS_MAX_QPS],
}

// The layout a C caller compiles against (x86-64).
const _: () = {
    assert!(size_of::<StatsEndpoint>() == 68);
    assert!(size_of::<StatsQp>() == 24);
    assert!(offset_of!(StatsQp, bytes) == 16);
    assert!(size_of::<SendStatsV1>() == 8552);
    assert!(offset_of!(SendStatsV1, stripe_width) == 16);
    assert!(offset_of!(SendStatsV1, ar_threshold) == 24);
    assert!(offset_of!(SendStatsV1, adaptive_routing) == 32);
    assert!(offset_of!(SendStatsV1, retry_cnt) == 38);
    assert!(offset_of!(SendStatsV1, source) == 40);
    assert!(offset_of!(SendStatsV1, reason) == 296);
    assert!(offset_of!(SendStatsV1, local) == 4392);
    assert!(offset_of!(SendStatsV1, peer) == 4936);
    assert!(offset_of!(SendStatsV1, qps) == 5480);
};

impl SendStatsV1 {
    /// All zero but `version`: what a caller passes in, and where the plugin starts from.
    pub const fn empty() -> SendStatsV1 {
        const END: StatsEndpoint = StatsEndpoint {
            device: [0; STATS_NAME_BYTES],
            port: 0,
        };
        const QP: StatsQp = StatsQp {
            local: 0,
            remote: 0,
            weight: 0,
            reserved: 0,
            bytes: 0,
        };
        SendStatsV1 {
            version: SEND_STATS_VERSION,
            nqps: 0,
            nlocal: 0,
            npeer: 0,
            stripe_width: 0,
            align: 0,
            ar_threshold: 0,
            adaptive_routing: 0,
            tc: 0,
            sl: 0,
            fifo_tc: 0,
            ece: 0,
            timeout: 0,
            retry_cnt: 0,
            reserved: 0,
            source: [0; STATS_SOURCE_BYTES],
            reason: [0; STATS_REASON_BYTES],
            local: [END; STATS_MAX_ENDPOINTS],
            peer: [END; STATS_MAX_ENDPOINTS],
            qps: [QP; STATS_MAX_QPS],
        }
    }

    /// In Rust terms; counts beyond the arrays (a misbehaving library) are clamped to them.
    pub fn read(&self) -> SendStats {
        let ends = |list: &[StatsEndpoint], n: u32| -> Vec<PortName> {
            list[..(n as usize).min(list.len())]
                .iter()
                .map(|e| PortName {
                    device: read_c_str(&e.device),
                    port: e.port,
                })
                .collect()
        };
        let (local, peer) = (ends(&self.local, self.nlocal), ends(&self.peer, self.npeer));
        let port = |list: &[PortName], i: u32| {
            list.get(i as usize).cloned().unwrap_or_else(|| PortName {
                device: format!("#{i}?"),
                port: 0,
            })
        };
        SendStats {
            source: read_c_str(&self.source),
            reason: read_c_str(&self.reason),
            stripe_width: self.stripe_width,
            align: self.align,
            adaptive_routing: self.adaptive_routing != 0,
            ar_threshold: self.ar_threshold,
            tc: self.tc,
            sl: self.sl,
            fifo_tc: self.fifo_tc,
            ece: self.ece != 0,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            qps: self.qps[..(self.nqps as usize).min(STATS_MAX_QPS)]
                .iter()
                .map(|q| QpStats {
                    local: port(&local, q.local),
                    remote: port(&peer, q.remote),
                    weight: q.weight,
                    bytes: q.bytes,
                })
                .collect(),
        }
    }
}

/// A port by name, as logs write it: `device:port`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortName {
    pub device: String,
    pub port: u32,
}

impl std::fmt::Display for PortName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.device, self.port)
    }
}

/// One QP of the plan, its ports resolved, and the payload bytes it carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpStats {
    pub local: PortName,
    pub remote: PortName,
    pub weight: u32,
    pub bytes: u64,
}

/// [`SendStatsV1`] read back: the plan a send communicator runs and what each QP carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendStats {
    pub source: String,
    pub reason: String,
    pub stripe_width: u32,
    pub align: u32,
    pub adaptive_routing: bool,
    pub ar_threshold: u64,
    pub tc: u8,
    pub sl: u8,
    pub fifo_tc: u8,
    pub ece: bool,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub qps: Vec<QpStats>,
}

/// Copies `s` into `dst` with its NUL, cut at a character boundary if it does not fit.
pub fn write_c_str<const N: usize>(dst: &mut [c_char; N], s: &str) {
    let mut len = s.len().min(N.saturating_sub(1));
    while !s.is_char_boundary(len) {
        len -= 1;
    }
    for (d, &b) in dst.iter_mut().zip(&s.as_bytes()[..len]) {
        *d = b as c_char;
    }
    dst[len..].fill(0);
}

/// The string in `src` up to its first NUL, never past the array.
pub fn read_c_str(src: &[c_char]) -> String {
    let bytes: Vec<u8> = src
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_cut_at_a_character_boundary_and_always_terminated() {
        let mut dst = [0x55 as c_char; 6];
        write_c_str(&mut dst, "ab");
        assert_eq!(read_c_str(&dst), "ab");
        assert!(dst[2..].iter().all(|&c| c == 0), "the rest is cleared");
        write_c_str(&mut dst, "abcdéf");
        // 5 bytes fit; 'é' (2 bytes) would straddle the end, so it is left out.
        assert_eq!(read_c_str(&dst), "abcd");
        write_c_str(&mut dst, "abcdefgh");
        assert_eq!((read_c_str(&dst).as_str(), dst[5]), ("abcde", 0));
        let unterminated = [b'x' as c_char; 4];
        assert_eq!(read_c_str(&unterminated), "xxxx");
    }

    #[test]
    fn read_resolves_endpoints_and_clamps_counts() {
        let mut s = SendStatsV1::empty();
        write_c_str(&mut s.source, "policy p@1");
        write_c_str(&mut s.local[0].device, "soft_0");
        s.local[0].port = 1;
        write_c_str(&mut s.peer[0].device, "soft_1");
        s.peer[0].port = 1;
        (s.nlocal, s.npeer, s.nqps) = (1, 1, 2);
        s.qps[0] = StatsQp {
            local: 0,
            remote: 0,
            weight: 3,
            reserved: 0,
            bytes: 42,
        };
        s.qps[1] = StatsQp {
            local: 5,
            ..s.qps[0]
        };
        s.adaptive_routing = 1;
        let r = s.read();
        assert_eq!(r.source, "policy p@1");
        assert!(r.adaptive_routing && !r.ece);
        assert_eq!(r.qps.len(), 2);
        assert_eq!(
            (r.qps[0].local.to_string(), r.qps[0].remote.to_string()),
            ("soft_0:1".into(), "soft_1:1".into())
        );
        assert_eq!((r.qps[0].weight, r.qps[0].bytes), (3, 42));
        assert_eq!(
            r.qps[1].local.device, "#5?",
            "an index past the list is shown, not trusted"
        );
        s.nqps = u32::MAX;
        s.nlocal = u32::MAX;
        assert_eq!(s.read().qps.len(), STATS_MAX_QPS);
    }
}
