//! The verbs objects: what `ibv_open_device`, `ibv_alloc_pd`, `ibv_reg_mr`, `ibv_create_cq`,
//! `ibv_create_qp` and `ibv_create_comp_channel` return. Providers embed these at the start of
//! their own objects, so the layouts are ABI, and `ibv_context::ops` is how the inline fast-path
//! calls (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`) reach the provider.

use core::ffi::{c_char, c_int, c_uint, c_void};

use crate::enums::{
    IBV_SYSFS_NAME_MAX, IBV_SYSFS_PATH_MAX, ibv_node_type, ibv_qp_state, ibv_qp_type,
    ibv_transport_type,
};
use crate::work::{ibv_recv_wr, ibv_send_wr, ibv_wc};
use crate::{_compat_ibv_port_attr, ibv_device_attr};

/// Declares types that only ever travel behind pointers: unsized-in-spirit, never built in Rust.
macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            #[repr(C)]
            #[derive(Debug)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque! {
    /// Shared receive queue (unused; a pointer in `ibv_qp` and `ibv_qp_init_attr`).
    ibv_srq,
    /// Address handle (unused; a pointer in the UD part of `ibv_send_wr`).
    ibv_ah,
    /// Memory window (unused; pointers in `ibv_send_wr` and `ibv_context_ops`).
    ibv_mw,
    /// Memory-window bind request (unused; a pointer in `ibv_context_ops::bind_mw`).
    ibv_mw_bind,
    /// Work queue (unused; a pointer in `ibv_async_event`).
    ibv_wq,
}

/// glibc's `pthread_mutex_t` inside `ibv_context`, `ibv_cq` and `ibv_qp`: only its size and
/// alignment matter here (the provider owns it), and those differ by architecture.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct pthread_mutex_opaque {
    #[cfg(target_arch = "aarch64")]
    _bytes: [u64; 6],
    #[cfg(not(target_arch = "aarch64"))]
    _bytes: [u64; 5],
}

/// glibc's `pthread_cond_t` inside `ibv_cq` and `ibv_qp` (48 bytes on every 64-bit target).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct pthread_cond_opaque {
    _bytes: [u64; 6],
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
compile_error!("the pthread sizes above are glibc's on 64-bit Linux; other targets are unchecked");

/// An obsolete slot at the start of `ibv_device` that libibverbs keeps for ABI compatibility.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct _ibv_device_ops {
    pub _dummy1: Option<unsafe extern "C" fn(*mut ibv_device, c_int) -> *mut ibv_context>,
    pub _dummy2: Option<unsafe extern "C" fn(*mut ibv_context)>,
}

/// One entry of `ibv_get_device_list`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: ibv_node_type::Type,
    pub transport_type: ibv_transport_type::Type,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

/// A retired entry point kept as a placeholder so the live slots stay at their offsets.
pub type compat_fn = Option<unsafe extern "C" fn() -> *mut c_void>;

/// The provider's function table inside `ibv_context`. libibverbs' inline `ibv_post_send`,
/// `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` call through these slots.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_context_ops {
    pub _compat_query_device:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int>,
    pub _compat_query_port:
        Option<unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int>,
    pub _compat_alloc_pd: compat_fn,
    pub _compat_dealloc_pd: compat_fn,
    pub _compat_reg_mr: compat_fn,
    pub _compat_rereg_mr: compat_fn,
    pub _compat_dereg_mr: compat_fn,
    /// The second argument is C's `enum ibv_mw_type`.
    pub alloc_mw: Option<unsafe extern "C" fn(*mut ibv_pd, c_uint) -> *mut ibv_mw>,
    pub bind_mw: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_mw, *mut ibv_mw_bind) -> c_int>,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut ibv_mw) -> c_int>,
    pub _compat_create_cq: compat_fn,
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub _compat_cq_event: compat_fn,
    pub _compat_resize_cq: compat_fn,
    pub _compat_destroy_cq: compat_fn,
    pub _compat_create_srq: compat_fn,
    pub _compat_modify_srq: compat_fn,
    pub _compat_query_srq: compat_fn,
    pub _compat_destroy_srq: compat_fn,
    pub post_srq_recv: Option<
        unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int,
    >,
    pub _compat_create_qp: compat_fn,
    pub _compat_query_qp: compat_fn,
    pub _compat_modify_qp: compat_fn,
    pub _compat_destroy_qp: compat_fn,
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat_create_ah: compat_fn,
    pub _compat_destroy_ah: compat_fn,
    pub _compat_attach_mcast: compat_fn,
    pub _compat_detach_mcast: compat_fn,
    pub _compat_async_event: compat_fn,
}

/// An open device.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_opaque,
    pub abi_compat: *mut c_void,
}

/// A protection domain.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// A registered memory region.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// A completion event channel.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// A completion queue.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_opaque,
    pub cond: pthread_cond_opaque,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// A queue pair.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: ibv_qp_state::Type,
    pub qp_type: ibv_qp_type::Type,
    pub mutex: pthread_mutex_opaque,
    pub cond: pthread_cond_opaque,
    pub events_completed: u32,
}
