//! Verbs setup of a connection's QPs: creation, the INIT → RTR → RTS transitions with the plan's
//! attributes (`ncclIbCreateQp`, `ncclIbRtrQp`, `ncclIbRtsQp`), ECE — negotiated, or always
//! exchanged when the provider requires it as an admission ticket — and the loopback flush QP.

use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ncclwasm_model::{Endpoint, LinkLayer};
use ncclwasm_verbs::{
    Access, Cq, Ece, Grh, InitAttr, Mtu, Qp, QpCaps, RtrAttr, RtsAttr, VerbsError,
};

use crate::comm::Side;
use crate::device::{PortCtx, QpWatch};
use crate::net_error::NetError;
use ncclwasm_proto::MAX_REQUESTS;
use ncclwasm_proto::fifo::CTS_SLOT_BYTES;
use ncclwasm_proto::handshake::{LocalQp, QpBringUp};
use ncclwasm_proto::message;

/// A random value (nonces, PSNs): the OS-seeded keys of `RandomState`, mixed with a counter so
/// two draws in one process differ.
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// `rnr_retry` 7 means "retry forever": a receive is always posted before its CTS is written,
/// so an RNR can only be a transient race and must never fail the connection (`ncclIbRtsQp`).
const RNR_RETRY_FOREVER: u8 = 7;
/// `min_rnr_timer` as `ncclIbRtrQp`.
const MIN_RNR_TIMER: u8 = 12;

/// One RC QP of a connection.
#[derive(Debug)]
pub(crate) struct ConnQp {
    pub(crate) qp: Qp,
    /// Declared after `qp`: forgets the QP's fatal events once it is destroyed.
    _watch: QpWatch,
    pub(crate) psn: u32,
    /// `Port::index` of the port it runs on: where the telemetry counts its work.
    pub(crate) port: u32,
    /// This QP's own ECE when the provider requires the peer's ECE before RTR
    /// ([`ncclwasm_verbs::Capabilities::ece_required`]): the peer runs the same provider, so its
    /// value is this one with the `options` it sent as its secret.
    ece_required: Option<Ece>,
}

/// The access a connection's QPs grant the peer: data and FIFO writes, flush reads, and the
/// one-sided traffic's reads and signals (atomics), as NCCL's QPs since 2.29.
const QP_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// What [`create_all`] makes for one side of a connection.
pub(crate) struct SideQps {
    /// One per local port, indexed by endpoint.
    pub cqs: Vec<Arc<Cq>>,
    /// One per planned QP, in plan order, with what the handshake tells the peer about each.
    pub qps: Vec<ConnQp>,
    pub locals: Vec<LocalQp>,
}

/// The QPs of one side of a connection: a CQ per local port, then one RC QP per planned endpoint
/// on that endpoint's CQ (both sides lay their QPs out the same way; see [`create`] for the
/// flags).
pub(crate) fn create_all(
    ports: &[PortCtx],
    endpoints: &[usize],
    cts_inline: bool,
    ece: bool,
) -> Result<SideQps, NetError> {
    let cqs = Side::cqs(ports, endpoints)?;
    let mut qps = Vec::with_capacity(endpoints.len());
    let mut locals = Vec::with_capacity(endpoints.len());
    for &ep in endpoints {
        let (q, l) = create(&ports[ep], &cqs[ep], cts_inline, ece)?;
        qps.push(q);
        locals.push(l);
    }
    Ok(SideQps { cqs, qps, locals })
}

/// Creates an RC QP on `port`'s device, moves it to INIT and says what the peer must know.
///
/// Send queue 2 × 256 (every request can add a chain per QP), receive queue 256 (one receive
/// per request per QP), and, when `cts_inline` is set, room to send a whole CTS slot inline;
/// a device refusing that inline size gets a QP without inline data.
pub(crate) fn create(
    port: &PortCtx,
    cq: &Arc<Cq>,
    cts_inline: bool,
    ece: bool,
) -> Result<(ConnQp, LocalQp), NetError> {
    let dev = &port.dev;
    let mut caps = QpCaps {
        max_send_wr: 2 * MAX_REQUESTS as u32,
        max_recv_wr: MAX_REQUESTS as u32,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: if cts_inline { CTS_SLOT_BYTES as u32 } else { 0 },
    };
    let qp = match dev.pd.create_qp(cq, cq, caps, false) {
        Ok(qp) => qp,
        Err(_) if caps.max_inline_data > 0 => {
            caps.max_inline_data = 0;
            dev.pd
                .create_qp(cq, cq, caps, false)
                .map_err(NetError::verbs(format!("creating a QP on {}", dev.name())))?
        }
        Err(e) => {
            return Err(NetError::verbs(format!("creating a QP on {}", dev.name()))(
                e,
            ));
        }
    };
    qp.to_init(&InitAttr {
        pkey_index: 0,
        port: port.port.port,
        access: QP_ACCESS,
    })
    .map_err(NetError::verbs(format!("QP {} to INIT", qp.qpn())))?;
    // A provider that requires ECE must answer query_ece; otherwise a NIC without ECE simply
    // runs without it.
    let required = dev.ctx.fabric().capabilities().ece_required;
    let queried = match qp.query_ece() {
        Ok(e) => Some(e),
        Err(e) if unsupported(&e) && !required => None,
        Err(e) => return Err(NetError::verbs(format!("query_ece on QP {}", qp.qpn()))(e)),
    };
    let ece_required = queried.filter(|_| required);
    let psn = (random_u64() as u32) & message::MAX_24BIT;
    let local = LocalQp {
        qpn: qp.qpn(),
        secret: ece_required.map_or(0, |e| e.options),
        psn,
        ece: if ece { queried.map(to_wire) } else { None },
    };
    Ok((
        ConnQp {
            _watch: dev.watch(qp.id()),
            qp,
            psn,
            port: port.port.index,
            ece_required,
        },
        local,
    ))
}

