//! Memory regions: the key table every local and remote access is checked against.
//!
//! A hardware NIC checks the key, the PD, the bounds and the access flags of every DMA; so does
//! this table. An access holds an [`MrGuard`] for as long as it touches the memory, and
//! [`MrTable::deregister`] removes the key first (new accesses fail like a stale rkey) and then
//! waits for the guards to drop, so no emulated DMA ever touches memory the owner has freed.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use ibverbs_sys::ibv_access_flags;

use super::rand_u32;

/// `IBV_ACCESS_*` bits the checks look at.
pub(crate) const LOCAL_WRITE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
pub(crate) const REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
pub(crate) const REMOTE_READ: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;

/// One registration. Keys are random (a stale or guessed key misses), lkey == rkey as on mlx5.
#[derive(Debug)]
pub(crate) struct MrEntry {
    pub pd: u32,
    /// The IOVA remote peers address (equal to `addr` unless registered with `reg_mr_iova2`).
    pub iova: u64,
    pub addr: usize,
    pub len: usize,
    pub access: u32,
    inflight: AtomicUsize,
    /// Set by `deregister` before it waits for `inflight` to drain: only then does the last
    /// access out wake it (a wake-up per access would be a syscall per WR).
    removed: AtomicBool,
}

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

/// A checked access in progress: the memory stays registered until it drops.
#[derive(Debug)]
pub(crate) struct MrGuard {
    entry: Arc<MrEntry>,
    table: Arc<MrTableInner>,
    /// Host address of the first byte of the access.
    pub ptr: *mut u8,
}

// SAFETY: the guard only carries an address into registered memory; which thread uses it does
// not matter (the engine moves accesses between its threads like a NIC's DMA engines).
unsafe impl Send for MrGuard {}

impl Drop for MrGuard {
    fn drop(&mut self) {
        // SeqCst with `deregister`'s store and load: either it sees the count at zero, or
        // this sees the flag and wakes it.
        if self.entry.inflight.fetch_sub(1, Ordering::SeqCst) == 1
            && self.entry.removed.load(Ordering::SeqCst)
        {
            // Take the lock so a deregistration between its check and its wait cannot miss us.
            let _map = self.table.map.lock().unwrap_or_else(|e| e.into_inner());
            self.table.idle.notify_all();
        }
    }
}

/// Why an access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Violation {
    /// No such key (never registered, or deregistered).
    Key,
    /// The key belongs to another protection domain.
    Pd,
    /// The range leaves the region.
    Bounds,
    /// The region was not registered with the needed access flag.
    Access,
}

#[derive(Debug, Default)]
struct MrTableInner {
    map: Mutex<HashMap<u32, Arc<MrEntry>, BuildHasherDefault<KeyHash>>>,
    idle: Condvar,
}

/// Keys are drawn uniformly at random ([`MrTable::register`]), so one multiplication hashes
/// them: every work request looks its keys up here, and SipHash's resistance to chosen keys
/// buys nothing for keys this table picks itself. (The multiplication spreads the 32 random
/// bits over the high ones too, which the table's probing tags are taken from.)
#[derive(Default)]
struct KeyHash(u64);

impl Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0 << 8 | u64::from(b);
        }
    }

    fn write_u32(&mut self, key: u32) {
        self.0 = u64::from(key);
    }
}

/// The MRs of one context.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    inner: Arc<MrTableInner>,
}

impl MrTable {
    /// Registers `[addr, addr+len)` under a fresh random key; `iova` is what remote peers use.
    pub(crate) fn register(&self, pd: u32, addr: usize, len: usize, iova: u64, access: u32) -> u32 {
        let mut map = self.inner.map.lock().unwrap_or_else(|e| e.into_inner());
        let key = loop {
            let k = rand_u32();
            if k != 0 && !map.contains_key(&k) {
                break k;
            }
        };
        map.insert(
            key,
            Arc::new(MrEntry {
                pd,
                iova,
                addr,
                len,
                access,
                inflight: AtomicUsize::new(0),
                removed: AtomicBool::new(false),
            }),
        );
        key
    }

