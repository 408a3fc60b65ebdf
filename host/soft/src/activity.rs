//! Where a thread spinning on empty completion queues waits for the soft "NIC" to do something.
//!
//! On a NIC an empty `poll_cq` is a memory read and a caller may spin on it forever (NCCL's
//! progress thread does, as does its `isend` on the clear-to-send FIFO). Here the "NIC" is
//! threads of this process on the same few cores: a spinner takes the CPU the responder and ack
//! threads need to produce what it waits for. Napping a fixed time (the first design: 20 µs every
//! 64 empty polls, which the kernel's timer slack stretches to ~70 µs) put that nap on every
//! small message's latency.
//!
//! Instead, everything the soft provider makes visible to a poller — a completion pushed to a
//! CQ, a remote write placed into registered memory (a clear-to-send entry arrives that way,
//! with no completion) — advances one process-wide counter, and a poller whose last
//! [`SPIN_POLLS`] polls found nothing and saw the counter unchanged sleeps on it (a futex) until
//! it moves, at most [`MAX_WAIT`]. Producers pay one atomic add per event, and a `FUTEX_WAKE`
//! only while somebody sleeps. The poller wakes the moment its completion (or its
//! clear-to-send) lands, not after a nap.
//!
//! The counter is watched per thread: a poll that finds the counter moved since this thread's
//! previous poll never waits, so an event that landed between two polls (which this thread may
//! not have looked at yet: the CTS it checks after polling) is not slept through.
//!
//! While connections are leased to pollers (`qp::serve`), their arrivals are for a poller to
//! serve, and no thread produces an event for them: the sleep is then a `poll` of the leased
//! sockets and of an eventfd (the bell) that producers ring as they would wake the futex.

use std::cell::Cell;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use smallvec::SmallVec;

use crate::abi::sys;

/// Empty polls in a row (with the counter unchanged) after which a polling thread waits.
const SPIN_POLLS: u32 = 64;

/// The longest wait: a backstop for progress that does not pass through the counter (a timer
/// expiring in the caller, a peer's clear-to-send the caller checks by itself), short next to
/// NCCL's own timeouts.
const MAX_WAIT: Duration = Duration::from_micros(500);

/// Moves on every completion and every placed remote write in this process.
static EVENTS: AtomicU32 = AtomicU32::new(0);
/// Threads sleeping on [`EVENTS`]: a producer issues `FUTEX_WAKE` only when there are any.
static SLEEPERS: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// This thread's empty polls in a row, and the counter as its previous poll saw it.
    static IDLE: Cell<(u32, u32)> = const { Cell::new((0, 0)) };
}

/// Something a poller may be waiting for happened: called after the completion is queued or
/// the bytes are in place.
pub(crate) fn happened() {
    // SeqCst pairs with the sleeper's: either it sees the new count (and does not sleep) or we
    // see it counted as a sleeper (and wake it).
    EVENTS.fetch_add(1, Ordering::SeqCst);
    if SLEEPERS.load(Ordering::SeqCst) > 0 {
        wake_all();
    }
}

/// The counter before a poll; pass it to [`polled`] afterwards.
pub(crate) fn before_poll() -> u32 {
    EVENTS.load(Ordering::SeqCst)
}

/// After a poll that found `found` completions, with the counter `seen` read before it: resets
/// the idle count, or counts one more empty poll and, past [`SPIN_POLLS`] of them with nothing
/// happening, waits for the counter to move.
pub(crate) fn polled(seen: u32, found: bool) {
    IDLE.with(|idle| {
        let (empty, last) = idle.get();
        if found || seen != last {
            idle.set((0, seen));
            return;
        }
        let empty = empty + 1;
        if empty < SPIN_POLLS {
            idle.set((empty, seen));
            return;
        }
        idle.set((0, seen));
        SLEEPERS.fetch_add(1, Ordering::SeqCst);
        wait_while(seen);
        SLEEPERS.fetch_sub(1, Ordering::SeqCst);
    });
}

/// Sleeps while [`EVENTS`] still reads `seen`, at most [`MAX_WAIT`] (spurious returns are fine:
/// the caller polls again). While connections are leased to pollers (the `serve` module of
/// `qp`), an arrival on one of them is something to wake for too: the sleep is a `poll` of
/// their sockets and of [`BELL`], which [`happened`] rings for such sleepers.
fn wait_while(seen: u32) {
    let mut fds = SmallVec::<[libc::pollfd; crate::qp::SLEEP_FDS + 1]>::new();
    if !crate::qp::sleep_fds(&mut fds) {
        return;
    }
    // No leased socket to wake for: the futex alone, and no bell is made.
    let Some(bell) = (!fds.is_empty()).then(bell).flatten() else {
        sys::futex_wait(&EVENTS, seen, MAX_WAIT);
        return;
    };
    fds.push(libc::pollfd {
        fd: bell.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    });
    if EVENTS.load(Ordering::SeqCst) != seen {
        return;
    }
    let ms = MAX_WAIT.as_micros().div_ceil(1000) as libc::c_int;
    // What woke it is for the caller's next poll to find; only the bell is emptied here.
    if sys::poll(&mut fds, ms).is_ok_and(|n| n > 0) && fds.last().is_some_and(|b| b.revents != 0) {
        let _ = (&*bell).read(&mut [0u8; 8]);
    }
}

/// Rung by [`happened`] while somebody sleeps on sockets (see [`wait_while`]); made by the
/// first such sleeper. `None` when no eventfd could be made: sleepers use the futex alone.
static BELL: OnceLock<Option<File>> = OnceLock::new();

fn bell() -> Option<&'static File> {
    BELL.get_or_init(|| sys::eventfd(sys::Eventfd::Counter).ok().map(File::from))
        .as_ref()
}

fn wake_all() {
    sys::futex_wake_all(&EVENTS);
    if let Some(Some(bell)) = BELL.get() {
        // Full only after 2^64 - 2 rings nobody read: then it is readable anyway.
        let _ = (&*bell).write(&1u64.to_ne_bytes());
    }
}
