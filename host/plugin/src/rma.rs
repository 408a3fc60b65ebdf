//! The one-sided tables' bodies (`ncclRmaPlugin_v14` … `_v16`, in `rma_v14` … `rma_v16`): NCCL's
//! RMA proxy finds them in this library when `NCCL_RMA_PLUGIN` names none, and they run on the
//! same context, device table, policy and verbs path as the net tables
//! (`ncclwasm_transport::rma`).
//!
//! Every object NCCL holds is a generation-checked key, as for the net tables: collective
//! communicators, contexts, symmetric registrations and requests, each in its own table, so a
//! handle of one kind passed for another, or used after it was closed, is refused. Closing in any
//! order is safe — a context, a registration and a request each hold what they use — and a
//! context destroyed with requests in flight stops waiting for them (their keys go stale).
//!
//! `init` and `finalize` are the net tables' (a context counted like a v11+ one); `connect`
//! takes whatever context NCCL passes (2.30 passes its net plugin's, not the RMA one).

use std::ffi::{c_int, c_void};
use std::os::fd::BorrowedFd;

use ncclwasm_abi::*;
use ncclwasm_transport::{
    HANDLE_SIZE, NetError, PTR_CUDA, PTR_HOST, PutSignal, RmaColl, RmaConfig, RmaCtx, RmaReq,
    SignalOp, SymMr,
};

use crate::comms::{COMMS, Endpoint};
use crate::context::{config, init_ctx, net};
use crate::edge::{as_handle, guard, key, not_a, null_arg};
use crate::handles::{Handles, Held};
use crate::memory::NcclMemory;

/// `NCCL_GIN_IB_TC`: the traffic class of one-sided connections when NCCL's config leaves it
/// undefined (NCCL's proxy reads it before `NCCL_IB_TC`, which the plan's default reads).
const ENV_GIN_TC: &str = "NCCL_GIN_IB_TC";

static COLLS: Handles<RmaColl> = Handles::new("collective communicator");
static CONTEXTS: Handles<RmaCtx> = Handles::new("one-sided context");
static SYMS: Handles<SymMr> = Handles::new("symmetric registration");
/// A request, with the context that runs it.
static REQUESTS: Handles<(RmaCtx, RmaReq)> = Handles::new("one-sided request");

/// Writes NULL through `out` (refusing a NULL `out`), so it is written on every path.
fn cleared<'a>(out: *mut *mut c_void, what: &str) -> Result<&'a mut *mut c_void, NetError> {
    // SAFETY: NCCL passes a valid out-pointer (or NULL, refused).
    let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg(what))?;
    *out = std::ptr::null_mut();
    Ok(out)
}

fn sym(mh: *mut c_void, what: &str) -> Result<Held<SymMr>, NetError> {
    SYMS.get(key(mh, what)?)
}

pub(crate) unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    logger: Logger,
) -> NcclResult {
    init_ctx(ctx, comm_id, std::ptr::null_mut(), logger, None, 8)
}

/// `getProperties`: the net tables' v12 properties, as a GIN proxy device (what NCCL's own
/// proxy reports, and what its v13 loader requires).
pub(crate) unsafe extern "C" fn get_properties(dev: c_int, out: *mut PropsV12) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        *out = PropsV12 {
            net_device_type: NCCL_NET_DEVICE_GIN_PROXY,
            ..crate::v12::props_v12(dev)?
        };
        Ok(())
    })
}

