//! A safe driver for a built plugin library, used the way NCCL's proxy uses it.
//!
//! `ncclwasm bench` (a `#![forbid(unsafe_code)]` crate) drives `libnccl_net_wasm.so` through
//! exactly the C edge NCCL sees: `dlopen`, the newest exported `ncclNetPlugin_vN` table (v12 down
//! to v8), and calls through its function pointers — plus the plugin's own
//! `ncclwasm_send_comm_stats` ([`SendComm::stats`]). All of that is `unsafe`, so it lives here,
//! behind owned handles whose lifetimes encode NCCL's ordering rules: a communicator outlives its
//! memory registrations, a registration outlives the requests on it, and closing consumes the
//! handle. The logger passed to `init` is NULL (allowed by the ABI; a C-variadic logger cannot be
//! written in stable Rust), so the library logs nothing.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_int, c_void};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};

use crate::NET;
use crate::layout::*;
use crate::stats::{SEND_STATS_SYMBOL, SendStats, SendStatsFn, SendStatsV2};

/// The alignment of registered memory.
const PAGE: usize = 4096;

/// `NCCL_NET_HANDLE_MAXSIZE`.
pub const HANDLE_BYTES: usize = 128;

/// The plugin library in `dir`, a directory of binaries. For cargo's `target/<profile>`: in
/// `deps/` when the plugin was built as a dependency (of its own tests) — fresh with whatever
/// depends on it, hence first — else next to the binaries, where `cargo build -p
/// ncclwasm-plugin` puts it. Last, a copy installed under NCCL's name, `libnccl-net-wasm.so`.
pub fn built_library(dir: &Path) -> Option<PathBuf> {
    [
        dir.join("deps/libnccl_net_wasm.so"),
        dir.join("libnccl_net_wasm.so"),
        dir.join("libnccl-net-wasm.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// A failed load or call: which entry point and what it returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError(String);

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LoadError {}

impl LoadError {
    pub(crate) fn new(what: impl Into<String>) -> LoadError {
        LoadError(what.into())
    }
}

type Result<T> = std::result::Result<T, LoadError>;

pub(crate) fn check(entry: &str, rc: NcclResult) -> Result<()> {
    if rc == NCCL_SUCCESS {
        Ok(())
    } else {
        Err(LoadError(format!("{entry} returned ncclResult {rc}")))
    }
}

/// The table NCCL would pick, by version. `'static` is a white lie kept private: the tables
/// are statics of the library, which [`Plugin`] keeps open until it is dropped, and no reference
/// to them leaves a borrow of the `Plugin`.
#[derive(Clone, Copy, Debug)]
enum Table {
    V8(&'static NetV8),
    V9(&'static NetV9),
    V10(&'static NetV10),
    V11(&'static NetV11),
    V12(&'static NetV12),
}

/// Slot `$slot` of whichever table is loaded (the arms differ only in the table type), or the
/// slot's name if it is NULL.
macro_rules! slot {
    ($table:expr, $slot:ident) => {
        match $table {
            Table::V8(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V9(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V10(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V11(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V12(t) => t.$slot.ok_or(stringify!($slot)),
        }
    };
}

/// A loaded plugin library: `dlclose`d on drop, after `finalize` (v11+) when `init` ran.
#[derive(Debug)]
pub struct Plugin {
    lib: NonNull<c_void>,
    table: Table,
    version: u32,
    /// The v11+ per-communicator context from `init`.
    ctx: *mut c_void,
    initialised: bool,
    /// `ncclwasm_send_comm_stats`, when the library exports it.
    send_stats: Option<SendStatsFn>,
}

/// What `getProperties` reports, in every version's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Properties {
    pub name: String,
    pub pci_path: Option<String>,
    pub guid: u64,
    pub ptr_support: i32,
    pub speed_mbps: i32,
    pub max_comms: i32,
    pub max_recvs: i32,
    /// `vProps.devs`: the physical devices this one is made of (v8: itself).
    pub children: Vec<i32>,
    /// `maxP2pBytes` (v8: NCCL's 1 GiB shim value).
    pub max_p2p_bytes: usize,
    /// `railId` and `planeId` (before v12: undefined, [`ID_UNDEF`]).
    pub rail_id: i16,
    pub plane_id: i16,
}

impl Plugin {
    /// `dlopen(path, RTLD_NOW | RTLD_LOCAL)` and the newest of the [`NET`] tables, as NCCL
    /// 2.30+ probes.
    pub fn open(path: &Path) -> Result<Plugin> {
        Plugin::open_as(path, NET.newest)
    }

    /// As an older NCCL loads the library: the newest table at or below `newest` (NCCL 2.26
    /// probes v10 first, 2.24 v9, 2.20 v8).
    pub fn open_as(path: &Path, newest: u32) -> Result<Plugin> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| LoadError(format!("{} contains a NUL byte", path.display())))?;
        // SAFETY: a valid C string; loading runs the library's initialisers, which for this
        // plugin do nothing but register its statics.
        let lib = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let Some(lib) = NonNull::new(lib) else {
            return Err(LoadError(format!(
                "dlopen {}: {}",
                path.display(),
                dl_error()
            )));
        };
        for version in (NET.oldest..=newest.min(NET.newest)).rev() {
            let sym = CString::new(NET.symbol(version)).expect("no NUL");
            // SAFETY: `lib` is an open handle and `sym` a valid C string.
            let p = unsafe { libc::dlsym(lib.as_ptr(), sym.as_ptr()) };
            if p.is_null() {
                continue;
            }
            // SAFETY: `ncclNetPlugin_vN` is a static `ncclNet_vN_t` (the layouts of `layout`) that
            // lives until `dlclose`, which only `Drop` calls (see `Table`).
            let table = unsafe {
                match version {
                    12 => Table::V12(&*p.cast::<NetV12>()),
                    11 => Table::V11(&*p.cast::<NetV11>()),
                    10 => Table::V10(&*p.cast::<NetV10>()),
                    9 => Table::V9(&*p.cast::<NetV9>()),
                    _ => Table::V8(&*p.cast::<NetV8>()),
                }
            };
            // SAFETY: `lib` is open and the name a valid C string.
            let stats = unsafe { libc::dlsym(lib.as_ptr(), SEND_STATS_SYMBOL.as_ptr()) };
            // SAFETY: when exported, the symbol is the function `crate::stats` declares, alive
            // until `dlclose` (which only `Drop` calls).
            let send_stats = (!stats.is_null())
                .then(|| unsafe { std::mem::transmute::<*mut c_void, SendStatsFn>(stats) });
            return Ok(Plugin {
                lib,
                table,
                version,
                ctx: ptr::null_mut(),
                initialised: false,
                send_stats,
            });
        }
        // SAFETY: `lib` is open and nothing of it is in use.
        unsafe { libc::dlclose(lib.as_ptr()) };
        Err(LoadError(format!(
            "{} exports none of {} … v{}",
            path.display(),
            NET.symbol(NET.oldest),
            newest.min(NET.newest)
        )))
    }

    /// The address of `name` in the library, when it exports it: valid until `self` is dropped
    /// (which only [`crate::load_rma`]'s tables, borrowing `self`, rely on).
    pub(crate) fn symbol(&self, name: &str) -> Option<NonNull<c_void>> {
        let name = CString::new(name).ok()?;
        // SAFETY: `lib` is open while `self` lives, and `name` is a valid C string.
        NonNull::new(unsafe { libc::dlsym(self.lib.as_ptr(), name.as_ptr()) })
    }

    /// The ABI version of the table in use (one of [`NET`]'s versions).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Whether the library exports `ncclwasm_send_comm_stats` ([`SendComm::stats`]): this
    /// plugin does, another NCCL plugin does not.
    pub fn reports_stats(&self) -> bool {
        self.send_stats.is_some()
    }

    /// The table's `name` (`WASM` for this plugin).
    pub fn name(&self) -> String {
        let name = match self.table {
            Table::V8(t) => t.name,
            Table::V9(t) => t.name,
            Table::V10(t) => t.name,
            Table::V11(t) => t.name,
            Table::V12(t) => t.name,
        };
        c_str(name).unwrap_or_default()
    }

    fn missing(&self, slot: &str) -> LoadError {
        LoadError(format!("ncclNetPlugin_v{} has no {slot}", self.version))
    }

    /// A data-path slot that is NULL, or a size the v8 ABI's `int` cannot carry.
    fn unusable(&self, slot: &str, size: usize) -> LoadError {
        if c_int::try_from(size).is_err() && self.version == 8 {
            LoadError(format!("{size} bytes exceed the v8 ABI's int sizes"))
        } else {
            self.missing(slot)
        }
    }

    /// `init` with a NULL logger and profiler; v11+ with comm id 0 and no traffic class.
    pub fn init(&mut self) -> Result<()> {
        if self.initialised {
            return Err(LoadError("init was already called".into()));
        }
        let mut config = CommConfigC { traffic_class: -1 };
        let ctx = &mut self.ctx;
        // SAFETY: each arm calls the slot with its version's signature; NULL logger and
        // profiler are allowed; `ctx` and `config` are valid for the call.
        let rc = unsafe {
            match self.table {
                Table::V8(t) => t.init.map(|f| f(None)),
                Table::V9(t) => t.init.map(|f| f(None)),
                Table::V10(t) => t.init.map(|f| f(None, None)),
                Table::V11(t) => t.init.map(|f| f(ctx, 0, &mut config, None, None)),
                Table::V12(t) => t.init.map(|f| f(ctx, 0, &mut config, None, None)),
            }
        }
        .ok_or_else(|| self.missing("init"))?;
        check("init", rc)?;
        self.initialised = true;
        Ok(())
    }

    /// `devices`: how many devices NCCL would see.
    pub fn devices(&self) -> Result<i32> {
        let f = slot!(self.table, devices).map_err(|s| self.missing(s))?;
        let mut n: c_int = -1;
        // SAFETY: `n` is a valid out-parameter.
        check("devices", unsafe { f(&mut n) })?;
        Ok(n)
    }

    /// `getProperties(dev)`.
    pub fn properties(&self, dev: i32) -> Result<Properties> {
        fn get<T>(
            f: Option<unsafe extern "C" fn(c_int, *mut T) -> NcclResult>,
            dev: i32,
        ) -> Result<T> {
            let f = f.ok_or_else(|| LoadError("no getProperties".into()))?;
            let mut out = std::mem::MaybeUninit::<T>::zeroed();
            // SAFETY: `out` has the layout of this version's properties struct, and every
            // field of it is valid when zeroed (integers and nullable pointers).
            check("getProperties", unsafe { f(dev, out.as_mut_ptr()) })?;
            // SAFETY: zeroed, then written by the plugin; all-zero is a valid value too.
            Ok(unsafe { out.assume_init() })
        }
        macro_rules! common {
            ($p:expr, $children:expr, $max_p2p:expr) => {
                common!($p, $children, $max_p2p, ID_UNDEF, ID_UNDEF)
            };
            ($p:expr, $children:expr, $max_p2p:expr, $rail:expr, $plane:expr) => {
                Properties {
                    name: c_str($p.name).unwrap_or_default(),
                    pci_path: c_str($p.pci_path),
                    guid: $p.guid,
                    ptr_support: $p.ptr_support,
                    speed_mbps: $p.speed,
                    max_comms: $p.max_comms,
                    max_recvs: $p.max_recvs,
                    children: $children,
                    max_p2p_bytes: $max_p2p,
                    rail_id: $rail,
                    plane_id: $plane,
                }
            };
        }
        fn devs(ndevs: c_int, devs: &[c_int]) -> Vec<i32> {
            devs[..usize::try_from(ndevs).unwrap_or(0).min(devs.len())].to_vec()
        }
        Ok(match self.table {
            Table::V8(t) => {
                let p = get(t.get_properties, dev)?;
                common!(p, vec![dev], 1 << 30)
            }
            Table::V9(t) => {
                let p = get(t.get_properties, dev)?;
                common!(p, devs(p.vprops.ndevs, &p.vprops.devs), p.max_p2p_bytes)
            }
            Table::V10(t) => {
                let p = get(t.get_properties, dev)?;
                common!(p, devs(p.vprops.ndevs, &p.vprops.devs), p.max_p2p_bytes)
            }
            Table::V11(t) => {
                let p = get(t.get_properties, dev)?;
                common!(p, devs(p.vprops.ndevs, &p.vprops.devs), p.max_p2p_bytes)
            }
            Table::V12(t) => {
                let p = get(t.get_properties, dev)?;
                let children = devs(p.vprops.ndevs, &p.vprops.devs);
                common!(p, children, p.max_p2p_bytes, p.rail_id, p.plane_id)
            }
        })
    }

    /// `makeVDevice` of physical devices `devs`, as NCCL core fuses NICs (v9+): the new
    /// device's index.
    pub fn make_vdevice(&self, devs: &[i32]) -> Result<i32> {
        fn fuse<T>(
            f: Option<unsafe extern "C" fn(*mut c_int, *mut T) -> NcclResult>,
            mut props: T,
        ) -> Result<i32> {
            let f = f.ok_or_else(|| LoadError("no makeVDevice".into()))?;
            let mut d: c_int = -1;
            // SAFETY: `props` is this version's `ncclNetVDeviceProps_t`; `d` is a valid
            // out-parameter.
            check("makeVDevice", unsafe { f(&mut d, &mut props) })?;
            Ok(d)
        }
        fn members<const N: usize>(devs: &[i32]) -> Result<[c_int; N]> {
            let mut out = [0; N];
            out.get_mut(..devs.len())
                .ok_or_else(|| {
                    LoadError(format!("{} devices; a vNIC takes at most {N}", devs.len()))
                })?
                .copy_from_slice(devs);
            Ok(out)
        }
        let ndevs = devs.len() as c_int;
        match self.table {
            Table::V8(_) => Err(self.missing("makeVDevice")),
            Table::V9(t) => fuse(
                t.make_vdevice,
                VDevPropsV9 {
                    ndevs,
                    devs: members(devs)?,
                },
            ),
            Table::V10(t) => fuse(
                t.make_vdevice,
                VDevPropsV9 {
                    ndevs,
                    devs: members(devs)?,
                },
            ),
            Table::V11(t) => fuse(
                t.make_vdevice,
                VDevPropsV9 {
                    ndevs,
                    devs: members(devs)?,
                },
            ),
            Table::V12(t) => fuse(
                t.make_vdevice,
                VDevPropsV12 {
                    ndevs,
                    devs: members(devs)?,
                },
            ),
        }
    }

    /// `listen(dev)`: the listen comm and the handle to give the connecting side.
    pub fn listen(&self, dev: i32) -> Result<(ListenComm<'_>, [u8; HANDLE_BYTES])> {
        let mut handle = [0u8; HANDLE_BYTES];
        let mut comm: *mut c_void = ptr::null_mut();
        let h = handle.as_mut_ptr().cast::<c_void>();
        // SAFETY: each arm calls the slot with its version's signature; `handle` is the
        // 128-byte buffer NCCL owns; `comm` is a valid out-parameter.
        let rc = unsafe {
            match self.table {
                Table::V8(t) => t.listen.map(|f| f(dev, h, &mut comm)),
                Table::V9(t) => t.listen.map(|f| f(dev, h, &mut comm)),
                Table::V10(t) => t.listen.map(|f| f(dev, h, &mut comm)),
                Table::V11(t) => t.listen.map(|f| f(self.ctx, dev, h, &mut comm)),
                Table::V12(t) => t.listen.map(|f| f(self.ctx, dev, h, &mut comm)),
            }
        }
        .ok_or_else(|| self.missing("listen"))?;
        check("listen", rc)?;
        let comm = NonNull::new(comm).ok_or_else(|| LoadError("listen returned no comm".into()))?;
        Ok((ListenComm { plugin: self, comm }, handle))
    }

    /// One `connect` attempt: `None` means "call again", as NCCL's proxy does.
    /// The plugin keeps its progress in the handle's scratch bytes, so every attempt of one
    /// connection must pass the same buffer, as NCCL does.
    pub fn connect(
        &self,
        dev: i32,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<Option<SendComm<'_>>> {
        let h = handle.as_mut_ptr().cast::<c_void>();
        let mut comm: *mut c_void = ptr::null_mut();
        let mut dev_comm: *mut c_void = ptr::null_mut();
        let mut config = CommConfigC { traffic_class: -1 };
        let (c, d) = (&mut comm, &mut dev_comm);
        // SAFETY: each arm calls the slot with its version's signature; the handle is 128
        // writable bytes and the other pointers are valid for the call.
        let rc = unsafe {
            match self.table {
                Table::V8(t) => t.connect.map(|f| f(dev, h, c, d)),
                Table::V9(t) => t.connect.map(|f| f(dev, h, c, d)),
                Table::V10(t) => t.connect.map(|f| f(dev, &mut config, h, c, d)),
                Table::V11(t) => t.connect.map(|f| f(self.ctx, dev, h, c, d)),
                Table::V12(t) => t.connect.map(|f| f(self.ctx, dev, h, c, d)),
            }
        }
        .ok_or_else(|| self.missing("connect"))?;
        check("connect", rc)?;
        Ok(NonNull::new(comm).map(|comm| SendComm { plugin: self, comm }))
    }

    fn close(&self, entry: &'static str, comm: NonNull<c_void>) -> Result<()> {
        let f = match entry {
            "closeSend" => slot!(self.table, close_send),
            "closeRecv" => slot!(self.table, close_recv),
            _ => slot!(self.table, close_listen),
        }
        .map_err(|s| self.missing(s))?;
        // SAFETY: `comm` came from this plugin and is closed once (the handle is consumed).
        check(entry, unsafe { f(comm.as_ptr()) })
    }

    fn test(&self, request: *mut c_void) -> Result<Option<usize>> {
        let f = slot!(self.table, test).map_err(|s| self.missing(s))?;
        let (mut done, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `request` is a live request of this plugin (not yet reported done).
        check("test", unsafe { f(request, &mut done, &mut size) })?;
        Ok((done != 0).then(|| usize::try_from(size).unwrap_or(0)))
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if self.initialised {
            let finalize = match self.table {
                Table::V11(t) => t.finalize,
                Table::V12(t) => t.finalize,
                _ => None,
            };
            if let Some(f) = finalize {
                // SAFETY: the context from `init`, finalized once; every comm borrowed the
                // plugin, so all are closed by now.
                unsafe { f(self.ctx) };
            }
        }
        // SAFETY: nothing of the library is referenced any more (every handle borrowed `self`).
        unsafe { libc::dlclose(self.lib.as_ptr()) };
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a C string valid until the next dl* call on this thread.
    c_str(unsafe { libc::dlerror() }).unwrap_or_else(|| "unknown error".into())
}

fn c_str(p: *const std::ffi::c_char) -> Option<String> {
    // SAFETY: `p` is NULL or a NUL-terminated string owned by the library, alive while it is
    // loaded.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// A listen comm; closed on drop (NCCL closes it right after `accept` returns a comm).
#[derive(Debug)]
pub struct ListenComm<'p> {
    plugin: &'p Plugin,
    comm: NonNull<c_void>,
}

impl<'p> ListenComm<'p> {
    /// One `accept` attempt: `None` means "call again".
    pub fn accept(&self) -> Result<Option<RecvComm<'p>>> {
        let f = slot!(self.plugin.table, accept).map_err(|s| self.plugin.missing(s))?;
        let mut comm: *mut c_void = ptr::null_mut();
        let mut dev_comm: *mut c_void = ptr::null_mut();
        // SAFETY: a live listen comm and valid out-parameters.
        check("accept", unsafe {
            f(self.comm.as_ptr(), &mut comm, &mut dev_comm)
        })?;
        Ok(NonNull::new(comm).map(|comm| RecvComm {
            plugin: self.plugin,
            comm,
        }))
    }
}

impl Drop for ListenComm<'_> {
    fn drop(&mut self) {
        let _ = self.plugin.close("closeListen", self.comm);
    }
}

/// Page-aligned, zeroed bytes a registration owns (`regMr`'s [`Mr`], `regMrSym`'s
/// [`crate::load_rma::SymMr`]): freed on drop, unless a request on them is still in flight.
#[derive(Debug)]
pub(crate) struct Pages {
    /// Owned by this value; a raw pointer because the plugin writes into it while requests
    /// hold a shared borrow of the registration.
    data: NonNull<[u8]>,
    /// Requests posted and not yet seen done: if any is left, the bytes are leaked rather than
    /// freed under the library's feet.
    pending: Cell<usize>,
}

impl Pages {
    pub(crate) fn new(len: usize) -> Result<Pages> {
        let layout = Pages::layout(len)?;
        // SAFETY: a layout of non-zero size (`layout` rounds 0 up to one byte).
        let bytes = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| LoadError(format!("cannot allocate {len} bytes to register")))?;
        Ok(Pages {
            data: NonNull::slice_from_raw_parts(bytes, len),
            pending: Cell::new(0),
        })
    }

    /// Page-aligned, as the buffers NCCL registers are (its allocations are): where a message's
    /// source and destination sit within a page changes what a copy of it costs (on this
    /// machine, 64 KiB took 6x longer between two heap addresses than between two pages), so
    /// a bench must not leave that to the heap.
    fn layout(len: usize) -> Result<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(len.max(1), PAGE)
            .map_err(|_| LoadError(format!("{len} bytes cannot be registered")))
    }

    pub(crate) fn start(&self) -> *mut c_void {
        self.data.cast::<c_void>().as_ptr()
    }

    /// The bytes; not while a request on them is in flight (they borrow the registration).
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: owned by `self`; `&mut self` means no request is in flight on it.
        unsafe { self.data.as_mut() }
    }

    /// The address of `range`, refused beyond the bytes.
    pub(crate) fn at(&self, range: &Range<usize>) -> Result<*mut c_void> {
        if range.start > range.end || range.end > self.data.len() {
            return Err(LoadError(format!(
                "{range:?} is outside the {}-byte registration",
                self.data.len()
            )));
        }
        // SAFETY: in bounds, checked above.
        Ok(unsafe { self.data.cast::<u8>().as_ptr().add(range.start) }.cast())
    }

    /// A request on the bytes was posted (`true`) or seen done (`false`).
    pub(crate) fn track(&self, posted: bool) {
        let n = self.pending.get();
        self.pending.set(if posted { n + 1 } else { n - 1 });
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        if self.pending.get() == 0
            && let Ok(layout) = Pages::layout(self.data.len())
        {
            // SAFETY: allocated in `new` with this layout and not referenced by any request.
            unsafe { std::alloc::dealloc(self.data.cast::<u8>().as_ptr(), layout) };
        }
    }
}

/// Memory registered with `regMr` on one comm: owns its bytes, deregistered on drop (before
/// they are freed).
#[derive(Debug)]
pub struct Mr<'c> {
    plugin: &'c Plugin,
    comm: NonNull<c_void>,
    mhandle: *mut c_void,
    pages: Pages,
}

impl Mr<'_> {
    fn register<'c>(plugin: &'c Plugin, comm: NonNull<c_void>, len: usize) -> Result<Mr<'c>> {
        let f = slot!(plugin.table, reg_mr).map_err(|s| plugin.missing(s))?;
        let pages = Pages::new(len)?;
        let mut mhandle: *mut c_void = ptr::null_mut();
        // SAFETY: a live comm; `pages` is `len` bytes owned by the returned value.
        let rc = unsafe {
            f(
                comm.as_ptr(),
                pages.start(),
                len,
                NCCL_PTR_HOST,
                &mut mhandle,
            )
        };
        let mr = Mr {
            plugin,
            comm,
            mhandle,
            pages,
        };
        check("regMr", rc)?;
        Ok(mr)
    }

    /// The registered bytes; not while a request on them is in flight (they borrow `self`).
    pub fn bytes(&mut self) -> &mut [u8] {
        self.pages.bytes()
    }

    fn range(&self, comm: NonNull<c_void>, range: &Range<usize>) -> Result<*mut c_void> {
        if comm != self.comm {
            return Err(LoadError("memory registered on another comm".into()));
        }
        self.pages.at(range)
    }
}

impl Drop for Mr<'_> {
    fn drop(&mut self) {
        if !self.mhandle.is_null()
            && let Ok(f) = slot!(self.plugin.table, dereg_mr)
        {
            // SAFETY: a live comm (it outlives `self`) and this registration's handle.
            unsafe { f(self.comm.as_ptr(), self.mhandle) };
        }
    }
}

/// A send comm; closed on drop.
#[derive(Debug)]
pub struct SendComm<'p> {
    plugin: &'p Plugin,
    comm: NonNull<c_void>,
}

