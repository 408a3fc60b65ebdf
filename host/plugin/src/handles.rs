//! Generation-checked handles: the opaque pointers NCCL holds for contexts, communicators, memory
//! registrations and requests.
//!
//! NCCL hands every handle back as a `void*` and may do so after closing what it names (a
//! `test` on a request of a closed communicator, a second `deregMr`). A handle is therefore never
//! an address: it is a slot index plus that slot's generation, and a slot's generation changes
//! when it is freed, so a stale handle finds nothing and the call is refused as invalid usage
//! instead of reading freed memory. A request handle is its communicator's handle, the request's
//! pool index and an issue counter of that index, which changes when the request is issued and
//! again when `test` reports it done: a request tested after completion, or after its slot was
//! reused, is stale too.
//!
//! Lookups are O(1) under a read lock (taken exclusively only to open or close), so the proxy
//! thread's `test` loop does not contend with other communicators' calls. Closing removes the
//! entry and drops it outside the lock; a call that looked the entry up just before holds its own
//! reference, so the object stays alive until that call returns. The per-message calls hold the
//! read lock instead of a reference ([`Handles::with_brief`], [`Handles::view`]): a close waits
//! for them.
//!
//! A call whose closure panics marks its entry failed: the object may be half-updated, so every
//! later call on it is refused with an internal error until NCCL closes it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};

use ncclwasm_transport::{MAX_REQUESTS, NetError, ReqId};
use ncclwasm_verbs::panic_message;

/// Bits of a key that name the slot: a million objects open at once.
const INDEX_BITS: u32 = 20;
/// Bits of a key that hold the slot's generation (wrapping, never 0); with the request bits this fills
/// the 64 bits of a handle.
const GENERATION_BITS: u32 = 20;
/// Bits of a request handle below its communicator's key: pool index and issue counter.
const REQUEST_INDEX_BITS: u32 = 8;
const REQUEST_ISSUE_BITS: u32 = 16;
const REQUEST_BITS: u32 = REQUEST_INDEX_BITS + REQUEST_ISSUE_BITS;

const _: () = assert!(MAX_REQUESTS <= 1 << REQUEST_INDEX_BITS);
const _: () = assert!(INDEX_BITS + GENERATION_BITS + REQUEST_BITS <= 64);

/// One object NCCL holds, and why it can no longer be used, once a call on it panicked.
struct Entry<T> {
    value: T,
    failed: OnceLock<String>,
}

