//! tracing → NCCL's logger. Every event of the plugin (and of the transport, the policy engine
//! and the verbs layer under it) at INFO or above becomes one call of NCCL's variadic logger,
//! with `"%s"` as the format so no text of ours is ever interpreted. WARN goes to all
//! subsystems (as NCCL's WARN macro), INFO to `INIT` and `NET` (as net_ib's device lines), so
//! `NCCL_DEBUG=INFO` shows the policy's decisions and one line per connection, and
//! `NCCL_DEBUG_SUBSYS=NET` keeps them among NCCL's own. DEBUG and
//! TRACE events (a connection plan's full reason among them) become NCCL TRACE lines, and only
//! when `NCCL_DEBUG=TRACE` asks for them: otherwise their call sites stay disabled and cost
//! nothing. Each call hands NCCL the Rust source file and line of the event, which NCCL prints
//! beside WARN and TRACE lines.
//!
//! Without a logger (a harness passing NULL, as `ncclwasm bench`'s ranks do; NCCL never does)
//! the plugin prints to stderr what NCCL would print for the same `NCCL_DEBUG` and
//! `NCCL_DEBUG_SUBSYS` (`host:pid:tid NCCL INFO …`), and a WARN always, so a failure there is
//! never silent.

use std::ffi::{CString, c_int, c_ulong};
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

use ncclwasm_abi::{LOG_INFO, LOG_TRACE, LOG_WARN, Logger, NCCL_ALL, NCCL_INIT, NCCL_NET};

/// The logger NCCL gave the last `init` (0 = none: events are dropped).
static LOGGER: AtomicUsize = AtomicUsize::new(0);

/// Remembers NCCL's logger (NULL is fine) and installs the bridge once per loaded image.
pub(crate) fn install(logger: Logger) {
    LOGGER.store(logger.map_or(0, |f| f as usize), Ordering::Release);
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // Fails only if this image already has a global subscriber: then it is ours.
        let _ =
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(NcclLayer));
    });
}

fn logger() -> Logger {
    let raw = LOGGER.load(Ordering::Acquire);
    if raw == 0 {
        return None;
    }
    type F = unsafe extern "C" fn(
        c_int,
        std::ffi::c_ulong,
        *const std::ffi::c_char,
        c_int,
        *const std::ffi::c_char,
        ...
    );
    // SAFETY: `raw` was stored from a non-NULL `F` in `install`; function pointers round-trip
    // through usize on every platform Rust supports.
    Some(unsafe { std::mem::transmute::<usize, F>(raw) })
}

/// Whether NCCL prints TRACE lines: `NCCL_DEBUG=TRACE`, read once as NCCL reads it.
fn trace_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("NCCL_DEBUG").is_ok_and(|v| v.eq_ignore_ascii_case("TRACE")))
}

/// Hands one line to NCCL, located at the caller's source line.
#[track_caller]
pub(crate) fn emit(level: c_int, line: &str) {
    let at = std::panic::Location::caller();
    emit_at(level, at.file(), at.line(), line);
}

/// Hands one line to NCCL, located at `file`:`line_no`; without a logger, to stderr as NCCL
/// would print it (module docs).
pub(crate) fn emit_at(level: c_int, file: &str, line_no: u32, line: &str) {
    let flags = if level == LOG_WARN {
        NCCL_ALL
    } else {
        NCCL_INIT | NCCL_NET
    };
    let Some(log) = logger() else {
        if level == LOG_WARN || stderr_filter().shows(level, flags) {
            eprintln!("{}", stderr_line(level, line));
        }
        return;
    };
    let text = CString::new(line.replace('\0', " ")).unwrap_or_default();
    let file = CString::new(file.replace('\0', " ")).unwrap_or_default();
    let line_no = c_int::try_from(line_no).unwrap_or(c_int::MAX);
    // SAFETY: NCCL's logger takes (level, flags, file, line, fmt, ...); "%s" consumes exactly
    // the one NUL-terminated string passed; both strings live until the call returns.
    unsafe {
        log(
            level,
            flags,
            file.as_ptr(),
            line_no,
            c"%s".as_ptr(),
            text.as_ptr(),
        )
    };
}

/// What NCCL prints: `NCCL_DEBUG`'s level (VERSION 1, WARN 2, INFO 3, ABORT 4, TRACE 5; unset
/// 0) and `NCCL_DEBUG_SUBSYS`'s mask of subsystems.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Filter {
    level: c_int,
    mask: c_ulong,
}

