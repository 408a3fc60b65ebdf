//! The rules every entry point keeps at the C edge: a panic or an error becomes a WARN through
//! NCCL's logger and its `ncclResult_t` ([`guard`]: nothing unwinds into C), a NULL argument is
//! refused by name, and a handle NCCL passes is a key into the tables of `handles`, never an
//! address. Each entry point also clears its out-parameters first, so they are written on every
//! path.

use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use ncclwasm_abi::*;
use ncclwasm_transport::{ErrorClass, NetError};

use crate::log;

/// The plugin's name: `NCCL_NET=WASM` selects it.
pub(crate) const NAME: &CStr = c"WASM";

/// The largest message size: `test` reports sizes as C `int`.
pub(crate) const MAX_BYTES: usize = ncclwasm_transport::MAX_MESSAGE_BYTES as usize;

pub(crate) fn code(class: ErrorClass) -> NcclResult {
    match class {
        ErrorClass::Internal => NCCL_INTERNAL_ERROR,
        ErrorClass::System => NCCL_SYSTEM_ERROR,
        ErrorClass::InvalidArgument => NCCL_INVALID_ARGUMENT,
        ErrorClass::InvalidUsage => NCCL_INVALID_USAGE,
        ErrorClass::Remote => NCCL_REMOTE_ERROR,
    }
}

/// Runs one entry point: errors become a WARN and their NCCL result, panics a WARN and
/// `ncclInternalError`; nothing unwinds into C. The WARN is located at the entry point that
/// called this.
#[track_caller]
pub(crate) fn guard(entry: &str, f: impl FnOnce() -> Result<(), NetError>) -> NcclResult {
    let at = std::panic::Location::caller();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            log::emit_at(
                LOG_WARN,
                at.file(),
                at.line(),
                &format!("NET/WASM: {entry}: {e}"),
            );
            code(e.class())
        }
        Err(panic) => {
            let what = ncclwasm_verbs::panic_message(panic.as_ref());
            log::emit_at(
                LOG_WARN,
                at.file(),
                at.line(),
                &format!("NET/WASM: {entry}: internal error (panic: {what}); please report it"),
            );
            NCCL_INTERNAL_ERROR
        }
    }
}

pub(crate) fn null_arg(what: &str) -> NetError {
    NetError::Argument(format!("{what} is NULL"))
}

/// Interned C strings for property names and paths: NCCL keeps the pointers, so they live as
/// long as the image.
pub(crate) fn c_string(s: &str) -> *const c_char {
    static STRINGS: Mutex<Vec<&'static CStr>> = Mutex::new(Vec::new());
    if s.is_empty() {
        return std::ptr::null();
    }
    let mut strings = STRINGS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = strings.iter().find(|c| c.to_bytes() == s.as_bytes()) {
        return c.as_ptr();
    }
    let owned = CString::new(s.replace('\0', "")).unwrap_or_default();
    let leaked: &'static CStr = Box::leak(owned.into_boxed_c_str());
    strings.push(leaked);
    leaked.as_ptr()
}

/// A handle from NCCL as a table key (NULL refused, naming the argument).
pub(crate) fn key(handle: *mut c_void, what: &str) -> Result<u64, NetError> {
    if handle.is_null() {
        return Err(null_arg(what));
    }
    Ok(handle as usize as u64)
}

pub(crate) fn as_handle(key: u64) -> *mut c_void {
    key as usize as *mut c_void
}

pub(crate) fn not_a(handle: u64, kind: &str) -> NetError {
    NetError::Argument(format!("{handle:#x} is not a {kind} of this plugin"))
}