/// `getRmaProperties` (v16): no signal makes other peers' puts visible — a signal is ordered
/// after its own lane's work only — so NCCL keeps its per-peer flush.
pub(crate) unsafe extern "C" fn get_rma_properties(
    coll: *mut c_void,
    out: *mut RmaPropertiesV16,
) -> NcclResult {
    guard("getRmaProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        COLLS.get(key(coll, "collComm")?)?;
        *out = RmaPropertiesV16 {
            flushes_all_puts_on_any_signal: false,
        };
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn listen(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> NcclResult {
    crate::comms::listen_impl(dev, handle, listen_comm, || config(ctx).map(drop))
}

/// `connect`: collective and blocking, as NCCL's proxy calls it on every rank at once.
pub(crate) unsafe extern "C" fn connect(
    _ctx: *mut c_void,
    handles: *mut *mut c_void,
    nranks: c_int,
    rank: c_int,
    listen_comm: *mut c_void,
    coll: *mut *mut c_void,
) -> NcclResult {
    guard("connect", || {
        let out = cleared(coll, "collComm")?;
        let n = usize::try_from(nranks)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| NetError::Argument(format!("nranks {nranks}")))?;
        let rank = usize::try_from(rank)
            .ok()
            .filter(|&r| r < n)
            .ok_or_else(|| NetError::Argument(format!("rank {rank} of {nranks}")))?;
        if handles.is_null() {
            return Err(null_arg("handles"));
        }
        let mut all = vec![[0u8; HANDLE_SIZE]; n];
        for (r, h) in all.iter_mut().enumerate() {
            // SAFETY: NCCL passes `nranks` handle pointers, each to NCCL_NET_HANDLE_MAXSIZE
            // (128) bytes.
            let p = unsafe { *handles.add(r) };
            if p.is_null() {
                return Err(null_arg(&format!("handles[{r}]")));
            }
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), h.as_mut_ptr(), HANDLE_SIZE) };
        }
        let lk = key(listen_comm, "listenComm")?;
        let coll_comm = COMMS.with(lk, |e| match e {
            Endpoint::Listen(l) => {
                let mut l = l
                    .lock()
                    .map_err(|_| NetError::Internal("a listener's lock is poisoned".into()))?;
                net()?.rma_connect(&all, rank, &mut l, 0)
            }
            _ => Err(not_a(lk, "listener")),
        })?;
        *out = as_handle(COLLS.insert(coll_comm)?);
        Ok(())
    })
}

/// `createContext`: collective. The traffic class is NCCL's config's, else `NCCL_GIN_IB_TC`,
/// else the plan's default (`NCCL_IB_TC`).
pub(crate) unsafe extern "C" fn create_context(
    coll: *mut c_void,
    config: *mut RmaConfigV14,
    rma_ctx: *mut *mut c_void,
) -> NcclResult {
    guard("createContext", || {
        let out = cleared(rma_ctx, "rmaCtx")?;
        // SAFETY: NULL or NCCL's config, valid for the call.
        let c = unsafe { config.as_ref() }.ok_or_else(|| null_arg("config"))?;
        let traffic_class = match c.traffic_class {
            -1 => std::env::var(ENV_GIN_TC)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(-1),
            tc => tc,
        };
        let (Ok(contexts), Ok(rank_stride)) =
            (u32::try_from(c.n_contexts), u32::try_from(c.rank_stride))
        else {
            return Err(NetError::Argument(format!(
                "createContext with {} contexts and rank stride {}",
                c.n_contexts, c.rank_stride
            )));
        };
        let ctx = COLLS
            .get(key(coll, "collComm")?)?
            .create_context(RmaConfig {
                contexts,
                traffic_class,
                rank_stride,
            })?;
        *out = as_handle(CONTEXTS.insert(ctx)?);
        Ok(())
    })
}

