//! The data path's entry points: `isend`, `irecv`, `iflush` and `test`, one body each for every
//! version (the shims in `v8` … `v12` pass their own integer widths). They run per message, so
//! nothing here allocates: NCCL's arrays are read into fixed arrays and a request handle is its
//! communicator's key and pool index.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;
use ncclwasm_transport::{Done, MAX_RECVS, MemHandle, NetError, RecvBuf};

use crate::comms::{COMMS, Endpoint, on_recv, on_send};
use crate::edge::{MAX_BYTES, guard, key, null_arg};
use crate::handles::{Held, RequestKey};
use crate::memory::mem;

pub(crate) fn isend_impl(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        *out = std::ptr::null_mut();
        if size > MAX_BYTES {
            return Err(NetError::Argument(format!(
                "isend of {size} bytes; a message is at most {MAX_BYTES} bytes (`test` reports sizes as int)"
            )));
        }
        let mr = mem(mh)?;
        *out = on_send(comm, |s, requests, k| {
            let id = s.isend_profiled(
                data as u64,
                size as u64,
                tag as u32,
                mr.as_deref(),
                phandle as usize,
            )?;
            Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
        })?;
        Ok(())
    })
}

/// NCCL's parallel arrays of one `irecv`, `n` entries each: buffers, sizes, tags, memory
/// handles and profiler handles (NULL before v10, or when NCCL profiles nothing).
#[derive(Clone, Copy)]
pub(crate) struct RecvArrays {
    pub(crate) data: *mut *mut c_void,
    pub(crate) sizes: Sizes,
    pub(crate) tags: *mut c_int,
    pub(crate) mhandles: *mut *mut c_void,
    pub(crate) phandles: *mut *mut c_void,
}

/// The sizes array of `irecv`/`iflush`: `size_t` from v9 on, `int` in v8 and in every `iflush`.
#[derive(Clone, Copy)]
pub(crate) enum Sizes {
    Int(*mut c_int),
    Size(*mut usize),
}

/// One buffer NCCL passes to `irecv`/`iflush`, its registration held for the call.
#[derive(Default)]
struct Arg {
    addr: u64,
    size: u64,
    tag: u32,
    mr: Option<Held<MemHandle>>,
}

/// The `n` buffers NCCL passes to `irecv`/`iflush` as parallel arrays (`tags` is NULL for a
/// flush), read into the caller's fixed array `args` (filled in place, not returned: the
/// array is moved nowhere): both run per message, so nothing is allocated. Returns `n`.
///
/// # Safety
/// Every non-NULL array holds `n` entries.
unsafe fn recv_args(
    call: &str,
    n: c_int,
    data: *mut *mut c_void,
    sizes: Sizes,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    args: &mut [Arg; MAX_RECVS],
) -> Result<usize, NetError> {
    let n = usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| NetError::Argument(format!("{call} of {n} buffers")))?;
    let sizes_null = match sizes {
        Sizes::Int(p) => p.is_null(),
        Sizes::Size(p) => p.is_null(),
    };
    if data.is_null() || sizes_null || mhandles.is_null() {
        return Err(null_arg("data, sizes or mhandles"));
    }
    for (i, arg) in args.iter_mut().enumerate().take(n) {
        // SAFETY: every array holds n entries (the contract), `tags` only when non-NULL.
        let (addr, size, tag, mh) = unsafe {
            let size = match sizes {
                Sizes::Int(p) => p.add(i).read().max(0) as u64,
                Sizes::Size(p) => p.add(i).read() as u64,
            };
            let tag = if tags.is_null() { 0 } else { *tags.add(i) };
            (*data.add(i), size, tag, *mhandles.add(i))
        };
        *arg = Arg {
            addr: addr as u64,
            size,
            tag: tag as u32,
            mr: mem(mh)?,
        };
    }
    Ok(n)
}