impl SendComm<'_> {
    /// `regMr` of `len` zeroed bytes (`NCCL_PTR_HOST`).
    pub fn reg_mr(&self, len: usize) -> Result<Mr<'_>> {
        Mr::register(self.plugin, self.comm, len)
    }

    /// One `isend` attempt of `mr[range]`: `None` means "not now, call again".
    pub fn isend<'m>(
        &self,
        mr: &'m Mr<'_>,
        range: Range<usize>,
        tag: i32,
    ) -> Result<Option<Request<'m>>> {
        let data = mr.range(self.comm, &range)?;
        let size = range.len();
        let (c, m) = (self.comm.as_ptr(), mr.mhandle);
        let mut req: *mut c_void = ptr::null_mut();
        let small = c_int::try_from(size).ok();
        let r = &mut req;
        let no = ptr::null_mut();
        // SAFETY: each arm calls the slot with its version's signature; `data` is inside the
        // registration, which the request borrows until it is done.
        let rc = unsafe {
            match self.plugin.table {
                Table::V8(t) => small.and_then(|n| t.isend.map(|f| f(c, data, n, tag, m, r))),
                Table::V9(t) => t.isend.map(|f| f(c, data, size, tag, m, r)),
                Table::V10(t) => t.isend.map(|f| f(c, data, size, tag, m, no, r)),
                Table::V11(t) => t.isend.map(|f| f(c, data, size, tag, m, no, r)),
                Table::V12(t) => t.isend.map(|f| f(c, data, size, tag, m, no, r)),
            }
        }
        .ok_or_else(|| self.plugin.unusable("isend", size))?;
        check("isend", rc)?;
        Ok(Request::new(mr, req))
    }

    /// `ncclwasm_send_comm_stats`: the plan this connection runs, who made it and why, and the
    /// payload bytes posted on each of its QPs so far (requests in flight included).
    pub fn stats(&self) -> Result<SendStats> {
        let f = self.plugin.send_stats.ok_or_else(|| {
            LoadError(format!(
                "the library does not export {}",
                SEND_STATS_SYMBOL.to_string_lossy()
            ))
        })?;
        let mut out = Box::new(SendStatsV2::empty());
        // SAFETY: a live send comm of this plugin and a struct of the version it names.
        check("ncclwasm_send_comm_stats", unsafe {
            f(self.comm.as_ptr(), &mut *out)
        })?;
        out.read()
    }
}

