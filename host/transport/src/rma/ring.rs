//! The ring a collective communicator talks over: a send communicator to the next rank and a
//! receive communicator from the previous one, and the all-gather NCCL's proxy runs on them
//! (each rank forwards, `nranks - 1` times, the slot it received last), made of the ordinary
//! two-sided `isend`/`irecv`/`test`.

use std::time::{Duration, Instant};

use ncclwasm_verbs::DmaBuf;

use crate::net_error::NetError;
use crate::{CommConfig, Done, HANDLE_SIZE, Listener, Net, RecvBuf, RecvComm, SendComm};

/// How long a collective step waits for its peers before it gives up: ranks that never arrive
/// (a crashed peer, a rank that never called) fail the call instead of hanging NCCL.
pub(crate) const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// Connects to `handle` and accepts one connection on `listener`, both at once (each side of
/// the pair may be the other's peer, even this rank itself).
pub(crate) fn pair(
    net: &Net,
    dev: i64,
    handle: &[u8; HANDLE_SIZE],
    listener: &mut Listener,
    comm: CommConfig,
    what: &dyn Fn() -> String,
) -> Result<(SendComm, RecvComm), NetError> {
    let mut handle = *handle;
    let (mut send, mut recv) = (None, None);
    let deadline = Instant::now() + COLLECTIVE_TIMEOUT;
    loop {
        if send.is_none() {
            send = net.connect(dev, &mut handle, comm)?;
        }
        if recv.is_none() {
            recv = listener.accept()?;
        }
        (send, recv) = match (send, recv) {
            (Some(s), Some(r)) => return Ok((s, r)),
            other => other,
        };
        if Instant::now() > deadline {
            return Err(NetError::Usage(format!(
                "{} did not complete within {COLLECTIVE_TIMEOUT:?}: every rank must make the \
                 same collective call",
                what()
            )));
        }
        std::thread::yield_now();
    }
}

/// The ring of a collective communicator.
#[derive(Debug)]
pub(crate) struct Ring {
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    send: SendComm,
    recv: RecvComm,
}

impl Ring {
    pub(crate) fn new(rank: usize, nranks: usize, send: SendComm, recv: RecvComm) -> Ring {
        Ring {
            rank,
            nranks,
            send,
            recv,
        }
    }

    /// Every rank's `mine`, in rank order (all the same length).
    pub(crate) fn all_gather(&self, mine: &[u8]) -> Result<Vec<u8>, NetError> {
        let (n, len) = (self.nranks, mine.len());
        let buf = DmaBuf::new((n * len).max(1));
        buf.write(self.rank * len, mine);
        if n > 1 && len > 0 {
            let total = (n * len) as u64;
            let smr = self.send.reg_mr(buf.addr(), total, &buf)?;
            let rmr = self.recv.reg_mr(buf.addr(), total, &buf)?;
            let deadline = Instant::now() + COLLECTIVE_TIMEOUT;
            let mut from = self.rank;
            for _ in 0..n - 1 {
                let into = (from + n - 1) % n;
                let rreq = self.recv.irecv(&[RecvBuf {
                    addr: buf.addr() + (into * len) as u64,
                    size: len as u64,
                    tag: 0,
                    mr: Some(&rmr),
                }])?;
                let mut sreq = None;
                let (mut sent, mut received) = (false, false);
                while !(sent && received) {
                    if sreq.is_none() {
                        sreq = self.send.isend(
                            buf.addr() + (from * len) as u64,
                            len as u64,
                            0,
                            Some(&smr),
                        )?;
                    }
                    if let Some(r) = sreq.filter(|_| !sent) {
                        sent = matches!(self.send.test(r)?, Some(Done::Send { .. }));
                    }
                    if !received {
                        received = self.recv.test(rreq)?.is_some();
                    }
                    if Instant::now() > deadline {
                        return Err(NetError::Usage(format!(
                            "rank {} of {n}: an all-gather step waited {COLLECTIVE_TIMEOUT:?} \
                             for its neighbours",
                            self.rank
                        )));
                    }
                    std::thread::yield_now();
                }
                from = into;
            }
        }
        let mut out = vec![0; n * len];
        buf.read(0, &mut out);
        Ok(out)
    }

    /// Returns once every rank called it.
    pub(crate) fn barrier(&self) -> Result<(), NetError> {
        self.all_gather(&[1]).map(drop)
    }
}
