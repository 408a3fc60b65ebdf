//! What a policy decides on one machine, as data: the policy calls behind `explain`, `diff` and
//! `check`.
//!
//! [`evaluate`] asks a [`PolicyHost`] every decision the plugin asks at start-up and on the first
//! connection, in the plugin's order, and keeps each answer with its reason and [source]. The
//! result is plain serialisable data, so the human renderers are pure functions over it and
//! `--json` prints this same structure (documented in README.md; fields are only ever added).
//! The device list NCCL would see is made by the plugin's own function
//! (`ncclwasm_model::device_table`), so it numbers and names devices as the plugin does;
//! `table_tests` holds the two side by side. How a plan is shown, field by field, is `plan`.
//!
//! [source]: ncclwasm_policy::Source

use std::collections::BTreeMap;
use std::sync::Arc;

use ncclwasm_default::IbConfig;
use ncclwasm_model::device_table::{DeviceTable, RailPlane, TableDevice, TableEnv};
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, Endpoint, GidType, LinkLayer, NetAttr, OneSided, Port,
    PortAnswer, PortChange, PortEvent, PortEventCause, PortState, QpPlan, Topology, VnicAnswer,
};
use ncclwasm_policy::{Decision, PolicyError, PolicyHost, PolicyId, Source};
use serde::Serialize;

use crate::Error;

mod plan;
use plan::plan_view;
pub use plan::{plan_rows, plan_values};

/// Everything one policy decides on one machine (and its peer).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub policy: PolicyView,
    pub topology: TopologyView,
    /// The machine on the other end of the sample connection (the same one unless `--peer`).
    pub peer_topology: TopologyView,
    pub settings: SettingsView,
    /// `select-devices`: NCCL device `i` is `devices.value[i]`, before fusion.
    pub devices: Decided<Vec<DeviceView>>,
    /// `select-gid`, per selected port.
    pub gids: Vec<PortGid>,
    /// `group-devices`: fused NICs the plugin itself exposes.
    pub groups: Decided<Vec<GroupView>>,
    /// The device list NCCL sees, as the plugin numbers and names it (`DeviceTable`): the
    /// selection, each group where its first selected member stands.
    pub nccl_devices: Vec<NcclDevice>,
    /// `make-vnic`: NCCL core's answer to a sample fusion request, when there are two devices.
    pub vnic: Option<VnicView>,
    /// The peer's own `select-devices` and `select-gid`, when it is another machine.
    pub peer: Option<PeerView>,
    /// `plan-connection` for the connection [`Connections`] names (NCCL device 0 or its vNIC
    /// unless told), when a device was selected.
    pub connection: Option<ConnectionView>,
    /// With [`Connections::All`]: every NCCL device's connection, in device order.
    pub connections: Vec<ConnectionView>,
    /// How the first message of each size is striped over the plan's QPs.
    pub striping: Vec<Striping>,
    /// Decisions that will likely fail at run time although every hook answered: a RoCE port
    /// (local or the peer's) whose GID is link-local or unconfigured, so not routable.
    pub warnings: Vec<String>,
}

/// Who decides: the built-in default, or a wasm policy as its `init` named it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyView {
    /// `builtin` or `wasm`.
    pub kind: &'static str,
    pub name: String,
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The file it was loaded from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

impl PolicyView {
    pub fn builtin() -> PolicyView {
        PolicyView {
            kind: "builtin",
            name: "built-in default".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            sha256: None,
            origin: None,
        }
    }

