//! The receiver's side of rail failover on a prepared connection: its receive queues stay full,
//! a tagged arrival is counted by its tag, a failed QP is dropped (its completions count nothing
//! and the CTS entries in flight are written again through a QP that works), and the sender's
//! fail-back re-creates failed QPs here too (`Rejoin`, answered by `Rejoined`). The sender
//! decides about the port. [`RecvComm`]'s progress calls in here only when the connection is
//! prepared.

use ncclwasm_proto::datapath::Receiver;
use ncclwasm_proto::failover::CTS_WR_ID;
use ncclwasm_proto::handshake::rejoin_bring_up;
use ncclwasm_proto::message::{Message, Rejoin};
use ncclwasm_verbs::{Completion, RecvWr, WcOpcode, WcStatus};

use super::{ControlLink, fence, half};
use crate::net_error::NetError;
use crate::qp::{self, ConnQp};
use crate::recv::RecvComm;

/// Posts `n` receives ahead on `q` (a prepared connection's receive queues stay full; `n` is
/// zero on any other).
pub(crate) fn prefill(q: &ConnQp, n: usize) -> Result<(), NetError> {
    for _ in 0..n {
        q.qp.post_recv(&[RecvWr {
            wr_id: 0,
            sges: &[],
        }])
        .map_err(NetError::verbs(format!(
            "posting a receive ahead on QP {}",
            q.qp.qpn()
        )))?;
    }
    Ok(())
}

impl RecvComm {
    /// Polls completions on a prepared connection: a tagged arrival is counted by its tag (and
    /// its consumed receive posted again), and a failed QP is dropped: its completions count
    /// nothing and the CTS entries in flight are written again through a QP that works
    /// (`ncclwasm_proto::failover`).
    pub(crate) fn progress_prepared(&self, receiver: &mut Receiver) -> Result<(), NetError> {
        let mut failed = self.side.fatal_qps();
        if let Some(control) = &self.control {
            let (_, watch) = &mut *crate::comm::lock_state(control)?;
            for e in watch.newly_down(&self.side.ports) {
                failed.extend(
                    (0..self.setup.routes.len()).filter(|&q| self.setup.routes[q].local == e),
                );
            }
        }
        self.side.poll_each(self.side.all(), |d, wc: &Completion| {
            let Some(q) = self.side.qp_index(wc.qp_num) else {
                // What a failed QP flushed, polled only after it was re-created (a rejoin can
                // follow its failure within one call).
                if wc.status == WcStatus::WrFlushErr {
                    return Ok(());
                }
                // A flush QP's: as on any connection.
                return self.side.account(receiver.requests(), d, wc);
            };
            if receiver.is_failed(q) {
                return Ok(());
            }
            if wc.status != WcStatus::Success {
                if !failed.contains(&q) {
                    failed.push(q);
                }
                return Ok(());
            }
            match wc.opcode {
                WcOpcode::RecvRdmaWithImm => {
                    let a = receiver
                        .arrived(wc.imm.unwrap_or(0))
                        .map_err(NetError::protocol("accounting a tagged arrival"))?;
                    if let Some((off, word)) = a.record {
                        self.regions.sizes.buf.store_u64_release(off, word);
                    }
                    let qp = &self.side.qps()[q].qp;
                    qp.post_recv(&[RecvWr {
                        wr_id: 0,
                        sges: &[],
                    }])
                    .map_err(NetError::verbs(|| {
                        format!("posting a receive on QP {}", qp.qpn())
                    }))
                }
                _ if wc.wr_id == CTS_WR_ID => Ok(()),
                _ => self.side.account(receiver.requests(), d, wc),
            }
        })?;
        failed.sort_unstable();
        failed.dedup();
        for q in failed {
            self.drop_failed(receiver, q, "failed")?;
        }
        // The sender's rejoins. Read whether or not a QP failed here: when only the sender's
        // port failed, this side's QPs stay up until their own work times out (a NIC's retries
        // take 4.3 s × 7 with NCCL's defaults), and the sender waits for our halves meanwhile.
        if let Some(control) = &self.control {
            let (link, _) = &mut *crate::comm::lock_state(control)?;
            if (receiver.any_failed() || link.due())
                && let Some(m) = link.poll()?
            {
                for &q in &m.indices {
                    let q = q as usize;
                    if q < self.setup.routes.len() {
                        self.drop_failed(
                            receiver,
                            q,
                            "failed at the sender (its rejoin names it)",
                        )?;
                    }
                }
                self.rejoin(receiver, link, &m)?;
            }
        }
        Ok(())
    }

