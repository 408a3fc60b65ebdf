//! The libibverbs entry points and the `ibv_context.ops` fast path, with libibverbs' exact C
//! signatures. Every object returned is a real rdma-sys struct placed first in a `#[repr(C)]`
//! soft struct, so the pointer the caller holds is also a pointer to our state, exactly as a
//! provider library embeds `ibv_qp` in its `mlx5_qp`.

use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdma_sys::{
    _compat_ibv_port_attr, ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq, ibv_device,
    ibv_device_attr, ibv_ece, ibv_event_type, ibv_gid, ibv_mr, ibv_mtu, ibv_pd, ibv_port_attr,
    ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_qp_type, ibv_recv_wr, ibv_send_flags, ibv_send_wr,
    ibv_sge, ibv_wc, ibv_wc_flags, ibv_wr_opcode,
};

use super::activity;
use super::ctx::{CqState, Ctx};
use super::event::{Cq, Element};
use super::fabric::{self, SoftDevice};
use super::mr::{FdMapping, MapError};
use super::qp::{Attrs, Caps, MAX_INLINE, MAX_MSG, Qp, RecvWqe, SendWqe, Sge, Sges};
use super::wire::ReqOp;

/// `ibv_ece.vendor_id` of soft QPs: the ECE value carries the QP's secret in `options`.
pub const SOFT_ECE_VENDOR: u32 = 0x0050_F7F7;

/// Resource limits a soft device advertises (and enforces at creation).
const MAX_QP_WR: u32 = 32_768;
const MAX_SGE: u32 = 32;
const MAX_CQE: c_int = 4_194_303;
const MAX_RD_ATOM: c_int = 16;
const LINK_LAYER_INFINIBAND: u8 = 1;
const LINK_LAYER_ETHERNET: u8 = 2;

#[repr(C)]
pub(crate) struct SoftContext {
    pub ibv: ibv_context,
    pub ctx: Arc<Ctx>,
}

#[repr(C)]
struct SoftPd {
    ibv: ibv_pd,
    ctx: Arc<Ctx>,
}

#[repr(C)]
struct SoftMr {
    ibv: ibv_mr,
    ctx: Arc<Ctx>,
    /// The soft NIC's own mapping of a dma-buf registration; unmapped after the key is gone.
    dmabuf: Option<FdMapping>,
}

#[repr(C)]
struct SoftCq {
    ibv: ibv_cq,
    cq: Arc<CqState>,
}

#[repr(C)]
pub(crate) struct SoftQp {
    pub ibv: ibv_qp,
    pub qp: Arc<Qp>,
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local; writing it is always allowed.
    unsafe { *libc::__errno_location() = e };
}

/// Returns `e` as a positive errno and sets `errno`, so both conventions agree.
fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

fn null<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

/// Runs an entry point's body; a panic (a bug of this provider) must not unwind into C, where it
/// would abort the process (NCCL with it): it is logged and becomes the verb's error convention
/// (`on_panic`: errno EIO with -1, the errno itself, or NULL). With `fault-injection`,
/// [`crate::fault::panic_in_next_verb`] makes the next entry point panic here, to prove it.
fn shield<R>(verb: &'static str, on_panic: impl FnOnce() -> R, body: impl FnOnce() -> R) -> R {
    let run = || {
        #[cfg(feature = "fault-injection")]
        if crate::fault::take_injected_panic() {
            panic!("injected panic in {verb}");
        }
        body()
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(panic) => {
            let what = ncclwasm_verbs::panic_message(panic.as_ref());
            tracing::warn!("soft verbs: {verb} panicked ({what}); failing the call with EIO");
            on_panic()
        }
    }
}

/// The soft context behind an `ibv_context` pointer.
///
/// # Safety
/// `ctx` must come from [`open_device`] and not be closed.
pub(crate) unsafe fn ctx_of<'a>(ctx: *mut ibv_context) -> &'a Arc<Ctx> {
    // SAFETY: `ibv` is the first field of the repr(C) SoftContext that open_device allocated.
    unsafe { &(*ctx.cast::<SoftContext>()).ctx }
}

