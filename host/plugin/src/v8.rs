//! `ncclNetPlugin_v8`: its table and the shims its signatures need — `int` sizes in
//! `isend`/`irecv`, no virtual NICs, no contexts. `listen` keeps this shape up to v10 and
//! `connect` up to v9, which take them from here.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;
use ncclwasm_transport::{CommConfig, MAX_RECVS};

use crate::comms::{accept, close_listen, close_recv, close_send, connect_impl, listen_impl};
use crate::context::init_net;
use crate::edge::{NAME, guard, null_arg};
use crate::memory::{dereg_mr, reg_mr, reg_mr_dma_buf};
use crate::messages::{RecvArrays, Sizes, iflush, irecv_impl, isend_impl, test};
use crate::properties::{common, devices, props};

unsafe extern "C" fn init(logger: Logger) -> NcclResult {
    guard("init", || init_net(logger, None, 1, false))
}

unsafe extern "C" fn get_properties(dev: c_int, out: *mut PropsV8) -> NcclResult {
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

pub(crate) unsafe extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    lc: *mut *mut c_void,
) -> NcclResult {
    listen_impl(dev, handle, lc, || Ok(()))
}

pub(crate) unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    connect_impl(dev, handle, sc, || Ok(CommConfig::default()))
}

unsafe extern "C" fn isend(
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
        std::ptr::null_mut(),
        req,
    )
}

unsafe extern "C" fn irecv(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    let arrays = RecvArrays {
        data,
        sizes: Sizes::Int(sizes),
        tags,
        mhandles: mh,
        phandles: std::ptr::null_mut(),
    };
    irecv_impl(comm, n, arrays, req)
}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(get_properties),
    listen: Some(listen),
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
};
