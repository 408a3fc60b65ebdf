//! Memory registrations: `regMr`, `regMrDmaBuf` and `deregMr`, each refusing a pointer type the
//! device did not advertise (crate docs, "GPU memory").

use std::ffi::{c_int, c_void};
use std::os::fd::BorrowedFd;

use ncclwasm_abi::*;
use ncclwasm_transport::{MemHandle, NetError, PTR_CUDA, PTR_DMABUF, PTR_HOST, RegionSource};
use ncclwasm_verbs::{ForeignMemory, Memory};

use crate::comms::{Endpoint, MRS, on_comm};
use crate::edge::{as_handle, guard, null_arg};
use crate::handles::View;

/// NCCL's buffers, registered page-rounded.
pub(crate) struct NcclMemory;

impl RegionSource for NcclMemory {
    fn memory(&self, start: u64, len: u64) -> Memory {
        // SAFETY: NCCL registered a buffer inside these pages and keeps it mapped until deregMr
        // (a page holding one mapped byte is mapped as a whole), and it lets the NIC read and
        // write it — that is what registering it means.
        Memory::Foreign(unsafe { ForeignMemory::new(start as *mut u8, len as usize) })
    }
}

/// A registration handle from NCCL (NULL = none), looked up in the registrations held for the
/// call ([`MRS`]`.view`).
pub(crate) fn mem<'a>(
    mrs: &'a View<'_, MemHandle>,
    mh: *mut c_void,
) -> Result<Option<&'a MemHandle>, NetError> {
    if mh.is_null() {
        return Ok(None);
    }
    mrs.get(mh as usize as u64).map(Some)
}

/// `regMr` on a send or receive communicator: host memory, and GPU memory (`NCCL_PTR_CUDA`)
/// when a peer-memory module lets `ibv_reg_mr` take it (`ptrSupport` says which).
pub(crate) unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMr", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { mh.as_mut() }.ok_or_else(|| null_arg("mhandle"))?;
        *out = std::ptr::null_mut();
        let mr = on_comm(comm, |e| register(e, data, size, ty, None))?;
        *out = as_handle(MRS.insert(mr)?);
        Ok(())
    })
}

/// `regMrDmaBuf`: GPU memory NCCL hands over as a dma-buf fd (`NCCL_PTR_DMABUF`); fd -1 is an
/// ordinary `regMr`, as in net_ib.
pub(crate) unsafe extern "C" fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    offset: u64,
    fd: c_int,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMrDmaBuf", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { mh.as_mut() }.ok_or_else(|| null_arg("mhandle"))?;
        *out = std::ptr::null_mut();
        // SAFETY: NCCL keeps the fd open for the duration of the call; the kernel (or the
        // provider) takes its own reference to the pages.
        let fd = (fd >= 0).then(|| unsafe { BorrowedFd::borrow_raw(fd) });
        let dmabuf = fd.map(|fd| (fd, offset));
        let mr = on_comm(comm, |e| register(e, data, size, ty, dmabuf))?;
        *out = as_handle(MRS.insert(mr)?);
        Ok(())
    })
}

/// Registers NCCL's buffer of pointer type `ty`, from a dma-buf when `dmabuf` is given; a type
/// the device did not advertise in `ptrSupport` is refused, naming it.
fn register(
    comm: &Endpoint,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    dmabuf: Option<(BorrowedFd<'_>, u64)>,
) -> Result<MemHandle, NetError> {
    let (addr, len) = (data as u64, size as u64);
    if len == 0 && dmabuf.is_some() {
        return Err(NetError::Usage(format!(
            "regMrDmaBuf of 0 bytes at {addr:#x}"
        )));
    }
    let ptr_support = match comm {
        Endpoint::Send { comm, .. } => comm.ptr_support(),
        Endpoint::Recv { comm, .. } => comm.ptr_support(),
        Endpoint::Listen(_) => 0,
    };
    let wanted = u32::try_from(ty).unwrap_or(0);
    let allowed = match dmabuf {
        Some(_) => wanted & (PTR_CUDA | PTR_DMABUF) != 0 && ptr_support & PTR_DMABUF != 0,
        None => (wanted == PTR_HOST || wanted == PTR_CUDA) && ptr_support & wanted != 0,
    };
    if !allowed {
        let how = if dmabuf.is_some() {
            "regMrDmaBuf"
        } else {
            "regMr"
        };
        return Err(NetError::Usage(format!(
            "{how} of {size} bytes at {addr:#x} with pointer type {ty:#x}: this device's \
             ptrSupport is {ptr_support:#x}"
        )));
    }
    match (comm, dmabuf) {
        (Endpoint::Send { comm, .. }, None) => comm.reg_mr(addr, len, &NcclMemory),
        (Endpoint::Recv { comm, .. }, None) => comm.reg_mr(addr, len, &NcclMemory),
        (Endpoint::Send { comm, .. }, Some((fd, off))) => comm.reg_mr_dmabuf(addr, len, fd, off),
        (Endpoint::Recv { comm, .. }, Some((fd, off))) => comm.reg_mr_dmabuf(addr, len, fd, off),
        (Endpoint::Listen(_), _) => Err(NetError::Argument("regMr on a listener".into())),
    }
}

/// `deregMr`. NULL is tolerated (NCCL #782); a handle deregistered already is refused, and so
/// is one registered on other devices than `comm`'s, which stays registered: net_ib's
/// `ncclIbDeregMr` looks the handle up in the caches of `comm`'s devices only and fails when it
/// is not there ("could not find mr"), so a registration of another communicator on the same
/// devices is released, one of another device is not.
pub(crate) unsafe extern "C" fn dereg_mr(comm: *mut c_void, mh: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        if mh.is_null() {
            return Ok(());
        }
        let k = mh as usize as u64;
        let registration = MRS.get(k)?;
        on_comm(comm, |e| {
            let holds = match e {
                Endpoint::Send { comm, .. } => comm.holds(&registration),
                Endpoint::Recv { comm, .. } => comm.holds(&registration),
                Endpoint::Listen(_) => false,
            };
            if holds {
                Ok(())
            } else {
                Err(NetError::Usage(format!(
                    "memory registration {k:#x} was made on other devices than this \
                     communicator's; deregister it through a communicator of its devices \
                     (it stays registered)"
                )))
            }
        })?;
        drop(registration);
        MRS.remove(k, |_| true)
    })
}
