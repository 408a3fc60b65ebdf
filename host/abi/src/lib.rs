//! The C edge of nccl-net-wasm, shared by both of its sides.
//!
//! * [`layout`]: NCCL's net plugin ABI, v8 … v12, as `#[repr(C)]` mirrors with their sizes and
//!   offsets checked at compile time — what the plugin (`libnccl-net-wasm.so`) exports;
//! * [`rma`]: NCCL's one-sided RMA plugin ABI, v14 … v16 (`ncclRmaPlugin_vN`: puts, puts with a
//!   signal, gets over symmetric registrations of a group of ranks), checked the same way — the
//!   plugin exports these tables beside its net tables, in the same library;
//! * [`stats`]: `ncclwasm_send_comm_stats`, an extension export of the plugin that tells what a
//!   send communicator runs and has sent (NCCL looks its symbols up by name, so it never sees it);
//!   the plan inside is `ncclwasm_model::ConnPlan` as JSON, written and read back here, so a
//!   plan field is declared once, in `model` — the one crate of ours this one uses;
//! * [`load`]: a safe driver of a built plugin library through those same tables, the way NCCL's
//!   proxy calls them — `ncclwasm bench` and the tests use it;
//! * [`load_rma`]: the same for the library's one-sided tables, as NCCL's GIN proxy calls them
//!   (`ncclwasm bench`'s one-sided part).
//!
//! This crate is the FFI boundary, so it holds `unsafe`, each block with its `// SAFETY:`
//! argument; the crates on either side of it need none for the ABI.

pub mod layout;
pub mod load;
pub mod load_rma;
pub mod rma;
pub mod stats;

pub use layout::*;
pub use rma::*;
pub use stats::*;

/// A family of tables NCCL finds in a plugin library by symbol name, `<stem><version>`, probing
/// from the newest version it knows down. Each family is declared once, here, with the versions
/// this project exports: the loader probes them and the tests walk them from this declaration,
/// so a new version raises `newest` — the one place its number is written — and adds its layout
/// and shim (`docs/architecture.md`, "How to add an ABI version / an ABI family").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// The symbol's name without the version: `ncclNetPlugin_v`.
    pub stem: &'static str,
    /// The oldest version exported.
    pub oldest: u32,
    /// The newest version exported: the one the newest NCCL takes.
    pub newest: u32,
}

impl Family {
    /// Every version exported, oldest first.
    pub fn versions(self) -> std::ops::RangeInclusive<u32> {
        self.oldest..=self.newest
    }

    /// The exported symbol of one version: `ncclNetPlugin_v12`.
    pub fn symbol(self, version: u32) -> String {
        format!("{}{version}", self.stem)
    }
}

/// NCCL's net tables, `ncclNetPlugin_v8` (NCCL 2.20) … `_v12` (NCCL 2.30+).
pub const NET: Family = Family {
    stem: "ncclNetPlugin_v",
    oldest: 8,
    newest: 12,
};

/// NCCL's one-sided RMA tables, `ncclRmaPlugin_v14` … `_v16`, which NCCL looks for in the net
/// plugin's own library: NCCL 2.30 probes v14 then v13, NCCL 2.32.3 probes v16 … v13; v15 is
/// the table aws-ofi-nccl exports, so an NCCL between those two takes it. v13 is not exported:
/// it is GIN v13's table under another name, whose `createContext` and `regMrSym` hand back a
/// GIN device handle for kernels, which a proxy-only plugin has none of — and every NCCL that
/// probes v13 probes v14 first.
pub const RMA: Family = Family {
    stem: "ncclRmaPlugin_v",
    oldest: 14,
    newest: 16,
};

/// Every family the plugin exports.
pub const FAMILIES: &[Family] = &[NET, RMA];
