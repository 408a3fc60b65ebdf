//! `ncclNetPlugin_v9`: `size_t` sizes, virtual NICs of up to 4 devices (`makeVDevice`),
//! `forceFlush` and the byte limits in the properties. Its `getProperties` serves v10 too (the
//! same struct), its `makeVDevice` v10 and v11.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;

use crate::comms::{accept, close_listen, close_recv, close_send};
use crate::context::init_net;
use crate::edge::{NAME, guard, null_arg};
use crate::memory::{dereg_mr, reg_mr, reg_mr_dma_buf};
use crate::messages::{RecvArrays, Sizes, iflush, irecv_impl, isend_impl, test};
use crate::properties::{devices, make_vdevice_impl, props, props_v9};
use crate::v8;

unsafe extern "C" fn init(logger: Logger) -> NcclResult {
    guard("init", || init_net(logger, None, 4, false))
}

pub(crate) unsafe extern "C" fn get_properties(dev: c_int, out: *mut PropsV9) -> NcclResult {
    guard("getProperties", || {
        // SAFETY: NCCL passes a valid properties struct.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null_arg("props"))?;
        *out = props_v9(&props(dev)?);
        Ok(())
    })
}

unsafe extern "C" fn isend(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    isend_impl(comm, data, size, tag, mh, std::ptr::null_mut(), req)
}

unsafe extern "C" fn irecv(
    comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    let arrays = RecvArrays {
        data,
        sizes: Sizes::Size(sizes),
        tags,
        mhandles: mh,
        phandles: std::ptr::null_mut(),
    };
    irecv_impl(comm, n, arrays, req)
}

pub(crate) unsafe extern "C" fn make_vdevice(d: *mut c_int, props: *mut VDevPropsV9) -> NcclResult {
    // SAFETY: NULL or NCCL's struct.
    match unsafe { props.as_ref() } {
        Some(p) => make_vdevice_impl(d, &p.devs[..(p.ndevs.clamp(0, 4) as usize)]),
        None => make_vdevice_impl(d, &[]),
    }
}

#[unsafe(no_mangle)]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: NAME.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    get_properties: Some(get_properties),
    listen: Some(v8::listen),
    connect: Some(v8::connect),
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
    make_vdevice: Some(make_vdevice),
};
