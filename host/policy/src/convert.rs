//! Between the shared model types and the generated WIT types.
//!
//! Inbound (model → guest) is total. Outbound (guest → model) only reshapes: whether an answer
//! makes sense is `ncclwasm_model::validate`'s job. Reasons are capped in length here because a
//! hostile guest could otherwise hand back megabytes that end up in every log line.

use ncclwasm_model as m;
use ncclwasm_model::device_table::{ID_UNDEF, RailPlane};

use crate::engine::wit;
use wit::ncclwasm::policy::telemetry as tel;
use wit::ncclwasm::policy::types as t;

/// Longest reason kept, in bytes: room for the built-in default's own reasons (up to ~600
/// bytes, which the wasm `nccl-default` hands back) but not for a flood.
const REASON_MAX: usize = 1024;

pub(crate) fn reason(mut r: String) -> String {
    m::text::shorten(&mut r, REASON_MAX);
    r
}

fn link_layer(l: m::LinkLayer) -> t::LinkLayer {
    match l {
        m::LinkLayer::Infiniband => t::LinkLayer::Infiniband,
        m::LinkLayer::Ethernet => t::LinkLayer::Ethernet,
    }
}

pub(crate) fn port_state(s: m::PortState) -> t::PortState {
    match s {
        m::PortState::Down => t::PortState::Down,
        m::PortState::Initializing => t::PortState::Initializing,
        m::PortState::Armed => t::PortState::Armed,
        m::PortState::Active => t::PortState::Active,
    }
}

fn gid(g: &m::Gid) -> t::Gid {
    t::Gid {
        index: g.index,
        hi: g.hi(),
        lo: g.lo(),
        gid_type: match g.gid_type {
            m::GidType::Ib => t::GidType::Ib,
            m::GidType::RoceV1 => t::GidType::RoceV1,
            m::GidType::RoceV2 => t::GidType::RoceV2,
            m::GidType::Unknown => t::GidType::Unknown,
        },
        family: match g.family() {
            m::AddrFamily::Ipv4 => t::AddrFamily::Ipv4,
            m::AddrFamily::Ipv6 => t::AddrFamily::Ipv6,
        },
        link_local: g.is_link_local(),
        unconfigured: g.is_unconfigured(),
        prefix_len: g.prefix_len,
    }
}

pub(crate) fn port(p: &m::Port) -> t::Port {
    t::Port {
        index: p.index,
        device: p.device.clone(),
        port: p.port,
        state: port_state(p.state),
        link_layer: link_layer(p.link_layer),
        speed_mbps: p.speed_mbps,
        width: p.width,
        mtu: p.mtu,
        lid: p.lid,
        pci_path: p.pci_path.clone(),
        full_pci_path: p.full_pci_path.clone(),
        guid: p.guid,
        numa_node: p.numa_node,
        max_qps: p.max_qps,
        provider: p.provider.clone(),
        gids: p.gids.iter().map(gid).collect(),
    }
}

pub(crate) fn ports(ps: &[m::Port]) -> Vec<t::Port> {
    ps.iter().map(port).collect()
}

fn endpoint(e: &m::Endpoint) -> t::Endpoint {
    t::Endpoint {
        device: e.device.clone(),
        port: e.port,
        link_layer: link_layer(e.link_layer),
        speed_mbps: e.speed_mbps,
        mtu: e.mtu,
        lid: e.lid,
        gid: gid(&e.gid),
    }
}

pub(crate) fn connection(c: &m::Connection) -> t::Connection {
    t::Connection {
        comm_id: c.comm_id,
        traffic_class: c.traffic_class,
        device: c.device,
        device_name: c.device_name.clone(),
        local: c.local.iter().map(endpoint).collect(),
        peer: c.peer.iter().map(endpoint).collect(),
        net_attr: c.net_attr.map(|a| t::NetAttr {
            send: comm_attr(a.send),
            recv: comm_attr(a.recv),
            ops: a.ops,
            algos: a.algos,
            protos: a.protos,
        }),
        one_sided: c.one_sided.map(|o| t::OneSided {
            context: o.context,
            contexts: o.contexts,
            rank: o.rank,
            peer: o.peer,
            nranks: o.nranks,
        }),
    }
}

fn comm_attr(a: m::CommAttr) -> t::CommAttr {
    t::CommAttr {
        max_concurrent_peers: a.max_concurrent_peers,
        min_concurrent_peers: a.min_concurrent_peers,
        max_flows_per_peer: a.max_flows_per_peer,
        min_flows_per_peer: a.min_flows_per_peer,
    }
}

pub(crate) fn selection(s: t::DeviceSelection) -> m::DeviceSelection {
    let id = |v: Option<i16>| v.unwrap_or(ID_UNDEF);
    m::DeviceSelection {
        ports: s.ports,
        // A policy's negative value stays negative (not undefined) for validation to refuse.
        rails: s.rails.map(|rails| {
            rails
                .into_iter()
                .map(|r| RailPlane {
                    rail: id(r.rail),
                    plane: id(r.plane),
                })
                .collect()
        }),
        reason: reason(s.reason),
    }
}

