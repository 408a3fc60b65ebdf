//! rail-aligned: every QP of a connection joins a local port to a peer port on the **same
//! subnet**, so traffic never crosses rails.
//!
//! On a rail-optimised fabric NIC *k* of every node hangs off leaf switch *k*; a QP from rail 0 to
//! rail 3 leaves the leaf and crosses the spine, where it competes with every other job. NCCL's
//! built-in plan pairs QP *i* with local port `i % nlocal` and peer port `i % npeer` by position,
//! which crosses rails whenever the two sides list their ports in different orders (a fused NIC
//! built from different devices, a pod that got other VFs, a PCI renumbering). This policy pairs
//! by address instead: a local endpoint goes with a peer endpoint whose GID shares its subnet
//! (IB: the 64-bit subnet prefix; RoCE: the interface's prefix). Local endpoints without such a
//! peer carry nothing; when no endpoint pairs at all the policy has no opinion and the built-in
//! plan stands.
//!
//! It also tells NCCL 2.30 the rails, which NCCL cannot discover (NVIDIA/nccl#1755, #1933,
//! #2097): each selected port's v12 `railId` is the rank of its subnet among the distinct
//! subnets of the selected ports (the subnet of the routable GID the built-in default picks for
//! it; undefined for a port on a link-local one), so
//! NIC *k* of every node — on leaf *k*'s subnet — is rail *k* everywhere, and NCCL's topology
//! search (`NCCL_CROSS_NIC=0`) keeps its rings on rails. The ports and their order stay the
//! built-in's. No opinion when the ports share one subnet, or when `NCCL_IB_HCA` gives rails
//! itself (`<hca>:<port>:<rail>:<plane>`: the operator's word stands).
//!
//! One-sided traffic (NCCL's RMA tables) is planned per context: context *c* of a fused NIC
//! gets one QP on the *c*-th same-subnet pair (round robin), so the rails share the contexts
//! and no put crosses rails or is split over them; NCCL's own proxy cannot use a fused NIC at all.
//!
//! With `wait-ms=N` it also answers port events: a failed port's rail is held for up to N ms
//! (`wait`) rather than moving its traffic across rails, and a port that is active again carries
//! its share once more (`fail-back`). Without it the built-in answer stands.
//!
//! Settings (`NCCL_WASM_POLICY_CONFIG`): `qps-per-pair=N` (1..=128), default
//! `NCCL_IB_QPS_PER_CONNECTION` (1), NCCL's QPs per device; `wait-ms=N` (1..=10000), unset by
//! default.

use ncclwasm_default::IbConfig;
use ncclwasm_guest::model::MAX_PORT_WAIT_MS;
use ncclwasm_guest::model::device_table::{ID_UNDEF, RailPlane};
use ncclwasm_guest::{
    Config, Connection, DeviceSelection, Hooks, PlanPatch, Policy, Port, PortAnswer, PortChange,
    PortEvent, PortState, QpPlan, Subnet,
};

/// The most QPs a plan may hold (`conn-plan.qps` in the WIT).
const MAX_QPS: usize = 128;

