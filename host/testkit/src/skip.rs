//! Skips that are seen and counted.
//!
//! A test that cannot run its checks on this host (no root, no RDMA hardware, a fabric without
//! a feature) returns early, and libtest reports it as passed. [`skip`] makes the difference
//! visible: a `SKIP:` line in the output, and one line in the file `cargo xtask test` names in
//! [`SKIP_LOG_ENV`], which it counts and lists at the end of the run.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;

/// Names the file every [`skip`] appends one line to (set by `cargo xtask test`; unset, skips
/// are only printed).
pub const SKIP_LOG_ENV: &str = "NCCLWASM_SKIP_LOG";

/// Records that the calling test skips its checks because of `reason`; the caller then returns.
///
/// The line names the test (libtest runs each test on a thread named after it) and the test
/// binary, since one test function can run in several binaries. It goes straight to the
/// process's stderr, past libtest's capture, so it is in the log of a passing run too.
pub fn skip(reason: &str) {
    let exe = std::env::current_exe().unwrap_or_default();
    let line = record(std::thread::current().name(), &binary(&exe), reason);
    // Best effort, like libtest's own output: a closed stderr must not fail the test.
    let _ = writeln!(std::io::stderr().lock(), "SKIP: {line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_ENV) {
        append(Path::new(&log), &line);
    }
}

/// `<test> (<binary>): <reason>`; the thread is `main` when a binary has no libtest harness.
fn record(thread: Option<&str>, binary: &str, reason: &str) -> String {
    match thread {
        Some(test) if test != "main" => format!("{test} ({binary}): {reason}"),
        _ => format!("{binary}: {reason}"),
    }
}

/// The test binary's name without the hash cargo appends (`soft-0123456789abcdef` → `soft`).
fn binary(exe: &Path) -> String {
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name.to_owned()
        }
        _ => stem,
    }
}

/// Appends `line` to the skip log. One `write` of one line on an `O_APPEND` file, so test
/// processes running at the same time do not interleave; a log that cannot be written fails
/// the test, since the count would be wrong.
fn append(log: &Path, line: &str) {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()))
        .unwrap_or_else(|e| panic!("recording the skip in {}: {e}", log.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_names_test_binary_and_reason() {
        assert_eq!(
            record(Some("tests::peer"), "soft", "needs root"),
            "tests::peer (soft): needs root"
        );
        assert_eq!(record(Some("main"), "bench", "why"), "bench: why");
        assert_eq!(record(None, "bench", "why"), "bench: why");
    }

    #[test]
    fn the_binary_name_drops_cargos_hash_only() {
        let b = |p: &str| binary(Path::new(p));
        assert_eq!(b("/t/debug/deps/ib_soft-0123456789abcdef"), "ib_soft");
        assert_eq!(b("/t/debug/deps/two-words"), "two-words");
        assert_eq!(b("/t/debug/deps/x-0123456789abcdeg"), "x-0123456789abcdeg");
    }

    /// End to end, in a child with a log of its own (this process may be logging for
    /// `cargo xtask test`, whose count must not include this test).
    #[test]
    fn a_skip_is_printed_and_logged_once_per_call() {
        const TEST: &str = "skip::tests::a_skip_is_printed_and_logged_once_per_call";
        if crate::child::enter(TEST) {
            skip("first reason");
            skip("second reason");
            return;
        }
        let log = std::env::temp_dir().join(format!("ncclwasm-skip-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&log);
        let mut child = crate::child::command(TEST);
        child.env(SKIP_LOG_ENV, &log);
        let out = crate::child::run(child, TEST);
        let logged = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_file(&log).unwrap();
        let line = |reason: &str| format!("{TEST} (ncclwasm_testkit): {reason}");
        assert_eq!(
            logged,
            format!("{}\n{}\n", line("first reason"), line("second reason"))
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let printed: Vec<&str> = stderr.lines().filter(|l| l.starts_with("SKIP: ")).collect();
        assert_eq!(
            printed,
            [
                format!("SKIP: {}", line("first reason")),
                format!("SKIP: {}", line("second reason"))
            ]
        );
    }
}
