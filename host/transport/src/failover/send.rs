//! The sender's side of rail failover on a prepared connection: it polls the tagged slices'
//! completions, asks the policy about the port of a QP that failed (`move-to` restripes), probes
//! the receiver's arrival record and writes again what it lacks, and fails back when the port
//! returns. [`SendComm`]'s progress calls in here only when the connection is prepared; an
//! unprepared one never reaches this file.

use std::time::{Duration, Instant};

use ncclwasm_model::{PortAnswer, PortChange, PortEvent, PortEventCause, PortState};
use ncclwasm_proto::MAX_REQUESTS;
use ncclwasm_proto::ProtoError;
use ncclwasm_proto::failover::{PROBE_WR_ID, SendFailover};
use ncclwasm_proto::fifo::ARRIVALS_OFFSET;
use ncclwasm_proto::handshake::rejoin_bring_up;
use ncclwasm_proto::message::{Message, Rejoin};
use ncclwasm_verbs::{Completion, Remote, SendOp, SendWr, WcStatus};

use super::{ControlLink, PortWatch, cause_text, fence, half, port_name};
use crate::device::PortCtx;
use crate::net_error::NetError;
use crate::qp::{self, ConnQp};
use crate::send::{SendComm, SendState};
use crate::socket::Stream;

/// Fail-back on a prepared connection: the kept handshake socket, the ports whose QPs failed
/// (with the port's return count then), the policy's `stay` and `wait` answers, and a rejoin
/// waiting for the peer's halves.
#[derive(Debug)]
pub(crate) struct Failback {
    link: ControlLink,
    /// Per local endpoint: the port's return count when its QPs failed.
    down: Vec<Option<u64>>,
    /// Per local endpoint: the return count the policy answered `stay` to.
    stayed: Vec<Option<u64>>,
    /// Per local endpoint: the `wait` the port is held by.
    held: Vec<Option<Held>>,
    /// A rejoin sent: the port and its fresh QPs (plan index, QP).
    pending: Option<(u32, Vec<(usize, ConnQp)>)>,
    /// Port failures announced by async events.
    watch: PortWatch,
}

/// A port held by the policy's `wait`: until when, and why (for the error when it stays down).
#[derive(Debug)]
struct Held {
    since: Instant,
    ms: u32,
    reason: String,
    source: String,
}

impl Failback {
    /// Keeps the handshake socket `stream` of a connection over the local endpoints `ports`;
    /// no port has failed yet.
    pub(crate) fn new(stream: Stream, ports: &[PortCtx], endpoints: usize) -> Self {
        Failback {
            link: ControlLink::new(stream),
            down: vec![None; endpoints],
            stayed: vec![None; endpoints],
            held: (0..endpoints).map(|_| None).collect(),
            pending: None,
            watch: PortWatch::new(ports),
        }
    }
}

