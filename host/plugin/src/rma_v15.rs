//! `ncclRmaPlugin_v15` (aws-ofi-nccl's header, NCCL 2.32): `iput`, `iputSignal` and `iget` gain
//! `optFlags`, a hint that may aggregate requests and must not change what they do; every
//! request is posted at once here, so it changes nothing.

use std::ffi::{c_int, c_void};

use ncclwasm_abi::*;

use crate::context::finalize;
use crate::properties::devices;
use crate::rma;

pub(crate) unsafe extern "C" fn iput(
    rma_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src: *mut c_void,
    size: usize,
    dst_off: u64,
    dst: *mut c_void,
    rank: u32,
    _opt_flags: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, as it passes them to v14's entry point.
    unsafe {
        rma::iput(
            rma_ctx, context, src_off, src, size, dst_off, dst, rank, request,
        )
    }
}

pub(crate) unsafe extern "C" fn iput_signal(
    rma_ctx: *mut c_void,
    context: c_int,
    src_off: u64,
    src: *mut c_void,
    size: usize,
    dst_off: u64,
    dst: *mut c_void,
    rank: u32,
    signal_off: u64,
    signal: *mut c_void,
    value: u64,
    op: u32,
    strong: bool,
    _opt_flags: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, as it passes them to v14's entry point.
    unsafe {
        rma::iput_signal(
            rma_ctx, context, src_off, src, size, dst_off, dst, rank, signal_off, signal, value,
            op, strong, request,
        )
    }
}

pub(crate) unsafe extern "C" fn iget(
    rma_ctx: *mut c_void,
    context: c_int,
    remote_off: u64,
    remote: *mut c_void,
    size: usize,
    local_off: u64,
    local: *mut c_void,
    rank: u32,
    _opt_flags: u32,
    request: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, as it passes them to v14's entry point.
    unsafe {
        rma::iget(
            rma_ctx, context, remote_off, remote, size, local_off, local, rank, request,
        )
    }
}

#[unsafe(no_mangle)]
pub static ncclRmaPlugin_v15: RmaV15 = RmaV15 {
    name: crate::edge::NAME.as_ptr(),
    init: Some(rma::init),
    devices: Some(devices),
    get_properties: Some(rma::get_properties),
    listen: Some(rma::listen),
    connect: Some(rma::connect),
    create_context: Some(rma::create_context),
    reg_mr_sym: Some(rma::reg_mr_sym),
    reg_mr_sym_dma_buf: Some(rma::reg_mr_sym_dma_buf),
    dereg_mr_sym: Some(rma::dereg_mr_sym),
    destroy_context: Some(rma::destroy_context),
    close_coll: Some(rma::close_coll),
    close_listen: Some(crate::comms::close_listen),
    iput: Some(iput),
    iput_signal: Some(iput_signal),
    iget: Some(iget),
    iflush: Some(rma::iflush),
    test: Some(rma::test),
    rma_progress: Some(rma::rma_progress),
    query_last_error: Some(rma::query_last_error),
    finalize: Some(finalize),
};
