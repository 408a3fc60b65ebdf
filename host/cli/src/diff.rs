//! `ncclwasm policy diff A B`: the decisions two policies make differently on the same machine,
//! each side with its value, reason and source. Exit status 0 when they agree, 1 when they differ
//! (as diff(1)), 2 on trouble.
//!
//! Both reports are flattened into the same list of named decisions (explain's [`items`]) and compared by
//! value: the same decision for a different reason, or from a different source, is no difference
//! (a wasm build of the built-in default must show none). The exception is a fault: a decision
//! one side made only by falling back is that policy's failure, and is shown.

use clap::Args as ClapArgs;
use ncclwasm_inspect::render::{field, json};
use ncclwasm_inspect::report::{self, PolicyView, Report, TopologyView};
use ncclwasm_inspect::setup::{self, ConfigArgs, MachineArgs, PolicyArg};
use ncclwasm_model::OneSided;
use serde::Serialize;

use crate::explain::{Item, items};
use crate::fail::{Exit, Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The first policy: a component (.wasm) or `builtin`
    #[arg(value_name = "A")]
    pub a: PolicyArg,

    /// The second policy: a component (.wasm) or `builtin`
    #[arg(value_name = "B")]
    pub b: PolicyArg,

    #[command(flatten)]
    pub machines: MachineArgs,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// NCCL_WASM_POLICY_CONFIG for A only (instead of --config): policies refuse settings
    /// meant for another
    #[arg(long, value_name = "S")]
    pub config_a: Option<String>,

    /// NCCL_WASM_POLICY_CONFIG for B only (instead of --config)
    #[arg(long, value_name = "S")]
    pub config_b: Option<String>,

    /// Compare the plans of one-sided traffic (NCCL's RMA tables) instead: where the sample
    /// connection sits in its RMA communicator, as `policy explain --one-sided`
    #[arg(long, value_name = "TOML", value_parser = crate::explain::inline_table::<OneSided>)]
    pub one_sided: Option<OneSided>,

    /// Print the differences as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let (local, peer) = setup::topologies(&args.machines)?;
    let settings = setup::settings(&args.config)?;
    let telemetry = setup::telemetry(args.machines.telemetry.as_deref(), &local.ports())?
        .map(std::sync::Arc::new);
    let mut reports = Vec::with_capacity(2);
    for (policy, config) in [(&args.a, &args.config_a), (&args.b, &args.config_b)] {
        let mut settings = settings.clone();
        if let Some(config) = config {
            settings.config = Some(config.clone());
        }
        let (host, view) = setup::host(settings, policy)?;
        if let Some(t) = &telemetry {
            host.set_telemetry(t.clone());
        }
        reports.push(report::evaluate(
            &host,
            view,
            &local,
            peer.as_ref(),
            &[],
            report::Connections::Sample,
            report::ConnShape {
                net_attr: None,
                one_sided: args.one_sided,
            },
        )?);
    }
    let diff = compare(&reports[0], &reports[1]);
    let exit = if diff.differences.is_empty() {
        Exit::Success
    } else {
        Exit::No
    };
    let text = if args.json {
        json(&diff)?
    } else {
        render(&diff)
    };
    Ok(Outcome { text, exit })
}

