//! The `ib` backend: the real libibverbs, opened at run time.
//!
//! As NCCL's `ibvsymbols.cc` in its default (dlopen) mode: `dlopen("libibverbs.so.1")` with
//! `RTLD_NOW | RTLD_LOCAL` (and `RTLD_NODELETE`), every entry point resolved with
//! `dlvsym(…, "IBVERBS_1.1")` and a plain `dlsym` fallback, the newer ones
//! (`IBVERBS_1.8/1.10/1.12`) left `None` when absent. Nothing in this crate names an exported
//! libibverbs symbol, so a library built on it has no `DT_NEEDED` on libibverbs and loads on
//! hosts without rdma-core (a CI guard checks this).
//!
//! A library may also export the extension symbols of [`crate::table`] (a provider built as
//! `libibverbs.so.1`, such as the `soft-ibverbs` cdylib): its sysfs tree, its
//! [`crate::ProviderCaps`] and, with `fault-injection`, its fault hooks.

use std::ffi::{CStr, CString, c_void};
use std::ptr::NonNull;

use crate::error::{Result, VerbsError};
use crate::provider::ProviderCaps;
use crate::table::{
    CAPABILITIES_SYMBOL, CapabilitiesFn, SYSFS_READ_SYMBOL, SysfsReadFn, VerbsTable,
};
#[cfg(feature = "fault-injection")]
use crate::table::{FAULT_SYMBOLS, FaultTable};

/// Overrides the library the `ib` fabric opens (tests point it at the `soft-ibverbs` cdylib).
pub const PATH_ENV: &str = "NCCL_WASM_IBVERBS_PATH";

/// Names tried, in order, when neither the caller nor [`PATH_ENV`] names a library. The
/// unversioned name is a last resort, as in NCCL, for stacks that only ship the dev symlink.
const DEFAULT_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

/// An open `dlopen` handle, closed when the fabric that owns it goes away.
#[derive(Debug)]
pub(crate) struct Library {
    handle: NonNull<c_void>,
    path: String,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym/dlclose on it are thread-safe.
unsafe impl Send for Library {}
// SAFETY: as above, the handle is only passed to thread-safe libdl functions.
unsafe impl Sync for Library {}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and is closed exactly once; every object created
        // through its symbols holds the fabric (and so this library) alive.
        unsafe { libc::dlclose(self.handle.as_ptr()) };
    }
}

impl Library {
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// An extension symbol (unversioned), if the library exports it.
    fn extension(&self, name: &CStr) -> Option<NonNull<c_void>> {
        // SAFETY: open handle, NUL-terminated name.
        NonNull::new(unsafe { libc::dlsym(self.handle.as_ptr(), name.as_ptr()) })
    }

    /// The library's sysfs-shaped tree, when it exports `ncclwasm_verbs_sysfs_read`.
    pub(crate) fn sysfs_read(&self) -> Option<SysfsReadFn> {
        let p = self.extension(SYSFS_READ_SYMBOL)?;
        // SAFETY: the symbol has the SysfsReadFn signature (extension contract, crate::table);
        // the fabric keeps this library loaded as long as its provider can call it.
        Some(unsafe { fn_ptr(p.as_ptr()) })
    }

    /// What the library's provider promises (`ncclwasm_verbs_capabilities`; none if absent).
    pub(crate) fn capabilities(&self) -> ProviderCaps {
        self.extension(CAPABILITIES_SYMBOL)
            .map_or(ProviderCaps::NONE, |p| {
                // SAFETY: the symbol has the CapabilitiesFn signature (extension contract).
                let f: CapabilitiesFn = unsafe { fn_ptr(p.as_ptr()) };
                // SAFETY: a function without arguments.
                ProviderCaps::from_bits(unsafe { f() })
            })
    }

    /// The library's fault hooks, when it exports all of [`FAULT_SYMBOLS`].
    #[cfg(feature = "fault-injection")]
    pub(crate) fn fault_table(&self) -> Option<FaultTable> {
        let mut p = [std::ptr::null_mut::<c_void>(); FAULT_SYMBOLS.len()];
        for (slot, name) in p.iter_mut().zip(FAULT_SYMBOLS) {
            *slot = self.extension(name)?.as_ptr();
        }
        // SAFETY: the library exports these names with exactly the FaultTable field signatures
        // (extension contract); data and function pointers have the same size here.
        unsafe {
            Some(FaultTable {
                port_down: fn_ptr(p[0]),
                port_up: fn_ptr(p[1]),
                cut_connection: fn_ptr(p[2]),
                stall: fn_ptr(p[3]),
                kill_device: fn_ptr(p[4]),
                refused_connections: fn_ptr(p[5]),
            })
        }
    }

