//! Which unauthenticated connections a listener keeps, for how long, and how often it complains.
//!
//! A handshake listener's port is reachable by anyone on the network: port scanners, a rank of
//! a previous job holding a stale handle, something speaking another protocol. Such a connection
//! must cost the listener one bounded slot for a bounded time and never the communicator; NCCL's
//! own socket layer likewise drops bad connections and goes on accepting. The I/O shells (the
//! transport's listener, the soft fabric's QP ports) keep each connection that has not yet
//! proved itself in a [`Pending`] set and count the ones they drop through a [`Throttle`].
//!
//! Time is an input: every call takes `now`, so the rules are tested with an explicit clock.
//!
//! This is listener policy, not protocol: it decides nothing that goes on the wire, so it lives
//! beside the protocol crate (`ncclwasm-proto`) rather than in it, and depends on nothing of
//! ours.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Connections a listener may hold before they prove themselves. A real peer proves itself
/// with its first message, sent right after connecting, so it occupies a slot for well under a
/// millisecond; 64 slots let that many peers race in at once while a flood of strangers costs
/// at most 64 file descriptors and 64 small buffers.
pub const MAX_PENDING: usize = 64;

/// How long the transport's listener waits for a connection's hello. A connector sends its
/// hello as soon as its non-blocking connect completes, and NCCL calls `connect` in a tight
/// loop, so anything slower is a stranger or a peer so overloaded that NCCL's own bootstrap
/// would have timed out first; 10 s leaves room for a heavily loaded node without letting an
/// idle socket sit forever.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(10);

/// The shortest time between two WARN lines about dropped strangers: a scan of 30 000
/// connections gives a handful of lines, each carrying how many were dropped in between.
pub const WARN_INTERVAL: Duration = Duration::from_secs(5);

/// A bounded set of connections waiting to prove themselves, oldest first, each with a
/// deadline.
///
/// When the set is full the oldest entry is evicted to make room: strangers arrive in bulk and
/// then sit, while a real peer proves itself within a round trip of arriving, so the newest
/// arrival is the likeliest to be real and the oldest the likeliest to be an idle stranger.
#[derive(Debug)]
pub struct Pending<T> {
    cap: usize,
    deadline: Duration,
    items: VecDeque<(Instant, T)>,
}

impl<T> Pending<T> {
    /// At most `cap` entries (at least one), each dropped `deadline` after it was admitted.
    pub fn new(cap: usize, deadline: Duration) -> Self {
        Pending {
            cap: cap.max(1),
            deadline,
            items: VecDeque::new(),
        }
    }

    /// Adds `item`, admitted at `now`; returns the entry evicted to make room, if any.
    pub fn admit(&mut self, item: T, now: Instant) -> Option<T> {
        let evicted = if self.items.len() >= self.cap {
            self.items.pop_front().map(|(_, t)| t)
        } else {
            None
        };
        self.items.push_back((now, item));
        evicted
    }

    /// Removes and returns every entry whose deadline has passed at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<T> {
        let mut out = Vec::new();
        // Admission times only grow along the queue, so the expired entries are a prefix.
        while self
            .items
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= self.deadline)
        {
            out.extend(self.items.pop_front().map(|(_, t)| t));
        }
        out
    }

    /// Runs `step` on every entry, oldest first; the entries for which it returns an outcome
    /// leave the set and come back with it.
    pub fn settle<R>(&mut self, mut step: impl FnMut(&mut T) -> Option<R>) -> Vec<(T, R)> {
        let mut done = Vec::new();
        let mut kept = VecDeque::with_capacity(self.items.len());
        for (at, mut item) in self.items.drain(..) {
            match step(&mut item) {
                Some(r) => done.push((item, r)),
                None => kept.push_back((at, item)),
            }
        }
        self.items = kept;
        done
    }

    /// When the oldest entry expires (`None` when the set is empty or the time is not
    /// representable): how long a shell waiting for input may sleep.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.items
            .front()
            .and_then(|(at, _)| at.checked_add(self.deadline))
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether no entry is waiting.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The entries, oldest first (a poll set is built from them).
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter().map(|(_, t)| t)
    }
}

