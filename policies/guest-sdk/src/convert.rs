//! WIT records ↔ model types. Inputs (ports, connections) come in as WIT and go out as model
//! types; decisions go the other way. Nothing is lost on the way in: the WIT `gid` flags
//! `family`, `link-local` and `unconfigured` are functions of the raw bytes the model keeps.

use crate::bindings::ncclwasm::policy::telemetry as tel;
use crate::bindings::ncclwasm::policy::types as wit;
use crate::model;
use crate::model::device_table::ID_UNDEF;
use crate::rt::{FromWit, IntoWit};

impl From<wit::LinkLayer> for model::LinkLayer {
    fn from(l: wit::LinkLayer) -> Self {
        match l {
            wit::LinkLayer::Infiniband => model::LinkLayer::Infiniband,
            wit::LinkLayer::Ethernet => model::LinkLayer::Ethernet,
        }
    }
}

impl From<wit::PortState> for model::PortState {
    fn from(s: wit::PortState) -> Self {
        match s {
            wit::PortState::Down => model::PortState::Down,
            wit::PortState::Initializing => model::PortState::Initializing,
            wit::PortState::Armed => model::PortState::Armed,
            wit::PortState::Active => model::PortState::Active,
        }
    }
}

impl From<wit::GidType> for model::GidType {
    fn from(t: wit::GidType) -> Self {
        match t {
            wit::GidType::Ib => model::GidType::Ib,
            wit::GidType::RoceV1 => model::GidType::RoceV1,
            wit::GidType::RoceV2 => model::GidType::RoceV2,
            wit::GidType::Unknown => model::GidType::Unknown,
        }
    }
}

/// The WIT carries the 16 GID bytes as two big-endian halves.
fn gid_bytes(hi: u64, lo: u64) -> [u8; 16] {
    let mut raw = [0; 16];
    raw[..8].copy_from_slice(&hi.to_be_bytes());
    raw[8..].copy_from_slice(&lo.to_be_bytes());
    raw
}

impl From<wit::Gid> for model::Gid {
    fn from(g: wit::Gid) -> Self {
        model::Gid {
            index: g.index,
            raw: gid_bytes(g.hi, g.lo),
            gid_type: g.gid_type.into(),
            prefix_len: g.prefix_len,
        }
    }
}

