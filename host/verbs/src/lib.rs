//! The verbs layer: a small safe wrapper over libibverbs types (`ncclwasm-ibverbs-sys`) for
//! exactly what the net_ib data path needs, with every libibverbs entry point taken from a
//! provider's [`VerbsTable`].
//!
//! # Shape
//! - [`Fabric`] is one verbs provider. [`Fabric::ib`] opens the real libibverbs at run time
//!   (`dlopen` + `dlvsym`, as NCCL's `ibvsymbols.cc`): no link-time dependency, and a missing
//!   library is a clean [`VerbsError::Load`] the caller reads as "no IB device". An in-process
//!   provider crate (`ncclwasm-soft`, the userspace provider over TCP) describes itself as a
//!   [`Provider`] and gets a fabric from [`Fabric::from_provider`], as a crypto provider crate
//!   hands rustls its provider. Everything above the table is the same code; [`table`] is the
//!   contract a provider fulfils, and what a provider differs in beyond its table is a
//!   capability ([`Capabilities`], [`ProviderCaps`]), never its name.
//! - Objects form a tree — [`Context`] → [`Pd`] → [`Mr`] / [`Qp`], [`Context`] → [`Cq`] — and
//!   each holds an `Arc` of its parents, so dropping in any order tears down children first, as
//!   verbs requires (QP before CQ and PD, MR before PD, all before the context and the library).
//! - Fast-path verbs (`post_send`, `post_recv`, `poll_cq`) go through the context's `ops` table,
//!   as verbs.h does.
//! - [`Fabric::discover`] produces the `ncclwasm_model::Port` records policies decide on, as
//!   `ncclIbInitDevices` gathers them (verbs + sysfs: a directory read through cap-std, or
//!   a tree the provider answers from memory, [`SysfsTree`]).
//! - One error type, [`VerbsError`], naming the verb, the object and the errno.
//! - No libibverbs type appears in the safe API; the only raw-pointer door is
//!   [`ForeignMemory::new`] (`unsafe`: the caller vouches for memory NCCL hands over).
//!
//! # Layering (modules; each uses only those on lines above it)
//! ```text
//! error, table, wr, sysfs   leaves: the error type, the provider C ABI (VerbsTable, extension
//!                           symbols, FaultTable), work-request values, the sysfs reader
//! provider                  Provider, ProviderCaps, Capabilities          (table)
//! ib                        dlopen a library into a table + extensions    (error, table, provider)
//! device                    Fabric, Context, attributes, async events     (ib, provider, …)
//! memory, cq                Pd, Mr, DmaBuf / Cq, completions              (device, wr)
//! qp                        Qp, transitions, posting, ECE                 (memory, cq, wr)
//! discover                  Fabric::discover                              (device, sysfs)
//! gpu, mlx5                 peer memory, relaxed ordering / Data Direct   (device, memory, sysfs)
//! fault                     the inject_* extension [fault-injection]      (device, qp, table)
//! ```
//! Objects never reach up: a parent does not name its children's modules, and the fault
//! extension sits on top of the objects instead of being woven into them.
//!
//! # Connecting a QP (the sequence `ncclIbCreateQp` / `ncclIbRtrQp` / `ncclIbRtsQp` follow)
//! `ctx.alloc_pd()`, `ctx.create_cq(depth)`, `pd.create_qp(&cq, &cq, caps, false)`,
//! `qp.to_init(&InitAttr { pkey_index, port, access })`, exchange [`Qp::qpn`], the GID/LID and
//! **the ECE** out of band, `qp.set_ece(peer_ece)`, `qp.to_rtr(&RtrAttr { .. })` (LID, or GRH
//! with SGID index, hop limit, TC), `qp.to_rts(&RtsAttr { .. })`. Then
//! [`Qp::post_send`] chains of [`SendWr`] (WRITE, WRITE_WITH_IMM, READ; signaled or not;
//! inline), [`Qp::post_recv`], [`Cq::poll`] into [`Completion`]s.
//!
//! When [`Capabilities::ece_required`] is true (the soft provider: its ECE value carries the
//! callee QP's admission secret), a transport must exchange ECE and call `set_ece` before RTR on
//! every QP, whatever `NCCL_IB_ECE_ENABLE` says.
//!
//! # Features
//! `fault-injection` (tests only): `Context::inject_port_down`, `Qp::inject_cut` and
//! friends, which reach a provider's fault hooks, in process or exported by a loaded library;
//! a provider without hooks (real libibverbs) answers [`VerbsError::Unsupported`]. Without the
//! feature none of this is compiled, and a loaded library's hooks are not looked up.

mod cq;
mod device;
mod discover;
mod error;
#[cfg(feature = "fault-injection")]
mod fault;
mod gpu;
pub mod ib;
mod memory;
pub mod mlx5;
mod provider;
mod qp;
mod sysfs;
pub mod table;
mod wr;

pub use cq::{Completion, Cq, WcOpcode, WcStatus};
pub use device::{AsyncEvent, AsyncEventKind, Context, DeviceAttr, Fabric, IbOptions, PortAttr};
pub use discover::merge_vfs_from_env;
pub use error::{Result, VerbsError, panic_message};
pub use gpu::{PEER_MEMORY_MODULES, RelaxedOrderingMode};
pub use memory::{Access, DmaBuf, ForeignMemory, Memory, Mr, Pd};
pub use provider::{Capabilities, ENV_SYSFS_ROOT, Provider, ProviderCaps, SysfsTree};
pub use qp::{Ece, Grh, InitAttr, Mtu, Posted, Qp, QpCaps, QpState, RtrAttr, RtsAttr};
#[cfg(feature = "fault-injection")]
pub use table::FaultTable;
pub use table::VerbsTable;
pub use wr::{RecvWr, Remote, SendOp, SendWr, Sge};
