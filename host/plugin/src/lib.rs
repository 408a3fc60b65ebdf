//! `libnccl-net-wasm.so`: the NCCL network plugin.
//!
//! This crate is the C edge and nothing else: it exports the `ncclNetPlugin_v8` … `_v12` tables
//! (static data, as NCCL's loader expects), converts C arguments, writes every out-parameter on
//! every path, catches panics, and maps errors to `ncclResult_t`. All behaviour lives in
//! `ncclwasm-transport` ([`Net`]) and the crates under it. The layouts are `ncclwasm-abi`'s, whose
//! `load` drives a built copy of this library through those same tables, for `ncclwasm bench` and
//! tests; [`ncclwasm_send_comm_stats`] is an extension export for such drivers.
//!
//! # Install
//! ```text
//! cargo build --release -p ncclwasm-plugin
//! cp target/release/libnccl_net_wasm.so /some/lib/dir/libnccl-net-wasm.so
//! NCCL_NET_PLUGIN=wasm (or the absolute path) NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=NET ...
//! ```
//! `NCCL_WASM_FABRIC` picks the verbs provider, which the plugin opens and hands to the
//! transport (`auto`: libibverbs when a port is active, else `init` fails and NCCL uses its own
//! transports; `ib`: libibverbs whatever its ports' state; `soft`: the userspace fabric over
//! TCP, devices from `NCCL_WASM_TOPOLOGY`); `NCCL_WASM_POLICY*` configure the policy engine.
//! Every decision is logged at INFO under the NET subsystem with its reason and source.
//!
//! # GPU memory
//! `ptrSupport` is `NCCL_PTR_HOST`, plus `NCCL_PTR_CUDA` when a peer-memory module is loaded and
//! `NCCL_PTR_DMABUF` when the device registers dma-bufs; `forceFlush` is set for mlx5 Data
//! Direct devices. `regMr` takes host and (with peer memory) CUDA pointers, `regMrDmaBuf` (in
//! every table version) dma-buf fds; a type the device did not advertise is refused with a WARN
//! naming it. The rules are net_ib's and live in the transport (`Net::gpu_support` says what was
//! decided and why; `docs/architecture.md`, "GPU memory").
//!
//! # Lifetime
//! The [`Net`] context is process-wide (NCCL reads devices once). ABI v8–v10 initialise once per
//! load, and since `dlclose` may leave this image mapped, their `init` replaces whatever state an
//! earlier load left; v11/v12 call `init`/`finalize` per communicator, and the last `finalize` drops the
//! context, which stops the event and policy threads — so NCCL's `dlclose` finds nothing running
//! and a later `dlopen` + `init` starts from scratch. Communicators hold their own references to
//! the devices they use, so closing them later is still safe.
//!
//! # Handles
//! Nothing NCCL holds is an address: communicators, memory registrations and requests are
//! generation-checked keys into the tables of [`handles`], so a call on a closed communicator, a
//! second `deregMr` or a `test` of a request already reported done is refused as invalid usage
//! instead of touching freed memory; a communicator a call panicked on fails every later call. A
//! request handle carries its communicator's key and pool index, so `test` is one O(1) lookup and
//! nothing is allocated per message.

mod fabric;
mod handles;
mod log;
mod pin;

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::BorrowedFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use handles::{Handles, Held, RequestKey, Requests};

use ncclwasm_policy::{PolicyCache, PolicyHost};
use ncclwasm_transport::{
    CommConfig, DeviceProps, Done, ErrorClass, HANDLE_SIZE, Listener, MAX_ENDPOINTS, MAX_QPS,
    MAX_RECVS, MemHandle, Net, NetError, PTR_CUDA, PTR_DMABUF, PTR_HOST, RecvBuf, RecvComm,
    RegionSource, SendComm,
};
use ncclwasm_verbs::{ForeignMemory, Memory};

use ncclwasm_abi::*;

/// The plugin's name: `NCCL_NET=WASM` selects it.
const NAME: &CStr = c"WASM";

/// The largest message size: `test` reports sizes as C `int`.
const MAX_BYTES: usize = ncclwasm_transport::MAX_MESSAGE_BYTES as usize;

/// The process-wide context and how many v11+ contexts use it.
struct Global {
    net: Net,
    contexts: usize,
}

static STATE: Mutex<Option<Global>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<Global>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The live context, or an error if NCCL calls before `init`.
fn net() -> Result<Net, NetError> {
    state()
        .as_ref()
        .map(|g| g.net.clone())
        .ok_or_else(|| NetError::Usage("the plugin is not initialised (call init first)".into()))
}