    pub fn wasm(id: &PolicyId) -> PolicyView {
        PolicyView {
            kind: "wasm",
            name: id.name.clone(),
            version: id.version.clone(),
            sha256: Some(id.sha256.clone()),
            origin: Some(id.origin.clone()),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TopologyView {
    pub name: String,
    pub description: String,
    pub origin: String,
}

impl From<&Topology> for TopologyView {
    fn from(t: &Topology) -> TopologyView {
        TopologyView {
            name: t.name.clone(),
            description: t.description.clone(),
            origin: t.origin.clone(),
        }
    }
}

/// The `NCCL_IB_*` settings in effect and the string `init` got.
#[derive(Clone, Debug, Serialize)]
pub struct SettingsView {
    /// `NCCL_WASM_POLICY_CONFIG` as handed to `init`.
    pub config: Option<String>,
    /// Every variable the built-in default reads, with its value and where it came from.
    pub ib: Vec<SettingView>,
    /// `NCCL_IB_*` pairs given that NCCL reads and the built-in default does not (the
    /// transport may).
    pub ignored: Vec<SettingView>,
    /// Values read other than written, and names NCCL does not read at all (misspelt ones, with
    /// the name meant): what the plugin WARNs at `init`.
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SettingView {
    pub name: String,
    pub value: String,
    /// `default` or `environment` (which includes `--env`).
    pub source: &'static str,
}

impl SettingsView {
    fn new(config: Option<String>, ib: &IbConfig) -> SettingsView {
        SettingsView {
            config,
            ib: ib
                .sources()
                .iter()
                .map(|s| SettingView {
                    name: s.name.to_owned(),
                    value: s.value.clone(),
                    source: match s.source {
                        ncclwasm_default::Source::Default => "default",
                        ncclwasm_default::Source::Environment => "environment",
                    },
                })
                .collect(),
            ignored: ib
                .ignored()
                .iter()
                .map(|(name, value)| SettingView {
                    name: name.clone(),
                    value: value.clone(),
                    source: "environment",
                })
                .collect(),
            warnings: ib.warnings().iter().map(ToString::to_string).collect(),
        }
    }
}

/// A decision with its reason and source.
#[derive(Clone, Debug, Serialize)]
pub struct Decided<T> {
    pub value: T,
    pub reason: String,
    pub source: SourceView,
}

/// Where a decision came from, flattened for JSON and for short labels.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SourceView {
    /// `policy`, `builtin` (no policy loaded), `no-opinion`, `not-implemented` or `fallback`.
    pub kind: &'static str,
    /// The policy (`name@version`) that answered, declined or faulted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// `fallback` only: the fault (`trap`, `timeout`, `out of memory`, `invalid answer`, …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The whole story in one sentence.
    pub text: String,
}

impl From<&Source> for SourceView {
    fn from(s: &Source) -> SourceView {
        let id = |p: &Arc<PolicyId>| Some(p.to_string());
        let (kind, policy, cause, detail) = match s {
            Source::Policy(p) => ("policy", id(p), None, None),
            Source::Builtin => ("builtin", None, None, None),
            Source::NoOpinion(p) => ("no-opinion", id(p), None, None),
            Source::NotImplemented(p) => ("not-implemented", id(p), None, None),
            Source::Fallback {
                policy,
                cause,
                detail,
            } => (
                "fallback",
                id(policy),
                Some(cause.to_string()),
                Some(detail.clone()),
            ),
        };
        SourceView {
            kind,
            policy,
            cause,
            detail,
            text: s.to_string(),
        }
    }
}

impl SourceView {
    /// A few words for a table column; the full story is in [`SourceView::text`].
    pub fn label(&self) -> String {
        match self.kind {
            "policy" => "policy".into(),
            "no-opinion" => "built-in (no opinion)".into(),
            "not-implemented" => "built-in (not implemented)".into(),
            "fallback" => format!("fallback ({})", self.cause.as_deref().unwrap_or("fault")),
            _ => "built-in".into(),
        }
    }
}

fn decided<T, U>(d: Decision<T>, value: impl FnOnce(T) -> U) -> Decided<U> {
    Decided {
        source: SourceView::from(&d.source),
        reason: d.reason,
        value: value(d.value),
    }
}

/// One selected port: NCCL device `device` before fusion is port-table entry `port`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceView {
    pub device: u32,
    pub port: u32,
    /// `device:port`, e.g. `mlx5_0:1`.
    pub name: String,
    pub link_layer: LinkLayer,
    pub speed_mbps: u32,
    pub numa_node: i32,
}

/// The GID one selected port uses.
#[derive(Clone, Debug, Serialize)]
pub struct PortGid {
    /// Port-table index and `device:port`.
    pub port: u32,
    pub name: String,
    pub index: u32,
    /// The GID in IPv6 text form; `::` when the index is not in the table.
    pub address: String,
    #[serde(rename = "type")]
    pub gid_type: GidType,
    pub prefix_len: u8,
    pub reason: String,
    pub source: SourceView,
}

#[derive(Clone, Debug, Serialize)]
pub struct GroupView {
    /// The device name NCCL sees (the policy's, or the members' joined by `+`; made unique as
    /// every name of the table).
    pub name: String,
    /// Port-table indices and their `device:port` names.
    pub ports: Vec<u32>,
    pub members: Vec<String>,
    pub reason: String,
}

/// One device of the list NCCL sees.
#[derive(Clone, Debug, Serialize)]
pub struct NcclDevice {
    pub device: u32,
    pub name: String,
    /// `props.port`: see [`ncclwasm_model::device_table`].
    pub port: u8,
    /// v12 `railId` and `planeId` (-1: undefined).
    pub rail: i16,
    pub plane: i16,
    pub ports: Vec<u32>,
}

/// A sample `makeVDevice` request and the answer.
#[derive(Clone, Debug, Serialize)]
pub struct VnicView {
    /// NCCL device indices asked to be fused, and their ports' names.
    pub request: Vec<u32>,
    pub members: Vec<String>,
    /// Why this request was chosen as the sample.
    pub why_asked: String,
    pub answer: Decided<VnicValue>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum VnicValue {
    Accept,
    Reshape { devices: Vec<u32> },
    Refuse,
}

/// The peer machine's own device and GID decisions (same policy, same settings).
#[derive(Clone, Debug, Serialize)]
pub struct PeerView {
    pub devices: Decided<Vec<DeviceView>>,
    pub gids: Vec<PortGid>,
}

/// A connection and its plan.
#[derive(Clone, Debug, Serialize)]
pub struct ConnectionView {
    /// The device the connection runs on (for the sample: NCCL device 0, or the vNIC that took it
    /// in the sample fusion) and its name.
    pub device: u32,
    pub device_name: String,
    /// The peer's device on the other end, and its name.
    pub peer_device: u32,
    pub peer_device_name: String,
    /// `conn.local` and `conn.peer`: QPs refer to these by position.
    pub local: Vec<EndpointView>,
    pub peer: Vec<EndpointView>,
    pub plan: PlanView,
    /// `on-port-event` for the connection's first local port: down (the others active), then
    /// up again.
    pub port_events: Vec<PortEventView>,
    /// NCCL's `setNetAttr` hint the connection was planned with (`null`: none given).
    pub net_attr: Option<NetAttr>,
    /// Where the connection sits in an RMA communicator when it was planned as one-sided
    /// traffic (`null`: two-sided).
    pub one_sided: Option<OneSided>,
}

/// What NCCL tells the plugin about a communicator beyond the machines, which every planned
/// connection carries: its latest `setNetAttr` hint and, for one-sided traffic, where the
/// connection sits in its RMA communicator. The default: neither (two-sided, no hint).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnShape {
    pub net_attr: Option<NetAttr>,
    pub one_sided: Option<OneSided>,
}

/// What the sample connection would do about one port event.
#[derive(Clone, Debug, Serialize)]
pub struct PortEventView {
    /// `device:port` of the port that changed.
    pub port: String,
    pub change: PortChange,
    /// Ports named by a `move-to` answer are indices into `local`.
    pub answer: Decided<PortAnswer>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointView {
    pub name: String,
    pub gid_index: u32,
    pub address: String,
}

/// The plan, with who set which field: a policy's patch only replaces some fields.
#[derive(Clone, Debug, Serialize)]
pub struct PlanView {
    #[serde(flatten)]
    pub decided: Decided<ConnPlan>,
    /// The fields the policy set (`qps`, `stripe-width`, `align`, `adaptive-routing`,
    /// `ar-threshold`, `tc`, `sl`, `fifo-tc`, `ece`, `timeout`, `retry-cnt`); the rest are the
    /// built-in default's.
    pub policy_set: Vec<String>,
    /// The policy's own reason for the fields it set.
    pub policy_reason: Option<String>,
    /// The built-in default's reason for its plan of this connection.
    pub builtin_reason: String,
}

/// The stripes of the first message of `size` bytes (rotation starting at QP `start`).
#[derive(Clone, Debug, Serialize)]
pub struct Striping {
    pub size: u64,
    pub start: u32,
    pub stripes: Vec<StripeView>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StripeView {
    /// Index into the plan's QPs.
    pub qp: u32,
    pub offset: u64,
    pub len: u64,
}

/// `device:port`, how ports are named everywhere in the output.
pub fn port_name(p: &Port) -> String {
    format!("{}:{}", p.device, p.port)
}

fn endpoint_view(e: &Endpoint) -> EndpointView {
    EndpointView {
        name: format!("{}:{}", e.device, e.port),
        gid_index: e.gid.index,
        address: e.gid.addr().to_string(),
    }
}

/// One machine's device selection and GIDs, and the endpoints they make.
struct Chosen {
    devices: Decided<Vec<DeviceView>>,
    gids: Vec<PortGid>,
    selected: Vec<Port>,
    /// The selected ports' rails and planes, in their order.
    rails: Vec<RailPlane>,
    endpoints: Vec<Endpoint>,
}

impl Chosen {
    /// A warning per RoCE endpoint whose GID cannot be routed: traffic to another subnet (or,
    /// when unconfigured, any traffic) fails although the decision was made without fault.
    fn unroutable(&self, whose: &str) -> Vec<String> {
        self.endpoints
            .iter()
            .filter(|e| e.link_layer == LinkLayer::Ethernet && !e.gid.is_routable())
            .map(|e| {
                format!(
                    "{whose}{}:{} uses GID index {} ({}), which is not routable: cross-node traffic may fail; set NCCL_IB_GID_INDEX, NCCL_IB_ADDR_FAMILY or NCCL_IB_ADDR_RANGE (or the policy's select-gid) to a routable entry",
                    e.device,
                    e.port,
                    e.gid.index,
                    e.gid.addr()
                )
            })
            .collect()
    }
}

fn choose(host: &PolicyHost, ports: &[Port]) -> Result<Chosen, PolicyError> {
    let selection = host.select_devices(ports)?;
    let selected: Vec<Port> = selection
        .value
        .ports
        .iter()
        .filter_map(|i| ports.iter().find(|p| p.index == *i).cloned())
        .collect();
    let rails = host.rails(&selection.value, &selected);
    let devices = decided(selection, |_| {
        selected
            .iter()
            .enumerate()
            .map(|(device, p)| DeviceView {
                device: device as u32,
                port: p.index,
                name: port_name(p),
                link_layer: p.link_layer,
                speed_mbps: p.speed_mbps,
                numa_node: p.numa_node,
            })
            .collect()
    });
    let mut gids = Vec::with_capacity(selected.len());
    let mut endpoints = Vec::with_capacity(selected.len());
    for p in &selected {
        let choice = host.select_gid(p)?;
        let e = p.endpoint(choice.value.index);
        gids.push(PortGid {
            port: p.index,
            name: port_name(p),
            index: choice.value.index,
            address: e.gid.addr().to_string(),
            gid_type: e.gid.gid_type,
            prefix_len: e.gid.prefix_len,
            reason: choice.reason,
            source: SourceView::from(&choice.source),
        });
        endpoints.push(e);
    }
    Ok(Chosen {
        devices,
        gids,
        selected,
        rails,
        endpoints,
    })
}

/// The device table the plugin makes of these decisions under NCCL's defaults (the topology's
/// PCI paths are merged with `NCCL_IB_MERGE_VFS=1`). A topology file does not say which NICs
/// have an mlx5 Data Direct function, so there are no `<dev>_dma` twins.
fn device_table(chosen: &Chosen, groups: &[DeviceGroup]) -> DeviceTable {
    DeviceTable::new(
        &chosen.selected,
        groups,
        &BTreeMap::new(),
        &chosen.rails,
        TableEnv::default(),
    )
}

/// Device `device` of the table, its ports named by `port.index`.
fn nccl_device(device: usize, d: &TableDevice, selected: &[Port]) -> NcclDevice {
    NcclDevice {
        device: device as u32,
        name: d.name.clone(),
        port: d.port,
        rail: d.ids.rail,
        plane: d.ids.plane,
        ports: d
            .members
            .iter()
            .map(|m| selected[m.selected].index)
            .collect(),
    }
}

fn nccl_devices(table: &DeviceTable, selected: &[Port]) -> Vec<NcclDevice> {
    table
        .devices()
        .iter()
        .enumerate()
        .map(|(i, d)| nccl_device(i, d, selected))
        .collect()
}

/// The sample fusion request: the first single-port devices that share a NIC (same PCI path after
/// NCCL's merge rule — what NCCL core fuses by default), else the first two devices.
fn vnic_request(devices: &[NcclDevice], selected: &[Port]) -> Option<(Vec<u32>, String)> {
    let single: Vec<(u32, &Port)> = devices
        .iter()
        .filter(|d| d.ports.len() == 1)
        .filter_map(|d| {
            let p = selected.iter().find(|p| p.index == d.ports[0])?;
            Some((d.device, p))
        })
        .collect();
    for (_, p) in &single {
        let same: Vec<&(u32, &Port)> = single
            .iter()
            .filter(|(_, q)| !p.pci_path.is_empty() && q.pci_path == p.pci_path)
            .collect();
        if same.len() >= 2 {
            return Some((
                same.iter().map(|(d, _)| *d).collect(),
                format!("these devices share one NIC (PCI path {})", p.pci_path),
            ));
        }
    }
    (single.len() >= 2).then(|| {
        (
            vec![single[0].0, single[1].0],
            "no devices share a NIC; the first two devices".to_owned(),
        )
    })
}

/// One machine's start-up decisions, as the plugin makes them: devices, GIDs, groups, the sample
/// fusion request, and the device a sample connection runs on.
struct Side {
    chosen: Chosen,
    groups: Decided<Vec<GroupView>>,
    nccl: Vec<NcclDevice>,
    vnic: Option<VnicView>,
    /// The device NCCL would connect on: device 0, or the vNIC it went into when the sample
    /// fusion took it (NCCL then uses the vNIC in its place).
    sample: Option<NcclDevice>,
}

impl Side {
    /// The device a connection of `which` runs on: the sample, or device `n` (the last device
    /// when this machine has fewer, as a peer with fewer NICs than rails would answer).
    fn device(&self, which: Option<u32>) -> Option<&NcclDevice> {
        match which {
            None => self.sample.as_ref(),
            Some(n) => self.nccl.get(n as usize).or(self.nccl.last()),
        }
    }

    /// The endpoints of `dev`'s ports, in the device's member order (`conn.local`).
    fn endpoints(&self, dev: &NcclDevice) -> Vec<Endpoint> {
        dev.ports
            .iter()
            .filter_map(|i| self.chosen.selected.iter().position(|p| p.index == *i))
            .map(|k| self.chosen.endpoints[k].clone())
            .collect()
    }
}

fn side(host: &PolicyHost, ports: &[Port]) -> Result<Side, PolicyError> {
    let chosen = choose(host, ports)?;
    let groups = host.group_devices(&chosen.selected)?;
    let table = device_table(&chosen, &groups.value);
    let nccl = nccl_devices(&table, &chosen.selected);
    let groups = decided(groups, |gs| {
        gs.iter()
            .map(|g| GroupView {
                // The fused device holding the group's first port.
                name: nccl
                    .iter()
                    .find(|d| {
                        d.ports.len() > 1 && g.ports.first().is_some_and(|p| d.ports.contains(p))
                    })
                    .map_or_else(String::new, |d| d.name.clone()),
                ports: g.ports.clone(),
                members: g
                    .ports
                    .iter()
                    .filter_map(|i| ports.iter().find(|p| p.index == *i))
                    .map(port_name)
                    .collect(),
                reason: g.reason.clone(),
            })
            .collect()
    });

    let mut fused = None;
    let vnic = match vnic_request(&nccl, &chosen.selected) {
        None => None,
        Some((request, why_asked)) => {
            // One port per requested device (its first), as the plugin asks.
            let members: Vec<Port> = request
                .iter()
                .filter_map(|&d| table.devices().get(d as usize))
                .map(|d| chosen.selected[d.members[0].selected].clone())
                .collect();
            let answer = host.make_vnic(&request, &members)?;
            let devices = match &answer.value {
                VnicAnswer::Accept { .. } => Some(request.clone()),
                VnicAnswer::Reshape { devices, .. } => Some(devices.clone()),
                VnicAnswer::Refuse { .. } => None,
            };
            fused = devices.and_then(|devices| {
                let mut table = table.clone();
                let v = table.fuse(&devices).ok()? as usize;
                Some(nccl_device(v, &table.devices()[v], &chosen.selected))
            });
            Some(VnicView {
                members: members.iter().map(port_name).collect(),
                request,
                why_asked,
                answer: decided(answer, |a| match a {
                    VnicAnswer::Accept { .. } => VnicValue::Accept,
                    VnicAnswer::Reshape { devices, .. } => VnicValue::Reshape { devices },
                    VnicAnswer::Refuse { .. } => VnicValue::Refuse,
                }),
            })
        }
    };
    let first = nccl.first().cloned();
    let sample = match (fused, first) {
        (Some(v), Some(d)) if d.ports.iter().all(|p| v.ports.contains(p)) => Some(v),
        (_, first) => first,
    };
    Ok(Side {
        chosen,
        groups,
        nccl,
        vnic,
        sample,
    })
}

/// Which connections a report plans (`explain --device`, `--all-connections`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connections {
    /// NCCL device 0, or the vNIC the sample fusion put it in, to the peer's same.
    Sample,
    /// NCCL device `n` to the peer's device `n` (its last when it has fewer).
    Device(u32),
    /// Every NCCL device, each to the peer's device of the same number (or its last); the
    /// report's `connection` is still the sample's.
    All,
}

/// Ask every decision, as the plugin does at start-up and on the connections `which` names,
/// each planned with `shape` (its communicator's latest `setNetAttr`, one-sided or not).
pub fn evaluate(
    host: &PolicyHost,
    policy: PolicyView,
    local: &Topology,
    peer: Option<&Topology>,
    sizes: &[u64],
    which: Connections,
    shape: ConnShape,
) -> Result<Report, Error> {
    // The peer makes its own decisions first, with the same policy; plans are then held to the
    // QP limit of the local (live) ports, as in the plugin.
    let peer_side = peer.map(|t| side(host, &t.ports())).transpose()?;
    host.set_topology(local.ports());
    let local_side = side(host, &local.ports())?;
    let remote = peer_side.as_ref().unwrap_or(&local_side);
    let plan = |device: Option<u32>| match (local_side.device(device), remote.device(device)) {
        (Some(l), Some(r)) => connection(host, &local_side, l, remote, r, shape).map(Some),
        _ => Ok(None),
    };
    let connection = match which {
        Connections::Device(n) if (n as usize) < local_side.nccl.len() => plan(Some(n))?,
        // A device the machine does not have: no connection to show; the caller says so.
        Connections::Device(_) => None,
        Connections::Sample | Connections::All => plan(None)?,
    };
    let connections = match which {
        Connections::All => (0..local_side.nccl.len() as u32)
            .filter_map(|n| plan(Some(n)).transpose())
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    let striping = connection.as_ref().map_or(Vec::new(), |c| {
        sizes
            .iter()
            .map(|&size| Striping {
                size,
                start: 0,
                stripes: c
                    .plan
                    .decided
                    .value
                    .stripes(size, 0)
                    .map(|s| StripeView {
                        qp: s.qp,
                        offset: s.offset,
                        len: s.len,
                    })
                    .collect(),
            })
            .collect()
    });

    let mut warnings = local_side.chosen.unroutable("");
    if let Some(p) = &peer_side {
        warnings.extend(p.chosen.unroutable("the peer's "));
    }
    Ok(Report {
        warnings,
        policy,
        topology: local.into(),
        peer_topology: peer.unwrap_or(local).into(),
        settings: SettingsView::new(host.settings().config.clone(), host.ib_config()),
        devices: local_side.chosen.devices,
        gids: local_side.chosen.gids,
        groups: local_side.groups,
        nccl_devices: local_side.nccl,
        vnic: local_side.vnic,
        peer: peer_side.map(|p| PeerView {
            devices: p.chosen.devices,
            gids: p.chosen.gids,
        }),
        connection,
        connections,
        striping,
    })
}

/// `plan-connection` (and `on-port-event`) for `device` of `local` to `peer_device` of `peer`.
fn connection(
    host: &PolicyHost,
    local: &Side,
    device: &NcclDevice,
    peer: &Side,
    peer_device: &NcclDevice,
    shape: ConnShape,
) -> Result<ConnectionView, PolicyError> {
    let conn = Connection {
        net_attr: shape.net_attr,
        one_sided: shape.one_sided,
        comm_id: 0,
        traffic_class: -1,
        device: device.device,
        device_name: device.name.clone(),
        local: local.endpoints(device),
        peer: peer.endpoints(peer_device),
    };
    let base = ncclwasm_default::plan_connection(host.ib_config(), &conn);
    let plan = host.plan_connection(&conn)?;
    let port_events = port_events(host, &conn, &plan.value.qps)?;
    Ok(ConnectionView {
        device: device.device,
        device_name: device.name.clone(),
        peer_device: peer_device.device,
        peer_device_name: peer_device.name.clone(),
        local: conn.local.iter().map(endpoint_view).collect(),
        peer: conn.peer.iter().map(endpoint_view).collect(),
        plan: plan_view(plan, &base),
        port_events,
        net_attr: shape.net_attr,
        one_sided: shape.one_sided,
    })
}

/// Ask `on-port-event` as the transport would if the connection's first local port went down
/// (an async port event, every other port active) and later came back.
fn port_events(
    host: &PolicyHost,
    conn: &Connection,
    qps: &[QpPlan],
) -> Result<Vec<PortEventView>, PolicyError> {
    let Some(first) = conn.local.first() else {
        return Ok(Vec::new());
    };
    let n = conn.local.len();
    let mut down_states = vec![PortState::Active; n];
    down_states[0] = PortState::Down;
    [
        (PortChange::Down, down_states),
        (PortChange::Up, vec![PortState::Active; n]),
    ]
    .into_iter()
    .map(|(change, states)| {
        let event = PortEvent {
            port: 0,
            change,
            cause: PortEventCause::AsyncEvent,
        };
        let answer = host.on_port_event(&event, conn, qps, &states)?;
        Ok(PortEventView {
            port: endpoint_view(first).name,
            change,
            answer: decided(answer, |a| a),
        })
    })
    .collect()
}

/// Every fallback in a report: (decision, source).
pub fn fallbacks(report: &Report) -> Vec<(String, &SourceView)> {
    let mut all: Vec<(String, &SourceView)> = vec![
        ("select-devices".into(), &report.devices.source),
        ("group-devices".into(), &report.groups.source),
    ];
    all.extend(
        report
            .gids
            .iter()
            .map(|g| (format!("select-gid {}", g.name), &g.source)),
    );
    all.extend(
        report
            .vnic
            .iter()
            .map(|v| ("make-vnic".to_owned(), &v.answer.source)),
    );
    for c in report.connection.iter().chain(&report.connections) {
        let on = format!("device {}", c.device);
        all.push((format!("plan-connection {on}"), &c.plan.decided.source));
        all.extend(
            c.port_events
                .iter()
                .map(|e| (format!("on-port-event {on}"), &e.answer.source)),
        );
    }
    all.retain(|(_, s)| s.kind == "fallback");
    all
}

#[cfg(test)]
mod table_tests;
