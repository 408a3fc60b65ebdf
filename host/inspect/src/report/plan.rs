//! A connection plan as `explain` and `diff` show it: who set which field ([`plan_view`], read
//! back from the plan's reason) and the rows of related fields with their values and reasons
//! ([`plan_rows`]).

use ncclwasm_model::ConnPlan;
use ncclwasm_policy::{Decision, Source};

use super::{PlanView, decided};

/// The plan with field attribution. `PlanPatch::apply` words a policy's plan reason as
/// `policy set <fields>: <why>; built-in default for the rest: <base reason>`, or `policy set
/// every field: <why>`; that is read back here (the format is pinned by a test below). Should it
/// not parse, the fields that differ from the built-in plan are taken as the policy's, with the
/// whole reason.
pub(super) fn plan_view(plan: Decision<ConnPlan>, base: &ConnPlan) -> PlanView {
    let by_policy = matches!(plan.source, Source::Policy(_));
    let every = |why: &str| {
        let fields = ConnPlan::FIELDS.iter().map(|f| (*f).to_owned()).collect();
        (fields, why.to_owned())
    };
    let parsed = match plan.reason.strip_prefix("policy set every field: ") {
        Some(why) => Some(every(why)),
        None => plan
            .reason
            .strip_suffix(&format!("; built-in default for the rest: {}", base.reason))
            .and_then(|r| r.strip_prefix("policy set "))
            .and_then(|r| r.split_once(": "))
            .map(|(fields, why)| {
                let fields = fields.split(", ").map(str::to_owned).collect::<Vec<_>>();
                (fields, why.to_owned())
            }),
    };
    let (policy_set, policy_reason) = match (by_policy, parsed) {
        (false, _) => (Vec::new(), None),
        (true, Some((fields, why))) => (fields, Some(why)),
        (true, None) => (
            plan.value
                .changed_fields(base)
                .into_iter()
                .map(str::to_owned)
                .collect(),
            Some(plan.reason.clone()),
        ),
    };
    PlanView {
        decided: decided(plan, |p| p),
        policy_set,
        policy_reason,
        builtin_reason: base.reason.clone(),
    }
}

/// One line of a plan as `explain` and `diff` show it: a few related fields, their values, and
/// who set them why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRow {
    pub label: &'static str,
    pub value: String,
    /// A short source label (see [`SourceView::label`]).
    pub source: String,
    pub reason: String,
}

/// The rows of a plan: label, the fields shown (WIT names), and the phrases by which the
/// built-in default's reason clauses are recognised (its reason is `; `-separated clauses, one
/// per concern; `plan_rows_cover_every_builtin_clause` checks they are all claimed).
const PLAN_ROWS: [(&str, &[&str], &[&str]); 6] = [
    ("qps", &["qps"], &["NCCL_IB_QPS_PER_CONNECTION", "no QPs"]),
    (
        "stripe width",
        &["stripe-width"],
        &["NCCL_IB_SPLIT_DATA_ON_QPS", "each put or get striped"],
    ),
    ("align", &["align"], &["aligned to"]),
    (
        "adaptive routing",
        &["adaptive-routing", "ar-threshold"],
        &["adaptive routing", "NCCL_IB_AR_THRESHOLD"],
    ),
    ("tc / sl / fifo tc", &["tc", "sl", "fifo-tc"], &["FIFO TC"]),
    (
        "ece / timeout / retry",
        &["ece", "timeout", "retry-cnt"],
        &["NCCL_IB_ECE_ENABLE", "NCCL_IB_TIMEOUT"],
    ),
];

