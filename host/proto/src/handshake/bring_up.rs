//! Where each QP of a connection runs and what brings it to RTS: in the handshake, from the
//! peer's QP infos joined with the plan's routes, and when a failed QP rejoins an established
//! connection.

use ncclwasm_model::{ConnPlan, Endpoint};

use crate::error::ProtoError;
use crate::message::{Ece, QpInfo, Rejoin};

/// Where one QP of a connection runs, from this side's point of view: indices into this side's
/// and the peer's endpoint lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpRoute {
    pub local: usize,
    pub remote: usize,
}

/// Everything needed to move one QP to RTR and RTS (`ncclIbRtrQp` + `ncclIbRtsQp`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpBringUp {
    /// Position of the QP in the plan (and in the `qps_created` report).
    pub qp: usize,
    pub route: QpRoute,
    /// The remote port: link layer, LID, GID and port number build the address vector.
    pub remote: Endpoint,
    pub remote_qpn: u32,
    /// Expected first PSN of the peer (`rq_psn`).
    pub remote_psn: u32,
    /// The secret the peer's QP expects from us (on a provider that requires ECE: handed to
    /// `set_ece` before RTR as the ECE `options`).
    pub remote_secret: u32,
    /// Path MTU in bytes (256 … 4096).
    pub mtu: u32,
    /// ECE values to set on the QP before RTR, when negotiated.
    pub ece: Option<Ece>,
    pub traffic_class: u8,
    pub service_level: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
}

pub(super) fn routes(plan: &ConnPlan, connector: bool) -> Vec<QpRoute> {
    plan.qps
        .iter()
        .map(|p| {
            let (local, remote) = if connector {
                (p.local, p.remote)
            } else {
                (p.remote, p.local)
            };
            QpRoute {
                local: local as usize,
                remote: remote as usize,
            }
        })
        .collect()
}

/// The bring-up list for this side: the peer's QP info joined with the plan's routes.
pub(super) fn bring_up(
    plan: &ConnPlan,
    routes: &[QpRoute],
    peer: &[Endpoint],
    peer_qps: &[QpInfo],
    mtus: &[u32],
    traffic_class: u8,
) -> Vec<QpBringUp> {
    routes
        .iter()
        .zip(peer_qps)
        .zip(mtus)
        .enumerate()
        .map(|(qp, ((route, info), &mtu))| QpBringUp {
            qp,
            route: *route,
            remote: peer[route.remote].clone(),
            remote_qpn: info.qpn,
            remote_psn: info.psn,
            remote_secret: info.secret,
            mtu,
            ece: info.ece,
            traffic_class,
            service_level: plan.sl,
            timeout: plan.timeout,
            retry_cnt: plan.retry_cnt,
        })
        .collect()
}

/// Bring-up of fresh QPs `indices` of an established connection, given the peer's halves
/// `infos` (checked: known plan QPs, on the peer endpoints the plan names). `tc` is the traffic
/// class the side uses (the plan's, or its FIFO class on the receiving side).
pub fn rejoin_bring_up(
    plan: &ConnPlan,
    routes: &[QpRoute],
    local: &[Endpoint],
    peer: &[Endpoint],
    m: &Rejoin,
    tc: u8,
) -> Result<Vec<QpBringUp>, ProtoError> {
    let bad = |detail: String| ProtoError::BadPeerInfo { detail };
    if m.indices.len() != m.qps.len() {
        return Err(bad(format!(
            "{} indices for {} QPs",
            m.indices.len(),
            m.qps.len()
        )));
    }
    m.indices
        .iter()
        .zip(&m.qps)
        .map(|(&i, info)| {
            let route = *routes
                .get(i as usize)
                .ok_or_else(|| bad(format!("a rejoin names QP {i} of {}", routes.len())))?;
            if usize::from(info.endpoint) != route.remote {
                return Err(bad(format!(
                    "rejoined QP {i} is on endpoint {}, the plan says {}",
                    info.endpoint, route.remote
                )));
            }
            Ok(QpBringUp {
                qp: i as usize,
                route,
                remote: peer[route.remote].clone(),
                remote_qpn: info.qpn,
                remote_psn: info.psn,
                remote_secret: info.secret,
                mtu: local[route.local].mtu.min(peer[route.remote].mtu),
                ece: None,
                traffic_class: tc,
                service_level: plan.sl,
                timeout: plan.timeout,
                retry_cnt: plan.retry_cnt,
            })
        })
        .collect()
}
