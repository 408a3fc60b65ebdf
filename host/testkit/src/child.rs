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
//!
//! Children that must talk to each other (the two ends of a connection exchanging a handle,
//! as NCCL's bootstrap would) do it through [`relay`]: each prints protocol lines starting
//! with [`TAG`] and reads the others' from its stdin.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Mutex, Once};
use std::time::Duration;

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

/// Runs the test `test` again in a child process with `vars` set — how one test gets its own
/// environment without touching the parent's. Returns `true` in the parent (the child ran the
/// test and passed), `false` in the child, which then runs the test body.
pub fn rerun_with_env(test: &str, vars: &[(&str, &str)]) -> bool {
    if enter(test) {
        return false;
    }
    let mut child = command(test);
    child.envs(vars.iter().copied());
    let out = run(child, test);
    // Shown with this test's own output (captured by libtest unless it fails or --nocapture).
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    true
}

/// Protocol lines between [`relay`]ed children start with this; libtest's own output does not.
pub const TAG: &str = "@@";

/// Prints one protocol line (`TAG` + `msg`) to the other children of a [`relay`], flushed.
pub fn say(msg: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{TAG}{msg}")
        .and_then(|()| out.flush())
        .expect("print a protocol line");
}

/// What one child of a [`relay`] did: its exit status and the protocol lines it printed
/// (with the [`TAG`]).
#[derive(Debug)]
pub struct Relayed {
    pub name: String,
    pub status: ExitStatus,
    pub lines: Vec<String>,
}

/// Starts every `(name, command)` (from [`command`] or [`command_via`]) with piped stdin and
/// stdout, copies each [`TAG`] line a child prints to every other child's stdin, and returns
/// what each did once all have exited. A child's stdin is closed when every other child is
/// done, so nobody waits forever for a line that cannot come; past `timeout` every child is
/// killed, so a stuck exchange fails the test instead of hanging it. Stderr is inherited.
pub fn relay(children: Vec<(String, Command)>, timeout: Duration) -> Vec<Relayed> {
    let mut started = Vec::new();
    for (name, mut cmd) in children {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting child {name}: {e}"));
        started.push((name, child));
    }
    let n = started.len();
    let stdins: Vec<Mutex<Option<ChildStdin>>> = started
        .iter_mut()
        .map(|(_, c)| Mutex::new(c.stdin.take()))
        .collect();
    let outs: Vec<_> = started
        .iter_mut()
        .map(|(_, c)| c.stdout.take().expect("piped stdout"))
        .collect();
    let done = Mutex::new(vec![false; n]);
    let children = Mutex::new(started);
    // Dropped once every relay is done (or this thread unwinds), which ends the watchdog.
    let (finished, watchdog) = mpsc::channel::<()>();
    let lines = std::thread::scope(|s| {
        let children = &children;
        s.spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = watchdog.recv_timeout(timeout) {
                for (_, c) in children.lock().unwrap().iter_mut() {
                    let _ = c.kill();
                }
            }
        });
        let relays: Vec<_> = outs
            .into_iter()
            .enumerate()
            .map(|(i, out)| {
                let (stdins, done) = (&stdins, &done);
                s.spawn(move || {
                    let mut seen = Vec::new();
                    for line in BufReader::new(out).lines() {
                        let Ok(line) = line else { break };
                        // libtest may print "test name ... " on the same line first.
                        let Some(at) = line.find(TAG) else { continue };
                        let line = line[at..].to_owned();
                        let others = stdins.iter().enumerate().filter(|&(k, _)| k != i);
                        for (_, stdin) in others {
                            if let Some(w) = stdin.lock().unwrap().as_mut() {
                                // The peer may have exited already; its status is returned.
                                let _ = writeln!(w, "{line}").and_then(|()| w.flush());
                            }
                        }
                        seen.push(line);
                    }
                    let mut done = done.lock().unwrap();
                    done[i] = true;
                    for (k, stdin) in stdins.iter().enumerate() {
                        if (0..n).all(|j| j == k || done[j]) {
                            stdin.lock().unwrap().take();
                        }
                    }
                    seen
                })
            })
            .collect();
        let lines: Vec<Vec<String>> = relays
            .into_iter()
            .map(|r| r.join().expect("relay thread"))
            .collect();
        drop(finished);
        lines
    });
    children
        .into_inner()
        .unwrap()
        .into_iter()
        .zip(lines)
        .map(|((name, mut child), lines)| Relayed {
            status: child.wait().expect("wait for a child"),
            name,
            lines,
        })
        .collect()
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

    /// Two children learn each other's line through the relay; each then says it heard it.
    #[test]
    fn relayed_children_hear_each_other() {
        const TEST: &str = "child::tests::relayed_children_hear_each_other";
        const ROLE: &str = "NCCLWASM_TESTKIT_ROLE";
        if enter(TEST) {
            let me = std::env::var(ROLE).unwrap();
            say(&format!("HELLO {me}"));
            let heard = std::io::stdin()
                .lines()
                .map(|l| l.unwrap())
                .find(|l| l.starts_with("@@HELLO"))
                .expect("the other child's hello");
            assert_ne!(heard, format!("@@HELLO {me}"));
            say(&format!("HEARD {heard}"));
            return;
        }
        let children = ["a", "b"]
            .map(|role| {
                let mut c = command(TEST);
                c.env(ROLE, role);
                (role.to_owned(), c)
            })
            .into();
        let got = relay(children, Duration::from_secs(30));
        for (r, other) in got.iter().zip(["b", "a"]) {
            assert!(r.status.success(), "{r:?}");
            assert_eq!(
                r.lines.last().map(String::as_str),
                Some(format!("@@HEARD @@HELLO {other}").as_str()),
                "{r:?}"
            );
        }
    }

    #[test]
    fn proofs_do_not_match_a_prefix_of_the_name() {
        assert!(ran("a", &format!("test a ... {}\nok", proof("a"))));
        assert!(!ran("a", &proof("a_b")));
        assert!(!ran("a_b", &proof("a")));
    }
}
