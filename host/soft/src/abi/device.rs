//! Devices and contexts: the device list (the topology's devices), `open_device` /
//! `close_device`, and what `query_device`, `query_port` and `query_gid` report of them.

use std::os::raw::{c_char, c_int};
use std::ptr;
use std::sync::Arc;

use ibverbs_sys::{
    _compat_ibv_port_attr, ibv_atomic_cap, ibv_context, ibv_device, ibv_device_attr, ibv_gid,
    ibv_mtu, ibv_port_attr,
};

use super::conv::{MAX_CQE, MAX_QP_WR, MAX_RD_ATOM, MAX_SGE, SOFT_ECE_VENDOR, fail, null, shield};
use super::cq::{poll_cq, req_notify_cq};
use super::objects::{SoftContext, ctx_of};
use super::plain::zeroed;
use super::post::{post_recv, post_send};
use crate::ctx::Ctx;
use crate::fabric::{self, SoftDevice};
use crate::qp::MAX_MSG;
use crate::sysfs::Ask;
use ncclwasm_verbs::table;

/// `ibv_port_attr.link_layer` values.
const LINK_LAYER_INFINIBAND: u8 = 1;
const LINK_LAYER_ETHERNET: u8 = 2;

/// `ibv_get_device_list`: the topology's devices (NULL + ENOSYS if the topology is unusable,
/// which callers read as zero devices).
pub unsafe extern "C" fn get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    shield(
        "get_device_list",
        || null(libc::EIO),
        || {
            let fabric = match fabric::fabric() {
                Ok(f) => f,
                Err(msg) => {
                    tracing::warn!("soft: no devices: {msg}");
                    if !num_devices.is_null() {
                        // SAFETY: the caller passed a writable int (checked non-NULL).
                        unsafe { *num_devices = 0 };
                    }
                    return null(libc::ENOSYS);
                }
            };
            let n = fabric.devices.len();
            // SAFETY: calloc of n+1 pointers; checked for NULL below.
            let list = unsafe { libc::calloc(n + 1, size_of::<*mut ibv_device>()) }
                .cast::<*mut ibv_device>();
            if list.is_null() {
                return null(libc::ENOMEM);
            }
            for (i, d) in fabric.devices.iter().enumerate() {
                // SAFETY: `list` has n+1 slots; the device lives for the whole process.
                unsafe { *list.add(i) = (&raw const d.ibv).cast_mut() };
            }
            if !num_devices.is_null() {
                // SAFETY: checked non-NULL; the caller passed a writable int.
                unsafe { *num_devices = n as c_int };
            }
            list
        },
    )
}

/// `ibv_free_device_list`. Devices themselves live as long as the process.
pub unsafe extern "C" fn free_device_list(list: *mut *mut ibv_device) {
    shield(
        "free_device_list",
        || (),
        || {
            // SAFETY: `list` came from get_device_list's calloc (free(NULL) is a no-op).
            unsafe { libc::free(list.cast()) };
        },
    )
}

/// `ibv_get_device_name`.
pub unsafe extern "C" fn get_device_name(device: *mut ibv_device) -> *const c_char {
    shield(
        "get_device_name",
        || null::<c_char>(libc::EIO).cast_const(),
        || {
            if device.is_null() {
                return null::<c_char>(libc::EINVAL);
            }
            // SAFETY: soft device pointers point at the first field of a repr(C) SoftDevice.
            unsafe { (*device.cast::<SoftDevice>()).name_c.as_ptr() }
        },
    )
}

/// `ibv_open_device`: a context with the fast-path ops filled in and an eventfd as `async_fd`.
pub unsafe extern "C" fn open_device(device: *mut ibv_device) -> *mut ibv_context {
    shield(
        "open_device",
        || null(libc::EIO),
        || {
            let Ok(fabric) = fabric::fabric() else {
                return null(libc::ENODEV);
            };
            let Some(dev) = fabric
                .devices
                .iter()
                .find(|d| ptr::eq((&raw const d.ibv).cast_mut(), device))
            else {
                return null(libc::ENODEV);
            };
            if !fabric::alive(dev) {
                return null(libc::EIO);
            }
            let ctx = match Ctx::new(fabric, dev) {
                Ok(c) => c,
                Err(e) => return null(e.raw_os_error().unwrap_or(libc::EIO)),
            };
            new_context(ctx, device)
        },
    )
}