/// `regMrSym` (and `regMrSymDmaBuf` with an fd): host memory, and GPU memory as `ptrSupport`
/// says, as the net tables' `regMr`.
fn reg_sym(
    coll: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    dmabuf: Option<(BorrowedFd<'_>, u64)>,
    mh: *mut *mut c_void,
) -> Result<(), NetError> {
    let out = cleared(mh, "mhandle")?;
    let coll = COLLS.get(key(coll, "collComm")?)?;
    let (addr, len) = (data as u64, size as u64);
    let support = coll.ptr_support();
    let wanted = u32::try_from(ty).unwrap_or(0);
    let allowed = match dmabuf {
        Some(_) => support & ncclwasm_transport::PTR_DMABUF != 0,
        None => (wanted == PTR_HOST || wanted == PTR_CUDA) && support & wanted != 0,
    };
    if !allowed {
        return Err(NetError::Usage(format!(
            "symmetric registration of {size} bytes at {addr:#x} with pointer type {ty:#x}: \
             this device's ptrSupport is {support:#x}"
        )));
    }
    let mr = match dmabuf {
        None => coll.reg_mr_sym(addr, len, &NcclMemory)?,
        Some((fd, off)) => coll.reg_mr_sym_dmabuf(addr, len, fd, off)?,
    };
    *out = as_handle(SYMS.insert(mr)?);
    Ok(())
}

pub(crate) unsafe extern "C" fn reg_mr_sym(
    coll: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    _mr_flags: u64,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMrSym", || reg_sym(coll, data, size, ty, None, mh))
}

pub(crate) unsafe extern "C" fn reg_mr_sym_dma_buf(
    coll: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    offset: u64,
    fd: c_int,
    _mr_flags: u64,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMrSymDmaBuf", || {
        // SAFETY: NCCL keeps the fd open for the duration of the call; the kernel (or the
        // provider) takes its own reference to the pages.
        let fd = (fd >= 0).then(|| unsafe { BorrowedFd::borrow_raw(fd) });
        reg_sym(coll, data, size, ty, fd.map(|fd| (fd, offset)), mh)
    })
}

/// `deregMrSym`: NULL is tolerated; a registration of another communicator is refused.
pub(crate) unsafe extern "C" fn dereg_mr_sym(coll: *mut c_void, mh: *mut c_void) -> NcclResult {
    guard("deregMrSym", || {
        if mh.is_null() {
            return Ok(());
        }
        let k = key(mh, "mhandle")?;
        let coll = COLLS.get(key(coll, "collComm")?)?;
        let mine = coll.holds(&*SYMS.get(k)?);
        match mine {
            true => SYMS.remove(k, |_| true),
            false => Err(NetError::Usage(format!(
                "symmetric registration {k:#x} belongs to another collective communicator"
            ))),
        }
    })
}

/// Closes an object of `table`; NULL is tolerated, a closed one refused.
fn close<T>(table: &Handles<T>, h: *mut c_void) -> Result<(), NetError> {
    match h.is_null() {
        true => Ok(()),
        false => table.remove(key(h, "handle")?, |_| true),
    }
}

pub(crate) unsafe extern "C" fn destroy_context(rma_ctx: *mut c_void) -> NcclResult {
    guard("destroyContext", || close(&CONTEXTS, rma_ctx))
}

pub(crate) unsafe extern "C" fn close_coll(coll: *mut c_void) -> NcclResult {
    guard("closeColl", || close(&COLLS, coll))
}

/// Runs `op` on the context `rma_ctx` and hands NCCL the request it made.
fn issue(
    rma_ctx: *mut c_void,
    request: *mut *mut c_void,
    op: impl FnOnce(&RmaCtx) -> Result<RmaReq, NetError>,
) -> Result<(), NetError> {
    let out = cleared(request, "request")?;
    let ctx = CONTEXTS.get(key(rma_ctx, "rmaCtx")?)?;
    let req = op(&ctx)?;
    *out = as_handle(REQUESTS.insert(((*ctx).clone(), req))?);
    Ok(())
}

fn index(v: c_int, what: &str) -> Result<usize, NetError> {
    usize::try_from(v).map_err(|_| NetError::Argument(format!("{what} {v}")))
}

/// `iput`, in v14's shape (v15+ add `optFlags`, which needs nothing: each request is posted at
/// once, which is what aggregating would allow us to defer).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn iput(
    rma_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src: *mut c_void,
    size: usize,
    dst_off: u64,
    dst: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iput", || {
        issue(rma_ctx, request, |ctx| {
            let (s, d) = (sym(src, "srcMhandle")?, sym(dst, "dstMhandle")?);
            let c = index(context, "context")?;
            ctx.put(
                c,
                &s,
                src_off,
                size as u64,
                &d,
                dst_off,
                rank as usize,
                None,
            )
        })
    })
}

