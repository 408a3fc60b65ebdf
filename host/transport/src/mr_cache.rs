//! Memory registration: page-rounded, cached per device, reference-counted.
//!
//! As `ncclIbRegMrDmaBufInternal`, a registration covers whole pages, and registering a range
//! already covered on that device reuses the region and counts one more user; the region is
//! deregistered when its last user is gone. Host (and peer-memory GPU) buffers go to
//! `ibv_reg_mr`, or to `ibv_reg_mr_iova2` with the buffer's address as IOVA when relaxed
//! ordering is on; a dma-buf goes to `ibv_reg_dmabuf_mr` with the fd, NCCL's offset, the
//! page-rounded length and the page-rounded buffer address as IOVA, so the peer addresses it by
//! NCCL's pointer as any other buffer. NCCL registers the same buffers from several
//! communicators (and channels share buffers), so the cache lives with the device's PD, shared by
//! every communicator on it.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};

use ncclwasm_verbs::{Access, DmaBuf, Memory, Mr, Pd};

use crate::net_error::NetError;

/// Pages registrations are rounded to.
const PAGE: u64 = 4096;

/// The pages holding `[addr, addr + len)`: `(first page address, bytes)`; at least one page.
fn page_span(addr: u64, len: u64) -> (u64, u64) {
    let start = addr & !(PAGE - 1);
    let end = addr.saturating_add(len.max(1)).div_ceil(PAGE) * PAGE;
    (start, end - start)
}

/// Where the bytes of a registration come from: the caller vouches for them.
///
/// The plugin implements it over NCCL's buffers (a `ForeignMemory` over the page span, which is
/// mapped because a byte of each page is); tests implement it over a [`DmaBuf`].
pub trait RegionSource: Send + Sync {
    /// The verbs memory covering `[start, start + len)`, the page span of a registration.
    fn memory(&self, start: u64, len: u64) -> Memory;
}

/// An owned buffer registers as itself; it must contain the requested span.
impl RegionSource for Arc<DmaBuf> {
    fn memory(&self, _start: u64, _len: u64) -> Memory {
        Memory::Owned(Arc::clone(self))
    }
}

/// The access every data registration gets: written by the peer (RDMA WRITE), read by our own
/// flush QP and by one-sided gets (RDMA READ), written locally (READ responses land in it),
/// and added to by one-sided signals (atomics), as NCCL's registrations since 2.29.
pub(crate) const DATA_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// Where the pages of a registration come from.
#[derive(Clone, Copy)]
pub(crate) enum Backing<'a> {
    /// Memory this process can address (host memory, or GPU memory under a peer-memory module).
    Host(&'a dyn RegionSource),
    /// A dma-buf: the pages of `fd` from `offset` (NCCL's `regMrDmaBuf`).
    DmaBuf { fd: BorrowedFd<'a>, offset: u64 },
}

impl Backing<'_> {
    fn is_dmabuf(&self) -> bool {
        matches!(self, Backing::DmaBuf { .. })
    }
}

/// How a device registers, as decided for it ([`crate::GpuSupport`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RegMode {
    /// `IBV_ACCESS_RELAXED_ORDERING`, through `ibv_reg_mr_iova2` for host memory.
    pub(crate) relaxed_ordering: bool,
    /// Dma-bufs through `mlx5dv_reg_dmabuf_mr` (an mlx5 Data Direct device).
    pub(crate) data_direct: bool,
}

#[derive(Debug)]
struct Entry {
    mr: Arc<Mr>,
    users: usize,
    /// A dma-buf region is never handed out for host memory at the same addresses, nor the
    /// reverse: the two are different pages.
    dmabuf: bool,
}

/// The registrations of one device.
#[derive(Debug, Default)]
pub(crate) struct MrCache {
    entries: Mutex<Vec<Entry>>,
}

impl MrCache {
    /// A region covering `[addr, addr + len)`: a cached one when one covers it, else a new
    /// page-rounded registration made as `mode` says.
    pub(crate) fn acquire(
        &self,
        pd: &Arc<Pd>,
        mode: RegMode,
        addr: u64,
        len: u64,
        backing: Backing<'_>,
    ) -> Result<Arc<Mr>, NetError> {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let end = addr.saturating_add(len);
        if let Some(e) = entries.iter_mut().find(|e| {
            e.dmabuf == backing.is_dmabuf()
                && e.mr.addr() <= addr
                && end <= e.mr.addr() + e.mr.len()
        }) {
            e.users += 1;
            return Ok(Arc::clone(&e.mr));
        }
        let (start, span) = page_span(addr, len);
        let dev = pd.context().name();
        let relaxed = mode.relaxed_ordering;
        let access = if relaxed {
            DATA_ACCESS | Access::RELAXED_ORDERING
        } else {
            DATA_ACCESS
        };
        let mr = match backing {
            Backing::Host(source) => {
                let memory = source.memory(start, span);
                let what = format!("registering {span} bytes at {start:#x} on {dev}");
                if relaxed {
                    let iova = memory.addr();
                    pd.reg_mr_iova2(memory, iova, access)
                } else {
                    pd.reg_mr(memory, access)
                }
                .map_err(|e| {
                    // A NIC fails to pin such pages with EFAULT; say which fault is likely.
                    let hint = match e.errno() {
                        Some(libc::EFAULT) => {
                            " (the buffer is not mapped in this process, or not readable and writable)"
                        }
                        _ => "",
                    };
                    NetError::verbs(format!("{what}{hint}"))(e)
                })?
            }
            Backing::DmaBuf { fd, offset } => {
                let what = format!(
                    "registering the dma-buf of buffer {addr:#x} ({len} bytes; fd {}, offset \
                     {offset}, {span} bytes at IOVA {start:#x}) on {dev}",
                    fd.as_raw_fd()
                );
                let span = usize::try_from(span)
                    .map_err(|_| NetError::Argument(format!("{what}: too large")))?;
                if mode.data_direct {
                    pd.reg_dmabuf_mr_data_direct(fd, offset, span, start, access)
                } else {
                    pd.reg_dmabuf_mr(fd, offset, span, start, access)
                }
                .map_err(NetError::verbs(what))?
            }
        };
        if !(mr.addr() <= addr && end <= mr.addr() + mr.len()) {
            return Err(NetError::Internal(format!(
                "the memory given for [{addr:#x}, {end:#x}) registered as [{:#x}, +{})",
                mr.addr(),
                mr.len()
            )));
        }
        let mr = Arc::new(mr);
        entries.push(Entry {
            mr: Arc::clone(&mr),
            users: 1,
            dmabuf: backing.is_dmabuf(),
        });
        Ok(mr)
    }

    /// One user of `mr` is gone; the last one deregisters it (when no request still holds it).
    pub(crate) fn release(&self, mr: &Arc<Mr>) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = entries.iter().position(|e| Arc::ptr_eq(&e.mr, mr)) {
            entries[i].users -= 1;
            if entries[i].users == 0 {
                entries.swap_remove(i);
            }
        }
    }

    /// Registrations alive (for tests and logs).
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_whole_pages() {
        assert_eq!(page_span(0x1000, 1), (0x1000, 0x1000));
        assert_eq!(page_span(0x1fff, 2), (0x1000, 0x2000));
        assert_eq!(page_span(0x1000, 0), (0x1000, 0x1000));
        assert_eq!(page_span(0x1234, 0x1000), (0x1000, 0x2000));
    }
}
