//! Waiting for something another thread or process does.

use std::time::{Duration, Instant};

/// Between two looks at the condition: short, so a test does not wait much longer than the
/// event, and not a spin, so the thread doing the work gets the CPU on a loaded machine.
const POLL: Duration = Duration::from_millis(1);

/// Polls `done` until it returns `true`; panics naming `what` if it has not after `timeout`.
/// The timeout is a generous bound for a hang, never a measurement: tests that wait for
/// another thread or process call this instead of sleeping for a guessed time.
pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what}: still not the case after {timeout:?}"
        );
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn returns_once_another_thread_makes_it_true() {
        let flag = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| flag.store(true, Ordering::Release));
            wait_until("the flag is set", Duration::from_secs(60), || {
                flag.load(Ordering::Acquire)
            });
        });
    }

    #[test]
    #[should_panic(expected = "never: still not the case after")]
    fn panics_at_the_deadline() {
        wait_until("never", Duration::ZERO, || false);
    }
}
