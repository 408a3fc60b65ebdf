//! The fault-injection extension (feature `fault-injection`): the failures a NIC and its fabric
//! produce, on demand, so error handling is testable without hardware.
//!
//! An extension on top of the objects: it adds `inject_*` methods to [`Context`] and [`Qp`] that
//! call the provider's [`FaultTable`] — handed over in process ([`crate::Provider::with_faults`])
//! or exported by a loaded library (`FAULT_SYMBOLS`, see [`crate::table`]). A provider without
//! hooks (real libibverbs) answers [`VerbsError::Unsupported`].

use std::time::Duration;

use crate::device::Context;
use crate::error::{Result, VerbsError};
use crate::qp::Qp;
use crate::table::FaultTable;

impl Context {
    fn faults(&self) -> Result<&FaultTable> {
        let fabric = self.fabric();
        fabric
            .provider
            .faults
            .as_ref()
            .ok_or(VerbsError::Unsupported {
                verb: "(fault injection)",
                fabric: fabric.name(),
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

    /// Makes this QP's responder silent for `d` from now (a stalled peer); a later call
    /// replaces the time, so `Duration::ZERO` ends a stall.
    pub fn inject_stall(&self, d: Duration) -> Result<()> {
        let f = self.pd().context().faults()?.stall;
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        // SAFETY: as above.
        unsafe { f(self.as_ptr(), micros) };
        Ok(())
    }
}
