//! The built-in default policy: the decisions NCCL's own IB transport makes (`net_ib.cc`), as
//! pure functions over port and connection snapshots.
//!
//! The host uses these whenever no policy is loaded or a policy answers "no opinion", and the
//! `nccl-default` wasm policy compiles this same crate for `wasm32-wasip2`, so the two can be
//! checked against each other on every topology of the corpus. Hence no I/O, no threads, no
//! clock here: configuration arrives as `NCCL_IB_*` name/value pairs ([`IbConfig::from_pairs`]),
//! ports as [`ncclwasm_model::Port`] values.
//!
//! Every rule names the `net_ib.cc` function it mirrors, and every answer carries a `reason`
//! naming the rule and the variable that drove it, because "why did NCCL pick GID 3 on this
//! port?" is the question operators actually ask.
#![forbid(unsafe_code)]

mod config;
mod conn;
mod devices;
mod failover;
mod fusion;
mod gid;

pub use config::{
    AddrRange, ConfigError, ConfigWarning, HcaEntry, HcaFilter, IbConfig, NET_ID_UNDEF,
    STRICT_CONFIG, Setting, Source, env_pairs,
};
pub use conn::plan_connection;
pub use devices::{MAX_IB_DEVS, rail_plane, select_devices};
pub use failover::on_port_event;
pub use fusion::{NO_GROUPS_REASON, group_devices, make_vnic};
pub use gid::select_gid;

/// How NCCL's logs name a link layer (`NCCL_IB_LLSTR`).
fn link_name(link: ncclwasm_model::LinkLayer) -> &'static str {
    match link {
        ncclwasm_model::LinkLayer::Infiniband => "IB",
        ncclwasm_model::LinkLayer::Ethernet => "RoCE",
    }
}

#[cfg(test)]
mod testutil;
