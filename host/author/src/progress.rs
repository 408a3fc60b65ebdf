//! Progress of the long steps an operator waits on: a cold `policy build`, the first compile of
//! a big (Python, JavaScript) component, `cargo xtask dist`'s packing.
//!
//! Shown as cargo and pip show theirs: on a terminal, one line redrawn in place — a spinner, what
//! is happening and how long it has taken — between a start line and an end line; in a pipe or a
//! CI log, where a redrawn line is noise, only the start line and the end line, with no control
//! characters. The start line says up front why the step is long (the `why` of [`Step::start`]),
//! the end line how long it took.
//!
//! What is written is a pure function of the step and the time elapsed ([`start_line`],
//! [`frame`], [`end_line`]); a [`Step`] only writes it. On a terminal a thread of its own
//! redraws the line ten times a second and sleeps in between, so the work being timed (a
//! compile that keeps a core busy) is not slowed by it. Progress is advice: a stderr that cannot
//! be written is ignored.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a terminal's line is redrawn: often enough to look alive, rarely enough to cost
/// nothing.
const FRAME: Duration = Duration::from_millis(100);

/// The spinner's frames (pip's, from rich).
const SPINNER: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

/// A redrawn line that wraps cannot be erased by `\r`, so a frame is cut to this many
/// characters (the narrowest terminal anyone keeps, less one).
const FRAME_WIDTH: usize = 79;

/// Back to the start of the line and erase it: what every redraw and the end line begin with.
const ERASE: &str = "\r\x1b[2K";

/// Where the lines go, shared by the caller and the spinner's thread.
type Out = Arc<Mutex<Box<dyn Write + Send>>>;

/// One long step being shown. [`Step::finish`] writes its end line; a step dropped unfinished (the
/// caller is returning an error) writes `<what>: stopped (<elapsed>)` instead, and the caller's
/// error follows.
pub struct Step {
    what: String,
    started: Instant,
    terminal: bool,
    out: Out,
    /// The spinner's thread and what stops it, on a terminal until the step ends.
    spinner: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    ended: bool,
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("what", &self.what)
            .field("terminal", &self.terminal)
            .finish_non_exhaustive()
    }
}

impl Step {
    /// Starts a step on stderr: `what` is what is happening ("compiling x.wasm"), `why` why it
    /// will take long, said up front. A spinner only when stderr is a terminal that understands
    /// erasing a line (not `TERM=dumb`).
    pub fn start(what: &str, why: Option<&str>) -> Step {
        let stderr = std::io::stderr();
        let terminal = stderr.is_terminal() && std::env::var_os("TERM").is_none_or(|t| t != "dumb");
        Step::start_on(Box::new(stderr), terminal, what, why)
    }

    /// A step run by a tool that draws its own progress on stderr (cargo's bar, npm's): the
    /// start and end lines only, so no spinner is drawn over the tool's output.
    pub fn around_tool(what: &str, why: Option<&str>) -> Step {
        Step::start_on(Box::new(std::io::stderr()), false, what, why)
    }

    /// [`Step::start`] on any output, told whether it is a terminal (tests write to a buffer).
    pub fn start_on(
        out: Box<dyn Write + Send>,
        terminal: bool,
        what: &str,
        why: Option<&str>,
    ) -> Step {
        let started = Instant::now();
        let out = Arc::new(Mutex::new(out));
        let mut text = start_line(what, why);
        if terminal {
            // The first frame now, so a step that ends within a frame still showed one.
            text += &format!("{ERASE}{}", frame(what, 0, Duration::ZERO));
        }
        write(&out, &text);
        // Without a thread (none to be had) the terminal still gets its start and end lines.
        let spinner = terminal
            .then(|| spin(Arc::clone(&out), what.to_owned(), started))
            .flatten();
        Step {
            what: what.to_owned(),
            started,
            terminal,
            out,
            spinner,
            ended: false,
        }
    }

    /// Ends the step with `done` ("compiled x.wasm") and the time it took.
    pub fn finish(mut self, done: &str) {
        let line = end_line(done, self.started.elapsed());
        self.end(&line);
    }

    /// Stops the spinner, erases its line on a terminal, and writes `line`.
    fn end(&mut self, line: &str) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some((stop, thread)) = self.spinner.take() {
            stop.store(true, Ordering::Release);
            thread.thread().unpark();
            // The thread only formats and writes; a panic there has nothing to hand back.
            let _ = thread.join();
        }
        let erase = if self.terminal { ERASE } else { "" };
        write(&self.out, &format!("{erase}{line}"));
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let line = end_line(&format!("{}: stopped", self.what), self.started.elapsed());
        self.end(&line);
    }
}

