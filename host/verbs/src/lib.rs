//! The verbs layer: a small safe wrapper over rdma-sys types for exactly what the net_ib data
//! path needs, with every libibverbs entry point taken from a [`VerbsTable`].
//!
//! # Shape
//! - [`Fabric`] is one verbs library. [`Fabric::ib`] opens the real libibverbs at run time
//!   (`dlopen` + `dlvsym`, as NCCL's `ibvsymbols.cc`): no link-time dependency, and a missing
//!   library is a clean [`VerbsError::Load`] the caller reads as "no IB device". [`Fabric::soft`]
//!   is the userspace provider in [`soft`]. Everything above the table is the same code.
//! - Objects form a tree — [`Context`] → [`Pd`] → [`Mr`] / [`Qp`], [`Context`] → [`Cq`] — and
//!   each holds an `Arc` of its parents, so dropping in any order tears down children first, as
//!   verbs requires (QP before CQ and PD, MR before PD, all before the context and the library).
//! - Fast-path verbs (`post_send`, `post_recv`, `poll_cq`) go through the context's `ops` table,
//!   as verbs.h does; [`table`] documents what a backend must provide.
//! - [`Fabric::discover`] produces the `ncclwasm_model::Port` records policies decide on, as
//!   `ncclIbInitDevices` gathers them (verbs + sysfs read through cap-std).
//! - One error type, [`VerbsError`], naming the verb, the object and the errno.
//! - No rdma-sys type appears in the safe API; the only raw-pointer door is
//!   [`ForeignMemory::new`] (`unsafe`: the caller vouches for memory NCCL hands over).
//!
//! # Connecting a QP (the sequence `ncclIbCreateQp` / `ncclIbRtrQp` / `ncclIbRtsQp` follow)
//! `ctx.alloc_pd()`, `ctx.create_cq(depth)`, `pd.create_qp(&cq, &cq, caps, false)`,
//! `qp.to_init(&InitAttr { pkey_index, port, access })`, exchange [`Qp::qpn`], the GID/LID and
//! **the ECE** out of band, `qp.set_ece(peer_ece)`, `qp.to_rtr(&RtrAttr { .. })` (LID, or GRH
//! with SGID index, hop limit, TC), `qp.to_rts(&RtsAttr { .. })`. Then
//! [`Qp::post_send`] chains of [`SendWr`] (WRITE, WRITE_WITH_IMM, READ; signaled or not;
//! inline), [`Qp::post_recv`], [`Cq::poll`] into [`Completion`]s.
//!
//! On the soft fabric the ECE value carries the callee QP's secret (the provider admits only
//! peers that present it), so a transport must exchange ECE and call `set_ece` before RTR
//! whenever [`Capabilities::ece`] is true, whatever `NCCL_IB_ECE_ENABLE` says.
//!
//! # Testing hooks
//! [`Context::inject_port_down`], [`Qp::inject_cut`] and friends ([`fault`]) reach the soft
//! provider's fault injection, in process or through the `soft-ibverbs` cdylib; on real
//! libibverbs they answer [`VerbsError::Unsupported`].

mod cq;
mod device;
mod discover;
mod error;
pub mod fault;
pub mod ib;
mod memory;
mod qp;
pub mod soft;
mod sysfs;
pub mod table;

pub use cq::{Completion, Cq, WcOpcode, WcStatus};
pub use device::{
    AsyncEvent, AsyncEventKind, Capabilities, Context, DeviceAttr, Fabric, IbOptions, PortAttr,
};
pub use error::{Result, VerbsError};
pub use memory::{Access, DmaBuf, ForeignMemory, Memory, Mr, Pd};
pub use qp::{
    Ece, Grh, InitAttr, Mtu, Qp, QpCaps, QpState, RecvWr, Remote, RtrAttr, RtsAttr, SendOp, SendWr,
    Sge,
};
pub use table::VerbsTable;