/// Makes (or, for v11+, reuses) the context; `contexts` counts v11+ communicators.
///
/// v8–v10 call `init` once per load and have no `finalize`, and `dlclose` need not unload this
/// image (a Rust library with thread-local destructors stays mapped), so their `init` may find
/// the state of an earlier load: it is replaced, so each load starts from what the machine is
/// now, not with the earlier load's virtual NICs.
fn init_net(logger: Logger, max_devs_per_nic: usize, context: bool) -> Result<(), NetError> {
    log::install(logger);
    let mut st = state();
    if !context {
        drop(st.take());
    }
    if st.is_none() {
        let choice = fabric::choice()?;
        let decisions = Arc::new(PolicyHost::from_env(max_devs_per_nic)?);
        if decisions.settings().cache != PolicyCache::Off
            && let Err(why) = pin::pin_image()
        {
            log::emit(
                LOG_WARN,
                &format!(
                    "NET/WASM: {why}; NCCL's dlclose may unmap this library under the policy cache's worker thread"
                ),
            );
        }
        let net = Net::new(fabric::config(choice, max_devs_per_nic, decisions)?)
            .map_err(|e| fabric::hint(choice, e))?;
        *st = Some(Global { net, contexts: 0 });
    }
    if context && let Some(g) = st.as_mut() {
        g.contexts += 1;
    }
    Ok(())
}

fn code(class: ErrorClass) -> NcclResult {
    match class {
        ErrorClass::Internal => NCCL_INTERNAL_ERROR,
        ErrorClass::System => NCCL_SYSTEM_ERROR,
        ErrorClass::InvalidArgument => NCCL_INVALID_ARGUMENT,
        ErrorClass::InvalidUsage => NCCL_INVALID_USAGE,
        ErrorClass::Remote => NCCL_REMOTE_ERROR,
    }
}

/// Runs one entry point: errors become a WARN and their NCCL result, panics a WARN and
/// `ncclInternalError`; nothing unwinds into C.
fn guard(entry: &str, f: impl FnOnce() -> Result<(), NetError>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            log::emit(LOG_WARN, &format!("NET/WASM: {entry}: {e}"));
            code(e.class())
        }
        Err(panic) => {
            let what = ncclwasm_verbs::panic_message(panic.as_ref());
            log::emit(
                LOG_WARN,
                &format!("NET/WASM: {entry}: internal error (panic: {what}); please report it"),
            );
            NCCL_INTERNAL_ERROR
        }
    }
}

fn null_arg(what: &str) -> NetError {
    NetError::Argument(format!("{what} is NULL"))
}

/// Interned C strings for property names and paths: NCCL keeps the pointers, so they live as
/// long as the image.
fn c_string(s: &str) -> *const c_char {
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

// ---------------------------------------------------------------------------------------------
// Communicators, registrations and requests as NCCL holds them.

/// What a communicator handle names.
#[expect(
    clippy::large_enum_variant,
    reason = "one per communicator, each in its own Arc: boxing would add an indirection to every call"
)]
enum Endpoint {
    Send {
        comm: SendComm,
        requests: Requests,
    },
    Recv {
        comm: RecvComm,
        requests: Requests,
    },
    /// `accept` needs the listener exclusively; NCCL's service thread is its only user.
    Listen(Mutex<Listener>),
}

static COMMS: Handles<Endpoint> = Handles::new("communicator");
static MRS: Handles<MemHandle> = Handles::new("memory registration");

/// A handle from NCCL as a table key (NULL refused, naming the argument).
fn key(handle: *mut c_void, what: &str) -> Result<u64, NetError> {
    if handle.is_null() {
        return Err(null_arg(what));
    }
    Ok(handle as usize as u64)
}

fn as_handle(key: u64) -> *mut c_void {
    key as usize as *mut c_void
}

fn not_a(handle: u64, kind: &str) -> NetError {
    NetError::Argument(format!("{handle:#x} is not a {kind} of this plugin"))
}

/// Runs `f` on the send communicator `comm` and its request counters.
fn on_send<R>(
    comm: *mut c_void,
    f: impl FnOnce(&SendComm, &Requests, u64) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "sendComm")?;
    COMMS.with(k, |e| match e {
        Endpoint::Send { comm, requests } => f(comm, requests, k),
        _ => Err(not_a(k, "send communicator")),
    })
}

/// Runs `f` on the receive communicator `comm` and its request counters.
fn on_recv<R>(
    comm: *mut c_void,
    f: impl FnOnce(&RecvComm, &Requests, u64) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "recvComm")?;
    COMMS.with(k, |e| match e {
        Endpoint::Recv { comm, requests } => f(comm, requests, k),
        _ => Err(not_a(k, "receive communicator")),
    })
}

/// NCCL's buffers, registered page-rounded.
struct NcclMemory;

impl RegionSource for NcclMemory {
    fn memory(&self, start: u64, len: u64) -> Memory {
        // SAFETY: NCCL registered a buffer inside these pages and keeps it mapped until deregMr
        // (a page holding one mapped byte is mapped as a whole), and it lets the NIC read and
        // write it — that is what registering it means.
        Memory::Foreign(unsafe { ForeignMemory::new(start as *mut u8, len as usize) })
    }
}