/// Runs `f` on the transport's view of the buffers `recv_args` read.
fn with_recv_bufs<R>(args: &[Arg], f: impl FnOnce(&[RecvBuf<'_>]) -> R) -> R {
    let mut bufs = [RecvBuf {
        addr: 0,
        size: 0,
        tag: 0,
        mr: None,
    }; MAX_RECVS];
    for (b, a) in bufs.iter_mut().zip(args) {
        *b = RecvBuf {
            addr: a.addr,
            size: a.size,
            tag: a.tag,
            mr: a.mr.as_deref(),
        };
    }
    f(&bufs[..args.len()])
}

/// `irecv`: `*request` is overwritten on every path, including NCCL's 0x1 sentinel
/// (`NCCL_NET_OPTIONAL_RECV_COMPLETION`, a hint this plugin does not use).
pub(crate) fn irecv_impl(
    comm: *mut c_void,
    n: c_int,
    arrays: RecvArrays,
    request: *mut *mut c_void,
) -> NcclResult {
    let RecvArrays {
        data,
        sizes,
        tags,
        mhandles,
        phandles,
    } = arrays;
    guard("irecv", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        // NCCL may have stored its `NCCL_NET_OPTIONAL_RECV_COMPLETION` hint (0x1) here; every
        // receive completes normally, so the slot is simply overwritten on every path.
        *out = std::ptr::null_mut();
        if tags.is_null() {
            return Err(null_arg("irecv tags"));
        }
        let mut args: [Arg; MAX_RECVS] = Default::default();
        // SAFETY: NCCL's arrays of n entries.
        let n = unsafe { recv_args("irecv", n, data, sizes, tags, mhandles, &mut args) }?;
        let mut parents = [0usize; MAX_RECVS];
        if !phandles.is_null() {
            for (i, p) in parents.iter_mut().enumerate().take(n) {
                // SAFETY: a non-NULL `phandles` holds n entries (the contract).
                *p = unsafe { *phandles.add(i) } as usize;
            }
        }
        *out = on_recv(comm, |r, requests, k| {
            let id = with_recv_bufs(&args[..n], |bufs| r.irecv_profiled(bufs, &parents[..n]))?;
            Ok(requests.issue(k, id))
        })?;
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn iflush(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        *out = std::ptr::null_mut();
        let mut args: [Arg; MAX_RECVS] = Default::default();
        // SAFETY: NCCL's arrays of n entries (a flush has no tags).
        let n = unsafe {
            recv_args(
                "iflush",
                n,
                data,
                Sizes::Int(sizes),
                std::ptr::null_mut(),
                mhandles,
                &mut args,
            )
        }?;
        *out = on_recv(comm, |r, requests, k| {
            let id = with_recv_bufs(&args[..n], |bufs| r.iflush(bufs))?;
            Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
        })?;
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let done = unsafe { done.as_mut() }.ok_or_else(|| null_arg("done"))?;
        *done = 0;
        key(request, "request")?;
        let req = RequestKey::decode(request)?;
        let result = COMMS.with_brief(req.comm, |e| {
            let (requests, result) = match e {
                Endpoint::Send { comm, requests } if requests.current(&req) => {
                    (requests, comm.test(req.id)?)
                }
                Endpoint::Recv { comm, requests } if requests.current(&req) => {
                    (requests, comm.test(req.id)?)
                }
                _ => return Err(req.stale()),
            };
            if result.is_some() {
                requests.retire(&req);
            }
            Ok(result)
        })?;
        let Some(result) = result else {
            return Ok(());
        };
        *done = 1;
        if sizes.is_null() {
            return Ok(());
        }
        match result {
            // SAFETY: a send's `sizes` points at one int.
            Done::Send { size } => unsafe { *sizes = size as c_int },
            Done::Recv { n, sizes: got } => {
                for (i, s) in got.iter().take(n).enumerate() {
                    // SAFETY: a receive's `sizes` has one int per grouped receive.
                    unsafe { *sizes.add(i) = *s as c_int };
                }
            }
            Done::Flush => {}
        }
        Ok(())
    })
}
