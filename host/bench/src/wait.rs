//! How a rank waits and gives up: every wait is bounded by [`stall`] *without progress*, so a
//! rank whose peer died stops by itself with one `error:` line, never a hang — a stream of
//! transfers through either kind of table ([`stream`]) included — while a long measurement that
//! keeps moving is never cut short. Whatever completes also tells the parent, at most every
//! [`Beat`], that this rank still moves ([`moved`]): the parent's own bound
//! ([`super::ranks`]) counts time without a line from any rank, and a timed stream of minutes
//! reports nothing else until it ends.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ncclwasm_abi::load::{LoadError, Request};
use ncclwasm_abi::load_rma::RmaRequest;

use super::wire::{self, Msg};
use crate::Error;

/// The longest a wait may go without progress (a transfer, a connection, a signal) before the
/// rank gives up: 30 s. `NCCL_WASM_BENCH_STALL_MS` sets it — internal, for the tests that show
/// a stuck rank failing the run and a slow one not, without waiting minutes for either.
pub fn stall() -> Duration {
    static STALL: OnceLock<Duration> = OnceLock::new();
    *STALL.get_or_init(|| {
        Duration::from_millis(millis_from_env("NCCL_WASM_BENCH_STALL_MS").unwrap_or(30_000))
    })
}

/// Internal, for the tests: each transfer a [`stream`] completes then takes this much longer,
/// as if the fabric were that slow (`NCCL_WASM_BENCH_PACE_MS`; none when unset). Far below
/// [`stall`] it makes a run slow but moving; far above, a rank that stopped.
fn pace() -> Option<Duration> {
    static PACE: OnceLock<Option<Duration>> = OnceLock::new();
    *PACE.get_or_init(|| millis_from_env("NCCL_WASM_BENCH_PACE_MS").map(Duration::from_millis))
}

fn millis_from_env(var: &str) -> Option<u64> {
    std::env::var(var).ok()?.parse().ok()
}

/// `d` as the one-line errors print it: `30 s`, `0.5 s`.
pub fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// A regular beat: due once every tenth of [`stall`], so a listener bounded by the stall (or
/// by twice it, the parent) hears several beats from anything that moves.
#[derive(Debug)]
pub struct Beat {
    every: Duration,
    last: Instant,
}

impl Beat {
    pub fn new(now: Instant) -> Beat {
        Beat::every(stall() / 10, now)
    }

    fn every(every: Duration, now: Instant) -> Beat {
        Beat { every, last: now }
    }

    /// Whether a beat is due at `now`; if so the next one is counted from `now`.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = now.saturating_duration_since(self.last) >= self.every;
        if due {
            self.last = now;
        }
        due
    }
}

/// Something completed: the parent hears so ([`Msg::Moving`]) when a [`Beat`] is due.
pub fn moved() -> Result<(), Error> {
    let now = Instant::now();
    thread_local! {
        static PULSE: RefCell<Option<Beat>> = const { RefCell::new(None) };
    }
    let due = PULSE.with_borrow_mut(|beat| beat.get_or_insert_with(|| Beat::new(now)).due(now));
    if due {
        wire::send(&Msg::Moving)?;
    }
    Ok(())
}

/// What one look at a wait found.
pub enum Look<T> {
    /// It is over, with this.
    Done(T),
    /// Not over, but something completed since the last look: the bound starts again.
    Moved,
    /// Nothing new.
    Idle,
}

/// Looks until `look` says it is done; fails after [`stall`] without a look that found
/// progress.
pub fn watch<T>(what: &str, mut look: impl FnMut() -> Result<Look<T>, Error>) -> Result<T, Error> {
    let mut progress = Instant::now();
    loop {
        match look()? {
            Look::Done(v) => {
                moved()?;
                return Ok(v);
            }
            Look::Moved => {
                progress = Instant::now();
                moved()?;
            }
            Look::Idle if progress.elapsed() > stall() => {
                return Err(Error::run(format!(
                    "{what}: no progress for {} (is the other rank alive?)",
                    secs(stall())
                )));
            }
            Look::Idle => std::thread::yield_now(),
        }
    }
}

/// Calls `attempt` until it yields, for at most [`stall`].
pub fn retry<T>(
    what: &str,
    mut attempt: impl FnMut() -> Result<Option<T>, Error>,
) -> Result<T, Error> {
    watch(what, || Ok(attempt()?.map_or(Look::Idle, Look::Done)))
}

/// Calls `attempt(i)` for every `slots[i]` still empty until all are filled; fails after
/// [`stall`] without one of them progressing.
pub fn until_all<T>(
    what: &str,
    slots: &mut [Option<T>],
    mut attempt: impl FnMut(usize) -> Result<Option<T>, Error>,
) -> Result<(), Error> {
    let mut pending = slots.len();
    watch(what, || {
        let before = pending;
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_none() {
                *slot = attempt(i)?;
                pending -= usize::from(slot.is_some());
            }
        }
        Ok(match pending {
            0 => Look::Done(()),
            _ if pending < before => Look::Moved,
            _ => Look::Idle,
        })
    })
}

/// Requests in flight per side while streaming: NCCL's `NCCL_STEPS`.
pub const WINDOW: usize = 8;

/// A posted transfer, two-sided or one-sided, polled until done: the bytes it moved, once it
/// has.
pub trait Transfer {
    fn poll(&mut self) -> Result<Option<usize>, Error>;
}

impl Transfer for Request<'_> {
    fn poll(&mut self) -> Result<Option<usize>, Error> {
        self.test().map_err(plugin_fail)
    }
}

impl Transfer for RmaRequest<'_> {
    fn poll(&mut self) -> Result<Option<usize>, Error> {
        self.test().map_err(plugin_fail)
    }
}

/// `n` transfers posted by `post`, at most [`WINDOW`] in flight, each tested to completion;
/// returns the sizes they reported, summed.
pub fn stream<R: Transfer>(
    n: u32,
    mut post: impl FnMut() -> Result<Option<R>, Error>,
) -> Result<usize, Error> {
    let mut inflight: VecDeque<R> = VecDeque::new();
    let (mut posted, mut total) = (0, 0);
    watch("a stream of transfers", || {
        if posted == n && inflight.is_empty() {
            return Ok(Look::Done(total));
        }
        if posted < n
            && inflight.len() < WINDOW
            && let Some(r) = post()?
        {
            inflight.push_back(r);
            posted += 1;
            return Ok(Look::Moved);
        }
        let Some(size) = inflight
            .front_mut()
            .map(Transfer::poll)
            .transpose()?
            .flatten()
        else {
            return Ok(Look::Idle);
        };
        total += size;
        inflight.pop_front();
        if let Some(pace) = pace() {
            std::thread::sleep(pace);
        }
        Ok(Look::Moved)
    })
}

pub fn plugin_fail(e: LoadError) -> Error {
    Error::run(format!("plugin: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_is_due_once_per_period_counted_from_the_last() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut beat = Beat::every(ms(100), t0);
        assert!(!beat.due(t0 + ms(99)));
        assert!(beat.due(t0 + ms(100)));
        assert!(!beat.due(t0 + ms(150)));
        assert!(beat.due(t0 + ms(250)));
        // A clock read before the last beat (another thread's) is not a beat.
        assert!(!beat.due(t0));
    }

    #[test]
    fn a_bound_prints_in_seconds() {
        assert_eq!(secs(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(secs(Duration::from_secs(30)), "30 s");
    }
}