/// A registration handle from NCCL (NULL = none), held for the call.
fn mem(mh: *mut c_void) -> Result<Option<Held<MemHandle>>, NetError> {
    if mh.is_null() {
        return Ok(None);
    }
    MRS.get(mh as usize as u64).map(Some)
}

// ---------------------------------------------------------------------------------------------
// Entry points shared by every version.

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    guard("devices", || {
        // SAFETY: NCCL passes a valid out-pointer (or NULL, refused).
        let ndev = unsafe { ndev.as_mut() }.ok_or_else(|| null_arg("ndev"))?;
        *ndev = 0;
        *ndev = net()?.device_count() as c_int;
        Ok(())
    })
}

fn props(dev: c_int) -> Result<DeviceProps, NetError> {
    net()?.properties(i64::from(dev))
}

/// The fields every properties version shares.
struct Common {
    name: *const c_char,
    pci_path: *const c_char,
    guid: u64,
    speed: c_int,
    port: c_int,
    max_comms: c_int,
}

fn common(p: &DeviceProps) -> Common {
    Common {
        name: c_string(&p.name),
        pci_path: c_string(&p.pci_path),
        guid: p.guid,
        speed: p.speed_mbps.min(i32::MAX as u32) as c_int,
        port: c_int::from(p.port),
        max_comms: p.max_comms.min(i32::MAX as u32) as c_int,
    }
}

fn children<const N: usize>(p: &DeviceProps) -> (c_int, [c_int; N]) {
    let mut devs = [0; N];
    for (d, c) in devs.iter_mut().zip(&p.children) {
        *d = *c as c_int;
    }
    (p.children.len().min(N) as c_int, devs)
}

unsafe extern "C" fn get_properties_v8(dev: c_int, out: *mut PropsV8) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        let p = props(dev)?;
        let c = common(&p);
        *out = PropsV8 {
            name: c.name,
            pci_path: c.pci_path,
            guid: c.guid,
            ptr_support: p.ptr_support as c_int,
            reg_is_global: 1,
            speed: c.speed,
            port: c.port,
            latency: 0.0,
            max_comms: c.max_comms,
            max_recvs: MAX_RECVS as c_int,
            net_device_type: 0,
            net_device_version: 0,
        };
        Ok(())
    })
}

fn props_v9(p: &DeviceProps) -> PropsV9 {
    let c = common(p);
    let (ndevs, devs) = children::<4>(p);
    PropsV9 {
        name: c.name,
        pci_path: c.pci_path,
        guid: c.guid,
        ptr_support: p.ptr_support as c_int,
        reg_is_global: 1,
        force_flush: c_int::from(p.force_flush),
        speed: c.speed,
        port: c.port,
        latency: 0.0,
        max_comms: c.max_comms,
        max_recvs: MAX_RECVS as c_int,
        net_device_type: 0,
        net_device_version: 0,
        vprops: VDevPropsV9 { ndevs, devs },
        max_p2p_bytes: MAX_BYTES,
        max_coll_bytes: MAX_BYTES,
    }
}

unsafe extern "C" fn get_properties_v9(dev: c_int, out: *mut PropsV9) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        *out = props_v9(&props(dev)?);
        Ok(())
    })
}

unsafe extern "C" fn get_properties_v11(dev: c_int, out: *mut PropsV11) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        let v = props_v9(&props(dev)?);
        *out = PropsV11 {
            name: v.name,
            pci_path: v.pci_path,
            guid: v.guid,
            ptr_support: v.ptr_support,
            reg_is_global: v.reg_is_global,
            force_flush: v.force_flush,
            speed: v.speed,
            port: v.port,
            latency: v.latency,
            max_comms: v.max_comms,
            max_recvs: v.max_recvs,
            net_device_type: 0,
            net_device_version: 0,
            vprops: v.vprops,
            max_p2p_bytes: v.max_p2p_bytes,
            max_coll_bytes: v.max_coll_bytes,
            max_multi_request_size: 1,
        };
        Ok(())
    })
}

unsafe extern "C" fn get_properties_v12(dev: c_int, out: *mut PropsV12) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        let p = props(dev)?;
        let v = props_v9(&p);
        let (ndevs, devs) = children::<8>(&p);
        *out = PropsV12 {
            name: v.name,
            pci_path: v.pci_path,
            guid: v.guid,
            ptr_support: v.ptr_support,
            reg_is_global: v.reg_is_global,
            force_flush: v.force_flush,
            speed: v.speed,
            port: v.port,
            latency: v.latency,
            max_comms: v.max_comms,
            max_recvs: v.max_recvs,
            net_device_type: 0,
            net_device_version: 0,
            vprops: VDevPropsV12 { ndevs, devs },
            max_p2p_bytes: v.max_p2p_bytes,
            max_coll_bytes: v.max_coll_bytes,
            max_multi_request_size: 1,
            rail_id: ID_UNDEF,
            plane_id: ID_UNDEF,
        };
        Ok(())
    })
}

