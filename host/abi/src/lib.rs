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