struct Slot<T> {
    generation: u32,
    entry: Option<Arc<Entry<T>>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

/// A table of objects NCCL holds by generation-checked key.
pub(crate) struct Handles<T> {
    /// What the table holds, for messages ("communicator", "memory registration").
    what: &'static str,
    /// Poisoning is recovered: every critical section is a push, a pop or a swap that cannot
    /// panic half-way, so the table is consistent whatever a panicking holder was doing.
    inner: RwLock<Slots<T>>,
}

fn split(key: u64) -> (usize, u32) {
    (
        (key & ((1 << INDEX_BITS) - 1)) as usize,
        (key >> INDEX_BITS) as u32,
    )
}

impl<T> Handles<T> {
    pub(crate) const fn new(what: &'static str) -> Self {
        Handles {
            what,
            inner: RwLock::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    /// Stores `value`; its key is never 0 (a generation is never 0) and never a pointer NCCL
    /// could mistake for one of its sentinels.
    pub(crate) fn insert(&self, value: T) -> Result<u64, NetError> {
        let entry = Some(Arc::new(Entry {
            value,
            failed: OnceLock::new(),
        }));
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let index = match t.free.pop() {
            Some(i) => i as usize,
            None if t.slots.len() < 1 << INDEX_BITS => {
                t.slots.push(Slot {
                    generation: 1,
                    entry: None,
                });
                t.slots.len() - 1
            }
            None => {
                return Err(NetError::Usage(format!(
                    "{} {}s are open; close some first",
                    1u32 << INDEX_BITS,
                    self.what
                )));
            }
        };
        let slot = &mut t.slots[index];
        slot.entry = entry;
        Ok(u64::from(slot.generation) << INDEX_BITS | index as u64)
    }

    fn entry(&self, key: u64) -> Option<Arc<Entry<T>>> {
        self.read().slot(key).cloned()
    }

    fn read(&self) -> View<'_, T> {
        View {
            handles: self,
            slots: self.inner.read().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// The object `key` names, held for the duration of a call (a memory registration while a
    /// send or receive uses it); stale or failed keys are refused as in [`Handles::with`].
    pub(crate) fn get(&self, key: u64) -> Result<Held<T>, NetError> {
        let entry = self.entry(key).ok_or_else(|| self.stale(key))?;
        match entry.failed.get() {
            Some(why) => Err(self.failed_earlier(why)),
            None => Ok(Held(entry)),
        }
    }

    fn failed_earlier(&self, why: &str) -> NetError {
        NetError::Internal(format!(
            "this {} failed in an earlier call ({why}) and can only be closed",
            self.what
        ))
    }

    fn stale(&self, key: u64) -> NetError {
        NetError::Usage(format!(
            "{key:#x} is not an open {} of this plugin (closed already, or never opened)",
            self.what
        ))
    }

    /// Runs `f` on the object `key` names. A stale key is invalid usage; an object a previous
    /// call panicked on is an internal error; a panic in `f` is caught and fails the object.
    pub(crate) fn with<R>(
        &self,
        key: u64,
        f: impl FnOnce(&T) -> Result<R, NetError>,
    ) -> Result<R, NetError> {
        let entry = self.entry(key).ok_or_else(|| self.stale(key))?;
        self.run(&entry, f)
    }

    /// [`with`](Self::with) for the per-message calls (`isend`, `irecv`, `test`): `f` runs
    /// under the table's read lock instead of on a reference of its own, which saves the two
    /// locked instructions of taking and dropping it on every call. Only for an `f` that is
    /// brief and never touches this table: an open or close waits for it, and a lookup from
    /// inside it could wait behind that open or close. (`with` is for every other call, some
    /// of which block for long: a collective connect waits for every rank.)
    pub(crate) fn with_brief<R>(
        &self,
        key: u64,
        f: impl FnOnce(&T) -> Result<R, NetError>,
    ) -> Result<R, NetError> {
        self.view(|v| self.run(v.entry(key)?, f))
    }

    /// Runs `f` with the table held for reading, for any number of lookups under the one lock
    /// (a multi-receive's registrations), on the terms of [`with_brief`](Self::with_brief).
    /// Tables are always taken in one order when nested: registrations before communicators.
    pub(crate) fn view<R>(
        &self,
        f: impl FnOnce(&View<'_, T>) -> Result<R, NetError>,
    ) -> Result<R, NetError> {
        f(&self.read())
    }

    /// Runs `f` on `entry` unless an earlier call failed it; a panic in `f` fails it.
    fn run<R>(
        &self,
        entry: &Entry<T>,
        f: impl FnOnce(&T) -> Result<R, NetError>,
    ) -> Result<R, NetError> {
        if let Some(why) = entry.failed.get() {
            return Err(self.failed_earlier(why));
        }
        match catch_unwind(AssertUnwindSafe(|| f(&entry.value))) {
            Ok(r) => r,
            Err(panic) => {
                let why = format!("panic: {}", panic_message(panic.as_ref()));
                let _ = entry.failed.set(why.clone());
                Err(NetError::Internal(why))
            }
        }
    }

    /// Takes the object out if `is_kind` accepts it (a failed object too: closing is what is
    /// left to do with it); the key (and every copy of it) is stale from now on. The object is
    /// dropped when the last call still using it returns.
    pub(crate) fn remove(
        &self,
        key: u64,
        is_kind: impl FnOnce(&T) -> bool,
    ) -> Result<(), NetError> {
        let (index, generation) = split(key);
        let taken = {
            let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
            let slot = t
                .slots
                .get_mut(index)
                .filter(|s| s.generation == generation)
                .ok_or_else(|| self.stale(key))?;
            let entry = slot.entry.as_ref().ok_or_else(|| self.stale(key))?;
            if !is_kind(&entry.value) {
                return Err(NetError::Argument(format!(
                    "{key:#x} is a {} of another kind",
                    self.what
                )));
            }
            let taken = slot.entry.take();
            slot.generation = match (slot.generation + 1) & ((1 << GENERATION_BITS) - 1) {
                0 => 1,
                g => g,
            };
            t.free.push(index as u32);
            taken
        };
        drop(taken);
        Ok(())
    }
}

/// A [`Handles`] table held for reading ([`Handles::view`]).
pub(crate) struct View<'a, T> {
    handles: &'a Handles<T>,
    slots: RwLockReadGuard<'a, Slots<T>>,
}

impl<T> View<'_, T> {
    /// The entry `key` names, while it is open.
    fn slot(&self, key: u64) -> Option<&Arc<Entry<T>>> {
        let (index, generation) = split(key);
        let slot = self.slots.slots.get(index)?;
        (slot.generation == generation)
            .then_some(slot.entry.as_ref())
            .flatten()
    }

    fn entry(&self, key: u64) -> Result<&Entry<T>, NetError> {
        self.slot(key)
            .map(|e| &**e)
            .ok_or_else(|| self.handles.stale(key))
    }

    /// The object `key` names, refused as [`Handles::get`] refuses it.
    pub(crate) fn get(&self, key: u64) -> Result<&T, NetError> {
        let entry = self.entry(key)?;
        match entry.failed.get() {
            Some(why) => Err(self.handles.failed_earlier(why)),
            None => Ok(&entry.value),
        }
    }
}

/// An object of a [`Handles`] table, kept alive while a call uses it.
pub(crate) struct Held<T>(Arc<Entry<T>>);

impl<T> std::ops::Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0.value
    }
}

/// The issue counters of one communicator's request pool.
pub(crate) struct Requests([AtomicU16; MAX_REQUESTS]);

/// What a request handle names.
pub(crate) struct RequestKey {
    pub comm: u64,
    pub id: ReqId,
    issue: u16,
}

impl Requests {
    pub(crate) fn new() -> Self {
        Requests(std::array::from_fn(|_| AtomicU16::new(0)))
    }

