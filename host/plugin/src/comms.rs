//! Communicators as NCCL holds them: listeners, send and receive comms behind generation-checked
//! handles, and the entry points that make and close them (`listen`, `connect`, `accept`,
//! `close*`); the version shims in `v8` … `v12` adapt their signatures.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use ncclwasm_abi::*;
use ncclwasm_transport::{
    CommConfig, HANDLE_SIZE, Listener, MemHandle, NetError, RecvComm, SendComm,
};

use crate::context::net;
use crate::edge::{as_handle, guard, key, not_a, null_arg};
use crate::handles::{Handles, Requests};

/// What a communicator handle names.
#[expect(
    clippy::large_enum_variant,
    reason = "a communicator is about 2 KiB (its per-request tables are boxed), one per \
              connection; boxing it would add an indirection to every call"
)]
pub(crate) enum Endpoint {
    Send {
        comm: SendComm,
        requests: Requests,
    },
    Recv {
        comm: RecvComm,
        requests: Requests,
    },
    /// `accept` needs the listener exclusively; NCCL's service thread is its only user.
    Listen(Mutex<Listener>),
}

pub(crate) static COMMS: Handles<Endpoint> = Handles::new("communicator");
pub(crate) static MRS: Handles<MemHandle> = Handles::new("memory registration");

/// Runs `f` on the send communicator `comm` and its request counters: for the per-message
/// calls and others as brief, which never touch the tables ([`Handles::with_brief`]).
pub(crate) fn on_send<R>(
    comm: *mut c_void,
    f: impl FnOnce(&SendComm, &Requests, u64) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "sendComm")?;
    COMMS.with_brief(k, |e| match e {
        Endpoint::Send { comm, requests } => f(comm, requests, k),
        _ => Err(not_a(k, "send communicator")),
    })
}

/// Runs `f` on the receive communicator `comm` and its request counters (brief, as
/// [`on_send`]).
pub(crate) fn on_recv<R>(
    comm: *mut c_void,
    f: impl FnOnce(&RecvComm, &Requests, u64) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "recvComm")?;
    COMMS.with_brief(k, |e| match e {
        Endpoint::Recv { comm, requests } => f(comm, requests, k),
        _ => Err(not_a(k, "receive communicator")),
    })
}

/// Runs `f` on the send or receive communicator `comm` (`regMr` does not say which).
pub(crate) fn on_comm<R>(
    comm: *mut c_void,
    f: impl FnOnce(&Endpoint) -> Result<R, NetError>,
) -> Result<R, NetError> {
    let k = key(comm, "comm")?;
    COMMS.with(k, |e| match e {
        Endpoint::Listen(_) => Err(not_a(k, "send or receive communicator")),
        e => f(e),
    })
}

/// `listen`; `ctx` checks the caller's context (v11+; nothing before).
pub(crate) fn listen_impl(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
    ctx: impl FnOnce() -> Result<(), NetError>,
) -> NcclResult {
    guard("listen", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { listen_comm.as_mut() }.ok_or_else(|| null_arg("listenComm"))?;
        *out = std::ptr::null_mut();
        ctx()?;
        if handle.is_null() {
            return Err(null_arg("handle"));
        }
        let (listener, bytes) = net()?.listen(i64::from(dev))?;
        let k = COMMS.insert(Endpoint::Listen(Mutex::new(listener)))?;
        // SAFETY: NCCL's handle buffer is NCCL_NET_HANDLE_MAXSIZE (128) bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), handle.cast(), HANDLE_SIZE) };
        *out = as_handle(k);
        Ok(())
    })
}

/// `connect`; `devComm` arguments are opaque (RCCL passes foreign structs there) and untouched.
/// `comm` says what the connection is planned with (v11+: the caller's context, checked).
pub(crate) fn connect_impl(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    comm: impl FnOnce() -> Result<CommConfig, NetError>,
) -> NcclResult {
    guard("connect", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { send_comm.as_mut() }.ok_or_else(|| null_arg("sendComm"))?;
        *out = std::ptr::null_mut();
        let comm = comm()?;
        // SAFETY: NCCL's handle buffer is 128 bytes, the same buffer on every call.
        let handle = unsafe { handle.cast::<[u8; HANDLE_SIZE]>().as_mut() }
            .ok_or_else(|| null_arg("handle"))?;
        if let Some(comm) = net()?.connect(i64::from(dev), handle, comm)? {
            let requests = Requests::new();
            *out = as_handle(COMMS.insert(Endpoint::Send { comm, requests })?);
        }
        Ok(())
    })
}

pub(crate) unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dc: *mut *mut c_void,
) -> NcclResult {
    guard("accept", || {
        // SAFETY: NCCL passes a valid out-pointer.
        let out = unsafe { recv_comm.as_mut() }.ok_or_else(|| null_arg("recvComm"))?;
        *out = std::ptr::null_mut();
        let k = key(listen_comm, "listenComm")?;
        let accepted = COMMS.with(k, |e| match e {
            Endpoint::Listen(l) => l
                .lock()
                .map_err(|_| NetError::Internal("a listener's lock is poisoned".into()))?
                .accept(),
            _ => Err(not_a(k, "listener")),
        })?;
        if let Some(comm) = accepted {
            let requests = Requests::new();
            *out = as_handle(COMMS.insert(Endpoint::Recv { comm, requests })?);
        }
        Ok(())
    })
}

/// Closes a communicator of the kind `is_kind` accepts; NULL is tolerated, a handle closed
/// already (or of another kind) is refused.
fn close(comm: *mut c_void, kind: &str, is_kind: fn(&Endpoint) -> bool) -> Result<(), NetError> {
    if comm.is_null() {
        return Ok(());
    }
    let k = comm as usize as u64;
    COMMS.remove(k, is_kind).map_err(|e| {
        if matches!(e, NetError::Argument(_)) {
            not_a(k, kind)
        } else {
            e
        }
    })
}

pub(crate) unsafe extern "C" fn close_send(comm: *mut c_void) -> NcclResult {
    guard("closeSend", || {
        close(comm, "send communicator", |e| {
            matches!(e, Endpoint::Send { .. })
        })
    })
}

pub(crate) unsafe extern "C" fn close_recv(comm: *mut c_void) -> NcclResult {
    guard("closeRecv", || {
        close(comm, "receive communicator", |e| {
            matches!(e, Endpoint::Recv { .. })
        })
    })
}

pub(crate) unsafe extern "C" fn close_listen(comm: *mut c_void) -> NcclResult {
    guard("closeListen", || {
        close(comm, "listener", |e| matches!(e, Endpoint::Listen(_)))
    })
}
