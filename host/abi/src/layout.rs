//! The NCCL net plugin ABI, v8 … v12: `#[repr(C)]` mirrors of NCCL's structs and function tables
//! with their x86-64 sizes and offsets checked at compile time (the `ncclNet_vN_t` of NCCL's
//! `net_vN.h` headers). Values coming in from C are plain integers, never Rust enums.

use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::mem::{offset_of, size_of};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const NCCL_SUCCESS: NcclResult = 0;
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
pub const NCCL_INVALID_USAGE: NcclResult = 5;
pub const NCCL_REMOTE_ERROR: NcclResult = 6;

/// `ncclDebugLogLevel` values.
pub const LOG_WARN: c_int = 2;
pub const LOG_INFO: c_int = 3;
pub const LOG_TRACE: c_int = 5;
/// `ncclDebugLogSubSys` flags.
pub const NCCL_INIT: c_ulong = 0x1;
pub const NCCL_NET: c_ulong = 0x10;
pub const NCCL_ALL: c_ulong = !0;

pub const NCCL_PTR_HOST: c_int = 0x1;
/// `NCCL_NET_ID_UNDEF`.
pub const ID_UNDEF: i16 = -1;
/// `NCCL_MAX_NET_SIZE_BYTES`: the largest `maxP2pBytes`/`maxCollBytes` NCCL accepts (1 TiB).
pub const NCCL_MAX_NET_SIZE_BYTES: usize = 1 << 40;
/// `MAX_COLLNET_SIZE`: the `maxCollBytes` net_ib reports (512 MiB).
pub const MAX_COLLNET_SIZE: usize = 512 << 20;

/// `ncclDebugLogger_t`: variadic; called with `"%s"` and a preformatted string.
pub type Logger = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;
/// `ncclProfilerCallback_t` (v10+ `init`; NULL when NCCL profiles nothing): `(eHandle, type,
/// pHandle, pluginId, extData)`, `type` one of the `PROFILER_*` event kinds.
pub type Profiler = Option<ProfilerFn>;
/// The callback itself, when NCCL gave one.
pub type ProfilerFn = unsafe extern "C" fn(
    e_handle: *mut *mut c_void,
    kind: c_int,
    p_handle: *mut c_void,
    plugin_id: i64,
    ext_data: *mut c_void,
) -> NcclResult;
/// `ncclProfilerNetEventStart` / `…Stop`: the profiler callback's `type`.
pub const PROFILER_EVENT_START: c_int = 0;
pub const PROFILER_EVENT_STOP: c_int = 1;
/// `NCCL_PROFILER_NET_TYPE_IB | NCCL_PROFILER_NET_IB_VER`: the plugin id of net_ib's QP events
/// (the type in bits 16–31, the descriptor's version below).
pub const PROFILER_PLUGIN_IB_V1: i64 = (1 << 16) | 1;
/// `ncclProfileQp`: an IB-v1 descriptor's `type`.
pub const PROFILE_QP: u8 = 1;
/// This plugin's own events (`NetWasmDescrV1`): type `0x4e57` ("NW"), version 1. NCCL's
/// example profiler keeps only IB and socket events; a profiler that knows this id reads the
/// decisions behind each connection.
pub const PROFILER_PLUGIN_NCCLWASM_V1: i64 = (0x4e57 << 16) | 1;

/// `ncclProfilerNetIbDescr_v1_t`: `type` then the union, whose one member is `qp`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetIbQpDescrV1 {
    pub kind: u8,
    pub qp: NetIbQp,
}

/// The `qp` member of [`NetIbQpDescrV1`]: one QP event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetIbQp {
    /// The device index of the connection's port (net_ib's `devIndex`).
    pub device: c_int,
    pub wr_id: u64,
    pub opcode: c_int,
    pub qp_num: c_int,
    pub length: usize,
}

/// The descriptor of this plugin's own profiler events ([`PROFILER_PLUGIN_NCCLWASM_V1`]): a
/// decision about one connection.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetWasmDescrV1 {
    /// 1: the plan the connection runs; 2: a failover move; 3: a fail-back; 4: a port held
    /// for (`wait`); 5: a held port resumed.
    pub kind: u8,
    /// The NCCL device the connection was made on.
    pub device: c_int,
    pub comm_id: u64,
    /// QPs of the plan, failover moves and fail-backs so far.
    pub qps: u32,
    pub moves: u32,
    pub fail_backs: u32,
    /// Who made the plan (NUL-terminated; valid during the callback only).
    pub source: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropsV8 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VDevPropsV9 {
    pub ndevs: c_int,
    pub devs: [c_int; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VDevPropsV12 {
    pub ndevs: c_int,
    pub devs: [c_int; 8],
}

/// `ncclNetProperties_v9_t`, identical to v10's.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropsV9 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub vprops: VDevPropsV9,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropsV11 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub vprops: VDevPropsV9,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropsV12 {
    pub name: *const c_char,
    pub pci_path: *const c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub vprops: VDevPropsV12,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
    pub rail_id: i16,
    pub plane_id: i16,
}

/// `ncclNetCommAttr_v11_t` (= v12): -1 is undefined.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CommAttrC {
    pub max_concurrent_peers: i32,
    pub min_concurrent_peers: i32,
    pub max_flows_per_peer: i32,
    pub min_flows_per_peer: i32,
}

