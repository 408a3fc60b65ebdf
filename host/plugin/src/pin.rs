//! Keeps this image mapped after NCCL's `dlclose` while the compiled-policy disk cache is on.
//!
//! wasmtime's disk cache records each use and trims the directory in a worker thread that it
//! starts itself and never joins: dropping the engine (our last `finalize`, or the unload of a
//! v8–v10 load) only tells that thread to stop. Had `dlclose` unmapped the image while it was
//! still returning through our code, the process would crash. Marking the image
//! `RTLD_NODELETE` closes that window for good: NCCL's `dlclose` then leaves it mapped (as
//! glibc already often does for a Rust library with thread-local destructors), and a later
//! `dlopen` + `init` starts from fresh state anyway (see `init_net`).

use std::ffi::c_void;

/// Pins the image this function lives in; `Err` says why it could not (the caller WARNs: the
/// plugin works on, with the narrow race above).
pub(crate) fn pin_image() -> Result<(), String> {
    // SAFETY: all-zero is a valid `Dl_info` (null pointers), filled by dladdr below.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let me = pin_image as fn() -> Result<(), String>;
    // SAFETY: dladdr only reads the loader's tables for an address of our own code and writes
    // `info`.
    if unsafe { libc::dladdr(me as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return Err("dladdr does not know this library".into());
    }
    // SAFETY: `dli_fname` is the loader's NUL-terminated path of an image that is loaded (it
    // holds this code); RTLD_NOLOAD only finds it, and the reference taken is kept for good.
    let handle = unsafe {
        libc::dlopen(
            info.dli_fname,
            libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
        )
    };
    if handle.is_null() {
        return Err("dlopen(RTLD_NOLOAD | RTLD_NODELETE) of this library failed".into());
    }
    Ok(())
}
