//! `ncclRmaPlugin_v14` (NCCL 2.30): the first one-sided table NCCL looks for in the net plugin's
//! library.

use ncclwasm_abi::*;

use crate::context::finalize;
use crate::properties::devices;
use crate::rma;

#[unsafe(no_mangle)]
pub static ncclRmaPlugin_v14: RmaV14 = RmaV14 {
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
    // v14's shape is the bodies' own.
    iput: Some(rma::iput),
    iput_signal: Some(rma::iput_signal),
    iget: Some(rma::iget),
    iflush: Some(rma::iflush),
    test: Some(rma::test),
    rma_progress: Some(rma::rma_progress),
    query_last_error: Some(rma::query_last_error),
    finalize: Some(finalize),
};
