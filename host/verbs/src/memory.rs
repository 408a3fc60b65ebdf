//! Protection domains, memory the device may touch, and memory regions.

use std::alloc::Layout;
use std::fmt;
use std::ops::BitOr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ibverbs_sys::{ibv_mr, ibv_pd};

use crate::device::Context;
use crate::error::{Result, VerbsError, check, last_errno};
use crate::wr::Sge;

/// `ibv_access_flags` of an MR or a QP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    pub const NONE: Access = Access(0);
    pub const LOCAL_WRITE: Access = Access(1);
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    pub const REMOTE_READ: Access = Access(1 << 2);
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// PCIe relaxed ordering (`IBV_ACCESS_RELAXED_ORDERING`, needs `reg_mr_iova2`).
    pub const RELAXED_ORDERING: Access = Access(1 << 20);

    pub fn bits(self) -> u32 {
        self.0
    }

    /// The flags as the `int` most registration verbs take; flags past `INT_MAX` are refused.
    pub(crate) fn c_bits(self) -> crate::Result<c_int> {
        c_int::try_from(self.0)
            .map_err(|_| VerbsError::Invalid(format!("access flags {:#x}", self.0)))
    }

    /// `self | other`, usable in constants.
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        self.union(rhs)
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd {
    pub(crate) ctx: Arc<Context>,
    pub(crate) pd: NonNull<ibv_pd>,
}

// SAFETY: verbs objects are thread-safe (table contract); the pointer is owned by this value.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of this PD, so none is left.
        let rc = unsafe { (self.ctx.table().dealloc_pd)(self.pd.as_ptr()) };
        if let Err(e) = check(rc, "dealloc_pd", || self.ctx.name().to_owned()) {
            tracing::warn!("{e}");
        }
    }
}

impl Context {
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>> {
        // SAFETY: live context.
        let pd = unsafe { (self.table().alloc_pd)(self.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::Verb {
            verb: "alloc_pd",
            object: self.name().to_owned(),
            errno: last_errno(),
        })?;
        Ok(Arc::new(Pd {
            ctx: Arc::clone(self),
            pd,
        }))
    }
}

/// Page-aligned, zeroed memory owned by Rust, for buffers the transport itself registers
/// (FIFOs, flush targets) and for tests.
///
/// It is an anonymous private mapping rather than a heap block: the kernel hands out zeroed
/// pages on first touch, so a connection's 128 KiB CTS FIFO costs neither a `memset` nor
/// resident memory until its slots are used (a heap block must be zeroed by hand, and that was
/// a tenth of the CPU of setting up 1024 connections).
///
/// Once registered, the device (or a remote peer) may write it at any time, like another
/// thread would; so it is never handed out as `&mut [u8]`, only copied in and out.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the allocation is owned; access goes through copies (see the type docs).
unsafe impl Send for DmaBuf {}
// SAFETY: as above.
unsafe impl Sync for DmaBuf {}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DmaBuf({:p}, {} bytes)", self.ptr, self.len)
    }
}

const PAGE: usize = 4096;

impl DmaBuf {
    pub fn new(len: usize) -> Arc<DmaBuf> {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; no existing memory
        // is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::mapped(len),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let ptr = NonNull::new(ptr.cast::<u8>())
            .filter(|_| ptr != libc::MAP_FAILED)
            .unwrap_or_else(|| {
                let layout = Layout::from_size_align(Self::mapped(len), PAGE);
                std::alloc::handle_alloc_error(layout.expect("buffer size fits isize"))
            });
        Arc::new(DmaBuf { ptr, len })
    }

    /// The mapping's length: whole pages, at least one.
    fn mapped(len: usize) -> usize {
        len.max(1).div_ceil(PAGE) * PAGE
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address the device sees (`ibv_mr.addr` for a plain registration).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn check(&self, offset: usize, n: usize) {
        assert!(
            offset.checked_add(n).is_some_and(|e| e <= self.len),
            "DmaBuf range {offset}+{n} beyond {}",
            self.len
        );
    }

    /// Copies `data` in at `offset`; panics when the range is out of bounds.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: the range is inside the allocation; raw copies do not create references that
        // a concurrent device write could invalidate.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
    }

    /// Copies out into `out` from `offset`; panics when the range is out of bounds.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }

    /// Reads the little-endian 8-byte word at `offset` with acquire ordering: how to poll a flag
    /// that a peer's RDMA WRITE sets. A plain copy could tear against the device's write, and
    /// the reads that follow it (the rest of the slot the flag guards) could be done before it.
    /// Panics when the range is out of bounds or `offset` is not 8-byte aligned in memory.
    pub fn load_u64_acquire(&self, offset: usize) -> u64 {
        self.check(offset, 8);
        let word = self.ptr.as_ptr().wrapping_add(offset).cast::<u64>();
        assert!(
            word.is_aligned(),
            "DmaBuf word at {offset} is not 8-byte aligned"
        );
        // SAFETY: the word is inside the allocation (checked), aligned (checked), and the
        // allocation outlives this call; the host only ever reads it atomically.
        let value = unsafe { AtomicU64::from_ptr(word) }.load(Ordering::Acquire);
        u64::from_le(value)
    }

