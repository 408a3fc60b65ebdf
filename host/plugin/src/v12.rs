//! `ncclNetPlugin_v12`: virtual NICs of up to 8 devices, rail and plane ids in the properties.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;
use ncclwasm_transport::NetError;

use crate::comms::{accept, close_listen, close_recv, close_send};
use crate::context::{finalize, init_ctx, set_net_attr};
use crate::edge::{NAME, guard, null_arg};
use crate::memory::{dereg_mr, reg_mr, reg_mr_dma_buf};
use crate::messages::{iflush, test};
use crate::properties::{children, devices, make_vdevice_impl, props, props_v9};
use crate::{v10, v11};

unsafe extern "C" fn init(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut CommConfigC,
    logger: Logger,
    prof: Profiler,
) -> NcclResult {
    init_ctx(ctx, comm_id, config, logger, prof, 8)
}

unsafe extern "C" fn get_properties(dev: c_int, out: *mut PropsV12) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        *out = props_v12(dev)?;
        Ok(())
    })
}

/// Device `dev`'s v12 properties: also what the RMA tables report (`crate::rma`).
pub(crate) fn props_v12(dev: c_int) -> Result<PropsV12, NetError> {
    let p = props(dev)?;
    let v = props_v9(&p);
    let (ndevs, devs) = children::<8>(&p);
    Ok(PropsV12 {
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
        rail_id: p.ids.rail,
        plane_id: p.ids.plane,
    })
}

unsafe extern "C" fn make_vdevice(d: *mut c_int, props: *mut VDevPropsV12) -> NcclResult {
    // SAFETY: NULL or NCCL's struct.
    match unsafe { props.as_ref() } {
        Some(p) => make_vdevice_impl(d, &p.devs[..(p.ndevs.clamp(0, 8) as usize)]),
        None => make_vdevice_impl(d, &[]),
    }
}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v12: NetV12 = NetV12 {
    name: NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(get_properties),
    listen: Some(v11::listen),
    connect: Some(v11::connect),
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
    make_vdevice: Some(make_vdevice),
    finalize: Some(finalize),
    set_net_attr: Some(set_net_attr),
};