/// `ncclNetAttr_v11_t` (= v12), what `setNetAttr` receives: the masks are `u32::MAX` when
/// undefined.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetAttrC {
    pub send: CommAttrC,
    pub recv: CommAttrC,
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

impl CommAttrC {
    fn to_model(self) -> ncclwasm_model::CommAttr {
        ncclwasm_model::CommAttr::from_raw(
            self.max_concurrent_peers,
            self.min_concurrent_peers,
            self.max_flows_per_peer,
            self.min_flows_per_peer,
        )
    }
}

impl NetAttrC {
    pub fn to_model(&self) -> ncclwasm_model::NetAttr {
        ncclwasm_model::NetAttr::from_raw(
            self.send.to_model(),
            self.recv.to_model(),
            self.op,
            self.algo,
            self.proto,
        )
    }
}

/// `ncclNetCommConfig_v10_t` (= v11, v12).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CommConfigC {
    pub traffic_class: c_int,
}

type P = *mut c_void;
type PP = *mut *mut c_void;

type InitV8 = unsafe extern "C" fn(Logger) -> NcclResult;
type InitV10 = unsafe extern "C" fn(Logger, Profiler) -> NcclResult;
type InitV11 = unsafe extern "C" fn(PP, u64, *mut CommConfigC, Logger, Profiler) -> NcclResult;
type Devices = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetProps<T> = unsafe extern "C" fn(c_int, *mut T) -> NcclResult;
type Listen = unsafe extern "C" fn(c_int, P, PP) -> NcclResult;
type ListenV11 = unsafe extern "C" fn(P, c_int, P, PP) -> NcclResult;
type Connect = unsafe extern "C" fn(c_int, P, PP, PP) -> NcclResult;
type ConnectV10 = unsafe extern "C" fn(c_int, *mut CommConfigC, P, PP, PP) -> NcclResult;
type ConnectV11 = unsafe extern "C" fn(P, c_int, P, PP, PP) -> NcclResult;
type Accept = unsafe extern "C" fn(P, PP, PP) -> NcclResult;
type RegMr = unsafe extern "C" fn(P, P, usize, c_int, PP) -> NcclResult;
type RegMrDmaBuf = unsafe extern "C" fn(P, P, usize, c_int, u64, c_int, PP) -> NcclResult;
type DeregMr = unsafe extern "C" fn(P, P) -> NcclResult;
type IsendV8 = unsafe extern "C" fn(P, P, c_int, c_int, P, PP) -> NcclResult;
type IsendV9 = unsafe extern "C" fn(P, P, usize, c_int, P, PP) -> NcclResult;
type IsendV10 = unsafe extern "C" fn(P, P, usize, c_int, P, P, PP) -> NcclResult;
type IrecvV8 = unsafe extern "C" fn(P, c_int, PP, *mut c_int, *mut c_int, PP, PP) -> NcclResult;
type IrecvV9 = unsafe extern "C" fn(P, c_int, PP, *mut usize, *mut c_int, PP, PP) -> NcclResult;
type IrecvV10 =
    unsafe extern "C" fn(P, c_int, PP, *mut usize, *mut c_int, PP, PP, PP) -> NcclResult;
type Iflush = unsafe extern "C" fn(P, c_int, PP, *mut c_int, PP, PP) -> NcclResult;
type Test = unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> NcclResult;
type Close = unsafe extern "C" fn(P) -> NcclResult;
type GetDeviceMr = unsafe extern "C" fn(P, P, PP) -> NcclResult;
type IrecvConsumed = unsafe extern "C" fn(P, c_int, P) -> NcclResult;
type MakeVDevice<T> = unsafe extern "C" fn(*mut c_int, *mut T) -> NcclResult;
type Finalize = unsafe extern "C" fn(P) -> NcclResult;
type SetNetAttr = unsafe extern "C" fn(P, *mut NetAttrC) -> NcclResult;

