//! Everything of this crate that touches a raw pointer, a C struct or a libc call, each
//! `unsafe` block with the reason it holds; the engine's modules forbid `unsafe` (`lib.rs`).
//!
//! The C side, one file per verb family: `device` (device list, contexts, port and GID
//! queries, and the sysfs-shaped tree's `SysfsReadFn`), `mr` (PDs and MRs), `cq` (CQs, `poll_cq`), `qp` (QPs, their state changes, and
//! ECE, which carries the admission secret), `post` (`post_send` / `post_recv`) and `event`
//! (async events), with libibverbs' exact C signatures; `fault` (the fault-injection hooks,
//! re-exported as the crate's `fault`). What they share sits in leaves that import none of
//! them: `objects` (the soft structs behind the caller's pointers and the casts back), `conv`
//! (the advertised limits, the errno conventions and the panic shield), `plain` (C structs
//! made from all-zero bytes).
//!
//! The engine's side, safe APIs over the pointer work it needs: `memory` (registered memory
//! as checked regions, and every copy, read, send and pull into or out of it), `mapping` (the
//! provider's own `mmap` of a dma-buf), `sys` (the other libc calls: randomness, futex,
//! eventfd, interfaces, netlink, `poll`) and `alloc_count` (the counting allocator of the
//! `alloc-count` feature).
//!
//! The crate's table (`lib.rs`) names the entry points through the re-exports below; the
//! fast-path ops are filled into each context by `device::new_context`.

#[cfg(feature = "alloc-count")]
pub mod alloc_count;
mod conv;
pub(crate) mod cq;
pub(crate) mod device;
mod event;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod mapping;
pub(crate) mod memory;
mod mr;
pub(crate) mod objects;
pub(crate) mod plain;
mod post;
mod qp;
pub(crate) mod sys;

pub(crate) use cq::{create_cq, destroy_cq};
pub use device::sysfs_read;
pub(crate) use device::{
    close_device, free_device_list, get_device_list, get_device_name, open_device, query_device,
    query_gid, query_port,
};
pub(crate) use event::{ack_async_event, event_type_str, get_async_event};
pub(crate) use mr::{alloc_pd, dealloc_pd, dereg_mr, reg_dmabuf_mr, reg_mr, reg_mr_iova2};
pub(crate) use qp::{create_qp, destroy_qp, modify_qp, query_ece, query_qp, set_ece};
