//! Plain data shared by every layer of nccl-net-wasm.
//!
//! Nothing here calls a policy, and the only I/O is [`file`], the bounded reader every layer
//! uses for the files it is pointed at, and `private_dir`, the per-user directory for what one
//! process leaves for the next. The rest are the snapshots a policy decides over
//! ([`Port`], [`Gid`], [`Connection`], [`PortEvent`]), the decisions it returns
//! ([`DeviceSelection`], [`GidChoice`], [`DeviceGroup`], [`VnicAnswer`], [`ConnPlan`],
//! [`PortAnswer`]) and the topology file format that describes a machine as data. The types
//! mirror `wit/policy.wit` one to one, so the host, the built-in default, the CLI and Rust guests
//! all speak the same language. [`for_each_hook!`] is the one list of the policy hooks, from
//! which every layer with an item per hook is generated (`hook`, [`Hook`]).
#![forbid(unsafe_code)]

pub mod decide;
mod decision;
pub mod device_table;
mod failover;
pub mod file;
mod hook;
pub mod name_list;
mod net_attr;
mod plan;
mod port;
#[cfg(unix)]
pub mod private_dir;
pub mod spelling;
pub mod telemetry;
pub mod text;
pub mod topology;
pub mod validate;

pub use decision::*;
pub use failover::*;
pub use hook::Hook;
pub use net_attr::{CommAttr, NetAttr};
pub use plan::*;
pub use port::*;
pub use topology::{Topology, TopologyError};
