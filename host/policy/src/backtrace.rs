//! Where in a policy a failed call was, in the one line a fault is reported in.
//!
//! wasmtime attaches a [`WasmBacktrace`] to a trap (and to a timeout or a refused memory growth,
//! which stop the guest the same way). Its frames name the guest's functions when the component
//! kept its name section, and give file:line when it carries DWARF line tables (the engine keeps
//! them: `WasmBacktraceDetails::Enable`). wasmtime's own rendering of it is one line per frame
//! and lists every frame; a WARN is one line, so this module renders the few innermost frames of
//! the policy's own code, innermost first: `in policy::f (src/lib.rs:12:5) ← policy::g`.

use std::fmt::Write;
use std::num::NonZeroUsize;

use wasmtime::{FrameInfo, WasmBacktrace};

/// Frames wasmtime captures per fault. Enough to reach past a Rust panic's machinery (about ten
/// frames of `core`/`std`) to the policy's code, and few enough that a trap in a deep recursion
/// costs no more than a shallow one.
pub(crate) const CAPTURED_FRAMES: NonZeroUsize = NonZeroUsize::new(32).expect("non-zero");
/// Frames a fault's line names: where it happened and what called that, not a whole stack.
const SHOWN_FRAMES: usize = 3;
/// Longest function name kept, in bytes: a Rust name with generics can run to kilobytes.
const NAME_MAX: usize = 160;

/// The language runtimes' own frames, which are on top of nearly every trap and say nothing about
/// the policy: Rust's `core`/`std` panic and abort machinery (by path prefix), wasi-libc's
/// `abort`, `assert` and allocator (by name: a refused growth stops the guest in `sbrk`). They
/// are skipped when a frame of the policy's own follows.
const RUNTIME_PREFIXES: [&str; 9] = [
    "core::",
    "std::",
    "alloc::",
    "panic_abort::",
    "<core::",
    "<std::",
    "<alloc::",
    "__rust",
    "rust_",
];
const RUNTIME_NAMES: [&str; 12] = [
    "abort",
    "__assert_fail",
    "exit",
    "sbrk",
    "dlmalloc",
    "dlrealloc",
    "malloc",
    "calloc",
    "realloc",
    "aligned_alloc",
    "posix_memalign",
    "internal_memalign",
];

/// The error's messages as one line, without wasmtime's multi-line backtrace context, followed
/// by where in the guest it happened when the error carries a backtrace.
pub(crate) fn one_line(e: &wasmtime::Error) -> String {
    let Some(bt) = e.downcast_ref::<WasmBacktrace>() else {
        return format!("{e:#}").replace('\n', " ");
    };
    // The backtrace is one link of the chain (context wasmtime added); its text is dropped and
    // rendered below instead. The chain's links are type-erased, hence the comparison by text.
    let trace = bt.to_string();
    let mut line = String::new();
    for cause in e.chain().map(ToString::to_string).filter(|c| *c != trace) {
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&cause.replace('\n', " "));
    }
    line.push_str(&at(e));
    line
}

/// `, in <where>` when the error carries a backtrace, else nothing: for the faults whose line
/// the host words itself (a timeout, a refused memory growth).
pub(crate) fn at(e: &wasmtime::Error) -> String {
    e.downcast_ref::<WasmBacktrace>()
        .and_then(location)
        .map(|at| format!(", in {at}"))
        .unwrap_or_default()
}

/// One frame as a fault names it: a function and, with DWARF, its source position.
#[derive(Debug)]
struct Frame {
    /// Demangled, without a trailing generic argument list, at most [`NAME_MAX`] bytes.
    name: Option<String>,
    /// `file:line:column`, from the line tables.
    position: Option<String>,
    /// The wasm function's index in its core module: all there is to say without a name.
    index: u32,
}

impl Frame {
    fn new(name: Option<&str>, position: Option<String>, index: u32) -> Frame {
        Frame {
            name: name.map(tidy),
            position,
            index,
        }
    }

    fn is_runtime(&self) -> bool {
        self.name.as_deref().is_some_and(|n| {
            RUNTIME_NAMES.contains(&n) || RUNTIME_PREFIXES.iter().any(|p| n.starts_with(p))
        })
    }

    fn render(&self, out: &mut String) {
        match &self.name {
            Some(name) => out.push_str(name),
            None => {
                let _ = write!(out, "wasm function {}", self.index);
            }
        }
        if let Some(position) = &self.position {
            let _ = write!(out, " ({position})");
        }
    }
}

/// The innermost frames of the policy's own code, rendered; `None` when wasmtime captured none.
fn location(bt: &WasmBacktrace) -> Option<String> {
    render(&bt.frames().iter().flat_map(frames).collect::<Vec<_>>())
}