fn listen_impl(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult {
    guard("listen", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { listen_comm.as_mut() }.ok_or_else(|| null_arg("listenComm"))?;
        *out = std::ptr::null_mut();
        if handle.is_null() {
            return Err(null_arg("handle"));
        }
        let (listener, bytes) = net()?.listen(i64::from(dev))?;
        let k = COMMS.insert(Endpoint::Listen(Mutex::new(listener)))?;
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle.cast(), HANDLE_SIZE) };
        *out = as_handle(k);
        Ok(())
    })
}

unsafe extern "C" fn listen(dev: c_int, handle: *mut c_void, lc: *mut *mut c_void) -> NcclResult {
    listen_impl(dev, handle, lc)
}

unsafe extern "C" fn listen_v11(
    _ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    lc: *mut *mut c_void,
) -> NcclResult {
    listen_impl(dev, handle, lc)
}

/// `connect`; `devComm` arguments are opaque (RCCL passes foreign structs there) and untouched.
fn connect_impl(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    comm: CommConfig,
) -> NcclResult {
    guard("connect", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { send_comm.as_mut() }.ok_or_else(|| null_arg("sendComm"))?;
        *out = std::ptr::null_mut();
        // SAFETY: NCCL's handle buffer is 128 bytes, the same buffer on every call.
        let handle = unsafe { handle.cast::<[u8; HANDLE_SIZE]>().as_mut() }
            .ok_or_else(|| null_arg("handle"))?;
        if let Some(comm) = net()?.connect(i64::from(dev), handle, comm)? {
            let requests = Requests::new();
            *out = as_handle(COMMS.insert(Endpoint::Send { comm, requests })?);
        }
        Ok(())
    })
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    connect_impl(dev, handle, sc, CommConfig::default())
}

unsafe extern "C" fn connect_v10(
    dev: c_int,
    config: *mut CommConfigC,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NULL or NCCL's config struct.
    let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.traffic_class);
    connect_impl(
        dev,
        handle,
        sc,
        CommConfig {
            comm_id: 0,
            traffic_class: tc,
        },
    )
}

/// A v11+ per-communicator context.
struct Ctx {
    comm: CommConfig,
}

unsafe extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NULL or a context from init_v11.
    let comm = unsafe { ctx.cast::<Ctx>().as_ref() }.map_or_else(CommConfig::default, |c| c.comm);
    connect_impl(dev, handle, sc, comm)
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    guard("accept", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { recv_comm.as_mut() }.ok_or_else(|| null_arg("recvComm"))?;
        *out = std::ptr::null_mut();
        let k = key(listen_comm, "listenComm")?;
        let accepted = COMMS.with(k, |e| match e {
            Endpoint::Listen(l) => l
                .lock()
                .map_err(|_| NetError::Internal("a listener's lock is poisoned".into()))?
                .accept(),
            _ => Err(not_a(k, "listener")),
        })?;
        if let Some(comm) = accepted {
            let requests = Requests::new();
            *out = as_handle(COMMS.insert(Endpoint::Recv { comm, requests })?);
        }
        Ok(())
    })
}

/// Runs `f` on the send or receive communicator `comm` (`regMr` does not say which).
fn on_comm<R>(
    comm: *mut c_void,
    f: impl FnOnce(&Endpoint) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "comm")?;
    COMMS.with(k, |e| match e {
        Endpoint::Listen(_) => Err(not_a(k, "send or receive communicator")),
        e => f(e),
    })
}

/// `regMr` on a send or receive communicator: host memory, and GPU memory (`NCCL_PTR_CUDA`)
/// when a peer-memory module lets `ibv_reg_mr` take it (`ptrSupport` says which).
unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMr", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { mh.as_mut() }.ok_or_else(|| null_arg("mhandle"))?;
        *out = std::ptr::null_mut();
        let mr = on_comm(comm, |e| register(e, data, size, ty, None))?;
        *out = as_handle(MRS.insert(mr)?);
        Ok(())
    })
}

/// `regMrDmaBuf`: GPU memory NCCL hands over as a dma-buf fd (`NCCL_PTR_DMABUF`); fd -1 is an
/// ordinary `regMr`, as in net_ib.
unsafe extern "C" fn reg_mr_dma_buf(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    offset: u64,
    fd: c_int,
    mh: *mut *mut c_void,
) -> NcclResult {
    guard("regMrDmaBuf", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { mh.as_mut() }.ok_or_else(|| null_arg("mhandle"))?;
        *out = std::ptr::null_mut();
        // SAFETY: NCCL keeps the fd open for the duration of the call; the kernel (or the
        // provider) takes its own reference to the pages.
        let fd = (fd >= 0).then(|| unsafe { BorrowedFd::borrow_raw(fd) });
        let dmabuf = fd.map(|fd| (fd, offset));
        let mr = on_comm(comm, |e| register(e, data, size, ty, dmabuf))?;
        *out = as_handle(MRS.insert(mr)?);
        Ok(())
    })
}

