//! The symbol table and the rest of the C ABI a provider offers: every libibverbs entry point the
//! wrapper calls, as data, plus the extension symbols a loaded library may add.
//!
//! # Backend contract (read this before writing a provider)
//!
//! The safe wrapper (the rest of this crate) never names an exported libibverbs symbol. It calls
//! through a [`VerbsTable`], a struct of `unsafe extern "C" fn` pointers with **exactly the C
//! signatures libibverbs exports** (`ibverbs_sys` types), so one table can be filled from
//! `dlvsym(libibverbs.so.1, …)` (the `ib` backend, [`crate::ib`]) and another from Rust
//! functions (an in-process provider crate such as `ncclwasm-soft`). Like mio's selector
//! contract, this is the whole list of what a backend owes the wrapper; nothing else is assumed.
//!
//! ## What a provider crate hands over
//! A [`crate::Provider`], passed to [`crate::Fabric::from_provider`]:
//! - its name (for messages), its [`VerbsTable`] (below) and its sysfs-shaped tree (see
//!   Discovery): a directory, or a [`SysfsReadFn`] that answers it from memory;
//! - its [`crate::ProviderCaps`]: promises the table cannot express. Today one:
//!   [`crate::ProviderCaps::ECE_REQUIRED`], "this provider admits a QP's peer only after
//!   `set_ece` with the peer's `query_ece` value, so the transport must always exchange ECE";
//!   it surfaces as [`crate::Capabilities::ece_required`];
//! - with the `fault-injection` feature, optionally its `FaultTable` (the hooks behind
//!   `Context::inject_*` and `Qp::inject_*`).
//!
//! The same provider may also be built as a library exporting libibverbs' names, for the `ib`
//! fabric to `dlopen` (how CI runs the `ib` table without a NIC). What the in-process
//! [`crate::Provider`] passes as values, such a library exports as the extension symbols below,
//! which the `ib` fabric looks up with `dlsym` when it loads the library; a library without
//! them (rdma-core's) gets `/sys`, no [`crate::ProviderCaps`] and no fault hooks.
//!
//! ## Slow path: the table
//! Every non-optional field must be a working function. The `Option` fields are entry points
//! newer than `IBVERBS_1.1` (`ibv_reg_mr_iova2` 1.8, `ibv_query_ece`/`ibv_set_ece` 1.10,
//! `ibv_reg_dmabuf_mr` 1.12); `None` means "this library does not have it" and the wrapper
//! reports [`crate::VerbsError::Unsupported`] instead of calling.
//!
//! ## Fast path: `ibv_context.ops`
//! `post_send`, `post_recv` and `poll_cq` are **not** in the table: as in verbs.h (and NCCL's
//! `wrap_ibv_post_send`), the wrapper calls `(*qp->context).ops.post_send` etc. A provider's
//! `open_device` must return an `ibv_context` whose `ops.post_send`, `ops.post_recv` and
//! `ops.poll_cq` are `Some`; every other `ops` slot may be `None` (the wrapper never calls them;
//! `req_notify_cq` is unused because NCCL polls). Every object the provider returns
//! (`ibv_pd`, `ibv_mr`, `ibv_cq`, `ibv_qp`) must have its `context` field pointing at that
//! context, because that is how the fast path finds the ops.
//!
//! ## Objects: what the wrapper reads, ownership, lifetime
//! - `get_device_list(&n)`: a NULL-terminated array of `*mut ibv_device`, `n` set. **NULL with any
//!   errno means zero devices** (libibverbs without a kernel returns NULL + ENOSYS); the wrapper
//!   never treats it as an error. The array is owned by the caller until `free_device_list`.
//!   A device pointer must stay valid while a context opened from it is open (the wrapper also
//!   keeps the list alive that long, so a provider may tie devices to the list).
//! - `get_device_name(dev)`: a NUL-terminated name valid as long as the device; it names the sysfs
//!   directory `class/infiniband/<name>` (see Discovery).
//! - `open_device` → `ibv_context` (fields above, plus `async_fd`, see Async events), released by
//!   `close_device`. `query_device` fills `ibv_device_attr` (the wrapper reads `max_qp`,
//!   `max_qp_wr`, `max_cqe`, `max_sge`, `max_mr_size`, `node_guid`, `sys_image_guid` — network
//!   order, as the kernel gives it; discovery reports it in host order as the port's `guid` —,
//!   `phys_port_cnt`, `max_qp_rd_atom`, `vendor_id`, `vendor_part_id`, `fw_ver`).
//!   `query_port` is the exported **compat** symbol `ibv_query_port@IBVERBS_1.1` that NCCL
//!   loads: its third argument really points at a full 52-byte `ibv_port_attr` (cast to
//!   `_compat_ibv_port_attr`), and a provider fills all of it. `query_gid` fills 16 bytes; an
//!   empty slot is all zeroes (discovery reads indices `0..gid_tbl_len`, keeps empty slots as
//!   unconfigured entries and drops the trailing ones).
//! - `alloc_pd`/`dealloc_pd`, `reg_mr`/`dereg_mr` (`ibv_mr.addr,length,lkey,rkey` filled; `access`
//!   is an `ibv_access_flags` bit set), `create_cq`/`destroy_cq` (`ibv_cq.cqe` = the real depth,
//!   ≥ the request; `cq_context` and `channel` are passed as NULL, `comp_vector` 0),
//!   `create_qp`/`destroy_qp` (only `IBV_QPT_RC`; `ibv_qp_init_attr.cap` is in/out: the provider
//!   writes back what it granted, including `max_inline_data`; `ibv_qp.qp_num` and `state` set),
//!   `modify_qp` with the attribute masks of NCCL's `ncclIbCreateQp/RtrQp/RtsQp`, `query_qp`.
//! - Teardown order is the wrapper's job: QPs, then CQs and MRs, then PDs, then the context
//!   (each wrapper object holds an `Arc` of its parent). A provider may answer EBUSY to a
//!   destroy that would orphan a child, as the kernel does.
//! - All entry points and ops may be called from any thread, concurrently on different objects;
//!   the wrapper serialises posts on one QP (a CQ may be polled from several threads).
//!
//! ## Errors (errno conventions)
//! - Pointer-returning verbs: NULL and `errno` set.
//! - `int`-returning verbs (`modify_qp`, `query_*`, `destroy_*`, `dealloc_pd`, `dereg_mr`,
//!   `close_device`, `get_async_event`, `set_ece`, `query_ece`): 0 on success. On failure
//!   libibverbs is inconsistent (a positive errno *or* -1 with `errno`), so the wrapper takes a
//!   positive return as the errno, else reads `errno`. Providers should return the positive errno
//!   **and** set `errno`, so both readings agree.
//! - `ops.post_send`/`ops.post_recv`: 0, or a positive errno with `*bad_wr` = the first WR not
//!   posted (EINVAL wrong QP state or bad opcode, ENOMEM queue full, EINVAL too many SGEs or inline
//!   too long). `ops.poll_cq`: number of completions (≥ 0), negative on a CQ error (overrun).
//! - Data-path errors are completions, not return codes (`IBV_WC_*` statuses, QP to ERR, later WRs
//!   `IBV_WC_WR_FLUSH_ERR`).
//!
//! ## Async events
//! `ibv_context.async_fd` must be a pollable fd (pipe or eventfd) that is readable while an event
//! is pending. The wrapper sets it `O_NONBLOCK`, `poll`s it with a timeout (so its event thread can
//! stop without `pthread_cancel`, unlike NCCL) and then calls `get_async_event`, which must honour
//! `O_NONBLOCK` (EAGAIN when nothing is pending). Each event is acknowledged with
//! `ack_async_event`. Events carry the port number (`IBV_EVENT_PORT_ACTIVE/ERR`), the QP
//! (`IBV_EVENT_QP_FATAL` …) or nothing (`IBV_EVENT_DEVICE_FATAL`). `event_type_str` returns a
//! static string.
//!
//! ## Discovery extras: a sysfs-shaped tree
//! What verbs do not say (PCI path, NUMA node, GID types, the netdev behind a RoCE GID, the
//! driver) is read from sysfs **relative to a root** (`sysfs.rs`, [`crate::SysfsTree`]): a
//! directory read through cap-std (`/sys` for real libibverbs, or `NCCL_WASM_SYSFS_ROOT`), or a
//! tree a userspace provider answers from memory through a [`SysfsReadFn`] (the soft provider,
//! for its topology: no file is written, so a machine of 10 000 devices × 256 GIDs costs nothing
//! until a path is asked, and the very same discovery code runs in CI). Paths, relative to the
//! root:
//! - `class/infiniband/<dev>/device` → a symlink (relative) to a PCI function directory, e.g.
//!   `../../../devices/pci0000:00/0000:00:02.0/0000:17:00.1`, resolved inside the root. The
//!   reported path is `/sys/` joined with the resolved path relative to the root (for both
//!   backends, so the soft tree reproduces a topology file's `pci-path`), with the port/VF merge
//!   rule of `ncclIbGetPciPath` applied (`ncclwasm_model::topology::merged_pci_path`: last
//!   character `0`, and with VF merging the device number zeroed too).
//! - `class/infiniband/<dev>/device/numa_node`: a decimal integer, `-1` when unknown.
//! - `class/infiniband/<dev>/device/driver` → symlink whose last component names the driver
//!   (`mlx5_core` → provider `mlx5`). The soft tree names it after the topology file's
//!   `provider` (`drivers/mlx5_core` for `provider = "mlx5"`, `drivers/soft` for `"soft"`), so a
//!   soft run of `dgx-h100.toml` shows policies the same ports as the file does offline.
//! - `class/infiniband/<dev>/ports/<p>/gid_attrs/types/<i>`: `IB/RoCE v1` or `RoCE v2`.
//! - `class/infiniband/<dev>/ports/<p>/gid_attrs/ndevs/<i>`: the netdev name (RoCE only); the
//!   prefix length comes from that interface's address list (`getifaddrs`). IB and link-local
//!   GIDs have prefix 64.
//!
//! Every entry may be missing or unreadable (containers hide parts of sysfs): discovery then
//! reports "unknown" (empty path, NUMA -1, [`ncclwasm_model::GidType::Unknown`], prefix 0)
//! instead of failing.
//!
//! ## Extension symbols of a loaded library
//! Looked up with `dlsym` (unversioned) when the `ib` fabric loads a library. rdma-core has none
//! of them; a provider library that has a tree or capabilities must export the first two, or the
//! `ib` fabric over it would not behave as the provider does in process.
//! - [`SYSFS_READ_SYMBOL`] (`ncclwasm_verbs_sysfs_read`, [`SysfsReadFn`]): the library's
//!   sysfs-shaped tree, answered path by path. Absent: `/sys`.
//! - [`CAPABILITIES_SYMBOL`] (`ncclwasm_verbs_capabilities`, [`CapabilitiesFn`]): the bits of
//!   the provider's [`crate::ProviderCaps`], the same value its in-process [`crate::Provider`]
//!   declares. Absent: none.
//! - With the `fault-injection` feature, `FAULT_SYMBOLS`: the `FaultTable` hooks, in field
//!   order, used only when all of them resolve. Test tooling: a library may leave them out.
//!
//! The provider's environment (`NCCL_WASM_TOPOLOGY` for the soft provider) configures it before
//! the first `get_device_list`, the same way in both shapes.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uint, c_void};

