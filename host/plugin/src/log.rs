//! tracing → NCCL's logger. Every event of the plugin (and of the transport, the policy engine
//! and the verbs layer under it) at INFO or above becomes one call of NCCL's variadic logger,
//! with `"%s"` as the format so no text of ours is ever interpreted. WARN goes to all
//! subsystems (as NCCL's WARN macro), INFO to `NET`, so `NCCL_DEBUG=INFO
//! NCCL_DEBUG_SUBSYS=NET` shows the policy's decisions and one line per connection. DEBUG and
//! TRACE events (a connection plan's full reason among them) become NCCL TRACE lines, and only
//! when `NCCL_DEBUG=TRACE` asks for them: otherwise their call sites stay disabled and cost
//! nothing. Each call hands NCCL the Rust source file and line of the event, which NCCL prints
//! beside WARN and TRACE lines.

use std::ffi::{CString, c_int};
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

use ncclwasm_abi::{LOG_INFO, LOG_TRACE, LOG_WARN, Logger, NCCL_ALL, NCCL_NET};

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

/// Hands one line to NCCL, located at `file`:`line_no`. Without a logger (test harnesses and the
/// bench pass NULL; NCCL never does) a WARN still reaches stderr, so a failure there is never
/// silent.
pub(crate) fn emit_at(level: c_int, file: &str, line_no: u32, line: &str) {
    let Some(log) = logger() else {
        if level == LOG_WARN {
            eprintln!("WARN {line}");
        }
        return;
    };
    let flags = if level == LOG_WARN {
        NCCL_ALL
    } else {
        NCCL_NET
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
