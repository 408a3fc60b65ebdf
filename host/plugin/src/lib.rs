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
//! load; v11/v12 call `init`/`finalize` per communicator, and the last `finalize` drops the
//! context, which stops the event and policy threads — so NCCL's `dlclose` finds nothing running
//! and a later `dlopen` + `init` starts from scratch. Communicators hold their own references to
//! the devices they use, so closing them later is still safe.
//!
//! # Requests
//! A request handed to NCCL is the address of a slot in its communicator's fixed table (one per
//! pool index), so `test` finds the communicator and the request without a lookup, and nothing is
//! allocated per message.

mod fabric;
mod log;

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::BorrowedFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use ncclwasm_policy::PolicyHost;
use ncclwasm_transport::{
    CommConfig, DeviceProps, Done, ErrorClass, HANDLE_SIZE, Listener, MAX_ENDPOINTS, MAX_QPS,
    MAX_RECVS, MAX_REQUESTS, MemHandle, Net, NetError, PTR_CUDA, PTR_DMABUF, PTR_HOST, RecvBuf,
    RecvComm, RegionSource, ReqId, SendComm,
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

/// Makes (or reuses) the context; `contexts` counts v11+ communicators.
fn init_net(logger: Logger, max_devs_per_nic: usize, context: bool) -> Result<(), NetError> {
    log::install(logger);
    let mut st = state();
    if st.is_none() {
        let choice = fabric::choice()?;
        let decisions = Arc::new(PolicyHost::from_env(max_devs_per_nic)?);
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
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            log::emit(
                LOG_WARN,
                &format!("NET/WASM: {entry}: internal error (panic: {what}); please report it"),
            );
            NCCL_INTERNAL_ERROR
        }
    }
}

fn null_arg(what: &str) -> NetError {
    NetError::Usage(format!("{what} is NULL"))
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
// Communicators and requests as NCCL holds them.

/// Which communicator a request slot belongs to.
#[derive(Clone, Copy)]
enum Owner {
    Send(*const PluginSend),
    Recv(*const PluginRecv),
}

/// A request as NCCL sees it: a slot of its communicator's table.
struct Slot {
    owner: Owner,
    index: usize,
}

fn slots(owner: Owner) -> Box<[Slot]> {
    (0..MAX_REQUESTS)
        .map(|index| Slot { owner, index })
        .collect()
}

/// The first byte of every communicator NCCL holds, because `regMr` does not say which kind it
/// passes.
const SEND_KIND: u8 = 0x5e;
const RECV_KIND: u8 = 0x7e;

#[repr(C)]
struct PluginSend {
    kind: u8,
    comm: SendComm,
    slots: Box<[Slot]>,
}

#[repr(C)]
struct PluginRecv {
    kind: u8,
    comm: RecvComm,
    slots: Box<[Slot]>,
}

fn boxed_send(comm: SendComm) -> *mut c_void {
    let b = Box::into_raw(Box::new(PluginSend {
        kind: SEND_KIND,
        comm,
        slots: Box::new([]),
    }));
    // SAFETY: `b` was just allocated and is uniquely owned here.
    unsafe { (*b).slots = slots(Owner::Send(b)) };
    b.cast()
}

fn boxed_recv(comm: RecvComm) -> *mut c_void {
    let b = Box::into_raw(Box::new(PluginRecv {
        kind: RECV_KIND,
        comm,
        slots: Box::new([]),
    }));
    // SAFETY: as in `boxed_send`.
    unsafe { (*b).slots = slots(Owner::Recv(b)) };
    b.cast()
}

fn slot_ptr(slots: &[Slot], id: ReqId) -> *mut c_void {
    (&raw const slots[id.index()]).cast_mut().cast()
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

/// A registration handle from NCCL (NULL = none).
///
/// # Safety
/// `mh` is NULL or a handle from `reg_mr` not yet deregistered.
unsafe fn mem<'a>(mh: *mut c_void) -> Option<&'a MemHandle> {
    // SAFETY: per the contract.
    unsafe { mh.cast::<MemHandle>().as_ref() }
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
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle.cast(), HANDLE_SIZE) };
        *out = Box::into_raw(Box::new(listener)).cast();
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
        if let Some(c) = net()?.connect(i64::from(dev), handle, comm)? {
            *out = boxed_send(c);
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
        // SAFETY: a listener from `listen`, used by one thread at a time (NCCL's service thread).
        let l = unsafe { listen_comm.cast::<Listener>().as_mut() }
            .ok_or_else(|| null_arg("listenComm"))?;
        if let Some(c) = l.accept()? {
            *out = boxed_recv(c);
        }
        Ok(())
    })
}