fn to_wire(e: Ece) -> message::Ece {
    message::Ece {
        vendor_id: e.vendor_id,
        options: e.options,
        comp_mask: e.comp_mask,
    }
}

fn from_wire(e: message::Ece) -> Ece {
    Ece {
        vendor_id: e.vendor_id,
        options: e.options,
        comp_mask: e.comp_mask,
    }
}

/// The address vector towards `remote` from `local` (`ncclIbRtrQp`): a GRH on Ethernet (RoCE)
/// and across IB subnets, the LID within one.
fn route(local: &Endpoint, remote: &Endpoint, tc: u8) -> Option<Grh> {
    let same_subnet = local.gid.raw[..8] == remote.gid.raw[..8];
    let global = local.link_layer == LinkLayer::Ethernet || !same_subnet;
    global.then_some(Grh {
        dgid: remote.gid.raw,
        sgid_index: local.gid.index as u8,
        hop_limit: 255,
        traffic_class: tc,
        flow_label: 0,
    })
}

impl ConnQp {
    /// `(id, number)`: how fatal events find this QP, and how messages name it.
    pub(crate) fn ids(&self) -> (u64, u32) {
        (self.qp.id(), self.qp.qpn())
    }

    /// RTR then RTS as the handshake asks, after handing the QP the peer's ECE: the negotiated
    /// value, or, when the provider requires ECE and none was negotiated, the peer's secret in
    /// this QP's own ECE. Returns the ECE queried after RTR when the negotiated ECE was set, as
    /// `ncclIbAccept` reports it back.
    pub(crate) fn bring_up(
        &self,
        local: &PortCtx,
        b: &QpBringUp,
    ) -> Result<Option<message::Ece>, NetError> {
        let qpn = self.qp.qpn();
        let what = |step: &str| format!("QP {qpn} on {}: {step}", local.dev.name());
        // As `wrap_ibv_set_ece`: a NIC without ECE support simply runs without it.
        let mut ece_set = false;
        if let Some(e) = b.ece {
            match self.qp.set_ece(from_wire(e)) {
                Ok(()) => ece_set = true,
                Err(e) if unsupported(&e) => {}
                Err(e) => return Err(NetError::verbs(what("set_ece"))(e)),
            }
        } else if let Some(own) = self.ece_required {
            self.qp
                .set_ece(Ece {
                    options: b.remote_secret,
                    ..own
                })
                .map_err(NetError::verbs(what("set_ece (required by the provider)")))?;
        }
        let path_mtu = Mtu::from_bytes(b.mtu).ok_or_else(|| {
            NetError::Internal(format!("path MTU {} is not an InfiniBand MTU", b.mtu))
        })?;
        self.qp
            .to_rtr(&RtrAttr {
                path_mtu,
                dest_qpn: b.remote_qpn,
                rq_psn: b.remote_psn,
                max_dest_rd_atomic: 1,
                min_rnr_timer: MIN_RNR_TIMER,
                dlid: b.remote.lid,
                grh: route(&local.endpoint, &b.remote, b.traffic_class),
                sl: b.service_level,
                port: local.port.port,
            })
            .map_err(NetError::verbs(what("to RTR")))?;
        self.qp
            .to_rts(&RtsAttr {
                timeout: b.timeout,
                retry_cnt: b.retry_cnt,
                rnr_retry: RNR_RETRY_FOREVER,
                sq_psn: self.psn,
                max_rd_atomic: 1,
            })
            .map_err(NetError::verbs(what("to RTS")))?;
        if !ece_set {
            return Ok(None);
        }
        match self.qp.query_ece() {
            Ok(e) => Ok(Some(to_wire(e))),
            Err(e) if unsupported(&e) => Ok(None),
            Err(e) => Err(NetError::verbs(what("query_ece after RTR"))(e)),
        }
    }
}

/// The library or the NIC does not do ECE (`EOPNOTSUPP`, or no `ibv_set_ece` at all).
fn unsupported(e: &VerbsError) -> bool {
    matches!(e, VerbsError::Unsupported { .. }) || e.errno() == Some(libc::EOPNOTSUPP)
}

/// A QP connected to itself, for flushing by RDMA READ (`ncclIbCreateQp` + RTR to its own QPN
/// in `ncclIbAccept`'s GPU-flush setup).
pub(crate) fn loopback(
    port: &PortCtx,
    endpoint: usize,
    cq: &Arc<Cq>,
    timeout: u8,
    retry_cnt: u8,
) -> Result<ConnQp, NetError> {
    let (qp, local) = create(port, cq, false, false)?;
    let own = QpBringUp {
        qp: 0,
        route: ncclwasm_proto::handshake::QpRoute {
            local: endpoint,
            remote: endpoint,
        },
        remote: port.endpoint.clone(),
        remote_qpn: local.qpn,
        remote_psn: local.psn,
        remote_secret: local.secret,
        mtu: port.endpoint.mtu.clamp(256, 4096),
        ece: None,
        traffic_class: 0,
        service_level: 0,
        timeout,
        retry_cnt,
    };
    qp.bring_up(port, &own)?;
    Ok(qp)
}