pub(crate) fn gid_choice(g: t::GidChoice) -> m::GidChoice {
    m::GidChoice {
        index: g.index,
        reason: reason(g.reason),
    }
}

pub(crate) fn groups(gs: Vec<t::DeviceGroup>) -> Vec<m::DeviceGroup> {
    gs.into_iter()
        .map(|g| m::DeviceGroup {
            ports: g.ports,
            name: g.name,
            reason: reason(g.reason),
        })
        .collect()
}

pub(crate) fn vnic(v: t::VnicAnswer) -> m::VnicAnswer {
    match v {
        t::VnicAnswer::Accept(r) => m::VnicAnswer::Accept { reason: reason(r) },
        t::VnicAnswer::Reshape((devices, r)) => m::VnicAnswer::Reshape {
            devices,
            reason: reason(r),
        },
        t::VnicAnswer::Refuse(r) => m::VnicAnswer::Refuse { reason: reason(r) },
    }
}

pub(crate) fn patch(p: t::ConnPlan) -> m::PlanPatch {
    let qps = p.qps.map(|qs| {
        qs.into_iter()
            .map(|q| m::QpPlan {
                local: q.local,
                remote: q.remote,
                weight: q.weight,
            })
            .collect()
    });
    // The WIT record's options have the plan's own types, field for field.
    macro_rules! patch {
        ($( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*) => {
            m::PlanPatch {
                qps,
                $( $field: p.$field, )*
                reason: reason(p.reason),
            }
        };
    }
    m::for_each_plan_field!(patch)
}

pub(crate) fn port_event(e: &m::PortEvent) -> t::PortEvent {
    t::PortEvent {
        port: e.port,
        change: match e.change {
            m::PortChange::Down => t::PortChange::Down,
            m::PortChange::Up => t::PortChange::Up,
        },
        cause: match e.cause {
            m::PortEventCause::AsyncEvent => t::PortEventCause::AsyncEvent,
            m::PortEventCause::FatalCompletion => t::PortEventCause::FatalCompletion,
        },
    }
}

pub(crate) fn qp_plans(qps: &[m::QpPlan]) -> Vec<t::QpPlan> {
    qps.iter()
        .map(|q| t::QpPlan {
            local: q.local,
            remote: q.remote,
            weight: q.weight,
        })
        .collect()
}

pub(crate) fn port_answer(a: t::PortAnswer) -> m::PortAnswer {
    match a {
        t::PortAnswer::MoveTo((ports, r)) => m::PortAnswer::MoveTo {
            ports,
            reason: reason(r),
        },
        t::PortAnswer::Wait((ms, r)) => m::PortAnswer::Wait {
            ms,
            reason: reason(r),
        },
        t::PortAnswer::Fail(r) => m::PortAnswer::Fail { reason: reason(r) },
        t::PortAnswer::FailBack(r) => m::PortAnswer::FailBack { reason: reason(r) },
        t::PortAnswer::Stay(r) => m::PortAnswer::Stay { reason: reason(r) },
    }
}

/// The counters a policy's `telemetry.read` returns.
pub(crate) fn telemetry(s: &m::telemetry::Telemetry) -> tel::Snapshot {
    use m::telemetry as mt;
    let traffic = |t: mt::Traffic| tel::Traffic {
        wrs: t.wrs,
        bytes: t.bytes,
    };
    let errors = |e: &[mt::StatusCount]| {
        e.iter()
            .map(|c| tel::StatusCount {
                status: c.status,
                count: c.count,
            })
            .collect()
    };
    tel::Snapshot {
        at_ms: s.at_ms,
        ports: s
            .ports
            .iter()
            .map(|p| tel::PortTelemetry {
                index: p.index,
                device: p.device.clone(),
                port: p.port,
                send: traffic(p.send),
                recv: traffic(p.recv),
                completions: p.completions,
                errors: errors(&p.errors),
                last_error_ms: p.last_error_ms,
                changes: p
                    .changes
                    .iter()
                    .map(|c| tel::StateChange {
                        at_ms: c.at_ms,
                        state: port_state(c.state),
                    })
                    .collect(),
                connections: p.connections,
                qps: p.qps,
                window_ms: p.window_ms,
                window_bytes: p.window_bytes,
            })
            .collect(),
        connections: s
            .connections
            .iter()
            .map(|c| tel::ConnectionTelemetry {
                id: c.id,
                comm_id: c.comm_id,
                device: c.device,
                sending: c.sending,
                done: traffic(c.done),
                completions: c.completions,
                errors: errors(&c.errors),
                qps: c
                    .qps
                    .iter()
                    .map(|q| tel::QpTelemetry {
                        qpn: q.qpn,
                        port: q.port,
                        send: traffic(q.send),
                        recv: traffic(q.recv),
                    })
                    .collect(),
            })
            .collect(),
    }
}
