//! The C edge of nccl-net-wasm, shared by both of its sides.
//!
//! * [`layout`]: NCCL's net plugin ABI, v8 … v12, as `#[repr(C)]` mirrors with their sizes and
//!   offsets checked at compile time — what the plugin (`libnccl-net-wasm.so`) exports;
//! * [`stats`]: `ncclwasm_send_comm_stats`, an extension export of the plugin that tells what a
//!   send communicator runs and has sent (NCCL looks its symbols up by name, so it never sees it);
//!   the plan inside is `ncclwasm_model::ConnPlan` as JSON, written and read back here, so a
//!   plan field is declared once, in `model` — the one crate of ours this one uses;
//! * [`load`]: a safe driver of a built plugin library through those same tables, the way NCCL's
//!   proxy calls them — `ncclwasm bench` and the tests use it.
//!
//! This crate is the FFI boundary, so it holds `unsafe`, each block with its `// SAFETY:`
//! argument; the crates on either side of it need none for the ABI.

pub mod layout;
pub mod load;
pub mod stats;

pub use layout::*;
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

/// Every family the plugin exports.
pub const FAMILIES: &[Family] = &[NET];