pub fn plan_rows(plan: &PlanView) -> Vec<PlanRow> {
    let p = &plan.decided.value;
    let clauses: Vec<&str> = plan.builtin_reason.split("; ").collect();
    let builtin_label = match plan.decided.source.kind {
        "policy" => "built-in".to_owned(),
        _ => plan.decided.source.label(),
    };
    let mut claimed = vec![false; clauses.len()];
    let mut policy_reason_shown = false;
    let mut rows: Vec<PlanRow> = PLAN_ROWS
        .iter()
        .map(|(label, fields, phrases)| {
            let mut mine = Vec::new();
            for (c, clause) in clauses.iter().enumerate() {
                if !claimed[c] && phrases.iter().any(|ph| clause.contains(ph)) {
                    claimed[c] = true;
                    mine.push(*clause);
                }
            }
            let by_policy = fields
                .iter()
                .any(|f| plan.policy_set.iter().any(|s| s == f));
            let (source, reason) = if by_policy {
                let why = plan
                    .policy_reason
                    .as_deref()
                    .unwrap_or(&plan.decided.reason);
                // A policy that words its reason in clauses as the built-in does gets the
                // clauses of this row; otherwise its whole reason is shown once.
                let matched: Vec<&str> = why
                    .split("; ")
                    .filter(|c| phrases.iter().any(|ph| c.contains(ph)))
                    .collect();
                let reason = if !matched.is_empty() {
                    matched.join("; ")
                } else if !policy_reason_shown {
                    policy_reason_shown = true;
                    why.to_owned()
                } else {
                    "(the policy's reason above)".to_owned()
                };
                ("policy".to_owned(), reason)
            } else {
                (builtin_label.clone(), mine.join("; "))
            };
            PlanRow {
                label,
                value: plan_value(label, p),
                source,
                reason,
            }
        })
        .collect();
    let rest: Vec<&str> = clauses
        .iter()
        .zip(&claimed)
        .filter(|(c, taken)| !**taken && !c.is_empty())
        .map(|(c, _)| *c)
        .collect();
    if !rest.is_empty() {
        rows.push(PlanRow {
            label: "also",
            value: String::new(),
            source: builtin_label,
            reason: rest.join("; "),
        });
    }
    rows
}

fn plan_value(label: &str, p: &ConnPlan) -> String {
    match label {
        "qps" => p.qps.len().to_string(),
        "stripe width" => format!("{} of {} QPs per message", p.stripe_count(), p.qps.len()),
        "align" => format!("{} bytes", p.align),
        "adaptive routing" => adaptive_routing_value(p.adaptive_routing, p.ar_threshold),
        "tc / sl / fifo tc" => format!("{} / {} / {}", p.tc, p.sl, p.fifo_tc),
        "ece / timeout / retry" => ece_timeout_retry_value(p.ece, p.timeout, p.retry_cnt),
        _ => String::new(),
    }
}