/// Wraps a context in its `ibv_context` (also used by tests that build private fabrics).
pub(crate) fn new_context(ctx: Arc<Ctx>, device: *mut ibv_device) -> *mut ibv_context {
    let mut ibv: ibv_context = zeroed();
    ibv.device = device;
    ibv.cmd_fd = -1;
    ibv.async_fd = ctx.events.raw_fd();
    ibv.num_comp_vectors = 1;
    ibv.ops.post_send = Some(post_send);
    ibv.ops.post_recv = Some(post_recv);
    ibv.ops.poll_cq = Some(poll_cq);
    ibv.ops.req_notify_cq = Some(req_notify_cq);
    Box::into_raw(Box::new(SoftContext { ibv, ctx })).cast()
}

/// `ibv_close_device`: stops every thread the context started.
pub unsafe extern "C" fn close_device(context: *mut ibv_context) -> c_int {
    shield(
        "close_device",
        || fail(libc::EIO),
        || {
            if context.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: the pointer came from open_device (Box<SoftContext>) and is closed only once.
            let sc = unsafe { Box::from_raw(context.cast::<SoftContext>()) };
            sc.ctx.close();
            0
        },
    )
}

/// `ibv_query_device`.
pub unsafe extern "C" fn query_device(
    context: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    shield(
        "query_device",
        || fail(libc::EIO),
        || {
            if context.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            let mut a: ibv_device_attr = zeroed();
            for (d, s) in a.fw_ver.iter_mut().zip(b"soft-1.0".iter()) {
                *d = *s as c_char;
            }
            a.node_guid = ctx.dev.desc.guid.to_be();
            a.sys_image_guid = ctx.dev.desc.guid.to_be();
            a.max_mr_size = u64::MAX;
            a.page_size_cap = 4096;
            a.vendor_id = SOFT_ECE_VENDOR;
            a.max_qp = ctx.dev.desc.max_qps.min(i32::MAX as u32) as c_int;
            a.max_qp_wr = MAX_QP_WR as c_int;
            a.max_sge = MAX_SGE as c_int;
            a.max_sge_rd = MAX_SGE as c_int;
            a.max_cq = 1 << 16;
            a.max_cqe = MAX_CQE;
            a.max_mr = 1 << 24;
            a.max_pd = 1 << 24;
            a.max_qp_rd_atom = MAX_RD_ATOM;
            a.max_qp_init_rd_atom = MAX_RD_ATOM;
            a.max_res_rd_atom = MAX_RD_ATOM * 1024;
            // Atomic between QPs of this device (and of every device of this process: one
            // 64-bit atomic instruction on the memory), not against the CPU: hardware's HCA.
            a.atomic_cap = ibv_atomic_cap::IBV_ATOMIC_HCA;
            a.max_pkeys = 1;
            a.phys_port_cnt = ctx.dev.port_count();
            // SAFETY: the caller passed a writable ibv_device_attr.
            unsafe { *attr = a };
            0
        },
    )
}