/// The soft QP behind an `ibv_qp` pointer.
///
/// # Safety
/// `qp` must come from [`create_qp`] and not be destroyed.
pub(crate) unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> &'a Arc<Qp> {
    // SAFETY: `ibv` is the first field of the repr(C) SoftQp that create_qp allocated.
    unsafe { &(*qp.cast::<SoftQp>()).qp }
}

// ---------------------------------------------------------------------------------------------
// Devices

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
    // SAFETY: ibv_context is plain C data (pointers, ints, NULL-able fn pointers, a pthread
    // mutex whose all-zero value is PTHREAD_MUTEX_INITIALIZER on glibc).
    let mut ibv: ibv_context = unsafe { std::mem::zeroed() };
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
            // SAFETY: plain C data; all-zero is valid.
            let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
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
            // SAFETY: plain C data; all-zero is valid.
            let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
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
            a.phys_state = if state == rdma_sys::ibv_port_state::IBV_PORT_ACTIVE {
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

// ---------------------------------------------------------------------------------------------
// PDs and MRs

/// `ibv_alloc_pd`.
pub unsafe extern "C" fn alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    shield(
        "alloc_pd",
        || null(libc::EIO),
        || {
            if context.is_null() {
                return null(libc::EINVAL);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            if !fabric::alive(ctx.dev) {
                return null(libc::EIO);
            }
            let ibv = ibv_pd {
                context,
                handle: ctx.alloc_pd_id(),
            };
            Box::into_raw(Box::new(SoftPd {
                ibv,
                ctx: Arc::clone(ctx),
            }))
            .cast()
        },
    )
}

/// `ibv_dealloc_pd`: EBUSY while MRs still use it.
pub unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    shield(
        "dealloc_pd",
        || fail(libc::EIO),
        || {
            if pd.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft PD (first field of a boxed SoftPd).
            let sp = unsafe { &*pd.cast::<SoftPd>() };
            if sp.ctx.mrs.count_for_pd(sp.ibv.handle) > 0 {
                return fail(libc::EBUSY);
            }
            // SAFETY: allocated by alloc_pd, freed once.
            drop(unsafe { Box::from_raw(pd.cast::<SoftPd>()) });
            0
        },
    )
}

/// `ibv_reg_mr`.
pub unsafe extern "C" fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    shield(
        "reg_mr",
        || null(libc::EIO),
        || {
            // SAFETY: same contract as reg_mr_iova2 with iova = addr.
            unsafe { reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
        },
    )
}

/// `ibv_reg_mr_iova2`: remote peers address the region by `iova`.
pub unsafe extern "C" fn reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    shield(
        "reg_mr_iova2",
        || null(libc::EIO),
        || {
            if pd.is_null() || (addr.is_null() && length > 0) {
                return null(libc::EINVAL);
            }
            // SAFETY: a live soft PD.
            let sp = unsafe { &*pd.cast::<SoftPd>() };
            register(sp, pd, addr as usize, addr, length, iova, access, None)
        },
    )
}

/// Registers `[host, host + length)` of this process under a fresh key, addressed by `iova`;
/// `ibv_addr` is what `ibv_mr.addr` reports (the caller's address, or the dma-buf offset).
#[allow(clippy::too_many_arguments)]
fn register(
    sp: &SoftPd,
    pd: *mut ibv_pd,
    host: usize,
    ibv_addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
    dmabuf: Option<FdMapping>,
) -> *mut ibv_mr {
    if !fabric::alive(sp.ctx.dev) {
        return null(libc::EIO);
    }
    // Remote write/atomic without local write is invalid, as in libibverbs.
    let remote_write = super::mr::REMOTE_WRITE;
    if access & remote_write != 0 && access & super::mr::LOCAL_WRITE == 0 {
        return null(libc::EINVAL);
    }
    let key = sp
        .ctx
        .mrs
        .register(sp.ibv.handle, host, length, iova, access);
    let ibv = ibv_mr {
        context: sp.ibv.context,
        pd,
        addr: ibv_addr,
        length,
        handle: key,
        lkey: key,
        rkey: key,
    };
    Box::into_raw(Box::new(SoftMr {
        ibv,
        ctx: Arc::clone(&sp.ctx),
        dmabuf,
    }))
    .cast()
}