    /// Removes the key, then waits until no access holds it.
    pub(crate) fn deregister(&self, key: u32) -> bool {
        let mut map = self.inner.map.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = map.remove(&key) else {
            return false;
        };
        entry.removed.store(true, Ordering::SeqCst);
        while entry.inflight.load(Ordering::SeqCst) != 0 {
            map = self.inner.idle.wait(map).unwrap_or_else(|e| e.into_inner());
        }
        true
    }

    /// Checks an access of `len` bytes at `addr` (an IOVA for remote accesses, a virtual
    /// address for local SGEs) and pins the region while the guard lives. `need` is the access
    /// flag the operation requires (0 for a local read, which every MR allows).
    pub(crate) fn acquire(
        &self,
        key: u32,
        pd: u32,
        addr: u64,
        len: usize,
        need: u32,
    ) -> Result<MrGuard, Violation> {
        let map = self.inner.map.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map.get(&key).ok_or(Violation::Key)?;
        if entry.pd != pd {
            return Err(Violation::Pd);
        }
        let offset = addr.checked_sub(entry.iova).ok_or(Violation::Bounds)?;
        let end = offset.checked_add(len as u64).ok_or(Violation::Bounds)?;
        if end > entry.len as u64 {
            return Err(Violation::Bounds);
        }
        if entry.access & need != need {
            return Err(Violation::Access);
        }
        entry.inflight.fetch_add(1, Ordering::AcqRel);
        Ok(MrGuard {
            entry: Arc::clone(entry),
            table: Arc::clone(&self.inner),
            ptr: (entry.addr + offset as usize) as *mut u8,
        })
    }

    /// Number of registrations (for `dealloc_pd`'s EBUSY and tests).
    pub(crate) fn count_for_pd(&self, pd: u32) -> usize {
        let map = self.inner.map.lock().unwrap_or_else(|e| e.into_inner());
        map.values().filter(|e| e.pd == pd).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn checks_key_pd_bounds_and_access() {
        let t = MrTable::default();
        let buf = [0u8; 100];
        let base = buf.as_ptr() as usize;
        let k = t.register(1, base, 100, base as u64, LOCAL_WRITE | REMOTE_WRITE);
        assert!(t.acquire(k, 1, base as u64 + 10, 90, REMOTE_WRITE).is_ok());
        assert_eq!(
            t.acquire(k, 1, base as u64 + 10, 91, REMOTE_WRITE).err(),
            Some(Violation::Bounds)
        );
        assert_eq!(
            t.acquire(k, 1, base as u64 - 1, 1, 0).err(),
            Some(Violation::Bounds)
        );
        assert_eq!(
            t.acquire(k, 2, base as u64, 1, 0).err(),
            Some(Violation::Pd)
        );
        assert_eq!(
            t.acquire(k, 1, base as u64, 1, REMOTE_READ).err(),
            Some(Violation::Access)
        );
        assert_eq!(
            t.acquire(k ^ 1, 1, base as u64, 1, 0).err(),
            Some(Violation::Key)
        );
        let iova = t.register(1, base, 100, 0x1000, REMOTE_READ);
        let g = t.acquire(iova, 1, 0x1010, 4, REMOTE_READ).expect("inside");
        assert_eq!(g.ptr as usize, base + 0x10);
        assert_eq!(t.count_for_pd(1), 2);
    }

    #[test]
    fn deregister_waits_for_inflight_access() {
        let t = Arc::new(MrTable::default());
        let k = t.register(1, 0x1000, 10, 0x1000, REMOTE_WRITE);
        let g = t.acquire(k, 1, 0x1000, 10, REMOTE_WRITE).expect("valid");
        let t2 = Arc::clone(&t);
        let h = std::thread::spawn(move || t2.deregister(k));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!h.is_finished(), "dereg must wait for the access");
        // New accesses already fail like a stale key.
        assert_eq!(t.acquire(k, 1, 0x1000, 1, 0).err(), Some(Violation::Key));
        drop(g);
        assert!(h.join().expect("no panic"));
        assert!(!t.deregister(k));
    }

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