/// `ibv_query_port` (the compat symbol; the pointer is a full `ibv_port_attr`).
pub unsafe extern "C" fn query_port(
    context: *mut ibv_context,
    port_num: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    shield(
        "query_port",
        || fail(libc::EIO),
        || {
            if context.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            let (Some(p), Some(state)) = (ctx.dev.port(port_num), ctx.dev.port_state(port_num))
            else {
                return fail(libc::EINVAL);
            };
            let mtu = match p.mtu {
                256 => ibv_mtu::IBV_MTU_256,
                512 => ibv_mtu::IBV_MTU_512,
                1024 => ibv_mtu::IBV_MTU_1024,
                2048 => ibv_mtu::IBV_MTU_2048,
                _ => ibv_mtu::IBV_MTU_4096,
            };
            let mut a: ibv_port_attr = zeroed();
            a.state = state;
            a.max_mtu = mtu;
            a.active_mtu = mtu;
            a.gid_tbl_len = p.gids.len() as c_int;
            a.max_msg_sz = MAX_MSG as u32;
            a.pkey_tbl_len = 1;
            a.lid = p.lid;
            a.sm_lid = if p.lid != 0 { 1 } else { 0 };
            a.max_vl_num = 1;
            a.active_width = width_code(p.width);
            a.active_speed = speed_code(p.speed_mbps / u32::from(p.width.max(1)));
            a.phys_state = if state == ibverbs_sys::ibv_port_state::IBV_PORT_ACTIVE {
                5
            } else {
                3
            };
            a.link_layer = match p.link_layer {
                ncclwasm_model::LinkLayer::Infiniband => LINK_LAYER_INFINIBAND,
                ncclwasm_model::LinkLayer::Ethernet => LINK_LAYER_ETHERNET,
            };
            // SAFETY: per the table contract the pointer is a full, writable ibv_port_attr.
            unsafe { *attr.cast::<ibv_port_attr>() = a };
            0
        },
    )
}

/// `ibv_port_attr.active_width` code for a lane count (1x=1, 2x=16, 4x=2, 8x=4, 12x=8).
fn width_code(lanes: u8) -> u8 {
    match lanes {
        1 => 1,
        2 => 16,
        8 => 4,
        12 => 8,
        _ => 2,
    }
}

/// `ibv_port_attr.active_speed` code for a per-lane rate in Mb/s (the fastest not above it).
fn speed_code(lane_mbps: u32) -> u8 {
    const CODES: [(u32, u8); 8] = [
        (100_000, 128), // NDR
        (50_000, 64),   // HDR
        (25_000, 32),   // EDR
        (14_000, 16),   // FDR
        (10_000, 4),    // QDR
        (5_000, 2),     // DDR
        (2_500, 1),     // SDR
        (0, 1),
    ];
    CODES
        .iter()
        .find(|(m, _)| lane_mbps >= *m)
        .map_or(1, |c| c.1)
}

/// The soft machine's sysfs-shaped tree, answered from memory (`ncclwasm_verbs::table::
/// SysfsReadFn`): the provider's tree in process, and `ncclwasm_verbs_sysfs_read` of the
/// `libibverbs.so.1` stand-in.
///
/// # Safety
/// `path` must be NULL or NUL-terminated, `buf` NULL or writable for `len` bytes.
pub unsafe extern "C" fn sysfs_read(
    path: *const c_char,
    op: c_int,
    buf: *mut c_char,
    len: usize,
) -> isize {
    shield(
        "sysfs_read",
        || -1,
        || {
            if path.is_null() {
                return -1;
            }
            // SAFETY: a NUL-terminated string (caller contract).
            let Ok(rel) = unsafe { std::ffi::CStr::from_ptr(path) }.to_str() else {
                return -1;
            };
            let ask = match op {
                table::SYSFS_READ => Ask::Read,
                table::SYSFS_RESOLVE => Ask::Resolve,
                table::SYSFS_TABLE => Ask::Table,
                _ => return -1,
            };
            let Some(answer) = crate::sysfs::read(rel, ask) else {
                return -1;
            };
            let bytes = answer.as_bytes();
            if !buf.is_null() && len > 0 {
                let n = bytes.len().min(len - 1);
                // SAFETY: `buf` is writable for `len` > n bytes (caller contract).
                unsafe {
                    ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                    *buf.add(n) = 0;
                }
            }
            isize::try_from(bytes.len()).unwrap_or(isize::MAX)
        },
    )
}

/// `ibv_query_gid`: the topology's GID table (empty slots are zero).
pub unsafe extern "C" fn query_gid(
    context: *mut ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    shield(
        "query_gid",
        || fail(libc::EIO),
        || {
            if context.is_null() || gid.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            let Some(g) = ctx
                .dev
                .port(port_num)
                .and_then(|p| usize::try_from(index).ok().and_then(|i| p.gids.get(i)))
            else {
                return fail(libc::EINVAL);
            };
            // SAFETY: the caller passed a writable 16-byte ibv_gid.
            unsafe { (*gid).raw = g.raw };
            0
        },
    )
}