/// `ibv_reg_dmabuf_mr`: any fd the soft NIC can map stands for a dma-buf (a `memfd` for a GPU
/// buffer). The region is the fd's pages from `offset`, mapped by the provider itself and
/// addressed by `iova`, so bytes moved through it appear in every mapping of the fd. fd -1 is
/// `EBADF`, which is how NCCL's probe (`ncclIbDmaBufSupport`) learns the verb is supported; an
/// fd that cannot be mapped is `EOPNOTSUPP`, as a kernel without dma-buf support answers; a
/// range past the end of the fd is `EINVAL`.
pub unsafe extern "C" fn reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    shield(
        "reg_dmabuf_mr",
        || null(libc::EIO),
        || {
            if pd.is_null() {
                return null(libc::EINVAL);
            }
            if fd < 0 {
                return null(libc::EBADF);
            }
            if length == 0 {
                return null(libc::EINVAL);
            }
            // SAFETY: a live soft PD.
            let sp = unsafe { &*pd.cast::<SoftPd>() };
            let mapping = match FdMapping::map(fd, offset, length) {
                Ok(m) => m,
                Err(MapError::Range) => return null(libc::EINVAL),
                Err(MapError::Unmappable(e)) => {
                    tracing::debug!("soft: reg_dmabuf_mr of fd {fd}: mmap errno {e}");
                    return null(libc::EOPNOTSUPP);
                }
            };
            let host = mapping.addr();
            register(
                sp,
                pd,
                host,
                offset as usize as *mut c_void,
                length,
                iova,
                access as c_uint,
                Some(mapping),
            )
        },
    )
}

/// `ibv_dereg_mr`: the key stops working at once; returns when no access uses it any more.
pub unsafe extern "C" fn dereg_mr(mr: *mut ibv_mr) -> c_int {
    shield(
        "dereg_mr",
        || fail(libc::EIO),
        || {
            if mr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: allocated by reg_mr_iova2, deregistered once.
            let sm = unsafe { Box::from_raw(mr.cast::<SoftMr>()) };
            sm.ctx.mrs.deregister(sm.ibv.lkey);
            // The key is gone and no access holds it: now the dma-buf mapping (if any) may go.
            drop(sm);
            0
        },
    )
}

// ---------------------------------------------------------------------------------------------
// CQs

/// `ibv_create_cq`; completion channels are not supported (NCCL polls).
pub unsafe extern "C" fn create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    shield(
        "create_cq",
        || null(libc::EIO),
        || {
            if context.is_null() || !(1..=MAX_CQE).contains(&cqe) {
                return null(libc::EINVAL);
            }
            if !channel.is_null() {
                return null(libc::EOPNOTSUPP);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            if !fabric::alive(ctx.dev) {
                return null(libc::EIO);
            }
            let state = Arc::new(CqState {
                cq: Cq::new(cqe as usize),
                ibv: Default::default(),
                ctx: Arc::clone(ctx),
            });
            // SAFETY: plain C data; the pthread mutex/cond all-zero values are their static initialisers.
            let mut ibv: ibv_cq = unsafe { std::mem::zeroed() };
            ibv.context = context;
            ibv.cq_context = cq_context;
            ibv.cqe = cqe;
            let raw: *mut SoftCq = Box::into_raw(Box::new(SoftCq {
                ibv,
                cq: Arc::clone(&state),
            }));
            state.ibv.store(raw as usize, Ordering::Release);
            raw.cast()
        },
    )
}

