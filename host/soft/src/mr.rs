//! Memory regions: the key table every local and remote access is checked against.
//!
//! A hardware NIC checks the key, the PD, the bounds and the access flags of every DMA; so does
//! this table. An access holds an [`MrGuard`] for as long as it touches the memory, and
//! [`MrTable::deregister`] removes the key first (new accesses fail like a stale rkey) and then
//! waits for the guards to drop, so no emulated DMA ever touches memory the owner has freed.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use ibverbs_sys::ibv_access_flags;

use crate::abi::memory::Region;
use crate::abi::sys::rand_u32;

/// `IBV_ACCESS_*` bits the checks look at.
pub(crate) const LOCAL_WRITE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
pub(crate) const REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
pub(crate) const REMOTE_READ: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
pub(crate) const REMOTE_ATOMIC: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

/// One registration. Keys are random (a stale or guessed key misses), lkey == rkey as on mlx5.
#[derive(Debug)]
pub(crate) struct MrEntry {
    pub pd: u32,
    /// The IOVA remote peers address (the region's address unless registered with
    /// `reg_mr_iova2`, or a dma-buf's).
    pub iova: u64,
    /// The registered memory itself.
    region: Region,
    pub access: u32,
    /// The accesses in flight, plus [`REMOVED`] once `deregister` took the key away: one word,
    /// so the last access out learns from its own decrement whether anyone waits (a wake-up
    /// per access would be a syscall per WR).
    inflight: AtomicUsize,
    /// What `deregister` waits on. The entry's own, so a guard needs nothing but its entry to
    /// wake it (no second `Arc`, of the table, per access).
    idle: Mutex<()>,
    drained: Condvar,
}

/// The bit of [`MrEntry::inflight`] that says `deregister` waits.
const REMOVED: usize = 1 << (usize::BITS - 1);

/// A checked access in progress: the memory stays registered until it drops. The only way to
/// the bytes of an MR: the engine reads and writes them through [`region`](Self::region),
/// borrowed from the guard (the engine moves guards between its threads like a NIC's DMA
/// engines).
#[derive(Debug)]
pub(crate) struct MrGuard {
    entry: Arc<MrEntry>,
    /// The bytes of the access, checked against the registration.
    region: Region,
}

impl MrGuard {
    /// The bytes this access may touch.
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }
}

impl Drop for MrGuard {
    fn drop(&mut self) {
        let e = &self.entry;
        if e.inflight.fetch_sub(1, Ordering::AcqRel) == REMOVED | 1 {
            // Take the lock so a deregistration between its check and its wait cannot miss us.
            let _idle = e.idle.lock().unwrap_or_else(|e| e.into_inner());
            e.drained.notify_all();
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
    map: Mutex<HashMap<u32, Arc<MrEntry>, BuildHasherDefault<KeyHash>>>,
}

impl MrTable {
    /// Registers `region` under a fresh random key; `iova` is what remote peers use.
    pub(crate) fn register(&self, pd: u32, region: Region, iova: u64, access: u32) -> u32 {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
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
                region,
                access,
                inflight: AtomicUsize::new(0),
                idle: Mutex::new(()),
                drained: Condvar::new(),
            }),
        );
        key
    }

    /// Removes the key (new accesses fail at once), then waits until no access holds it.
    pub(crate) fn deregister(&self, key: u32) -> bool {
        let removed = self
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        let Some(entry) = removed else {
            return false;
        };
        // Under the entry's lock: a last guard that drops after this sees `REMOVED` in its own
        // decrement and can only notify once this waits.
        let mut idle = entry.idle.lock().unwrap_or_else(|e| e.into_inner());
        entry.inflight.fetch_or(REMOVED, Ordering::AcqRel);
        while entry.inflight.load(Ordering::Acquire) != REMOVED {
            idle = entry.drained.wait(idle).unwrap_or_else(|e| e.into_inner());
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
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map.get(&key).ok_or(Violation::Key)?;
        if entry.pd != pd {
            return Err(Violation::Pd);
        }
        let offset = addr.checked_sub(entry.iova).ok_or(Violation::Bounds)?;
        let region = usize::try_from(offset)
            .ok()
            .and_then(|offset| entry.region.part(offset, len))
            .ok_or(Violation::Bounds)?;
        if entry.access & need != need {
            return Err(Violation::Access);
        }
        // Under the map's lock, so never after `deregister` removed the key and set `REMOVED`.
        entry.inflight.fetch_add(1, Ordering::Relaxed);
        Ok(MrGuard {
            entry: Arc::clone(entry),
            region,
        })
    }

    /// Number of registrations (for `dealloc_pd`'s EBUSY and tests).
    pub(crate) fn count_for_pd(&self, pd: u32) -> usize {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
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
        let (region, other) = (Region::leaked(100), Region::leaked(100));
        let (base, other_base) = (region.addr(), other.addr());
        let k = t.register(1, region, base, LOCAL_WRITE | REMOTE_WRITE);
        assert!(t.acquire(k, 1, base + 10, 90, REMOTE_WRITE).is_ok());
        assert_eq!(
            t.acquire(k, 1, base + 10, 91, REMOTE_WRITE).err(),
            Some(Violation::Bounds)
        );
        assert_eq!(
            t.acquire(k, 1, base - 1, 1, 0).err(),
            Some(Violation::Bounds)
        );
        assert_eq!(t.acquire(k, 2, base, 1, 0).err(), Some(Violation::Pd));
        assert_eq!(
            t.acquire(k, 1, base, 1, REMOTE_READ).err(),
            Some(Violation::Access)
        );
        assert_eq!(t.acquire(k ^ 1, 1, base, 1, 0).err(), Some(Violation::Key));
        let iova = t.register(1, other, 0x1000, REMOTE_READ);
        let g = t.acquire(iova, 1, 0x1010, 4, REMOTE_READ).expect("inside");
        assert_eq!(g.region().addr(), other_base + 0x10);
        assert_eq!(g.region().len(), 4);
        assert_eq!(t.count_for_pd(1), 2);
    }

    #[test]
    fn deregister_waits_for_inflight_access() {
        let t = Arc::new(MrTable::default());
        let k = t.register(1, Region::leaked(10), 0x1000, REMOTE_WRITE);
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
    fn deregister_wakes_whichever_guard_drops_last() {
        use std::sync::atomic::AtomicUsize;
        const GUARDS: usize = 8;
        for _ in 0..50 {
            let t = MrTable::default();
            let k = t.register(1, Region::leaked(64), 0x1000, REMOTE_WRITE);
            let dropped = Arc::new(AtomicUsize::new(0));
            let droppers: Vec<_> = (0..GUARDS)
                .map(|_| {
                    let g = t.acquire(k, 1, 0x1000, 1, 0).expect("valid");
                    let dropped = Arc::clone(&dropped);
                    std::thread::spawn(move || {
                        dropped.fetch_add(1, Ordering::SeqCst);
                        drop(g);
                    })
                })
                .collect();
            assert!(t.deregister(k));
            assert_eq!(
                dropped.load(Ordering::SeqCst),
                GUARDS,
                "returned before every drop"
            );
            for d in droppers {
                d.join().expect("no panic");
            }
        }
    }
}
