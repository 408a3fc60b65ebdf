//! The connection-scale part of `ncclwasm bench`: `--connections N` connections set up at once
//! between the two ranks, as an all-to-all at scale opens many, timed and weighed.
//!
//! The receiving rank listens `N` times (NCCL listens once per connection) and hands all the
//! handles over in one line; the sending rank connects to each while the receiver accepts each,
//! every pending one advanced in one loop as NCCL's proxy advances its connections. Each rank
//! reports its wall time from its first NCCL call to its last established comm, and what the
//! connections added to the process: resident memory, threads and file descriptors (read from
//! `/proc/self`, before and after). The comms are closed only once both ranks are established,
//! and the close is timed as well.

use std::io::BufRead;
use std::path::Path;
use std::time::Instant;

use ncclwasm_abi::load::{HANDLE_BYTES, Plugin};
use ncclwasm_model::file::{self, Limit};
use serde::{Deserialize, Serialize};

use crate::bench_rank::{self, Args, Msg, Role};
use crate::fail::Fail;

/// What the parent tells both ranks once each has reported its [`Scale`]: close them now (each
/// then reports the time its closes took, [`Msg::ScaleClosed`]).
pub const SCALE_DONE: &str = "scale-done";

/// One rank's side of the connection-scale part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scale {
    pub role: Role,
    pub connections: u32,
    /// From the first `listen`/`connect` to the last comm established.
    pub setup_secs: f64,
    pub before: Footprint,
    pub after: Footprint,
}

/// What the process holds, from `/proc/self`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Footprint {
    /// Resident memory (`VmRSS`).
    pub rss_kib: u64,
    pub threads: u64,
    pub fds: u64,
}

impl Footprint {
    fn now() -> Result<Footprint, Fail> {
        let status = file::read_to_string(Path::new("/proc/self/status"), Limit::PROC)
            .map_err(|e| Fail::trouble(format!("connection scale: {e}")))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .ok_or_else(|| Fail::trouble(format!("/proc/self/status has no {name}")))
        };
        let fds = std::fs::read_dir("/proc/self/fd")
            .map_err(|e| Fail::trouble(format!("connection scale: /proc/self/fd: {e}")))?
            .count() as u64;
        Ok(Footprint {
            rss_kib: field("VmRSS:")?,
            threads: field("Threads:")?,
            fds,
        })
    }
}

/// This rank's side of `--connections`: nothing when it is 0.
pub fn run(plugin: &Plugin, args: &Args, stdin: &mut impl BufRead) -> Result<(), Fail> {
    let n = args.connections as usize;
    if n == 0 {
        return Ok(());
    }
    let before = Footprint::now()?;
    let fail = bench_rank::plugin_fail;
    // Held until both ranks are established, then closed together (timed).
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let setup_secs = match args.role {
        Role::Recv => {
            let start = Instant::now();
            let listens = (0..n)
                .map(|_| plugin.listen(args.device))
                .collect::<Result<Vec<_>, _>>()
                .map_err(fail)?;
            let handles = listens.iter().map(|(_, h)| bench_rank::hex(h)).collect();
            bench_rank::send(&Msg::Handles(handles))?;
            let mut comms: Vec<_> = (0..n).map(|_| None).collect();
            until_all("accept", &mut comms, |i| {
                listens[i].0.accept().map_err(fail)
            })?;
            drop(listens); // as NCCL: closeListen right after accept
            recvs.extend(comms.into_iter().flatten());
            start.elapsed().as_secs_f64()
        }
        Role::Send => {
            let line = bench_rank::read_line(stdin, "peer's listen handles")?;
            let mut handles = line
                .split(',')
                .map(|h| {
                    bench_rank::unhex(h)
                        .ok_or_else(|| Fail::trouble(format!("not a handle: {h:?}")))
                })
                .collect::<Result<Vec<[u8; HANDLE_BYTES]>, _>>()?;
            if handles.len() != n {
                return Err(Fail::trouble(format!(
                    "the receiver listened {} times, not {n}",
                    handles.len()
                )));
            }
            let start = Instant::now();
            let mut comms: Vec<_> = (0..n).map(|_| None).collect();
            until_all("connect", &mut comms, |i| {
                plugin.connect(args.device, &mut handles[i]).map_err(fail)
            })?;
            sends.extend(comms.into_iter().flatten());
            start.elapsed().as_secs_f64()
        }
    };
    let after = Footprint::now()?;
    bench_rank::send(&Msg::Scale(Scale {
        role: args.role,
        connections: args.connections,
        setup_secs,
        before,
        after,
    }))?;
    bench_rank::expect_line(stdin, SCALE_DONE)?;
    let start = Instant::now();
    drop((sends, recvs));
    bench_rank::send(&Msg::ScaleClosed(start.elapsed().as_secs_f64()))
}

/// Calls `attempt(i)` for every `slots[i]` still empty until all are filled; fails after
/// [`bench_rank::STALL`] without one of them progressing.
fn until_all<T>(
    what: &str,
    slots: &mut [Option<T>],
    mut attempt: impl FnMut(usize) -> Result<Option<T>, Fail>,
) -> Result<(), Fail> {
    let mut pending = slots.len();
    let mut progress = Instant::now();
    while pending > 0 {
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.is_none() {
                *slot = attempt(i)?;
                if slot.is_some() {
                    pending -= 1;
                    progress = Instant::now();
                }
            }
        }
        if progress.elapsed() > bench_rank::STALL {
            return Err(Fail::trouble(format!(
                "{what}: {pending} of {} connections made no progress for {} s (is the other rank alive?)",
                slots.len(),
                bench_rank::STALL.as_secs()
            )));
        }
        std::thread::yield_now();
    }
    Ok(())
}
