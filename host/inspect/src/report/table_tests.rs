//! The device table the plugin tells NCCL (the transport's [`Net`]) against the one the report
//! shows (`policy explain`, `devices`, `bench`): equal on every machine of the corpus under
//! every shipped policy, and when a group lists its ports in another order than the selection.
//!
//! The transport's table is built by `Net::new` on the soft fabric, which reads its machine once
//! per process (`NCCL_WASM_TOPOLOGY`): each topology gets a child process that prints its table
//! as protocol lines, and the parent compares them with the report's on the same file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ncclwasm_model::decide::{Decided, DecisionError, Decisions};
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortAnswer, PortEvent,
    PortState, QpPlan, Topology, VnicAnswer,
};
use ncclwasm_policy::{PolicyHost, Settings};
use ncclwasm_testkit::child;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{Net, NetConfig};

use super::{Connections, NcclDevice, PolicyView, choose, device_table, evaluate, nccl_devices};

/// The shipped policies: the built-in default (`None`) and the wasm policies of `policies/`.
fn policies() -> Vec<(&'static str, Option<PathBuf>)> {
    let mut all = vec![("builtin", None)];
    for p in ["nccl-default", "rail-aligned", "weighted-stripe"] {
        all.push((p, Some(ncclwasm_testkit::guest(p))));
    }
    all
}

fn host(policy: Option<PathBuf>) -> PolicyHost {
    let mut s = Settings::default();
    s.policy = policy;
    PolicyHost::new(s).expect("the policy loads")
}

/// One device as a line: its name, `props.port` and its ports (`port.index` values).
fn line(name: &str, port: u8, ports: &[u32]) -> String {
    format!("{name} port {port} {ports:?}")
}

/// The transport's table on the machine `NCCL_WASM_TOPOLOGY` names, or why there is none.
fn transport_table(decisions: Arc<dyn Decisions>) -> Vec<String> {
    let net = Net::new(NetConfig {
        fabric: ncclwasm_soft::fabric().expect("the soft fabric"),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions,
        oob: OobEnv::default(),
    });
    match net {
        Ok(net) => (0..net.device_count() as i64)
            .map(|d| {
                let props = net.properties(d).expect("a device of the table");
                let ports = net.device_ports(d).expect("a device of the table");
                line(&props.name, props.port, &ports)
            })
            .collect(),
        Err(e) => vec![format!("no device: {e}")],
    }
}

/// The report's table: the same lines.
fn report_table(devices: &[NcclDevice]) -> Vec<String> {
    devices
        .iter()
        .map(|d| line(&d.name, d.port, &d.ports))
        .collect()
}

/// Runs `test`'s child side on `topology`; returns the protocol lines it printed, by key.
fn child_tables(test: &str, topology: &Path) -> BTreeMap<String, Vec<String>> {
    let mut cmd = child::command(test);
    cmd.env("NCCL_WASM_TOPOLOGY", topology)
        .env_remove("NCCL_WASM_POLICY");
    let out = child::run(cmd, test);
    let mut tables = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(at) = line.find(child::TAG) else {
            continue;
        };
        let (key, json) = line[at + child::TAG.len()..]
            .split_once('=')
            .expect("key=table");
        tables.insert(key.to_owned(), serde_json::from_str(json).expect("a table"));
    }
    tables
}

fn say_table(key: &str, table: &[String]) {
    child::say(&format!(
        "{key}={}",
        serde_json::to_string(table).expect("a table")
    ));
}

#[test]
fn transport_and_report_tables_agree_on_the_corpus_under_every_shipped_policy() {
    const TEST: &str = "report::table_tests::transport_and_report_tables_agree_on_the_corpus_under_every_shipped_policy";
    if child::enter(TEST) {
        for (name, policy) in policies() {
            say_table(name, &transport_table(Arc::new(host(policy))));
        }
        return;
    }
    let hosts: Vec<(&str, PolicyHost)> = policies()
        .into_iter()
        .map(|(name, policy)| (name, host(policy)))
        .collect();
    let mut differ = Vec::new();
    for file in ncclwasm_testkit::topologies() {
        let transport = child_tables(TEST, &file);
        let topology = Topology::load(&file).unwrap();
        for (name, host) in &hosts {
            let report = evaluate(
                host,
                PolicyView::builtin(),
                &topology,
                None,
                &[],
                Connections::Sample,
                Default::default(),
            )
            .unwrap();
            let report = report_table(&report.nccl_devices);
            let transport = &transport[*name];
            if *transport != report {
                differ.push(format!(
                    "{} under {name}:\n  transport {transport:?}\n  report    {report:?}",
                    topology.name
                ));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "the tables differ:\n{}",
        differ.join("\n")
    );
}

/// The built-in default, except that `group-devices` fuses the third and the first selected
/// ports, listed in that order.
#[derive(Debug)]
struct ThirdAndFirst(PolicyHost);

fn third_and_first(selected: &[Port]) -> Vec<DeviceGroup> {
    vec![DeviceGroup {
        ports: vec![selected[2].index, selected[0].index],
        name: None,
        reason: "listed out of selection order".into(),
    }]
}

impl Decisions for ThirdAndFirst {
    fn live_ports(&self, ports: &[Port]) {
        Decisions::live_ports(&self.0, ports)
    }
    fn select_devices(&self, ports: &[Port]) -> Result<Decided<DeviceSelection>, DecisionError> {
        Decisions::select_devices(&self.0, ports)
    }
    fn select_gid(&self, port: &Port) -> Result<Decided<GidChoice>, DecisionError> {
        Decisions::select_gid(&self.0, port)
    }
    fn group_devices(&self, ports: &[Port]) -> Result<Decided<Vec<DeviceGroup>>, DecisionError> {
        Ok(Decided {
            value: third_and_first(ports),
            reason: "test".into(),
            source: "test".into(),
        })
    }
    fn make_vnic(
        &self,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Decided<VnicAnswer>, DecisionError> {
        Decisions::make_vnic(&self.0, request, ports)
    }
    fn plan_connection(
        &self,
        conn: &Connection,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Decided<ConnPlan>, DecisionError> {
        Decisions::plan_connection(&self.0, conn, fits)
    }
    fn on_port_event(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError> {
        Decisions::on_port_event(&self.0, event, conn, qps, states)
    }
    fn port_changed(&self, device: &str, port: u8, state: PortState) {
        Decisions::port_changed(&self.0, device, port, state)
    }
}

#[test]
fn a_group_listed_out_of_selection_order_stands_in_one_place() {
    const TEST: &str =
        "report::table_tests::a_group_listed_out_of_selection_order_stands_in_one_place";
    if child::enter(TEST) {
        say_table(
            "grouped",
            &transport_table(Arc::new(ThirdAndFirst(host(None)))),
        );
        return;
    }
    let file = ncclwasm_testkit::topology("roce-8nic.toml");
    let transport = &child_tables(TEST, &file)["grouped"];
    let host = host(None);
    let ports = Topology::load(&file).unwrap().ports();
    host.set_topology(ports.clone());
    let chosen = choose(&host, &ports).unwrap();
    let table = device_table(&chosen, &third_and_first(&chosen.selected));
    let report = report_table(&nccl_devices(&table, &chosen.selected));
    assert_eq!(*transport, report);
    // Where the rule puts it: at the first selected port, which the group lists last.
    assert_eq!(report[0], line("mlx5_2+mlx5_0", 1, &[2, 0]), "{report:?}");
}