/// `ibv_destroy_cq`: EBUSY while a QP still uses it.
pub unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    shield(
        "destroy_cq",
        || fail(libc::EIO),
        || {
            if cq.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft CQ.
            let sc = unsafe { &*cq.cast::<SoftCq>() };
            if Arc::strong_count(&sc.cq) > 1 {
                return fail(libc::EBUSY);
            }
            sc.cq.ctx.events.forget(Element::Cq(cq as usize));
            // SAFETY: allocated by create_cq, destroyed once.
            drop(unsafe { Box::from_raw(cq.cast::<SoftCq>()) });
            0
        },
    )
}

/// `ops.poll_cq`: up to `num_entries` completions, -1 once the CQ has overrun.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    shield(
        "poll_cq",
        || -libc::EIO,
        || {
            if cq.is_null() || (wc.is_null() && num_entries > 0) {
                return -libc::EINVAL;
            }
            // SAFETY: a live soft CQ.
            let sc = unsafe { &*cq.cast::<SoftCq>() };
            let max = usize::try_from(num_entries).unwrap_or(0);
            let seen = activity::before_poll();
            let n = sc.cq.cq.poll(max, |i, w| {
                // SAFETY: plain C data; all-zero is valid.
                let mut out: ibv_wc = unsafe { std::mem::zeroed() };
                out.wr_id = w.wr_id;
                out.status = w.status;
                out.opcode = w.opcode;
                out.byte_len = w.byte_len;
                out.qp_num = w.qp_num;
                out.src_qp = w.src_qp;
                if let Some(imm) = w.imm {
                    out.imm_data_invalidated_rkey_union.imm_data = imm;
                    out.wc_flags = ibv_wc_flags::IBV_WC_WITH_IMM.0;
                }
                // SAFETY: the caller's array has `num_entries` slots and `i < num_entries`.
                unsafe { wc.add(i).write(out) };
            });
            match n {
                Some(n) => {
                    activity::polled(seen, n > 0);
                    n as c_int
                }
                None => {
                    set_errno(libc::EOVERFLOW);
                    -1
                }
            }
        },
    )
}

/// `ops.req_notify_cq`: accepted; there are no completion channels to notify.
pub unsafe extern "C" fn req_notify_cq(_cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    shield("req_notify_cq", || fail(libc::EIO), || 0)
}

// ---------------------------------------------------------------------------------------------
// QPs

