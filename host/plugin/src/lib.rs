//! `libnccl-net-wasm.so`: the NCCL network plugin.
//!
//! This crate is the C edge and nothing else: it exports the `ncclNetPlugin_v8` … `_v12` tables
//! and the one-sided `ncclRmaPlugin_v14` … `_v16` (static data, as NCCL's loader expects),
//! converts C arguments, writes every out-parameter on every path, catches panics, and maps errors to `ncclResult_t`. All behaviour lives in
//! `ncclwasm-transport` ([`Net`](ncclwasm_transport::Net)) and the crates under it. The layouts are `ncclwasm-abi`'s, whose
//! `load` drives a built copy of this library through those same tables, for `ncclwasm bench` and
//! tests; [`ncclwasm_send_comm_stats`] is an extension export for such drivers.
//!
//! # Install
//! ```text
//! cargo build --release -p ncclwasm-plugin
//! cp target/release/libnccl_net_wasm.so /some/lib/dir/libnccl-net-wasm.so
//! NCCL_NET_PLUGIN=wasm (or the absolute path) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=NET ...
//! ```
//! `NCCL_WASM_FABRIC` picks the verbs provider, which the plugin opens and hands to the
//! transport (`auto`: libibverbs when a port is active, else `init` fails and NCCL uses its own
//! transports; `ib`: libibverbs whatever its ports' state; `soft`: the userspace fabric over
//! TCP, devices from `NCCL_WASM_TOPOLOGY`); `NCCL_WASM_POLICY*` configure the policy engine.
//! Every decision is logged at INFO under the NET subsystem with its reason and source.
//!
//! # GPU memory
//! `ptrSupport` is `NCCL_PTR_HOST`, plus `NCCL_PTR_CUDA` when a peer-memory module is loaded and
//! `NCCL_PTR_DMABUF` when the device registers dma-bufs; `forceFlush` is set for mlx5 Data
//! Direct devices. `regMr` takes host and (with peer memory) CUDA pointers, `regMrDmaBuf` (in
//! every table version) dma-buf fds; a type the device did not advertise is refused with a WARN
//! naming it. The rules are net_ib's and live in the transport (`Net::gpu_support` says what was
//! decided and why; `docs/architecture.md`, "GPU memory").
//!
//! # Lifetime
//! The [`Net`](ncclwasm_transport::Net) context is process-wide (NCCL reads devices once). ABI v8–v10 initialise once per
//! load, and since `dlclose` may leave this image mapped, their `init` replaces whatever state an
//! earlier load left; v11/v12 call `init`/`finalize` per communicator, and the last `finalize` drops the
//! context, which stops the event and policy threads — so NCCL's `dlclose` finds nothing running
//! and a later `dlopen` + `init` starts from scratch. Communicators hold their own references to
//! the devices they use, so closing them later is still safe.
//!
//! # Handles
//! Nothing NCCL holds is an address: v11+ contexts, communicators, memory registrations and
//! requests are generation-checked keys into the tables of [`handles`], so a second `finalize`,
//! a call on a finalized context or a closed communicator, a second `deregMr` or a `test` of a
//! request already reported done is refused as invalid usage instead of touching freed memory; a communicator a call panicked on fails every later call. A
//! request handle carries its communicator's key and pool index, so `test` is one O(1) lookup and
//! nothing is allocated per message.
//!
//! # Modules
//! One file per ABI version, `v8` … `v12`, holds its exported `ncclNetPlugin_vN` table and the
//! shims its signatures need (a later version takes an unchanged shim from the version that
//! introduced it). The bodies every version shares are by concern: [`edge`] (the rules of every
//! entry point: `guard`, NULL checks, handle keys), [`context`] (`init`/`finalize` and the
//! process-wide state), [`properties`] (`devices`, `getProperties`, `makeVDevice`), [`comms`]
//! (`listen`/`connect`/`accept`/`close*`), [`memory`] (`regMr*`, `deregMr`), [`messages`]
//! (`isend`/`irecv`/`iflush`/`test`), and [`stats`] for the extension export. The one-sided
//! tables are `rma_v14` … `rma_v16` over the bodies of [`rma`] (`docs/architecture.md`,
//! "One-sided traffic").

mod comms;
mod context;
mod edge;
mod fabric;
mod handles;
mod log;
mod memory;
mod messages;
mod pin;
mod profiler;
mod properties;
mod rma;
mod rma_v14;
mod rma_v15;
mod rma_v16;
mod stats;
mod v10;
mod v11;
mod v12;
mod v8;
mod v9;

pub use rma_v14::ncclRmaPlugin_v14;
pub use rma_v15::ncclRmaPlugin_v15;
pub use rma_v16::ncclRmaPlugin_v16;
pub use stats::ncclwasm_send_comm_stats;
pub use v8::ncclNetPlugin_v8;
pub use v9::ncclNetPlugin_v9;
pub use v10::ncclNetPlugin_v10;
pub use v11::ncclNetPlugin_v11;
pub use v12::ncclNetPlugin_v12;
