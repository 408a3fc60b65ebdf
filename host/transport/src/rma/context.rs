//! A one-sided context set (`createContext`): the lanes to every peer, and the operations that
//! run on them — the I/O shell around [`ncclwasm_proto::rma::Book`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ncclwasm_model::OneSided;
use ncclwasm_proto::MAX_ENDPOINTS;
use ncclwasm_proto::rma::{self, Book, Posts, Signal, SignalPost, Slice, Striping};
use ncclwasm_verbs::{Access, Remote, SendOp, SendWr, Sge, WcStatus};

use super::ring::{COLLECTIVE_TIMEOUT, pair};
use super::{CollInner, RmaConfig, SymMr};
use crate::comm::{OwnedRegion, lock_state};
use crate::net_error::NetError;
use crate::{CommConfig, RecvComm, SendComm};

/// Puts and gets of at least this many bytes are striped over the plan's `stripe_width` QPs
/// (below it, one QP carries each whole: a slice per QP costs a completion per QP).
pub const STRIPE_MIN: u64 = 64 << 10;

/// What a signal does to the 64-bit word at the target (`NCCL_NET_SIGNAL_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOp {
    /// Adds 1.
    Inc,
    /// Adds the value.
    Add(u64),
}

/// The signal of an `iputSignal`: `op` on the 64-bit word at offset `off` of the target's part
/// of `mr`, after the put's bytes — and, when `strong`, after every earlier put of the context
/// to that target.
#[derive(Clone, Copy, Debug)]
pub struct PutSignal<'a> {
    pub mr: &'a SymMr,
    pub off: u64,
    pub op: SignalOp,
    pub strong: bool,
}

/// A one-sided request, as NCCL holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RmaReq(rma::RmaReq);

impl RmaReq {
    pub fn to_bits(self) -> u64 {
        self.0.to_bits()
    }

    pub fn from_bits(bits: u64) -> RmaReq {
        RmaReq(rma::RmaReq::from_bits(bits))
    }
}

/// The signal word a held signal will add to: its address on the peer and the keys of each of
/// the peer's endpoints (the QP that carries it picks one).
#[derive(Clone, Copy, Debug)]
struct Target {
    addr: u64,
    rkeys: [u32; MAX_ENDPOINTS],
    add: u64,
}

/// One context's connection to one peer: its QPs are the lane's.
#[derive(Debug)]
struct Lane {
    send: SendComm,
}

/// A set of one-sided contexts (`createContext`'s `rmaCtx`). Cheap to clone; the connections
/// close when the last clone goes (`destroyContext`), whatever is still in flight.
#[derive(Debug, Clone)]
pub struct RmaCtx {
    inner: Arc<CtxInner>,
}

#[derive(Debug)]
struct CtxInner {
    coll: u64,
    rank: usize,
    nranks: usize,
    contexts: usize,
    stride: usize,
    /// `context * nranks + peer`; `None` for peers not `stride` apart.
    lanes: Vec<Option<Lane>>,
    /// The peers' connections to this rank (`context * nranks + peer`): passive, kept open
    /// for them (only fault injection reads them).
    #[cfg_attr(
        not(feature = "fault-injection"),
        expect(dead_code, reason = "held to keep the peers' connections open")
    )]
    accepted: Vec<Option<RecvComm>>,
    /// Where FETCH_AND_ADD results and flush reads land (nobody reads them), registered on
    /// every endpoint of the device.
    scratch: OwnedRegion,
    book: Mutex<Book<Target>>,
    /// The first failure of the set (`queryLastError`).
    failed: Mutex<Option<String>>,
}

