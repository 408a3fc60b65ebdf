//! `ncclwasm_send_comm_stats`: what a send communicator of this plugin runs, and what it has sent.
//!
//! ```c
//! ncclResult_t ncclwasm_send_comm_stats(void *sendComm, ncclwasmSendStats_v2_t *out);
//! ```
//!
//! An extra export next to the `ncclNetPlugin_vN` tables. NCCL looks its symbols up by name and
//! never asks for this one; tools that drive the library themselves (`ncclwasm bench`) `dlsym` it
//! to report the plan the connection really runs — the one the policy made in that process, or
//! the built-in default that replaced it — and the payload bytes it has posted on each QP, rather
//! than recomputing either. The caller sets `version` to [`SEND_STATS_VERSION`]; the plugin
//! refuses any other value without writing (an error result, as for any misuse), and otherwise
//! overwrites the whole struct, on error too.
//!
//! The plan is `ncclwasm_model::ConnPlan` as JSON (its serde shape, the one `ncclwasm policy
//! explain --json` prints), so a field added to the plan travels without a change here: both the
//! writer ([`SendStatsV2::fill`], the plugin) and the reader ([`SendStatsV2::read`], the bench)
//! are this file and that type. What is not the plan stays numeric or a plain C string: the
//! payload bytes per QP, who made the plan, and the ports its QPs index. Strings are
//! NUL-terminated, cut at a character boundary when longer than their array (the plan's reason
//! is cut until its JSON fits).

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

use ncclwasm_model::{ConnPlan, Endpoint};

use crate::layout::NcclResult;
use crate::load::LoadError;

/// The exported name.
pub const SEND_STATS_SYMBOL: &std::ffi::CStr = c"ncclwasm_send_comm_stats";

/// The layout [`SendStatsV2`] is: a changed layout gets a new version and a new struct. (Version
/// 1 spelled every plan field out as a C field; the plugin refuses it.)
pub const SEND_STATS_VERSION: u32 = 2;

/// QPs one connection may have (`NCCL_IB_MAX_QPS`).
pub const STATS_MAX_QPS: usize = 128;
/// Ports one (possibly fused) device may have.
pub const STATS_MAX_ENDPOINTS: usize = 8;
/// A device name with its NUL (`IBV_SYSFS_NAME_MAX`).
pub const STATS_NAME_BYTES: usize = 64;
pub const STATS_SOURCE_BYTES: usize = 256;
/// The plan's JSON with its NUL: a plan of [`STATS_MAX_QPS`] QPs takes under 8 KiB without its
/// reason, so the reason keeps at least as much again.
pub const STATS_PLAN_BYTES: usize = 16 * 1024;

/// The export's signature.
pub type SendStatsFn = unsafe extern "C" fn(*mut c_void, *mut SendStatsV2) -> NcclResult;

/// One port of the connection, local or remote.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StatsEndpoint {
    pub device: [c_char; STATS_NAME_BYTES],
    pub port: u32,
}

/// `ncclwasmSendStats_v2_t`: the plan a send communicator runs, who made it and why, the ports
/// its QPs index, and the bytes posted per QP.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SendStatsV2 {
    /// In: [`SEND_STATS_VERSION`].
    pub version: u32,
    pub nlocal: u32,
    pub npeer: u32,
    /// Entries of `bytes`: one per QP of the plan, in plan order.
    pub nqps: u32,
    /// Who made the plan: the policy (`name@version`), the built-in default, or the built-in
    /// default standing in for a policy's plan the handshake refused.
    pub source: [c_char; STATS_SOURCE_BYTES],
    /// The ports the plan's QPs index (`qps[i].local`, `qps[i].remote`).
    pub local: [StatsEndpoint; STATS_MAX_ENDPOINTS],
    pub peer: [StatsEndpoint; STATS_MAX_ENDPOINTS],
    /// Payload bytes posted on each QP since the connection was made.
    pub bytes: [u64; STATS_MAX_QPS],
    /// The plan, `ncclwasm_model::ConnPlan` as JSON, NUL-terminated.
    pub plan: [c_char; STATS_PLAN_BYTES],
}

// The layout a C caller compiles against (x86-64).
const _: () = {
    assert!(size_of::<StatsEndpoint>() == 68);
    assert!(offset_of!(SendStatsV2, nqps) == 12);
    assert!(offset_of!(SendStatsV2, source) == 16);
    assert!(offset_of!(SendStatsV2, local) == 272);
    assert!(offset_of!(SendStatsV2, peer) == 816);
    assert!(offset_of!(SendStatsV2, bytes) == 1360);
    assert!(offset_of!(SendStatsV2, plan) == 2384);
    assert!(size_of::<SendStatsV2>() == 18768);
};