/// Up to [`SHOWN_FRAMES`] frames, innermost first, past the runtime's frames on top unless
/// nothing else is left (a trap in the runtime itself, or a policy whose own code was all
/// inlined into an export).
fn render(frames: &[Frame]) -> Option<String> {
    let skip = frames
        .iter()
        .position(|f| !f.is_runtime())
        .unwrap_or_default();
    let mut out = String::new();
    for (i, frame) in frames.get(skip..)?.iter().take(SHOWN_FRAMES).enumerate() {
        if i > 0 {
            out.push_str(" ← ");
        }
        frame.render(&mut out);
    }
    if out.is_empty() {
        return None;
    }
    if frames.iter().all(|f| f.name.is_none()) {
        out.push_str(" (no name section)");
    }
    Some(out)
}

/// The logical frames of one wasm frame: with DWARF, each function inlined at that point
/// (innermost first, the wasm function itself last) with its file:line:column; without, the wasm
/// function and its name-section name, if any.
fn frames(frame: &FrameInfo) -> Vec<Frame> {
    let index = frame.func_index();
    let symbols = frame.symbols();
    if symbols.is_empty() {
        return vec![Frame::new(frame.func_name(), None, index)];
    }
    symbols
        .iter()
        .enumerate()
        .map(|(i, symbol)| {
            let position = symbol
                .file()
                .map(|file| match (symbol.line(), symbol.column()) {
                    (Some(line), Some(column)) => format!("{file}:{line}:{column}"),
                    (Some(line), None) => format!("{file}:{line}"),
                    _ => file.to_owned(),
                });
            let outermost = i + 1 == symbols.len();
            let name = symbol
                .name()
                .or_else(|| outermost.then(|| frame.func_name()).flatten());
            Frame::new(name, position, index)
        })
        .collect()
}

/// A name as a fault shows it: a Rust symbol demangled without its hash, and any name without
/// its trailing generic arguments (`with<P, T, F>` is `with`; file:line says which), at most
/// [`NAME_MAX`] bytes. A C name is as it is.
fn tidy(name: &str) -> String {
    let mut name = match rustc_demangle::try_demangle(name) {
        Ok(d) => format!("{d:#}"),
        Err(_) => name.to_owned(),
    };
    if name.ends_with('>') {
        let mut depth = 0usize;
        for (at, c) in name.char_indices().rev() {
            match c {
                '>' => depth += 1,
                '<' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                // `<A as B>` alone is a path, not generic arguments: kept.
                if at > 0 {
                    name.truncate(at);
                }
                break;
            }
        }
    }
    if name.len() > NAME_MAX {
        let mut end = NAME_MAX;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
        name.push('…');
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: Option<&str>, position: Option<&str>) -> Frame {
        Frame::new(name, position.map(str::to_owned), 7)
    }

    /// What the hostile guests' traps look like: the runtime's frames on top are skipped, three
    /// frames shown, innermost first.
    #[test]
    fn the_policys_own_frames_come_first_and_three_at_most() {
        let frames = [
            frame(Some("abort"), None),
            frame(
                Some("_RNvNtCshXfaRvt2tfW_3std7process5abort"),
                Some("/rustc/x/library/std/src/process.rs:2533:5"),
            ),
            frame(Some("select_devices"), Some("src/lib.rs:19:9")),
            frame(Some("{closure#0}<p::Trap>"), Some("sdk/rt.rs:152:37")),
            frame(Some("with<p::Trap, T, F<p::Trap>>"), Some("sdk/rt.rs:45:9")),
            frame(Some("export_select_devices"), Some("src/lib.rs:37:1")),
        ];
        assert_eq!(
            render(&frames).unwrap(),
            "select_devices (src/lib.rs:19:9) ← {closure#0} (sdk/rt.rs:152:37) ← with \
             (sdk/rt.rs:45:9)"
        );
    }

    /// A trap inside the runtime with nothing of the policy's below it still says where.
    #[test]
    fn only_runtime_frames_are_shown_as_they_are() {
        let frames = [frame(Some("sbrk"), None), frame(Some("malloc"), None)];
        assert_eq!(render(&frames).unwrap(), "sbrk ← malloc");
        assert_eq!(render(&[]), None);
    }

    /// A stripped component has only function indices to show, and says why.
    #[test]
    fn without_a_name_section_the_index_is_shown() {
        let frames = [frame(None, None), frame(None, None)];
        assert_eq!(
            render(&frames).unwrap(),
            "wasm function 7 ← wasm function 7 (no name section)"
        );
    }

    #[test]
    fn names_are_demangled_without_generics_and_bounded() {
        assert_eq!(
            tidy(
                "_ZN87_$LT$ncclwasm_guest..rt..Export$LT$P$GT$$u20$as$u20$ncclwasm_guest..bindings..Guest$GT$14select_devices17he904f68f7a4715ebE"
            ),
            "<ncclwasm_guest::rt::Export<P> as ncclwasm_guest::bindings::Guest>::select_devices"
        );
        assert_eq!(tidy("<a::B as c::D>"), "<a::B as c::D>");
        assert_eq!(tidy("policy_pick"), "policy_pick");
        let long = tidy(&"x".repeat(1000));
        assert!(long.len() <= NAME_MAX + '…'.len_utf8(), "{long}");
    }
}
