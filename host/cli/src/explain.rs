//! `ncclwasm policy explain`: every decision a policy makes on a machine, with its reason and
//! source, the plan of a sample connection and how messages are striped over it.

mod connection;
mod items;

use clap::Args as ClapArgs;
use ncclwasm_inspect::render::{self, Table, field, json};
use ncclwasm_inspect::report::{
    self, ConnShape, Connections, PortGid, Report, SourceView, VnicValue,
};
use ncclwasm_inspect::setup::{self, ConfigArgs, DEFAULT_SIZES, MachineArgs, PolicyArg};
use ncclwasm_model::{NetAttr, OneSided};

use crate::fail::{Exit, Fail, Outcome};
use connection::{connection_section, connections_section, port_events_section, striping_section};
pub(crate) use connection::{port_answer, qp_pairs};
pub(crate) use items::{Item, fault, items};

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

    /// Plan the connection of NCCL device N (to the peer's device N, or its last) instead of
    /// device 0's
    #[arg(long, value_name = "N", conflicts_with = "all_connections")]
    pub device: Option<u32>,

    /// Plan a connection from every NCCL device (to the peer's device of the same number, or its
    /// last) and list them in one table; the sample connection is still shown in full
    #[arg(long)]
    pub all_connections: bool,

    /// NCCL's setNetAttr hint the connections are planned with, a TOML inline table by the WIT's
    /// names, e.g. 'send = { max-concurrent-peers = 2, max-flows-per-peer = 4 }, ops = 16'
    /// [default: none given]
    #[arg(long, value_name = "TOML", value_parser = inline_table::<NetAttr>)]
    pub net_attr: Option<NetAttr>,

    /// Plan the connections as one-sided traffic (NCCL's RMA tables): where each sits in its
    /// RMA communicator, a TOML inline table by the WIT's names, e.g.
    /// 'context = 1, contexts = 4, rank = 0, peer = 1, nranks = 2' [default: two-sided]
    #[arg(long, value_name = "TOML", value_parser = inline_table::<OneSided>)]
    pub one_sided: Option<OneSided>,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// Print the report as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

/// `--net-attr`, `--one-sided`: the fields of the WIT record as the inside of a TOML inline
/// table, comma-separated on one line (`send = { max-concurrent-peers = 2 }, ops = 16`).
pub(crate) fn inline_table<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Given<T> {
        given: T,
    }
    toml::from_str::<Given<T>>(&format!("given = {{ {text} }}"))
        .map(|g| g.given)
        .map_err(|e| e.message().to_owned())
}

/// Where a one-sided connection sits, in one line.
fn one_sided_text(o: &OneSided) -> String {
    format!(
        "context {} of {}, rank {} to rank {} of {}",
        o.context, o.contexts, o.rank, o.peer, o.nranks
    )
}

/// The hint in one line: each direction's peers and flows per peer as `min–max` (`?` where NCCL
/// left a bound undefined), then the masks.
fn hint_text(a: &NetAttr) -> String {
    let bound = |v: Option<i32>| v.map_or("?".to_owned(), |v| v.to_string());
    let side = |c: &ncclwasm_model::CommAttr| {
        format!(
            "{}–{} peer(s), {}–{} flow(s) per peer",
            bound(c.min_concurrent_peers),
            bound(c.max_concurrent_peers),
            bound(c.min_flows_per_peer),
            bound(c.max_flows_per_peer)
        )
    };
    let mask = |v: Option<u32>| v.map_or("?".to_owned(), |v| format!("{v:#x}"));
    format!(
        "send {}; recv {}; ops {}, algos {}, protos {}",
        side(&a.send),
        side(&a.recv),
        mask(a.ops),
        mask(a.algos),
        mask(a.protos)
    )
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let (local, peer) = setup::topologies(&args.machines)?;
    let settings = setup::settings(&args.config)?;
    let (host, policy) = setup::host(settings, &args.policy)?;
    if let Some(t) = setup::telemetry(args.machines.telemetry.as_deref(), &local.ports())? {
        host.set_telemetry(std::sync::Arc::new(t));
    }
    let which = match (args.device, args.all_connections) {
        (Some(n), _) => Connections::Device(n),
        (None, true) => Connections::All,
        (None, false) => Connections::Sample,
    };
    let report = report::evaluate(
        &host,
        policy,
        &local,
        peer.as_ref(),
        &args.sizes,
        which,
        ConnShape {
            net_attr: args.net_attr,
            one_sided: args.one_sided,
        },
    )?;
    if let Some(n) = args.device
        && n as usize >= report.nccl_devices.len()
    {
        return Err(Fail::trouble(format!(
            "--device {n}: the policy gives NCCL {} device(s) on {}",
            report.nccl_devices.len(),
            local.name
        )));
    }
    let text = if args.json {
        json(&report)?
    } else {
        render(&report)
    };
    // A decision the built-in default made because the policy faulted is not the policy's: the
    // report says which (its warnings), and the exit status says so to a script.
    let exit = if report::fallbacks(&report).is_empty() {
        Exit::Success
    } else {
        Exit::No
    };
    Ok(Outcome { text, exit })
}

