//! `ncclNetPlugin_v11`: a context per communicator (`init` makes it, `finalize` drops it;
//! `listen` and `connect` take it), `setNetAttr` (kept in the context, `context.rs`),
//! `maxMultiRequestSize` in the properties. Its `listen` and `connect` serve v12 too.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;

use crate::comms::{accept, close_listen, close_recv, close_send, connect_impl, listen_impl};
use crate::context::{config, finalize, init_ctx, set_net_attr};
use crate::edge::{NAME, guard, null_arg};
use crate::memory::{dereg_mr, reg_mr, reg_mr_dma_buf};
use crate::messages::{iflush, test};
use crate::properties::{devices, props, props_v9};
use crate::{v9, v10};

unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    prof: Profiler,
) -> NcclResult {
    init_ctx(ctx, comm_id, config, logger, prof, 4)
}

unsafe extern "C" fn get_properties(dev: c_int, out: *mut PropsV11) -> NcclResult {
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

pub(crate) unsafe extern "C" fn listen(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    lc: *mut *mut c_void,
) -> NcclResult {
    listen_impl(dev, handle, lc, || config(ctx).map(drop))
}

pub(crate) unsafe extern "C" fn connect(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    sc: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    connect_impl(dev, handle, sc, || config(ctx))
}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
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
    isend: Some(v10::isend),
    irecv: Some(v10::irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: Some(v9::make_vdevice),
    finalize: Some(finalize),
    set_net_attr: Some(set_net_attr),
};
