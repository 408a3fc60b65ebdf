//! [`PolicyHost`]: the decisions API the CLI, the transport and the plugin call.
//!
//! Each hook method returns a [`Decision`]: the value, its reason, and its [`Source`] (which
//! policy version made it, or why the built-in default did). The current policy lives behind one
//! `ArcSwapOption`: a call loads it once and makes its whole answer with that version, while a
//! swap publishes a new version with one store, after it was compiled, `init`-ed and tried on the
//! live topology (`docs/architecture.md`, "Hot swap").

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use ncclwasm_default::IbConfig;
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::validate::{self, InvalidAnswer};
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortAnswer, PortChange,
    PortEvent, PortEventCause, PortState, QpPlan, VnicAnswer,
};

use crate::convert;
use crate::engine::wit::ncclwasm::policy::types::Hooks as HookFlags;
use crate::engine::{Fault, Instance, LOG_TARGET, PolicyEngine, Pool};
use crate::watch::Watcher;
use crate::{FailureCause, FailureMode, Hook, PolicyError, Settings};

/// Which policy version made a decision: what `policy explain` and the INFO logs show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyId {
    /// As the policy's `init` reported them.
    pub name: String,
    pub version: String,
    /// sha256 of the component's bytes, in hex.
    pub sha256: String,
    /// Where it came from: the path, or the label given to [`PolicyHost::swap_from_bytes`].
    pub origin: String,
    /// The decision hooks it declared in `policy-info.hooks`, in [`Hook::DECISIONS`] order; the
    /// host never calls the others.
    pub hooks: Vec<Hook>,
}

impl fmt::Display for PolicyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.version)
    }
}

/// Where a decision came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The policy answered, and the answer passed validation.
    Policy(Arc<PolicyId>),
    /// No wasm policy is loaded: the built-in default decides.
    Builtin,
    /// The policy answered `none` for this decision.
    NoOpinion(Arc<PolicyId>),
    /// The policy does not implement this hook (not in `policy-info.hooks`).
    NotImplemented(Arc<PolicyId>),
    /// The policy faulted; under `NCCL_WASM_POLICY_FAILURE=open` the built-in default decided.
    Fallback {
        policy: Arc<PolicyId>,
        cause: FailureCause,
        detail: String,
    },
}

impl Source {
    /// True when the built-in default made the decision, for whatever reason.
    pub fn is_builtin(&self) -> bool {
        !matches!(self, Source::Policy(_))
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Policy(id) => write!(f, "policy {id}"),
            Source::Builtin => f.write_str("built-in default (no policy loaded)"),
            Source::NoOpinion(id) => write!(f, "built-in default ({id} had no opinion)"),
            Source::NotImplemented(id) => {
                write!(f, "built-in default ({id} does not implement this hook)")
            }
            Source::Fallback {
                policy,
                cause,
                detail,
            } => {
                write!(
                    f,
                    "built-in default (fallback: {policy} failed with {cause}: {detail})"
                )
            }
        }
    }
}

/// A decision with its explanation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision<T> {
    pub value: T,
    /// Why, in the words of whoever decided.
    pub reason: String,
    pub source: Source,
}

/// How often each thing happened since the host was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Calls per decision hook, in [`Hook::DECISIONS`] order.
    pub calls: [(Hook, u64); 6],
    /// Faults per cause, in [`FailureCause::ALL`] order (fallbacks under `open`, errors under
    /// `closed`).
    pub faults: [(FailureCause, u64); 5],
    pub swaps_ok: u64,
    pub swaps_refused: u64,
}

#[derive(Debug, Default)]
struct Counters {
    calls: [AtomicU64; 6],
    faults: [AtomicU64; 5],
    swaps_ok: AtomicU64,
    swaps_refused: AtomicU64,
}

