//! [`PolicyHost`]: the decisions API the CLI, the transport and the plugin call.
//!
//! Each hook method returns a [`Decision`]: the value, its reason, and its [`Source`] (which
//! policy version made it, or why the built-in default did). The current policy lives behind one
//! `ArcSwapOption`: a call loads it once and makes its whole answer with that version, while a
//! swap publishes a new version with one store, after it was compiled, `init`-ed and tried on the
//! live topology (`docs/architecture.md`, "Hot swap").
//!
//! The hook methods are generated from `ncclwasm_model::for_each_hook!`; what each hook does
//! beyond the common failure model (its built-in answer, conversions, validation) is in
//! [`hooks`].

mod hooks;

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use ncclwasm_default::IbConfig;
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::telemetry::{Telemetry, TelemetrySource};
use ncclwasm_model::validate::{self, InvalidAnswer};
use ncclwasm_model::{
    Connection, DeviceSelection, Gid, Port, PortAnswer, PortEvent, PortState, QpPlan,
};

use crate::convert;
use crate::engine::{Compilation, Fault, Instance, LOG_TARGET, PolicyEngine, Pool};
use crate::watch::{Publish, Watcher};
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
    /// Its size and imports, and what compiling it cost this load.
    pub compilation: Compilation,
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
    pub calls: [(Hook, u64); Hook::COUNT],
    /// Faults per cause, in [`FailureCause::ALL`] order (fallbacks under `open`, errors under
    /// `closed`).
    pub faults: [(FailureCause, u64); FailureCause::ALL.len()],
    pub swaps_ok: u64,
    pub swaps_refused: u64,
}

/// The counters behind [`Stats`], sized by the lists of hooks and causes.
#[derive(Debug)]
struct Counters {
    calls: [AtomicU64; Hook::COUNT],
    faults: [AtomicU64; FailureCause::ALL.len()],
    swaps_ok: AtomicU64,
    swaps_refused: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            faults: std::array::from_fn(|_| AtomicU64::new(0)),
            swaps_ok: AtomicU64::new(0),
            swaps_refused: AtomicU64::new(0),
        }
    }
}

