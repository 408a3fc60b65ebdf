//! Per-device state shared by every communicator: the open context, the PD, the MR cache, what
//! was decided about GPU memory on it, and the async-event thread that turns fatal events into errors of the next call (as net_ib's
//! `ncclIbAsyncThreadMain` and `devFatalError`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ncclwasm_model::device_table::data_direct_name;
use ncclwasm_model::{Endpoint, Port, PortState};
use ncclwasm_verbs::{AsyncEvent, AsyncEventKind, Context, DeviceAttr, Fabric, Pd};

use crate::gid_table::GidTables;
use crate::gpu::{self, GpuEnv, GpuFacts, GpuSupport};
use crate::mr_cache::MrCache;
use crate::net_error::NetError;
use crate::telemetry::Registry;
use ncclwasm_model::decide::Decisions;

/// How long the event thread waits per poll, i.e. how quickly it notices it should stop.
const EVENT_POLL: Duration = Duration::from_millis(50);

/// What the async-event thread recorded, shared by a device and its Data Direct twin.
#[derive(Debug, Default)]
struct FaultState {
    /// Fast check before taking the lock: has any fatal event been seen?
    any: AtomicBool,
    faults: Mutex<Faults>,
}

/// How many times each port of the device went down (`PORT_ERR`) and came back
/// (`PORT_ACTIVE`): a connection prepared for failover compares them with what it saw before.
#[derive(Debug, Default)]
struct PortEvents {
    /// Bumped on every port event: the one atomic load a prepared connection makes per call.
    generation: AtomicU64,
    counts: Mutex<HashMap<u8, PortCounts>>,
}

/// Port events of one port so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PortCounts {
    pub(crate) downs: u64,
    pub(crate) ups: u64,
}

#[derive(Debug, Default)]
struct Faults {
    /// The whole device is gone.
    device: Option<String>,
    /// Fatal events about single QPs, by the QP object's id ([`ncclwasm_verbs::Qp::id`]), as
    /// net_ib finds its QP through the event's context pointer: QP numbers are reused, so an
    /// event kept by number would fail a later connection that got the same number. Removed
    /// when the QP is destroyed ([`QpWatch`]); an event that arrives after that (it was in
    /// flight while the QP was destroyed) finds no entry and is dropped.
    qps: HashMap<u64, Option<String>>,
}

impl FaultState {
    /// Keeps the fast check true exactly while something is recorded.
    fn update_any(&self, f: &Faults) {
        let any = f.device.is_some() || f.qps.values().any(Option::is_some);
        self.any.store(any, Ordering::Release);
    }
}

/// Drops a QP's recorded fatal event when the QP goes away. Held next to the QP, after it, so
/// it is dropped once the QP is destroyed (the provider delivers no event for it after that).
#[derive(Debug)]
pub(crate) struct QpWatch {
    faults: Arc<FaultState>,
    id: u64,
}

impl Drop for QpWatch {
    fn drop(&mut self) {
        let mut f = self.faults.faults.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Some(_)) = f.qps.remove(&self.id) {
            self.faults.update_any(&f);
        }
    }
}

/// One open verbs device (all its ports share it).
#[derive(Debug)]
pub(crate) struct DevCtx {
    pub(crate) ctx: Arc<Context>,
    pub(crate) pd: Arc<Pd>,
    pub(crate) attr: DeviceAttr,
    pub(crate) mrs: MrCache,
    /// Pointer types, relaxed ordering, flush and Data Direct on this device.
    pub(crate) gpu: GpuSupport,
    /// What the decisions were made from, kept to decide for the Data Direct twin.
    env: GpuEnv,
    facts: GpuFacts,
    /// The Data Direct sysfs path mlx5 reported for this context (see [`DevCtx::data_direct`]).
    data_direct_path: Option<String>,
    faults: Arc<FaultState>,
    port_events: Arc<PortEvents>,
    /// The GID index each selected port of the device uses (`select-gid` at init), shared with
    /// the Data Direct twin: which change of a GID table concerns this job.
    gids_in_use: Arc<Mutex<HashMap<u8, u32>>>,
}

