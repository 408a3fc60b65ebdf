//! Fault injection (feature `fault-injection`): the failures a NIC and its fabric produce, on
//! demand, so error handling is testable without hardware. Each function takes the verbs object
//! the test already holds; [`HOOKS`] wraps them in the C-ABI [`FaultTable`] that [`crate::fabric`]
//! hands the wrapper (behind `Context::inject_*` and `Qp::inject_*`) and the cdylib exports.
//!
//! Port and device faults act on the device (every context of it in this loaded copy sees
//! them), exactly like a cable pull or a firmware crash would.
//!
//! Under `abi/` because every hook starts from a C pointer; the crate re-exports it as
//! `ncclwasm_soft::fault`.

use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ibverbs_sys::{ibv_context, ibv_event_type, ibv_qp};
use ncclwasm_model::PortState;
use ncclwasm_verbs::FaultTable;

pub use super::conv::panic_in_next_verb;
use super::objects::{ctx_of, qp_of};
use crate::event::Element;

/// Takes port `port` of the context's device down: `IBV_EVENT_PORT_ERR` on every context,
/// `query_port` reports DOWN, QPs on the port fail their outstanding work with
/// `IBV_WC_RETRY_EXC_ERR` and go to ERR, and no connection uses the port until it is up again.
/// Returns `false` if the port does not exist or already was down.
///
/// # Safety
/// `context` must be a live soft context.
pub unsafe fn port_down(context: *mut ibv_context, port: u8) -> bool {
    // SAFETY: per the function contract.
    let dev = unsafe { ctx_of(context) }.dev;
    if !dev.set_port_state(port, PortState::Down) {
        return false;
    }
    dev.each_context(|c| {
        c.events
            .push(ibv_event_type::IBV_EVENT_PORT_ERR, Element::Port(port));
        for qp in c.qps() {
            qp.link_lost(Some(port));
        }
    });
    true
}

/// Brings port `port` back: `IBV_EVENT_PORT_ACTIVE` on every context. Returns `false` if the
/// port does not exist or already was active.
///
/// # Safety
/// `context` must be a live soft context.
pub unsafe fn port_up(context: *mut ibv_context, port: u8) -> bool {
    // SAFETY: per the function contract.
    let dev = unsafe { ctx_of(context) }.dev;
    if !dev.set_port_state(port, PortState::Active) {
        return false;
    }
    dev.each_context(|c| {
        c.events
            .push(ibv_event_type::IBV_EVENT_PORT_ACTIVE, Element::Port(port));
    });
    true
}

/// Cuts `qp` off from its peer QP for good, without the orderly goodbye (a crashed peer, a
/// pulled cable): the work either QP has outstanding or posts next fails with
/// `IBV_WC_RETRY_EXC_ERR` and takes that QP to ERR; no asynchronous event, as on RC hardware,
/// where a responder never hears that its requester went away.
///
/// # Safety
/// `qp` must be a live soft QP.
pub unsafe fn cut_connection(qp: *mut ibv_qp) {
    // SAFETY: per the function contract.
    unsafe { qp_of(qp) }.cut();
}

/// Makes `qp`'s responder silent for `duration` from now: requests wait unanswered, so a peer
/// with a short `timeout`/`retry_cnt` sees `IBV_WC_RETRY_EXC_ERR`, and one with a long budget
/// just sees the delay. A later call replaces the time (`Duration::ZERO` ends the stall at
/// once); a stall also ends when the QP fails, is reset or destroyed.
///
/// # Safety
/// `qp` must be a live soft QP.
pub unsafe fn stall(qp: *mut ibv_qp, duration: Duration) {
    // SAFETY: per the function contract.
    unsafe { qp_of(qp) }.stall(duration);
}

/// A catastrophic device error: `IBV_EVENT_DEVICE_FATAL` on every context of the device, every
/// QP to ERR (work flushed), and every later resource verb fails with EIO.
///
/// # Safety
/// `context` must be a live soft context.
pub unsafe fn kill_device(context: *mut ibv_context) {
    // SAFETY: per the function contract.
    let dev = unsafe { ctx_of(context) }.dev;
    dev.dead.store(true, Ordering::Release);
    dev.each_context(|c| {
        c.events
            .push(ibv_event_type::IBV_EVENT_DEVICE_FATAL, Element::Device);
        for qp in c.qps() {
            qp.link_lost(None);
        }
    });
}

/// How many connections this context's listeners refused as strangers (unknown QP, wrong
/// secret, wrong source address, or a second connection for one QP).
///
/// # Safety
/// `context` must be a live soft context.
pub unsafe fn refused_connections(context: *mut ibv_context) -> u64 {
    // SAFETY: per the function contract.
    unsafe { ctx_of(context) }.refused.load(Ordering::Relaxed)
}

/// The functions above with the [`FaultTable`] signatures.
pub const HOOKS: FaultTable = FaultTable {
    port_down: c_port_down,
    port_up: c_port_up,
    cut_connection: c_cut_connection,
    stall: c_stall,
    kill_device: c_kill_device,
    refused_connections: c_refused_connections,
};

unsafe extern "C" fn c_port_down(context: *mut ibv_context, port: u8) -> c_int {
    // SAFETY: the caller passes a live soft context (FaultTable contract).
    c_int::from(unsafe { port_down(context, port) })
}

unsafe extern "C" fn c_port_up(context: *mut ibv_context, port: u8) -> c_int {
    // SAFETY: as above.
    c_int::from(unsafe { port_up(context, port) })
}

unsafe extern "C" fn c_cut_connection(qp: *mut ibv_qp) {
    // SAFETY: the caller passes a live soft QP.
    unsafe { cut_connection(qp) }
}

unsafe extern "C" fn c_stall(qp: *mut ibv_qp, micros: u64) {
    // SAFETY: the caller passes a live soft QP.
    unsafe { stall(qp, Duration::from_micros(micros)) }
}

unsafe extern "C" fn c_kill_device(context: *mut ibv_context) {
    // SAFETY: the caller passes a live soft context.
    unsafe { kill_device(context) }
}

unsafe extern "C" fn c_refused_connections(context: *mut ibv_context) -> u64 {
    // SAFETY: the caller passes a live soft context.
    unsafe { refused_connections(context) }
}
