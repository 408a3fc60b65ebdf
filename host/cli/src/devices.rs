//! `ncclwasm devices`: what the plugin sees on this host — every port discovery reports (state,
//! link layer, speed, GID table, NUMA node, PCI path) — and every decision the policy would make
//! on it, the `policy explain` report on the live machine instead of a file.

use std::path::PathBuf;

use clap::Args as ClapArgs;
use ncclwasm_inspect::live::{self, FabricView};
use ncclwasm_inspect::render::{self, Table, field, json};
use ncclwasm_inspect::report::{self, Report};
use ncclwasm_inspect::setup::{self, ConfigArgs, DEFAULT_SIZES, PolicyArg};
use ncclwasm_model::telemetry::Telemetry;
use ncclwasm_model::{Gid, GidType, LinkLayer, Port, PortState, topology};
use serde::Serialize;

use crate::fail::{Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The policy: a component (.wasm) or `builtin` [default: as the plugin, $NCCL_WASM_POLICY,
    /// else builtin]
    #[arg(long, value_name = "FILE|builtin")]
    pub policy: Option<PolicyArg>,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// A telemetry snapshot of this host, such as a running job's NCCL_WASM_TELEMETRY_FILE:
    /// shown per port, and what the policy's `telemetry.read` returns in the report
    #[arg(long, value_name = "FILE")]
    pub telemetry: Option<PathBuf>,

    /// Print the ports and the report as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

/// `--json`: the fabric, the ports as discovered, and the `policy explain` report on them.
#[derive(Debug, Serialize)]
pub struct Devices {
    pub fabric: FabricView,
    pub ports: Vec<PortView>,
    /// `--telemetry`'s snapshot, laid over the ports.
    pub telemetry: Option<Telemetry>,
    pub report: Report,
}

/// A discovered port; the GUID in hex and GIDs in text, as topology files write them.
#[derive(Debug, Serialize)]
pub struct PortView {
    pub index: u32,
    pub name: String,
    pub state: PortState,
    pub link_layer: LinkLayer,
    pub speed_mbps: u32,
    pub width: u8,
    pub mtu: u32,
    pub lid: u16,
    pub numa_node: i32,
    /// After NCCL's port/VF merge rule, as decisions see it.
    pub pci_path: String,
    pub guid: String,
    pub provider: String,
    pub max_qps: u32,
    pub gids: Vec<GidView>,
}

#[derive(Debug, Serialize)]
pub struct GidView {
    pub index: u32,
    pub gid: String,
    #[serde(rename = "type")]
    pub gid_type: GidType,
    pub prefix_len: u8,
}

impl From<&Port> for PortView {
    fn from(p: &Port) -> PortView {
        PortView {
            index: p.index,
            name: report::port_name(p),
            state: p.state,
            link_layer: p.link_layer,
            speed_mbps: p.speed_mbps,
            width: p.width,
            mtu: p.mtu,
            lid: p.lid,
            numa_node: p.numa_node,
            pci_path: p.pci_path.clone(),
            guid: format!("{:#018x}", p.guid),
            provider: p.provider.clone(),
            max_qps: p.max_qps,
            gids: p
                .gids
                .iter()
                .filter(|g| **g != Gid::unconfigured(g.index))
                .map(|g| GidView {
                    index: g.index,
                    gid: g.addr().to_string(),
                    gid_type: g.gid_type,
                    prefix_len: g.prefix_len,
                })
                .collect(),
        }
    }
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let live = live::discover()?;
    let (host, view) = setup::host(
        setup::settings(&args.config)?,
        &PolicyArg::or_from_env(args.policy.as_ref()),
    )?;
    let telemetry = setup::telemetry(args.telemetry.as_deref(), &live.ports)?;
    if let Some(t) = &telemetry {
        host.set_telemetry(std::sync::Arc::new(t.clone()));
    }
    let sizes: Vec<u64> = DEFAULT_SIZES
        .split(',')
        .map(setup::parse_size)
        .collect::<Result<_, _>>()
        .map_err(Fail::trouble)?;
    let report = report::evaluate(
        &host,
        view,
        &live.topology,
        None,
        &sizes,
        report::Connections::Sample,
        Default::default(),
    )?;
    let devices = Devices {
        fabric: live.fabric,
        ports: live.ports.iter().map(PortView::from).collect(),
        telemetry,
        report,
    };
    let text = if args.json {
        json(&devices)?
    } else {
        render(&devices)
    };
    Ok(Outcome::success(text))
}

/// The ports as discovered, then the `explain` report.
pub fn render(d: &Devices) -> String {
    let mut out = field("fabric", &format!("{}  ({})", d.fabric.name, d.fabric.why));
    if let Some(lib) = &d.fabric.library {
        out += &field("library", lib);
    }
    if let Some(root) = &d.fabric.sysfs_root {
        out += &field("sysfs", &format!("{root}  (NCCL_WASM_SYSFS_ROOT)"));
    }
    out += &field("ports", &format!("{} discovered", d.ports.len()));
    if !d.ports.is_empty() {
        let mut t = Table::new(
            2,
            &[
                "#", "port", "state", "link", "speed", "mtu", "lid", "numa", "guid", "pci path",
            ],
        );
        for p in &d.ports {
            t.row(vec![
                p.index.to_string(),
                p.name.clone(),
                topology::state_name(p.state).to_owned(),
                render::link(p.link_layer).to_owned(),
                render::speed(p.speed_mbps),
                p.mtu.to_string(),
                p.lid.to_string(),
                p.numa_node.to_string(),
                p.guid.clone(),
                if p.pci_path.is_empty() {
                    "-".to_owned()
                } else {
                    p.pci_path.clone()
                },
            ]);
        }
        out += &t.render();
        let entries: usize = d.ports.iter().map(|p| p.gids.len()).sum();
        out += &field("gid tables", &format!("{entries} configured entries"));
        let mut t = Table::new(2, &["port", "index", "gid", "type", "prefix"]);
        for p in &d.ports {
            for g in &p.gids {
                t.row(vec![
                    p.name.clone(),
                    g.index.to_string(),
                    g.gid.clone(),
                    topology::gid_type_name(g.gid_type).to_owned(),
                    format!("/{}", g.prefix_len),
                ]);
            }
        }
        out += &t.render();
    }
    if let Some(t) = &d.telemetry {
        out += &telemetry_table(t);
    }
    out.push('\n');
    out + &crate::explain::render(&d.report)
}

/// The snapshot per port: what was posted, completed and failed, what runs on it now, and its
/// latest state change.
fn telemetry_table(t: &Telemetry) -> String {
    let out = field(
        "telemetry",
        &format!(
            "at {} ms since init, {} open connection(s)",
            t.at_ms,
            t.connections.len()
        ),
    );
    let mut table = Table::new(
        2,
        &[
            "port", "sent", "send wrs", "recv wrs", "done", "errors", "conns", "qps", "recent",
            "changed",
        ],
    );
    for p in &t.ports {
        let errors: u64 = p.errors.iter().map(|e| e.count).sum();
        table.row(vec![
            format!("{}:{}", p.device, p.port),
            render::bytes(p.send.bytes),
            p.send.wrs.to_string(),
            p.recv.wrs.to_string(),
            p.completions.to_string(),
            match p.last_error_ms {
                Some(at) => format!("{errors}, last {at} ms"),
                None => errors.to_string(),
            },
            p.connections.to_string(),
            p.qps.to_string(),
            format!("{}/{} ms", render::bytes(p.window_bytes), p.window_ms),
            p.changes.last().map_or("-".to_owned(), |c| {
                format!("{} {} ms", topology::state_name(c.state), c.at_ms)
            }),
        ]);
    }
    out + &table.render()
}