    /// The handle of request `id`, just issued on the communicator `comm`.
    pub(crate) fn issue(&self, comm: u64, id: ReqId) -> *mut std::ffi::c_void {
        let issue = self.0[id.index()]
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1);
        let low = u64::from(issue) << REQUEST_INDEX_BITS | id.index() as u64;
        (comm << REQUEST_BITS | low) as usize as *mut std::ffi::c_void
    }

    /// Whether `key` names the request currently issued at its index.
    pub(crate) fn current(&self, key: &RequestKey) -> bool {
        self.0[key.id.index()].load(Ordering::Acquire) == key.issue
    }

    /// `test` reported the request done: its handle is stale from now on.
    pub(crate) fn retire(&self, key: &RequestKey) {
        self.0[key.id.index()].fetch_add(1, Ordering::AcqRel);
    }
}

impl RequestKey {
    /// Splits a request handle from NCCL; the communicator and the issue are checked by the
    /// caller against the tables.
    pub(crate) fn decode(request: *mut std::ffi::c_void) -> Result<RequestKey, NetError> {
        let raw = request as usize as u64;
        let index = (raw & ((1 << REQUEST_INDEX_BITS) - 1)) as usize;
        let id = ReqId::from_index(index)
            .ok()
            .filter(|_| index < MAX_REQUESTS)
            .ok_or_else(|| NetError::Usage(format!("{request:p} is not a request")))?;
        Ok(RequestKey {
            comm: raw >> REQUEST_BITS,
            id,
            issue: (raw >> REQUEST_INDEX_BITS) as u16,
        })
    }

