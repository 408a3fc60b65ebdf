//! `ncclwasm policy explain`: every decision a policy makes on a machine, with its reason and
//! source, the plan of a sample connection and how messages are striped over it.

use clap::Args as ClapArgs;
use ncclwasm_model::{PortAnswer, PortChange};
use serde::Serialize;

use crate::fail::{Exit, Fail, Outcome};
use crate::render::{self, Table, field};
use crate::report::{self, PortGid, Report, SourceView, VnicValue};
use crate::setup::{self, ConfigArgs, DEFAULT_SIZES, MachineArgs, PolicyArg};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The policy: a component (.wasm) or `builtin`
    #[arg(value_name = "FILE|builtin")]
    pub policy: PolicyArg,

    #[command(flatten)]
    pub machines: MachineArgs,

    /// Message sizes to show the striping of, comma-separated (bytes; K, M, G suffixes)
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = DEFAULT_SIZES,
        value_parser = setup::parse_size
    )]
    pub sizes: Vec<u64>,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// Print the report as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let (local, peer) = setup::topologies(&args.machines)?;
    let settings = setup::settings(&args.config)?;
    let (host, policy) = setup::host(settings, &args.policy)?;
    let report = report::evaluate(&host, policy, &local, peer.as_ref(), &args.sizes)?;
    // A decision the built-in default made because the policy faulted is not the policy's: the
    // report shows it, and the exit status says so to a script.
    let faulted: Vec<String> = items(&report)
        .into_iter()
        .filter(|i| i.fault.is_some())
        .map(|i| i.decision)
        .collect();
    let mut text = if args.json {
        crate::json(&report)?
    } else {
        render(&report)
    };
    if !faulted.is_empty() && !args.json {
        text += &format!(
            "\n{} decision(s) fell back to the built-in default after a policy fault: {}\n",
            faulted.len(),
            faulted.join(", ")
        );
    }
    let exit = if faulted.is_empty() {
        Exit::Success
    } else {
        Exit::No
    };
    Ok(Outcome { text, exit })
}

/// The report for people: one section per decision, aligned columns, reasons last.
pub fn render(r: &Report) -> String {
    let mut out = header(r);
    out.push('\n');
    out += &devices_section("devices", &r.devices);
    out.push('\n');
    out += &gids_section(&r.gids);
    out.push('\n');
    out += &fused_section(r);
    if let Some(v) = &r.vnic {
        out.push('\n');
        out += &vnic_section(v);
    }
    if let Some(p) = &r.peer {
        out.push('\n');
        out += &devices_section("peer devices", &p.devices);
        out.push('\n');
        out += &gids_section(&p.gids);
    }
    if let Some(c) = &r.connection {
        out.push('\n');
        out += &connection_section(c);
        if !c.port_events.is_empty() {
            out.push('\n');
            out += &port_events_section(c);
        }
    }
    if !r.striping.is_empty() {
        out.push('\n');
        out += &striping_section(r);
    }
    out
}

fn vnic_answer(v: &report::VnicView) -> String {
    match &v.answer.value {
        VnicValue::Accept => "accept".to_owned(),
        VnicValue::Reshape { devices } => format!("reshape to devices {}", list(devices)),
        VnicValue::Refuse => "refuse".to_owned(),
    }
}

fn vnic_section(v: &report::VnicView) -> String {
    let answer = vnic_answer(v);
    let mut out = field(
        "vnic",
        &format!(
            "fuse devices {} ({})? {answer}",
            list(&v.request),
            v.members.join(", ")
        ),
    );
    out += &source_lines(&v.answer.source, &v.answer.reason);
    out + &field("  asked", &v.why_asked)
}

fn header(r: &Report) -> String {
    let p = &r.policy;
    let mut out = match (&p.origin, &p.sha256) {
        (Some(origin), Some(sha)) => field(
            "policy",
            &format!(
                "{} {}  ({origin}, sha256 {})",
                p.name,
                p.version,
                &sha[..sha.len().min(12)]
            ),
        ),
        _ => field("policy", "built-in default (NCCL's own decisions)"),
    };
    out += &field(
        "topology",
        &format!("{}  ({})", r.topology.name, r.topology.origin),
    );
    if r.peer.is_some() {
        out += &field(
            "peer",
            &format!("{}  ({})", r.peer_topology.name, r.peer_topology.origin),
        );
    } else {
        out += &field("peer", "the same machine");
    }
    let set: Vec<String> = r
        .settings
        .ib
        .iter()
        .filter(|s| s.source != "default")
        .chain(&r.settings.ignored)
        .map(|s| format!("{}={}", s.name, s.value))
        .collect();
    if set.is_empty() {
        out += &field("settings", "NCCL_IB_* at NCCL's defaults");
    } else {
        out += &field("settings", &set.join(" "));
    }
    for w in &r.settings.warnings {
        out += &field("warning", w);
    }
    if let Some(config) = &r.settings.config {
        out += &field("config", config);
    }
    out
}

/// `source` and `why` lines under a section header (a fallback's source names the fault).
fn source_lines(source: &SourceView, reason: &str) -> String {
    field("  source", &source.text) + &field("  why", reason)
}

/// A reason followed by the fault that made the built-in default decide, if any.
fn why(reason: &str, source: &SourceView) -> String {
    match (&source.cause, &source.detail) {
        (Some(cause), Some(detail)) => format!("{reason} [policy fault: {cause}: {detail}]"),
        _ => reason.to_owned(),
    }
}