impl SendComm {
    /// Polls completions on a prepared connection and carries out failover: a failed QP's port
    /// is decided by the policy; a `move-to` restripes, probes the receiver's arrival record and
    /// writes again what it lacks (`ncclwasm_proto::failover`).
    pub(crate) fn progress_prepared(&self, st: &mut SendState) -> Result<(), NetError> {
        let mut failed: Vec<(usize, PortEventCause)> = self
            .side
            .fatal_qps()
            .into_iter()
            .map(|q| (q, PortEventCause::AsyncEvent))
            .collect();
        if let (Some(fb), Some(f)) = (st.failback.as_mut(), st.sender.failover()) {
            for e in fb.watch.newly_down(&self.side.ports) {
                let live = (0..self.setup.routes.len())
                    .find(|&q| self.setup.routes[q].local == e && !f.is_failed(q));
                failed.extend(live.map(|q| (q, PortEventCause::AsyncEvent)));
            }
        }
        let mut probe_done = false;
        self.side.poll_each(self.side.all(), |d, wc: &Completion| {
            let Some(q) = self.side.qp_index(wc.qp_num) else {
                // What a failed QP flushed, polled only after it was re-created.
                if wc.status == WcStatus::WrFlushErr {
                    return Ok(());
                }
                return Err(self.side.failed(d, wc));
            };
            let fo = st.sender.failover().is_some_and(|f| f.is_failed(q));
            if fo {
                // Its slices are accounted for by the probe.
                return Ok(());
            }
            if wc.status != WcStatus::Success {
                if wc.wr_id == PROBE_WR_ID {
                    st.sender.probe_lost();
                }
                if !failed.iter().any(|&(f, _)| f == q) {
                    failed.push((q, PortEventCause::FatalCompletion));
                }
                return Ok(());
            }
            if wc.wr_id == PROBE_WR_ID {
                probe_done = true;
                return Ok(());
            }
            st.sender
                .slice_acked(wc.wr_id)
                .map_err(NetError::protocol("accounting a completion"))
        })?;
        for (q, cause) in failed {
            if !st.sender.failover().is_some_and(|f| f.is_failed(q)) {
                self.port_down(st, q, cause)?;
            }
        }
        if probe_done {
            self.replay(st)?;
        }
        self.fail_back(st)?;
        self.held_too_long(st)?;
        if let Some((q, route)) = st.sender.take_probe() {
            let len = (MAX_REQUESTS * size_of::<u64>()) as u32;
            let sge = self.sizes.mrs[route.local]
                .sge(ARRIVALS_OFFSET as u64, len)
                .map_err(NetError::verbs("the probe's landing area"))?;
            let qp = &self.side.qps()[q].qp;
            qp.post_send(&[SendWr {
                wr_id: PROBE_WR_ID,
                op: SendOp::Read(Remote {
                    addr: self.setup.sizes_fifo.addr + ARRIVALS_OFFSET as u64,
                    rkey: self.setup.sizes_fifo.rkeys[route.remote],
                }),
                sges: &[sge],
                signaled: true,
                inline: false,
            }])
            .map_err(NetError::verbs(|| {
                format!("posting the failover probe on QP {}", qp.qpn())
            }))?;
        }
        Ok(())
    }