/// The slots every version has, in slot order, parameterised by what changed.
macro_rules! table {
    ($name:ident, $props:ty, $init:ty, $listen:ty, $connect:ty, $isend:ty, $irecv:ty
     $(, $extra:ident : $extra_ty:ty)*) => {
        #[repr(C)]
        #[derive(Debug)]
        pub struct $name {
            pub name: *const c_char,
            pub init: Option<$init>,
            pub devices: Option<Devices>,
            pub get_properties: Option<GetProps<$props>>,
            pub listen: Option<$listen>,
            pub connect: Option<$connect>,
            pub accept: Option<Accept>,
            pub reg_mr: Option<RegMr>,
            pub reg_mr_dma_buf: Option<RegMrDmaBuf>,
            pub dereg_mr: Option<DeregMr>,
            pub isend: Option<$isend>,
            pub irecv: Option<$irecv>,
            pub iflush: Option<Iflush>,
            pub test: Option<Test>,
            pub close_send: Option<Close>,
            pub close_recv: Option<Close>,
            pub close_listen: Option<Close>,
            pub get_device_mr: Option<GetDeviceMr>,
            pub irecv_consumed: Option<IrecvConsumed>,
            $(pub $extra: Option<$extra_ty>,)*
        }

        // SAFETY: the only non-Sync field is `name`, a pointer to a static, immutable C string.
        unsafe impl Sync for $name {}
    };
}

table!(NetV8, PropsV8, InitV8, Listen, Connect, IsendV8, IrecvV8);
table!(NetV9, PropsV9, InitV8, Listen, Connect, IsendV9, IrecvV9,
    make_vdevice: MakeVDevice<VDevPropsV9>);
table!(NetV10, PropsV9, InitV10, Listen, ConnectV10, IsendV10, IrecvV10,
    make_vdevice: MakeVDevice<VDevPropsV9>);
table!(NetV11, PropsV11, InitV11, ListenV11, ConnectV11, IsendV10, IrecvV10,
    make_vdevice: MakeVDevice<VDevPropsV9>, finalize: Finalize, set_net_attr: SetNetAttr);
table!(NetV12, PropsV12, InitV11, ListenV11, ConnectV11, IsendV10, IrecvV10,
    make_vdevice: MakeVDevice<VDevPropsV12>, finalize: Finalize, set_net_attr: SetNetAttr);

// The layouts NCCL compiles against (x86-64, checked with gcc on NVIDIA's headers).
const _: () = {
    assert!(size_of::<NetV8>() == 152);
    assert!(size_of::<NetV9>() == 160);
    assert!(size_of::<NetV10>() == 160);
    assert!(size_of::<NetV11>() == 176);
    assert!(size_of::<NetV12>() == 176);
    assert!(size_of::<NetAttrC>() == 44);
    assert!(size_of::<NetIbQpDescrV1>() == 40);
    assert!(offset_of!(NetIbQpDescrV1, qp) == 8);
    assert!(offset_of!(NetIbQp, wr_id) == 8);
    assert!(offset_of!(NetIbQp, opcode) == 16);
    assert!(offset_of!(NetIbQp, qp_num) == 20);
    assert!(offset_of!(NetIbQp, length) == 24);
    assert!(size_of::<NetWasmDescrV1>() == 40);
    assert!(offset_of!(NetWasmDescrV1, comm_id) == 8);
    assert!(offset_of!(NetWasmDescrV1, source) == 32);
    assert!(offset_of!(NetAttrC, recv) == 16);
    assert!(offset_of!(NetAttrC, op) == 32);
    assert!(offset_of!(NetAttrC, proto) == 40);
    assert!(offset_of!(NetV9, make_vdevice) == 152);
    assert!(offset_of!(NetV11, finalize) == 160);
    assert!(offset_of!(NetV12, set_net_attr) == 168);

    assert!(size_of::<PropsV8>() == 64);
    assert!(offset_of!(PropsV8, latency) == 40);
    assert!(offset_of!(PropsV8, net_device_version) == 56);

    assert!(size_of::<PropsV9>() == 104);
    assert!(offset_of!(PropsV9, force_flush) == 32);
    assert!(offset_of!(PropsV9, speed) == 36);
    assert!(offset_of!(PropsV9, vprops) == 64);
    assert!(offset_of!(PropsV9, max_p2p_bytes) == 88);
    assert!(offset_of!(PropsV9, max_coll_bytes) == 96);

    assert!(size_of::<PropsV11>() == 112);
    assert!(offset_of!(PropsV11, max_multi_request_size) == 104);

    assert!(size_of::<PropsV12>() == 128);
    assert!(offset_of!(PropsV12, vprops) == 64);
    assert!(offset_of!(PropsV12, max_p2p_bytes) == 104);
    assert!(offset_of!(PropsV12, max_coll_bytes) == 112);
    assert!(offset_of!(PropsV12, max_multi_request_size) == 120);
    assert!(offset_of!(PropsV12, rail_id) == 124);
    assert!(offset_of!(PropsV12, plane_id) == 126);

    assert!(size_of::<VDevPropsV9>() == 20);
    assert!(size_of::<VDevPropsV12>() == 36);
    assert!(size_of::<CommConfigC>() == 4);
};
