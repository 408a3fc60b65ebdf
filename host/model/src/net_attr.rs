//! NCCL's hints about a communicator's coming traffic: what `setNetAttr` (plugin ABI v11+)
//! hands the plugin at connect and again before a transfer whose shape differs from the last
//! one — how many peers and flows per peer the sends and the receives will have, and which
//! operations, algorithms and protocols. A policy's `plan-connection` sees the latest hint of
//! the connection's communicator ([`crate::Connection::net_attr`]), so one policy can give a
//! ring's few peers more QPs than an all-to-all's many.

use serde::{Deserialize, Serialize};

/// One direction of NCCL's `ncclNetCommAttr_v11_t`: a range of concurrent peers and of flows
/// (channels) per peer. `None` where NCCL left a field undefined (`NCCL_NET_ATTR_UNDEF`, -1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct CommAttr {
    pub max_concurrent_peers: Option<i32>,
    pub min_concurrent_peers: Option<i32>,
    pub max_flows_per_peer: Option<i32>,
    pub min_flows_per_peer: Option<i32>,
}

/// NCCL's `ncclNetAttr_v11_t` (= v12), undefined fields as `None`. Written with the WIT's
/// names (`max-concurrent-peers`) where a file gives one (`policy test` cases).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct NetAttr {
    pub send: CommAttr,
    pub recv: CommAttr,
    /// Bit `i` set: NCCL's `ncclFunc_t` number `i` (0 broadcast, 1 reduce, 2 all-gather,
    /// 3 reduce-scatter, 4 all-reduce, then NCCL's later functions in its order).
    pub ops: Option<u32>,
    /// Bit `i`: NCCL's algorithm `i` (0 tree, 1 ring, 2 CollNet direct, 3 CollNet chain,
    /// 4 NVLS, 5 NVLS tree, 6 PAT); undefined for point-to-point.
    pub algos: Option<u32>,
    /// Bit `i`: NCCL's protocol `i` (0 LL, 1 LL128, 2 Simple); undefined for point-to-point.
    pub protos: Option<u32>,
}

impl CommAttr {
    /// From NCCL's four ints, -1 (or any negative) meaning undefined.
    pub fn from_raw(max_peers: i32, min_peers: i32, max_flows: i32, min_flows: i32) -> CommAttr {
        let defined = |v: i32| (v >= 0).then_some(v);
        CommAttr {
            max_concurrent_peers: defined(max_peers),
            min_concurrent_peers: defined(min_peers),
            max_flows_per_peer: defined(max_flows),
            min_flows_per_peer: defined(min_flows),
        }
    }
}

impl NetAttr {
    /// From NCCL's masks, `u32::MAX` (`(uint32_t)NCCL_NET_ATTR_UNDEF`) meaning undefined.
    pub fn from_raw(send: CommAttr, recv: CommAttr, ops: u32, algos: u32, protos: u32) -> NetAttr {
        let defined = |v: u32| (v != u32::MAX).then_some(v);
        NetAttr {
            send,
            recv,
            ops: defined(ops),
            algos: defined(algos),
            protos: defined(protos),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undefined_fields_are_none() {
        let send = CommAttr::from_raw(4, 4, 2, -1);
        assert_eq!(
            (send.max_concurrent_peers, send.min_flows_per_peer),
            (Some(4), None)
        );
        let a = NetAttr::from_raw(
            send,
            CommAttr::from_raw(-1, -1, -1, -1),
            1 << 4,
            u32::MAX,
            4,
        );
        assert_eq!((a.ops, a.algos, a.protos), (Some(16), None, Some(4)));
        assert_eq!(a.recv, CommAttr::default());
    }
}
