//! `ncclNetPlugin_v10`: a profiler callback at `init`, the communicator's config (traffic
//! class) at `connect`, profiler handles in `isend`/`irecv` (the parents of the requests' QP
//! events, `crate::profiler`). Its `isend` and `irecv` serve v11 and v12 too.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;
use ncclwasm_transport::CommConfig;

use crate::comms::{accept, close_listen, close_recv, close_send, connect_impl};
use crate::context::init_net;
use crate::edge::{NAME, guard};
use crate::memory::{dereg_mr, reg_mr, reg_mr_dma_buf};
use crate::messages::{RecvArrays, Sizes, iflush, irecv_impl, isend_impl, test};
use crate::properties::devices;
use crate::{v8, v9};

unsafe extern "C" fn init(logger: Logger, prof: Profiler) -> NcclResult {
    guard("init", || init_net(logger, prof, 4, false))
}

unsafe extern "C" fn connect(
    dev: c_int,
    config: *mut CommConfigC,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NULL or NCCL's config struct.
    let tc = unsafe { config.as_ref() }.map_or(-1, |c| c.traffic_class);
    connect_impl(dev, handle, sc, || {
        Ok(CommConfig {
            comm_id: 0,
            traffic_class: tc,
            net_attr: None,
            one_sided: None,
        })
    })
}

pub(crate) unsafe extern "C" fn isend(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    phandle: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    isend_impl(comm, data, size, tag, mh, phandle, req)
}

pub(crate) unsafe extern "C" fn irecv(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    phandles: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    let arrays = RecvArrays {
        data,
        sizes: Sizes::Size(sizes),
        tags,
        mhandles: mh,
        phandles,
    };
    irecv_impl(comm, n, arrays, req)
}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(v9::get_properties),
    listen: Some(v8::listen),
    connect: Some(connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: Some(reg_mr_dma_buf),
    dereg_mr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(v9::make_vdevice),
};