/// A decision the two sides make differently; a side that did not make it at all (a port only
/// one of them selected) is `None`.
#[derive(Clone, Debug, Serialize)]
pub struct Difference {
    pub decision: String,
    pub a: Option<Item>,
    pub b: Option<Item>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Diff {
    pub a: PolicyView,
    pub b: PolicyView,
    pub topology: TopologyView,
    pub peer_topology: TopologyView,
    pub equal: bool,
    pub differences: Vec<Difference>,
}

/// The decisions of `a` and `b` that differ, in `a`'s order, then those only `b` made. A
/// decision differs when its value does, or when one side faulted and fell back to the built-in
/// default: that side's policy did not make it, whatever the value.
pub fn compare(a: &Report, b: &Report) -> Diff {
    let (ia, ib) = (items(a), items(b));
    let find = |list: &[Item], key: &str| list.iter().find(|i| i.decision == key).cloned();
    let same = |x: &Item, y: &Item| x.value == y.value && x.fault.is_some() == y.fault.is_some();
    let mut differences: Vec<Difference> = ia
        .iter()
        .filter_map(|x| {
            let y = find(&ib, &x.decision);
            (!y.as_ref().is_some_and(|y| same(x, y))).then(|| Difference {
                decision: x.decision.clone(),
                a: Some(x.clone()),
                b: y,
            })
        })
        .collect();
    differences.extend(
        ib.iter()
            .filter(|y| find(&ia, &y.decision).is_none())
            .map(|y| Difference {
                decision: y.decision.clone(),
                a: None,
                b: Some(y.clone()),
            }),
    );
    Diff {
        a: a.policy.clone(),
        b: b.policy.clone(),
        topology: a.topology.clone(),
        peer_topology: a.peer_topology.clone(),
        equal: differences.is_empty(),
        differences,
    }
}

pub fn render(d: &Diff) -> String {
    let who = |p: &PolicyView| match &p.origin {
        Some(origin) => format!("{} {}  ({origin})", p.name, p.version),
        None => "built-in default (NCCL's own decisions)".to_owned(),
    };
    let mut out = field("a", &who(&d.a)) + &field("b", &who(&d.b));
    out += &field(
        "topology",
        &format!("{}  ({})", d.topology.name, d.topology.origin),
    );
    if d.peer_topology.origin != d.topology.origin {
        out += &field(
            "peer",
            &format!("{}  ({})", d.peer_topology.name, d.peer_topology.origin),
        );
    }
    out.push('\n');
    if d.differences.is_empty() {
        return out + "no differences\n";
    }
    for diff in &d.differences {
        out += &diff.decision;
        out.push('\n');
        for (side, it) in [("a", &diff.a), ("b", &diff.b)] {
            match it {
                None => out += &format!("  {side}  (not decided: no such port or device)\n"),
                Some(it) => {
                    out += &format!("  {side}  {}\n", it.value);
                    let reason = if it.reason.is_empty() {
                        "-"
                    } else {
                        &it.reason
                    };
                    out += &format!("     {}: {reason}\n", it.source);
                    if let Some(fault) = &it.fault {
                        out += &format!("     fault: {fault}\n");
                    }
                }
            }
        }
    }
    let n = d.differences.len();
    out + &format!(
        "\n{n} decision{} differ{}\n",
        if n == 1 { "" } else { "s" },
        if n == 1 { "s" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::corpus_report;

    #[test]
    fn equal_reports_have_no_differences() {
        let r = corpus_report("k8s-pod");
        let d = compare(&r, &r);
        assert!(d.equal && d.differences.is_empty());
        assert!(render(&d).ends_with("\nno differences\n"));
    }

    #[test]
    fn a_changed_gid_and_a_missing_port_are_differences() {
        let a = corpus_report("k8s-pod");
        let mut b = a.clone();
        b.gids[0].index = 1;
        b.gids[0].address = "fe80::1".into();
        b.gids[0].reason = "mine".into();
        b.gids.pop();
        let d = compare(&a, &b);
        let names: Vec<&str> = d.differences.iter().map(|x| x.decision.as_str()).collect();
        assert_eq!(names, ["gid mlx5_2:1", "gid mlx5_5:1"]);
        assert_eq!(
            d.differences[0].b.as_ref().unwrap().value,
            "index 1 (fe80::1)"
        );
        assert!(d.differences[1].b.is_none());
        let text = render(&d);
        assert!(
            text.contains("gid mlx5_2:1\n  a  index 3 (::ffff:10.244.1.17)\n"),
            "{text}"
        );
        assert!(
            text.contains("  b  (not decided: no such port or device)\n"),
            "{text}"
        );
        assert!(text.ends_with("\n2 decisions differ\n"), "{text}");
    }

    #[test]
    fn same_value_from_another_source_or_reason_is_no_difference() {
        let a = corpus_report("loopback");
        let mut b = a.clone();
        b.devices.reason = "another reason".into();
        b.devices.source.kind = "policy";
        assert!(compare(&a, &b).equal);
        b.devices.source.kind = "fallback";
        b.devices.source.cause = Some("trap".into());
        let d = compare(&a, &b);
        assert_eq!(d.differences.len(), 1);
        assert_eq!(
            d.differences[0].b.as_ref().unwrap().fault.as_deref(),
            Some("trap: ")
        );
    }
}
