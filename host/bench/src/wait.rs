//! How a rank waits and gives up: every wait is bounded by [`STALL`], so a rank whose peer died
//! stops by itself with one `error:` line, never a hang — a stream of transfers through either
//! kind of table ([`stream`]) included.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ncclwasm_abi::load::{LoadError, Request};
use ncclwasm_abi::load_rma::RmaRequest;

use crate::Error;

/// The longest any single wait may take (a transfer making no progress, a peer not
/// connecting) before the rank gives up.
pub const STALL: Duration = Duration::from_secs(30);

/// Calls `attempt` until it yields, for at most [`STALL`].
pub fn retry<T>(
    what: &str,
    mut attempt: impl FnMut() -> Result<Option<T>, Error>,
) -> Result<T, Error> {
    let start = Instant::now();
    loop {
        if let Some(v) = attempt()? {
            return Ok(v);
        }
        if start.elapsed() > STALL {
            return Err(Error::run(format!(
                "{what} did not complete within {} s (is the other rank alive?)",
                STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
}

/// Calls `attempt(i)` for every `slots[i]` still empty until all are filled; fails after
/// [`STALL`] without one of them progressing.
pub fn until_all<T>(
    what: &str,
    slots: &mut [Option<T>],
    mut attempt: impl FnMut(usize) -> Result<Option<T>, Error>,
) -> Result<(), Error> {
    let mut pending = slots.len();
    let mut progress = Instant::now();
    while pending > 0 {
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_none() {
                *slot = attempt(i)?;
                if slot.is_some() {
                    pending -= 1;
                    progress = Instant::now();
                }
            }
        }
        if progress.elapsed() > STALL {
            return Err(Error::run(format!(
                "{what}: {pending} of {} connections made no progress for {} s (is the other rank alive?)",
                slots.len(),
                STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
    Ok(())
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
    let mut progress = Instant::now();
    while posted < n || !inflight.is_empty() {
        if posted < n
            && inflight.len() < WINDOW
            && let Some(r) = post()?
        {
            inflight.push_back(r);
            posted += 1;
            progress = Instant::now();
            continue;
        }
        if let Some(front) = inflight.front_mut()
            && let Some(size) = front.poll()?
        {
            total += size;
            inflight.pop_front();
            progress = Instant::now();
            continue;
        }
        if progress.elapsed() > STALL {
            return Err(Error::run(format!(
                "no transfer completed for {} s (is the other rank alive?)",
                STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
    Ok(total)
}

pub fn plugin_fail(e: LoadError) -> Error {
    Error::run(format!("plugin: {e}"))
}
