//! NCCL's one-sided RMA plugin ABI, v14 … v16: `#[repr(C)]` mirrors of the `ncclRma_vN_t`
//! tables NCCL's GIN proxy drives (puts, puts with a signal, gets, flushes over symmetric
//! registrations of a group of ranks), with their x86-64 sizes and offsets checked at compile
//! time against NCCL's `rma_v14.h` and the v15/v16 headers. They reuse the net ABI's logger,
//! result codes and `ncclNetProperties_v12_t` ([`crate::layout`]).

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

use crate::layout::{Logger, NcclResult, PropsV12};

/// `NCCL_NET_SIGNAL_OP_INC`: the signal word grows by one, whatever `signalValue` says (NCCL's
/// own `net_ib` GIN posts a fetch-and-add of 1).
pub const NCCL_NET_SIGNAL_OP_INC: u32 = 1;
/// `NCCL_NET_SIGNAL_OP_ADD`: the signal word grows by `signalValue`.
pub const NCCL_NET_SIGNAL_OP_ADD: u32 = 2;
/// `NCCL_NET_DEVICE_GIN_PROXY`: the `netDeviceType` an RMA plugin served by NCCL's CPU proxy
/// reports in `getProperties` — the kernels hand their operations to the proxy, which calls
/// the table (the other GIN types are kernel-initiated and need a device handle).
pub const NCCL_NET_DEVICE_GIN_PROXY: c_int = 2;
/// `ncclRmaOptFlagsAggregateRequests` (v15+ `optFlags`): the caller may post more operations
/// to the same peer right after this one, so a backend may batch them. A hint only: it must not
/// change the data moved or the order signals and puts become visible in.
pub const RMA_OPT_FLAGS_AGGREGATE_REQUESTS: u32 = 1;

/// `ncclRmaConfig_v14_t` (= v15, v16): what `createContext` builds.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmaConfigV14 {
    /// Independent streams of operations (`context` of every data call is below it).
    pub n_contexts: c_int,
    /// As the net ABI's `trafficClass`; -1 is undefined.
    pub traffic_class: c_int,
    /// The distance between the ranks this context reaches (1: all of them).
    pub rank_stride: c_int,
}

/// `ncclRmaProperties_v16_t`, what v16's `getRmaProperties` fills per group.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmaPropertiesV16 {
    /// True only when any signal arriving makes every put the group has received visible, on
    /// every NIC it uses: NCCL then skips its per-peer flush in a device barrier. NCCL's own
    /// wrappers report false for older tables, which keeps the flush.
    pub flushes_all_puts_on_any_signal: bool,
}

type P = *mut c_void;
type PP = *mut *mut c_void;

type Init = unsafe extern "C" fn(ctx: PP, comm_id: u64, logger: Logger) -> NcclResult;
type Devices = unsafe extern "C" fn(ndev: *mut c_int) -> NcclResult;
type GetRmaProperties =
    unsafe extern "C" fn(coll_comm: P, props: *mut RmaPropertiesV16) -> NcclResult;
type GetProperties = unsafe extern "C" fn(dev: c_int, props: *mut PropsV12) -> NcclResult;
type Listen = unsafe extern "C" fn(ctx: P, dev: c_int, handle: P, listen_comm: PP) -> NcclResult;
/// Collective over the group: every rank calls it with all `nranks` listen handles.
type Connect = unsafe extern "C" fn(
    ctx: P,
    handles: PP,
    nranks: c_int,
    rank: c_int,
    listen_comm: P,
    coll_comm: PP,
) -> NcclResult;
type CreateContext =
    unsafe extern "C" fn(coll_comm: P, config: *mut RmaConfigV14, rma_ctx: PP) -> NcclResult;