/// Registers NCCL's buffer of pointer type `ty`, from a dma-buf when `dmabuf` is given; a type
/// the device did not advertise in `ptrSupport` is refused, naming it.
fn register(
    comm: &Endpoint,
    data: *mut c_void,
    size: usize,
    ty: c_int,
    dmabuf: Option<(BorrowedFd<'_>, u64)>,
) -> Result<MemHandle, NetError> {
    let (addr, len) = (data as u64, size as u64);
    if len == 0 && dmabuf.is_some() {
        return Err(NetError::Usage(format!(
            "regMrDmaBuf of 0 bytes at {addr:#x}"
        )));
    }
    let ptr_support = match comm {
        Endpoint::Send { comm, .. } => comm.ptr_support(),
        Endpoint::Recv { comm, .. } => comm.ptr_support(),
        Endpoint::Listen(_) => 0,
    };
    let wanted = u32::try_from(ty).unwrap_or(0);
    let allowed = match dmabuf {
        Some(_) => wanted & (PTR_CUDA | PTR_DMABUF) != 0 && ptr_support & PTR_DMABUF != 0,
        None => (wanted == PTR_HOST || wanted == PTR_CUDA) && ptr_support & wanted != 0,
    };
    if !allowed {
        let how = if dmabuf.is_some() {
            "regMrDmaBuf"
        } else {
            "regMr"
        };
        return Err(NetError::Usage(format!(
            "{how} of {size} bytes at {addr:#x} with pointer type {ty:#x}: this device's \
             ptrSupport is {ptr_support:#x}"
        )));
    }
    match (comm, dmabuf) {
        (Endpoint::Send { comm, .. }, None) => comm.reg_mr(addr, len, &NcclMemory),
        (Endpoint::Recv { comm, .. }, None) => comm.reg_mr(addr, len, &NcclMemory),
        (Endpoint::Send { comm, .. }, Some((fd, off))) => comm.reg_mr_dmabuf(addr, len, fd, off),
        (Endpoint::Recv { comm, .. }, Some((fd, off))) => comm.reg_mr_dmabuf(addr, len, fd, off),
        (Endpoint::Listen(_), _) => Err(NetError::Argument("regMr on a listener".into())),
    }
}

unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mh: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        // NULL is tolerated (NCCL #782); a handle deregistered already is refused.
        if mh.is_null() {
            return Ok(());
        }
        MRS.remove(mh as usize as u64, |_| true)
    })
}

fn isend_impl(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("isend", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        *out = std::ptr::null_mut();
        if size > MAX_BYTES {
            return Err(NetError::Argument(format!(
                "isend of {size} bytes; maxP2pBytes is {MAX_BYTES}"
            )));
        }
        let mr = mem(mh)?;
        *out = on_send(comm, |s, requests, k| {
            let id = s.isend(data as u64, size as u64, tag as u32, mr.as_deref())?;
            Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
        })?;
        Ok(())
    })
}

unsafe extern "C" fn isend_v8(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    isend_impl(
        comm,
        data,
        usize::try_from(size).unwrap_or(usize::MAX),
        tag,
        mh,
        req,
    )
}

unsafe extern "C" fn isend_v9(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    isend_impl(comm, data, size, tag, mh, req)
}

unsafe extern "C" fn isend_v10(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    _phandle: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    isend_impl(comm, data, size, tag, mh, req)
}

/// The sizes array of `irecv`/`iflush`: `size_t` from v9 on, `int` in v8 and in every `iflush`.
#[derive(Clone, Copy)]
enum Sizes {
    Int(*mut c_int),
    Size(*mut usize),
}

/// One buffer NCCL passes to `irecv`/`iflush`, its registration held for the call.
#[derive(Default)]
struct Arg {
    addr: u64,
    size: u64,
    tag: u32,
    mr: Option<Held<MemHandle>>,
}

/// The `n` buffers NCCL passes to `irecv`/`iflush` as parallel arrays (`tags` is NULL for a
/// flush), read into a fixed array: both run per message, so nothing is allocated.
///
/// # Safety
/// Every non-NULL array holds `n` entries.
unsafe fn recv_args(
    call: &str,
    n: c_int,
    data: *mut *mut c_void,
    sizes: Sizes,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
) -> Result<([Arg; MAX_RECVS], usize), NetError> {
    let n = usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| NetError::Argument(format!("{call} of {n} buffers")))?;
    let sizes_null = match sizes {
        Sizes::Int(p) => p.is_null(),
        Sizes::Size(p) => p.is_null(),
    };
    if data.is_null() || sizes_null || mhandles.is_null() {
        return Err(null_arg("data, sizes or mhandles"));
    }
    let mut args: [Arg; MAX_RECVS] = Default::default();
    for (i, arg) in args.iter_mut().enumerate().take(n) {
        // SAFETY: every array holds n entries (the contract), `tags` only when non-NULL.
        let (addr, size, tag, mh) = unsafe {
            let size = match sizes {
                Sizes::Int(p) => p.add(i).read().max(0) as u64,
                Sizes::Size(p) => p.add(i).read() as u64,
            };
            let tag = if tags.is_null() { 0 } else { *tags.add(i) };
            (*data.add(i), size, tag, *mhandles.add(i))
        };
        *arg = Arg {
            addr: addr as u64,
            size,
            tag: tag as u32,
            mr: mem(mh)?,
        };
    }
    Ok((args, n))
}

