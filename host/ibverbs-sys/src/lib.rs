//! `#[repr(C)]` declarations of the part of libibverbs' ABI (`<infiniband/verbs.h>`) that the
//! verbs layer, the soft provider and soft-ibverbs use: the object structs (`ibv_context` with the
//! `ibv_context_ops` slots the fast path calls, `ibv_device`, `ibv_pd`, `ibv_mr`, `ibv_cq`,
//! `ibv_qp`, `ibv_comp_channel`), the work requests and completions, the attribute structs, and the
//! enums and flags those carry.
//!
//! Why not `rdma-sys`: it runs bindgen 0.59 against the system header at build time, and with
//! libclang 15 or newer (Debian 13's default) bindgen panics on the header's anonymous unions, so
//! the workspace stopped building on any machine without an old libclang. The ABI is frozen (these
//! structs are what every provider already reads and writes), so a fixed transcription is the
//! root fix: no build script, no dependencies, nothing to go wrong on a new toolchain.
//!
//! The API keeps rdma-sys's shape, so the switch changed no caller's code: enums are modules of constants with a
//! `Type` alias (`ibv_qp_state::IBV_QPS_RTS`), flag sets are `u32` newtypes with `BitOr`/`BitAnd`
//! (`ibv_send_flags::IBV_SEND_SIGNALED.0`), `ibv_event_type` is a Rust enum, and the header's
//! anonymous unions are named fields (`imm_data_invalidated_rkey_union`).
//!
//! How it is kept true: `tests/layout.rs` compiles a C program against the installed header and
//! compares every declared struct's size, alignment and field offsets, and every declared
//! constant's value, with the Rust side. Types that only ever travel behind pointers (`ibv_srq`,
//! `ibv_ah`, `ibv_mw`, …) are opaque and have no layout to check.
//!
//! Only declarations live here: reading a union field is `unsafe` at the use site, so the crate
//! itself needs none.
#![no_std]
#![forbid(unsafe_code)]
#![allow(non_camel_case_types, non_upper_case_globals)]

mod attrs;
mod enums;
mod flags;
mod objects;
mod work;

pub use attrs::*;
pub use enums::*;
pub use flags::*;
pub use objects::*;
pub use work::*;