impl RmaCtx {
    pub(super) fn create(coll: &Arc<CollInner>, config: RmaConfig) -> Result<RmaCtx, NetError> {
        let (rank, nranks) = (coll.ring.rank, coll.ring.nranks);
        let stride = config.rank_stride as usize;
        if stride == 0 || nranks % stride != 0 || config.contexts == 0 {
            return Err(NetError::Argument(format!(
                "createContext with {} contexts and rank stride {stride} over {nranks} ranks: \
                 at least one context, and the stride must divide the rank count",
                config.contexts
            )));
        }
        let contexts = config.contexts as usize;
        let (mut listener, handle) = coll.net.listen(coll.dev)?;
        let handles = coll.ring.all_gather(&handle)?;
        let mut lanes: Vec<Option<Lane>> = (0..contexts * nranks).map(|_| None).collect();
        let mut accepted: Vec<Option<RecvComm>> = (0..contexts * nranks).map(|_| None).collect();
        for c in 0..contexts {
            for i in (0..nranks).step_by(stride) {
                // One connection towards `rank + i`, one accepted from `rank - i`; the barrier
                // keeps the next step's connections from reaching a listener early, so the one
                // accepted here is from `rank - i`.
                let to = (rank + i) % nranks;
                const H: usize = crate::HANDLE_SIZE;
                let mut h = [0u8; H];
                h.copy_from_slice(&handles[to * H..(to + 1) * H]);
                let comm = CommConfig {
                    comm_id: coll.comm_id,
                    traffic_class: config.traffic_class,
                    net_attr: None,
                    one_sided: Some(OneSided {
                        context: c as u32,
                        contexts: config.contexts,
                        rank: rank as u32,
                        peer: to as u32,
                        nranks: nranks as u32,
                    }),
                };
                let (send, recv) = pair(&coll.net, coll.dev, &h, &mut listener, comm, &|| {
                    format!("context {c}: connecting rank {rank} to rank {to}")
                })?;
                lanes[c * nranks + to] = Some(Lane { send });
                accepted[c * nranks + (rank + nranks - i) % nranks] = Some(recv);
                coll.ring.barrier()?;
            }
        }
        let book = Book::new(
            lanes
                .iter()
                .map(|l| l.as_ref().map_or(0, |l| l.send.side.qps().len())),
        );
        Ok(RmaCtx {
            inner: Arc::new(CtxInner {
                coll: coll.id,
                rank,
                nranks,
                contexts,
                stride,
                lanes,
                accepted,
                scratch: OwnedRegion::new(&coll.ports, 8, Access::LOCAL_WRITE)?,
                book: Mutex::new(book),
                failed: Mutex::new(None),
            }),
        })
    }

