//! The soft NIC's own mapping of a dma-buf (`ibv_reg_dmabuf_mr`): `mmap` and `munmap` of the
//! fd's pages, whose range becomes the registration's [`Region`](super::memory::Region).

use std::ptr::NonNull;

/// The soft NIC's own mapping of a dma-buf (`ibv_reg_dmabuf_mr`): the fd's pages, mapped shared,
/// so what the data path writes through it is what every other mapping of that fd sees. A
/// registration over it is addressed by its IOVA only; the caller's virtual addresses play no
/// part, as for a GPU buffer a real NIC reaches through the dma-buf's pages.
#[derive(Debug)]
pub(crate) struct FdMapping {
    base: NonNull<u8>,
    /// Bytes mapped from `base` (the requested range, widened down to a page boundary).
    mapped: usize,
    /// Where the requested offset lies in the mapping.
    skew: usize,
}

// SAFETY: the mapping is owned; which thread unmaps it does not matter.
unsafe impl Send for FdMapping {}
// SAFETY: the mapping is only read and written through checked MR accesses.
unsafe impl Sync for FdMapping {}

impl FdMapping {
    /// Maps `len` bytes at `offset` of `fd` (shared, read/write). A range past the end of a file
    /// is refused ([`MapError::Range`]: touching such pages would kill the process with SIGBUS,
    /// where a kernel refuses to register past a dma-buf's end); an fd that cannot be mapped so
    /// (a pipe, a socket, `/dev/null`, a read-only file) gives `mmap`'s errno.
    pub(crate) fn map(fd: i32, offset: u64, len: usize) -> Result<FdMapping, MapError> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let skew = usize::try_from(offset).map_err(|_| MapError::Range)? % page;
        let start = offset - skew as u64;
        let mapped = len.checked_add(skew).ok_or(MapError::Range)?;
        let file_off = libc::off_t::try_from(start).map_err(|_| MapError::Range)?;
        // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid out-pointer; a bad fd only makes fstat fail.
        if unsafe { libc::fstat(fd, &mut st) } == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFREG
            && offset.saturating_add(len as u64) > u64::try_from(st.st_size).unwrap_or(0)
        {
            return Err(MapError::Range);
        }
        // SAFETY: a fresh shared mapping chosen by the kernel; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                file_off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MapError::Unmappable(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EINVAL),
            ));
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or(MapError::Unmappable(libc::EINVAL))?;
        Ok(FdMapping { base, mapped, skew })
    }

    /// Host address of the registered range's first byte (the requested offset).
    pub(crate) fn addr(&self) -> usize {
        self.base.as_ptr() as usize + self.skew
    }
}

/// Why an fd could not be mapped as a dma-buf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapError {
    /// The range does not lie inside the file.
    Range,
    /// `mmap` refused the fd (its errno).
    Unmappable(i32),
}

impl Drop for FdMapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; the MR over it was deregistered first, and
        // deregistration waits until no access holds it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.mapped) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_mappings_share_pages_with_every_other_mapping() {
        let fd = memfd(3 * 4096);
        let m = FdMapping::map(fd, 4096 + 10, 100).expect("a memfd maps");
        // SAFETY: inside the fresh 100-byte mapping.
        unsafe { (m.addr() as *mut u8).add(5).write(0xAB) };
        let other = FdMapping::map(fd, 0, 3 * 4096).expect("maps again");
        // SAFETY: inside the second mapping.
        let seen = unsafe { (other.addr() as *const u8).add(4096 + 15).read() };
        assert_eq!(seen, 0xAB);
        let pipe = [0i32; 2];
        // SAFETY: a valid two-int array.
        assert_eq!(unsafe { libc::pipe(pipe.as_ptr().cast_mut()) }, 0);
        assert!(
            matches!(
                FdMapping::map(pipe[0], 0, 4096),
                Err(MapError::Unmappable(_))
            ),
            "a pipe does not map"
        );
        assert_eq!(
            FdMapping::map(fd, 2 * 4096, 4097).err(),
            Some(MapError::Range),
            "past the end of the memfd"
        );
        for f in [fd, pipe[0], pipe[1]] {
            // SAFETY: fds this test opened.
            unsafe { libc::close(f) };
        }
    }

    fn memfd(len: i64) -> i32 {
        // SAFETY: a NUL-terminated name; flags 0.
        let fd = unsafe { libc::memfd_create(c"soft-mr-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: the fd just made.
        assert_eq!(unsafe { libc::ftruncate(fd, len) }, 0);
        fd
    }
}