impl Counters {
    fn call(&self, hook: Hook) {
        if let Some(i) = hook.decision_index() {
            self.calls[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn fault(&self, cause: FailureCause) {
        self.faults[cause.index()].fetch_add(1, Ordering::Relaxed);
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

/// The caller's own check of a policy's answer (the transport's: does the plan fit this
/// connection?), `Err` saying why not.
type Fits<'a, T> = &'a dyn Fn(&T) -> Result<(), String>;

/// A policy's answer must also pass `fits`, the caller's own check, when there is one: one that
/// does not is an invalid answer.
fn fitting<T>(asked: Asked<T>, fits: Option<Fits<'_, T>>) -> Result<Asked<T>, Fault> {
    match (asked, fits) {
        (Asked::Answer(v), Some(fits)) => match fits(&v) {
            Ok(()) => Ok(Asked::Answer(v)),
            Err(detail) => Err(Fault {
                cause: FailureCause::InvalidAnswer,
                detail,
            }),
        },
        (asked, _) => Ok(asked),
    }
}

/// State shared by the host, its watcher thread and in-flight calls.
struct Shared {
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

/// One [`PolicyHost`] method per hook of `ncclwasm_model::for_each_hook!`.
macro_rules! host_methods {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        impl PolicyHost {
            $(host_method! {
                [$(#[$doc])*] $variant $method ($($arg: $ty),*) -> $answer; [$($fitting)?]
            })*
        }
    };
}

/// A hook's method: its glue in [`hooks`] under the failure model of [`Shared::decide`]; and,
/// for a hook the list marks `fitting`, the method that also takes the caller's check.
macro_rules! host_method {
    ([$(#[$doc:meta])*] $variant:ident $method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; []) => {
        $(#[$doc])*
        pub fn $method(&self, $($arg: $ty),*) -> Result<Decision<$answer>, PolicyError> {
            let s = &*self.shared;
            s.decide(
                Hook::$variant,
                true,
                None,
                || hooks::$variant::builtin(s, $($arg),*),
                |v, source| hooks::$variant::reason(v, source),
                |l| hooks::$variant::ask(s, l, $($arg),*),
            )
        }
    };
    (
        [$(#[$doc:meta])*] $variant:ident $method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty;
        [$fitting:ident]
    ) => {
        host_method! { [$(#[$doc])*] $variant $method ($($arg: $ty),*) -> $answer; [] }

        #[doc = concat!("As [`", stringify!($method), "`](Self::", stringify!($method), "),")]
        /// and a policy's answer must also pass `fits`, the data path's own checks against the
        /// live call: one that does not is an invalid answer like any other (fallback under
        /// `open`, error under `closed`).
        pub fn $fitting(
            &self,
            $($arg: $ty,)*
            fits: &dyn Fn(&$answer) -> Result<(), String>,
        ) -> Result<Decision<$answer>, PolicyError> {
            let s = &*self.shared;
            s.decide(
                Hook::$variant,
                true,
                Some(fits),
                || hooks::$variant::builtin(s, $($arg),*),
                |v, source| hooks::$variant::reason(v, source),
                |l| hooks::$variant::ask(s, l, $($arg),*),
            )
        }
    };
}

ncclwasm_model::for_each_hook!(host_methods);

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
        // Values NCCL accepts but reads other than their author probably meant: the built-in
        // default does what NCCL does, and the operator hears which and what was done.
        for w in ib.warnings() {
            tracing::warn!(target: LOG_TARGET, "{w}");
        }
        for w in settings.unknown_warnings() {
            tracing::warn!(target: LOG_TARGET, "{w}");
        }
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
        let mut loaded = None;
        if let Some(path) = &shared.settings.policy {
            match shared.swap_path(path) {
                Ok(id) => loaded = Some(id.sha256.clone()),
                Err(e) if shared.settings.failure == FailureMode::Closed => return Err(e),
                Err(_) => {} // WARNed by `publish`; the built-in default decides.
            }
        }
        let watcher = match (&shared.settings.policy, shared.settings.reload) {
            (Some(path), Some(every)) => Some(Watcher::start(
                shared.clone(),
                path.clone(),
                every,
                loaded.as_deref(),
            )?),
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

    /// The rail and plane of each port of `selection` (`selected`, in its order; v12
    /// `railId`/`planeId`): the selection's own when `select-devices` gave them, else from
    /// `NCCL_IB_HCA`, as NCCL 2.30.
    pub fn rails(
        &self,
        selection: &DeviceSelection,
        selected: &[Port],
    ) -> Vec<ncclwasm_model::device_table::RailPlane> {
        selection.rails.clone().unwrap_or_else(|| {
            selected
                .iter()
                .map(|p| ncclwasm_default::rail_plane(&self.shared.ib, p))
                .collect()
        })
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
    /// Until [`set_telemetry`](Self::set_telemetry) says otherwise, a policy's `telemetry.read`
    /// finds these ports idle.
    pub fn set_topology(&self, ports: Vec<Port>) {
        if !self.shared.engine.has_telemetry() {
            self.set_telemetry(Arc::new(Telemetry::idle(&ports)));
        }
        self.shared.topology.store(Some(Arc::new(ports)));
    }

    /// Where a policy's `telemetry.read` reads from now on: the transport's counters in a job,
    /// a snapshot file (a [`Telemetry`]) offline.
    pub fn set_telemetry(&self, source: Arc<dyn TelemetrySource>) {
        self.shared.engine.set_telemetry(source);
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

    /// [`on_port_event`](Self::on_port_event) about a failure that has not happened — asked at
    /// connect time, to know whether to prepare the connection for one — without an INFO line.
    pub fn on_port_event_ahead(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decision<PortAnswer>, PolicyError> {
        let s = &*self.shared;
        s.decide(
            Hook::OnPortEvent,
            false,
            None,
            || hooks::OnPortEvent::builtin(s, event, conn, qps, states),
            hooks::OnPortEvent::reason,
            |l| hooks::OnPortEvent::ask(s, l, event, conn, qps, states),
        )
    }

    /// A port changed state: the live topology (what a hot-swapped policy is tried on) follows.
    pub fn port_changed(&self, device: &str, port: u8, state: PortState) {
        let changed = self.change_port(device, port, |p| {
            std::mem::replace(&mut p.state, state) != state
        });
        if changed {
            tracing::info!(target: LOG_TARGET, "policy: {device}:{port} is now {state:?}");
        }
    }

    /// A port's GID table changed: the live topology (what a hot-swapped policy is tried on)
    /// takes `gids`, the table as the transport read it through verbs. An entry whose bytes did
    /// not change keeps the type and prefix discovery gave it (read from sysfs, which the
    /// transport does not read); a new one keeps what `gids` says.
    pub fn gids_changed(&self, device: &str, port: u8, gids: &[Gid]) {
        let changed = self.change_port(device, port, |p| {
            let merged: Vec<Gid> = gids
                .iter()
                .map(|g| {
                    p.gids
                        .iter()
                        .find(|known| known.index == g.index && known.raw == g.raw)
                        .unwrap_or(g)
                        .clone()
                })
                .collect();
            merged != std::mem::replace(&mut p.gids, merged.clone())
        });
        if changed {
            let configured = gids.iter().filter(|g| !g.is_unconfigured()).count();
            tracing::info!(target: LOG_TARGET, "policy: {device}:{port} has a new GID table ({configured} configured entries)");
        }
    }

    /// Applies `change` to port `device:port` of the live topology (`true`: it changed the port)
    /// and publishes the topology when it did; `false` too when no topology was set.
    fn change_port(
        &self,
        device: &str,
        port: u8,
        mut change: impl FnMut(&mut Port) -> bool,
    ) -> bool {
        let s = &*self.shared;
        let Some(ports) = s.topology.load_full() else {
            return false;
        };
        let mut ports = (*ports).clone();
        let mut changed = false;
        for p in ports
            .iter_mut()
            .filter(|p| p.device == device && p.port == port)
        {
            changed |= change(p);
        }
        if changed {
            s.topology.store(Some(Arc::new(ports)));
        }
        changed
    }
}

impl Shared {
    /// Make one decision: ask the current policy, fall back or fail as configured, and log it
    /// (the INFO line only when `log`: a question about what has not happened is no decision an
    /// operator should read as taken). A policy's answer that fails `fits`, the caller's own
    /// check, is an invalid answer like any other.
    fn decide<T>(
        &self,
        hook: Hook,
        log: bool,
        fits: Option<Fits<'_, T>>,
        builtin: impl FnOnce() -> T,
        reason: impl FnOnce(&T, &Source) -> String,
        ask: impl FnOnce(&Loaded) -> Result<Asked<T>, Fault>,
    ) -> Result<Decision<T>, PolicyError> {
        self.counters.call(hook);
        let current = self.current.load_full();
        let (value, source) = match current {
            None => (builtin(), Source::Builtin),
            Some(l) => match ask(&l).and_then(|asked| fitting(asked, fits)) {
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
            // A plan is decided per connection: its full reason goes to TRACE (and `explain`),
            // and the transport's one INFO line per connection says who decided. The
            // decisions made once per process stay at INFO.
            if hook == Hook::PlanConnection {
                tracing::debug!(target: LOG_TARGET, %hook, source = %source, "{reason}");
            } else {
                tracing::info!(target: LOG_TARGET, %hook, source = %source, "{reason}");
            }
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

    fn swap_path(&self, path: &Path) -> Result<Arc<PolicyId>, PolicyError> {
        let origin = path.display().to_string();
        let bytes = file::read(path, Limit::POLICY).map_err(|source| PolicyError::Read { source });
        self.publish(bytes.and_then(|b| self.load(&b, &origin)), &origin)
    }

    fn swap_bytes(&self, bytes: &[u8], origin: &str) -> Result<Arc<PolicyId>, PolicyError> {
        self.publish(self.load(bytes, origin), origin)
    }

    /// Publish a loaded version with one store, or count and WARN why it was refused.
    fn publish(
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
                let c = &id.compilation;
                tracing::info!(
                    target: LOG_TARGET,
                    policy = %id,
                    origin,
                    sha256 = %id.sha256,
                    "policy {id} published (was {was}); {} KiB, {} ms to compile: {}",
                    c.bytes.div_ceil(1024),
                    c.time.as_millis(),
                    c.cache
                );
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
        let sha256 = crate::watch::hex(&prepared.sha);
        let compilation = prepared.compilation.clone();
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
                .filter(|&h| hooks::declares(info.hooks, h))
                .collect(),
            compilation,
        });
        pool.set_label(&id.to_string());
        pool.give_back(instance);
        let loaded = Loaded { id, pool };
        if let Some(ports) = self.topology.load_full() {
            hooks::trial(self, &loaded, &ports)?;
        }
        Ok(loaded)
    }
}

/// The watcher's owner: a new file is loaded and tried like any other, a refused one counted.
impl Publish for Shared {
    fn changed(&self, bytes: &[u8], origin: &str) {
        // Refusals are WARNed and counted by `publish`; the old policy stays.
        let _ = self.swap_bytes(bytes, origin);
    }

    fn refused(&self, error: PolicyError, origin: &str) {
        let _ = self.publish(Err(error), origin);
    }
}