impl Counters {
    fn call(&self, hook: Hook) {
        if let Some(i) = Hook::DECISIONS.iter().position(|h| *h == hook) {
            self.calls[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn fault(&self, cause: FailureCause) {
        let i = FailureCause::ALL
            .iter()
            .position(|c| *c == cause)
            .expect("every cause is listed");
        self.faults[i].fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Stats {
        let get = |a: &AtomicU64| a.load(Ordering::Acquire);
        Stats {
            calls: std::array::from_fn(|i| (Hook::DECISIONS[i], get(&self.calls[i]))),
            faults: std::array::from_fn(|i| (FailureCause::ALL[i], get(&self.faults[i]))),
            swaps_ok: get(&self.swaps_ok),
            swaps_refused: get(&self.swaps_refused),
        }
    }
}

/// One loaded policy version: its identity (with the hooks it declared) and its instances.
pub(crate) struct Loaded {
    id: Arc<PolicyId>,
    pool: Pool,
}

/// What asking a policy gave, before the host picks the source.
enum Asked<T> {
    Answer(T),
    NoOpinion,
    NotImplemented,
}

impl Loaded {
    /// Call `hook` if the policy implements it, and validate the answer with `finish`.
    fn ask<W, T>(
        &self,
        hook: Hook,
        call: impl FnOnce(&mut Instance) -> wasmtime::Result<Option<W>>,
        finish: impl FnOnce(W) -> Result<T, InvalidAnswer>,
    ) -> Result<Asked<T>, Fault> {
        let declared = hook == Hook::Init || self.id.hooks.contains(&hook);
        if !declared {
            return Ok(Asked::NotImplemented);
        }
        match self.pool.call(call)? {
            None => Ok(Asked::NoOpinion),
            Some(w) => finish(w).map(Asked::Answer).map_err(|e| Fault {
                cause: FailureCause::InvalidAnswer,
                detail: e.to_string(),
            }),
        }
    }
}

/// State shared by the host, its watcher thread and in-flight calls.
pub(crate) struct Shared {
    settings: Settings,
    ib: IbConfig,
    engine: Arc<PolicyEngine>,
    current: ArcSwapOption<Loaded>,
    /// The live ports, for trial runs and for the QP limit of plans.
    topology: ArcSwapOption<Vec<Port>>,
    counters: Counters,
    /// (policy, hook, cause) already warned about.
    warned: Mutex<HashSet<(String, Hook, FailureCause)>>,
}

/// The policy engine as the rest of the plugin sees it. `Sync`: share it between NCCL's threads.
/// Dropping it stops the watcher and, with the last loaded version, the epoch thread.
pub struct PolicyHost {
    shared: Arc<Shared>,
    _watcher: Option<Watcher>,
}

impl fmt::Debug for PolicyHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyHost")
            .field("settings", &self.shared.settings)
            .field("policy", &self.policy())
            .finish_non_exhaustive()
    }
}

impl PolicyHost {
    /// A host configured from the environment (`NCCL_WASM_POLICY*`, `NCCL_IB_*`), for an NCCL
    /// ABI whose virtual NICs hold up to `max_devs_per_nic` devices.
    pub fn from_env(max_devs_per_nic: usize) -> Result<PolicyHost, PolicyError> {
        PolicyHost::new(Settings {
            max_devs_per_nic,
            ..Settings::from_env()?
        })
    }

    /// A host with explicit settings. With `settings.policy` set, the policy is loaded now: if
    /// that fails, `closed` returns the error and `open` WARNs and starts with the built-in
    /// default (the watcher, when on, keeps looking at the file).
    pub fn new(settings: Settings) -> Result<PolicyHost, PolicyError> {
        settings.log();
        let ib = IbConfig::from_pairs(&settings.ib)?;
        let engine = PolicyEngine::new(&settings)?;
        let shared = Arc::new(Shared {
            ib,
            engine,
            current: ArcSwapOption::empty(),
            topology: ArcSwapOption::empty(),
            counters: Counters::default(),
            warned: Mutex::new(HashSet::new()),
            settings,
        });
        if let Some(path) = &shared.settings.policy {
            match shared.swap_path(path) {
                Ok(_) => {}
                Err(e) if shared.settings.failure == FailureMode::Closed => return Err(e),
                Err(_) => {} // WARNed by `publish`; the built-in default decides.
            }
        }
        let watcher = match (&shared.settings.policy, shared.settings.reload) {
            (Some(path), Some(every)) => {
                Some(Watcher::start(Arc::clone(&shared), path.clone(), every)?)
            }
            _ => None,
        };
        Ok(PolicyHost {
            shared,
            _watcher: watcher,
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.shared.settings
    }

    /// The built-in default's configuration (parsed `NCCL_IB_*`).
    pub fn ib_config(&self) -> &IbConfig {
        &self.shared.ib
    }

    /// The wasm policy now deciding; `None` = the built-in default.
    pub fn policy(&self) -> Option<Arc<PolicyId>> {
        self.shared
            .current
            .load()
            .as_ref()
            .map(|l| Arc::clone(&l.id))
    }

    pub fn stats(&self) -> Stats {
        self.shared.counters.snapshot()
    }

    /// Tell the host the live ports. From then on a new policy is tried on them (every hook,
    /// with a sample connection) before it is published, and plans are held to their QP limit.
    pub fn set_topology(&self, ports: Vec<Port>) {
        self.shared.topology.store(Some(Arc::new(ports)));
    }

    /// Compile, `init`, try and publish the component at `path`; on failure the previous policy
    /// stays and the error says why (also WARNed).
    pub fn swap_from_path(&self, path: impl AsRef<Path>) -> Result<Arc<PolicyId>, PolicyError> {
        self.shared.swap_path(path.as_ref())
    }

    /// As [`swap_from_path`](Self::swap_from_path), from bytes; `origin` names them in logs.
    pub fn swap_from_bytes(
        &self,
        bytes: &[u8],
        origin: &str,
    ) -> Result<Arc<PolicyId>, PolicyError> {
        self.shared.swap_bytes(bytes, origin)
    }

    /// Go back to the built-in default.
    pub fn use_builtin(&self) {
        self.shared.current.store(None);
        tracing::info!(target: LOG_TARGET, "policy: built-in default");
    }

    /// Which ports NCCL sees, in which order.
    pub fn select_devices(&self, ports: &[Port]) -> Result<Decision<DeviceSelection>, PolicyError> {
        let s = &*self.shared;
        s.decide(
            Hook::SelectDevices,
            || ncclwasm_default::select_devices(&s.ib, ports),
            |d, _| d.reason.clone(),
            |l| s.ask_select_devices(l, ports),
        )
    }

    /// The GID index `port` uses.
    pub fn select_gid(&self, port: &Port) -> Result<Decision<GidChoice>, PolicyError> {
        let s = &*self.shared;
        s.decide(
            Hook::SelectGid,
            || ncclwasm_default::select_gid(&s.ib, port),
            |d, _| d.reason.clone(),
            |l| s.ask_select_gid(l, port),
        )
    }

    /// Fused NICs the plugin exposes; `ports` are the selected ports in NCCL order.
    pub fn group_devices(&self, ports: &[Port]) -> Result<Decision<Vec<DeviceGroup>>, PolicyError> {
        let s = &*self.shared;
        s.decide(
            Hook::GroupDevices,
            || ncclwasm_default::group_devices(&s.ib, ports),
            |gs, source| groups_reason(gs, source),
            |l| s.ask_group_devices(l, ports),
        )
    }

    /// NCCL core asks to fuse `request` (device indices); `ports[k]` is the port of `request[k]`.
    pub fn make_vnic(
        &self,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Decision<VnicAnswer>, PolicyError> {
        let s = &*self.shared;
        let max = s.settings.max_devs_per_nic;
        s.decide(
            Hook::MakeVnic,
            || ncclwasm_default::make_vnic(&s.ib, request, ports, max),
            |v, _| vnic_reason(v).to_owned(),
            |l| s.ask_make_vnic(l, request, ports),
        )
    }

    /// The plan of one connection: the policy's patch merged over the built-in plan, validated.
    pub fn plan_connection(&self, conn: &Connection) -> Result<Decision<ConnPlan>, PolicyError> {
        self.plan_connection_fitting(conn, &|_| Ok(()))
    }

    /// As [`plan_connection`](Self::plan_connection), and a policy's plan must also pass
    /// `fits`, the data path's own checks against the live connection: one that does not is an
    /// invalid answer like any other (fallback under `open`, error under `closed`).
    pub fn plan_connection_fitting(
        &self,
        conn: &Connection,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Decision<ConnPlan>, PolicyError> {
        let s = &*self.shared;
        let base = ncclwasm_default::plan_connection(&s.ib, conn);
        s.decide(
            Hook::PlanConnection,
            || base.clone(),
            |p, _| p.reason.clone(),
            |l| s.ask_plan_connection(l, conn, &base, fits),
        )
    }

    /// What connection `conn`, running QPs `qps`, does about `event`; `states[i]` is the
    /// current state of `conn.local[i]`. The answer is checked by
    /// `validate::check_port_answer`, so the transport can carry it out as given.
    pub fn on_port_event(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decision<PortAnswer>, PolicyError> {
        self.port_event(true, event, conn, qps, states)
    }

    /// [`on_port_event`](Self::on_port_event) about a failure that has not happened — asked at
    /// connect time, to know whether to prepare the connection for one — without an INFO line.
    pub fn on_port_event_ahead(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decision<PortAnswer>, PolicyError> {
        self.port_event(false, event, conn, qps, states)
    }

    fn port_event(
        &self,
        log: bool,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decision<PortAnswer>, PolicyError> {
        let s = &*self.shared;
        s.decide_logged(
            Hook::OnPortEvent,
            log,
            || ncclwasm_default::on_port_event(&s.ib, event, conn, qps, states),
            |a, _| format!("{}: {}", a.kind(), a.reason()),
            |l| s.ask_on_port_event(l, event, conn, qps, states),
        )
    }

    /// A port changed state: the live topology (what a hot-swapped policy is tried on) follows.
    pub fn port_changed(&self, device: &str, port: u8, state: PortState) {
        let s = &*self.shared;
        let Some(ports) = s.topology.load_full() else {
            return;
        };
        let mut ports = (*ports).clone();
        let mut changed = false;
        for p in ports
            .iter_mut()
            .filter(|p| p.device == device && p.port == port && p.state != state)
        {
            p.state = state;
            changed = true;
        }
        if changed {
            tracing::info!(target: LOG_TARGET, "policy: {device}:{port} is now {state:?}");
            s.topology.store(Some(Arc::new(ports)));
        }
    }
}

fn groups_reason(gs: &[DeviceGroup], source: &Source) -> String {
    if gs.is_empty() {
        return match source {
            Source::Policy(id) => format!("{id} made no groups"),
            _ => ncclwasm_default::NO_GROUPS_REASON.to_owned(),
        };
    }
    gs.iter()
        .map(|g| g.reason.as_str())
        .collect::<Vec<_>>()
        .join("; ")
}

fn vnic_reason(v: &VnicAnswer) -> &str {
    match v {
        VnicAnswer::Accept { reason }
        | VnicAnswer::Reshape { reason, .. }
        | VnicAnswer::Refuse { reason } => reason,
    }
}

impl Shared {
    /// Make one decision: ask the current policy, fall back or fail as configured, and log it.
    fn decide<T>(
        &self,
        hook: Hook,
        builtin: impl FnOnce() -> T,
        reason: impl FnOnce(&T, &Source) -> String,
        ask: impl FnOnce(&Loaded) -> Result<Asked<T>, Fault>,
    ) -> Result<Decision<T>, PolicyError> {
        self.decide_logged(hook, true, builtin, reason, ask)
    }

    /// [`decide`](Self::decide), with its INFO line only when `log` (a question about what has
    /// not happened is no decision an operator should read as taken).
    fn decide_logged<T>(
        &self,
        hook: Hook,
        log: bool,
        builtin: impl FnOnce() -> T,
        reason: impl FnOnce(&T, &Source) -> String,
        ask: impl FnOnce(&Loaded) -> Result<Asked<T>, Fault>,
    ) -> Result<Decision<T>, PolicyError> {
        self.counters.call(hook);
        let current = self.current.load_full();
        let (value, source) = match current {
            None => (builtin(), Source::Builtin),
            Some(l) => match ask(&l) {
                Ok(Asked::Answer(v)) => (v, Source::Policy(Arc::clone(&l.id))),
                Ok(Asked::NoOpinion) => (builtin(), Source::NoOpinion(Arc::clone(&l.id))),
                Ok(Asked::NotImplemented) => (builtin(), Source::NotImplemented(Arc::clone(&l.id))),
                Err(fault) => {
                    self.counters.fault(fault.cause);
                    self.warn_once(&l.id, hook, &fault);
                    if self.settings.failure == FailureMode::Closed {
                        return Err(PolicyError::Failed {
                            policy: l.id.to_string(),
                            hook,
                            cause: fault.cause,
                            detail: fault.detail,
                        });
                    }
                    let Fault { cause, detail } = fault;
                    (
                        builtin(),
                        Source::Fallback {
                            policy: Arc::clone(&l.id),
                            cause,
                            detail,
                        },
                    )
                }
            },
        };
        let reason = reason(&value, &source);
        if log {
            tracing::info!(target: LOG_TARGET, %hook, source = %source, "{reason}");
        }
        Ok(Decision {
            value,
            reason,
            source,
        })
    }

    fn warn_once(&self, id: &PolicyId, hook: Hook, fault: &Fault) {
        let key = (format!("{id} {}", id.sha256), hook, fault.cause);
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key);
        if first {
            let then = match self.settings.failure {
                FailureMode::Open => {
                    "using the built-in default for this decision (further such faults are not logged)"
                }
                FailureMode::Closed => "failing the call (NCCL_WASM_POLICY_FAILURE=closed)",
            };
            tracing::warn!(target: LOG_TARGET, policy = %id, %hook, cause = %fault.cause, "policy {id} failed in {hook}: {}: {}; {then}", fault.cause, fault.detail);
        }
    }

    fn ask_select_devices(
        &self,
        l: &Loaded,
        ports: &[Port],
    ) -> Result<Asked<DeviceSelection>, Fault> {
        let arg = convert::ports(ports);
        l.ask(
            Hook::SelectDevices,
            |i| i.bindings.call_select_devices(&mut i.store, &arg),
            |w| {
                let sel = convert::selection(w);
                validate::check_selection(&sel, ports).map(|()| sel)
            },
        )
    }

    fn ask_select_gid(&self, l: &Loaded, port: &Port) -> Result<Asked<GidChoice>, Fault> {
        let arg = convert::port(port);
        l.ask(
            Hook::SelectGid,
            |i| i.bindings.call_select_gid(&mut i.store, &arg),
            |w| {
                let choice = convert::gid_choice(w);
                validate::check_gid(&choice, port).map(|()| choice)
            },
        )
    }

    fn ask_group_devices(
        &self,
        l: &Loaded,
        ports: &[Port],
    ) -> Result<Asked<Vec<DeviceGroup>>, Fault> {
        let arg = convert::ports(ports);
        let max = self.settings.max_devs_per_nic;
        l.ask(
            Hook::GroupDevices,
            |i| {
                i.bindings
                    .call_group_devices(&mut i.store, &arg, wire_max(max))
            },
            |w| {
                let groups = convert::groups(w);
                validate::check_groups(&groups, ports, max).map(|()| groups)
            },
        )
    }

    fn ask_make_vnic(
        &self,
        l: &Loaded,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Asked<VnicAnswer>, Fault> {
        let arg = convert::ports(ports);
        let max = self.settings.max_devs_per_nic;
        l.ask(
            Hook::MakeVnic,
            |i| {
                i.bindings
                    .call_make_vnic(&mut i.store, request, &arg, wire_max(max))
            },
            |w| {
                let answer = convert::vnic(w);
                validate::check_vnic(&answer, request, ports, max).map(|()| answer)
            },
        )
    }

    fn ask_plan_connection(
        &self,
        l: &Loaded,
        conn: &Connection,
        base: &ConnPlan,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Asked<ConnPlan>, Fault> {
        let arg = convert::connection(conn);
        let max_qps = self.max_qps(conn);
        l.ask(
            Hook::PlanConnection,
            |i| i.bindings.call_plan_connection(&mut i.store, &arg),
            |w| {
                let plan = convert::patch(w).apply(base.clone());
                validate::check_plan(&plan, conn, max_qps)?;
                fits(&plan).map_err(InvalidAnswer::new)?;
                Ok(plan)
            },
        )
    }

    fn ask_on_port_event(
        &self,
        l: &Loaded,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Asked<PortAnswer>, Fault> {
        let (e, c, q) = (
            convert::port_event(event),
            convert::connection(conn),
            convert::qp_plans(qps),
        );
        let st: Vec<_> = states.iter().map(|&s| convert::port_state(s)).collect();
        l.ask(
            Hook::OnPortEvent,
            |i| i.bindings.call_on_port_event(&mut i.store, e, &c, &q, &st),
            |w| {
                let answer = convert::port_answer(w);
                validate::check_port_answer(&answer, event, conn, qps, states).map(|()| answer)
            },
        )
    }

    /// The QP limit of a connection: the smallest `max_qps` of its local ports, when the live
    /// topology knows them.
    fn max_qps(&self, conn: &Connection) -> u32 {
        let topology = self.topology.load();
        let known = topology.as_deref().map(Vec::as_slice).unwrap_or_default();
        conn.local
            .iter()
            .filter_map(|e| {
                known
                    .iter()
                    .find(|p| p.device == e.device && p.port == e.port)
            })
            .map(|p| p.max_qps)
            .min()
            .unwrap_or(validate::MAX_QPS_PER_CONNECTION)
    }

    pub(crate) fn swap_path(&self, path: &Path) -> Result<Arc<PolicyId>, PolicyError> {
        let origin = path.display().to_string();
        let bytes = file::read(path, Limit::POLICY).map_err(|source| PolicyError::Read { source });
        self.publish(bytes.and_then(|b| self.load(&b, &origin)), &origin)
    }

    pub(crate) fn swap_bytes(
        &self,
        bytes: &[u8],
        origin: &str,
    ) -> Result<Arc<PolicyId>, PolicyError> {
        self.publish(self.load(bytes, origin), origin)
    }

    /// Publish a loaded version with one store, or count and WARN why it was refused.
    pub(crate) fn publish(
        &self,
        loaded: Result<Loaded, PolicyError>,
        origin: &str,
    ) -> Result<Arc<PolicyId>, PolicyError> {
        match loaded {
            Ok(loaded) => {
                let id = Arc::clone(&loaded.id);
                let previous = self.current.swap(Some(Arc::new(loaded)));
                self.counters.swaps_ok.fetch_add(1, Ordering::Relaxed);
                let was = previous.map_or("the built-in default".to_owned(), |p| p.id.to_string());
                tracing::info!(target: LOG_TARGET, policy = %id, origin, sha256 = %id.sha256, "policy {id} published (was {was})");
                Ok(id)
            }
            Err(e) => {
                let keep = self
                    .current
                    .load()
                    .as_ref()
                    .map_or("the built-in default".to_owned(), |p| p.id.to_string());
                tracing::warn!(target: LOG_TARGET, origin, "policy not loaded, keeping {keep}: {e}");
                // Counted after the WARN: whoever sees the count can find the line that says why.
                self.counters.swaps_refused.fetch_add(1, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Compile, instantiate, `init`, and try every hook on the live topology.
    fn load(&self, bytes: &[u8], origin: &str) -> Result<Loaded, PolicyError> {
        let prepared = self.engine.prepare(bytes, origin)?;
        let sha256: String = prepared.sha.iter().map(|b| format!("{b:02x}")).collect();
        let pool = Pool::new(
            Arc::clone(&self.engine),
            prepared,
            self.settings.init_pairs(),
            origin,
        );
        let (instance, info) = match pool.fresh() {
            Ok(Ok(first)) => first,
            Ok(Err(message)) => {
                return Err(PolicyError::InitRefused {
                    what: origin.to_owned(),
                    message: convert::reason(message),
                });
            }
            Err(Fault { cause, detail }) => {
                return Err(PolicyError::Trial {
                    what: origin.to_owned(),
                    hook: Hook::Init,
                    cause,
                    detail,
                });
            }
        };
        let id = Arc::new(PolicyId {
            name: convert::reason(info.name),
            version: convert::reason(info.version),
            sha256,
            origin: origin.to_owned(),
            hooks: Hook::DECISIONS
                .into_iter()
                .filter(|&h| declares(info.hooks, h))
                .collect(),
        });
        pool.set_label(&id.to_string());
        pool.give_back(instance);
        let loaded = Loaded { id, pool };
        if let Some(ports) = self.topology.load_full() {
            self.trial(&loaded, &ports)?;
        }
        Ok(loaded)
    }

    /// Ask every hook once, as the plugin would at start-up and on the first connection, off
    /// the hot path: a policy that faults or answers nonsense here is never published.
    fn trial(&self, l: &Loaded, ports: &[Port]) -> Result<(), PolicyError> {
        let failed = |hook: Hook| {
            move |Fault { cause, detail }| PolicyError::Trial {
                what: l.id.origin.clone(),
                hook,
                cause,
                detail,
            }
        };
        let selection = match self
            .ask_select_devices(l, ports)
            .map_err(failed(Hook::SelectDevices))?
        {
            Asked::Answer(sel) => sel,
            Asked::NoOpinion | Asked::NotImplemented => {
                ncclwasm_default::select_devices(&self.ib, ports)
            }
        };
        let selected: Vec<Port> = selection
            .ports
            .iter()
            .filter_map(|i| ports.iter().find(|p| p.index == *i).cloned())
            .collect();
        for port in &selected {
            self.ask_select_gid(l, port)
                .map_err(failed(Hook::SelectGid))?;
        }
        self.ask_group_devices(l, &selected)
            .map_err(failed(Hook::GroupDevices))?;
        let pair = &selected[..selected.len().min(2)];
        let request: Vec<u32> = (0..pair.len() as u32).collect();
        self.ask_make_vnic(l, &request, pair)
            .map_err(failed(Hook::MakeVnic))?;
        if let Some(conn) = selected.first().map(|p| self.sample_connection(p)) {
            let base = ncclwasm_default::plan_connection(&self.ib, &conn);
            self.ask_plan_connection(l, &conn, &base, &|_| Ok(()))
                .map_err(failed(Hook::PlanConnection))?;
            // Its one port goes down, then comes back.
            for (change, state) in [
                (PortChange::Down, PortState::Down),
                (PortChange::Up, PortState::Active),
            ] {
                let event = PortEvent {
                    port: 0,
                    change,
                    cause: PortEventCause::AsyncEvent,
                };
                self.ask_on_port_event(l, &event, &conn, &base.qps, &[state])
                    .map_err(failed(Hook::OnPortEvent))?;
            }
        }
        Ok(())
    }

    /// A connection from `port` to a peer that looks the same (as between two identical nodes),
    /// with the GID the built-in default would pick.
    fn sample_connection(&self, port: &Port) -> Connection {
        let endpoint = port.endpoint(ncclwasm_default::select_gid(&self.ib, port).index);
        Connection {
            comm_id: 0,
            traffic_class: -1,
            device: 0,
            device_name: port.device.clone(),
            local: vec![endpoint.clone()],
            peer: vec![endpoint],
        }
    }
}

/// Whether `policy-info.hooks` names `hook`.
fn declares(flags: HookFlags, hook: Hook) -> bool {
    let flag = match hook {
        Hook::Init => return true,
        Hook::SelectDevices => HookFlags::SELECT_DEVICES,
        Hook::SelectGid => HookFlags::SELECT_GID,
        Hook::GroupDevices => HookFlags::GROUP_DEVICES,
        Hook::MakeVnic => HookFlags::MAKE_VNIC,
        Hook::PlanConnection => HookFlags::PLAN_CONNECTION,
        Hook::OnPortEvent => HookFlags::ON_PORT_EVENT,
    };
    flags.contains(flag)
}

/// The vNIC size limit as the WIT carries it (NCCL's limits are 4 and 8).
fn wire_max(max_devs_per_nic: usize) -> u32 {
    u32::try_from(max_devs_per_nic).unwrap_or(u32::MAX)
}