impl From<wit::Port> for model::Port {
    fn from(p: wit::Port) -> Self {
        model::Port {
            index: p.index,
            device: p.device,
            port: p.port,
            state: p.state.into(),
            link_layer: p.link_layer.into(),
            speed_mbps: p.speed_mbps,
            width: p.width,
            mtu: p.mtu,
            lid: p.lid,
            pci_path: p.pci_path,
            full_pci_path: p.full_pci_path,
            guid: p.guid,
            numa_node: p.numa_node,
            max_qps: p.max_qps,
            provider: p.provider,
            gids: p.gids.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<wit::Endpoint> for model::Endpoint {
    fn from(e: wit::Endpoint) -> Self {
        model::Endpoint {
            device: e.device,
            port: e.port,
            link_layer: e.link_layer.into(),
            speed_mbps: e.speed_mbps,
            mtu: e.mtu,
            lid: e.lid,
            gid: e.gid.into(),
        }
    }
}

impl From<wit::Connection> for model::Connection {
    fn from(c: wit::Connection) -> Self {
        model::Connection {
            comm_id: c.comm_id,
            traffic_class: c.traffic_class,
            device: c.device,
            device_name: c.device_name,
            local: c.local.into_iter().map(Into::into).collect(),
            peer: c.peer.into_iter().map(Into::into).collect(),
            net_attr: c.net_attr.map(Into::into),
            one_sided: c.one_sided.map(|o| model::OneSided {
                context: o.context,
                contexts: o.contexts,
                rank: o.rank,
                peer: o.peer,
                nranks: o.nranks,
            }),
        }
    }
}

impl From<wit::CommAttr> for model::CommAttr {
    fn from(a: wit::CommAttr) -> Self {
        model::CommAttr {
            max_concurrent_peers: a.max_concurrent_peers,
            min_concurrent_peers: a.min_concurrent_peers,
            max_flows_per_peer: a.max_flows_per_peer,
            min_flows_per_peer: a.min_flows_per_peer,
        }
    }
}

impl From<wit::NetAttr> for model::NetAttr {
    fn from(a: wit::NetAttr) -> Self {
        model::NetAttr {
            send: a.send.into(),
            recv: a.recv.into(),
            ops: a.ops,
            algos: a.algos,
            protos: a.protos,
        }
    }
}

impl From<model::DeviceSelection> for wit::DeviceSelection {
    fn from(d: model::DeviceSelection) -> Self {
        let id = |v: i16| (v != ID_UNDEF).then_some(v);
        wit::DeviceSelection {
            ports: d.ports,
            rails: d.rails.map(|rails| {
                rails
                    .into_iter()
                    .map(|r| wit::RailPlane {
                        rail: id(r.rail),
                        plane: id(r.plane),
                    })
                    .collect()
            }),
            reason: d.reason,
        }
    }
}

impl From<model::GidChoice> for wit::GidChoice {
    fn from(g: model::GidChoice) -> Self {
        wit::GidChoice {
            index: g.index,
            reason: g.reason,
        }
    }
}

impl From<model::DeviceGroup> for wit::DeviceGroup {
    fn from(g: model::DeviceGroup) -> Self {
        wit::DeviceGroup {
            ports: g.ports,
            name: g.name,
            reason: g.reason,
        }
    }
}

impl From<model::VnicAnswer> for wit::VnicAnswer {
    fn from(a: model::VnicAnswer) -> Self {
        match a {
            model::VnicAnswer::Accept { reason } => wit::VnicAnswer::Accept(reason),
            model::VnicAnswer::Reshape { devices, reason } => {
                wit::VnicAnswer::Reshape((devices, reason))
            }
            model::VnicAnswer::Refuse { reason } => wit::VnicAnswer::Refuse(reason),
        }
    }
}

impl From<model::QpPlan> for wit::QpPlan {
    fn from(q: model::QpPlan) -> Self {
        wit::QpPlan {
            local: q.local,
            remote: q.remote,
            weight: q.weight,
        }
    }
}

impl From<model::PlanPatch> for wit::ConnPlan {
    fn from(p: model::PlanPatch) -> Self {
        // The WIT record's options have the plan's own types, field for field.
        macro_rules! plan {
            ($( $(#[$doc:meta])* $field:ident : $ty:ty = $wit:literal; )*) => {
                wit::ConnPlan {
                    qps: p.qps.map(|qps| qps.into_iter().map(Into::into).collect()),
                    $( $field: p.$field, )*
                    reason: p.reason,
                }
            };
        }
        model::for_each_plan_field!(plan)
    }
}

impl From<wit::QpPlan> for model::QpPlan {
    fn from(q: wit::QpPlan) -> Self {
        model::QpPlan {
            local: q.local,
            remote: q.remote,
            weight: q.weight,
        }
    }
}

impl From<wit::PortEvent> for model::PortEvent {
    fn from(e: wit::PortEvent) -> Self {
        model::PortEvent {
            port: e.port,
            change: match e.change {
                wit::PortChange::Down => model::PortChange::Down,
                wit::PortChange::Up => model::PortChange::Up,
            },
            cause: match e.cause {
                wit::PortEventCause::AsyncEvent => model::PortEventCause::AsyncEvent,
                wit::PortEventCause::FatalCompletion => model::PortEventCause::FatalCompletion,
            },
        }
    }
}

impl From<model::PortAnswer> for wit::PortAnswer {
    fn from(a: model::PortAnswer) -> Self {
        match a {
            model::PortAnswer::MoveTo { ports, reason } => wit::PortAnswer::MoveTo((ports, reason)),
            model::PortAnswer::Wait { ms, reason } => wit::PortAnswer::Wait((ms, reason)),
            model::PortAnswer::Fail { reason } => wit::PortAnswer::Fail(reason),
            model::PortAnswer::FailBack { reason } => wit::PortAnswer::FailBack(reason),
            model::PortAnswer::Stay { reason } => wit::PortAnswer::Stay(reason),
        }
    }
}

impl From<tel::Snapshot> for model::telemetry::Telemetry {
    fn from(s: tel::Snapshot) -> Self {
        use model::telemetry as mt;
        let traffic = |t: tel::Traffic| mt::Traffic {
            wrs: t.wrs,
            bytes: t.bytes,
        };
        let errors = |e: Vec<tel::StatusCount>| {
            e.into_iter()
                .map(|c| mt::StatusCount {
                    status: c.status,
                    count: c.count,
                })
                .collect()
        };
        mt::Telemetry {
            at_ms: s.at_ms,
            ports: s
                .ports
                .into_iter()
                .map(|p| mt::PortTelemetry {
                    index: p.index,
                    device: p.device,
                    port: p.port,
                    send: traffic(p.send),
                    recv: traffic(p.recv),
                    completions: p.completions,
                    errors: errors(p.errors),
                    last_error_ms: p.last_error_ms,
                    changes: p
                        .changes
                        .into_iter()
                        .map(|c| mt::StateChange {
                            at_ms: c.at_ms,
                            state: c.state.into(),
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
                .into_iter()
                .map(|c| mt::ConnectionTelemetry {
                    id: c.id,
                    comm_id: c.comm_id,
                    device: c.device,
                    sending: c.sending,
                    done: traffic(c.done),
                    completions: c.completions,
                    errors: errors(c.errors),
                    qps: c
                        .qps
                        .into_iter()
                        .map(|q| mt::QpTelemetry {
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
}

/// The model types whose `From` conversions above cross the WIT boundary, with their WIT names.
macro_rules! wit_forms {
    (in: $($model:ident => $wit:ident),*; out: $($answer:ident => $wit_answer:ident),*) => {
        $(impl FromWit for model::$model {
            type Wit = wit::$wit;
            fn from_wit(w: wit::$wit) -> Self {
                w.into()
            }
        })*
        $(impl IntoWit for model::$answer {
            type Wit = wit::$wit_answer;
            fn into_wit(self) -> wit::$wit_answer {
                self.into()
            }
        })*
    };
}

wit_forms! {
    in: Port => Port, Connection => Connection, PortEvent => PortEvent, QpPlan => QpPlan,
        PortState => PortState;
    out: DeviceSelection => DeviceSelection, GidChoice => GidChoice, DeviceGroup => DeviceGroup,
        VnicAnswer => VnicAnswer, PlanPatch => ConnPlan, PortAnswer => PortAnswer
}

/// Device indices and other plain numbers are the same on both sides.
impl FromWit for u32 {
    type Wit = u32;
    fn from_wit(w: u32) -> Self {
        w
    }
}

impl<T: IntoWit> IntoWit for Vec<T> {
    type Wit = Vec<T::Wit>;
    fn into_wit(self) -> Self::Wit {
        self.into_iter().map(IntoWit::into_wit).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_halves_are_big_endian() {
        let g: model::Gid = wit::Gid {
            index: 3,
            hi: 0xfe80_0000_0000_0001,
            lo: 0x0000_ffff_0a00_0001,
            gid_type: wit::GidType::RoceV2,
            family: wit::AddrFamily::Ipv4,
            link_local: false,
            unconfigured: false,
            prefix_len: 120,
        }
        .into();
        assert_eq!(
            g.raw,
            [0xfe, 0x80, 0, 0, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 10, 0, 0, 1]
        );
        assert_eq!(
            (g.index, g.gid_type, g.prefix_len),
            (3, model::GidType::RoceV2, 120)
        );
    }

    fn wit_gid(index: u32) -> wit::Gid {
        wit::Gid {
            index,
            hi: 0xfe80 << 48,
            lo: u64::from(index),
            gid_type: wit::GidType::Ib,
            family: wit::AddrFamily::Ipv6,
            link_local: true,
            unconfigured: false,
            prefix_len: 64,
        }
    }

    #[test]
    fn port_fields_land_in_their_places() {
        let p: model::Port = wit::Port {
            index: 7,
            device: "mlx5_3".into(),
            port: 2,
            state: wit::PortState::Armed,
            link_layer: wit::LinkLayer::Infiniband,
            speed_mbps: 400_000,
            width: 4,
            mtu: 4096,
            lid: 11,
            pci_path: "/sys/devices/x".into(),
            full_pci_path: "/sys/devices/x.1".into(),
            guid: 0xabc,
            numa_node: -1,
            max_qps: 1 << 17,
            provider: "mlx5".into(),
            gids: vec![wit_gid(0), wit_gid(1)],
        }
        .into();
        assert_eq!((p.index, p.device.as_str(), p.port), (7, "mlx5_3", 2));
        assert_eq!(
            (p.state, p.link_layer),
            (model::PortState::Armed, model::LinkLayer::Infiniband)
        );
        assert_eq!(
            (p.speed_mbps, p.width, p.mtu, p.lid),
            (400_000, 4, 4096, 11)
        );
        assert_eq!(
            (p.pci_path.as_str(), p.full_pci_path.as_str()),
            ("/sys/devices/x", "/sys/devices/x.1")
        );
        assert_eq!((p.guid, p.numa_node), (0xabc, -1));
        assert_eq!((p.max_qps, p.provider.as_str()), (1 << 17, "mlx5"));
        assert_eq!(p.gids[1].raw[15], 1);
        assert!(p.gids[1].is_link_local());
    }

    #[test]
    fn connection_keeps_both_sides_in_order() {
        let ep = |device: &str, gid| wit::Endpoint {
            device: device.into(),
            port: 1,
            link_layer: wit::LinkLayer::Ethernet,
            speed_mbps: 100_000,
            mtu: 1024,
            lid: 0,
            gid: wit_gid(gid),
        };
        let c: model::Connection = wit::Connection {
            comm_id: 0xfeed,
            traffic_class: -1,
            device: 3,
            device_name: "a+b".into(),
            local: vec![ep("a", 0), ep("b", 1)],
            peer: vec![ep("c", 2)],
            net_attr: Some(wit::NetAttr {
                send: wit::CommAttr {
                    max_concurrent_peers: Some(2),
                    min_concurrent_peers: Some(2),
                    max_flows_per_peer: Some(8),
                    min_flows_per_peer: None,
                },
                recv: wit::CommAttr {
                    max_concurrent_peers: None,
                    min_concurrent_peers: None,
                    max_flows_per_peer: None,
                    min_flows_per_peer: None,
                },
                ops: Some(1 << 4),
                algos: Some(1 << 1),
                protos: None,
            }),
            one_sided: Some(wit::OneSided {
                context: 1,
                contexts: 4,
                rank: 2,
                peer: 0,
                nranks: 3,
            }),
        }
        .into();
        assert_eq!((c.comm_id, c.traffic_class, c.device), (0xfeed, -1, 3));
        assert_eq!(
            c.one_sided
                .map(|o| (o.context, o.contexts, o.rank, o.peer, o.nranks)),
            Some((1, 4, 2, 0, 3))
        );
        let hint = c.net_attr.expect("the hint crosses");
        assert_eq!(
            (hint.send.max_flows_per_peer, hint.send.min_flows_per_peer),
            (Some(8), None)
        );
        assert_eq!(
            (hint.ops, hint.algos, hint.protos),
            (Some(16), Some(2), None)
        );
        assert_eq!(c.device_name, "a+b");
        let names: Vec<_> = c
            .local
            .iter()
            .chain(&c.peer)
            .map(|e| e.device.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!((c.peer[0].gid.index, c.peer[0].mtu), (2, 1024));
        assert_eq!(c.local[1].link_layer, model::LinkLayer::Ethernet);
    }

    #[test]
    fn plan_patch_keeps_every_field_in_place() {
        let patch = model::PlanPatch {
            qps: Some(vec![model::QpPlan {
                local: 1,
                remote: 2,
                weight: 3,
            }]),
            stripe_width: Some(4),
            align: Some(128),
            adaptive_routing: Some(true),
            ar_threshold: Some(8192),
            tc: Some(106),
            sl: Some(5),
            fifo_tc: Some(7),
            ece: None,
            timeout: Some(20),
            retry_cnt: Some(6),
            reason: "why".into(),
        };
        let plan: wit::ConnPlan = patch.into();
        let qp = &plan.qps.as_ref().unwrap()[0];
        assert_eq!((qp.local, qp.remote, qp.weight), (1, 2, 3));
        assert_eq!((plan.stripe_width, plan.align), (Some(4), Some(128)));
        assert_eq!(
            (plan.adaptive_routing, plan.ar_threshold, plan.ece),
            (Some(true), Some(8192), None)
        );
        assert_eq!(
            (plan.tc, plan.sl, plan.fifo_tc, plan.timeout, plan.retry_cnt),
            (Some(106), Some(5), Some(7), Some(20), Some(6))
        );
        assert_eq!(plan.reason, "why");
    }

    #[test]
    fn vnic_reshape_carries_devices_and_reason() {
        let a: wit::VnicAnswer = model::VnicAnswer::Reshape {
            devices: vec![0, 2],
            reason: "r".into(),
        }
        .into();
        match a {
            wit::VnicAnswer::Reshape((devices, reason)) => {
                assert_eq!((devices, reason.as_str()), (vec![0, 2], "r"));
            }
            other => panic!("expected reshape, got {other:?}"),
        }
    }

    #[test]
    fn port_event_and_answer_keep_every_field() {
        let e: model::PortEvent = wit::PortEvent {
            port: 3,
            change: wit::PortChange::Down,
            cause: wit::PortEventCause::FatalCompletion,
        }
        .into();
        assert_eq!(
            e,
            model::PortEvent {
                port: 3,
                change: model::PortChange::Down,
                cause: model::PortEventCause::FatalCompletion,
            }
        );
        let up: model::PortEvent = wit::PortEvent {
            port: 0,
            change: wit::PortChange::Up,
            cause: wit::PortEventCause::AsyncEvent,
        }
        .into();
        assert_eq!(
            (up.change, up.cause),
            (model::PortChange::Up, model::PortEventCause::AsyncEvent)
        );
        let a: wit::PortAnswer = model::PortAnswer::MoveTo {
            ports: vec![1, 2],
            reason: "r".into(),
        }
        .into();
        assert!(matches!(a, wit::PortAnswer::MoveTo((p, r)) if p == [1, 2] && r == "r"));
        let a: wit::PortAnswer = model::PortAnswer::Wait {
            ms: 250,
            reason: "w".into(),
        }
        .into();
        assert!(matches!(a, wit::PortAnswer::Wait((250, r)) if r == "w"));
        let q: model::QpPlan = wit::QpPlan {
            local: 1,
            remote: 2,
            weight: 3,
        }
        .into();
        assert_eq!((q.local, q.remote, q.weight), (1, 2, 3));
    }
}
