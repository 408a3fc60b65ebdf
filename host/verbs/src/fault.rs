//! Fault injection into the `soft` provider through the wrapper, for both ways of loading it:
//! in process (`Fabric::soft`) and as the `soft-ibverbs` cdylib behind the `ib` table, which
//! exports these hooks as C functions named in [`SYMBOLS`]. Real libibverbs has none of them, so
//! on a NIC the inject calls answer [`VerbsError::Unsupported`].

use std::os::raw::{c_char, c_int};
use std::path::PathBuf;
use std::time::Duration;

use rdma_sys::{ibv_context, ibv_qp};

use crate::device::Context;
use crate::error::{Result, VerbsError};
use crate::qp::Qp;

/// The hooks a fault-capable library provides (C ABI so the cdylib can export them).
#[derive(Clone, Copy, Debug)]
pub struct FaultTable {
    /// Port down: `IBV_EVENT_PORT_ERR`, QPs on the port to ERR; 1 if the state changed.
    pub port_down: unsafe extern "C" fn(context: *mut ibv_context, port: u8) -> c_int,
    /// Port up again: `IBV_EVENT_PORT_ACTIVE`; 1 if the state changed.
    pub port_up: unsafe extern "C" fn(context: *mut ibv_context, port: u8) -> c_int,
    /// Breaks the QP's TCP connections without a goodbye.
    pub cut_connection: unsafe extern "C" fn(qp: *mut ibv_qp),
    /// Makes the QP's responder silent for `micros` µs.
    pub stall: unsafe extern "C" fn(qp: *mut ibv_qp, micros: u64),
    /// Device fatal: `IBV_EVENT_DEVICE_FATAL`, every QP to ERR, later verbs fail (for good).
    pub kill_device: unsafe extern "C" fn(context: *mut ibv_context),
    /// Connections the context's listeners refused as strangers.
    pub refused_connections: unsafe extern "C" fn(context: *mut ibv_context) -> u64,
    /// Writes the provider's sysfs root (NUL-terminated) into `buf`; returns its length, or -1
    /// when it does not fit or cannot be built.
    pub sysfs_root: unsafe extern "C" fn(buf: *mut c_char, len: usize) -> isize,
}

/// Exported names of the [`FaultTable`] hooks, in field order.
pub const SYMBOLS: [&str; 7] = [
    "ncclwasm_soft_port_down",
    "ncclwasm_soft_port_up",
    "ncclwasm_soft_cut_connection",
    "ncclwasm_soft_stall",
    "ncclwasm_soft_kill_device",
    "ncclwasm_soft_refused_connections",
    "ncclwasm_soft_sysfs_root",
];

/// The in-process soft provider's hooks.
pub static SOFT: FaultTable = FaultTable {
    port_down: soft_port_down,
    port_up: soft_port_up,
    cut_connection: soft_cut_connection,
    stall: soft_stall,
    kill_device: soft_kill_device,
    refused_connections: soft_refused_connections,
    sysfs_root: soft_sysfs_root,
};

unsafe extern "C" fn soft_port_down(context: *mut ibv_context, port: u8) -> c_int {
    // SAFETY: the caller passes a live soft context (FaultTable contract).
    c_int::from(unsafe { crate::soft::fault::port_down(context, port) })
}

unsafe extern "C" fn soft_port_up(context: *mut ibv_context, port: u8) -> c_int {
    // SAFETY: as above.
    c_int::from(unsafe { crate::soft::fault::port_up(context, port) })
}

unsafe extern "C" fn soft_cut_connection(qp: *mut ibv_qp) {
    // SAFETY: the caller passes a live soft QP.
    unsafe { crate::soft::fault::cut_connection(qp) }
}

unsafe extern "C" fn soft_stall(qp: *mut ibv_qp, micros: u64) {
    // SAFETY: the caller passes a live soft QP.
    unsafe { crate::soft::fault::stall(qp, Duration::from_micros(micros)) }
}

unsafe extern "C" fn soft_kill_device(context: *mut ibv_context) {
    // SAFETY: the caller passes a live soft context.
    unsafe { crate::soft::fault::kill_device(context) }
}

unsafe extern "C" fn soft_refused_connections(context: *mut ibv_context) -> u64 {
    // SAFETY: the caller passes a live soft context.
    unsafe { crate::soft::fault::refused_connections(context) }
}

unsafe extern "C" fn soft_sysfs_root(buf: *mut c_char, len: usize) -> isize {
    let Ok(root) = crate::soft::sysfs_root() else {
        return -1;
    };
    let bytes = root.as_os_str().as_encoded_bytes();
    if bytes.len() >= len || buf.is_null() {
        return -1;
    }
    // SAFETY: `buf` has room for `len` > bytes.len() bytes (caller contract).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    bytes.len() as isize
}

/// The root a fault-capable library reports for its sysfs tree.
pub(crate) fn library_sysfs_root(t: &FaultTable) -> Option<PathBuf> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` has the length we pass.
    let n = unsafe { (t.sysfs_root)(buf.as_mut_ptr().cast(), buf.len()) };
    let n = usize::try_from(n).ok()?;
    buf.truncate(n);
    Some(PathBuf::from(String::from_utf8(buf).ok()?))
}

impl Context {
    fn faults(&self) -> Result<&FaultTable> {
        self.fabric()
            .faults
            .as_ref()
            .ok_or(VerbsError::Unsupported {
                verb: "(fault injection)",
                fabric: self.fabric().name(),
            })
    }

    /// Takes `port` down as a cable pull would; `Ok(false)` if it already was down.
    pub fn inject_port_down(&self, port: u8) -> Result<bool> {
        let f = self.faults()?.port_down;
        // SAFETY: our live context, of the library the hooks came from.
        Ok(unsafe { f(self.ctx.as_ptr(), port) } != 0)
    }

    /// Brings `port` back up; `Ok(false)` if it already was up.
    pub fn inject_port_up(&self, port: u8) -> Result<bool> {
        let f = self.faults()?.port_up;
        // SAFETY: as above.
        Ok(unsafe { f(self.ctx.as_ptr(), port) } != 0)
    }

    /// A catastrophic device error (`IBV_EVENT_DEVICE_FATAL`); the device stays dead for the
    /// rest of the process, so tests do this in a child process.
    pub fn inject_device_fatal(&self) -> Result<()> {
        let f = self.faults()?.kill_device;
        // SAFETY: as above.
        unsafe { f(self.ctx.as_ptr()) };
        Ok(())
    }

    /// Connections this context refused as strangers (wrong secret, unknown QP, …).
    pub fn refused_connections(&self) -> Result<u64> {
        let f = self.faults()?.refused_connections;
        // SAFETY: as above.
        Ok(unsafe { f(self.ctx.as_ptr()) })
    }
}

impl Qp {
    /// Breaks this QP's connections without a goodbye (peer crash, cable cut).
    pub fn inject_cut(&self) -> Result<()> {
        let f = self.pd().context().faults()?.cut_connection;
        // SAFETY: our live QP, of the library the hooks came from.
        unsafe { f(self.as_ptr()) };
        Ok(())
    }

    /// Makes this QP's responder silent for `d` (a stalled peer).
    pub fn inject_stall(&self, d: Duration) -> Result<()> {
        let f = self.pd().context().faults()?.stall;
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        // SAFETY: as above.
        unsafe { f(self.as_ptr(), micros) };
        Ok(())
    }
}