impl SendStatsV2 {
    /// All zero but `version`: what a caller passes in, and where the plugin starts from.
    pub const fn empty() -> SendStatsV2 {
        const END: StatsEndpoint = StatsEndpoint {
            device: [0; STATS_NAME_BYTES],
            port: 0,
        };
        SendStatsV2 {
            version: SEND_STATS_VERSION,
            nlocal: 0,
            npeer: 0,
            nqps: 0,
            source: [0; STATS_SOURCE_BYTES],
            local: [END; STATS_MAX_ENDPOINTS],
            peer: [END; STATS_MAX_ENDPOINTS],
            bytes: [0; STATS_MAX_QPS],
            plan: [0; STATS_PLAN_BYTES],
        }
    }

    /// The plugin's side: writes what a send communicator runs. Lists longer than their arrays
    /// are cut to them (the plugin checks at compile time that its own bounds fit).
    pub fn fill(
        &mut self,
        source: &str,
        plan: &ConnPlan,
        local: &[Endpoint],
        peer: &[Endpoint],
        posted: &[u64],
    ) -> Result<(), LoadError> {
        write_c_str(&mut self.plan, &encode_plan(plan)?);
        write_c_str(&mut self.source, source);
        for (list, n, ends) in [
            (&mut self.local, &mut self.nlocal, local),
            (&mut self.peer, &mut self.npeer, peer),
        ] {
            *n = ends.len().min(STATS_MAX_ENDPOINTS) as u32;
            for (e, ep) in list.iter_mut().zip(ends) {
                write_c_str(&mut e.device, &ep.device);
                e.port = u32::from(ep.port);
            }
        }
        self.nqps = posted.len().min(STATS_MAX_QPS) as u32;
        for (b, p) in self.bytes.iter_mut().zip(posted) {
            *b = *p;
        }
        Ok(())
    }

    /// The tool's side: the struct in Rust terms. Counts beyond the arrays (a misbehaving
    /// library) are clamped to them; a plan that is not a `ConnPlan` is an error.
    pub fn read(&self) -> Result<SendStats, LoadError> {
        let ends = |list: &[StatsEndpoint], n: u32| -> Vec<PortName> {
            list[..(n as usize).min(list.len())]
                .iter()
                .map(|e| PortName {
                    device: read_c_str(&e.device),
                    port: e.port,
                })
                .collect()
        };
        let plan = serde_json::from_str(&read_c_str(&self.plan))
            .map_err(|e| LoadError::new(format!("ncclwasm_send_comm_stats: the plan: {e}")))?;
        Ok(SendStats {
            source: read_c_str(&self.source),
            plan,
            local: ends(&self.local, self.nlocal),
            peer: ends(&self.peer, self.npeer),
            posted: self.bytes[..(self.nqps as usize).min(STATS_MAX_QPS)].to_vec(),
        })
    }
}

/// `plan` as JSON that fits [`SendStatsV2::plan`] with its NUL: when it does not, the longest
/// prefix of the reason (cut at a character boundary) that lets it fit.
fn encode_plan(plan: &ConnPlan) -> Result<String, LoadError> {
    if let Some(json) = encode_cut(plan, plan.reason.len())? {
        return Ok(json);
    }
    let mut best = encode_cut(plan, 0)?.ok_or_else(|| {
        LoadError::new(format!(
            "ncclwasm_send_comm_stats: a plan of {} QPs does not fit in {STATS_PLAN_BYTES} bytes",
            plan.qps.len()
        ))
    })?;
    // Binary search over the reason's character boundaries: `ends[lo]` bytes fit, `ends[hi]`
    // (the whole reason when `hi` is past the list) do not.
    let ends: Vec<usize> = plan.reason.char_indices().map(|(i, _)| i).collect();
    let (mut lo, mut hi) = (0, ends.len());
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match encode_cut(plan, ends[mid])? {
            Some(json) => (best, lo) = (json, mid),
            None => hi = mid,
        }
    }
    Ok(best)
}

/// `plan` with its reason cut to `keep` bytes, as JSON, if that fits [`SendStatsV2::plan`].
fn encode_cut(plan: &ConnPlan, keep: usize) -> Result<Option<String>, LoadError> {
    let json = if keep == plan.reason.len() {
        serde_json::to_string(plan)
    } else {
        serde_json::to_string(&ConnPlan {
            reason: plan.reason[..keep].to_owned(),
            ..plan.clone()
        })
    }
    .map_err(|e| LoadError::new(format!("ncclwasm_send_comm_stats: the plan: {e}")))?;
    Ok((json.len() < STATS_PLAN_BYTES).then_some(json))
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

/// [`SendStatsV2`] read back: the plan a send communicator runs and what each QP carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendStats {
    pub source: String,
    pub plan: ConnPlan,
    /// The ports `plan.qps[i].local` and `.remote` index.
    pub local: Vec<PortName>,
    pub peer: Vec<PortName>,
    /// Payload bytes posted on each QP of the plan, in plan order.
    pub posted: Vec<u64>,
}