/// The report for people: one section per decision, aligned columns, reasons last, warnings
/// lifted into a block of their own under the header.
pub fn render(r: &Report) -> String {
    let mut out = header(r);
    let warnings = warnings(r);
    if !warnings.is_empty() {
        out.push('\n');
        out += &warnings;
    }
    out.push('\n');
    out += &devices_section("devices", &r.devices);
    out.push('\n');
    out += &gids_section("gids", &r.gids);
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
        out += &gids_section("peer gids", &p.gids);
    }
    if !r.connections.is_empty() {
        out.push('\n');
        out += &connections_section(&r.connections);
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

pub(crate) fn vnic_answer(v: &report::VnicView) -> String {
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

/// What an operator must see before the tables: settings NCCL will not read as written, GIDs
/// that cannot leave the subnet on a RoCE port, and policy faults (the built-in default decided
/// instead, and the exit status is 1).
fn warnings(r: &Report) -> String {
    let mut out = String::new();
    for w in r.settings.warnings.iter().chain(&r.warnings) {
        out += &field("warning", w);
    }
    for (decision, source) in report::fallbacks(r) {
        out += &field(
            "warning",
            &format!(
                "the policy faulted in {decision} ({}), so the built-in default decided",
                fault(source).unwrap_or_default()
            ),
        );
    }
    out
}

/// Reasons shared by several rows, printed once: one `why` line when every row has the same,
/// else a `[k]` per row and the reasons numbered below the table.
struct Reasons(Vec<String>);

impl Reasons {
    fn new<'a>(all: impl IntoIterator<Item = &'a str>) -> Reasons {
        let mut distinct: Vec<String> = Vec::new();
        for r in all {
            if !distinct.iter().any(|d| d == r) {
                distinct.push(r.to_owned());
            }
        }
        Reasons(distinct)
    }

    /// Whether rows need a column pointing at their reason.
    fn column(&self) -> bool {
        self.0.len() > 1
    }

    fn mark(&self, reason: &str) -> String {
        let k = self.0.iter().position(|d| d == reason).unwrap_or(0);
        format!("[{}]", k + 1)
    }

    fn render(&self) -> String {
        match self.0.as_slice() {
            [] => String::new(),
            [one] => field("  why", one),
            many => many
                .iter()
                .enumerate()
                .map(|(k, r)| field(&format!("  [{}]", k + 1), r))
                .collect(),
        }
    }
}

fn gids_section(label: &str, gids: &[PortGid]) -> String {
    let mut out = field(label, &format!("{} ports", gids.len()));
    if gids.is_empty() {
        return out;
    }
    let same_source = gids.iter().all(|g| g.source == gids[0].source);
    if same_source {
        out += &field("  source", &gids[0].source.text);
    }
    let whys: Vec<String> = gids.iter().map(|g| why(&g.reason, &g.source)).collect();
    let reasons = Reasons::new(whys.iter().map(String::as_str));
    let mut header = vec!["port", "index", "address", "type"];
    if !same_source {
        header.push("source");
    }
    if reasons.column() {
        header.push("why");
    }
    let mut t = Table::new(2, &header);
    for (g, w) in gids.iter().zip(&whys) {
        let mut row = vec![
            g.name.clone(),
            g.index.to_string(),
            g.address.clone(),
            ncclwasm_model::topology::gid_type_name(g.gid_type).to_owned(),
        ];
        if !same_source {
            row.push(g.source.label());
        }
        if reasons.column() {
            row.push(reasons.mark(w));
        }
        t.row(row);
    }
    out + &t.render() + &reasons.render()
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
    }
    // The device list NCCL then sees, when fusing changed it or a device has a rail or plane
    // (v12 `railId`/`planeId`, as NCCL logs them, `-` when undefined).
    let undef = ncclwasm_model::device_table::ID_UNDEF;
    let ids = r
        .nccl_devices
        .iter()
        .any(|d| d.rail != undef || d.plane != undef);
    if !g.value.is_empty() || ids {
        out += &field("  nccl sees", "");
        let id = |v: i16| {
            if v == undef {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::corpus_report;
    use ncclwasm_inspect::report::{GroupView, NcclDevice};

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
