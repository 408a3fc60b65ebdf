//! Protection domains and memory regions: `alloc_pd` / `dealloc_pd`, `reg_mr` (and its iova
//! and dma-buf forms) and `dereg_mr`. The keys and the checks behind them are the `mr` module's.

use std::io::BufRead;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::Arc;

use ibverbs_sys::{ibv_access_flags, ibv_context, ibv_mr, ibv_pd};

use super::conv::{fail, null, shield};
use super::mapping::{FdMapping, MapError};
use super::memory::Region;
use super::objects::{SoftPd, ctx_of, pd_of};
use crate::ctx::Ctx;
use crate::fabric;

#[repr(C)]
struct SoftMr {
    ibv: ibv_mr,
    ctx: Arc<Ctx>,
    /// The soft NIC's own mapping of a dma-buf registration; unmapped after the key is gone.
    dmabuf: Option<FdMapping>,
}

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
            // SAFETY: a live soft PD.
            let sp = unsafe { pd_of(pd) };
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
            let sp = unsafe { pd_of(pd) };
            if !mapped(addr as usize, length, access & WRITABLE != 0) {
                return null(libc::EFAULT);
            }
            // SAFETY: the verbs contract: the caller keeps `[addr, addr + length)` mapped until
            // `dereg_mr` returns, which is after the key is gone and no access holds it; that
            // it is mapped now was just checked.
            let region = unsafe { Region::registered(addr as usize, length) };
            register(sp, pd, region, addr, iova, access, None)
        },
    )
}

/// The access flags that make a NIC pin a registration's pages for writing.
const WRITABLE: c_uint =
    crate::mr::LOCAL_WRITE | crate::mr::REMOTE_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

/// Whether `[addr, addr + len)` is mapped in this process, readable, and writable when
/// `writable`: what a NIC's `ibv_reg_mr` finds out by pinning the pages, failing with `EFAULT`
/// when it cannot. Without the check an unmapped buffer would register and the first transfer
/// into it would fail the connection instead, blamed on the peer.
///
/// Read from `/proc/self/maps`: one pass over the process's mappings (at registration, which the
/// transport caches, never per message), and it sees permissions — `mincore` sees only whether
/// pages are mapped, so a `PROT_NONE` reservation or a read-only mapping would pass it, and
/// probing each page with `process_vm_readv` costs a copy per page and sees no write
/// permission. Where `/proc` cannot be read the range is taken on trust, as before.
fn mapped(addr: usize, len: usize, writable: bool) -> bool {
    match std::fs::File::open("/proc/self/maps") {
        Ok(maps) => covered(std::io::BufReader::new(maps), addr, len, writable),
        Err(e) => {
            tracing::debug!("soft: reg_mr cannot read /proc/self/maps ({e}); not checked");
            true
        }
    }
}

/// Whether the mappings listed in `maps` (`/proc/<pid>/maps` lines, in address order) cover
/// `[addr, addr + len)` without a gap, each readable and, when `writable`, writable.
fn covered(maps: impl BufRead, addr: usize, len: usize, writable: bool) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut next = addr;
    for line in maps.lines() {
        if next >= end {
            break;
        }
        let Ok(line) = line else { return false };
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((from, to)) = range.split_once('-').and_then(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        }) else {
            continue;
        };
        if to <= next {
            continue;
        }
        let allowed =
            perms.starts_with('r') && (!writable || perms.as_bytes().get(1) == Some(&b'w'));
        if from > next || !allowed {
            return false;
        }
        next = to;
    }
    next >= end
}

/// Registers `region` of this process under a fresh key, addressed by `iova`; `ibv_addr` is
/// what `ibv_mr.addr` reports (the caller's address, or the dma-buf offset).
fn register(
    sp: &SoftPd,
    pd: *mut ibv_pd,
    region: Region,
    ibv_addr: *mut c_void,
    iova: u64,
    access: c_uint,
    dmabuf: Option<FdMapping>,
) -> *mut ibv_mr {
    if !fabric::alive(sp.ctx.dev) {
        return null(libc::EIO);
    }
    // Remote write/atomic without local write is invalid, as in libibverbs.
    let remote_write = crate::mr::REMOTE_WRITE;
    if access & remote_write != 0 && access & crate::mr::LOCAL_WRITE == 0 {
        return null(libc::EINVAL);
    }
    let length = region.len();
    let key = sp.ctx.mrs.register(sp.ibv.handle, region, iova, access);
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
            let sp = unsafe { pd_of(pd) };
            let mapping = match FdMapping::map(fd, offset, length) {
                Ok(m) => m,
                Err(MapError::Range) => return null(libc::EINVAL),
                Err(MapError::Unmappable(e)) => {
                    tracing::debug!("soft: reg_dmabuf_mr of fd {fd}: mmap errno {e}");
                    return null(libc::EOPNOTSUPP);
                }
            };
            // SAFETY: the mapping lives in the SoftMr made below, which drops it only after
            // deregistering the key, once no access holds it.
            let region = unsafe { Region::registered(mapping.addr(), length) };
            register(
                sp,
                pd,
                region,
                offset as usize as *mut c_void,
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

#[cfg(test)]
mod tests {
    use super::covered;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 00:00 0
4000-5000 rw-p 00000000 00:00 0
6000-7000 ---p 00000000 00:00 0
7000-8000 rw-s 00000000 00:05 12 /memfd:x (deleted)
";

    #[test]
    fn a_range_is_covered_only_by_mappings_without_gaps_that_allow_the_access() {
        let c = |addr, len, w| covered(MAPS.as_bytes(), addr, len, w);
        assert!(c(0x1000, 0x2000, true), "one writable mapping");
        assert!(c(0x2800, 0x1000, false), "read across two mappings");
        assert!(!c(0x2800, 0x1000, true), "a read-only page, written");
        assert!(!c(0x4800, 0x1000, false), "unmapped after 0x5000");
        assert!(!c(0x800, 0x1000, false), "unmapped before 0x1000");
        assert!(!c(0x6000, 8, false), "PROT_NONE");
        assert!(c(0x7000, 0x1000, true), "shared");
        assert!(!c(0x9000, 1, false), "past every mapping");
        assert!(c(0x9000, 0, true), "nothing to check");
        assert!(!c(usize::MAX, 2, false), "wraps");
    }
}
