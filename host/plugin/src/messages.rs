//! The data path's entry points: `isend`, `irecv`, `iflush` and `test`, one body each for every
//! version (the shims in `v8` … `v12` pass their own integer widths). They run per message, so
//! nothing here allocates: NCCL's arrays are read into fixed arrays and a request handle is its
//! communicator's key and pool index.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;
use ncclwasm_transport::{Done, MAX_RECVS, MemHandle, NetError, RecvBuf};

use crate::comms::{COMMS, Endpoint, MRS, on_recv, on_send};
use crate::edge::{MAX_BYTES, guard, key, null_arg};
use crate::handles::{RequestKey, View};
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
        *out = MRS.view(|mrs| {
            let mr = mem(mrs, mh)?;
            on_send(comm, |s, requests, k| {
                let id =
                    s.isend_profiled(data as u64, size as u64, tag as u32, mr, phandle as usize)?;
                Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
            })
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

/// The `n` buffers NCCL passes to `irecv`/`iflush` as parallel arrays (`tags` is NULL for a
/// flush), each with its registration from `mrs`, read into the caller's fixed array `bufs` in
/// place: both run per message, so nothing is allocated or moved. Returns `n`.
///
/// # Safety
/// Every non-NULL array holds `n` entries.
unsafe fn recv_args<'a>(
    call: &str,
    n: c_int,
    arrays: &RecvArrays,
    mrs: &'a View<'_, MemHandle>,
    bufs: &mut [RecvBuf<'a>; MAX_RECVS],
) -> Result<usize, NetError> {
    let RecvArrays {
        data,
        sizes,
        tags,
        mhandles,
        ..
    } = *arrays;
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
    for (i, buf) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: every array holds n entries (the contract), `tags` only when non-NULL.
        let (addr, size, tag, mh) = unsafe {
            let size = match sizes {
                Sizes::Int(p) => p.add(i).read().max(0) as u64,
                Sizes::Size(p) => p.add(i).read() as u64,
            };
            let tag = if tags.is_null() { 0 } else { *tags.add(i) };
            (*data.add(i), size, tag, *mhandles.add(i))
        };
        *buf = RecvBuf {
            addr: addr as u64,
            size,
            tag: tag as u32,
            mr: mem(mrs, mh)?,
        };
    }
    Ok(n)
}

/// No buffer yet: what `recv_args` fills.
const NO_BUF: RecvBuf<'static> = RecvBuf {
    addr: 0,
    size: 0,
    tag: 0,
    mr: None,
};

/// `irecv`: `*request` is overwritten on every path, including NCCL's 0x1 sentinel
/// (`NCCL_NET_OPTIONAL_RECV_COMPLETION`, a hint this plugin does not use).
pub(crate) fn irecv_impl(
    comm: *mut c_void,
    n: c_int,
    arrays: RecvArrays,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        // NCCL may have stored its `NCCL_NET_OPTIONAL_RECV_COMPLETION` hint (0x1) here; every
        // receive completes normally, so the slot is simply overwritten on every path.
        *out = std::ptr::null_mut();
        if arrays.tags.is_null() {
            return Err(null_arg("irecv tags"));
        }
        *out = MRS.view(|mrs| {
            let mut bufs = [NO_BUF; MAX_RECVS];
            // SAFETY: NCCL's arrays of n entries.
            let n = unsafe { recv_args("irecv", n, &arrays, mrs, &mut bufs) }?;
            let mut parents = [0usize; MAX_RECVS];
            if !arrays.phandles.is_null() {
                for (i, p) in parents.iter_mut().enumerate().take(n) {
                    // SAFETY: a non-NULL `phandles` holds n entries (the contract).
                    *p = unsafe { *arrays.phandles.add(i) } as usize;
                }
            }
            on_recv(comm, |r, requests, k| {
                let id = r.irecv_profiled(&bufs[..n], &parents[..n])?;
                Ok(requests.issue(k, id))
            })
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
        // A flush has no tags and no profiler handles.
        let arrays = RecvArrays {
            data,
            sizes: Sizes::Int(sizes),
            tags: std::ptr::null_mut(),
            mhandles,
            phandles: std::ptr::null_mut(),
        };
        *out = MRS.view(|mrs| {
            let mut bufs = [NO_BUF; MAX_RECVS];
            // SAFETY: NCCL's arrays of n entries.
            let n = unsafe { recv_args("iflush", n, &arrays, mrs, &mut bufs) }?;
            on_recv(comm, |r, requests, k| {
                let id = r.iflush(&bufs[..n])?;
                Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
            })
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
