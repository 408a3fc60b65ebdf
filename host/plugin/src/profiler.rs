//! NCCL's profiler callback as the transport's [`Profiler`] (`docs/architecture.md`, "NCCL's
//! profiler"): QP events with net_ib's IB-v1 descriptor and plugin id, so NCCL's profilers
//! read them as net_ib's; this plugin's decision events with its own id and descriptor
//! (`ncclwasm_abi::NetWasmDescrV1`).

use std::ffi::{CString, c_void};
use std::sync::Once;

use ncclwasm_abi::*;
use ncclwasm_transport::profile::{DecisionEvent, DecisionKind, Profiler, QpEvent};

/// The callback NCCL handed `init`.
pub(crate) struct NcclProfiler {
    callback: ProfilerFn,
}

impl std::fmt::Debug for NcclProfiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclProfiler")
    }
}

impl NcclProfiler {
    pub(crate) fn new(callback: ProfilerFn) -> NcclProfiler {
        NcclProfiler { callback }
    }

    /// One call; an error of the profiler's is its own (one WARN), never the message's.
    fn call(
        &self,
        handle: &mut *mut c_void,
        kind: i32,
        parent: *mut c_void,
        plugin: i64,
        data: *mut c_void,
    ) {
        // SAFETY: NCCL's callback with the arguments its ABI names: a handle it writes (start)
        // or reads (stop), the parent handle NCCL gave this request, a descriptor that lives
        // for the call.
        let rc = unsafe { (self.callback)(handle, kind, parent, plugin, data) };
        if rc != NCCL_SUCCESS {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "NET/WASM: NCCL's profiler callback returned {rc}; its events may be \
                     incomplete (not said again)"
                )
            });
        }
    }
}

impl Profiler for NcclProfiler {
    fn start_qp(&self, parent: usize, e: &QpEvent) -> usize {
        let mut descr = NetIbQpDescrV1 {
            kind: PROFILE_QP,
            qp: NetIbQp {
                device: e.device,
                wr_id: e.wr_id,
                opcode: e.opcode,
                qp_num: e.qpn as i32,
                length: e.length as usize,
            },
        };
        let mut handle = std::ptr::null_mut();
        self.call(
            &mut handle,
            PROFILER_EVENT_START,
            parent as *mut c_void,
            PROFILER_PLUGIN_IB_V1,
            (&raw mut descr).cast(),
        );
        handle as usize
    }

    fn stop(&self, handle: usize) {
        let mut handle = handle as *mut c_void;
        self.call(
            &mut handle,
            PROFILER_EVENT_STOP,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        );
    }

    fn decision(&self, parent: usize, e: &DecisionEvent<'_>) {
        // Once per connection and failover: a string of its own is no per-message cost.
        let source = CString::new(e.source.replace('\0', " ")).unwrap_or_default();
        let mut descr = NetWasmDescrV1 {
            kind: match e.kind {
                DecisionKind::Plan => 1,
                DecisionKind::FailoverMove => 2,
                DecisionKind::FailBack => 3,
                DecisionKind::Wait => 4,
                DecisionKind::Resume => 5,
            },
            device: e.device as i32,
            comm_id: e.comm_id,
            qps: e.qps,
            moves: e.moves,
            fail_backs: e.fail_backs,
            source: source.as_ptr(),
        };
        let mut handle = std::ptr::null_mut();
        self.call(
            &mut handle,
            PROFILER_EVENT_START,
            parent as *mut c_void,
            PROFILER_PLUGIN_NCCLWASM_V1,
            (&raw mut descr).cast(),
        );
        if !handle.is_null() {
            self.stop(handle as usize);
        }
    }
}