/// `ibv_create_qp`: RC only; the granted capacities are written back into `init_attr.cap`.
pub unsafe extern "C" fn create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    shield(
        "create_qp",
        || null(libc::EIO),
        || {
            if pd.is_null() || init.is_null() {
                return null(libc::EINVAL);
            }
            // SAFETY: live soft PD and a readable/writable init attr from the caller.
            let (sp, ia) = unsafe { (&*pd.cast::<SoftPd>(), &mut *init) };
            if ia.qp_type != ibv_qp_type::IBV_QPT_RC {
                return null(libc::EOPNOTSUPP);
            }
            if !ia.srq.is_null() {
                return null(libc::EOPNOTSUPP);
            }
            if ia.send_cq.is_null() || ia.recv_cq.is_null() {
                return null(libc::EINVAL);
            }
            if !fabric::alive(sp.ctx.dev) {
                return null(libc::EIO);
            }
            let c = ia.cap;
            if c.max_send_wr > MAX_QP_WR
                || c.max_recv_wr > MAX_QP_WR
                || c.max_send_sge > MAX_SGE
                || c.max_recv_sge > MAX_SGE
                || c.max_inline_data > MAX_INLINE
            {
                return null(libc::EINVAL);
            }
            let caps = Caps {
                max_send_wr: c.max_send_wr.max(1),
                max_recv_wr: c.max_recv_wr.max(1),
                max_send_sge: c.max_send_sge.max(1),
                max_recv_sge: c.max_recv_sge.max(1),
                max_inline: c.max_inline_data,
            };
            ia.cap.max_send_wr = caps.max_send_wr;
            ia.cap.max_recv_wr = caps.max_recv_wr;
            ia.cap.max_send_sge = caps.max_send_sge;
            ia.cap.max_recv_sge = caps.max_recv_sge;
            let slot = match sp.ctx.reserve_qpn() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("soft: create_qp: {e}");
                    return null(e.raw_os_error().unwrap_or(libc::EADDRNOTAVAIL));
                }
            };
            // SAFETY: both CQ pointers are live soft CQs (checked non-NULL above).
            let (scq, rcq) =
                unsafe { (&*ia.send_cq.cast::<SoftCq>(), &*ia.recv_cq.cast::<SoftCq>()) };
            let qp = Qp::new(
                Arc::clone(&sp.ctx),
                slot,
                sp.ibv.handle,
                caps,
                ia.sq_sig_all != 0,
                Arc::clone(&scq.cq),
                Arc::clone(&rcq.cq),
            );
            // SAFETY: plain C data; pthread mutex/cond all-zero values are their static initialisers.
            let mut ibv: ibv_qp = unsafe { std::mem::zeroed() };
            ibv.context = sp.ibv.context;
            ibv.qp_context = ia.qp_context;
            ibv.pd = pd;
            ibv.send_cq = ia.send_cq;
            ibv.recv_cq = ia.recv_cq;
            ibv.handle = qp.qpn;
            ibv.qp_num = qp.qpn;
            ibv.state = rdma_sys::ibv_qp_state::IBV_QPS_RESET;
            ibv.qp_type = ibv_qp_type::IBV_QPT_RC;
            let raw: *mut SoftQp = Box::into_raw(Box::new(SoftQp {
                ibv,
                qp: Arc::clone(&qp),
            }));
            qp.ibv.store(raw as usize, Ordering::Release);
            raw.cast()
        },
    )
}

/// `ibv_modify_qp`.
pub unsafe extern "C" fn modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
) -> c_int {
    shield(
        "modify_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP and the caller's attr.
            let (q, a) = unsafe { (qp_of(qp), &*attr) };
            let m = attr_mask as u32;
            let has = |b: rdma_sys::ibv_qp_attr_mask| m & b.0 != 0;
            // SAFETY: reading the `raw` view of the caller's GID union; every bit pattern is valid.
            let dgid = unsafe { a.ah_attr.grh.dgid.raw };
            let attrs = Attrs {
                port: a.port_num,
                pkey_index: a.pkey_index,
                access: a.qp_access_flags,
                path_mtu: a.path_mtu,
                dest_qpn: a.dest_qp_num,
                rq_psn: a.rq_psn,
                sq_psn: a.sq_psn,
                max_dest_rd_atomic: a.max_dest_rd_atomic,
                max_rd_atomic: a.max_rd_atomic,
                min_rnr_timer: a.min_rnr_timer,
                timeout: a.timeout,
                retry_cnt: a.retry_cnt,
                rnr_retry: a.rnr_retry,
                dgid: (a.ah_attr.is_global != 0).then_some(dgid),
                sgid_index: a.ah_attr.grh.sgid_index,
                dlid: a.ah_attr.dlid,
                hop_limit: a.ah_attr.grh.hop_limit,
                traffic_class: a.ah_attr.grh.traffic_class,
                sl: a.ah_attr.sl,
            };
            let state = has(rdma_sys::ibv_qp_attr_mask::IBV_QP_STATE).then_some(a.qp_state);
            let cur = has(rdma_sys::ibv_qp_attr_mask::IBV_QP_CUR_STATE).then_some(a.cur_qp_state);
            match q.modify(&attrs, state, m, cur) {
                Ok(()) => {
                    // SAFETY: a live soft QP; the caller owns it and serialises modify_qp.
                    unsafe { (*qp).state = q.state() };
                    0
                }
                Err(e) => fail(e),
            }
        },
    )
}

