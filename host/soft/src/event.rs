//! Completion queues and the asynchronous event queue of a context.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use ibverbs_sys::{ibv_event_type, ibv_wc_opcode, ibv_wc_status};

use crate::abi::sys;

/// One work completion, converted to `ibv_wc` by `poll_cq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wc {
    pub wr_id: u64,
    pub status: ibv_wc_status::Type,
    pub opcode: ibv_wc_opcode::Type,
    pub byte_len: u32,
    /// Immediate data in network byte order, for `IBV_WC_WITH_IMM`.
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub src_qp: u32,
}

/// A completion queue of fixed depth. Overrun is an error, as on hardware: the completion is
/// lost, the CQ is marked broken (`poll_cq` returns -1 from then on) and the owner raises
/// `IBV_EVENT_CQ_ERR`.
#[derive(Debug)]
pub(crate) struct Cq {
    pub depth: usize,
    ring: Mutex<VecDeque<Wc>>,
    overrun: AtomicBool,
}

/// The CQ had no room: the caller reports `IBV_EVENT_CQ_ERR`.
#[derive(Debug)]
pub(crate) struct Overrun;

impl Cq {
    pub(crate) fn new(depth: usize) -> Cq {
        Cq {
            depth,
            ring: Mutex::new(VecDeque::with_capacity(depth.min(4096))),
            overrun: AtomicBool::new(false),
        }
    }

    /// Adds a completion. Returns `Err` only on the transition into overrun, so the event is
    /// raised once.
    pub(crate) fn push(&self, wc: Wc) -> Result<(), Overrun> {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() >= self.depth {
            return if self.overrun.swap(true, Ordering::AcqRel) {
                Ok(())
            } else {
                Err(Overrun)
            };
        }
        ring.push_back(wc);
        drop(ring);
        super::activity::happened();
        Ok(())
    }

    /// Takes up to `max` completions; `None` once the CQ has overrun.
    pub(crate) fn poll(&self, max: usize, mut out: impl FnMut(usize, Wc)) -> Option<usize> {
        if self.overrun.load(Ordering::Acquire) {
            return None;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let n = max.min(ring.len());
        for (i, wc) in ring.drain(..n).enumerate() {
            out(i, wc);
        }
        Some(n)
    }
}

/// What an async event is about (`ibv_async_event.element`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Element {
    /// Address of the `ibv_cq`.
    Cq(usize),
    /// Address of the `ibv_qp`.
    Qp(usize),
    /// A port: its interface's link or GID addresses changed (the `link_watch` module), or
    /// fault injection.
    Port(u8),
    /// Device-fatal comes only from fault injection.
    #[cfg(feature = "fault-injection")]
    Device,
}

/// Pending async events plus an eventfd that is readable exactly while one is pending
/// (semaphore mode: one count per event), like a kernel context's `async_fd`.
#[derive(Debug)]
pub(crate) struct EventQueue {
    queue: Mutex<VecDeque<(ibv_event_type, Element)>>,
    /// The eventfd, as a `File` for its safe `read` and `write` of the 8-byte count.
    fd: File,
    closed: AtomicBool,
}

impl EventQueue {
    pub(crate) fn new() -> io::Result<EventQueue> {
        Ok(EventQueue {
            queue: Mutex::new(VecDeque::new()),
            fd: File::from(sys::eventfd(sys::Eventfd::Semaphore)?),
            closed: AtomicBool::new(false),
        })
    }

    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub(crate) fn push(&self, kind: ibv_event_type, element: Element) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((kind, element));
        self.bump();
    }

    fn bump(&self) {
        let _ = (&self.fd).write(&1u64.to_ne_bytes());
    }

    /// Drops pending events about an object being destroyed, so nobody reads a dangling pointer
    /// (libibverbs makes destroy wait for the acks instead; dropping is the simpler equivalent).
    pub(crate) fn forget(&self, element: Element) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let before = q.len();
        q.retain(|(_, e)| *e != element);
        for _ in q.len()..before {
            // Non-blocking because the count is > 0.
            let _ = (&self.fd).read(&mut [0u8; 8]);
        }
    }

    /// Wakes a blocked `get_async_event` for good (context closing).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.bump();
    }

    /// Waits for the next event, honouring `O_NONBLOCK` on the fd (EAGAIN when none is pending).
    pub(crate) fn next(&self) -> io::Result<(ibv_event_type, Element)> {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            if let Err(err) = (&self.fd).read(&mut [0u8; 8]) {
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            if let Some(ev) = self
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front()
            {
                return Ok(ev);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(id: u64) -> Wc {
        Wc {
            wr_id: id,
            status: ibv_wc_status::IBV_WC_SUCCESS,
            opcode: ibv_wc_opcode::IBV_WC_RDMA_WRITE,
            byte_len: 0,
            imm: None,
            qp_num: 1,
            src_qp: 2,
        }
    }

    #[test]
    fn cq_overrun_is_reported_not_silent() {
        let cq = Cq::new(2);
        cq.push(wc(1)).expect("room");
        cq.push(wc(2)).expect("room");
        assert!(cq.push(wc(3)).is_err(), "first overrun is reported");
        assert!(cq.push(wc(4)).is_ok(), "reported once");
        assert_eq!(cq.poll(8, |_, _| {}), None, "poll fails after overrun");
    }

    #[test]
    fn cq_polls_in_order() {
        let cq = Cq::new(4);
        for i in 0..3 {
            cq.push(wc(i)).expect("room");
        }
        let mut seen = Vec::new();
        assert_eq!(cq.poll(2, |_, w| seen.push(w.wr_id)), Some(2));
        assert_eq!(cq.poll(2, |_, w| seen.push(w.wr_id)), Some(1));
        assert_eq!(seen, vec![0, 1, 2]);
    }

    #[test]
    fn event_fd_is_readable_while_events_pend() {
        let q = EventQueue::new().expect("eventfd");
        let readable = |q: &EventQueue| {
            let mut p = [libc::pollfd {
                fd: q.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            sys::poll(&mut p, 0).ok() == Some(1)
        };
        assert!(!readable(&q));
        q.push(ibv_event_type::IBV_EVENT_PORT_ERR, Element::Port(1));
        q.push(ibv_event_type::IBV_EVENT_QP_FATAL, Element::Qp(0x10));
        q.push(ibv_event_type::IBV_EVENT_PORT_ACTIVE, Element::Port(1));
        q.forget(Element::Qp(0x10));
        assert!(readable(&q));
        assert_eq!(
            q.next().expect("event"),
            (ibv_event_type::IBV_EVENT_PORT_ERR, Element::Port(1))
        );
        assert!(readable(&q));
        assert_eq!(
            q.next().expect("event").0,
            ibv_event_type::IBV_EVENT_PORT_ACTIVE
        );
        assert!(!readable(&q), "fd drained with the queue");
    }
}