    /// Stores the little-endian 8-byte word at `offset` with release ordering: how to publish
    /// a record a peer reads by RDMA READ, after the host writes it depends on, and in one
    /// piece. Panics when the range is out of bounds or `offset` is not 8-byte aligned.
    pub fn store_u64_release(&self, offset: usize, value: u64) {
        self.check(offset, 8);
        let word = self.ptr.as_ptr().wrapping_add(offset).cast::<u64>();
        assert!(
            word.is_aligned(),
            "DmaBuf word at {offset} is not 8-byte aligned"
        );
        // SAFETY: as in `load_u64_acquire`; the host only ever writes it atomically.
        unsafe { AtomicU64::from_ptr(word) }.store(value.to_le(), Ordering::Release);
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v);
        v
    }

    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole allocation, as in `write`.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.len) };
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; MRs over it hold the Arc, so no device
        // access remains.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), Self::mapped(self.len)) };
    }
}

/// Memory owned by someone else (NCCL's buffers), vouched for by the caller.
#[derive(Debug)]
pub struct ForeignMemory {
    addr: *mut u8,
    len: usize,
}

// SAFETY: a plain address range; the creator vouched for its validity from any thread.
unsafe impl Send for ForeignMemory {}
// SAFETY: as above.
unsafe impl Sync for ForeignMemory {}

impl ForeignMemory {
    /// # Safety
    /// `[addr, addr+len)` must stay mapped and may be read and written by the device and by
    /// remote peers (per the MR's access flags) until the [`Mr`] registered over it is dropped.
    pub unsafe fn new(addr: *mut u8, len: usize) -> ForeignMemory {
        ForeignMemory { addr, len }
    }
}

/// What an MR covers; keeps owned memory alive as long as the registration.
#[derive(Debug)]
pub enum Memory {
    Owned(Arc<DmaBuf>),
    Foreign(ForeignMemory),
}

impl From<Arc<DmaBuf>> for Memory {
    fn from(b: Arc<DmaBuf>) -> Memory {
        Memory::Owned(b)
    }
}

impl From<ForeignMemory> for Memory {
    fn from(f: ForeignMemory) -> Memory {
        Memory::Foreign(f)
    }
}

impl Memory {
    fn range(&self) -> (*mut u8, usize) {
        match self {
            Memory::Owned(b) => (b.ptr.as_ptr(), b.len),
            Memory::Foreign(f) => (f.addr, f.len),
        }
    }

    /// The CPU address of the first byte: the IOVA that makes `reg_mr_iova2` address this memory
    /// as `reg_mr` would (what NCCL passes; the memory may start before the range asked for).
    pub fn addr(&self) -> u64 {
        self.range().0 as u64
    }
}

/// A registered memory region.
#[derive(Debug)]
pub struct Mr {
    pd: Arc<Pd>,
    mr: NonNull<ibv_mr>,
    /// `None` for dma-buf registrations, which have no CPU mapping.
    _memory: Option<Memory>,
    /// Whether SGE addresses of this MR are CPU addresses (false for a foreign IOVA or dma-buf),
    /// which is what inline sends read.
    cpu_addressed: bool,
    addr: u64,
    len: u64,
    lkey: u32,
    rkey: u32,
}

// SAFETY: verbs objects are thread-safe; the pointer is owned by this value.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by this value; the memory (if owned) is freed only after this.
        let rc = unsafe { (self.pd.ctx.table().dereg_mr)(self.mr.as_ptr()) };
        if let Err(e) = check(rc, "dereg_mr", || format!("MR lkey {:#x}", self.lkey)) {
            tracing::warn!("{e}");
        }
    }
}

impl Mr {
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// First address in the MR's address space (the IOVA when one was given).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// A scatter/gather entry for `len` bytes at `offset`, bounds-checked against the MR.
    pub fn sge(&self, offset: u64, len: u32) -> Result<Sge> {
        if offset
            .checked_add(u64::from(len))
            .is_none_or(|end| end > self.len)
        {
            return Err(VerbsError::Invalid(format!(
                "SGE {offset}+{len} outside MR of {} bytes",
                self.len
            )));
        }
        Ok(Sge::new(
            self.addr + offset,
            len,
            self.lkey,
            self.cpu_addressed,
        ))
    }
}

impl Pd {
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn object(&self) -> String {
        format!("PD of {}", self.ctx.name())
    }