/// The transport's view of the buffers `recv_args` read.
fn recv_bufs(args: &[Arg]) -> [RecvBuf<'_>; MAX_RECVS] {
    let mut bufs = [RecvBuf {
        addr: 0,
        size: 0,
        tag: 0,
        mr: None,
    }; MAX_RECVS];
    for (b, a) in bufs.iter_mut().zip(args) {
        *b = RecvBuf {
            addr: a.addr,
            size: a.size,
            tag: a.tag,
            mr: a.mr.as_deref(),
        };
    }
    bufs
}

/// `irecv`: `*request` is overwritten on every path, including NCCL's 0x1 sentinel
/// (`NCCL_NET_OPTIONAL_RECV_COMPLETION`, a hint this plugin does not use).
fn irecv_impl(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: Sizes,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("irecv", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        // NCCL may have stored its `NCCL_NET_OPTIONAL_RECV_COMPLETION` hint (0x1) here; every
        // receive completes normally, so the slot is simply overwritten on every path.
        *out = std::ptr::null_mut();
        if tags.is_null() {
            return Err(null_arg("irecv tags"));
        }
        // SAFETY: NCCL's arrays of n entries.
        let (args, n) = unsafe { recv_args("irecv", n, data, sizes, tags, mhandles) }?;
        *out = on_recv(comm, |r, requests, k| {
            let id = r.irecv(&recv_bufs(&args[..n])[..n])?;
            Ok(requests.issue(k, id))
        })?;
        Ok(())
    })
}

unsafe extern "C" fn irecv_v8(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    irecv_impl(comm, n, data, Sizes::Int(sizes), tags, mh, req)
}

unsafe extern "C" fn irecv_v9(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    irecv_impl(comm, n, data, Sizes::Size(sizes), tags, mh, req)
}

unsafe extern "C" fn irecv_v10(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    irecv_impl(comm, n, data, Sizes::Size(sizes), tags, mh, req)
}

unsafe extern "C" fn iflush(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    guard("iflush", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { request.as_mut() }.ok_or_else(|| null_arg("request"))?;
        *out = std::ptr::null_mut();
        // SAFETY: NCCL's arrays of n entries (a flush has no tags).
        let (args, n) = unsafe {
            recv_args(
                "iflush",
                n,
                data,
                Sizes::Int(sizes),
                std::ptr::null_mut(),
                mhandles,
            )
        }?;
        *out = on_recv(comm, |r, requests, k| {
            let id = r.iflush(&recv_bufs(&args[..n])[..n])?;
            Ok(id.map_or(std::ptr::null_mut(), |id| requests.issue(k, id)))
        })?;
        Ok(())
    })
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let done = unsafe { done.as_mut() }.ok_or_else(|| null_arg("done"))?;
        *done = 0;
        key(request, "request")?;
        let req = RequestKey::decode(request)?;
        let result = COMMS.with(req.comm, |e| {
            let (requests, result) = match e {
                Endpoint::Send { comm, requests } if requests.current(&req) => {
                    (requests, comm.test(req.id)?)
                }
                Endpoint::Recv { comm, requests } if requests.current(&req) => {
                    (requests, comm.test(req.id)?)
                }
                _ => return Err(req.stale()),
            };
            if result.is_some() {
                requests.retire(&req);
            }
            Ok(result)
        })?;
        let Some(result) = result else {
            return Ok(());
        };
        *done = 1;
        if sizes.is_null() {
            return Ok(());
        }
        match result {
            // SAFETY: a send's `sizes` points at one int.
            Done::Send { size } => unsafe { *sizes = size as c_int },
            Done::Recv { n, sizes: got } => {
                for (i, s) in got.iter().take(n).enumerate() {
                    // SAFETY: a receive's `sizes` has one int per grouped receive.
                    unsafe { *sizes.add(i) = *s as c_int };
                }
            }
            Done::Flush => {}
        }
        Ok(())
    })
}

/// Closes a communicator of the kind `is_kind` accepts; NULL is tolerated, a handle closed
/// already (or of another kind) is refused.
fn close(comm: *mut c_void, kind: &str, is_kind: fn(&Endpoint) -> bool) -> Result<(), NetError> {
    if comm.is_null() {
        return Ok(());
    }
    let k = comm as usize as u64;
    COMMS.remove(k, is_kind).map_err(|e| {
        if matches!(e, NetError::Argument(_)) {
            not_a(k, kind)
        } else {
            e
        }
    })
}

