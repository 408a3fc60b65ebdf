//! `libibverbs.so.1` made of the soft provider: every entry point of [`VerbsTable`] exported
//! under its libibverbs name and symbol version (`ibv_reg_mr@@IBVERBS_1.1`,
//! `ibv_reg_mr_iova2@@IBVERBS_1.8`, …), forwarding to [`ncclwasm_soft::table`].
//!
//! The `ib` loader opens this file exactly as it opens rdma-core's library (dlopen +
//! dlvsym), so the conformance suite runs the `ib` table through the C ABI in CI, where no
//! RDMA hardware or kernel support exists. The fast path needs no export: the contexts the soft
//! provider returns carry their own `ops` table.
//!
//! Besides the verbs, it exports the extension symbols of [`ncclwasm_verbs::table`], which hand
//! the `ib` fabric what [`ncclwasm_soft::fabric`] hands over in process, since the Rust API of
//! this library's copy of the provider is not reachable through `dlopen`:
//! `ncclwasm_verbs_sysfs_read` (its sysfs tree), `ncclwasm_verbs_capabilities`
//! ([`ncclwasm_soft::CAPABILITIES`]: the transport must exchange ECE) and, because this library
//! is test tooling, always the `ncclwasm_verbs_fault_*` hooks.
//!
//! Any verbs program can run on it: link `-libverbs` as usual and put a `libibverbs.so.1`
//! pointing here first on `LD_LIBRARY_PATH` (`tests/verbs/`); [`ncclwasm_soft::ENV_DELIVERY`] chooses how WRs
//! between two QPs of one process travel.
//!
//! [`VerbsTable`]: ncclwasm_verbs::VerbsTable

use std::os::raw::{c_char, c_int, c_uint, c_void};

use ibverbs_sys::{
    _compat_ibv_port_attr, ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq, ibv_device,
    ibv_device_attr, ibv_ece, ibv_event_type, ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr,
};
use ncclwasm_verbs::VerbsTable;

/// The soft provider's table; the first verb called also applies the provider's variables
/// ([`ncclwasm_soft::apply_env`]): [`ncclwasm_soft::ENV_DELIVERY`] (`in-process`: a program —
/// another NCCL net plugin among them — that owns both ends of its connections runs over the
/// soft fabric with no socket and no thread hand-off, and what is measured is the program) and
/// [`ncclwasm_soft::ENV_CMA`]. A value they do not take is said on stderr (this library has no
/// log of its own) and the defaults kept.
fn table() -> &'static VerbsTable {
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| {
        if let Err(e) = ncclwasm_soft::apply_env() {
            eprintln!("soft-ibverbs: {e}; keeping the defaults");
        }
    });
    ncclwasm_soft::table()
}

/// Exports `ncclwasm_soft_ibv_<name>` and binds it to `ibv_<name>@@<version>`.
macro_rules! export {
    ($internal:ident, $field:ident, $ver:literal, ($($a:ident: $t:ty),*) -> $r:ty) => {
        #[doc = concat!("`ibv_", stringify!($field), "@@", $ver, "`.")]
        ///
        /// # Safety
        /// The libibverbs contract of this verb.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $internal($($a: $t),*) -> $r {
            // SAFETY: the caller honours the verb's C contract, which the soft table implements.
            unsafe { (table().$field)($($a),*) }
        }
        std::arch::global_asm!(concat!(
            ".symver ", stringify!($internal), ", ibv_", stringify!($field), "@@", $ver
        ));
    };
}

/// Like `export!` for an optional entry point: absent in the table = fails with EOPNOTSUPP.
macro_rules! export_opt {
    ($internal:ident, $field:ident, $ver:literal, $fail:expr, ($($a:ident: $t:ty),*) -> $r:ty) => {
        #[doc = concat!("`ibv_", stringify!($field), "@@", $ver, "`.")]
        ///
        /// # Safety
        /// The libibverbs contract of this verb.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $internal($($a: $t),*) -> $r {
            match table().$field {
                // SAFETY: as in `export!`.
                Some(f) => unsafe { f($($a),*) },
                None => {
                    set_errno(EOPNOTSUPP);
                    $fail
                }
            }
        }
        std::arch::global_asm!(concat!(
            ".symver ", stringify!($internal), ", ibv_", stringify!($field), "@@", $ver
        ));
    };
}

const EOPNOTSUPP: c_int = 95;

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *errno_location() = e };
}

unsafe extern "C" {
    #[link_name = "__errno_location"]
    fn errno_location() -> *mut c_int;
}