    /// `iput`, and `iputSignal` when `signal` is given: `size` bytes from `src_off` of this
    /// rank's part of `src` to `dst_off` of `rank`'s part of `dst`. The request is done (`test`)
    /// once the bytes and the signal have both landed at the target.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        context: usize,
        src: &SymMr,
        src_off: u64,
        size: u64,
        dst: &SymMr,
        dst_off: u64,
        rank: usize,
        signal: Option<PutSignal<'_>>,
    ) -> Result<RmaReq, NetError> {
        let i = &*self.inner;
        let lane = i.lane(context, rank)?;
        i.alive()?;
        i.mine(&[src, dst])?;
        let from = src.at(i.rank, src_off, size, "put source")?;
        let to = dst.at(rank, dst_off, size, "put destination")?;
        let signal = match signal {
            None => None,
            Some(PutSignal {
                mr,
                off,
                op,
                strong,
            }) => {
                i.mine(&[mr])?;
                let addr = mr.at(rank, off, 8, "signal")?;
                if addr % 8 != 0 {
                    return Err(NetError::Argument(format!(
                        "signal word at offset {off} of rank {rank}'s registration is not \
                         8-byte aligned"
                    )));
                }
                let add = match op {
                    SignalOp::Inc => 1,
                    SignalOp::Add(v) => v,
                };
                Some(Signal {
                    strong,
                    target: Target {
                        addr,
                        rkeys: mr.peers[rank].rkeys,
                        add,
                    },
                })
            }
        };
        i.transfer(lane, size, signal, |slice, le, re| {
            Ok((
                SendOp::Write(Remote {
                    addr: to + slice.off,
                    rkey: dst.peers[rank].rkeys[re],
                }),
                Sge::raw(from + slice.off, slice.len as u32, src.local.lkeys()[le]),
            ))
        })
    }

    /// `iget`: `size` bytes from `remote_off` of `rank`'s part of `remote` to `local_off` of
    /// this rank's part of `local`.
    #[allow(clippy::too_many_arguments)]
    pub fn get(
        &self,
        context: usize,
        remote: &SymMr,
        remote_off: u64,
        size: u64,
        local: &SymMr,
        local_off: u64,
        rank: usize,
    ) -> Result<RmaReq, NetError> {
        let i = &*self.inner;
        let lane = i.lane(context, rank)?;
        i.alive()?;
        i.mine(&[remote, local])?;
        let from = remote.at(rank, remote_off, size, "get source")?;
        let to = local.at(i.rank, local_off, size, "get destination")?;
        i.transfer(lane, size, None, |slice, le, re| {
            Ok((
                SendOp::Read(Remote {
                    addr: from + slice.off,
                    rkey: remote.peers[rank].rkeys[re],
                }),
                Sge::raw(to + slice.off, slice.len as u32, local.local.lkeys()[le]),
            ))
        })
    }

    /// `iflush`: done once everything this context posted to `rank` before it has completed
    /// (puts placed at `rank`, gets landed here): one small read of `rank`'s part of `mr` on
    /// each QP of the lane, which RC executes after the QP's earlier work.
    pub fn flush(&self, context: usize, mr: &SymMr, rank: usize) -> Result<RmaReq, NetError> {
        let i = &*self.inner;
        let lane_index = i.lane(context, rank)?;
        i.alive()?;
        i.mine(&[mr])?;
        let p = mr.peers[rank];
        if p.len == 0 {
            return Err(NetError::Argument(format!(
                "flush through rank {rank}'s empty registration"
            )));
        }
        let len = p.len.min(8) as u32;
        let mut book = lock_state(&i.book)?;
        let (req, slices) = i.until_room(lane_index, &mut book, |b| b.flush(lane_index))?;
        let lane = i.lanes[lane_index].as_ref().ok_or_else(gone)?;
        for s in slices {
            i.post(lane, s.qp, s.wr_id, |le, re| {
                Ok((
                    SendOp::Read(Remote {
                        addr: p.addr,
                        rkey: p.rkeys[re],
                    }),
                    i.scratch.mrs[le]
                        .sge(0, len)
                        .map_err(NetError::verbs("a flush read"))?,
                ))
            })?;
        }
        Ok(RmaReq(req))
    }

    /// `test`: `Ok(true)` once `req` is done (and forgotten); a request one of whose work
    /// requests failed fails, with the failure.
    pub fn test(&self, req: RmaReq) -> Result<bool, NetError> {
        let i = &*self.inner;
        let mut book = lock_state(&i.book)?;
        let lane = book
            .lane_of(req.0)
            .map_err(NetError::protocol("test of a one-sided request"))?;
        i.poll(lane, &mut book)?;
        match book
            .test(req.0)
            .map_err(NetError::protocol("test of a one-sided request"))?
        {
            None => Ok(false),
            Some(true) => Ok(true),
            Some(false) => Err(NetError::OneSided(
                i.failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .unwrap_or_else(|| "a work request failed".into()),
            )),
        }
    }

    /// `rmaProgress`: polls every lane (completions, held signals).
    pub fn progress(&self) -> Result<(), NetError> {
        let i = &*self.inner;
        let mut book = lock_state(&i.book)?;
        (0..i.lanes.len()).try_for_each(|l| i.poll(l, &mut book))
    }

    /// `queryLastError`: the first failure of any lane, if one failed.
    pub fn last_error(&self) -> Option<String> {
        self.inner
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Contexts in the set.
    pub fn contexts(&self) -> usize {
        self.inner.contexts
    }

    /// Fault injection (tests): the QP `qp` of `context`'s connection from `from` to this rank
    /// goes silent for `d`, as [`RecvComm::inject_stall`].
    #[cfg(feature = "fault-injection")]
    pub fn inject_stall(
        &self,
        context: usize,
        from: usize,
        qp: usize,
        d: std::time::Duration,
    ) -> Result<(), NetError> {
        let i = &*self.inner;
        i.lane(context, from)?;
        let r = i.accepted[context * i.nranks + from]
            .as_ref()
            .ok_or_else(gone)?;
        r.inject_stall(qp, d)
    }

    /// Fault injection (tests): the QP `qp` of `context`'s connection from this rank to
    /// `rank` loses its connections without a goodbye (a cable cut), so its work fails.
    #[cfg(feature = "fault-injection")]
    pub fn inject_cut(&self, context: usize, rank: usize, qp: usize) -> Result<(), NetError> {
        let i = &*self.inner;
        let l = i.lane(context, rank)?;
        let lane = i.lanes[l].as_ref().ok_or_else(gone)?;
        let qps = lane.send.side.qps();
        let q = qps
            .get(qp)
            .ok_or_else(|| NetError::Argument(format!("QP {qp} of {}", qps.len())))?;
        q.qp.inject_cut()
            .map_err(NetError::verbs(|| "cutting a QP".into()))
    }

    /// The plan of context `context`'s connection to `rank` (who decided it, its QPs).
    pub fn plan(&self, context: usize, rank: usize) -> Result<&ncclwasm_model::ConnPlan, NetError> {
        let i = &*self.inner;
        let l = i.lane(context, rank)?;
        Ok(i.lanes[l].as_ref().ok_or_else(gone)?.send.plan())
    }
}

fn gone() -> NetError {
    NetError::Internal("a one-sided lane the book knows has no connection".into())
}

impl CtxInner {
    /// The lane of `context` to `rank`, or why there is none.
    fn lane(&self, context: usize, rank: usize) -> Result<usize, NetError> {
        if context >= self.contexts {
            return Err(NetError::Argument(format!(
                "context {context} of a set of {}",
                self.contexts
            )));
        }
        if rank >= self.nranks {
            return Err(NetError::Argument(format!(
                "rank {rank} of a collective communicator of {} ranks",
                self.nranks
            )));
        }
        let l = context * self.nranks + rank;
        if self.lanes[l].is_none() {
            return Err(NetError::Argument(format!(
                "rank {rank} is not a peer of rank {} here: the contexts connect ranks {} apart",
                self.rank, self.stride
            )));
        }
        Ok(l)
    }

