//! Is an answer *possible*? Pure checks of every decision against the data it was made over.
//!
//! A policy is untrusted code: its answers are checked here before the host acts on them, and
//! the receiving side of a connection checks the sender's plan with the same function. The checks
//! are about safety and coherence (indices in range, limits of the hardware and of NCCL, no
//! contradictions), never about taste: a policy may make any choice that the data path can
//! execute. The built-in default passes them by construction; the tests below pin the rules.

use std::collections::HashSet;
use std::fmt;

use crate::device_table::{ID_UNDEF, PLANE_INDICES, PLANE_VIRT_BIT};
use crate::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, LinkLayer, MAX_PORT_WAIT_MS,
    Port, PortAnswer, PortChange, PortEvent, PortState, QpPlan, VnicAnswer,
};

/// NCCL's limit on QPs per connection (`NCCL_IB_MAX_QPS`).
pub const MAX_QPS_PER_CONNECTION: u32 = 128;
/// The largest QP timeout exponent the verbs API accepts (5 bits).
pub const MAX_QP_TIMEOUT: u8 = 31;
/// The largest QP retry count the verbs API accepts (3 bits).
pub const MAX_RETRY_CNT: u8 = 7;
/// The largest InfiniBand service level (4 bits).
pub const MAX_SL: u8 = 15;
/// NCCL copies device names into a `char[256]`, NUL included.
pub const MAX_NAME_LEN: usize = 255;

/// Why an answer was refused: one sentence naming the offending value, shown in the WARN the
/// host logs when it falls back, so a policy author can find the bug.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidAnswer(String);

impl InvalidAnswer {
    /// An answer refused by a check outside this module (the data path's own, against the live
    /// connection).
    pub fn new(what: impl fmt::Display) -> Self {
        InvalidAnswer(what.to_string())
    }

    /// The explanation, without any prefix.
    pub fn message(&self) -> &str {
        &self.0
    }
}

type Checked = Result<(), InvalidAnswer>;

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Checked {
    if ok {
        Ok(())
    } else {
        Err(InvalidAnswer(what()))
    }
}

/// The port named by `index` (a `port.index` value) in `ports`.
fn port_named<'a>(ports: &'a [Port], index: u32, role: &str) -> Result<&'a Port, InvalidAnswer> {
    ports.iter().find(|p| p.index == index).ok_or_else(|| {
        let known: Vec<u32> = ports.iter().map(|p| p.index).collect();
        InvalidAnswer::new(format!(
            "{role} names port {index}, which is not one of {known:?}"
        ))
    })
}

fn no_duplicates(values: &[u32], what: &str) -> Checked {
    let mut seen = HashSet::with_capacity(values.len());
    match values.iter().find(|v| !seen.insert(**v)) {
        Some(dup) => Err(InvalidAnswer::new(format!("{what} lists {dup} twice"))),
        None => Ok(()),
    }
}

