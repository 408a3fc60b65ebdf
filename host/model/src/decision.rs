//! What a policy (or the built-in default) decides.

use serde::{Deserialize, Serialize};

/// Which ports NCCL sees, in which order (`port.index` values).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSelection {
    pub ports: Vec<u32>,
    /// Each port's rail and plane, in `ports` order; `None`: the host's (`NCCL_IB_HCA`'s).
    #[serde(default)]
    pub rails: Option<Vec<crate::device_table::RailPlane>>,
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

/// The connection plan's fields besides `qps` and `reason`, in the handshake's wire order: each
/// one's doc, name, type and WIT name. Everything that handles the fields one by one is made from
/// this list — [`ConnPlan`] and [`PlanPatch`] themselves, [`PlanPatch::apply`],
/// [`ConnPlan::changed_fields`], a whole plan as a patch, the handshake's encoding
/// (`ncclwasm-proto`'s `message.rs`) and the WIT conversions of the host (`ncclwasm-policy`) and
/// of the guest SDK — so a new field is one entry here (docs/architecture.md, "How to add a plan
/// field"). `$callback` is a macro taking the entries as
/// `$( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*`.
#[macro_export]
macro_rules! for_each_plan_field {
    ($callback:ident) => {
        $callback! {
            /// How many consecutive QPs (from a rotating start) one message is striped over.
            stripe_width: u32 = "stripe-width";
            /// Stripes are multiples of this many bytes.
            align: u32 = "align";
            /// Messages above `ar_threshold` go as RDMA WRITE plus a zero-byte WRITE_WITH_IMM.
            adaptive_routing: bool = "adaptive-routing";
            ar_threshold: u64 = "ar-threshold";
            /// Traffic class and service level of the data QPs, traffic class of the CTS FIFO.
            tc: u8 = "tc";
            sl: u8 = "sl";
            fifo_tc: u8 = "fifo-tc";
            /// Enhanced connection establishment.
            ece: bool = "ece";
            /// QP timeout exponent (4.096 µs × 2^timeout) and retry count.
            timeout: u8 = "timeout";
            retry_cnt: u8 = "retry-cnt";
        }
    };
}

macro_rules! plan_types {
    ($( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*) => {
        /// A complete connection plan: what the data path executes for every message.
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct ConnPlan {
            pub qps: Vec<QpPlan>,
            $( $(#[$doc])* pub $field: $ty, )*
            pub reason: String,
        }

        /// A policy's partial plan: `None` fields keep the built-in default's value.
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct PlanPatch {
            pub qps: Option<Vec<QpPlan>>,
            $( $(#[$doc])* pub $field: Option<$ty>, )*
            pub reason: String,
        }

        impl ConnPlan {
            /// Every field a policy may set (WIT names, `qps` first).
            pub const FIELDS: &[&str] = &["qps", $($wit),*];

            /// The fields (WIT names, `qps` first) whose values differ between two plans.
            pub fn changed_fields(&self, other: &ConnPlan) -> Vec<&'static str> {
                let mut changed = Vec::new();
                if self.qps != other.qps {
                    changed.push("qps");
                }
                $( if self.$field != other.$field {
                    changed.push($wit);
                } )*
                changed
            }
        }

        impl PlanPatch {
            /// `base` with this patch's `Some` fields, its reason kept; and the WIT names of
            /// the fields the patch set, `qps` first.
            pub(crate) fn overlay(self, base: ConnPlan) -> (ConnPlan, Vec<&'static str>) {
                let mut set = Vec::new();
                let mut pick = |name: &'static str, some: bool| {
                    if some {
                        set.push(name);
                    }
                };
                pick("qps", self.qps.is_some());
                $( pick($wit, self.$field.is_some()); )*
                let plan = ConnPlan {
                    qps: self.qps.unwrap_or(base.qps),
                    $( $field: self.$field.unwrap_or(base.$field), )*
                    reason: base.reason,
                };
                (plan, set)
            }
        }

        /// Every field set: a policy answering with a whole plan.
        impl From<ConnPlan> for PlanPatch {
            fn from(plan: ConnPlan) -> PlanPatch {
                PlanPatch {
                    qps: Some(plan.qps),
                    $( $field: Some(plan.$field), )*
                    reason: plan.reason,
                }
            }
        }
    };
}

for_each_plan_field!(plan_types);