/// Symmetric: every rank registers its buffer of the same role, in the same order.
type RegMrSym = unsafe extern "C" fn(
    coll_comm: P,
    data: P,
    size: usize,
    kind: c_int,
    mr_flags: u64,
    mhandle: PP,
) -> NcclResult;
type RegMrSymDmaBuf = unsafe extern "C" fn(
    coll_comm: P,
    data: P,
    size: usize,
    kind: c_int,
    offset: u64,
    fd: c_int,
    mr_flags: u64,
    mhandle: PP,
) -> NcclResult;
type DeregMrSym = unsafe extern "C" fn(coll_comm: P, mhandle: P) -> NcclResult;
type Close = unsafe extern "C" fn(comm: P) -> NcclResult;
/// `iput`, and `iget` with the roles of the offsets swapped (`remoteOff`/`remoteMhandle`,
/// then `localOff`/`localMhandle`): the same C signature.
type TransferV14 = unsafe extern "C" fn(
    rma_ctx: P,
    context: c_int,
    src_off: u64,
    src_mhandle: P,
    size: usize,
    dst_off: u64,
    dst_mhandle: P,
    rank: u32,
    request: PP,
) -> NcclResult;
/// v15 adds `optFlags` ([`RMA_OPT_FLAGS_AGGREGATE_REQUESTS`]) before `request`.
type TransferV15 = unsafe extern "C" fn(
    rma_ctx: P,
    context: c_int,
    src_off: u64,
    src_mhandle: P,
    size: usize,
    dst_off: u64,
    dst_mhandle: P,
    rank: u32,
    opt_flags: u32,
    request: PP,
) -> NcclResult;
/// The put, then the signal word at `signal_off` of the target's `signal_mhandle` changed by
/// `signal_op` ([`NCCL_NET_SIGNAL_OP_INC`], [`NCCL_NET_SIGNAL_OP_ADD`]), never visible before
/// the put's bytes.
type IputSignalV14 = unsafe extern "C" fn(
    rma_ctx: P,
    context: c_int,
    src_off: u64,
    src_mhandle: P,
    size: usize,
    dst_off: u64,
    dst_mhandle: P,
    rank: u32,
    signal_off: u64,
    signal_mhandle: P,
    signal_value: u64,
    signal_op: u32,
    is_strong_signal: bool,
    request: PP,
) -> NcclResult;
type IputSignalV15 = unsafe extern "C" fn(
    rma_ctx: P,
    context: c_int,
    src_off: u64,
    src_mhandle: P,
    size: usize,
    dst_off: u64,
    dst_mhandle: P,
    rank: u32,
    signal_off: u64,
    signal_mhandle: P,
    signal_value: u64,
    signal_op: u32,
    is_strong_signal: bool,
    opt_flags: u32,
    request: PP,
) -> NcclResult;
type Iflush = unsafe extern "C" fn(
    rma_ctx: P,
    context: c_int,
    mhandle: P,
    rank: u32,
    request: PP,
) -> NcclResult;
type Test = unsafe extern "C" fn(coll_comm: P, request: P, done: *mut c_int) -> NcclResult;
type Progress = unsafe extern "C" fn(rma_ctx: P) -> NcclResult;
type QueryLastError = unsafe extern "C" fn(rma_ctx: P, has_error: *mut bool) -> NcclResult;
type Finalize = unsafe extern "C" fn(ctx: P) -> NcclResult;

/// The slots every version has, in slot order, parameterised by what changed: the data calls'
/// signatures (`iput` and `iget` share one), and the slot v16 put between `devices` and
/// `getProperties`. `rmaProgress` and
/// `queryLastError` may be NULL (NCCL calls them only when set).
macro_rules! rma_table {
    ($name:ident, $transfer:ty, $iput_signal:ty $(, $extra:ident : $extra_ty:ty)*) => {
        #[repr(C)]
        #[derive(Debug)]
        pub struct $name {
            pub name: *const c_char,
            pub init: Option<Init>,
            pub devices: Option<Devices>,
            $(pub $extra: Option<$extra_ty>,)*
            pub get_properties: Option<GetProperties>,
            pub listen: Option<Listen>,
            pub connect: Option<Connect>,
            pub create_context: Option<CreateContext>,
            pub reg_mr_sym: Option<RegMrSym>,
            pub reg_mr_sym_dma_buf: Option<RegMrSymDmaBuf>,
            pub dereg_mr_sym: Option<DeregMrSym>,
            pub destroy_context: Option<Close>,
            pub close_coll: Option<Close>,
            pub close_listen: Option<Close>,
            pub iput: Option<$transfer>,
            pub iput_signal: Option<$iput_signal>,
            pub iget: Option<$transfer>,
            pub iflush: Option<Iflush>,
            pub test: Option<Test>,
            pub rma_progress: Option<Progress>,
            pub query_last_error: Option<QueryLastError>,
            pub finalize: Option<Finalize>,
        }

        // SAFETY: the only non-Sync field is `name`, a pointer to a static, immutable C string.
        unsafe impl Sync for $name {}
    };
}

rma_table!(RmaV14, TransferV14, IputSignalV14);
rma_table!(RmaV15, TransferV15, IputSignalV15);
rma_table!(RmaV16, TransferV15, IputSignalV15, get_rma_properties: GetRmaProperties);

// The layouts NCCL compiles against (x86-64, checked with gcc on NVIDIA's `rma_v14.h` and on
// the v15 header; v16 is v15 with one slot more after `devices`).
const _: () = {
    assert!(size_of::<RmaConfigV14>() == 12);
    assert!(offset_of!(RmaConfigV14, rank_stride) == 8);
    assert!(size_of::<RmaPropertiesV16>() == 1);

    assert!(size_of::<RmaV14>() == 168);
    assert!(offset_of!(RmaV14, get_properties) == 24);
    assert!(offset_of!(RmaV14, create_context) == 48);
    assert!(offset_of!(RmaV14, iput) == 104);
    assert!(offset_of!(RmaV14, iput_signal) == 112);
    assert!(offset_of!(RmaV14, iget) == 120);
    assert!(offset_of!(RmaV14, iflush) == 128);
    assert!(offset_of!(RmaV14, test) == 136);
    assert!(offset_of!(RmaV14, rma_progress) == 144);
    assert!(offset_of!(RmaV14, query_last_error) == 152);
    assert!(offset_of!(RmaV14, finalize) == 160);

    assert!(size_of::<RmaV15>() == 168);
    assert!(offset_of!(RmaV15, iput) == 104);
    assert!(offset_of!(RmaV15, finalize) == 160);

    assert!(size_of::<RmaV16>() == 176);
    assert!(offset_of!(RmaV16, get_rma_properties) == 24);
    assert!(offset_of!(RmaV16, get_properties) == 32);
    assert!(offset_of!(RmaV16, iput) == 112);
    assert!(offset_of!(RmaV16, finalize) == 168);
};