/// Writes and flushes `text`; errors are ignored (progress is advice, see the module doc).
fn write(out: &Out, text: &str) {
    let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// The spinner's thread: a frame every [`FRAME`] until `stop` is set; `None` when no thread
/// could be started.
fn spin(out: Out, what: String, started: Instant) -> Option<(Arc<AtomicBool>, JoinHandle<()>)> {
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("ncclwasm-progress".into())
        .spawn(move || {
            let mut tick = 0;
            loop {
                std::thread::park_timeout(FRAME);
                if stopped.load(Ordering::Acquire) {
                    return;
                }
                tick += 1;
                write(
                    &out,
                    &format!("{ERASE}{}", frame(&what, tick, started.elapsed())),
                );
            }
        })
        .ok()?;
    Some((stop, thread))
}

/// The line a step starts with: what, and why it will be long when that is known.
pub fn start_line(what: &str, why: Option<&str>) -> String {
    match why {
        Some(why) => format!("{what}: {why}\n"),
        None => format!("{what}\n"),
    }
}

/// The redrawn line, without a newline: spinner, what, time so far; cut to [`FRAME_WIDTH`].
pub fn frame(what: &str, tick: usize, elapsed: Duration) -> String {
    let spinner = SPINNER[tick % SPINNER.len()];
    let time = format!(" ({})", self::elapsed(elapsed));
    let room = FRAME_WIDTH.saturating_sub(2 + time.chars().count());
    let what: String = if what.chars().count() > room {
        let mut cut: String = what.chars().take(room.saturating_sub(1)).collect();
        cut.push('…');
        cut
    } else {
        what.to_owned()
    };
    format!("{spinner} {what}{time}")
}

/// The line a step ends with: what was done and how long it took.
pub fn end_line(done: &str, elapsed: Duration) -> String {
    format!("{done} ({})\n", self::elapsed(elapsed))
}

/// A time as a person reads a clock: `0.4 s`, `42 s`, `2 min`, `2 min 05 s`.
pub fn elapsed(d: Duration) -> String {
    let secs = d.as_secs_f64();
    let whole = d.as_secs();
    if secs < 10.0 {
        format!("{secs:.1} s")
    } else if secs < 60.0 {
        format!("{secs:.0} s")
    } else if whole.is_multiple_of(60) {
        format!("{} min", whole / 60)
    } else {
        format!("{} min {:02} s", whole / 60, whole % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer a step writes into and the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    /// In a pipe: the start line and the end line, nothing redrawn, no control characters.
    #[test]
    fn a_pipe_gets_two_plain_lines() {
        let out = Shared::default();
        let step = Step::start_on(
            Box::new(out.clone()),
            false,
            "compiling p.wasm",
            Some("once"),
        );
        step.finish("compiled p.wasm");
        let text = out.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        assert_eq!(lines[0], "compiling p.wasm: once");
        assert!(
            lines[1].starts_with("compiled p.wasm (") && lines[1].ends_with(" s)"),
            "{text:?}"
        );
        assert!(!text.contains(['\r', '\x1b']), "{text:?}");
    }

    /// On a terminal: the same lines, with the spinner's frames between them erased before the
    /// end line is written.
    #[test]
    fn a_terminal_gets_a_spinner_erased_at_the_end() {
        let out = Shared::default();
        let step = Step::start_on(Box::new(out.clone()), true, "packing", None);
        step.finish("packed");
        let text = out.text();
        let (before, end) = text.rsplit_once(ERASE).expect("the spinner is erased");
        assert!(
            before.starts_with("packing\n\r\x1b[2K⠋ packing ("),
            "{text:?}"
        );
        assert!(
            end.starts_with("packed (") && end.ends_with(")\n"),
            "{text:?}"
        );
    }

    /// A step its caller abandons (an error is on its way) says it stopped.
    #[test]
    fn an_abandoned_step_says_it_stopped() {
        let out = Shared::default();
        drop(Step::start_on(
            Box::new(out.clone()),
            false,
            "building p",
            None,
        ));
        assert!(out.text().starts_with("building p\nbuilding p: stopped ("));
    }

    #[test]
    fn frames_stay_on_one_line_of_a_narrow_terminal() {
        assert_eq!(
            frame("compiling p.wasm", 1, Duration::from_secs(75)),
            "⠙ compiling p.wasm (1 min 15 s)"
        );
        let long = frame(&"x".repeat(200), 0, Duration::from_millis(400));
        assert_eq!(long.chars().count(), FRAME_WIDTH, "{long}");
        assert!(long.ends_with("x… (0.4 s)"), "{long}");
    }

    #[test]
    fn times_read_as_a_clock() {
        assert_eq!(elapsed(Duration::from_millis(420)), "0.4 s");
        assert_eq!(elapsed(Duration::from_millis(42_400)), "42 s");
        assert_eq!(elapsed(Duration::from_secs(125)), "2 min 05 s");
        assert_eq!(elapsed(Duration::from_secs(120)), "2 min");
    }
}