unsafe extern "C" fn close_send(comm: *mut c_void) -> NcclResult {
    guard("closeSend", || {
        close(comm, "send communicator", |e| {
            matches!(e, Endpoint::Send { .. })
        })
    })
}

unsafe extern "C" fn close_recv(comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || {
        close(comm, "receive communicator", |e| {
            matches!(e, Endpoint::Recv { .. })
        })
    })
}

unsafe extern "C" fn close_listen(comm: *mut c_void) -> NcclResult {
    guard("closeListen", || {
        close(comm, "listener", |e| matches!(e, Endpoint::Listen(_)))
    })
}

fn make_vdevice_impl(d: *mut c_int, devs: &[c_int]) -> NcclResult {
    guard("makeVDevice", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let d = unsafe { d.as_mut() }.ok_or_else(|| null_arg("d"))?;
        *d = -1;
        let request: Vec<u32> = devs.iter().map(|&x| x.max(0) as u32).collect();
        *d = net()?.make_vdevice(&request)? as c_int;
        Ok(())
    })
}

unsafe extern "C" fn make_vdevice_v9(d: *mut c_int, props: *mut VDevPropsV9) -> NcclResult {
    // SAFETY: NULL or NCCL's struct.
    match unsafe { props.as_ref() } {
        Some(p) => make_vdevice_impl(d, &p.devs[..(p.ndevs.clamp(0, 4) as usize)]),
        None => make_vdevice_impl(d, &[]),
    }
}

unsafe extern "C" fn make_vdevice_v12(d: *mut c_int, props: *mut VDevPropsV12) -> NcclResult {
    // SAFETY: NULL or NCCL's struct.
    match unsafe { props.as_ref() } {
        Some(p) => make_vdevice_impl(d, &p.devs[..(p.ndevs.clamp(0, 8) as usize)]),
        None => make_vdevice_impl(d, &[]),
    }
}

unsafe extern "C" fn init_v8(logger: Logger) -> NcclResult {
    guard("init", || init_net(logger, 1, false))
}

unsafe extern "C" fn init_v9(logger: Logger) -> NcclResult {
    guard("init", || init_net(logger, 4, false))
}

unsafe extern "C" fn init_v10(logger: Logger, _prof: Profiler) -> NcclResult {
    guard("init", || init_net(logger, 4, false))
}

fn init_ctx(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    max_devs: usize,
) -> NcclResult {
    guard("init", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { ctx.as_mut() }.ok_or_else(|| null_arg("ctx"))?;
        *out = std::ptr::null_mut();
        init_net(logger, max_devs, true)?;
        // SAFETY: NULL or NCCL's config.
        let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.traffic_class);
        tracing::info!("NET/WASM: init comm {comm_id:#x} traffic class {tc}");
        *out = Box::into_raw(Box::new(Ctx {
            comm: CommConfig {
                comm_id,
                traffic_class: tc,
            },
        }))
        .cast();
        Ok(())
    })
}

unsafe extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    _prof: Profiler,
) -> NcclResult {
    init_ctx(ctx, comm_id, config, logger, 4)
}

unsafe extern "C" fn init_v12(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    _prof: Profiler,
) -> NcclResult {
    init_ctx(ctx, comm_id, config, logger, 8)
}

/// `finalize`: the last context drops the process-wide state, stopping every thread.
unsafe extern "C" fn finalize(ctx: *mut c_void) -> NcclResult {
    guard("finalize", || {
        if !ctx.is_null() {
            // SAFETY: a context from init, finalized once.
            drop(unsafe { Box::from_raw(ctx.cast::<Ctx>()) });
        }
        let last = {
            let mut st = state();
            match st.as_mut() {
                Some(g) => {
                    g.contexts = g.contexts.saturating_sub(1);
                    if g.contexts == 0 { st.take() } else { None }
                }
                None => None,
            }
        };
        drop(last);
        Ok(())
    })
}

unsafe extern "C" fn set_net_attr(_ctx: *mut c_void, _attr: *mut c_void) -> NcclResult {
    NCCL_SUCCESS
}

// Every connection fits the stats struct whole.
const _: () = assert!(MAX_QPS <= STATS_MAX_QPS && MAX_ENDPOINTS <= STATS_MAX_ENDPOINTS);