    /// Plan QP `q` failed: the policy decides about its port.
    fn port_down(
        &self,
        st: &mut SendState,
        q: usize,
        cause: PortEventCause,
    ) -> Result<(), NetError> {
        let port = self.setup.routes[q].local as u32;
        let f = st.sender.failover();
        // A port is down when every QP the plan has on it failed (this one's included).
        let states: Vec<PortState> = (0..self.setup.local.len() as u32)
            .map(|p| {
                let down = p == port
                    || self
                        .setup
                        .routes
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.local as u32 == p)
                        .all(|(i, _)| f.is_some_and(|f| f.is_failed(i)));
                if down {
                    PortState::Down
                } else {
                    PortState::Active
                }
            })
            .collect();
        let event = PortEvent {
            port,
            change: PortChange::Down,
            cause,
        };
        let d = self
            .decisions
            .on_port_event(&event, &self.conn, &self.setup.plan.qps, &states)?;
        if let Some(fb) = st.failback.as_mut() {
            let pc = &self.side.ports[port as usize];
            fb.down[port as usize] = Some(pc.dev.port_counts(pc.port.port).ups);
        }
        let name = port_name(&self.conn, port);
        tracing::info!(
            "NET/WASM: {}: port {name} failed ({} on QP {}): {} [{}]",
            self.side.desc,
            cause_text(cause),
            self.side.qps()[q].qp.qpn(),
            d.reason,
            d.source
        );
        let fail = |reason: String| NetError::PortFailed {
            connection: self.side.desc.clone(),
            port: name.clone(),
            reason,
            source_of: d.source.clone(),
        };
        match d.value {
            PortAnswer::MoveTo { ports, .. } => {
                st.sender
                    .fail_over(port, &ports)
                    .map_err(|e| fail(e.to_string()))?;
                // Before the probe and the replay: nothing of the port's QPs lands later.
                let on_port = (0..self.setup.routes.len())
                    .filter(|&i| self.setup.routes[i].local as u32 == port);
                fence(&self.side.qps(), on_port)?;
                let to: Vec<String> = ports.iter().map(|&p| port_name(&self.conn, p)).collect();
                tracing::info!(
                    "NET/WASM: {}: new messages go over {}; slices in flight on {name} are \
                     probed at the receiver and written again where missing",
                    self.side.desc,
                    to.join(", ")
                );
                Ok(())
            }
            PortAnswer::Fail { reason } => Err(fail(reason)),
            PortAnswer::Wait { ms, reason } => {
                let Some(fb) = st.failback.as_mut() else {
                    return Err(NetError::Internal(
                        "a prepared connection without its handshake socket".into(),
                    ));
                };
                st.sender.hold(port).map_err(|e| fail(e.to_string()))?;
                // Nothing the failed QPs still hold may land after the resumed QPs wrote it.
                let on_port = (0..self.setup.routes.len())
                    .filter(|&i| self.setup.routes[i].local as u32 == port);
                fence(&self.side.qps(), on_port)?;
                fb.held[port as usize] = Some(Held {
                    since: Instant::now(),
                    ms,
                    reason,
                    source: d.source.clone(),
                });
                tracing::info!(
                    "NET/WASM: {}: new messages wait up to {ms} ms for {name} to come back; its \
                     slices in flight are then written again on its re-created QPs where the \
                     receiver lacks them",
                    self.side.desc
                );
                Ok(())
            }
            other => Err(NetError::Internal(format!(
                "the answer to a port failure was {}, an answer to a port coming back",
                other.kind()
            ))),
        }
    }

    /// Fail-back: a rejoin in flight is finished when the peer's halves arrive; otherwise a
    /// held port that is active again is re-created at once, and a port whose QPs failed and
    /// that came back since is decided by the policy (`fail-back` re-creates its QPs and sends
    /// their halves over the kept socket; `stay` leaves traffic where it is until the port
    /// fails and returns again).
    fn fail_back(&self, st: &mut SendState) -> Result<(), NetError> {
        let SendState {
            sender, failback, ..
        } = st;
        let Some(fb) = failback.as_mut() else {
            return Ok(());
        };
        if let Some((port, fresh)) = fb.pending.take() {
            let Some(m) = fb.link.poll()? else {
                fb.pending = Some((port, fresh));
                return Ok(());
            };
            let s = &self.setup;
            let ups = rejoin_bring_up(&s.plan, &s.routes, &s.local, &s.peer, &m, s.plan.tc)
                .map_err(NetError::protocol("fail-back"))?;
            if ups.len() != fresh.len() || ups.iter().zip(&fresh).any(|(b, (i, _))| b.qp != *i) {
                return Err(NetError::Protocol {
                    during: "fail-back",
                    source: ProtoError::BadPeerInfo {
                        detail: format!(
                            "the peer rejoined QPs {:?}, not the ones asked for",
                            m.indices
                        ),
                    },
                });
            }
            let n = fresh.len();
            for (b, (i, q)) in ups.iter().zip(fresh) {
                q.bring_up(&self.side.ports[b.route.local], b)?;
                drop(self.side.replace_qp(i, q));
            }
            fb.down[port as usize] = None;
            let name = port_name(&self.conn, port);
            if let Some(h) = fb.held[port as usize].take() {
                sender
                    .resume(port)
                    .map_err(NetError::protocol("resuming a held port"))?;
                tracing::info!(
                    "NET/WASM: {}: held port {name} is back after {} ms: its {n} QP(s) were \
                     re-created; what the receiver lacks is written again on them, then new \
                     messages start",
                    self.side.desc,
                    h.since.elapsed().as_millis()
                );
            } else {
                sender
                    .fail_back(port)
                    .map_err(NetError::protocol("fail-back"))?;
                tracing::info!(
                    "NET/WASM: {}: port {name} is back: its {n} QP(s) were re-created and carry \
                     new messages again",
                    self.side.desc
                );
            }
            return Ok(());
        }
        for p in 0..fb.down.len() {
            let Some(at) = fb.down[p] else { continue };
            let pc = &self.side.ports[p];
            if fb.held[p].is_some() {
                // Back when verbs says it is active — also when it came back before the failure
                // was noticed, or never went down (a QP failed on an active port); its events
                // may still be on their way. The `wait` already said what to do then: no up
                // event is asked about. Asked only while the connection is held.
                let active = pc
                    .dev
                    .ctx
                    .query_port(pc.port.port)
                    .is_ok_and(|a| a.state == PortState::Active);
                if active {
                    fb.pending = Some(self.rejoin(&mut fb.link, sender.failover(), p)?);
                    return Ok(());
                }
                continue;
            }
            let now = pc.dev.port_counts(pc.port.port).ups;
            if now <= at || fb.stayed[p] == Some(now) {
                continue;
            }
            if sender.failover().is_none_or(|f| f.blocked()) {
                // Asked once nothing is held or being replayed; a held port may still be back.
                continue;
            }
            let event = PortEvent {
                port: p as u32,
                change: PortChange::Up,
                cause: PortEventCause::AsyncEvent,
            };
            let states: Vec<PortState> = (0..fb.down.len())
                .map(|q| {
                    if q != p && fb.down[q].is_some() {
                        PortState::Down
                    } else {
                        PortState::Active
                    }
                })
                .collect();
            let d =
                self.decisions
                    .on_port_event(&event, &self.conn, &self.setup.plan.qps, &states)?;
            let name = port_name(&self.conn, p as u32);
            tracing::info!(
                "NET/WASM: {}: port {name} is active again: {} [{}]",
                self.side.desc,
                d.reason,
                d.source
            );
            match d.value {
                PortAnswer::FailBack { .. } => {
                    fb.pending = Some(self.rejoin(&mut fb.link, sender.failover(), p)?);
                    return Ok(());
                }
                PortAnswer::Stay { .. } => fb.stayed[p] = Some(now),
                other => {
                    return Err(NetError::Internal(format!(
                        "the answer to a port coming back was {}, an answer to a port failure",
                        other.kind()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Re-creates the failed QPs of local endpoint `p` and sends their halves to the peer;
    /// returns the rejoin to finish when the peer's halves arrive.
    fn rejoin(
        &self,
        link: &mut ControlLink,
        f: Option<&SendFailover>,
        p: usize,
    ) -> Result<(u32, Vec<(usize, ConnQp)>), NetError> {
        let pc = &self.side.ports[p];
        let mut fresh = Vec::new();
        let mut halves = Vec::new();
        let failed = self
            .setup
            .routes
            .iter()
            .enumerate()
            .filter(|(i, r)| r.local == p && f.is_some_and(|f| f.is_failed(*i)));
        for (i, _) in failed {
            let (q, l) = qp::create(pc, &self.side.cqs[p], false, false)?;
            halves.push(half(&l, p));
            fresh.push((i, q));
        }
        link.send(&Message::Rejoin(Rejoin {
            indices: fresh.iter().map(|(i, _)| *i as u32).collect(),
            qps: halves,
        }))?;
        Ok((p as u32, fresh))
    }

    /// A port held by `wait` that has not come back (rejoined) within the policy's time fails
    /// the connection with the policy's reason.
    fn held_too_long(&self, st: &SendState) -> Result<(), NetError> {
        let Some(fb) = st.failback.as_ref() else {
            return Ok(());
        };
        for (p, h) in fb.held.iter().enumerate() {
            let Some(h) = h else { continue };
            if h.since.elapsed() < Duration::from_millis(u64::from(h.ms)) {
                continue;
            }
            return Err(NetError::PortFailed {
                connection: self.side.desc.clone(),
                port: port_name(&self.conn, p as u32),
                reason: format!(
                    "{}; the port did not come back within the {} ms the policy waited",
                    h.reason, h.ms
                ),
                source_of: h.source.clone(),
            });
        }
        Ok(())
    }

    /// The probe returned: writes again every slice the receiver lacks.
    fn replay(&self, st: &mut SendState) -> Result<(), NetError> {
        let mut words = [0u64; MAX_REQUESTS];
        for (slot, w) in words.iter_mut().enumerate() {
            *w = self
                .sizes
                .buf
                .load_u64_acquire(ARRIVALS_OFFSET + slot * size_of::<u64>());
        }
        let reposts = st
            .sender
            .probed(&words)
            .map_err(NetError::protocol("reading the failover probe"))?;
        for r in &reposts {
            let (post, reqs) = st
                .sender
                .replay(r)
                .map_err(NetError::protocol("replaying a slice"))?;
            let SendState { bufs, posted, .. } = st;
            self.post(&self.side.qps(), bufs, posted, &post, &reqs)?;
        }
        if let Some(c) = st.sender.failover().map(|f| f.counters()) {
            tracing::info!(
                "NET/WASM: {}: failover probe {}: {} slice(s) written again ({} bytes in all \
                 so far), {} confirmed delivered",
                self.side.desc,
                c.probes,
                reposts.len(),
                c.replayed_bytes,
                c.confirmed
            );
        }
        Ok(())
    }
}
