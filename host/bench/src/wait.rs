//! How a rank waits and gives up: every wait is bounded by [`STALL`], so a rank whose peer died
//! stops by itself with one `error:` line, never a hang.

use std::time::{Duration, Instant};

use ncclwasm_abi::load::LoadError;

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

pub fn plugin_fail(e: LoadError) -> Error {
    Error::run(format!("plugin: {e}"))
}