impl Filter {
    /// As NCCL reads the two variables: names case-insensitive, comma-separated, a leading `^`
    /// for all but those named; default subsystems INIT, BOOTSTRAP and ENV.
    fn parse(debug: Option<&str>, subsys: Option<&str>) -> Filter {
        const LEVELS: [&str; 5] = ["VERSION", "WARN", "INFO", "ABORT", "TRACE"];
        const SUBSYSTEMS: [&str; 16] = [
            "INIT",
            "COLL",
            "P2P",
            "SHM",
            "NET",
            "GRAPH",
            "TUNING",
            "ENV",
            "ALLOC",
            "CALL",
            "PROXY",
            "NVLS",
            "BOOTSTRAP",
            "REG",
            "PROFILE",
            "RAS",
        ];
        let level = debug.map_or(0, |d| {
            LEVELS
                .iter()
                .position(|l| l.eq_ignore_ascii_case(d.trim()))
                .map_or(0, |i| i as c_int + 1)
        });
        let bit = |name: &str| -> c_ulong {
            if name.eq_ignore_ascii_case("ALL") {
                return NCCL_ALL;
            }
            SUBSYSTEMS
                .iter()
                .position(|s| s.eq_ignore_ascii_case(name))
                .map_or(0, |i| 1 << i)
        };
        let mask = match subsys {
            None => bit("INIT") | bit("BOOTSTRAP") | bit("ENV"),
            Some(list) => {
                let (invert, list) = match list.strip_prefix('^') {
                    Some(rest) => (true, rest),
                    None => (false, list),
                };
                let named = list.split(',').map(|n| bit(n.trim())).fold(0, |a, b| a | b);
                if invert { !named } else { named }
            }
        };
        Filter { level, mask }
    }

    fn shows(self, level: c_int, flags: c_ulong) -> bool {
        level <= self.level && flags & self.mask != 0
    }
}

/// The process's [`Filter`], read once as NCCL reads its variables.
fn stderr_filter() -> Filter {
    static FILTER: OnceLock<Filter> = OnceLock::new();
    *FILTER.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok();
        Filter::parse(
            var("NCCL_DEBUG").as_deref(),
            var("NCCL_DEBUG_SUBSYS").as_deref(),
        )
    })
}

/// This host's name up to its first dot, as NCCL prints it in log lines and fills in `%h`.
pub(crate) fn short_host() -> String {
    let name = ncclwasm_model::file::hostname().unwrap_or_default();
    name.split('.').next().unwrap_or_default().to_owned()
}

/// `line` as NCCL prints one: `host:pid:tid NCCL INFO …` (NCCL adds the CUDA device in
/// brackets, which a plugin does not know).
fn stderr_line(level: c_int, line: &str) -> String {
    static HOST: OnceLock<String> = OnceLock::new();
    let host = HOST.get_or_init(short_host);
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    let what = match level {
        LOG_WARN => "WARN",
        LOG_INFO => "INFO",
        _ => "TRACE",
    };
    format!("{host}:{}:{tid} NCCL {what} {line}", std::process::id())
}

/// Collects an event's message and fields into one line.
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

struct NcclLayer;

impl<S: Subscriber> Layer<S> for NcclLayer {
    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        *meta.level() <= Level::INFO || trace_on()
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let mut line = Line(String::new());
        event.record(&mut line);
        let level = match *meta.level() {
            Level::ERROR | Level::WARN => LOG_WARN,
            Level::INFO => LOG_INFO,
            _ => LOG_TRACE,
        };
        if !line.0.starts_with("NET/WASM") {
            line.0 = format!("NET/WASM ({}): {}", meta.target(), line.0);
        }
        emit_at(
            level,
            meta.file().unwrap_or("ncclwasm"),
            meta.line().unwrap_or(0),
            &line.0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's reading of NCCL_DEBUG and NCCL_DEBUG_SUBSYS: INFO lines (INIT|NET) show with
    /// INFO whatever the subsystems unless NET and INIT are both left out; WARN shows from
    /// WARN up; nothing without NCCL_DEBUG.
    #[test]
    fn lines_show_as_nccl_would_show_them() {
        let info = NCCL_INIT | NCCL_NET;
        let shows = |debug, subsys, level, flags| Filter::parse(debug, subsys).shows(level, flags);
        assert!(shows(Some("INFO"), None, LOG_INFO, info));
        assert!(shows(Some("info"), Some("NET"), LOG_INFO, info));
        assert!(!shows(Some("INFO"), Some("COLL,P2P"), LOG_INFO, info));
        assert!(!shows(Some("INFO"), Some("^INIT,NET"), LOG_INFO, info));
        assert!(shows(Some("INFO"), Some("^INIT"), LOG_INFO, info));
        assert!(shows(Some("TRACE"), Some("ALL"), LOG_TRACE, NCCL_NET));
        assert!(!shows(Some("INFO"), None, LOG_TRACE, info));
        assert!(shows(Some("WARN"), None, LOG_WARN, NCCL_ALL));
        assert!(!shows(Some("WARN"), None, LOG_INFO, info));
        assert!(!shows(None, None, LOG_WARN, NCCL_ALL));
        assert!(!shows(Some("bogus"), None, LOG_WARN, NCCL_ALL));
    }
}