export!(ncclwasm_soft_ibv_get_device_list, get_device_list, "IBVERBS_1.1", (num_devices: *mut c_int) -> *mut *mut ibv_device);
export!(ncclwasm_soft_ibv_free_device_list, free_device_list, "IBVERBS_1.1", (list: *mut *mut ibv_device) -> ());
export!(ncclwasm_soft_ibv_get_device_name, get_device_name, "IBVERBS_1.1", (device: *mut ibv_device) -> *const c_char);
export!(ncclwasm_soft_ibv_open_device, open_device, "IBVERBS_1.1", (device: *mut ibv_device) -> *mut ibv_context);
export!(ncclwasm_soft_ibv_close_device, close_device, "IBVERBS_1.1", (context: *mut ibv_context) -> c_int);
export!(ncclwasm_soft_ibv_query_device, query_device, "IBVERBS_1.1", (context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int);
export!(ncclwasm_soft_ibv_query_port, query_port, "IBVERBS_1.1", (context: *mut ibv_context, port: u8, attr: *mut _compat_ibv_port_attr) -> c_int);
export!(ncclwasm_soft_ibv_query_gid, query_gid, "IBVERBS_1.1", (context: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int);
export!(ncclwasm_soft_ibv_alloc_pd, alloc_pd, "IBVERBS_1.1", (context: *mut ibv_context) -> *mut ibv_pd);
export!(ncclwasm_soft_ibv_dealloc_pd, dealloc_pd, "IBVERBS_1.1", (pd: *mut ibv_pd) -> c_int);
export!(ncclwasm_soft_ibv_reg_mr, reg_mr, "IBVERBS_1.1", (pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr);
export!(ncclwasm_soft_ibv_dereg_mr, dereg_mr, "IBVERBS_1.1", (mr: *mut ibv_mr) -> c_int);
export!(ncclwasm_soft_ibv_create_cq, create_cq, "IBVERBS_1.1", (context: *mut ibv_context, cqe: c_int, cq_context: *mut c_void, channel: *mut ibv_comp_channel, comp_vector: c_int) -> *mut ibv_cq);
export!(ncclwasm_soft_ibv_destroy_cq, destroy_cq, "IBVERBS_1.1", (cq: *mut ibv_cq) -> c_int);
export!(ncclwasm_soft_ibv_create_qp, create_qp, "IBVERBS_1.1", (pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp);
export!(ncclwasm_soft_ibv_modify_qp, modify_qp, "IBVERBS_1.1", (qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int);
export!(ncclwasm_soft_ibv_query_qp, query_qp, "IBVERBS_1.1", (qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int, init: *mut ibv_qp_init_attr) -> c_int);
export!(ncclwasm_soft_ibv_destroy_qp, destroy_qp, "IBVERBS_1.1", (qp: *mut ibv_qp) -> c_int);
export!(ncclwasm_soft_ibv_get_async_event, get_async_event, "IBVERBS_1.1", (context: *mut ibv_context, event: *mut ibv_async_event) -> c_int);
export!(ncclwasm_soft_ibv_ack_async_event, ack_async_event, "IBVERBS_1.1", (event: *mut ibv_async_event) -> ());
export!(ncclwasm_soft_ibv_event_type_str, event_type_str, "IBVERBS_1.1", (event: ibv_event_type) -> *const c_char);
export_opt!(ncclwasm_soft_ibv_reg_mr_iova2, reg_mr_iova2, "IBVERBS_1.8", std::ptr::null_mut(), (pd: *mut ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: c_uint) -> *mut ibv_mr);
export_opt!(ncclwasm_soft_ibv_query_ece, query_ece, "IBVERBS_1.10", EOPNOTSUPP, (qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int);
export_opt!(ncclwasm_soft_ibv_set_ece, set_ece, "IBVERBS_1.10", EOPNOTSUPP, (qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int);
export_opt!(ncclwasm_soft_ibv_reg_dmabuf_mr, reg_dmabuf_mr, "IBVERBS_1.12", std::ptr::null_mut(), (pd: *mut ibv_pd, offset: u64, length: usize, iova: u64, fd: c_int, access: c_int) -> *mut ibv_mr);

/// `ncclwasm_verbs_sysfs_read` (see `ncclwasm_verbs::table::SysfsReadFn`): the soft provider's
/// sysfs-shaped tree, answered from memory as in process; no file is written.
///
/// # Safety
/// `path` must be NULL or NUL-terminated, `buf` NULL or writable for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclwasm_verbs_sysfs_read(
    path: *const c_char,
    op: c_int,
    buf: *mut c_char,
    len: usize,
) -> isize {
    // SAFETY: the caller's contract is the one `sysfs_read` asks.
    unsafe { ncclwasm_soft::sysfs_read(path, op, buf, len) }
}

/// `ncclwasm_verbs_capabilities`: the bits of [`ncclwasm_soft::CAPABILITIES`], what the
/// provider declares in process.
#[unsafe(no_mangle)]
pub extern "C" fn ncclwasm_verbs_capabilities() -> u64 {
    ncclwasm_soft::CAPABILITIES.bits()
}

/// Exports one hook of `ncclwasm_soft::fault::HOOKS` under its name in
/// `ncclwasm_verbs::table::FAULT_SYMBOLS`.
macro_rules! export_fault {
    ($name:ident, $field:ident, ($($a:ident: $t:ty),*) -> $r:ty) => {
        /// See `ncclwasm_verbs::FaultTable`.
        ///
        /// # Safety
        /// Objects passed must be live objects of this library.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $r {
            // SAFETY: forwarded under the same contract.
            unsafe { (ncclwasm_soft::fault::HOOKS.$field)($($a),*) }
        }
    };
}

export_fault!(ncclwasm_verbs_fault_port_down, port_down, (context: *mut ibv_context, port: u8) -> c_int);
export_fault!(ncclwasm_verbs_fault_port_up, port_up, (context: *mut ibv_context, port: u8) -> c_int);
export_fault!(ncclwasm_verbs_fault_cut_connection, cut_connection, (qp: *mut ibv_qp) -> ());
export_fault!(ncclwasm_verbs_fault_stall, stall, (qp: *mut ibv_qp, micros: u64) -> ());
export_fault!(ncclwasm_verbs_fault_kill_device, kill_device, (context: *mut ibv_context) -> ());
export_fault!(ncclwasm_verbs_fault_refused_connections, refused_connections, (context: *mut ibv_context) -> u64);
