//! Re-running one test of the current test binary in a child process, with proof that it ran.
//!
//! Some tests need a process of their own: their own environment variables, the other end of a
//! connection, a provider that reads its topology once per process. They re-run their test
//! binary filtered to one test with `--exact`. libtest exits successfully when the filter
//! matches nothing, so after a rename the child would run zero tests and the parent would pass
//! having checked nothing. Hence the proof: the child's side starts with [`enter`], which
//! prints a line naming the test, and the parent requires that line besides the exit status
//! ([`assert_ran`], [`run`]). Entered, and exited successfully, means the test ran in the
//! child and passed.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Once;

/// Set in the child to the name of the test it was started for.
const ENV: &str = "NCCLWASM_TESTKIT_CHILD";

/// The proof line for `test`, quoted so that a test's name is not a prefix of another's.
fn proof(test: &str) -> String {
    format!("ncclwasm-testkit: child entered {test:?}")
}

fn this_binary() -> PathBuf {
    std::env::current_exe().expect("the path of this test binary")
}

fn add_args(cmd: &mut Command, test: &str) {
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV, test);
}

/// The command that runs `test`, and only it, of this test binary in a child process. Add
/// environment and stdio to it, then check it with [`run`] or [`assert_ran`].
pub fn command(test: &str) -> Command {
    let mut cmd = Command::new(this_binary());
    add_args(&mut cmd, test);
    cmd
}

/// [`command`] started through `launcher` (say `ip netns exec <ns>`): the test binary and its
/// arguments are appended to the launcher's.
pub fn command_via(mut launcher: Command, test: &str) -> Command {
    launcher.arg(this_binary());
    add_args(&mut launcher, test);
    launcher
}

/// Whether this process is a child started by [`command`], for any test.
pub fn is_child() -> bool {
    std::env::var_os(ENV).is_some()
}

/// In the child started for `test`: prints the proof (once per process) and returns `true`;
/// the caller then runs the child's side. Anywhere else, `false`.
pub fn enter(test: &str) -> bool {
    if std::env::var_os(ENV).is_none_or(|v| v != test) {
        return false;
    }
    static PROOF: Once = Once::new();
    PROOF.call_once(|| {
        // Straight to stdout, past libtest's capture; one line, flushed, so a parent reading
        // line by line sees it whatever the child prints next.
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", proof(test))
            .and_then(|()| out.flush())
            .expect("print the child's proof");
    });
    true
}

/// Whether `stdout`, a child's standard output, holds the proof that it entered `test`.
pub fn ran(test: &str, stdout: &str) -> bool {
    let proof = proof(test);
    stdout.lines().any(|l| l.contains(&proof))
}

/// Asserts that the child started for `test` ran it and passed: it exited successfully and
/// printed the proof. Shows the child's output otherwise.
pub fn assert_ran(test: &str, out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{test} failed in its child process ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        ran(test, &stdout),
        "the child process never entered {test:?} (renamed, or not calling \
         testkit::child::enter?):\n{stdout}\n{stderr}"
    );
}

/// Runs `cmd` (from [`command`]) to completion and [`assert_ran`]s it; returns its output.
pub fn run(mut cmd: Command, test: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("starting the child process for {test}: {e}"));
    assert_ran(test, &out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_proves_it_ran() {
        const TEST: &str = "child::tests::a_child_proves_it_ran";
        if enter(TEST) {
            assert!(is_child());
            return;
        }
        assert!(!is_child());
        let out = run(command(TEST), TEST);
        // Once, even if the child's side calls `enter` again.
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.matches(&proof(TEST)).count(), 1, "{stdout}");
    }

    #[test]
    #[should_panic(expected = "never entered \"child::tests::no_such_test\"")]
    fn a_child_that_ran_no_test_fails_the_parent() {
        run(
            command("child::tests::no_such_test"),
            "child::tests::no_such_test",
        );
    }

    #[test]
    fn proofs_do_not_match_a_prefix_of_the_name() {
        assert!(ran("a", &format!("test a ... {}\nok", proof("a"))));
        assert!(!ran("a", &proof("a_b")));
        assert!(!ran("a_b", &proof("a")));
    }
}