#[derive(Debug)]
struct RailAligned {
    ib: IbConfig,
    qps_per_pair: u32,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS`: stripe each message over every QP, not one per pair.
    split_data_on_qps: bool,
    /// `wait-ms`: how long a failed port's rail is held; `None`: no opinion on port events.
    wait_ms: Option<u32>,
}

impl Policy for RailAligned {
    // `HOOKS` is a constant: `on-port-event` is always declared and answers `None` (the
    // built-in's answer) unless `wait-ms` is set.
    const HOOKS: Hooks = Hooks::SELECT_DEVICES
        .union(Hooks::PLAN_CONNECTION)
        .union(Hooks::ON_PORT_EVENT);

    fn init(config: &Config) -> Result<Self, String> {
        let ib = IbConfig::from_pairs(config.pairs()).map_err(|e| e.to_string())?;
        let mut options = config.options()?;
        let qps_per_pair = options
            .take::<u32>("qps-per-pair")?
            .unwrap_or(ib.qps_per_connection);
        let wait_ms = options.take::<u32>("wait-ms")?;
        options.finish()?;
        if !(1..=MAX_QPS as u32).contains(&qps_per_pair) {
            return Err(format!(
                "qps-per-pair={qps_per_pair}: a connection holds 1..={MAX_QPS} QPs"
            ));
        }
        if let Some(ms) = wait_ms
            && !(1..=MAX_PORT_WAIT_MS).contains(&ms)
        {
            return Err(format!(
                "wait-ms={ms}: a failed port is waited for 1..={MAX_PORT_WAIT_MS} ms"
            ));
        }
        Ok(RailAligned {
            qps_per_pair,
            split_data_on_qps: ib.split_data_on_qps,
            wait_ms,
            ib,
        })
    }

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        rails_by_subnet(&self.ib, ports)
    }

    fn plan_connection(&mut self, conn: &Connection) -> Option<PlanPatch> {
        self.plan(conn)
    }

    fn on_port_event(
        &mut self,
        event: &PortEvent,
        conn: &Connection,
        _qps: &[QpPlan],
        _states: &[PortState],
    ) -> Option<PortAnswer> {
        self.port_answer(event, conn)
    }
}

/// The built-in selection with each port's rail the rank of its subnet; `None` when there is
/// one subnet or none, or `NCCL_IB_HCA` names rails.
fn rails_by_subnet(ib: &IbConfig, ports: &[Port]) -> Option<DeviceSelection> {
    let base = ncclwasm_default::select_devices(ib, ports);
    let selected: Vec<&Port> = base
        .ports
        .iter()
        .filter_map(|&i| ports.iter().find(|p| p.index == i))
        .collect();
    // NCCL_IB_HCA's rails and planes: the rails the operator's, the planes kept.
    let given: Vec<RailPlane> = selected
        .iter()
        .map(|p| ncclwasm_default::rail_plane(ib, p))
        .collect();
    if given.iter().any(|g| g.rail != ID_UNDEF) {
        return None;
    }
    // A link-local GID (fe80::/64 on every port alike) says nothing about the rail.
    let subnets: Vec<Option<Subnet>> = selected
        .iter()
        .map(|p| {
            let gid = p.endpoint(ncclwasm_default::select_gid(ib, p).index).gid;
            gid.is_routable().then(|| Subnet::of(&gid)).flatten()
        })
        .collect();
    let mut distinct: Vec<Subnet> = subnets.iter().flatten().copied().collect();
    distinct.sort();
    distinct.dedup();
    if distinct.len() < 2 {
        return None;
    }
    let rank = |s: &Option<Subnet>| s.and_then(|s| distinct.iter().position(|d| *d == s));
    let rails = given
        .iter()
        .zip(&subnets)
        .map(|(g, s)| RailPlane {
            rail: rank(s).map_or(ID_UNDEF, |r| r as i16),
            plane: g.plane,
        })
        .collect();
    let named: Vec<String> = distinct
        .iter()
        .enumerate()
        .map(|(r, s)| format!("rail {r} {s}"))
        .collect();
    Some(DeviceSelection {
        ports: base.ports,
        rails: Some(rails),
        reason: format!(
            "{}; rails by subnet, the same rank on every node: {}",
            base.reason,
            named.join(", ")
        ),
    })
}

ncclwasm_guest::export_policy!(RailAligned);

/// One local endpoint and the peer endpoint on its rail.
#[derive(Debug, PartialEq, Eq)]
struct Pair {
    local: u32,
    remote: u32,
    subnet: Subnet,
}

/// For each local endpoint, a peer endpoint on its subnet: a peer not yet taken if there is one
/// (so two rails never funnel into one peer port while another idles), else a taken one.
fn pair_up(conn: &Connection) -> Vec<Pair> {
    let mut taken = vec![false; conn.peer.len()];
    let mut pairs = Vec::new();
    for (local, l) in conn.local.iter().enumerate() {
        let Some(subnet) = Subnet::of(&l.gid) else {
            continue;
        };
        let on_rail: Vec<usize> = (0..conn.peer.len())
            .filter(|&r| Subnet::of(&conn.peer[r].gid) == Some(subnet))
            .collect();
        let Some(&remote) = on_rail.iter().find(|&&r| !taken[r]).or(on_rail.first()) else {
            continue;
        };
        taken[remote] = true;
        pairs.push(Pair {
            local: local as u32,
            remote: remote as u32,
            subnet,
        });
    }
    pairs
}

impl RailAligned {
    /// With `wait-ms`: a port-down holds the failed port's rail for up to that long, a port-up
    /// gives the rail its share again. `None` without it.
    fn port_answer(&self, event: &PortEvent, conn: &Connection) -> Option<PortAnswer> {
        let ms = self.wait_ms?;
        let rail = conn.local.get(event.port as usize).map_or_else(
            || format!("port {}", event.port),
            |e| format!("{}:{}", e.device, e.port),
        );
        Some(match event.change {
            PortChange::Down => PortAnswer::Wait {
                ms,
                reason: format!(
                    "rail {rail} held for up to {ms} ms rather than moving its traffic across rails"
                ),
            },
            PortChange::Up => PortAnswer::FailBack {
                reason: format!("rail {rail} is active again: it carries its share of the traffic"),
            },
        })
    }

    /// `qps_per_pair` QPs per pair, interleaved pair by pair as NCCL rotates over devices, so
    /// consecutive messages start on different rails; a message goes over one QP per pair (or
    /// every QP with `NCCL_IB_SPLIT_DATA_ON_QPS=1`), as NCCL stripes over devices. `None` when
    /// nothing pairs.
    fn plan(&self, conn: &Connection) -> Option<PlanPatch> {
        let pairs = pair_up(conn);
        if pairs.is_empty() {
            return None;
        }
        if let Some(o) = conn.one_sided {
            return Some(spread_context(conn, &pairs, o.context, o.contexts));
        }
        let rounds = (self.qps_per_pair as usize).min(MAX_QPS / pairs.len());
        let qps: Vec<QpPlan> = (0..rounds)
            .flat_map(|_| &pairs)
            .map(|p| QpPlan {
                local: p.local,
                remote: p.remote,
                weight: 1,
            })
            .collect();

        let stripe = if self.split_data_on_qps {
            qps.len()
        } else {
            pairs.len()
        };
        // A reason is read in one log line (and cut by the host past 1 KiB): counts and idle ports
        // first, so only the tail of a long pair list can get lost.
        let mut reason =
            format!("{rounds} QP(s) per pair, {stripe} per message, none across rails; ");
        let idle: Vec<&str> = (0..conn.local.len())
            .filter(|&l| !pairs.iter().any(|p| p.local as usize == l))
            .map(|l| conn.local[l].device.as_str())
            .collect();
        if !idle.is_empty() {
            reason += &format!("idle, no peer on their subnet: {}; ", idle.join(", "));
        }
        // The peer's device is named only when it differs from ours: eight rails then fit.
        let rails: Vec<String> = pairs
            .iter()
            .map(|p| {
                let (l, r) = (&conn.local[p.local as usize], &conn.peer[p.remote as usize]);
                if l.device == r.device {
                    format!("{} {}", l.device, p.subnet)
                } else {
                    format!("{}↔{} {}", l.device, r.device, p.subnet)
                }
            })
            .collect();
        reason += &format!("rails (local[↔peer] subnet): {}", rails.join(", "));
        Some(PlanPatch {
            stripe_width: Some(stripe as u32),
            qps: Some(qps),
            reason,
            ..PlanPatch::default()
        })
    }
}

/// A one-sided context's plan: one QP on the same-subnet pair `context % pairs` — contexts are
/// independent streams (ordering holds only within one), so a fused NIC's rails each carry their
/// share of contexts, and no put is split across rails.
fn spread_context(conn: &Connection, pairs: &[Pair], context: u32, contexts: u32) -> PlanPatch {
    let p = &pairs[context as usize % pairs.len()];
    let (l, r) = (&conn.local[p.local as usize], &conn.peer[p.remote as usize]);
    PlanPatch {
        stripe_width: Some(1),
        qps: Some(vec![QpPlan {
            local: p.local,
            remote: p.remote,
            weight: 1,
        }]),
        reason: format!(
            "one-sided context {context} of {contexts}: 1 QP on {}↔{} {} (contexts spread over \
             {} same-subnet pair(s))",
            l.device,
            r.device,
            p.subnet,
            pairs.len()
        ),
        ..PlanPatch::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::model::validate::{check_plan, check_port_answer, check_selection};
    use ncclwasm_guest::testing::{connection, endpoint, port, topology};
    use ncclwasm_guest::{AddrFamily, Endpoint, GidType, POLICY_CONFIG_KEY, Port};

    /// `device` talking over its RoCEv2 IPv4 GID, as NCCL's default GID scan would pick.
    fn roce_v4(ports: &[Port], device: &str) -> Endpoint {
        let p = port(ports, device);
        let gid = p
            .gids
            .iter()
            .find(|g| g.gid_type == GidType::RoceV2 && g.family() == AddrFamily::Ipv4)
            .unwrap_or_else(|| panic!("{device} has no RoCEv2 IPv4 GID"));
        endpoint(p, gid.index)
    }

    /// Each `roce-8nic` NIC on its own rail: its IPv4 address, or its IPv6 one (mlx5_3, mlx5_7).
    fn roce_or_v6(p: &Port) -> Endpoint {
        let mut routable = p.gids.iter().filter(|g| g.is_routable());
        let v4 = routable.clone().find(|g| g.family() == AddrFamily::Ipv4);
        endpoint(p, v4.or(routable.next_back()).unwrap().index)
    }

    fn rails(qps_per_pair: u32) -> RailAligned {
        RailAligned {
            ib: IbConfig::default(),
            qps_per_pair,
            split_data_on_qps: false,
            wait_ms: None,
        }
    }

    fn init(policy_config: &str) -> Result<RailAligned, String> {
        RailAligned::init(&Config::new(vec![(
            POLICY_CONFIG_KEY.into(),
            policy_config.into(),
        )]))
    }

    #[test]
    fn pairs_by_subnet_not_by_position() {
        let ports = topology("roce-8nic");
        let local = vec![roce_v4(&ports, "mlx5_0"), roce_v4(&ports, "mlx5_2")];
        // The peer lists the same rails in the other order, plus a rail we do not have.
        let peer = vec![
            roce_v4(&ports, "mlx5_4"),
            roce_v4(&ports, "mlx5_2"),
            roce_v4(&ports, "mlx5_0"),
        ];
        let conn = connection(local, peer);
        let patch = rails(1).plan(&conn).unwrap();
        let qps = patch.qps.unwrap();
        let pairs: Vec<_> = qps.iter().map(|q| (q.local, q.remote)).collect();
        assert_eq!(pairs, [(0, 2), (1, 1)]);
        assert_eq!(
            patch.reason,
            "1 QP(s) per pair, 2 per message, none across rails; \
             rails (local[↔peer] subnet): mlx5_0 10.0.0.0/24, mlx5_2 10.0.2.0/24"
        );
    }

    /// One-sided contexts of a fused NIC take the rails in turn, one QP each, never across;
    /// the merged plan passes the host's checks.
    #[test]
    fn one_sided_contexts_spread_over_the_rails() {
        let ports = topology("roce-8nic");
        let local = vec![roce_v4(&ports, "mlx5_0"), roce_v4(&ports, "mlx5_2")];
        let peer = vec![roce_v4(&ports, "mlx5_2"), roce_v4(&ports, "mlx5_0")];
        let mut conn = connection(local, peer);
        let mut on = |context| {
            conn.one_sided = Some(ncclwasm_guest::model::OneSided {
                context,
                contexts: 3,
                rank: 0,
                peer: 1,
                nranks: 2,
            });
            let patch = rails(2).plan(&conn).unwrap();
            let reason = patch.reason.clone();
            let base = ncclwasm_default::plan_connection(&IbConfig::default(), &conn);
            let plan = patch.apply(base);
            check_plan(&plan, &conn, 128).unwrap();
            assert_eq!((plan.qps.len(), plan.stripe_width), (1, 1), "{reason}");
            ((plan.qps[0].local, plan.qps[0].remote), reason)
        };
        let (first, reason) = on(0);
        assert_eq!(first, (0, 1));
        assert!(
            reason.starts_with("one-sided context 0 of 3: 1 QP on mlx5_0↔mlx5_0 10.0.0.0/24"),
            "{reason}"
        );
        assert_eq!(on(1).0, (1, 0));
        assert_eq!(on(2).0, (0, 1));
    }

    #[test]
    fn qps_rotate_over_pairs_and_never_cross_rails() {
        let ports = topology("roce-8nic");
        let devices = ["mlx5_0", "mlx5_1", "mlx5_2"];
        let local: Vec<_> = devices.iter().map(|d| roce_v4(&ports, d)).collect();
        let peer: Vec<_> = devices.iter().rev().map(|d| roce_v4(&ports, d)).collect();
        let conn = connection(local, peer);
        let qps = rails(2).plan(&conn).unwrap().qps.unwrap();
        assert_eq!(qps.len(), 6);
        let locals: Vec<u32> = qps.iter().map(|q| q.local).collect();
        assert_eq!(locals, [0, 1, 2, 0, 1, 2]);
        for q in &qps {
            let (l, r) = (&conn.local[q.local as usize], &conn.peer[q.remote as usize]);
            assert_eq!(
                Subnet::of(&l.gid),
                Subnet::of(&r.gid),
                "{} -> {}",
                l.device,
                r.device
            );
        }
    }

    #[test]
    fn unpaired_local_ports_stay_idle_and_are_named() {
        let ports = topology("roce-8nic");
        let local = vec![roce_v4(&ports, "mlx5_0"), roce_v4(&ports, "mlx5_4")];
        let conn = connection(local, vec![roce_v4(&ports, "mlx5_0")]);
        let patch = rails(1).plan(&conn).unwrap();
        assert_eq!(patch.qps.unwrap().len(), 1);
        assert_eq!(
            patch.reason,
            "1 QP(s) per pair, 1 per message, none across rails; \
             idle, no peer on their subnet: mlx5_4; \
             rails (local[↔peer] subnet): mlx5_0 10.0.0.0/24"
        );
    }

    #[test]
    fn two_locals_on_one_rail_share_the_only_peer_port() {
        let ports = topology("roce-8nic");
        let a = roce_v4(&ports, "mlx5_0");
        let conn = connection(vec![a.clone(), a.clone()], vec![a]);
        let qps = rails(1).plan(&conn).unwrap().qps.unwrap();
        assert_eq!(qps.iter().map(|q| q.remote).collect::<Vec<_>>(), [0, 0]);
    }

    #[test]
    fn no_common_subnet_means_no_opinion() {
        let ports = topology("roce-8nic");
        let conn = connection(
            vec![roce_v4(&ports, "mlx5_0")],
            vec![roce_v4(&ports, "mlx5_1")],
        );
        assert_eq!(rails(1).plan(&conn), None);
        // A GID whose prefix length the host does not know never pairs, not even with itself.
        let mut unknown = roce_v4(&ports, "mlx5_0");
        unknown.gid.prefix_len = 0;
        assert_eq!(
            rails(1).plan(&connection(vec![unknown.clone()], vec![unknown])),
            None
        );
    }

    #[test]
    fn ib_ports_pair_on_the_subnet_prefix() {
        let ports = topology("dgx-h100");
        let ib = |d: &str| endpoint(port(&ports, d), 0);
        let conn = connection(vec![ib("mlx5_0"), ib("mlx5_1")], vec![ib("mlx5_1")]);
        // Every DGX IB port sits on the default subnet fe80::/64: all pair with the one peer.
        let patch = rails(1).plan(&conn).unwrap();
        assert_eq!(patch.qps.unwrap().len(), 2);
        assert!(
            patch
                .reason
                .ends_with("mlx5_0↔mlx5_1 fe80::/64, mlx5_1 fe80::/64"),
            "{}",
            patch.reason
        );
    }

    #[test]
    fn caps_the_plan_at_128_qps() {
        let ports = topology("roce-8nic");
        let devices = ["mlx5_0", "mlx5_1", "mlx5_2"];
        let eps: Vec<_> = devices.iter().map(|d| roce_v4(&ports, d)).collect();
        let qps = rails(128)
            .plan(&connection(eps.clone(), eps))
            .unwrap()
            .qps
            .unwrap();
        assert_eq!(qps.len(), 126);
    }

    #[test]
    fn eight_rails_fit_in_one_log_line() {
        let ports = topology("roce-8nic");
        let eps: Vec<_> = ports.iter().map(roce_or_v6).collect();
        let patch = rails(1).plan(&connection(eps.clone(), eps)).unwrap();
        assert_eq!(patch.qps.unwrap().len(), 8);
        assert!(
            patch.reason.len() <= 256,
            "{} bytes: {}",
            patch.reason.len(),
            patch.reason
        );
    }

    #[test]
    fn patched_plans_pass_the_hosts_validation() {
        let ports = topology("roce-8nic");
        let all: Vec<_> = ports.iter().map(roce_or_v6).collect();
        // What `ncclwasm policy explain` asks: one local port, the peer's eight.
        let one_to_all = connection(vec![all[0].clone()], all.clone());
        let fused = connection(all[..3].to_vec(), all.iter().rev().cloned().collect());
        for split in ["0", "1"] {
            for qps in ["1", "3"] {
                let pairs = vec![
                    ("NCCL_IB_SPLIT_DATA_ON_QPS".to_string(), split.to_string()),
                    ("NCCL_IB_QPS_PER_CONNECTION".to_string(), qps.to_string()),
                ];
                let ib = IbConfig::from_pairs(&pairs).unwrap();
                let policy = RailAligned::init(&Config::new(pairs)).unwrap();
                for conn in [&one_to_all, &fused] {
                    let base = ncclwasm_default::plan_connection(&ib, conn);
                    let plan = policy.plan(conn).unwrap().apply(base);
                    let at = format!("split {split}, {qps} QPs, {}", conn.device_name);
                    check_plan(&plan, conn, 1 << 16).unwrap_or_else(|e| panic!("{at}: {e:?}"));
                    let want = if split == "1" {
                        plan.qps.len()
                    } else {
                        conn.local.len()
                    };
                    assert_eq!(plan.stripe_width as usize, want, "{at}");
                }
            }
        }
    }

    #[test]
    fn settings() {
        assert_eq!(init("").unwrap().qps_per_pair, 1);
        assert_eq!(init("qps-per-pair=4").unwrap().qps_per_pair, 4);
        let from_nccl = RailAligned::init(&Config::new(vec![(
            "NCCL_IB_QPS_PER_CONNECTION".into(),
            "2".into(),
        )]))
        .unwrap();
        assert_eq!(from_nccl.qps_per_pair, 2);
        assert!(init("qps-per-pair=0").unwrap_err().contains("1..=128"));
        assert!(init("qps=2").unwrap_err().contains("unknown setting `qps`"));
        assert_eq!(init("").unwrap().wait_ms, None);
        assert_eq!(init("wait-ms=2500").unwrap().wait_ms, Some(2500));
        assert_eq!(init("wait-ms=1").unwrap().wait_ms, Some(1));
        assert_eq!(init("wait-ms=10000").unwrap().wait_ms, Some(10_000));
        for bad in ["wait-ms=0", "wait-ms=10001"] {
            let e = init(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("1..=10000"), "{e}");
        }
        let e = init("wait-ms=soon").unwrap_err();
        assert!(e.contains("`wait-ms=soon`"), "{e}");
        let e = init("wait-ms=-1").unwrap_err();
        assert!(e.contains("`wait-ms=-1`"), "{e}");
    }

    #[test]
    fn port_events_wait_on_the_rail_only_with_wait_ms() {
        use ncclwasm_guest::PortEventCause;
        let ports = topology("dual-port");
        let a = endpoint(port(&ports, "mlx5_0"), 3);
        let b = endpoint(port(&ports, "mlx5_1"), 3);
        let conn = connection(vec![a.clone(), b.clone()], vec![a, b]);
        let event = |port, change| PortEvent {
            port,
            change,
            cause: PortEventCause::AsyncEvent,
        };
        let states = [PortState::Down, PortState::Active];
        let mut quiet = init("").unwrap();
        let mut waits = init("wait-ms=2500").unwrap();
        let plan = waits.plan(&conn).unwrap().qps.unwrap();
        for change in [PortChange::Down, PortChange::Up] {
            assert_eq!(
                quiet.on_port_event(&event(0, change), &conn, &plan, &states),
                None
            );
        }
        let down = waits.on_port_event(&event(1, PortChange::Down), &conn, &plan, &states);
        assert_eq!(
            down,
            Some(PortAnswer::Wait {
                ms: 2500,
                reason: "rail mlx5_1:1 held for up to 2500 ms rather than moving its traffic \
                         across rails"
                    .into()
            })
        );
        let up = waits.on_port_event(&event(0, PortChange::Up), &conn, &plan, &states);
        assert_eq!(
            up,
            Some(PortAnswer::FailBack {
                reason: "rail mlx5_0:1 is active again: it carries its share of the traffic".into()
            })
        );
        // The host's validation accepts both, at either end of the range, for either cause.
        for config in ["wait-ms=1", "wait-ms=10000"] {
            let mut p = init(config).unwrap();
            for change in [PortChange::Down, PortChange::Up] {
                for cause in [PortEventCause::AsyncEvent, PortEventCause::FatalCompletion] {
                    let e = PortEvent {
                        cause,
                        ..event(1, change)
                    };
                    let answer = p.on_port_event(&e, &conn, &plan, &states).unwrap();
                    check_port_answer(&answer, &e, &conn, &plan, &states)
                        .unwrap_or_else(|err| panic!("{config} {e:?}: {err:?}"));
                }
            }
        }
    }

    #[test]
    fn rails_rank_the_selected_ports_subnets() {
        let ports = topology("roce-8nic");
        let ib = IbConfig::default();
        let sel = rails_by_subnet(&ib, &ports).expect("eight NICs, eight subnets");
        assert_eq!(
            sel.ports,
            ncclwasm_default::select_devices(&ib, &ports).ports
        );
        let rails = sel.rails.as_ref().unwrap();
        let mut ranks: Vec<i16> = rails.iter().map(|r| r.rail).collect();
        assert!(rails.iter().all(|r| r.plane == ID_UNDEF), "{rails:?}");
        // Every subnet its own rail; the IPv4-mapped ones (::ffff:10.0.k.0/24) rank first, in
        // address order, so mlx5_0 (10.0.0.21) is rail 0 and mlx5_2 (10.0.2.21) rail 2.
        let name = |i: usize| {
            &ports
                .iter()
                .find(|p| p.index == sel.ports[i])
                .unwrap()
                .device
        };
        let rail_of =
            |dev: &str| rails[(0..sel.ports.len()).find(|&i| name(i) == dev).unwrap()].rail;
        assert_eq!((rail_of("mlx5_0"), rail_of("mlx5_2")), (0, 2));
        // mlx5_3 has no IPv4 GID: the built-in picks its link-local one, which names no rail.
        assert_eq!(rail_of("mlx5_3"), ID_UNDEF);
        ranks.sort_unstable();
        assert_eq!(ranks, [-1, 0, 1, 2, 3, 4, 5, 6]);
        assert!(sel.reason.contains("rail 0 10.0.0.0/24"), "{}", sel.reason);
        check_selection(&sel, &ports).unwrap();
    }

    #[test]
    fn one_subnet_or_the_operators_rails_leave_the_rails_alone() {
        assert_eq!(
            rails_by_subnet(&IbConfig::default(), &topology("loopback")),
            None
        );
        let pairs = vec![(
            "NCCL_IB_HCA".to_owned(),
            "mlx5_0:1:5:0,mlx5_2:1:6:0".to_owned(),
        )];
        let ib = IbConfig::from_pairs(&pairs).unwrap();
        assert_eq!(rails_by_subnet(&ib, &topology("roce-8nic")), None);
    }
}