impl DevCtx {
    /// Opens `name` and decides GPU memory on it: `peer_memory` is the host's peer-memory module
    /// (one lookup per context), `mlx5` whether the device's driver is mlx5.
    pub(crate) fn open(
        fabric: &Arc<Fabric>,
        name: &str,
        env: &GpuEnv,
        peer_memory: Option<String>,
        mlx5: bool,
    ) -> Result<Arc<DevCtx>, NetError> {
        let ctx = fabric
            .open(name)
            .map_err(NetError::verbs(format!("opening {name}")))?;
        let attr = ctx
            .query_device()
            .map_err(NetError::verbs(format!("querying {name}")))?;
        let pd = ctx
            .alloc_pd()
            .map_err(NetError::verbs(format!("allocating the PD of {name}")))?;
        let dmabuf = pd.dmabuf_supported();
        // Only an mlx5 device's context may be handed to libmlx5. The device itself keeps the
        // ordinary path; its Data Direct function becomes a twin device, as in net_ib.
        let data_direct_path = (mlx5 && dmabuf)
            .then(|| ctx.data_direct_sysfs_path())
            .flatten();
        let facts = GpuFacts {
            peer_memory,
            dmabuf,
            reg_mr_iova2: fabric.capabilities().reg_mr_iova2,
            mlx5,
            data_direct_path: None,
        };
        let gpu = gpu::decide(env, &facts);
        log_gpu(name, &gpu);
        Ok(Arc::new(DevCtx {
            ctx,
            pd,
            attr,
            mrs: MrCache::default(),
            gpu,
            env: *env,
            facts,
            data_direct_path,
            faults: Arc::default(),
            port_events: Arc::default(),
            gids_in_use: Arc::default(),
        }))
    }

    /// What the GPU decisions would be for this device's Data Direct function.
    fn data_direct_support(&self) -> (GpuFacts, GpuSupport) {
        let facts = GpuFacts {
            data_direct_path: self.data_direct_path.clone(),
            ..self.facts.clone()
        };
        let gpu = gpu::decide(&self.env, &facts);
        (facts, gpu)
    }

    /// The PCI path NCCL sees for the device's mlx5 Data Direct function when net_ib would give
    /// it a device of its own, `<dev>_dma` (not with `NCCL_IB_DATA_DIRECT=0`; why not is logged
    /// once here). `None` otherwise.
    pub(crate) fn data_direct(&self) -> Option<String> {
        let (_, gpu) = self.data_direct_support();
        if gpu.data_direct.value.is_none()
            && let Some(path) = &self.data_direct_path
        {
            tracing::info!(
                "NET/WASM: {}: {} ({path})",
                self.name(),
                gpu.data_direct.reason
            );
        }
        gpu.data_direct.value
    }

    /// The `<dev>_dma` device of a NIC whose [`DevCtx::data_direct`] is `Some`: the same
    /// context and fatal events, its own PD and MR cache, dma-bufs registered with
    /// `mlx5dv_reg_dmabuf_mr`, and `forceFlush`.
    pub(crate) fn data_direct_twin(&self) -> Result<Arc<DevCtx>, NetError> {
        let (facts, gpu) = self.data_direct_support();
        let name = data_direct_name(self.name());
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(NetError::verbs(format!("allocating the PD of {name}")))?;
        log_gpu(&name, &gpu);
        Ok(Arc::new(DevCtx {
            ctx: Arc::clone(&self.ctx),
            pd,
            attr: self.attr.clone(),
            mrs: MrCache::default(),
            gpu,
            env: self.env,
            facts,
            data_direct_path: None,
            faults: Arc::clone(&self.faults),
            port_events: Arc::clone(&self.port_events),
            gids_in_use: Arc::clone(&self.gids_in_use),
        }))
    }

    /// Port `port` uses GID index `index` (decided once, at init).
    pub(crate) fn use_gid(&self, port: u8, index: u32) {
        self.gids_in_use
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(port, index);
    }

