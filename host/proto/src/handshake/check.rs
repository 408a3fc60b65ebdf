//! The rules each side of the handshake applies to its own inputs (the shell's reports) and to
//! the peer's messages, with the error each breach gives.

use ncclwasm_model::validate::check_plan;
use ncclwasm_model::{ConnPlan, Connection, Endpoint};

use super::LocalQp;
use crate::MAX_ENDPOINTS;
use crate::error::ProtoError;
use crate::failover::MAX_FAILOVER_SLICES;
use crate::message::{MAX_24BIT, QpInfo, RemoteWindow};

pub(super) fn local_input(ok: bool, detail: impl FnOnce() -> String) -> Result<(), ProtoError> {
    if ok {
        Ok(())
    } else {
        Err(ProtoError::BadLocalInput { detail: detail() })
    }
}

pub(super) fn peer_info(ok: bool, detail: impl FnOnce() -> String) -> Result<(), ProtoError> {
    if ok {
        Ok(())
    } else {
        Err(ProtoError::BadPeerInfo { detail: detail() })
    }
}

/// Checks a side's own endpoint list at construction: 1..=8 ports of one link layer.
pub(super) fn check_own_endpoints(eps: &[Endpoint]) -> Result<(), ProtoError> {
    local_input(!eps.is_empty() && eps.len() <= MAX_ENDPOINTS, || {
        format!(
            "{} local endpoints; a device has 1..={MAX_ENDPOINTS}",
            eps.len()
        )
    })?;
    local_input(
        eps.iter().all(|e| e.link_layer == eps[0].link_layer),
        || "local endpoints mix link layers".to_owned(),
    )
}

/// A side that can create no QP can follow no plan.
pub(super) fn check_qp_limit(max_qps: u32) -> Result<(), ProtoError> {
    local_input(max_qps >= 1, || {
        "max_qps is 0; no plan could be followed".to_owned()
    })
}

/// The peer's ports must exist and share our link layer, as `ncclIbConnect`/`ncclIbAccept`
/// refuse "incompatible devices".
pub(super) fn check_peer_endpoints(
    local: &[Endpoint],
    peer: &[Endpoint],
) -> Result<(), ProtoError> {
    let incompatible = |detail: String| Err(ProtoError::Incompatible { detail });
    if peer.is_empty() {
        return incompatible("the peer advertised no ports".to_owned());
    }
    let ours = local[0].link_layer;
    match peer.iter().find(|e| e.link_layer != ours) {
        Some(e) => incompatible(format!(
            "peer port {}:{} is {:?} but the local ports are {:?}",
            e.device, e.port, e.link_layer, ours
        )),
        None => Ok(()),
    }
}

/// The plan, checked with the same rules the host applies to a policy's answer
/// (`ncclwasm_model::validate::check_plan`), over the connector's view of the connection.
pub(super) fn check_connection_plan(
    plan: &ConnPlan,
    conn: &Connection,
    max_qps: u32,
) -> Result<(), ProtoError> {
    check_plan(plan, conn, max_qps).map_err(|e| ProtoError::InvalidPlan {
        detail: e.message().to_owned(),
    })
}

/// A connection prepared for failover records each message's slices in one 64-bit word per
/// slot, so its stripe is at most [`MAX_FAILOVER_SLICES`] QPs wide.
pub(super) fn check_failover(plan: &ConnPlan, failover: bool) -> Result<(), ProtoError> {
    if failover && plan.stripe_width as usize > MAX_FAILOVER_SLICES {
        return Err(ProtoError::InvalidPlan {
            detail: format!(
                "a stripe of {} QPs cannot run prepared for failover (at most {MAX_FAILOVER_SLICES})",
                plan.stripe_width
            ),
        });
    }
    Ok(())
}

/// Path MTUs are InfiniBand MTU values.
pub(super) fn valid_mtu(mtu: u32) -> bool {
    mtu.is_power_of_two() && (256..=4096).contains(&mtu)
}

/// A registered window must have an address, room for `bytes` after it (so no offset into it
/// can overflow) and one rkey per endpoint of its owner.
pub(super) fn window_fits(w: &RemoteWindow, bytes: usize, owners: usize) -> bool {
    w.addr != 0 && w.addr.checked_add(bytes as u64).is_some() && w.rkeys.len() == owners
}

/// Checks the QPs the shell created against the plan (count, 24-bit numbers, ECE only when
/// negotiated) — the same rules the peer applies to them.
pub(super) fn check_local_qps(
    qps: &[LocalQp],
    plan: &ConnPlan,
    ece_now: bool,
) -> Result<(), ProtoError> {
    local_input(qps.len() == plan.qps.len(), || {
        format!("{} QPs created for a plan of {}", qps.len(), plan.qps.len())
    })?;
    for (q, l) in qps.iter().enumerate() {
        local_input(l.qpn <= MAX_24BIT && l.psn <= MAX_24BIT, || {
            format!("QP {q}: qpn {:#x} / psn {:#x} exceed 24 bits", l.qpn, l.psn)
        })?;
        local_input(l.ece.is_none() || (ece_now && plan.ece), || {
            format!("QP {q} reports ECE where none is expected")
        })?;
    }
    Ok(())
}

/// Checks the peer's QP infos against the plan: one per QP, each on the endpoint the plan put it
/// on (as `ncclIbQpInfo.devIndex` is used), ECE only when the plan negotiates it.
pub(super) fn check_peer_qps(
    qps: &[QpInfo],
    plan: &ConnPlan,
    peer_is_connector: bool,
) -> Result<(), ProtoError> {
    peer_info(qps.len() == plan.qps.len(), || {
        format!(
            "{} QP infos for a plan of {} QPs",
            qps.len(),
            plan.qps.len()
        )
    })?;
    for (q, (info, p)) in qps.iter().zip(&plan.qps).enumerate() {
        let planned = if peer_is_connector { p.local } else { p.remote };
        peer_info(u32::from(info.endpoint) == planned, || {
            format!(
                "QP {q} sits on peer endpoint {} but the plan says {planned}",
                info.endpoint
            )
        })?;
        peer_info(info.ece.is_none() || plan.ece, || {
            format!("QP {q} carries ECE values but the plan does not negotiate ECE")
        })?;
    }
    Ok(())
}
