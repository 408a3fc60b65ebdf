//! The counters behind a policy's `telemetry` import (`docs/architecture.md`, "Telemetry").
//!
//! Counting happens where the work is, and costs the data path no lock, no allocation and no
//! syscall: the verbs wrapper counts each QP's work requests and bytes under the post lock it
//! takes anyway ([`ncclwasm_verbs::Qp::posted`]), and each communicator side counts its
//! completions per endpoint, its errors by status and the messages `test` finished in its own
//! [`Meter`] (a load and a store per poll batch and per message: one writer at a time, under
//! the communicator's lock). Summing is the reader's work:
//! [`Registry::snapshot`], called when a policy asks, walks the live sides under the registry's
//! lock, adds what closed connections left behind, and keeps a few samples of the per-port
//! totals to report the bytes of a recent window.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use ncclwasm_model::device_table::{ID_UNDEF, RailPlane};
use ncclwasm_model::telemetry::{
    ConnectionTelemetry, MAX_CHANGES, MAX_CONNECTIONS, PortTelemetry, QpTelemetry, StateChange,
    StatusCount, Telemetry, TelemetrySource, Traffic,
};
use ncclwasm_model::{Port, PortState};
use ncclwasm_verbs::WcStatus;

use crate::comm::Side;
use crate::prometheus::{self, PortStatus};

/// Completion statuses counted apart; a status at or above the last is counted in the last.
const STATUSES: usize = 24;
/// The recent window: the newest sample at least this old is its start.
const WINDOW_MS: u64 = 1000;
/// Samples are taken at most this often (when a policy asks), so a burst of connects keeps a
/// short ring.
const SAMPLE_EVERY_MS: u64 = 100;

/// One side of one connection: what it counts itself (its QPs count in the verbs wrapper), and
/// who it is in a snapshot. Dropped with its [`Side`], which then leaves its totals behind.
#[derive(Debug)]
pub(crate) struct Meter {
    registry: Arc<Registry>,
    id: u64,
    comm_id: u64,
    device: u32,
    sending: bool,
    /// Per local endpoint.
    completions: Box<[AtomicU64]>,
    errors: Box<[[AtomicU64; STATUSES]]>,
    /// Per local endpoint, when its latest error was polled: ms since the registry started,
    /// plus one (0: never).
    last_error: Box<[AtomicU64]>,
    /// Messages `test` finished, and their bytes.
    done: [AtomicU64; 2],
}

