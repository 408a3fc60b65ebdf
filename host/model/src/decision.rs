//! What a policy (or the built-in default) decides.

use serde::{Deserialize, Serialize};

/// Which ports NCCL sees, in which order (`port.index` values).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSelection {
    pub ports: Vec<u32>,
    pub reason: String,
}

/// The GID index one port uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GidChoice {
    pub index: u32,
    pub reason: String,
}

/// A fused NIC the plugin exposes as one NCCL device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGroup {
    pub ports: Vec<u32>,
    pub name: Option<String>,
    pub reason: String,
}

/// The answer to NCCL core's request to fuse devices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VnicAnswer {
    Accept { reason: String },
    Reshape { devices: Vec<u32>, reason: String },
    Refuse { reason: String },
}

/// One queue pair of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpPlan {
    /// Index into [`crate::Connection::local`].
    pub local: u32,
    /// Index into [`crate::Connection::peer`].
    pub remote: u32,
    /// Relative share of each striped message (> 0).
    pub weight: u32,
}

/// A complete connection plan: what the data path executes for every message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnPlan {
    pub qps: Vec<QpPlan>,
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
    pub reason: String,
}

/// A policy's partial plan: `None` fields keep the built-in default's value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanPatch {
    pub qps: Option<Vec<QpPlan>>,
    pub stripe_width: Option<u32>,
    pub align: Option<u32>,
    pub adaptive_routing: Option<bool>,
    pub ar_threshold: Option<u64>,
    pub tc: Option<u8>,
    pub sl: Option<u8>,
    pub fifo_tc: Option<u8>,
    pub ece: Option<bool>,
    pub timeout: Option<u8>,
    pub retry_cnt: Option<u8>,
    pub reason: String,
}