    /// Resolves `name@version`, falling back to the default version of `name`.
    fn symbol(&self, name: &CStr, version: &CStr) -> Option<NonNull<c_void>> {
        // SAFETY: the handle is open; the strings are NUL-terminated.
        let p = unsafe { libc::dlvsym(self.handle.as_ptr(), name.as_ptr(), version.as_ptr()) };
        NonNull::new(p).or_else(|| {
            // SAFETY: as above.
            NonNull::new(unsafe { libc::dlsym(self.handle.as_ptr(), name.as_ptr()) })
        })
    }
}

/// Opens the verbs library: `path`, else `$NCCL_WASM_IBVERBS_PATH`, else the default names.
pub(crate) fn load(path: Option<&str>) -> Result<(Library, VerbsTable)> {
    let env = std::env::var(PATH_ENV).ok().filter(|p| !p.is_empty());
    let candidates: Vec<&str> = match path.or(env.as_deref()) {
        Some(p) => vec![p],
        None => DEFAULT_NAMES.to_vec(),
    };
    let mut reason = String::new();
    for name in &candidates {
        match open(name) {
            Ok(lib) => {
                let table = resolve(&lib)?;
                return Ok((lib, table));
            }
            Err(e) => reason = e,
        }
    }
    Err(VerbsError::Load {
        path: candidates.join(" or "),
        reason,
    })
}

fn open(name: &str) -> std::result::Result<Library, String> {
    let c = CString::new(name).map_err(|_| "path contains a NUL byte".to_owned())?;
    // RTLD_NODELETE: the library may own threads and thread-locals (provider libraries, the
    // soft cdylib) that must never be unmapped under them; NCCL never unloads it either, and the
    // plugin must survive dlclose + re-dlopen.
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    // SAFETY: dlopen with a valid C string; running the library's constructors is the point.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    NonNull::new(h)
        .map(|handle| Library {
            handle,
            path: name.to_owned(),
        })
        .ok_or_else(dlerror)
}

/// Reinterprets a symbol address as the function pointer type `F`.
///
/// # Safety
/// `F` must be an `extern "C"` function pointer type matching the symbol's real signature.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: same size (checked above); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

/// A symbol name literal (with its NUL) as a C string.
fn cname(s: &'static str) -> &'static CStr {
    CStr::from_bytes_with_nul(s.as_bytes()).expect("symbol name literals end with one NUL")
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread, and it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: non-NULL dlerror result is a C string (see above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Fills a table field from the library: `req!(name)` is mandatory at `IBVERBS_1.1`,
/// `opt!(name, version)` is optional.
fn resolve(lib: &Library) -> Result<VerbsTable> {
    macro_rules! req {
        ($name:literal) => {{
            let p = lib
                .symbol(cname(concat!("ibv_", $name, "\0")), c"IBVERBS_1.1")
                .ok_or(VerbsError::MissingSymbol {
                    path: lib.path().to_owned(),
                    symbol: concat!("ibv_", $name),
                })?;
            // SAFETY: the symbol is libibverbs' exported function of that name, whose C
            // signature (verbs.h) is the field's type; a data pointer and a fn pointer have the
            // same size on every platform libibverbs supports.
            unsafe { fn_ptr(p.as_ptr()) }
        }};
    }
    macro_rules! opt {
        ($name:literal, $ver:literal) => {{
            lib.symbol(cname(concat!("ibv_", $name, "\0")), $ver)
                // SAFETY: as in `req!`; absence is represented by `None`.
                .map(|p| unsafe { fn_ptr(p.as_ptr()) })
        }};
    }
    Ok(VerbsTable {
        get_device_list: req!("get_device_list"),
        free_device_list: req!("free_device_list"),
        get_device_name: req!("get_device_name"),
        open_device: req!("open_device"),
        close_device: req!("close_device"),
        query_device: req!("query_device"),
        query_port: req!("query_port"),
        query_gid: req!("query_gid"),
        alloc_pd: req!("alloc_pd"),
        dealloc_pd: req!("dealloc_pd"),
        reg_mr: req!("reg_mr"),
        dereg_mr: req!("dereg_mr"),
        create_cq: req!("create_cq"),
        destroy_cq: req!("destroy_cq"),
        create_qp: req!("create_qp"),
        modify_qp: req!("modify_qp"),
        query_qp: req!("query_qp"),
        destroy_qp: req!("destroy_qp"),
        get_async_event: req!("get_async_event"),
        ack_async_event: req!("ack_async_event"),
        event_type_str: req!("event_type_str"),
        reg_mr_iova2: opt!("reg_mr_iova2", c"IBVERBS_1.8"),
        reg_dmabuf_mr: opt!("reg_dmabuf_mr", c"IBVERBS_1.12"),
        query_ece: opt!("query_ece", c"IBVERBS_1.10"),
        set_ece: opt!("set_ece", c"IBVERBS_1.10"),
    })
}