impl Drop for SendComm<'_> {
    fn drop(&mut self) {
        let _ = self.plugin.close("closeSend", self.comm);
    }
}

/// A receive comm; closed on drop.
#[derive(Debug)]
pub struct RecvComm<'p> {
    plugin: &'p Plugin,
    comm: NonNull<c_void>,
}

impl RecvComm<'_> {
    /// `regMr` of `len` zeroed bytes (`NCCL_PTR_HOST`).
    pub fn reg_mr(&self, len: usize) -> Result<Mr<'_>> {
        Mr::register(self.plugin, self.comm, len)
    }

    /// One `irecv` attempt of one buffer, `mr[range]` (`n = 1`): `None` means "call again".
    pub fn irecv<'m>(
        &self,
        mr: &'m Mr<'_>,
        range: Range<usize>,
        tag: i32,
    ) -> Result<Option<Request<'m>>> {
        let mut data = mr.range(self.comm, &range)?;
        let mut mhandle = mr.mhandle;
        let mut tag = tag;
        let size = range.len();
        let (c, d, t_, m) = (self.comm.as_ptr(), &mut data, &mut tag, &mut mhandle);
        let mut req: *mut c_void = ptr::null_mut();
        let mut small = c_int::try_from(size).ok();
        let mut size = size;
        let (s, r) = (&mut size, &mut req);
        let no = ptr::null_mut();
        // SAFETY: each arm calls the slot with its version's signature and one-element arrays
        // valid for the call; the buffer is inside the registration, which the request borrows.
        let rc = unsafe {
            match self.plugin.table {
                Table::V8(t) => small
                    .as_mut()
                    .and_then(|n| t.irecv.map(|f| f(c, 1, d, n, t_, m, r))),
                Table::V9(t) => t.irecv.map(|f| f(c, 1, d, s, t_, m, r)),
                Table::V10(t) => t.irecv.map(|f| f(c, 1, d, s, t_, m, no, r)),
                Table::V11(t) => t.irecv.map(|f| f(c, 1, d, s, t_, m, no, r)),
                Table::V12(t) => t.irecv.map(|f| f(c, 1, d, s, t_, m, no, r)),
            }
        }
        .ok_or_else(|| self.plugin.unusable("irecv", size))?;
        check("irecv", rc)?;
        Ok(Request::new(mr, req))
    }
}

impl Drop for RecvComm<'_> {
    fn drop(&mut self) {
        let _ = self.plugin.close("closeRecv", self.comm);
    }
}

/// A posted `isend`/`irecv`, polled with [`Request::test`]. It borrows its registration, so
/// the memory and the comm outlive it.
#[derive(Debug)]
pub struct Request<'m> {
    mr: &'m Mr<'m>,
    req: *mut c_void,
    /// The size `test` reported once done: the library has released the request.
    done: Option<usize>,
}

impl<'m> Request<'m> {
    fn new(mr: &'m Mr<'m>, req: *mut c_void) -> Option<Request<'m>> {
        if req.is_null() {
            return None;
        }
        mr.pages.track(true);
        Some(Request {
            mr,
            req,
            done: None,
        })
    }

    /// One `test`: the size sent or received once done (then every later call returns it).
    pub fn test(&mut self) -> Result<Option<usize>> {
        if self.done.is_some() {
            return Ok(self.done);
        }
        self.done = self.mr.plugin.test(self.req)?;
        if self.done.is_some() {
            self.mr.pages.track(false);
        }
        Ok(self.done)
    }
}
