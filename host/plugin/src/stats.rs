//! `ncclwasm_send_comm_stats`, the extension export next to the tables: what a send
//! communicator runs and has sent, for tools that drive the library themselves.

use std::ffi::c_void;

use ncclwasm_abi::*;
use ncclwasm_transport::{MAX_ENDPOINTS, MAX_QPS, NetError};

use crate::comms::on_send;
use crate::edge::{guard, null_arg};

// Every connection fits the stats struct whole.
const _: () = assert!(MAX_QPS <= STATS_MAX_QPS && MAX_ENDPOINTS <= STATS_MAX_ENDPOINTS);

/// `ncclwasm_send_comm_stats` (layout and contract in `ncclwasm_abi::stats`): the plan a send
/// communicator runs, who made it and why, and the payload bytes posted on each of its QPs. NCCL
/// never calls it; `ncclwasm bench` does, to show what the connection did rather than what it
/// should have done.
///
/// # Safety
/// `out` is NULL or a struct whose first field, `version`, names its layout.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclwasm_send_comm_stats(
    send_comm: *mut c_void,
    out: *mut SendStatsV2,
) -> NcclResult {
    guard("ncclwasm_send_comm_stats", || {
        // SAFETY: NULL or the caller's struct, whose first field is its `u32` version in every
        // layout; nothing else is touched before the version says which layout it is.
        let version = *unsafe { out.cast::<u32>().as_ref() }.ok_or_else(|| null_arg("out"))?;
        if version != SEND_STATS_VERSION {
            return Err(NetError::Usage(format!(
                "stats layout version {version}; this plugin writes version {SEND_STATS_VERSION}"
            )));
        }
        // SAFETY: the version says `out` is a `SendStatsV2`, and the caller owns it.
        let out = unsafe { &mut *out };
        *out = SendStatsV2::empty();
        // The stats borrow the comm, so they are copied out while the handle is held.
        on_send(send_comm, |s, _, _| {
            let st = s.stats();
            out.fill(st.source, st.plan, st.local, st.peer, &st.posted)
                .map_err(|e| NetError::Internal(e.to_string()))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_refuse_what_is_not_a_send_comm_or_not_their_layout() {
        let mut out = SendStatsV2::empty();
        out.nqps = 7;
        // SAFETY: a NULL communicator is refused before anything is read through it.
        let rc = unsafe { ncclwasm_send_comm_stats(std::ptr::null_mut(), &mut out) };
        assert_eq!(
            (rc, out.nqps),
            (NCCL_INVALID_ARGUMENT, 0),
            "cleared on error too"
        );

        let mut junk = [0u8; 16];
        out.nqps = 7;
        // SAFETY: a handle is a key, never dereferenced: this one names no communicator.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INVALID_USAGE, 0));

        out.version = SEND_STATS_VERSION + 1;
        out.nqps = 7;
        // SAFETY: a layout of another version is refused before anything but its version is
        // read or written.
        let rc = unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), &mut out) };
        assert_eq!((rc, out.nqps), (NCCL_INVALID_USAGE, 7), "not written");

        // SAFETY: a NULL struct is refused.
        let rc =
            unsafe { ncclwasm_send_comm_stats(junk.as_mut_ptr().cast(), std::ptr::null_mut()) };
        assert_eq!(rc, NCCL_INVALID_ARGUMENT);
    }
}