/// A communicator of either kind.
#[derive(Clone, Copy)]
enum Comm<'a> {
    Send(&'a PluginSend),
    Recv(&'a PluginRecv),
}

impl Comm<'_> {
    /// The `ptrSupport` of the device the communicator was made on.
    fn ptr_support(self) -> u32 {
        match self {
            Comm::Send(s) => s.comm.ptr_support(),
            Comm::Recv(r) => r.comm.ptr_support(),
        }
    }
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
        // SAFETY: a communicator from connect/accept, alive until close.
        let comm = unsafe { which(comm) }?;
        *out = Box::into_raw(Box::new(register(comm, data, size, ty, None)?)).cast();
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
        // SAFETY: a communicator from connect/accept, alive until close.
        let comm = unsafe { which(comm) }?;
        // SAFETY: NCCL keeps the fd open for the duration of the call; the kernel (or the
        // provider) takes its own reference to the pages.
        let fd = (fd >= 0).then(|| unsafe { BorrowedFd::borrow_raw(fd) });
        let dmabuf = fd.map(|fd| (fd, offset));
        *out = Box::into_raw(Box::new(register(comm, data, size, ty, dmabuf)?)).cast();
        Ok(())
    })
}

/// Registers NCCL's buffer of pointer type `ty`, from a dma-buf when `dmabuf` is given; a type
/// the device did not advertise in `ptrSupport` is refused, naming it.
fn register(
    comm: Comm<'_>,
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
    let ptr_support = comm.ptr_support();
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
        (Comm::Send(s), None) => s.comm.reg_mr(addr, len, &NcclMemory),
        (Comm::Recv(r), None) => r.comm.reg_mr(addr, len, &NcclMemory),
        (Comm::Send(s), Some((fd, off))) => s.comm.reg_mr_dmabuf(addr, len, fd, off),
        (Comm::Recv(r), Some((fd, off))) => r.comm.reg_mr_dmabuf(addr, len, fd, off),
    }
}

/// Tells a send from a receive communicator by its first byte.
///
/// # Safety
/// `comm` is a live communicator returned by `connect` or `accept`.
unsafe fn which<'a>(comm: *mut c_void) -> Result<Comm<'a>, NetError> {
    if comm.is_null() {
        return Err(null_arg("comm"));
    }
    // SAFETY: both communicator structs are repr(C) with a `u8` kind first.
    match unsafe { comm.cast::<u8>().read() } {
        // SAFETY: the kind says it is a live PluginSend.
        SEND_KIND => Ok(Comm::Send(unsafe { &*comm.cast::<PluginSend>() })),
        // SAFETY: the kind says it is a live PluginRecv.
        RECV_KIND => Ok(Comm::Recv(unsafe { &*comm.cast::<PluginRecv>() })),
        k => Err(NetError::Usage(format!(
            "{comm:p} is not a communicator of this plugin (kind byte {k:#x})"
        ))),
    }
}

unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mh: *mut c_void) -> NcclResult {
    guard("deregMr", || {
        if !mh.is_null() {
            // SAFETY: a handle from regMr, deregistered once (NULL tolerated, see NCCL #782).
            drop(unsafe { Box::from_raw(mh.cast::<MemHandle>()) });
        }
        Ok(())
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
        // SAFETY: a send communicator from connect.
        let s = unsafe { comm.cast::<PluginSend>().as_ref() }.ok_or_else(|| null_arg("comm"))?;
        if size > MAX_BYTES {
            return Err(NetError::Usage(format!(
                "isend of {size} bytes; maxP2pBytes is {MAX_BYTES}"
            )));
        }
        // SAFETY: NULL or a live handle from regMr.
        let mr = unsafe { mem(mh) };
        if let Some(id) = s.comm.isend(data as u64, size as u64, tag as u32, mr)? {
            *out = slot_ptr(&s.slots, id);
        }
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

/// The `n` buffers NCCL passes to `irecv`/`iflush` as parallel arrays (`tags` is NULL for a
/// flush), read into a fixed array: both run per message, so nothing is allocated.
///
/// # Safety
/// Every non-NULL array holds `n` entries, each mhandle NULL or a live one from `regMr`.
unsafe fn recv_bufs<'a>(
    call: &str,
    n: c_int,
    data: *mut *mut c_void,
    sizes: Sizes,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
) -> Result<([RecvBuf<'a>; MAX_RECVS], usize), NetError> {
    let n = usize::try_from(n)
        .ok()
        .filter(|n| (1..=MAX_RECVS).contains(n))
        .ok_or_else(|| NetError::Usage(format!("{call} of {n} buffers")))?;
    let sizes_null = match sizes {
        Sizes::Int(p) => p.is_null(),
        Sizes::Size(p) => p.is_null(),
    };
    if data.is_null() || sizes_null || mhandles.is_null() {
        return Err(null_arg("data, sizes or mhandles"));
    }
    let empty = RecvBuf {
        addr: 0,
        size: 0,
        tag: 0,
        mr: None,
    };
    let mut bufs = [empty; MAX_RECVS];
    for (i, buf) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: every array holds n entries (the contract), `tags` only when non-NULL.
        let (addr, size, tag, mh) = unsafe {
            let size = match sizes {
                Sizes::Int(p) => p.add(i).read().max(0) as u64,
                Sizes::Size(p) => p.add(i).read() as u64,
            };
            let tag = if tags.is_null() { 0 } else { *tags.add(i) };
            (*data.add(i), size, tag, *mhandles.add(i))
        };
        *buf = RecvBuf {
            addr: addr as u64,
            size,
            tag: tag as u32,
            // SAFETY: NULL or a live handle from regMr.
            mr: unsafe { mem(mh) },
        };
    }
    Ok((bufs, n))
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
        // SAFETY: a receive communicator from accept.
        let r = unsafe { comm.cast::<PluginRecv>().as_ref() }.ok_or_else(|| null_arg("comm"))?;
        if tags.is_null() {
            return Err(null_arg("irecv tags"));
        }
        // SAFETY: NCCL's arrays of n entries.
        let (bufs, n) = unsafe { recv_bufs("irecv", n, data, sizes, tags, mhandles) }?;
        let id = r.comm.irecv(&bufs[..n])?;
        *out = slot_ptr(&r.slots, id);
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
        // SAFETY: a receive communicator from accept.
        let r = unsafe { comm.cast::<PluginRecv>().as_ref() }.ok_or_else(|| null_arg("comm"))?;
        // SAFETY: NCCL's arrays of n entries (a flush has no tags).
        let (bufs, n) = unsafe {
            recv_bufs(
                "iflush",
                n,
                data,
                Sizes::Int(sizes),
                std::ptr::null_mut(),
                mhandles,
            )
        }?;
        if let Some(id) = r.comm.iflush(&bufs[..n])? {
            *out = slot_ptr(&r.slots, id);
        }
        Ok(())
    })
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let done = unsafe { done.as_mut() }.ok_or_else(|| null_arg("done"))?;
        *done = 0;
        // SAFETY: a request slot returned by isend/irecv/iflush, of a live communicator.
        let slot = unsafe { request.cast::<Slot>().as_ref() }.ok_or_else(|| null_arg("request"))?;
        let id = ReqId::from_index(slot.index).map_err(|e| NetError::Usage(e.to_string()))?;
        let result = match slot.owner {
            // SAFETY: the owner outlives its requests (NCCL tests only before close).
            Owner::Send(s) => unsafe { &*s }.comm.test(id)?,
            // SAFETY: as above.
            Owner::Recv(r) => unsafe { &*r }.comm.test(id)?,
        };
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

unsafe extern "C" fn close_send(comm: *mut c_void) -> NcclResult {
    guard("closeSend", || {
        if !comm.is_null() {
            // SAFETY: a send communicator from connect, closed once.
            drop(unsafe { Box::from_raw(comm.cast::<PluginSend>()) });
        }
        Ok(())
    })
}

unsafe extern "C" fn close_recv(comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || {
        if !comm.is_null() {
            // SAFETY: a receive communicator from accept, closed once.
            drop(unsafe { Box::from_raw(comm.cast::<PluginRecv>()) });
        }
        Ok(())
    })
}

unsafe extern "C" fn close_listen(comm: *mut c_void) -> NcclResult {
    guard("closeListen", || {
        if !comm.is_null() {
            // SAFETY: a listener from listen, closed once.
            drop(unsafe { Box::from_raw(comm.cast::<Listener>()) });
        }
        Ok(())
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
/// `send_comm` is NULL or a live communicator of this plugin; `out` is NULL or a struct whose
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
        // SAFETY: NULL or a communicator from connect or accept, alive until close.
        let Comm::Send(s) = (unsafe { which(send_comm) })? else {
            return Err(NetError::Usage(
                "ncclwasm_send_comm_stats of a receive communicator".into(),
            ));
        };
        let st = s.comm.stats();
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
            (NCCL_INTERNAL_ERROR, 0),
            "cleared on error too"
        );

        let mut junk = [0u8; 16];
        out.nqps = 7;
        // SAFETY: only the first byte of a would-be communicator is read, and it is no kind.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INTERNAL_ERROR, 0));

        out.version = SEND_STATS_VERSION + 1;
        out.nqps = 7;
        // SAFETY: a layout of another version is refused before anything but its version is
        // read or written.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INTERNAL_ERROR, 7), "not written");

        // SAFETY: a NULL struct is refused.
        let rc =
            unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), std::ptr::null_mut()) };
        assert_eq!(rc, NCCL_INTERNAL_ERROR);
    }
}
