//! Async events: `get_async_event` (blocking, or EAGAIN on a non-blocking `async_fd`),
//! `ack_async_event` and `event_type_str`.

use std::os::raw::{c_char, c_int};
use std::sync::Arc;

use ibverbs_sys::{ibv_async_event, ibv_context, ibv_cq, ibv_event_type, ibv_qp};

use super::conv::{fail, null, set_errno, shield};
use super::objects::ctx_of;
use crate::event::Element;

/// `ibv_get_async_event`: blocks (or EAGAIN with `O_NONBLOCK` on `async_fd`).
pub unsafe extern "C" fn get_async_event(
    context: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    shield(
        "get_async_event",
        || {
            set_errno(libc::EIO);
            -1
        },
        || {
            if context.is_null() || event.is_null() {
                return fail(libc::EINVAL);
            }
            // Clone the context's Arc first: the wait below must not touch the context memory, which
            // close_device may free while this thread sleeps.
            // SAFETY: a live soft context at the time of the call.
            let ctx = Arc::clone(unsafe { ctx_of(context) });
            match ctx.events.next() {
                Ok((kind, element)) => {
                    // SAFETY: the caller's writable ibv_async_event.
                    let ev = unsafe { &mut *event };
                    ev.event_type = kind;
                    match element {
                        Element::Cq(p) => ev.element.cq = p as *mut ibv_cq,
                        Element::Qp(p) => ev.element.qp = p as *mut ibv_qp,
                        Element::Port(n) => ev.element.port_num = c_int::from(n),
                        #[cfg(feature = "fault-injection")]
                        Element::Device => ev.element.port_num = 0,
                    }
                    0
                }
                Err(e) => {
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    -1
                }
            }
        },
    )
}

/// `ibv_ack_async_event`: nothing to release (events about destroyed objects are dropped at
/// destroy time instead).
pub unsafe extern "C" fn ack_async_event(_event: *mut ibv_async_event) {}

/// `ibv_event_type_str`.
pub unsafe extern "C" fn event_type_str(event: ibv_event_type) -> *const c_char {
    shield(
        "event_type_str",
        || null::<c_char>(libc::EIO).cast_const(),
        || {
            use ibv_event_type::*;
            let s: &'static [u8] = match event {
                IBV_EVENT_CQ_ERR => b"CQ error\0",
                IBV_EVENT_QP_FATAL => b"local work queue catastrophic error\0",
                IBV_EVENT_QP_REQ_ERR => b"invalid request local work queue error\0",
                IBV_EVENT_QP_ACCESS_ERR => b"local access violation work queue error\0",
                IBV_EVENT_COMM_EST => b"communication established\0",
                IBV_EVENT_SQ_DRAINED => b"send queue drained\0",
                IBV_EVENT_PATH_MIG => b"path migrated\0",
                IBV_EVENT_PATH_MIG_ERR => b"path migration request error\0",
                IBV_EVENT_DEVICE_FATAL => b"local catastrophic error\0",
                IBV_EVENT_PORT_ACTIVE => b"port active\0",
                IBV_EVENT_PORT_ERR => b"port error\0",
                IBV_EVENT_LID_CHANGE => b"LID change\0",
                IBV_EVENT_PKEY_CHANGE => b"P_Key change\0",
                IBV_EVENT_SM_CHANGE => b"SM change\0",
                IBV_EVENT_SRQ_ERR => b"SRQ catastrophic error\0",
                IBV_EVENT_SRQ_LIMIT_REACHED => b"SRQ limit reached\0",
                IBV_EVENT_QP_LAST_WQE_REACHED => b"last WQE reached\0",
                IBV_EVENT_CLIENT_REREGISTER => b"client reregistration\0",
                IBV_EVENT_GID_CHANGE => b"GID table change\0",
                IBV_EVENT_WQ_FATAL => b"WQ fatal\0",
            };
            s.as_ptr().cast()
        },
    )
}
