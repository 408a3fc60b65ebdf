//! What a provider hands the wrapper to become a [`crate::Fabric`]: its entry points, its
//! sysfs-shaped tree, what it promises beyond the table, and (for tests) its fault hooks.
//!
//! An in-process provider crate builds a [`Provider`] and calls [`crate::Fabric::from_provider`],
//! as a crypto provider crate hands rustls its `CryptoProvider`; the `ib` fabric builds the same
//! description from a `dlopen`ed library and its extension symbols ([`crate::table`]). Nothing
//! above this point knows which provider it runs on: differences are capabilities.

use std::path::PathBuf;

#[cfg(feature = "fault-injection")]
use crate::table::FaultTable;
use crate::table::{SysfsReadFn, VerbsTable};

/// What a provider promises beyond its entry points, as a bit set (the value the
/// `ncclwasm_verbs_capabilities` extension symbol returns; unknown bits are ignored).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ProviderCaps(u64);

impl ProviderCaps {
    pub const NONE: ProviderCaps = ProviderCaps(0);
    /// The provider's ECE value is an admission ticket, not a feature negotiation: a QP given
    /// its peer's `query_ece` value before RTR admits that peer only with a 32-bit secret, one
    /// without it only by QPN, address and PSN (what a NIC checks). A transport must exchange
    /// ECE and call `set_ece` on every QP, whatever `NCCL_IB_ECE_ENABLE` says, to keep strangers
    /// out. Both ends run the same provider, so the peer's value differs
    /// from the local one only in `options`.
    pub const ECE_REQUIRED: ProviderCaps = ProviderCaps(1);

    const KNOWN: u64 = Self::ECE_REQUIRED.0;

    /// The bits, as the extension symbol returns them.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// From the extension symbol's value; bits this wrapper does not know are dropped.
    pub const fn from_bits(bits: u64) -> ProviderCaps {
        ProviderCaps(bits & Self::KNOWN)
    }

    pub const fn contains(self, other: ProviderCaps) -> bool {
        self.0 & other.0 == other.0
    }
}

/// Where discovery reads what verbs do not say (layout in [`crate::table`]).
#[derive(Clone, Debug)]
pub enum SysfsTree {
    /// A directory laid out as `/sys` (`/sys` itself for real libibverbs), read through cap-std.
    Dir(PathBuf),
    /// A tree the provider answers from memory, path by path: a provider whose devices come from
    /// a description (the soft provider's topology file) writes no file, so init costs what
    /// discovery asks, not what the machine could hold, and leaves nothing behind.
    Served(SysfsReadFn),
}

/// `NCCL_WASM_SYSFS_ROOT`: a directory laid out as `/sys` that discovery reads instead of the
/// tree the provider names (its own, [`crate::IbOptions::sysfs_root`], or `/sys`), whatever the
/// provider. It lets an operator or a test run discovery against a copy of another machine's
/// `class/infiniband` (PCI path, NUMA node, GID types, netdevs); verbs answers (ports, GIDs)
/// still come from the provider. Read here only, when a provider is described.
pub const ENV_SYSFS_ROOT: &str = "NCCL_WASM_SYSFS_ROOT";

/// A provider's description: everything [`crate::Fabric::from_provider`] needs.
#[derive(Clone, Debug)]
pub struct Provider {
    pub(crate) name: &'static str,
    pub(crate) table: VerbsTable,
    pub(crate) sysfs: SysfsTree,
    pub(crate) caps: ProviderCaps,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: Option<FaultTable>,
}

impl Provider {
    /// `name` appears in messages (`"ib"`, `"soft"`, …); `table` fulfils the backend contract of
    /// [`crate::table`]; discovery reads `sysfs`, unless [`ENV_SYSFS_ROOT`] names a directory.
    pub fn new(
        name: &'static str,
        table: VerbsTable,
        sysfs: SysfsTree,
        caps: ProviderCaps,
    ) -> Provider {
        let sysfs = match std::env::var_os(ENV_SYSFS_ROOT) {
            Some(root) if !root.is_empty() => {
                tracing::info!(
                    "{name}: discovery reads sysfs under {} ({ENV_SYSFS_ROOT})",
                    std::path::Path::new(&root).display()
                );
                SysfsTree::Dir(PathBuf::from(root))
            }
            _ => sysfs,
        };
        Provider {
            name,
            table,
            sysfs,
            caps,
            #[cfg(feature = "fault-injection")]
            faults: None,
        }
    }

    /// Adds the provider's fault hooks, which `Context::inject_*` and `Qp::inject_*` call.
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(mut self, faults: FaultTable) -> Provider {
        self.faults = Some(faults);
        self
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        let t = &self.table;
        Capabilities {
            reg_mr_iova2: t.reg_mr_iova2.is_some(),
            reg_dmabuf_mr: t.reg_dmabuf_mr.is_some(),
            ece: t.query_ece.is_some() && t.set_ece.is_some(),
            ece_required: self.caps.contains(ProviderCaps::ECE_REQUIRED),
        }
    }
}

/// What a fabric can do: the optional entry points its table has, and what its provider
/// promises ([`ProviderCaps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `ibv_reg_mr_iova2` (relaxed ordering).
    pub reg_mr_iova2: bool,
    /// `ibv_reg_dmabuf_mr`.
    pub reg_dmabuf_mr: bool,
    /// `ibv_query_ece` and `ibv_set_ece`.
    pub ece: bool,
    /// [`ProviderCaps::ECE_REQUIRED`]: the peer's ECE must be set on every QP before RTR.
    pub ece_required: bool,
}
