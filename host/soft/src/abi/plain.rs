//! C structs built from all-zero bytes: the one place that vouches for `mem::zeroed` of them.
//!
//! A leaf: the entry points fill in replies this way, and `fabric` its `ibv_device`s.

use ibverbs_sys::{
    ibv_context, ibv_cq, ibv_device, ibv_device_attr, ibv_port_attr, ibv_qp, ibv_qp_attr, ibv_wc,
};

/// A C struct for which all-zero bytes are a valid value: integers, arrays, enums whose zero is
/// a variant, NULL-able pointers and fn pointers, unions of those, and glibc pthread mutexes and
/// condition variables (whose all-zero values are `PTHREAD_*_INITIALIZER`).
///
/// # Safety
/// Implemented only for such types: [`zeroed`] then makes a valid value of them.
pub(crate) unsafe trait Plain: Sized {}

// SAFETY: each is a libibverbs struct of the kinds of fields listed on `Plain` (bindgen output).
unsafe impl Plain for ibv_device {}
// SAFETY: as above (its ops are NULL-able fn pointers; a pthread mutex).
unsafe impl Plain for ibv_context {}
// SAFETY: as above (a pthread mutex and condition variable).
unsafe impl Plain for ibv_cq {}
// SAFETY: as above (a pthread mutex and condition variable).
unsafe impl Plain for ibv_qp {}
// SAFETY: as above.
unsafe impl Plain for ibv_qp_attr {}
// SAFETY: as above.
unsafe impl Plain for ibv_device_attr {}
// SAFETY: as above.
unsafe impl Plain for ibv_port_attr {}
// SAFETY: as above (a union of two u32s).
unsafe impl Plain for ibv_wc {}

/// The all-zero value of `T`.
pub(crate) fn zeroed<T: Plain>() -> T {
    // SAFETY: `T: Plain` says all-zero bytes are a valid `T`.
    unsafe { std::mem::zeroed() }
}
