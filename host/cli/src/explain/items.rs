//! Every decision of a report under a stable name and worded as `explain` words it: what
//! `policy diff` compares and `policy test` looks up.

use ncclwasm_inspect::report::{self, Report, SourceView};
use ncclwasm_model::PortChange;
use serde::Serialize;

use super::connection::{port_answer, qp_pairs};
use super::vnic_answer;

/// One named decision of a report, as compared.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Item {
    /// What was decided, e.g. `devices`, `gid mlx5_0:1`, `plan qps`.
    #[serde(skip)]
    pub decision: String,
    pub value: String,
    pub reason: String,
    /// Short label: `policy`, `built-in`, `built-in (no opinion)`, `fallback (trap)`, …
    pub source: String,
    /// When the policy faulted and the built-in default decided instead: `cause: detail`.
    pub fault: Option<String>,
}

fn item(decision: impl Into<String>, value: String, reason: &str, source: &SourceView) -> Item {
    Item {
        decision: decision.into(),
        value,
        reason: reason.to_owned(),
        source: source.label(),
        fault: fault(source),
    }
}

/// `cause: detail` of a decision the built-in default made after a fault.
pub(crate) fn fault(s: &SourceView) -> Option<String> {
    let cause = s.cause.as_deref()?;
    Some(format!("{cause}: {}", s.detail.as_deref().unwrap_or("")))
}

/// Every decision of a report under a stable name, its value worded as explain words it:
/// what `policy diff` compares. A new hook's decision is one more item here.
pub fn items(r: &Report) -> Vec<Item> {
    let mut out = Vec::new();
    let mut machine =
        |prefix: &str, d: &report::Decided<Vec<report::DeviceView>>, gids: &[report::PortGid]| {
            let names: Vec<&str> = d.value.iter().map(|v| v.name.as_str()).collect();
            out.push(item(
                format!("{prefix}devices"),
                names.join(" "),
                &d.reason,
                &d.source,
            ));
            for g in gids {
                out.push(item(
                    format!("{prefix}gid {}", g.name),
                    format!("index {} ({})", g.index, g.address),
                    &g.reason,
                    &g.source,
                ));
            }
        };
    machine("", &r.devices, &r.gids);
    if let Some(p) = &r.peer {
        machine("peer ", &p.devices, &p.gids);
    }
    let groups: Vec<String> = r
        .groups
        .value
        .iter()
        .map(|g| format!("{}=[{}]", g.name, g.members.join(" ")))
        .collect();
    out.push(item(
        "fused",
        if groups.is_empty() {
            "none".to_owned()
        } else {
            groups.join(" ")
        },
        &r.groups.reason,
        &r.groups.source,
    ));
    if let Some(v) = &r.vnic {
        out.push(item(
            "vnic",
            format!("fuse {}? {}", v.members.join("+"), vnic_answer(v)),
            &v.answer.reason,
            &v.answer.source,
        ));
    }
    if let Some(c) = &r.connection {
        for row in report::plan_rows(&c.plan) {
            let value = if row.label == "qps" {
                format!("{}: {}", row.value, qp_pairs(c))
            } else {
                row.value
            };
            out.push(Item {
                decision: format!("plan {}", row.label),
                value,
                reason: row.reason,
                source: row.source,
                fault: None,
            });
        }
        // A fault replaces the whole plan: one item for it rather than one per row.
        let source = &c.plan.decided.source;
        let value = if source.kind == "fallback" {
            "built-in plan, after a fault"
        } else {
            "planned"
        };
        out.push(item(
            "plan-connection",
            value.to_owned(),
            &c.plan.decided.reason,
            source,
        ));
        for e in &c.port_events {
            let name = match e.change {
                PortChange::Down => "port-down",
                PortChange::Up => "port-up",
            };
            out.push(item(
                name,
                port_answer(&e.answer.value, c),
                e.answer.value.reason(),
                &e.answer.source,
            ));
        }
    }
    out
}