    /// Drops plan QP `q` (`what` happened to it): its completions count nothing from now on, it
    /// places nothing more, and the CTS entries in flight are written again through a QP that
    /// works. Nothing when it was dropped already.
    fn drop_failed(&self, receiver: &mut Receiver, q: usize, what: &str) -> Result<(), NetError> {
        if receiver.is_failed(q) {
            // Its fatal event stays recorded until the QP is replaced.
            return Ok(());
        }
        let rewrites = receiver
            .qp_failed(q)
            .map_err(NetError::protocol("dropping a failed QP"))?;
        // Its responder must place nothing the sender wrote before the failure and wrote
        // again elsewhere since, and its CTS writes must not land late either.
        fence(&self.side.qps(), [q])?;
        let qpn = self.side.qps()[q].qp.qpn();
        match receiver.cts_qp() {
            Some(first) => tracing::info!(
                "NET/WASM: {}: QP {qpn} {what}; the sender moves or holds its traffic; {} CTS \
                 entr(ies) written again, CTS now through QP {}",
                self.side.desc,
                rewrites.len(),
                self.side.qps()[first].qp.qpn()
            ),
            None => tracing::info!(
                "NET/WASM: {}: QP {qpn} {what}, the last one; CTS entries wait for the first \
                 QP the sender re-creates",
                self.side.desc,
            ),
        }
        for cts in &rewrites {
            self.post_cts(&self.side.qps(), cts)?;
        }
        Ok(())
    }

    /// The sender re-created failed QPs (fail-back): fresh ones here, brought up to its halves,
    /// their receive queues filled, and our halves sent back.
    fn rejoin(
        &self,
        receiver: &mut Receiver,
        link: &mut ControlLink,
        m: &Rejoin,
    ) -> Result<(), NetError> {
        let s = &self.setup;
        let ups = rejoin_bring_up(&s.plan, &s.routes, &s.local, &s.peer, m, s.plan.fifo_tc)
            .map_err(NetError::protocol("fail-back"))?;
        let mut halves = Vec::with_capacity(ups.len());
        let mut fresh = Vec::with_capacity(ups.len());
        for b in &ups {
            let ep = b.route.local;
            let port = &self.side.ports[ep];
            let (q, l) = qp::create(port, &self.side.cqs[ep], true, false)?;
            q.bring_up(port, b)?;
            prefill(&q, receiver.prefill())?;
            halves.push(half(&l, ep));
            fresh.push((b.qp, q));
        }
        // Every fresh QP exists before a failed one is destroyed, so none takes the number of
        // one it replaces: completions are told apart by QP number, and a failed QP's flushed
        // ones may still be queued (it may have failed in this very call).
        let mut rewrites = Vec::new();
        for (i, q) in fresh {
            drop(self.side.replace_qp(i, q));
            rewrites.extend(receiver.qp_rejoined(i));
        }
        link.send(&Message::Rejoined(Rejoin {
            indices: m.indices.clone(),
            qps: halves,
        }))?;
        // Every QP had failed: the CTS entries held back go now, through the first one back
        // (the sender's side of it is connected as soon as it reads our halves; until then
        // the write is retried, as a NIC retries a QP not ready yet).
        for cts in &rewrites {
            self.post_cts(&self.side.qps(), cts)?;
        }
        tracing::info!(
            "NET/WASM: {}: QP(s) {:?} re-created for the sender's fail-back",
            self.side.desc,
            m.indices
        );
        Ok(())
    }
}