/// Each plan row's label and its value for `p`, as `explain` shows them (`bench` shows the plan
/// its connection ran with the same words).
pub fn plan_values(p: &ConnPlan) -> impl Iterator<Item = (&'static str, String)> + '_ {
    PLAN_ROWS
        .iter()
        .map(move |(label, _, _)| (*label, plan_value(label, p)))
}

/// The "adaptive routing" value of a plan: `on above N bytes` or `off`.
fn adaptive_routing_value(on: bool, threshold: u64) -> String {
    if on {
        format!("on above {threshold} bytes")
    } else {
        "off".into()
    }
}

/// The "ece / timeout / retry" value of a plan, the timeout also as a duration.
fn ece_timeout_retry_value(ece: bool, timeout: u8, retry_cnt: u8) -> String {
    // The QP timeout is 4.096 µs × 2^timeout.
    let secs = 4.096e-6 * f64::from(1u32 << timeout.min(31));
    format!(
        "{} / {timeout} ({}) / {retry_cnt}",
        if ece { "on" } else { "off" },
        crate::render::duration(secs)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use ncclwasm_default::IbConfig;
    use ncclwasm_model::{Connection, Endpoint, PlanPatch, QpPlan, Topology};
    use ncclwasm_policy::{Hook, PolicyId};

    fn base() -> ConnPlan {
        plan(None)
    }

    /// The built-in plan of mlx5_0 to the peer's first two ports, one-sided or not.
    fn plan(one_sided: Option<ncclwasm_model::OneSided>) -> ConnPlan {
        let ports = Topology::load(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../topologies/dgx-h100.toml"
        ))
        .unwrap()
        .ports();
        let ib = IbConfig::from_pairs(&[]).unwrap();
        let ends: Vec<Endpoint> = ports[..2].iter().map(|p| p.endpoint(0)).collect();
        let conn = Connection {
            net_attr: None,
            one_sided,
            comm_id: 0,
            traffic_class: -1,
            device: 0,
            device_name: "mlx5_0".into(),
            local: ends[..1].to_vec(),
            peer: ends,
        };
        ncclwasm_default::plan_connection(&ib, &conn)
    }

    fn policy_source() -> Source {
        Source::Policy(Arc::new(PolicyId {
            name: "p".into(),
            version: "1".into(),
            sha256: "00".into(),
            origin: "p.wasm".into(),
            hooks: Hook::DECISIONS.to_vec(),
            compilation: ncclwasm_policy::Compilation {
                bytes: 0,
                imports: Vec::new(),
                time: std::time::Duration::ZERO,
                cache: ncclwasm_policy::CompileCache::Off,
            },
        }))
    }

    #[test]
    fn builtin_plan_rows_each_get_their_clause() {
        let base = base();
        let view = plan_view(
            Decision {
                reason: base.reason.clone(),
                value: base.clone(),
                source: Source::Builtin,
            },
            &base,
        );
        assert!(view.policy_set.is_empty());
        let rows = plan_rows(&view);
        let row = |l: &str| rows.iter().find(|r| r.label == l).unwrap().clone();
        assert!(row("qps").reason.contains("NCCL_IB_QPS_PER_CONNECTION=1"));
        assert_eq!(row("qps").value, "2");
        assert!(
            row("stripe width")
                .reason
                .starts_with("NCCL_IB_SPLIT_DATA_ON_QPS=0")
        );
        assert!(
            row("adaptive routing")
                .reason
                .contains("NCCL_IB_AR_THRESHOLD")
        );
        assert_eq!(row("adaptive routing").value, "on above 8192 bytes");
        assert!(row("tc / sl / fifo tc").reason.starts_with("TC 0"));
        assert!(
            row("ece / timeout / retry")
                .reason
                .contains("NCCL_IB_RETRY_CNT")
        );
        assert_eq!(row("ece / timeout / retry").value, "on / 20 (4.3 s) / 7");
        assert!(rows.iter().all(|r| r.source == "built-in"));
    }

    #[test]
    fn plan_rows_cover_every_builtin_clause() {
        let one_sided = ncclwasm_model::OneSided {
            context: 0,
            contexts: 1,
            rank: 0,
            peer: 1,
            nranks: 2,
        };
        for base in [base(), plan(Some(one_sided))] {
            let rows = plan_rows(&plan_view(
                Decision {
                    reason: base.reason.clone(),
                    value: base.clone(),
                    source: Source::Builtin,
                },
                &base,
            ));
            assert!(rows.iter().all(|r| r.label != "also"), "{rows:?}");
        }
    }

    #[test]
    fn policy_fields_are_read_back_from_the_patch_reason() {
        let base = base();
        let plan = PlanPatch {
            qps: Some(vec![QpPlan {
                local: 0,
                remote: 0,
                weight: 1,
            }]),
            tc: Some(106),
            reason: "one rail: keep it local".into(),
            ..PlanPatch::default()
        }
        .apply(base.clone());
        let view = plan_view(
            Decision {
                reason: plan.reason.clone(),
                value: plan,
                source: policy_source(),
            },
            &base,
        );
        assert_eq!(view.policy_set, ["qps", "tc"]);
        assert_eq!(
            view.policy_reason.as_deref(),
            Some("one rail: keep it local")
        );
        let rows = plan_rows(&view);
        let row = |l: &str| rows.iter().find(|r| r.label == l).unwrap().clone();
        assert_eq!(
            (row("qps").source.as_str(), row("qps").reason.as_str()),
            ("policy", "one rail: keep it local")
        );
        assert_eq!(row("tc / sl / fifo tc").value, "106 / 0 / 0");
        assert_eq!(row("stripe width").source, "built-in");
    }

    #[test]
    fn unparsable_policy_reason_falls_back_to_comparing_values() {
        let base = base();
        let mut plan = base.clone();
        plan.timeout = 18;
        plan.reason = "hand-made".into();
        let view = plan_view(
            Decision {
                reason: plan.reason.clone(),
                value: plan,
                source: policy_source(),
            },
            &base,
        );
        assert_eq!(view.policy_set, ["timeout"]);
        assert_eq!(view.policy_reason.as_deref(), Some("hand-made"));
    }
}