fn list(items: &[u32]) -> String {
    items
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn devices_section(label: &str, d: &report::Decided<Vec<report::DeviceView>>) -> String {
    let mut out = field(label, &format!("{} selected", d.value.len()));
    out += &source_lines(&d.source, &d.reason);
    if !d.value.is_empty() {
        let mut t = Table::new(2, &["dev", "port", "name", "link", "speed", "numa"]);
        for v in &d.value {
            t.row(vec![
                v.device.to_string(),
                v.port.to_string(),
                v.name.clone(),
                render::link(v.link_layer).to_owned(),
                render::speed(v.speed_mbps),
                v.numa_node.to_string(),
            ]);
        }
        out += &t.render();
    }
    out
}

fn gids_section(gids: &[PortGid]) -> String {
    let mut out = field("gids", &format!("{} ports", gids.len()));
    if let Some(first) = gids.first()
        && gids.iter().all(|g| g.source == first.source)
    {
        out += &field("  source", &first.source.text);
    }
    if gids.is_empty() {
        return out;
    }
    let mut t = Table::new(2, &["port", "index", "address", "type", "source", "why"]);
    for g in gids {
        t.row(vec![
            g.name.clone(),
            g.index.to_string(),
            g.address.clone(),
            ncclwasm_model::topology::gid_type_name(g.gid_type).to_owned(),
            g.source.label(),
            why(&g.reason, &g.source),
        ]);
    }
    out + &t.render()
}

fn fused_section(r: &Report) -> String {
    let g = &r.groups;
    let mut out = if g.value.is_empty() {
        field("fused", "none")
    } else {
        field("fused", &format!("{} group(s)", g.value.len()))
    };
    out += &source_lines(&g.source, &g.reason);
    if !g.value.is_empty() {
        let mut t = Table::new(2, &["name", "members", "why"]);
        for group in &g.value {
            t.row(vec![
                group.name.clone(),
                group.members.join(" "),
                group.reason.clone(),
            ]);
        }
        out += &t.render();
        out += &field("  nccl sees", "");
        // Rail and plane as NCCL logs them, `-` when undefined.
        let id = |v: i16| {
            if v == ncclwasm_model::device_table::ID_UNDEF {
                "-".to_owned()
            } else {
                v.to_string()
            }
        };
        let mut t = Table::new(2, &["dev", "name", "port", "rail", "plane", "ports"]);
        for d in &r.nccl_devices {
            t.row(vec![
                d.device.to_string(),
                d.name.clone(),
                d.port.to_string(),
                id(d.rail),
                id(d.plane),
                list(&d.ports),
            ]);
        }
        out += &t.render();
    }
    out
}

fn connection_section(c: &report::ConnectionView) -> String {
    let plan = &c.plan.decided;
    let mut out = field(
        "connection",
        &format!(
            "device {} ({}) to {} peer port(s): {} QP(s)",
            c.device,
            c.device_name,
            c.peer.len(),
            plan.value.qps.len()
        ),
    );
    out += &field("  source", &plan.source.text);
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

/// What the sample connection does if its first port fails, and when it comes back.
fn port_events_section(c: &report::ConnectionView) -> String {
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

fn striping_section(r: &Report) -> String {
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

fn fault(s: &SourceView) -> Option<String> {
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
        let plan = &c.plan.decided.value;
        let weighted = plan.qps.iter().any(|q| q.weight != 1);
        let name = |list: &[report::EndpointView], k: u32| {
            list.get(k as usize)
                .map_or(format!("#{k}"), |e| e.name.clone())
        };
        let qps: Vec<String> = plan
            .qps
            .iter()
            .map(|q| {
                let w = if weighted {
                    format!(" x{}", q.weight)
                } else {
                    String::new()
                };
                format!("{}>{}{w}", name(&c.local, q.local), name(&c.peer, q.remote))
            })
            .collect();
        for row in report::plan_rows(&c.plan) {
            let value = if row.label == "qps" {
                format!("{}: {}", row.value, qps.join(" "))
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
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{GroupView, NcclDevice, corpus_report};

    #[test]
    fn renders_every_section_of_a_builtin_report() {
        let text = render(&corpus_report("dual-port"));
        for label in [
            "policy",
            "topology",
            "peer",
            "settings",
            "devices",
            "gids",
            "fused",
            "vnic",
            "connection",
            "port-down",
            "port-up",
            "striping",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{label} "))),
                "{label}: {text}"
            );
        }
        assert!(text.contains("fuse devices 0,1 (mlx5_0:1, mlx5_1:1)? accept"));
        assert!(text.contains("  qp  8    1M\n"), "{text}");
        // NCCL's defaults: no failover, no failback.
        assert!(
            text.contains("port-down   mlx5_0:1 down: fail the connection\n"),
            "{text}"
        );
        assert!(
            text.contains("NCCL_IB_RESILIENCY_PORT_FAILOVER=0"),
            "{text}"
        );
        assert!(
            text.contains("port-up     mlx5_0:1 up: stay on the other ports\n"),
            "{text}"
        );
    }

    #[test]
    fn fused_groups_show_members_and_the_device_list_nccl_sees() {
        let mut r = corpus_report("dual-port");
        r.groups.value = vec![GroupView {
            name: "mlx5_0+mlx5_1".into(),
            ports: vec![0, 1],
            members: vec!["mlx5_0:1".into(), "mlx5_1:1".into()],
            reason: "one card".into(),
        }];
        r.nccl_devices = vec![NcclDevice {
            device: 0,
            name: "mlx5_0+mlx5_1".into(),
            port: 1,
            rail: -1,
            plane: 0x4001,
            ports: vec![0, 1],
        }];
        let text = render(&r);
        assert!(text.contains("fused       1 group(s)\n"), "{text}");
        assert!(
            text.contains("  mlx5_0+mlx5_1  mlx5_0:1 mlx5_1:1  one card\n"),
            "{text}"
        );
        assert!(
            text.contains("  0    mlx5_0+mlx5_1  1     -     16385  0,1\n"),
            "{text}"
        );
    }
}