    /// The GID index port `port` uses; `None` for a port NCCL does not see.
    pub(crate) fn gid_in_use(&self, port: u8) -> Option<u32> {
        self.gids_in_use
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&port)
            .copied()
    }

    pub(crate) fn name(&self) -> &str {
        self.ctx.name()
    }

    /// The error a call must return because of a fatal event on this device or on one of `qps`
    /// (`(id, QP number)` pairs: the id finds the event, the number names the QP).
    pub(crate) fn check(&self, qps: &[(u64, u32)]) -> Result<(), NetError> {
        if !self.faults.any.load(Ordering::Acquire) {
            return Ok(());
        }
        self.check_device()?;
        let f = self.faults.faults.lock().unwrap_or_else(|p| p.into_inner());
        match qps
            .iter()
            .find_map(|(id, q)| f.qps.get(id)?.as_ref().map(|e| (q, e)))
        {
            Some((q, event)) => Err(NetError::Fatal {
                object: format!("QP {q} on {}", self.name()),
                event: event.clone(),
            }),
            None => Ok(()),
        }
    }

    /// A fatal event of the device itself (every connection on it is lost).
    pub(crate) fn check_device(&self) -> Result<(), NetError> {
        if !self.faults.any.load(Ordering::Acquire) {
            return Ok(());
        }
        let f = self.faults.faults.lock().unwrap_or_else(|p| p.into_inner());
        match &f.device {
            Some(event) => Err(NetError::Fatal {
                object: format!("device {}", self.name()),
                event: event.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Whether any fatal event is recorded on the device.
    pub(crate) fn has_faults(&self) -> bool {
        self.faults.any.load(Ordering::Acquire)
    }

    /// Which of the QPs `ids` had a fatal event, for a connection prepared for failover (which
    /// moves their traffic instead of failing).
    pub(crate) fn fatal_qps(&self, ids: &[u64]) -> Vec<u64> {
        if !self.has_faults() {
            return Vec::new();
        }
        let f = self.faults.faults.lock().unwrap_or_else(|p| p.into_inner());
        ids.iter()
            .copied()
            .filter(|id| f.qps.get(id).is_some_and(Option::is_some))
            .collect()
    }

    /// Starts attributing fatal events to the QP with this id; they are forgotten when the
    /// returned watch is dropped.
    pub(crate) fn watch(&self, id: u64) -> QpWatch {
        self.faults
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .qps
            .insert(id, None);
        QpWatch {
            faults: Arc::clone(&self.faults),
            id,
        }
    }

    /// Changes whenever a port of the device changes state.
    pub(crate) fn port_generation(&self) -> u64 {
        self.port_events.generation.load(Ordering::Acquire)
    }

    /// How many times port `port` went down and came back so far.
    pub(crate) fn port_counts(&self, port: u8) -> PortCounts {
        // A plain counter map: a panic elsewhere cannot leave it half-updated.
        let c = self
            .port_events
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        c.get(&port).copied().unwrap_or_default()
    }

    fn note_port(&self, port: u8, state: PortState) {
        {
            let mut c = self
                .port_events
                .counts
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let c = c.entry(port).or_default();
            match state {
                PortState::Active => c.ups += 1,
                _ => c.downs += 1,
            }
        }
        self.port_events.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn record(&self, kind: AsyncEventKind, qp: Option<u64>, description: String) {
        use AsyncEventKind as K;
        let mut f = self.faults.faults.lock().unwrap_or_else(|p| p.into_inner());
        match (kind, qp) {
            (K::DeviceFatal, _) => f.device = Some(description),
            (K::QpFatal | K::QpReqErr | K::QpAccessErr | K::PathMigErr, Some(id)) => {
                match f.qps.get_mut(&id) {
                    Some(slot) => *slot = Some(description),
                    None => return,
                }
            }
            _ => return,
        }
        self.faults.update_any(&f);
    }
}

/// One INFO line with every GPU decision of device `name` and its reason.
fn log_gpu(name: &str, gpu: &GpuSupport) {
    tracing::info!(
        "NET/WASM: {name}: GPU memory: {}; {}; relaxed ordering: {}; {}; flush: {}",
        gpu.peer_memory.reason,
        gpu.dmabuf.reason,
        gpu.relaxed_ordering.reason,
        gpu.data_direct.reason,
        gpu.flush.reason
    );
}

/// The async-event thread of one device; stopped and joined on drop. Port state changes also
/// go to the telemetry, with their time.
#[derive(Debug)]
pub(crate) struct EventThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl EventThread {
    /// Port state changes also go to `decisions`, so later decisions see the port as it is; so
    /// do GID tables that changed ([`GidTables`]).
    pub(crate) fn start(
        dev: Arc<DevCtx>,
        decisions: Arc<dyn Decisions>,
        telemetry: Arc<Registry>,
    ) -> Result<EventThread, NetError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let name = format!("ncclwasm-ev-{}", dev.name());
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let events = || {
                    // Read here, not in `Net::new`: a port's table is hundreds of slots on a
                    // RoCE NIC. A change before this read is one it already has: its event then
                    // reports no entry changed, and still hands the table on.
                    let mut gids = GidTables::read(&dev);
                    while !flag.load(Ordering::Acquire) {
                        match dev.ctx.next_async_event(EVENT_POLL) {
                            Ok(Some(ev)) => {
                                handle_event(&dev, &*decisions, &telemetry, &mut gids, ev);
                            }
                            Ok(None) => {}
                            Err(e) => {
                                tracing::warn!("NET/WASM: async events of {}: {e}", dev.name());
                                std::thread::sleep(EVENT_POLL);
                            }
                        }
                    }
                };
                // A panic here (a bug) must not end event handling silently: the device is
                // failed, so the next call on any of its connections says why.
                if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(events)) {
                    let what = ncclwasm_verbs::panic_message(panic.as_ref());
                    tracing::warn!(
                        "NET/WASM: the async event thread of {} panicked ({what}); the device \
                         fails every call from now on",
                        dev.name()
                    );
                    dev.record(
                        AsyncEventKind::DeviceFatal,
                        None,
                        format!("its async event thread panicked: {what}"),
                    );
                }
            })
            .map_err(NetError::io("starting the async event thread"))?;
        Ok(EventThread {
            stop,
            handle: Some(handle),
        })
    }
}