impl SendStats {
    /// The local and remote port of the plan's QP `qp`; an index past the lists is shown as
    /// `#i?`, not trusted.
    pub fn ports(&self, qp: usize) -> (PortName, PortName) {
        let port = |list: &[PortName], i: Option<u32>| {
            i.and_then(|i| list.get(i as usize))
                .cloned()
                .unwrap_or_else(|| PortName {
                    device: format!("#{}?", i.map_or(String::new(), |i| i.to_string())),
                    port: 0,
                })
        };
        let q = self.plan.qps.get(qp);
        (
            port(&self.local, q.map(|q| q.local)),
            port(&self.peer, q.map(|q| q.remote)),
        )
    }
}

/// Copies `s` into `dst` with its NUL, cut at a character boundary if it does not fit.
pub fn write_c_str<const N: usize>(dst: &mut [c_char; N], s: &str) {
    let len = s.floor_char_boundary(N.saturating_sub(1));
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
    use ncclwasm_model::{Gid, LinkLayer, QpPlan};

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

    // Every field set apart from its default; a new plan field takes its default here.
    #[allow(clippy::needless_update)]
    fn plan(qps: usize, reason: &str) -> ConnPlan {
        ConnPlan {
            qps: (0..qps)
                .map(|i| QpPlan {
                    local: i as u32 % 2,
                    remote: u32::MAX,
                    weight: u32::MAX,
                })
                .collect(),
            stripe_width: 2,
            align: 128,
            adaptive_routing: true,
            ar_threshold: u64::MAX,
            tc: 106,
            sl: 3,
            fifo_tc: 104,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            reason: reason.into(),
            ..ConnPlan::default()
        }
    }

    fn endpoint(device: &str) -> Endpoint {
        Endpoint {
            device: device.into(),
            port: 1,
            link_layer: LinkLayer::Ethernet,
            speed_mbps: 100_000,
            mtu: 4096,
            lid: 0,
            gid: Gid::unconfigured(0),
        }
    }

    #[test]
    fn what_the_plugin_fills_reads_back_whole() {
        let p = plan(2, "policy set tc: storage");
        let mut s = SendStatsV2::empty();
        let local = [endpoint("soft_0"), endpoint("soft_1")];
        s.fill("policy p@1", &p, &local, &local[..1], &[42, 7])
            .unwrap();
        let r = s.read().unwrap();
        assert_eq!((r.source.as_str(), &r.plan), ("policy p@1", &p));
        assert_eq!(r.posted, [42, 7]);
        assert_eq!(
            (r.ports(1).0.to_string(), r.ports(0).1.device),
            ("soft_1:1".into(), "#4294967295?".into()),
            "an index past the list is shown, not trusted"
        );
        assert_eq!(r.ports(9).0.device, "#?");
    }

    #[test]
    fn the_largest_plan_fits_and_a_long_reason_is_cut_to_fit() {
        let long = "é\u{1}".repeat(STATS_PLAN_BYTES);
        let mut s = SendStatsV2::empty();
        s.fill("x", &plan(STATS_MAX_QPS, &long), &[], &[], &[])
            .unwrap();
        let r = s.read().unwrap();
        assert_eq!(r.plan.qps.len(), STATS_MAX_QPS);
        assert!(!r.plan.reason.is_empty() && long.starts_with(&r.plan.reason));
        let json = read_c_str(&s.plan);
        // The longest prefix that fits: one character more (6 or 2 bytes of JSON) would not.
        assert!(json.len() < STATS_PLAN_BYTES && json.len() + 6 >= STATS_PLAN_BYTES - 1);
    }

    #[test]
    fn read_clamps_counts_and_refuses_a_plan_that_is_not_one() {
        let mut s = SendStatsV2::empty();
        s.fill("x", &plan(1, ""), &[], &[], &[1]).unwrap();
        (s.nqps, s.nlocal) = (u32::MAX, u32::MAX);
        let r = s.read().unwrap();
        assert_eq!(
            (r.posted.len(), r.local.len()),
            (STATS_MAX_QPS, STATS_MAX_ENDPOINTS)
        );
        write_c_str(&mut s.plan, "{\"qps\": 3}");
        assert!(s.read().unwrap_err().to_string().contains("the plan"));
    }
}