/// `ibv_query_qp`: the current state and every attribute set so far.
pub unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _attr_mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    shield(
        "query_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let s = q.attrs();
            // SAFETY: plain C data; all-zero is valid.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.qp_state = q.state();
            a.cur_qp_state = a.qp_state;
            a.path_mtu = s.path_mtu;
            a.rq_psn = s.rq_psn;
            a.sq_psn = s.sq_psn;
            a.dest_qp_num = s.dest_qpn;
            a.qp_access_flags = s.access;
            a.cap.max_send_wr = q.caps.max_send_wr;
            a.cap.max_recv_wr = q.caps.max_recv_wr;
            a.cap.max_send_sge = q.caps.max_send_sge;
            a.cap.max_recv_sge = q.caps.max_recv_sge;
            a.cap.max_inline_data = q.caps.max_inline;
            if let Some(g) = s.dgid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = g;
            }
            a.ah_attr.grh.sgid_index = s.sgid_index;
            a.ah_attr.grh.hop_limit = s.hop_limit;
            a.ah_attr.grh.traffic_class = s.traffic_class;
            a.ah_attr.dlid = s.dlid;
            a.ah_attr.sl = s.sl;
            a.ah_attr.port_num = s.port;
            a.pkey_index = s.pkey_index;
            a.max_rd_atomic = s.max_rd_atomic;
            a.max_dest_rd_atomic = s.max_dest_rd_atomic;
            a.min_rnr_timer = s.min_rnr_timer;
            a.port_num = s.port;
            a.timeout = s.timeout;
            a.retry_cnt = s.retry_cnt;
            a.rnr_retry = s.rnr_retry;
            let cap = a.cap;
            // SAFETY: the caller passed a writable ibv_qp_attr.
            unsafe { *attr = a };
            if !init.is_null() {
                // SAFETY: a live soft QP and the caller's writable init attr.
                unsafe {
                    (*init).qp_context = (*qp).qp_context;
                    (*init).send_cq = (*qp).send_cq;
                    (*init).recv_cq = (*qp).recv_cq;
                    (*init).srq = ptr::null_mut();
                    (*init).cap = cap;
                    (*init).qp_type = ibv_qp_type::IBV_QPT_RC;
                    (*init).sq_sig_all = c_int::from(q.sq_sig_all);
                }
            }
            0
        },
    )
}

/// `ibv_destroy_qp`: stops the QP's threads (its peer sees an orderly goodbye).
pub unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    shield(
        "destroy_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: allocated by create_qp, destroyed once.
            let sq = unsafe { Box::from_raw(qp.cast::<SoftQp>()) };
            sq.qp.destroy();
            0
        },
    )
}

