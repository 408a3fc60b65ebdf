//! How `explain` shows a connection: its plan, QP by QP with the reason of every field, what it
//! does when a port fails, and how messages are striped over it; the one-line forms of a plan
//! that `policy test` compares.

use ncclwasm_inspect::render::{self, Table, field};
use ncclwasm_inspect::report::{self, Report};
use ncclwasm_model::{PortAnswer, PortChange};

use super::{Reasons, hint_text, one_sided_text, source_lines, why};

pub(super) fn connection_section(c: &report::ConnectionView) -> String {
    let plan = &c.plan.decided;
    let mut out = field(
        "connection",
        &format!(
            "device {} ({}) to peer device {} ({}, {} port(s)): {} QP(s)",
            c.device,
            c.device_name,
            c.peer_device,
            c.peer_device_name,
            c.peer.len(),
            plan.value.qps.len()
        ),
    );
    out += &field("  source", &plan.source.text);
    if let Some(hint) = &c.net_attr {
        out += &field("  hint", &format!("setNetAttr: {}", hint_text(hint)));
    }
    if let Some(o) = &c.one_sided {
        out += &field("  one-sided", &one_sided_text(o));
    }
    let mut t = Table::new(2, &["qp", "local", "gid", "remote", "gid", "weight"]);
    for (i, qp) in plan.value.qps.iter().enumerate() {
        let end = |list: &[report::EndpointView], k: u32| {
            list.get(k as usize)
                .map_or((format!("#{k}?"), String::new()), |e| {
                    (e.name.clone(), format!("{} {}", e.gid_index, e.address))
                })
        };
        let (local, lgid) = end(&c.local, qp.local);
        let (remote, rgid) = end(&c.peer, qp.remote);
        t.row(vec![
            i.to_string(),
            local,
            lgid,
            remote,
            rgid,
            qp.weight.to_string(),
        ]);
    }
    out += &t.render();
    let mut t = Table::new(2, &["plan", "value", "source", "why"]);
    for row in report::plan_rows(&c.plan) {
        t.row(vec![
            row.label.to_owned(),
            row.value,
            row.source,
            if row.reason.is_empty() {
                "-".to_owned()
            } else {
                row.reason
            },
        ]);
    }
    out + &t.render()
}

/// Every device's connection in one table (`--all-connections`): what a rail policy is judged
/// by. Reasons shared by several connections are printed once.
pub(super) fn connections_section(all: &[report::ConnectionView]) -> String {
    let out = field(
        "connections",
        &format!("{} device(s) to the peer", all.len()),
    );
    // The policy's own words when it planned; the built-in's whole reason otherwise.
    let whys: Vec<&str> = all
        .iter()
        .map(|c| {
            c.plan
                .policy_reason
                .as_deref()
                .unwrap_or(&c.plan.decided.reason)
        })
        .collect();
    let reasons = Reasons::new(whys.iter().copied());
    let mut header = vec!["dev", "name", "peer", "qps", "tc/sl", "source"];
    if reasons.column() {
        header.push("why");
    }
    let mut t = Table::new(2, &header);
    for (c, w) in all.iter().zip(&whys) {
        let plan = &c.plan.decided.value;
        let mut row = vec![
            c.device.to_string(),
            c.device_name.clone(),
            format!("{} {}", c.peer_device, c.peer_device_name),
            qp_pairs(c),
            format!("{}/{}", plan.tc, plan.sl),
            c.plan.decided.source.label(),
        ];
        if reasons.column() {
            row.push(reasons.mark(w));
        }
        t.row(row);
    }
    out + &t.render() + &reasons.render()
}

/// A plan's QPs as `local>remote` port names, with ` xW` weights when they are not all 1.
pub(crate) fn qp_pairs(c: &report::ConnectionView) -> String {
    let plan = &c.plan.decided.value;
    let weighted = plan.qps.iter().any(|q| q.weight != 1);
    let name = |list: &[report::EndpointView], k: u32| {
        list.get(k as usize)
            .map_or(format!("#{k}"), |e| e.name.clone())
    };
    plan.qps
        .iter()
        .map(|q| {
            let w = if weighted {
                format!(" x{}", q.weight)
            } else {
                String::new()
            };
            format!("{}>{}{w}", name(&c.local, q.local), name(&c.peer, q.remote))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the sample connection does if its first port fails, and when it comes back.
pub(super) fn port_events_section(c: &report::ConnectionView) -> String {
    let mut out = String::new();
    for e in &c.port_events {
        let (label, change) = match e.change {
            PortChange::Down => ("port-down", "down"),
            PortChange::Up => ("port-up", "up"),
        };
        let answer = match &e.answer.value {
            PortAnswer::MoveTo { ports, .. } => {
                let to: Vec<&str> = ports
                    .iter()
                    .map(|&p| c.local.get(p as usize).map_or("?", |v| v.name.as_str()))
                    .collect();
                format!("move its traffic to {}", to.join(", "))
            }
            PortAnswer::Wait { ms, .. } => format!("wait up to {ms} ms for it, then fail"),
            PortAnswer::Fail { .. } => "fail the connection".to_owned(),
            PortAnswer::FailBack { .. } => "fail back to it".to_owned(),
            PortAnswer::Stay { .. } => "stay on the other ports".to_owned(),
        };
        out += &field(label, &format!("{} {change}: {answer}", e.port));
        out += &source_lines(
            &e.answer.source,
            &why(e.answer.value.reason(), &e.answer.source),
        );
    }
    out
}

pub(super) fn striping_section(r: &Report) -> String {
    let qps = r
        .connection
        .as_ref()
        .map_or(0, |c| c.plan.decided.value.qps.len());
    let out = field(
        "striping",
        &format!("first message from QP 0 of {qps}; bytes@offset per QP, '-' = nothing"),
    );
    let mut header = vec!["qp".to_owned()];
    header.extend(r.striping.iter().map(|s| render::size(s.size)));
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Table::new(2, &header);
    let rows = r
        .striping
        .iter()
        .map(|s| s.stripes.len())
        .max()
        .unwrap_or(0);
    for k in 0..rows {
        let qp = r.striping[0].stripes.get(k).map_or(0, |s| s.qp);
        let mut row = vec![qp.to_string()];
        for s in &r.striping {
            row.push(s.stripes.get(k).map_or(String::new(), |st| {
                if st.len == 0 {
                    "-".to_owned()
                } else {
                    format!("{}@{}", st.len, st.offset)
                }
            }));
        }
        t.row(row);
    }
    out + &t.render()
}

/// An `on-port-event` answer in a few words, its ports named: `move-to mlx5_1:1`, `wait 5000`,
/// `fail`, `fail-back`, `stay` (as `policy test` cases write it).
pub(crate) fn port_answer(a: &PortAnswer, c: &report::ConnectionView) -> String {
    match a {
        PortAnswer::MoveTo { ports, .. } => {
            let to: Vec<&str> = ports
                .iter()
                .map(|&p| c.local.get(p as usize).map_or("?", |v| v.name.as_str()))
                .collect();
            format!("move-to {}", to.join(" "))
        }
        PortAnswer::Wait { ms, .. } => format!("wait {ms}"),
        PortAnswer::Fail { .. } => "fail".to_owned(),
        PortAnswer::FailBack { .. } => "fail-back".to_owned(),
        PortAnswer::Stay { .. } => "stay".to_owned(),
    }
}
