//! Timing for benches that print figures of their own beside criterion's (ratios measured in
//! the same run); never for a test's assertion.

use std::time::{Duration, Instant};

/// Median time per call of `f` over `rounds` batches of `batch` calls: the median shrugs off a
/// batch a scheduler hiccup slowed down, the batch keeps the clock's cost out of short calls.
pub fn median_per_call(mut f: impl FnMut(), rounds: usize, batch: u32) -> Duration {
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..batch {
                f();
            }
            start.elapsed() / batch
        })
        .collect();
    times.sort();
    times[rounds / 2]
}
