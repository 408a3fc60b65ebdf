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

use super::wait::{plugin_fail, until_all};
use super::wire::{self, Footprint, Msg, Role, SCALE_DONE, Scale};
use crate::Error;

/// What the process holds now, from `/proc/self`.
fn footprint() -> Result<Footprint, Error> {
    let status = file::read_to_string(Path::new("/proc/self/status"), Limit::PROC)
        .map_err(|e| Error::run(format!("connection scale: {e}")))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .ok_or_else(|| Error::run(format!("/proc/self/status has no {name}")))
    };
    let fds = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| Error::run(format!("connection scale: /proc/self/fd: {e}")))?
        .count() as u64;
    Ok(Footprint {
        rss_kib: field("VmRSS:")?,
        threads: field("Threads:")?,
        fds,
    })
}

/// This rank's side of `--connections`: nothing when it is 0.
pub fn run(
    plugin: &Plugin,
    role: Role,
    device: i32,
    connections: u32,
    stdin: &mut impl BufRead,
) -> Result<(), Error> {
    let n = connections as usize;
    if n == 0 {
        return Ok(());
    }
    let before = footprint()?;
    let fail = plugin_fail;
    // Held until both ranks are established, then closed together (timed).
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let setup_secs = match role {
        Role::Recv => {
            let start = Instant::now();
            let listens = (0..n)
                .map(|_| plugin.listen(device))
                .collect::<Result<Vec<_>, _>>()
                .map_err(fail)?;
            let handles = listens.iter().map(|(_, h)| wire::hex(h)).collect();
            wire::send(&Msg::Handles(handles))?;
            let mut comms: Vec<_> = (0..n).map(|_| None).collect();
            until_all("accept", &mut comms, |i| {
                listens[i].0.accept().map_err(fail)
            })?;
            drop(listens); // as NCCL: closeListen right after accept
            recvs.extend(comms.into_iter().flatten());
            start.elapsed().as_secs_f64()
        }
        Role::Send => {
            let line = wire::read_line(stdin, "peer's listen handles")?;
            let mut handles = line
                .split(',')
                .map(|h| wire::unhex(h).ok_or_else(|| Error::run(format!("not a handle: {h:?}"))))
                .collect::<Result<Vec<[u8; HANDLE_BYTES]>, _>>()?;
            if handles.len() != n {
                return Err(Error::run(format!(
                    "the receiver listened {} times, not {n}",
                    handles.len()
                )));
            }
            let start = Instant::now();
            let mut comms: Vec<_> = (0..n).map(|_| None).collect();
            until_all("connect", &mut comms, |i| {
                plugin.connect(device, &mut handles[i]).map_err(fail)
            })?;
            sends.extend(comms.into_iter().flatten());
            start.elapsed().as_secs_f64()
        }
    };
    let after = footprint()?;
    wire::send(&Msg::Scale(Scale {
        role,
        connections,
        setup_secs,
        before,
        after,
    }))?;
    wire::expect_line(stdin, SCALE_DONE)?;
    let start = Instant::now();
    drop((sends, recvs));
    wire::send(&Msg::ScaleClosed(start.elapsed().as_secs_f64()))
}