/// Reads an SGE list from the caller.
///
/// # Safety
/// `list` must point at `n` readable `ibv_sge`s (or `n <= 0`).
unsafe fn sges(list: *const ibv_sge, n: c_int) -> Sges {
    if n <= 0 || list.is_null() {
        return Sges::new();
    }
    // SAFETY: per the caller's contract.
    let raw = unsafe { std::slice::from_raw_parts(list, n as usize) };
    raw.iter()
        .map(|s| Sge {
            addr: s.addr,
            len: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// Converts one send WR; `Err(errno)` for what hardware rejects at post time.
///
/// # Safety
/// `wr` must be a readable `ibv_send_wr` whose SGEs (and, for inline sends, their bytes) are
/// readable.
unsafe fn send_wqe(q: &Qp, wr: &ibv_send_wr) -> Result<SendWqe, c_int> {
    use ibv_wr_opcode::*;
    let op = match wr.opcode {
        IBV_WR_RDMA_WRITE => ReqOp::Write,
        IBV_WR_RDMA_WRITE_WITH_IMM => ReqOp::WriteImm,
        IBV_WR_SEND => ReqOp::Send,
        IBV_WR_SEND_WITH_IMM => ReqOp::SendImm,
        IBV_WR_RDMA_READ => ReqOp::Read,
        _ => return Err(libc::EINVAL),
    };
    if wr.num_sge < 0 || wr.num_sge as u32 > q.caps.max_send_sge {
        return Err(libc::EINVAL);
    }
    let signaled = q.sq_sig_all || wr.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
    // SAFETY: per the caller's contract.
    let list = unsafe { sges(wr.sg_list, wr.num_sge) };
    let inline = wr.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0 && op != ReqOp::Read;
    let mut w = SendWqe::new(wr.wr_id, op, signaled, list);
    if inline {
        let total: usize = w.sges.iter().map(|s| s.len as usize).sum();
        if total > q.caps.max_inline as usize {
            return Err(libc::EINVAL);
        }
        let mut data = q.inline_buffer();
        for s in &w.sges {
            // SAFETY: inline SGEs need no key; the caller guarantees the bytes are readable now.
            data.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as *const u8, s.len as usize)
            });
        }
        w.inline = Some(data);
    }
    if matches!(op, ReqOp::Write | ReqOp::WriteImm | ReqOp::Read) {
        // SAFETY: RDMA opcodes use the `rdma` member of the union.
        let rdma = unsafe { wr.wr.rdma };
        w.raddr = rdma.remote_addr;
        w.rkey = rdma.rkey;
    }
    if matches!(op, ReqOp::WriteImm | ReqOp::SendImm) {
        // SAFETY: *_WITH_IMM opcodes use `imm_data`.
        w.imm = unsafe { wr.imm_data_invalidated_rkey_union.imm_data };
    }
    Ok(w)
}

/// `ops.post_send`.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    shield(
        "post_send",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let mut cur = wr;
            while !cur.is_null() {
                // SAFETY: the caller's WR chain is readable; `send_wqe` reads what it points at.
                let r = unsafe { send_wqe(q, &*cur) }.and_then(|w| q.post_send(w));
                if let Err(e) = r {
                    if !bad_wr.is_null() {
                        // SAFETY: the caller passed a writable out-pointer.
                        unsafe { *bad_wr = cur };
                    }
                    return e;
                }
                // SAFETY: readable WR (above).
                cur = unsafe { (*cur).next };
            }
            0
        },
    )
}

/// `ops.post_recv`.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    shield(
        "post_recv",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let mut cur = wr;
            while !cur.is_null() {
                // SAFETY: the caller's WR chain and SGE lists are readable.
                let r = unsafe {
                    let w = &*cur;
                    if w.num_sge < 0 {
                        Err(libc::EINVAL)
                    } else {
                        q.post_recv(RecvWqe {
                            wr_id: w.wr_id,
                            sges: sges(w.sg_list, w.num_sge),
                        })
                    }
                };
                if let Err(e) = r {
                    if !bad_wr.is_null() {
                        // SAFETY: the caller passed a writable out-pointer.
                        unsafe { *bad_wr = cur };
                    }
                    return e;
                }
                // SAFETY: readable WR (above).
                cur = unsafe { (*cur).next };
            }
            0
        },
    )
}

// ---------------------------------------------------------------------------------------------
// ECE: the secret's carrier

/// `ibv_query_ece`: `{SOFT_ECE_VENDOR, this QP's secret, 0}`.
pub unsafe extern "C" fn query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    shield(
        "query_ece",
        || fail(libc::EIO),
        || {
            if qp.is_null() || ece.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP and the caller's writable ibv_ece.
            unsafe {
                *ece = ibv_ece {
                    vendor_id: SOFT_ECE_VENDOR,
                    options: qp_of(qp).secret,
                    comp_mask: 0,
                };
            }
            0
        },
    )
}