use ibverbs_sys::{
    _compat_ibv_port_attr, ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq, ibv_device,
    ibv_device_attr, ibv_ece, ibv_event_type, ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr,
};

/// The libibverbs entry points the wrapper uses, with libibverbs' exported C signatures.
///
/// Field names are the C names without the `ibv_` prefix. See the module documentation for
/// what a backend must guarantee about each one.
#[derive(Clone, Copy, Debug)]
pub struct VerbsTable {
    pub get_device_list: unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(list: *mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(device: *mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(device: *mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(context: *mut ibv_context) -> c_int,
    pub query_device:
        unsafe extern "C" fn(context: *mut ibv_context, device_attr: *mut ibv_device_attr) -> c_int,
    /// The exported compat symbol (`ibv_query_port@IBVERBS_1.1`), as NCCL loads it; the pointer
    /// is a full `ibv_port_attr`.
    pub query_port: unsafe extern "C" fn(
        context: *mut ibv_context,
        port_num: u8,
        port_attr: *mut _compat_ibv_port_attr,
    ) -> c_int,
    pub query_gid: unsafe extern "C" fn(
        context: *mut ibv_context,
        port_num: u8,
        index: c_int,
        gid: *mut ibv_gid,
    ) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(context: *mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(pd: *mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(
        pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_int,
    ) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(mr: *mut ibv_mr) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        context: *mut ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(cq: *mut ibv_cq) -> c_int,
    pub create_qp:
        unsafe extern "C" fn(pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp:
        unsafe extern "C" fn(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int,
    pub query_qp: unsafe extern "C" fn(
        qp: *mut ibv_qp,
        attr: *mut ibv_qp_attr,
        attr_mask: c_int,
        init_attr: *mut ibv_qp_init_attr,
    ) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(qp: *mut ibv_qp) -> c_int,
    pub get_async_event:
        unsafe extern "C" fn(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int,
    pub ack_async_event: unsafe extern "C" fn(event: *mut ibv_async_event),
    pub event_type_str: unsafe extern "C" fn(event: ibv_event_type) -> *const c_char,
    /// `IBVERBS_1.8`: registration with an explicit IOVA and `IBV_ACCESS_RELAXED_ORDERING`.
    pub reg_mr_iova2: Option<
        unsafe extern "C" fn(
            pd: *mut ibv_pd,
            addr: *mut c_void,
            length: usize,
            iova: u64,
            access: c_uint,
        ) -> *mut ibv_mr,
    >,
    /// `IBVERBS_1.12`: registration of a dma-buf (GPU memory).
    pub reg_dmabuf_mr: Option<
        unsafe extern "C" fn(
            pd: *mut ibv_pd,
            offset: u64,
            length: usize,
            iova: u64,
            fd: c_int,
            access: c_int,
        ) -> *mut ibv_mr,
    >,
    /// `IBVERBS_1.10`: enhanced connection establishment.
    pub query_ece: Option<unsafe extern "C" fn(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int>,
    /// `IBVERBS_1.10`.
    pub set_ece: Option<unsafe extern "C" fn(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int>,
}

/// `ncclwasm_verbs_sysfs_read`: a loaded library's sysfs-shaped tree, answered from memory (see
/// the module documentation).
pub const SYSFS_READ_SYMBOL: &CStr = c"ncclwasm_verbs_sysfs_read";

/// Answers one path of a provider's sysfs-shaped tree: `path` is NUL-terminated and relative to
/// the tree's root, `op` one of [`SYSFS_READ`], [`SYSFS_RESOLVE`], [`SYSFS_TABLE`]. The answer
/// is written into `buf` (`len` bytes), truncated and NUL-terminated as `snprintf` does, and its
/// full length is returned — so a value `>= len` means "ask again with a larger buffer" — or -1
/// when the path does not exist, is not what `op` asks for, or `op` is not known (a reader then
/// falls back to [`SYSFS_READ`]). Called from any thread; a C function so that a library can
/// export it and an in-process provider can hand the same function over.
pub type SysfsReadFn =
    unsafe extern "C" fn(path: *const c_char, op: c_int, buf: *mut c_char, len: usize) -> isize;

/// [`SysfsReadFn`]'s `op`: the text of the file at `path` (symlinks on the way followed).
pub const SYSFS_READ: c_int = 0;
/// [`SysfsReadFn`]'s `op`: `path` with every symlink resolved, relative to the root (as
/// `realpath`; for a directory or a file alike).
pub const SYSFS_RESOLVE: c_int = 1;
/// [`SysfsReadFn`]'s `op`: the texts of the files `0`, `1`, … of the directory at `path` — a GID
/// table's (`gids`, `gid_attrs/types`, `gid_attrs/ndevs`) — each as [`SYSFS_READ`] gives it
/// trimmed, one per line, in index order up to the table's length. What discovery reads of every
/// slot of a port, in one question instead of one per slot (a port has up to 1 024).
pub const SYSFS_TABLE: c_int = 2;

/// `ncclwasm_verbs_capabilities`: what a loaded library's provider promises.
pub const CAPABILITIES_SYMBOL: &CStr = c"ncclwasm_verbs_capabilities";

/// Returns the bits of the provider's [`crate::ProviderCaps`].
pub type CapabilitiesFn = unsafe extern "C" fn() -> u64;

/// The hooks of a fault-capable provider (C ABI, so a library can export them): the failures a
/// NIC and its fabric produce, on demand, for tests.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug)]
pub struct FaultTable {
    /// Port down: `IBV_EVENT_PORT_ERR`, QPs on the port to ERR; 1 if the state changed.
    pub port_down: unsafe extern "C" fn(context: *mut ibv_context, port: u8) -> c_int,
    /// Port up again: `IBV_EVENT_PORT_ACTIVE`; 1 if the state changed.
    pub port_up: unsafe extern "C" fn(context: *mut ibv_context, port: u8) -> c_int,
    /// Breaks the QP's connections without a goodbye.
    pub cut_connection: unsafe extern "C" fn(qp: *mut ibv_qp),
    /// Makes the QP's responder silent for `micros` µs.
    pub stall: unsafe extern "C" fn(qp: *mut ibv_qp, micros: u64),
    /// Device fatal: `IBV_EVENT_DEVICE_FATAL`, every QP to ERR, later verbs fail (for good).
    pub kill_device: unsafe extern "C" fn(context: *mut ibv_context),
    /// Connections the context's listeners refused as strangers.
    pub refused_connections: unsafe extern "C" fn(context: *mut ibv_context) -> u64,
}

/// Exported names of the [`FaultTable`] hooks, in field order.
#[cfg(feature = "fault-injection")]
pub const FAULT_SYMBOLS: [&CStr; 6] = [
    c"ncclwasm_verbs_fault_port_down",
    c"ncclwasm_verbs_fault_port_up",
    c"ncclwasm_verbs_fault_cut_connection",
    c"ncclwasm_verbs_fault_stall",
    c"ncclwasm_verbs_fault_kill_device",
    c"ncclwasm_verbs_fault_refused_connections",
];