/// Rate limit for a WARN about events that may come by the thousand: at most one line per
/// interval, and that line says how many events it stands for.
#[derive(Debug)]
pub struct Throttle {
    interval: Duration,
    last: Option<Instant>,
    held: u64,
}

impl Throttle {
    /// At most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            last: None,
            held: 0,
        }
    }

    /// One more event at `now`. `Some(n)`: write a line now, for this event and the `n` held
    /// back since the previous line. `None`: stay quiet (the event is counted for the next
    /// line).
    pub fn hit(&mut self, now: Instant) -> Option<u64> {
        let due = self
            .last
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            self.last = Some(now);
            Some(std::mem::take(&mut self.held))
        } else {
            self.held = self.held.saturating_add(1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn full_set_evicts_the_oldest() {
        let t0 = Instant::now();
        let mut p = Pending::new(3, secs(10));
        for i in 0..3 {
            assert_eq!(p.admit(i, t0 + secs(i)), None);
        }
        assert_eq!(p.admit(3, t0 + secs(3)), Some(0));
        assert_eq!(p.admit(4, t0 + secs(3)), Some(1));
        assert_eq!(p.iter().copied().collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn zero_capacity_still_holds_the_newest() {
        let t0 = Instant::now();
        let mut p = Pending::new(0, secs(1));
        assert_eq!(p.admit('a', t0), None);
        assert_eq!(p.admit('b', t0), Some('a'));
    }

    #[test]
    fn entries_expire_at_their_own_deadline() {
        let t0 = Instant::now();
        let mut p = Pending::new(8, secs(10));
        p.admit("early", t0);
        p.admit("late", t0 + secs(4));
        assert_eq!(p.next_deadline(), Some(t0 + secs(10)));
        assert!(p.expire(t0 + secs(9)).is_empty());
        assert_eq!(p.expire(t0 + secs(10)), ["early"]);
        assert_eq!(p.next_deadline(), Some(t0 + secs(14)));
        assert!(p.expire(t0 + secs(13)).is_empty());
        assert_eq!(p.expire(t0 + secs(20)), ["late"]);
        assert!(p.is_empty());
        assert_eq!(p.next_deadline(), None);
    }

    #[test]
    fn a_clock_going_backwards_expires_nothing() {
        let t0 = Instant::now() + secs(100);
        let mut p = Pending::new(8, secs(1));
        p.admit(1, t0);
        assert!(p.expire(t0 - secs(50)).is_empty());
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn settle_removes_finished_entries_and_keeps_order_and_deadlines() {
        let t0 = Instant::now();
        let mut p = Pending::new(8, secs(10));
        for i in 0..6 {
            p.admit(i, t0 + secs(i));
        }
        let done = p.settle(|i| (*i % 2 == 0).then(|| *i * 10));
        assert_eq!(done, [(0, 0), (2, 20), (4, 40)]);
        assert_eq!(p.iter().copied().collect::<Vec<_>>(), [1, 3, 5]);
        // Entry 1 keeps its own admission time.
        assert_eq!(p.next_deadline(), Some(t0 + secs(11)));
        // `step` may change the entries it keeps.
        assert!(
            p.settle(|i| {
                *i += 100;
                None::<()>
            })
            .is_empty()
        );
        assert_eq!(p.iter().copied().collect::<Vec<_>>(), [101, 103, 105]);
    }

    #[test]
    fn throttle_writes_one_line_per_interval_with_the_held_count() {
        let t0 = Instant::now();
        let mut t = Throttle::new(secs(5));
        assert_eq!(t.hit(t0), Some(0));
        for s in 0..4 {
            assert_eq!(t.hit(t0 + secs(s)), None);
        }
        assert_eq!(t.hit(t0 + secs(5)), Some(4));
        assert_eq!(t.hit(t0 + secs(6)), None);
        assert_eq!(t.hit(t0 + secs(11)), Some(1));
        // A quiet spell: the next event is written at once.
        assert_eq!(t.hit(t0 + secs(100)), Some(0));
    }
}