impl Meter {
    /// `n` successful completions polled from endpoint `endpoint`. Polling happens under the
    /// communicator's state lock, so this is the counter's only writer at a time: a plain load
    /// and store, no locked instruction, on the data path.
    pub(crate) fn completed(&self, endpoint: usize, n: u64) {
        if n > 0
            && let Some(c) = self.completions.get(endpoint)
        {
            c.store(c.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        }
    }

    /// A completion in error polled from endpoint `endpoint`.
    pub(crate) fn failed(&self, endpoint: usize, status: WcStatus) {
        let slot = (status.raw() as usize).min(STATUSES - 1);
        if let (Some(e), Some(last)) = (self.errors.get(endpoint), self.last_error.get(endpoint)) {
            e[slot].fetch_add(1, Ordering::Relaxed);
            // Errors are rare (a failed port flushes a few hundred at most): a clock read each.
            last.fetch_max(self.registry.now_ms() + 1, Ordering::Relaxed);
        }
    }

    /// `test` reported a message of `bytes` done (under the state lock, as [`completed`]).
    ///
    /// [`completed`]: Self::completed
    pub(crate) fn done(&self, bytes: u64) {
        let [n, b] = &self.done;
        n.store(n.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        b.store(b.load(Ordering::Relaxed) + bytes, Ordering::Relaxed);
    }

    fn errors_of(&self, endpoint: usize) -> [u64; STATUSES] {
        std::array::from_fn(|s| self.errors[endpoint][s].load(Ordering::Relaxed))
    }
}

/// Who a new side is, before it has its QPs: the registry it counts in and what a snapshot says
/// of it.
#[derive(Clone, Debug)]
pub(crate) struct MeterSpec {
    pub(crate) registry: Arc<Registry>,
    pub(crate) comm_id: u64,
    pub(crate) device: u32,
    pub(crate) sending: bool,
}

impl MeterSpec {
    /// The meter of a side with `endpoints` local endpoints, numbered in the registry.
    pub(crate) fn meter(&self, endpoints: usize) -> Meter {
        let id = {
            let mut inner = self.registry.inner();
            inner.next_id += 1;
            inner.next_id
        };
        Meter {
            registry: Arc::clone(&self.registry),
            id,
            comm_id: self.comm_id,
            device: self.device,
            sending: self.sending,
            completions: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            errors: (0..endpoints)
                .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
                .collect(),
            last_error: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            done: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }
}

impl Side {
    /// Shares this side and counts it in its meter's registry from now on.
    pub(crate) fn tracked(self) -> Arc<Side> {
        let side = Arc::new(self);
        side.meter.registry.track(&side);
        side
    }
}

impl Drop for Side {
    /// What a closing side counted stays in its ports' totals.
    fn drop(&mut self) {
        Arc::clone(&self.meter.registry).retire(self);
    }
}

/// Totals of one port.
#[derive(Clone, Copy, Debug, Default)]
struct PortTotals {
    send: Traffic,
    recv: Traffic,
    completions: u64,
    errors: [u64; STATUSES],
    /// As [`Meter::last_error`].
    last_error: u64,
    connections: u32,
    qps: u32,
}

/// The process's telemetry: every live side, what closed ones left, port state changes, and
/// the samples of the recent window. One per [`Net`](crate::Net).
#[derive(Debug)]
pub struct Registry {
    started: Instant,
    /// The host's port table (every port discovery found), `Port::index` order.
    ports: Vec<(u32, String, u8)>,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    live: Vec<Weak<Side>>,
    /// What closed sides counted, per port (position in `Registry::ports`).
    retired: Vec<PortTotals>,
    changes: Vec<VecDeque<StateChange>>,
    /// Per port: its state now and every change counted, not only the kept ones.
    status: Vec<PortStatus>,
    /// (ms since start, bytes sent per port), oldest first.
    samples: VecDeque<(u64, Vec<u64>)>,
}

impl Registry {
    pub(crate) fn new(ports: &[Port]) -> Arc<Registry> {
        let n = ports.len();
        let inner = Inner {
            retired: vec![PortTotals::default(); n],
            changes: vec![VecDeque::new(); n],
            status: ports
                .iter()
                .map(|p| PortStatus {
                    state: p.state,
                    changes: 0,
                    rail: None,
                })
                .collect(),
            samples: VecDeque::from([(0, vec![0; n])]),
            ..Inner::default()
        };
        Arc::new(Registry {
            started: Instant::now(),
            ports: ports
                .iter()
                .map(|p| (p.index, p.device.clone(), p.port))
                .collect(),
            inner: Mutex::new(inner),
        })
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Plain counters and lists: a panic elsewhere cannot leave them half-updated.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn position(&self, index: u32) -> Option<usize> {
        self.ports.iter().position(|(i, _, _)| *i == index)
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A side was made: it is counted from now on, and when it closes.
    pub(crate) fn track(&self, side: &Arc<Side>) {
        let mut inner = self.inner();
        inner.live.retain(|w| w.strong_count() > 0);
        inner.live.push(Arc::downgrade(side));
    }

    /// A side is closing: what it counted stays in its ports' totals.
    pub(crate) fn retire(&self, side: &Side) {
        let mut totals = vec![PortTotals::default(); self.ports.len()];
        self.add_side(side, &mut totals);
        let mut inner = self.inner();
        for (r, t) in inner.retired.iter_mut().zip(&totals) {
            r.send += t.send;
            r.recv += t.recv;
            r.completions += t.completions;
            for (a, b) in r.errors.iter_mut().zip(&t.errors) {
                *a += b;
            }
            r.last_error = r.last_error.max(t.last_error);
        }
    }

    /// Port `device:port` went to `state` (an async event).
    pub(crate) fn port_changed(&self, device: &str, port: u8, state: PortState) {
        let Some(i) = self
            .ports
            .iter()
            .position(|(_, d, p)| d == device && *p == port)
        else {
            return;
        };
        let at_ms = self.now_ms();
        let mut inner = self.inner();
        let changes = &mut inner.changes[i];
        if changes.len() == MAX_CHANGES {
            changes.pop_front();
        }
        changes.push_back(StateChange { at_ms, state });
        let status = &mut inner.status[i];
        status.state = state;
        status.changes += 1;
    }

    /// The rails the policy gave the selected ports `selected` (`ids` in the same order);
    /// an undefined rail is none.
    pub(crate) fn set_rails(&self, selected: &[Port], ids: &[RailPlane]) {
        let mut inner = self.inner();
        for (p, id) in selected.iter().zip(ids) {
            if let Some(i) = self.position(p.index) {
                inner.status[i].rail = Some(id.rail).filter(|&r| r != ID_UNDEF);
            }
        }
    }

    /// Each port's state now, how often it changed and its rail, in a snapshot's port order.
    pub(crate) fn port_status(&self) -> Vec<PortStatus> {
        self.inner().status.clone()
    }

    /// Adds `side`'s counters to `totals` (by port position), and its QPs and itself to the
    /// ports it uses.
    fn add_side(&self, side: &Side, totals: &mut [PortTotals]) {
        let pos: Vec<Option<usize>> = side
            .ports
            .iter()
            .map(|p| self.position(p.port.index))
            .collect();
        let m = &side.meter;
        for (e, p) in pos.iter().enumerate() {
            let Some(t) = p.map(|p| &mut totals[p]) else {
                continue;
            };
            t.completions += m.completions[e].load(Ordering::Relaxed);
            t.last_error = t.last_error.max(m.last_error[e].load(Ordering::Relaxed));
            for (a, b) in t.errors.iter_mut().zip(m.errors_of(e)) {
                *a += b;
            }
        }
        let mut used = vec![false; totals.len()];
        for q in side.qps().iter() {
            let Some(p) = self.position(q.port) else {
                continue;
            };
            let posted = q.qp.posted();
            let t = &mut totals[p];
            t.send += Traffic {
                wrs: posted.sends,
                bytes: posted.send_bytes,
            };
            t.recv.wrs += posted.recvs;
            t.qps += 1;
            used[p] = true;
        }
        for (t, used) in totals.iter_mut().zip(used) {
            t.connections += u32::from(used);
        }
    }

    /// The connection telemetry of `side`.
    fn connection(&self, side: &Side) -> ConnectionTelemetry {
        let m = &side.meter;
        let mut errors = [0u64; STATUSES];
        for e in 0..side.ports.len() {
            for (a, b) in errors.iter_mut().zip(m.errors_of(e)) {
                *a += b;
            }
        }
        ConnectionTelemetry {
            id: m.id,
            comm_id: m.comm_id,
            device: m.device,
            sending: m.sending,
            done: Traffic {
                wrs: m.done[0].load(Ordering::Relaxed),
                bytes: m.done[1].load(Ordering::Relaxed),
            },
            completions: m
                .completions
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .sum(),
            errors: status_counts(&errors),
            qps: side
                .qps()
                .iter()
                .map(|q| {
                    let posted = q.qp.posted();
                    QpTelemetry {
                        qpn: q.qp.qpn(),
                        port: q.port,
                        send: Traffic {
                            wrs: posted.sends,
                            bytes: posted.send_bytes,
                        },
                        recv: Traffic {
                            wrs: posted.recvs,
                            bytes: 0,
                        },
                    }
                })
                .collect(),
        }
    }
}

/// The non-zero entries of a per-status array.
fn status_counts(errors: &[u64; STATUSES]) -> Vec<StatusCount> {
    errors
        .iter()
        .enumerate()
        .filter(|&(_, &n)| n > 0)
        .map(|(s, &count)| StatusCount {
            status: s as u32,
            count,
        })
        .collect()
}

impl TelemetrySource for Registry {
    fn snapshot(&self) -> Telemetry {
        let at_ms = self.now_ms();
        let mut inner = self.inner();
        let mut live: Vec<Arc<Side>> = inner.live.iter().filter_map(Weak::upgrade).collect();
        let mut totals = inner.retired.clone();
        for side in &live {
            self.add_side(side, &mut totals);
        }
        // The window: from the newest sample at least WINDOW_MS old (else the oldest).
        let sent: Vec<u64> = totals.iter().map(|t| t.send.bytes).collect();
        let start = inner
            .samples
            .iter()
            .rev()
            .find(|(t, _)| at_ms - t >= WINDOW_MS)
            .or(inner.samples.front())
            .cloned()
            .unwrap_or((at_ms, sent.clone()));
        if inner
            .samples
            .back()
            .is_none_or(|(t, _)| at_ms - t >= SAMPLE_EVERY_MS)
        {
            inner.samples.push_back((at_ms, sent.clone()));
        }
        // Older than the window's start: never a start again.
        while inner.samples.len() > 1 && inner.samples[1].0 <= start.0 {
            inner.samples.pop_front();
        }
        let ports = self
            .ports
            .iter()
            .zip(&totals)
            .enumerate()
            .map(|(i, ((index, device, port), t))| PortTelemetry {
                index: *index,
                device: device.clone(),
                port: *port,
                send: t.send,
                recv: t.recv,
                completions: t.completions,
                errors: status_counts(&t.errors),
                last_error_ms: t.last_error.checked_sub(1),
                changes: inner.changes[i].iter().copied().collect(),
                connections: t.connections,
                qps: t.qps,
                window_ms: (at_ms - start.0) as u32,
                window_bytes: sent[i].saturating_sub(start.1.get(i).copied().unwrap_or(0)),
            })
            .collect();
        drop(inner);
        // The newest, and only those summed: a rank may hold thousands of connections.
        live.sort_unstable_by_key(|s| std::cmp::Reverse(s.meter.id));
        let connections = live
            .iter()
            .take(MAX_CONNECTIONS)
            .map(|s| self.connection(s))
            .collect();
        Telemetry {
            at_ms,
            ports,
            connections,
        }
    }
}

/// What a telemetry file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TelemetryFormat {
    /// The snapshot file (TOML with the WIT's names): the live view `ncclwasm devices
    /// --telemetry` reads, and a snapshot `policy explain` replays. Left in place at the end.
    Snapshot,
    /// Prometheus' text exposition format ([`prometheus`]), for node_exporter's textfile
    /// collector. Removed when the writer stops, so a finished job's series do not stay.
    Prometheus,
}

/// Writes the registry's counters to a file in a [`TelemetryFormat`], whole (a temporary
/// beside it, then a rename, so a reader never sees half of one), when started and then every
/// interval, until dropped.
#[derive(Debug)]
pub(crate) struct FileWriter {
    path: std::path::PathBuf,
    format: TelemetryFormat,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FileWriter {
    pub(crate) fn start(
        registry: Arc<Registry>,
        path: std::path::PathBuf,
        format: TelemetryFormat,
        every: std::time::Duration,
    ) -> Result<FileWriter, crate::NetError> {
        let file = path.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("ncclwasm-telemetry".into())
            .spawn(move || {
                // One WARN when writing starts failing and one INFO when it works again, not a
                // line per interval.
                let mut failing = false;
                while !flag.load(Ordering::Acquire) {
                    let snapshot = registry.snapshot();
                    let text = match format {
                        TelemetryFormat::Snapshot => snapshot.to_toml(),
                        TelemetryFormat::Prometheus => prometheus::render(
                            &snapshot,
                            &registry.port_status(),
                            std::process::id(),
                        ),
                    };
                    match write_file(&file, text) {
                        Err(e) if !failing => {
                            failing = true;
                            tracing::warn!(
                                "NET/WASM: cannot write the telemetry to {}: {e} (trying again \
                                 every {} ms; said again only once it works)",
                                file.display(),
                                every.as_millis()
                            );
                        }
                        Ok(()) if failing => {
                            failing = false;
                            tracing::info!(
                                "NET/WASM: writing the telemetry to {} again",
                                file.display()
                            );
                        }
                        _ => {}
                    }
                    std::thread::park_timeout(every);
                }
            })
            .map_err(crate::NetError::io("starting the telemetry writer"))?;
        Ok(FileWriter {
            path,
            format,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn format(&self) -> TelemetryFormat {
        self.format
    }
}

/// Writes `text` to `path`: a regular file (or none yet) through a temporary file renamed over
/// it, so a reader never sees half of one; anything else that exists (a device such as
/// `/dev/full`, a FIFO) in place, never replaced by the rename.
fn write_file(path: &std::path::Path, text: String) -> std::io::Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => std::fs::write(path, text),
        _ => {
            let mut tmp = path.to_owned().into_os_string();
            tmp.push(".tmp");
            std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path))
        }
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // It only snapshots and writes; a panic there (a bug) is not this thread's to raise.
            let _ = t.join();
        }
        // Only a file it made by renaming: a device or FIFO it wrote in place stays.
        if self.format == TelemetryFormat::Prometheus
            && std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.is_file())
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