/// One async event of `dev`: logged (WARN when fatal), a port's new state told to `decisions`,
/// the telemetry and the device's port counters, a changed GID table re-read, and a fatal event
/// recorded for the next call on what it names.
fn handle_event(
    dev: &DevCtx,
    decisions: &dyn Decisions,
    telemetry: &Registry,
    gids: &mut GidTables,
    ev: AsyncEvent,
) {
    let fatal = matches!(
        ev.kind,
        AsyncEventKind::DeviceFatal
            | AsyncEventKind::QpFatal
            | AsyncEventKind::QpReqErr
            | AsyncEventKind::QpAccessErr
            | AsyncEventKind::PathMigErr
    );
    let what = match (ev.port, ev.qp_num) {
        (Some(p), _) => format!("{} port {p}", dev.name()),
        (_, Some(q)) => format!("{} QP {q}", dev.name()),
        _ => dev.name().to_owned(),
    };
    if fatal {
        tracing::warn!("NET/WASM: {what}: async event {}", ev.description);
    } else {
        tracing::info!("NET/WASM: {what}: async event {}", ev.description);
    }
    let state = match ev.kind {
        AsyncEventKind::PortActive => Some(PortState::Active),
        AsyncEventKind::PortErr => Some(PortState::Down),
        _ => None,
    };
    if let (Some(state), Some(port)) = (state, ev.port) {
        decisions.port_changed(dev.name(), port, state);
        telemetry.port_changed(dev.name(), port, state);
        dev.note_port(port, state);
    }
    if let (AsyncEventKind::GidChange, Some(port)) = (ev.kind, ev.port) {
        gids.changed(dev, port, decisions);
    }
    dev.record(ev.kind, ev.qp_id, ev.description);
}

impl Drop for EventThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One selected port: what discovery said, the GID the policy chose, and its device.
#[derive(Debug, Clone)]
pub(crate) struct PortCtx {
    /// Shared by every communicator on the port: a port carries its whole GID table, which a
    /// copy per connection would repeat (12 KiB each on the soft fabric's 256-entry tables).
    pub(crate) port: Arc<Port>,
    pub(crate) endpoint: Endpoint,
    pub(crate) dev: Arc<DevCtx>,
}