    /// Wraps a fresh registration. `iova` is the MR's address space when the caller chose one:
    /// libibverbs leaves `ibv_mr.addr` at the CPU address (or the dma-buf offset) even then,
    /// while SGEs and remote accesses use the IOVA.
    pub(crate) fn finish(
        self: &Arc<Self>,
        mr: *mut ibv_mr,
        verb: &'static str,
        memory: Option<Memory>,
        iova: Option<u64>,
    ) -> Result<Mr> {
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::Verb {
            verb,
            object: self.object(),
            errno: last_errno(),
        })?;
        // SAFETY: a registered MR; the provider filled these fields (contract).
        let (cpu_addr, len, lkey, rkey) = unsafe {
            let m = mr.as_ptr();
            ((*m).addr as u64, (*m).length as u64, (*m).lkey, (*m).rkey)
        };
        let addr = iova.unwrap_or(cpu_addr);
        // Inline sends read SGE addresses as CPU addresses: only when the two spaces agree.
        let cpu_addressed = memory.is_some() && addr == cpu_addr;
        Ok(Mr {
            pd: Arc::clone(self),
            mr,
            _memory: memory,
            cpu_addressed,
            addr,
            len,
            lkey,
            rkey,
        })
    }

    /// `ibv_reg_mr`: registers `memory` with `access`.
    pub fn reg_mr(self: &Arc<Self>, memory: impl Into<Memory>, access: Access) -> Result<Mr> {
        let memory = memory.into();
        let (ptr, len) = memory.range();
        let access_bits = access.c_bits()?;
        // SAFETY: the range is valid for the MR's lifetime (owned, or vouched for by
        // ForeignMemory's creator), and the Mr keeps the memory alive.
        let mr =
            unsafe { (self.ctx.table().reg_mr)(self.pd.as_ptr(), ptr.cast(), len, access_bits) };
        self.finish(mr, "reg_mr", Some(memory), None)
    }

    /// `ibv_reg_mr_iova2` (IBVERBS_1.8): registration with an explicit IOVA, needed for
    /// `Access::RELAXED_ORDERING` (NCCL's `ncclIbRegMrDmaBufInternal` path).
    pub fn reg_mr_iova2(
        self: &Arc<Self>,
        memory: impl Into<Memory>,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let f = self
            .ctx
            .table()
            .reg_mr_iova2
            .ok_or(VerbsError::Unsupported {
                verb: "reg_mr_iova2",
                fabric: self.ctx.fabric().name(),
            })?;
        let memory = memory.into();
        let (ptr, len) = memory.range();
        // SAFETY: as in `reg_mr`.
        let mr = unsafe { f(self.pd.as_ptr(), ptr.cast(), len, iova, access.bits()) };
        self.finish(mr, "reg_mr_iova2", Some(memory), Some(iova))
    }

    /// `ibv_reg_dmabuf_mr` (IBVERBS_1.12): registers `len` bytes at `offset` of a dma-buf.
    pub fn reg_dmabuf_mr(
        self: &Arc<Self>,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let f = self
            .ctx
            .table()
            .reg_dmabuf_mr
            .ok_or(VerbsError::Unsupported {
                verb: "reg_dmabuf_mr",
                fabric: self.ctx.fabric().name(),
            })?;
        let access_bits = access.c_bits()?;
        // SAFETY: the fd is borrowed for the call; the kernel takes its own reference.
        let mr = unsafe {
            f(
                self.pd.as_ptr(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access_bits,
            )
        };
        self.finish(mr, "reg_dmabuf_mr", None, Some(iova))
    }

    /// Whether the device registers dma-bufs, probed as `ncclIbDmaBufSupport` does: a
    /// registration of fd -1 must fail, and the errno says why — `EOPNOTSUPP` or
    /// `EPROTONOSUPPORT` when the kernel or provider has no dma-buf support, anything else (the
    /// expected `EBADF`) when only the fd was wrong. A library without the entry point
    /// (older than IBVERBS_1.12) does not support it either.
    pub fn dmabuf_supported(self: &Arc<Self>) -> bool {
        let Some(f) = self.ctx.table().reg_dmabuf_mr else {
            return false;
        };
        // SAFETY: fd -1 with length 0 names no memory; the provider must refuse it.
        let mr = unsafe { f(self.pd.as_ptr(), 0, 0, 0, -1, 0) };
        if let Some(mr) = NonNull::new(mr) {
            // A provider that accepted the bogus fd: undo, and do not trust it with dma-bufs.
            // SAFETY: the registration just made, deregistered once.
            unsafe { (self.ctx.table().dereg_mr)(mr.as_ptr()) };
            return false;
        }
        let errno = last_errno();
        !matches!(errno, libc::EOPNOTSUPP | libc::EPROTONOSUPPORT)
    }
}