/// Fused members must share one link layer: the data path cannot stripe one message over an IB
/// and an Ethernet port, and NCCL refuses such vNICs itself.
fn one_link_layer<'a>(members: impl IntoIterator<Item = &'a Port>, what: &str) -> Checked {
    let mut first: Option<&Port> = None;
    for p in members {
        match first {
            None => first = Some(p),
            Some(f) if f.link_layer != p.link_layer => {
                return Err(InvalidAnswer::new(format!(
                    "{what} mixes link layers: {} is {} but {} is {}",
                    f.device,
                    layer_name(f.link_layer),
                    p.device,
                    layer_name(p.link_layer)
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

fn layer_name(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::Infiniband => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
    }
}

fn fused_size(n: usize, max_devs_per_nic: usize, what: &str) -> Checked {
    ensure(n <= max_devs_per_nic, || {
        format!("{what} fuses {n} devices, more than the {max_devs_per_nic} a vNIC may hold")
    })
}

/// `select-devices`: every entry names a port of `ports`, once, and only active ports (NCCL
/// cannot use the others); rails, when given, are one per port, each rail undefined or
/// non-negative, each plane undefined or below the bit that marks a fused device's, and no more
/// distinct planes than NCCL takes on a node.
pub fn check_selection(sel: &DeviceSelection, ports: &[Port]) -> Checked {
    no_duplicates(&sel.ports, "the device selection")?;
    for &i in &sel.ports {
        let p = port_named(ports, i, "the device selection")?;
        ensure(p.state == PortState::Active, || {
            format!(
                "the device selection includes port {i} ({}:{}), which is not active",
                p.device, p.port
            )
        })?;
    }
    let Some(rails) = &sel.rails else {
        return Ok(());
    };
    ensure(rails.len() == sel.ports.len(), || {
        format!(
            "{} rail(s) for {} selected port(s): one per port, in order",
            rails.len(),
            sel.ports.len()
        )
    })?;
    for (r, &i) in rails.iter().zip(&sel.ports) {
        ensure(r.rail >= ID_UNDEF, || {
            format!("port {i}: rail {} is negative (none: undefined)", r.rail)
        })?;
        ensure(
            r.plane == ID_UNDEF || (0..PLANE_VIRT_BIT).contains(&r.plane),
            || {
                format!(
                    "port {i}: plane {} is outside 0..={} (the higher bit marks a fused device's; none: undefined)",
                    r.plane,
                    PLANE_VIRT_BIT - 1
                )
            },
        )?;
    }
    let mut planes: Vec<i16> = rails
        .iter()
        .map(|r| r.plane)
        .filter(|&p| p != ID_UNDEF)
        .collect();
    planes.sort_unstable();
    planes.dedup();
    ensure(planes.len() <= PLANE_INDICES, || {
        format!(
            "{} distinct planes; NCCL takes at most {PLANE_INDICES} on a node",
            planes.len()
        )
    })?;
    Ok(())
}

/// `select-gid`: the index is in the port's GID table and that slot is configured.
pub fn check_gid(choice: &GidChoice, port: &Port) -> Checked {
    let gid = port
        .gids
        .iter()
        .find(|g| g.index == choice.index)
        .ok_or_else(|| {
            InvalidAnswer::new(format!(
                "GID index {} is not in the table of {}:{} ({} entries)",
                choice.index,
                port.device,
                port.port,
                port.gids.len()
            ))
        })?;
    ensure(!gid.is_unconfigured(), || {
        format!(
            "GID index {} of {}:{} is an unconfigured slot",
            choice.index, port.device, port.port
        )
    })
}

/// `group-devices`: each group has 2..=`max_devs_per_nic` distinct members taken from `ports`
/// (the selected ports), one link layer, no port in two groups, and a usable name.
pub fn check_groups(groups: &[DeviceGroup], ports: &[Port], max_devs_per_nic: usize) -> Checked {
    let mut taken: HashSet<u32> = HashSet::new();
    for (g, group) in groups.iter().enumerate() {
        let what = format!("group {g}");
        ensure(group.ports.len() >= 2, || {
            format!(
                "{what} has {} member(s); a group fuses at least 2",
                group.ports.len()
            )
        })?;
        fused_size(group.ports.len(), max_devs_per_nic, &what)?;
        no_duplicates(&group.ports, &what)?;
        let members = group
            .ports
            .iter()
            .map(|&i| port_named(ports, i, &what))
            .collect::<Result<Vec<_>, _>>()?;
        one_link_layer(members, &what)?;
        if let Some(twice) = group.ports.iter().find(|&&i| !taken.insert(i)) {
            return Err(InvalidAnswer::new(format!(
                "port {twice} is in {what} and in an earlier group"
            )));
        }
        if let Some(name) = &group.name {
            ensure(!name.is_empty() && name.len() <= MAX_NAME_LEN, || {
                format!(
                    "{what} name must be 1..={MAX_NAME_LEN} bytes, got {}",
                    name.len()
                )
            })?;
        }
    }
    Ok(())
}

/// `make-vnic`: `request` holds NCCL device indices and `ports[k]` is the port of `request[k]`.
/// Accepting fuses exactly the request, so the request itself must be fusable; a reshape is a
/// non-empty subset of the request without duplicates, within the vNIC size and one link layer.
pub fn check_vnic(
    answer: &VnicAnswer,
    request: &[u32],
    ports: &[Port],
    max_devs_per_nic: usize,
) -> Checked {
    ensure(request.len() == ports.len(), || {
        format!(
            "the request has {} devices but {} ports",
            request.len(),
            ports.len()
        )
    })?;
    let chosen: Vec<usize> = match answer {
        VnicAnswer::Refuse { .. } => return Ok(()),
        VnicAnswer::Accept { .. } => (0..request.len()).collect(),
        VnicAnswer::Reshape { devices, .. } => {
            ensure(!devices.is_empty(), || {
                "the reshaped vNIC is empty".to_owned()
            })?;
            no_duplicates(devices, "the reshaped vNIC")?;
            devices
                .iter()
                .map(|d| {
                    request.iter().position(|r| r == d).ok_or_else(|| {
                        InvalidAnswer::new(format!(
                            "the reshaped vNIC names device {d}, which was not requested ({request:?})"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?
        }
    };
    fused_size(chosen.len(), max_devs_per_nic, "the vNIC")?;
    one_link_layer(chosen.iter().map(|&k| &ports[k]), "the vNIC")
}

/// `plan-connection` (after merging over the built-in plan): QPs 1..=128 and within the local
/// ports' limit `max_qps`, QP endpoints in range, positive weights, and every knob in the range
/// the verbs API and the data path accept.
pub fn check_plan(plan: &ConnPlan, conn: &Connection, max_qps: u32) -> Checked {
    let n = plan.qps.len();
    let limit = max_qps.min(MAX_QPS_PER_CONNECTION);
    ensure(n >= 1 && n as u64 <= u64::from(limit), || {
        format!("the plan has {n} QPs; a connection needs 1..={limit}")
    })?;
    for (q, qp) in plan.qps.iter().enumerate() {
        ensure((qp.local as usize) < conn.local.len(), || {
            format!(
                "QP {q} uses local port {} but the connection has {} local port(s)",
                qp.local,
                conn.local.len()
            )
        })?;
        ensure((qp.remote as usize) < conn.peer.len(), || {
            format!(
                "QP {q} uses peer port {} but the peer advertised {} port(s)",
                qp.remote,
                conn.peer.len()
            )
        })?;
        ensure(qp.weight > 0, || {
            format!("QP {q} has weight 0; weights are > 0")
        })?;
    }
    ensure(
        plan.stripe_width >= 1 && plan.stripe_width as usize <= n,
        || {
            format!(
                "stripe width {} is outside 1..={n} (the QP count)",
                plan.stripe_width
            )
        },
    )?;
    ensure(plan.align.is_power_of_two(), || {
        format!("alignment {} is not a power of two", plan.align)
    })?;
    ensure((1..=MAX_QP_TIMEOUT).contains(&plan.timeout), || {
        format!(
            "QP timeout {} is outside 1..={MAX_QP_TIMEOUT}",
            plan.timeout
        )
    })?;
    ensure(plan.retry_cnt <= MAX_RETRY_CNT, || {
        format!(
            "retry count {} is outside 0..={MAX_RETRY_CNT}",
            plan.retry_cnt
        )
    })?;
    ensure(plan.sl <= MAX_SL, || {
        format!("service level {} is outside 0..={MAX_SL}", plan.sl)
    })
}

/// `on-port-event`: the case answers the change (`move-to`/`wait`/`fail` a port-down,
/// `fail-back`/`stay` a port-up); `move-to` names distinct ports of the vNIC (`conn.local`) that
/// are active in `states`, are not the failed port, and carry a QP of the plan `qps` (the data
/// path moves traffic onto existing QPs only); `wait` is 1..=[`MAX_PORT_WAIT_MS`].
pub fn check_port_answer(
    answer: &PortAnswer,
    event: &PortEvent,
    conn: &Connection,
    qps: &[QpPlan],
    states: &[PortState],
) -> Checked {
    let change = match event.change {
        PortChange::Down => "port-down",
        PortChange::Up => "port-up",
    };
    ensure(answer.answers(event.change), || {
        format!("{} does not answer a {change}", answer.kind())
    })?;
    match answer {
        PortAnswer::MoveTo { ports, .. } => {
            ensure(!ports.is_empty(), || {
                "move-to names no port to move the traffic to".to_owned()
            })?;
            no_duplicates(ports, "move-to")?;
            for &p in ports {
                ensure((p as usize) < conn.local.len(), || {
                    format!(
                        "move-to names port {p} but the vNIC has {} port(s)",
                        conn.local.len()
                    )
                })?;
                ensure(p != event.port, || {
                    format!("move-to names port {p}, the port that failed")
                })?;
                ensure(states.get(p as usize) == Some(&PortState::Active), || {
                    format!("move-to names port {p}, which is not active")
                })?;
                ensure(qps.iter().any(|q| q.local == p), || {
                    format!("move-to names port {p}, which carries no QP of the connection")
                })?;
            }
            Ok(())
        }
        PortAnswer::Wait { ms, .. } => ensure((1..=MAX_PORT_WAIT_MS).contains(ms), || {
            format!("wait of {ms} ms is outside 1..={MAX_PORT_WAIT_MS}")
        }),
        PortAnswer::Fail { .. } | PortAnswer::FailBack { .. } | PortAnswer::Stay { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, Gid, GidType, QpPlan};

    fn port(index: u32, device: &str, layer: LinkLayer, state: PortState) -> Port {
        Port {
            index,
            device: device.to_owned(),
            port: 1,
            state,
            link_layer: layer,
            speed_mbps: 200_000,
            width: 4,
            mtu: 4096,
            lid: 0,
            pci_path: String::new(),
            full_pci_path: String::new(),
            guid: u64::from(index),
            numa_node: 0,
            max_qps: 64,
            provider: "mlx5".to_owned(),
            gids: vec![
                Gid::unconfigured(0),
                Gid::new(1, "fe80::1".parse().unwrap(), GidType::RoceV2, 64),
                Gid::new(2, "::ffff:10.0.0.1".parse().unwrap(), GidType::RoceV2, 24),
            ],
        }
    }

    fn ports() -> Vec<Port> {
        vec![
            port(0, "mlx5_0", LinkLayer::Ethernet, PortState::Active),
            port(1, "mlx5_1", LinkLayer::Ethernet, PortState::Active),
            port(2, "mlx5_2", LinkLayer::Infiniband, PortState::Active),
            port(3, "mlx5_3", LinkLayer::Ethernet, PortState::Down),
        ]
    }

    fn sel(ports: &[u32]) -> DeviceSelection {
        DeviceSelection {
            ports: ports.to_vec(),
            rails: None,
            reason: String::new(),
        }
    }

    fn err(r: Checked) -> String {
        r.expect_err("should be refused").message().to_owned()
    }

    #[test]
    fn selection_rules() {
        let p = ports();
        assert!(check_selection(&sel(&[2, 0, 1]), &p).is_ok());
        assert!(check_selection(&sel(&[]), &p).is_ok());
        assert!(err(check_selection(&sel(&[99]), &p)).contains("port 99"));
        assert!(err(check_selection(&sel(&[0, 0]), &p)).contains("twice"));
        assert!(err(check_selection(&sel(&[3]), &p)).contains("not active"));
        let with = |ids: &[(i16, i16)]| DeviceSelection {
            rails: Some(
                ids.iter()
                    .map(|&(rail, plane)| crate::device_table::RailPlane { rail, plane })
                    .collect(),
            ),
            ..sel(&[0, 1, 2][..ids.len().min(3)])
        };
        assert!(check_selection(&with(&[(0, 5), (1, -1), (-1, 16383)]), &p).is_ok());
        let short = DeviceSelection {
            ports: vec![0, 1, 2],
            ..with(&[(0, 0), (1, 0)])
        };
        assert!(err(check_selection(&short, &p)).contains("2 rail(s) for 3 selected port(s)"));
        assert!(err(check_selection(&with(&[(-2, 0)]), &p)).contains("rail -2 is negative"));
        assert!(err(check_selection(&with(&[(0, 16384)]), &p)).contains("plane 16384"));
    }

    #[test]
    fn gid_rules() {
        let p = &ports()[0];
        let c = |index| GidChoice {
            index,
            reason: String::new(),
        };
        assert!(check_gid(&c(1), p).is_ok());
        assert!(check_gid(&c(2), p).is_ok());
        assert!(err(check_gid(&c(0), p)).contains("unconfigured"));
        assert!(err(check_gid(&c(7), p)).contains("not in the table"));
    }

    fn group(ports: &[u32]) -> DeviceGroup {
        DeviceGroup {
            ports: ports.to_vec(),
            name: None,
            reason: String::new(),
        }
    }

    #[test]
    fn group_rules() {
        let p = ports();
        assert!(check_groups(&[group(&[0, 1])], &p, 4).is_ok());
        assert!(check_groups(&[], &p, 4).is_ok());
        assert!(err(check_groups(&[group(&[0])], &p, 4)).contains("at least 2"));
        assert!(err(check_groups(&[group(&[0, 1])], &p, 1)).contains("more than the 1"));
        assert!(err(check_groups(&[group(&[0, 2])], &p, 4)).contains("mixes link layers"));
        assert!(err(check_groups(&[group(&[0, 0])], &p, 4)).contains("twice"));
        assert!(err(check_groups(&[group(&[0, 9])], &p, 4)).contains("port 9"));
        let two = [group(&[0, 1]), group(&[1, 3])];
        assert!(err(check_groups(&two, &p, 4)).contains("earlier group"));
        let unnamed = DeviceGroup {
            name: Some(String::new()),
            ..group(&[0, 1])
        };
        assert!(err(check_groups(&[unnamed], &p, 4)).contains("name"));
    }

    #[test]
    fn vnic_rules() {
        let p = ports();
        let eth = [p[0].clone(), p[1].clone()];
        let mixed = [p[0].clone(), p[2].clone()];
        let accept = VnicAnswer::Accept {
            reason: String::new(),
        };
        let reshape = |devices: &[u32]| VnicAnswer::Reshape {
            devices: devices.to_vec(),
            reason: String::new(),
        };
        let refuse = VnicAnswer::Refuse {
            reason: String::new(),
        };
        assert!(check_vnic(&accept, &[4, 5], &eth, 4).is_ok());
        assert!(check_vnic(&refuse, &[4, 5], &mixed, 4).is_ok());
        assert!(err(check_vnic(&accept, &[4, 5], &mixed, 4)).contains("mixes"));
        assert!(err(check_vnic(&accept, &[4, 5], &eth, 1)).contains("more than"));
        assert!(check_vnic(&reshape(&[4]), &[4, 5], &mixed, 4).is_ok());
        assert!(err(check_vnic(&reshape(&[]), &[4, 5], &eth, 4)).contains("empty"));
        assert!(err(check_vnic(&reshape(&[6]), &[4, 5], &eth, 4)).contains("not requested"));
        assert!(err(check_vnic(&reshape(&[4, 4]), &[4, 5], &eth, 4)).contains("twice"));
    }

    fn endpoint() -> Endpoint {
        let p = port(0, "mlx5_0", LinkLayer::Ethernet, PortState::Active);
        Endpoint {
            device: p.device,
            port: p.port,
            link_layer: p.link_layer,
            speed_mbps: p.speed_mbps,
            mtu: p.mtu,
            lid: p.lid,
            gid: p.gids[2].clone(),
        }
    }

    fn plan(n: u32) -> ConnPlan {
        ConnPlan {
            qps: (0..n)
                .map(|q| QpPlan {
                    local: q % 2,
                    remote: 0,
                    weight: 1,
                })
                .collect(),
            stripe_width: 1,
            align: 128,
            ar_threshold: 8192,
            timeout: 20,
            retry_cnt: 7,
            ..ConnPlan::default()
        }
    }

    #[test]
    fn plan_rules() {
        let conn = Connection {
            net_attr: None,
            one_sided: None,
            comm_id: 1,
            traffic_class: -1,
            device: 0,
            device_name: "mlx5_0+mlx5_1".to_owned(),
            local: vec![endpoint(), endpoint()],
            peer: vec![endpoint()],
        };
        assert!(check_plan(&plan(2), &conn, 64).is_ok());
        assert!(err(check_plan(&plan(0), &conn, 64)).contains("0 QPs"));
        assert!(err(check_plan(&plan(129), &conn, 1024)).contains("1..=128"));
        assert!(err(check_plan(&plan(8), &conn, 4)).contains("1..=4"));
        let bad = |f: fn(&mut ConnPlan)| {
            let mut p = plan(2);
            f(&mut p);
            err(check_plan(&p, &conn, 64))
        };
        assert!(bad(|p| p.qps[0].local = 2).contains("local port 2"));
        assert!(bad(|p| p.qps[1].remote = 1).contains("peer port 1"));
        assert!(bad(|p| p.qps[0].weight = 0).contains("weight 0"));
        assert!(bad(|p| p.stripe_width = 3).contains("stripe width 3"));
        assert!(bad(|p| p.stripe_width = 0).contains("stripe width 0"));
        assert!(bad(|p| p.align = 96).contains("power of two"));
        assert!(bad(|p| p.align = 0).contains("power of two"));
        assert!(bad(|p| p.timeout = 0).contains("timeout 0"));
        assert!(bad(|p| p.timeout = 32).contains("timeout 32"));
        assert!(bad(|p| p.retry_cnt = 8).contains("retry count 8"));
        assert!(bad(|p| p.sl = 16).contains("service level 16"));
    }
    #[test]
    fn port_answer_rules() {
        use crate::PortEventCause;
        let conn = Connection {
            net_attr: None,
            one_sided: None,
            comm_id: 1,
            traffic_class: -1,
            device: 0,
            device_name: "mlx5_0+mlx5_1+mlx5_2".to_owned(),
            local: vec![endpoint(), endpoint(), endpoint()],
            peer: vec![endpoint()],
        };
        // QPs on ports 0 and 1; port 2 carries none.
        let qps = plan(4).qps;
        let states = [PortState::Down, PortState::Active, PortState::Active];
        let down = PortEvent {
            port: 0,
            change: PortChange::Down,
            cause: PortEventCause::AsyncEvent,
        };
        let up = PortEvent {
            change: PortChange::Up,
            ..down
        };
        let reason = String::new;
        let move_to = |ports: &[u32]| PortAnswer::MoveTo {
            ports: ports.to_vec(),
            reason: reason(),
        };
        let check = |a: &PortAnswer, e: &PortEvent| check_port_answer(a, e, &conn, &qps, &states);
        assert!(check(&move_to(&[1]), &down).is_ok());
        assert!(check(&PortAnswer::Fail { reason: reason() }, &down).is_ok());
        assert!(
            check(
                &PortAnswer::Wait {
                    ms: 500,
                    reason: reason()
                },
                &down
            )
            .is_ok()
        );
        assert!(check(&PortAnswer::Stay { reason: reason() }, &up).is_ok());
        assert!(check(&PortAnswer::FailBack { reason: reason() }, &up).is_ok());
        assert!(err(check(&move_to(&[]), &down)).contains("no port"));
        assert!(err(check(&move_to(&[1, 1]), &down)).contains("twice"));
        assert!(err(check(&move_to(&[3]), &down)).contains("has 3 port(s)"));
        assert!(err(check(&move_to(&[0]), &down)).contains("the port that failed"));
        assert!(err(check(&move_to(&[2]), &down)).contains("carries no QP"));
        let inactive = [PortState::Down, PortState::Down, PortState::Active];
        assert!(
            err(check_port_answer(
                &move_to(&[1]),
                &down,
                &conn,
                &qps,
                &inactive
            ))
            .contains("not active")
        );
        assert!(
            err(check(
                &PortAnswer::Wait {
                    ms: 0,
                    reason: reason()
                },
                &down
            ))
            .contains("1..=")
        );
        let long = PortAnswer::Wait {
            ms: MAX_PORT_WAIT_MS + 1,
            reason: reason(),
        };
        assert!(err(check(&long, &down)).contains("outside"));
        assert!(
            err(check(&PortAnswer::Stay { reason: reason() }, &down))
                .contains("stay does not answer a port-down")
        );
        assert!(err(check(&move_to(&[1]), &up)).contains("move-to does not answer a port-up"));
    }
}