    pub(crate) fn stale(&self) -> NetError {
        NetError::Usage(format!(
            "request {} is not in flight (tested after it completed, or its communicator \
             reused the slot)",
            self.id.index()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_key_is_stale_and_a_reused_slot_has_a_new_key() {
        let t = Handles::new("thing");
        let a = t.insert(7u32).unwrap();
        assert_eq!(t.with(a, |v| Ok(*v)).unwrap(), 7);
        t.remove(a, |_| true).unwrap();
        let e = t.with(a, |v| Ok(*v)).unwrap_err();
        assert!(matches!(e, NetError::Usage(_)), "{e}");
        assert!(t.remove(a, |_| true).is_err(), "a second close is refused");
        let b = t.insert(8u32).unwrap();
        assert_ne!(a, b, "the slot is reused with another generation");
        assert!(t.with(a, |v| Ok(*v)).is_err());
        assert_eq!(t.with(b, |v| Ok(*v)).unwrap(), 8);
        assert!(t.with(0, |v| Ok(*v)).is_err());
        assert!(t.with(u64::MAX, |v| Ok(*v)).is_err());
    }

    #[test]
    fn a_panic_fails_the_object_for_every_later_call() {
        let t = Handles::new("communicator");
        let a = t.insert(1u32).unwrap();
        let other = t.insert(2u32).unwrap();
        let e = t
            .with(a, |_| -> Result<(), NetError> { panic!("half-way") })
            .unwrap_err();
        assert!(
            matches!(&e, NetError::Internal(m) if m.contains("half-way")),
            "{e}"
        );
        for _ in 0..3 {
            let e = t.with(a, |v| Ok(*v)).unwrap_err();
            assert!(
                matches!(&e, NetError::Internal(m) if m.contains("failed in an earlier call")),
                "{e}"
            );
        }
        assert_eq!(t.with(other, |v| Ok(*v)).unwrap(), 2, "others go on");
        t.remove(a, |_| true).unwrap();
    }

    #[test]
    fn brief_calls_and_views_refuse_what_calls_on_a_reference_refuse() {
        let t = Handles::new("communicator");
        let (a, b) = (t.insert(1u32).unwrap(), t.insert(2u32).unwrap());
        assert_eq!(t.with_brief(a, |v| Ok(*v)).unwrap(), 1);
        let sum = t.view(|v| Ok(v.get(a)? + v.get(b)?)).unwrap();
        assert_eq!(sum, 3, "several lookups under one lock");
        let e = t
            .with_brief(a, |_| -> Result<(), NetError> { panic!("half-way") })
            .unwrap_err();
        assert!(
            matches!(&e, NetError::Internal(m) if m.contains("half-way")),
            "{e}"
        );
        for e in [
            t.with_brief(a, |v| Ok(*v)).unwrap_err(),
            t.view(|v| v.get(a).copied()).unwrap_err(),
            t.with(a, |v| Ok(*v)).unwrap_err(),
        ] {
            assert!(
                matches!(&e, NetError::Internal(m) if m.contains("failed in an earlier call")),
                "{e}"
            );
        }
        t.remove(b, |_| true).unwrap();
        let e = t.view(|v| v.get(b).copied()).unwrap_err();
        assert!(matches!(e, NetError::Usage(_)), "closed: {e}");
        assert!(t.with_brief(b, |v| Ok(*v)).is_err());
    }

    #[test]
    fn a_request_handle_is_stale_once_done_or_reissued() {
        let r = Requests::new();
        let id = ReqId::from_index(31).unwrap();
        let h = r.issue(0x1234_5678, id);
        assert!(h as usize > 1, "never NULL nor NCCL's 0x1 sentinel");
        let k = RequestKey::decode(h).unwrap();
        assert_eq!((k.comm, k.id), (0x1234_5678, id));
        assert!(r.current(&k));
        r.retire(&k);
        assert!(!r.current(&k), "tested after it completed");
        let h2 = r.issue(0x1234_5678, id);
        assert_ne!(h, h2);
        assert!(!r.current(&k) && r.current(&RequestKey::decode(h2).unwrap()));
    }
}