/// `ncclwasm_send_comm_stats` (layout and contract in `ncclwasm_abi::stats`): the plan a send
/// communicator runs, who made it and why, and the payload bytes posted on each of its QPs. NCCL
/// never calls it; `ncclwasm bench` does, to show what the connection did rather than what it
/// should have done.
///
/// # Safety
/// `out` is NULL or a struct whose
/// first field, `version`, names its layout.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclwasm_send_comm_stats(
    send_comm: *mut c_void,
    out: *mut SendStatsV1,
) -> NcclResult {
    guard("ncclwasm_send_comm_stats", || {
        // SAFETY: NULL or the caller's struct, whose first field is its `u32` version in every
        // layout; nothing else is touched before the version says which layout it is.
        let version = *unsafe { out.cast::<u32>().as_ref() }.ok_or_else(|| null_arg("out"))?;
        if version != SEND_STATS_VERSION {
            return Err(NetError::Usage(format!(
                "stats layout version {version}; this plugin writes version {SEND_STATS_VERSION}"
            )));
        }
        // SAFETY: the version says `out` is a `SendStatsV1`, and the caller owns it.
        let out = unsafe { &mut *out };
        *out = SendStatsV1::empty();
        // The stats borrow the comm, so they are copied out while the handle is held.
        on_send(send_comm, |s, _, _| {
            let st = s.stats();
            let p = st.plan;
            out.nqps = p.qps.len() as u32;
            out.nlocal = st.local.len() as u32;
            out.npeer = st.peer.len() as u32;
            out.stripe_width = p.stripe_width;
            out.align = p.align;
            out.ar_threshold = p.ar_threshold;
            out.adaptive_routing = u8::from(p.adaptive_routing);
            (out.tc, out.sl, out.fifo_tc) = (p.tc, p.sl, p.fifo_tc);
            out.ece = u8::from(p.ece);
            (out.timeout, out.retry_cnt) = (p.timeout, p.retry_cnt);
            write_c_str(&mut out.source, st.source);
            write_c_str(&mut out.reason, &p.reason);
            for (list, ends) in [(&mut out.local, st.local), (&mut out.peer, st.peer)] {
                for (e, ep) in list.iter_mut().zip(ends) {
                    write_c_str(&mut e.device, &ep.device);
                    e.port = u32::from(ep.port);
                }
            }
            for ((q, plan), bytes) in out.qps.iter_mut().zip(&p.qps).zip(&st.posted) {
                *q = StatsQp {
                    local: plan.local,
                    remote: plan.remote,
                    weight: plan.weight,
                    reserved: 0,
                    bytes: *bytes,
                };
            }
            Ok(())
        })
    })
}

/// Drops the process-wide state when the image is unloaded without `finalize` (ABI v8–v10 have
/// none), so no thread of ours outlives the code it runs.
extern "C" fn unload() {
    let _ = catch_unwind(|| {
        // At process exit another thread may hold the lock mid-call: then leave it be.
        if let Ok(mut st) = STATE.try_lock() {
            drop(st.take());
        }
    });
}

#[used]
#[unsafe(link_section = ".fini_array")]
static UNLOAD: extern "C" fn() = unload;

// ---------------------------------------------------------------------------------------------
// The exported tables (NCCL probes the newest it knows first).

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: NAME.as_ptr(),
    init: Some(init_v8),
    devices: Some(devices),
    get_properties: Some(get_properties_v8),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v8),
    irecv: Some(irecv_v8),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: NAME.as_ptr(),
    init: Some(init_v9),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v9),
    irecv: Some(irecv_v9),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(make_vdevice_v9),
};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: NAME.as_ptr(),
    init: Some(init_v10),
    devices: Some(devices),
    get_properties: Some(get_properties_v9),
    listen: Some(listen),
    connect: Some(connect_v10),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(make_vdevice_v9),
};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
    name: NAME.as_ptr(),
    init: Some(init_v11),
    devices: Some(devices),
    get_properties: Some(get_properties_v11),
    listen: Some(listen_v11),
    connect: Some(connect_v11),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(make_vdevice_v9),
    finalize: Some(finalize),
    set_net_attr: Some(set_net_attr),
};

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v12: NetV12 = NetV12 {
    name: NAME.as_ptr(),
    init: Some(init_v12),
    devices: Some(devices),
    get_properties: Some(get_properties_v12),
    listen: Some(listen_v11),
    connect: Some(connect_v11),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend_v10),
    irecv: Some(irecv_v10),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(make_vdevice_v12),
    finalize: Some(finalize),
    set_net_attr: Some(set_net_attr),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_refuse_what_is_not_a_send_comm_or_not_their_layout() {
        let mut out = SendStatsV1::empty();
        out.nqps = 7;
        // SAFETY: a NULL communicator is refused before anything is read through it.
        let rc = unsafe { ncclwasm_send_comm_stats(std::ptr::null_mut(), &mut out) };
        assert_eq!(
            (rc, out.nqps),
            (NCCL_INVALID_ARGUMENT, 0),
            "cleared on error too"
        );

        let mut junk = [0u8; 16];
        out.nqps = 7;
        // SAFETY: a handle is a key, never dereferenced: this one names no communicator.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INVALID_USAGE, 0));

        out.version = SEND_STATS_VERSION + 1;
        out.nqps = 7;
        // SAFETY: a layout of another version is refused before anything but its version is
        // read or written.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INVALID_USAGE, 7), "not written");

        // SAFETY: a NULL struct is refused.
        let rc =
            unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), std::ptr::null_mut()) };
        assert_eq!(rc, NCCL_INVALID_ARGUMENT);
    }
}
