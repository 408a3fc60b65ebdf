//! `ncclRmaPlugin_v16` (NCCL 2.32.3): v15 plus `getRmaProperties` after `devices`.

use ncclwasm_abi::*;

use crate::context::finalize;
use crate::properties::devices;
use crate::{rma, rma_v15};

#[unsafe(no_mangle)]
pub static ncclRmaPlugin_v16: RmaV16 = RmaV16 {
    name: crate::edge::NAME.as_ptr(),
    init: Some(rma::init),
    devices: Some(devices),
    get_rma_properties: Some(rma::get_rma_properties),
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
    iput: Some(rma_v15::iput),
    iput_signal: Some(rma_v15::iput_signal),
    iget: Some(rma_v15::iget),
    iflush: Some(rma::iflush),
    test: Some(rma::test),
    rma_progress: Some(rma::rma_progress),
    query_last_error: Some(rma::query_last_error),
    finalize: Some(finalize),
};