/// `ibv_set_ece`: the peer's ECE, i.e. the secret this QP presents when it connects.
pub unsafe extern "C" fn set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    shield(
        "set_ece",
        || fail(libc::EIO),
        || {
            if qp.is_null() || ece.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: the caller's readable ibv_ece.
            let e = unsafe { *ece };
            if e.vendor_id != SOFT_ECE_VENDOR {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP.
            unsafe { qp_of(qp) }.set_peer_secret(e.options);
            0
        },
    )
}

// ---------------------------------------------------------------------------------------------
// Async events

/// `ibv_get_async_event`: blocks (or EAGAIN with `O_NONBLOCK` on `async_fd`).
pub unsafe extern "C" fn get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    shield(
        "get_async_event",
        || {
            set_errno(libc::EIO);
            -1
        },
        || {
            if context.is_null() || event.is_null() {
                return fail(libc::EINVAL);
            }
            // Clone the context's Arc first: the wait below must not touch the context memory, which
            // close_device may free while this thread sleeps.
            // SAFETY: a live soft context at the time of the call.
            let ctx = Arc::clone(unsafe { ctx_of(context) });
            match ctx.events.next() {
                Ok((kind, element)) => {
                    // SAFETY: the caller's writable ibv_async_event.
                    let ev = unsafe { &mut *event };
                    ev.event_type = kind;
                    match element {
                        Element::Cq(p) => ev.element.cq = p as *mut ibv_cq,
                        Element::Qp(p) => ev.element.qp = p as *mut ibv_qp,
                        #[cfg(feature = "fault-injection")]
                        Element::Port(n) => ev.element.port_num = c_int::from(n),
                        #[cfg(feature = "fault-injection")]
                        Element::Device => ev.element.port_num = 0,
                    }
                    0
                }
                Err(e) => {
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    -1
                }
            }
        },
    )
}

/// `ibv_ack_async_event`: nothing to release (events about destroyed objects are dropped at
/// destroy time instead).
pub unsafe extern "C" fn ack_async_event(_event: *mut ibv_async_event) {}

/// `ibv_event_type_str`.
pub unsafe extern "C" fn event_type_str(event: ibv_event_type) -> *const c_char {
    shield(
        "event_type_str",
        || null::<c_char>(libc::EIO).cast_const(),
        || {
            use ibv_event_type::*;
            let s: &'static [u8] = match event {
                IBV_EVENT_CQ_ERR => b"CQ error\0",
                IBV_EVENT_QP_FATAL => b"local work queue catastrophic error\0",
                IBV_EVENT_QP_REQ_ERR => b"invalid request local work queue error\0",
                IBV_EVENT_QP_ACCESS_ERR => b"local access violation work queue error\0",
                IBV_EVENT_COMM_EST => b"communication established\0",
                IBV_EVENT_SQ_DRAINED => b"send queue drained\0",
                IBV_EVENT_PATH_MIG => b"path migrated\0",
                IBV_EVENT_PATH_MIG_ERR => b"path migration request error\0",
                IBV_EVENT_DEVICE_FATAL => b"local catastrophic error\0",
                IBV_EVENT_PORT_ACTIVE => b"port active\0",
                IBV_EVENT_PORT_ERR => b"port error\0",
                IBV_EVENT_LID_CHANGE => b"LID change\0",
                IBV_EVENT_PKEY_CHANGE => b"P_Key change\0",
                IBV_EVENT_SM_CHANGE => b"SM change\0",
                IBV_EVENT_SRQ_ERR => b"SRQ catastrophic error\0",
                IBV_EVENT_SRQ_LIMIT_REACHED => b"SRQ limit reached\0",
                IBV_EVENT_QP_LAST_WQE_REACHED => b"last WQE reached\0",
                IBV_EVENT_CLIENT_REREGISTER => b"client reregistration\0",
                IBV_EVENT_GID_CHANGE => b"GID table change\0",
                IBV_EVENT_WQ_FATAL => b"WQ fatal\0",
            };
            s.as_ptr().cast()
        },
    )
}