    /// Refuses new work once a work request of the set failed: a QP in error flushes what it
    /// held, so nothing posted now could be ordered after the work it follows (a strong
    /// signal would announce puts that never landed). NCCL then reads `queryLastError`.
    fn alive(&self) -> Result<(), NetError> {
        match self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(e) => Err(NetError::OneSided(format!(
                "the context set failed earlier, so it takes no new work: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Refuses registrations of another collective communicator.
    fn mine(&self, mrs: &[&SymMr]) -> Result<(), NetError> {
        match mrs.iter().all(|m| m.coll == self.coll) {
            true => Ok(()),
            false => Err(NetError::Argument(
                "a registration of another collective communicator".into(),
            )),
        }
    }

    /// Books a put or get on `lane` and posts its slices (each made by `wr` from the slice and
    /// its QP's local and remote endpoints), then its signal when it may go now.
    fn transfer(
        &self,
        lane_index: usize,
        size: u64,
        signal: Option<Signal<Target>>,
        wr: impl Fn(&Slice, usize, usize) -> Result<(SendOp, Sge), NetError>,
    ) -> Result<RmaReq, NetError> {
        let lane = self.lanes[lane_index].as_ref().ok_or_else(gone)?;
        let plan = lane.send.plan();
        let striping = Striping {
            width: plan.stripe_width,
            align: plan.align,
            min: STRIPE_MIN,
        };
        let mut book = lock_state(&self.book)?;
        let Posts {
            req,
            slices,
            signal,
        } = self.until_room(lane_index, &mut book, |b| {
            b.transfer(lane_index, size, striping, signal)
        })?;
        for s in &slices {
            self.post(lane, s.qp, s.wr_id, |le, re| wr(s, le, re))?;
        }
        if let Some(s) = signal {
            self.signal(lane, &s)?;
        }
        Ok(RmaReq(req))
    }

    /// Runs `book_it` until the lane's QPs have room for it, polling in between.
    fn until_room<T>(
        &self,
        lane: usize,
        book: &mut Book<Target>,
        mut book_it: impl FnMut(&mut Book<Target>) -> Result<T, ncclwasm_proto::ProtoError>,
    ) -> Result<T, NetError> {
        let deadline = Instant::now() + COLLECTIVE_TIMEOUT;
        loop {
            match book_it(book) {
                Err(ncclwasm_proto::ProtoError::RequestsExhausted { .. })
                    if Instant::now() < deadline =>
                {
                    self.poll(lane, book)?;
                    std::thread::yield_now();
                }
                other => return other.map_err(NetError::protocol("a one-sided request")),
            }
        }
    }

    fn signal(&self, lane: &Lane, s: &SignalPost<Target>) -> Result<(), NetError> {
        self.post(lane, s.qp, s.wr_id, |le, re| {
            Ok((
                SendOp::FetchAdd {
                    remote: Remote {
                        addr: s.target.addr,
                        rkey: s.target.rkeys[re],
                    },
                    add: s.target.add,
                },
                self.scratch.mrs[le]
                    .sge(0, 8)
                    .map_err(NetError::verbs("a signal's result"))?,
            ))
        })
    }

    /// Posts one signalled work request on plan QP `qp` of `lane`; `wr` makes it from the QP's
    /// local and remote endpoint indices.
    fn post(
        &self,
        lane: &Lane,
        qp: usize,
        wr_id: u64,
        wr: impl FnOnce(usize, usize) -> Result<(SendOp, Sge), NetError>,
    ) -> Result<(), NetError> {
        let q = lane.send.plan().qps[qp];
        let (op, sge) = wr(q.local as usize, q.remote as usize)?;
        let qps = lane.send.side.qps();
        let posted = qps[qp].qp.post_send(&[SendWr {
            wr_id,
            op,
            sges: &[sge],
            signaled: true,
            inline: false,
        }]);
        posted.map_err(|e| {
            let e =
                NetError::verbs(|| format!("posting one-sided work on QP {}", qps[qp].qp.qpn()))(e);
            self.fail(&e);
            e
        })
    }

    /// Feeds the completions of `lane` to the book and posts the signals that released.
    fn poll(&self, lane_index: usize, book: &mut Book<Target>) -> Result<(), NetError> {
        let Some(lane) = self.lanes[lane_index].as_ref() else {
            return Ok(());
        };
        let side = &lane.send.side;
        side.poll_each(side.all(), |d, wc| {
            let ok = wc.status == WcStatus::Success;
            if !ok {
                self.fail(&side.failed(d, wc));
            }
            book.complete(wc.wr_id, ok)
                .map_err(NetError::protocol("a one-sided completion"))
        })?;
        for s in book.released() {
            let lane = self.lanes[s.lane].as_ref().ok_or_else(gone)?;
            self.signal(lane, &s)?;
        }
        Ok(())
    }

    fn fail(&self, e: &NetError) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert_with(|| e.to_string());
    }
}
