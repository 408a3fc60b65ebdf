//! What a bench figure cost in CPU, not only in time: the CPU this process's threads used over
//! one part of one size, per message, from `/proc/self/task/*/schedstat` (nanoseconds on a CPU
//! per thread, summed). A spinning poller, a fabric thread and the kernel's work for a socket
//! all count; a thread that exits within the part takes its time with it, and the parts keep
//! their threads.

use std::time::Duration;

use super::wire::{self, CpuUse, Msg, Part};
use crate::Error;

/// The CPU time this process has used so far, its live threads summed.
fn used() -> Result<Duration, Error> {
    let tasks = std::fs::read_dir("/proc/self/task")
        .map_err(|e| Error::run(format!("/proc/self/task: {e}")))?;
    let mut ns = 0u64;
    for task in tasks.flatten() {
        // A thread may end between the listing and the read: it is not counted.
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(Duration::from_nanos(ns))
}

/// The CPU a part uses from [`CpuClock::start`] to [`CpuClock::report`].
#[derive(Debug)]
pub struct CpuClock(Duration);

impl CpuClock {
    pub fn start() -> Result<CpuClock, Error> {
        used().map(CpuClock)
    }

    /// Tells the parent what `part` of `size` used over `messages` messages (round trips for a
    /// ping-pong) since [`CpuClock::start`].
    pub fn report(self, part: Part, size: usize, messages: u32) -> Result<(), Error> {
        let secs = used()?.saturating_sub(self.0).as_secs_f64();
        wire::send(&Msg::Cpu(CpuUse {
            part,
            size: size as u64,
            messages,
            secs,
        }))
    }
}