/// `iputSignal`: the put, then the signal (`NCCL_NET_SIGNAL_OP_INC` or `_ADD`); a size of 0
/// is a signal alone (the source and destination may then be NULL).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn iput_signal(
    rma_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src: *mut c_void,
    size: usize,
    dst_off: u64,
    dst: *mut c_void,
    rank: u32,
    signal_off: u64,
    signal: *mut c_void,
    value: u64,
    op: u32,
    strong: bool,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iputSignal", || {
        let op = match op {
            NCCL_NET_SIGNAL_OP_INC => SignalOp::Inc,
            NCCL_NET_SIGNAL_OP_ADD => SignalOp::Add(value),
            other => {
                return Err(NetError::Argument(format!(
                    "signal operation {other} (NCCL_NET_SIGNAL_OP_INC is 1, _ADD 2)"
                )));
            }
        };
        issue(rma_ctx, request, |ctx| {
            let sig = sym(signal, "signalMhandle")?;
            // A signal alone may name no data buffers: the signal's registration stands in
            // (the put is empty, so nothing of it is touched).
            let data = |mh: *mut c_void, what| match size == 0 && mh.is_null() {
                true => Ok(None),
                false => sym(mh, what).map(Some),
            };
            let (s, d) = (data(src, "srcMhandle")?, data(dst, "dstMhandle")?);
            let c = index(context, "context")?;
            let (s, d) = (s.as_deref().unwrap_or(&sig), d.as_deref().unwrap_or(&sig));
            let signal = Some(PutSignal {
                mr: &sig,
                off: signal_off,
                op,
                strong,
            });
            ctx.put(
                c,
                s,
                src_off,
                size as u64,
                d,
                dst_off,
                rank as usize,
                signal,
            )
        })
    })
}

/// `iget`; `optFlags` as for [`iput`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn iget(
    rma_ctx: *mut c_void,
    context: c_int,
    remote_off: u64,
    remote: *mut c_void,
    size: usize,
    local_off: u64,
    local: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iget", || {
        issue(rma_ctx, request, |ctx| {
            let (r, l) = (sym(remote, "remoteMhandle")?, sym(local, "localMhandle")?);
            let c = index(context, "context")?;
            ctx.get(c, &r, remote_off, size as u64, &l, local_off, rank as usize)
        })
    })
}

pub(crate) unsafe extern "C" fn iflush(
    rma_ctx: *mut c_void,
    context: c_int,
    mh: *mut c_void,
    rank: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        issue(rma_ctx, request, |ctx| {
            let m = sym(mh, "mhandle")?;
            ctx.flush(index(context, "context")?, &m, rank as usize)
        })
    })
}

/// `test`: `*done` 1 once the request completed (its key then goes stale); a failed request
/// is reported once, with its failure, and forgotten.
pub(crate) unsafe extern "C" fn test(
    _coll: *mut c_void,
    request: *mut c_void,
    done: *mut c_int,
) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes a valid out-pointer (or NULL, refused).
        let done = unsafe { done.as_mut() }.ok_or_else(|| null_arg("done"))?;
        *done = 0;
        let k = key(request, "request")?;
        let r = REQUESTS.get(k)?;
        let (ctx, req) = &*r;
        let finished = ctx.test(*req);
        if !matches!(finished, Ok(false)) {
            drop(r);
            REQUESTS.remove(k, |_| true)?;
        }
        *done = c_int::from(finished?);
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn rma_progress(rma_ctx: *mut c_void) -> NcclResult {
    guard("rmaProgress", || {
        CONTEXTS.get(key(rma_ctx, "rmaCtx")?)?.progress()
    })
}

/// `queryLastError`: whether any connection of the context failed (the failure itself was
/// WARNed by the call that met it).
pub(crate) unsafe extern "C" fn query_last_error(
    rma_ctx: *mut c_void,
    has_error: *mut bool,
) -> NcclResult {
    guard("queryLastError", || {
        // SAFETY: NCCL passes a valid out-pointer (or NULL, refused).
        let out = unsafe { has_error.as_mut() }.ok_or_else(|| null_arg("hasError"))?;
        *out = false;
        *out = CONTEXTS
            .get(key(rma_ctx, "rmaCtx")?)?
            .last_error()
            .is_some();
        Ok(())
    })
}
