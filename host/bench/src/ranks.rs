//! The two rank processes, from the parent's side: started as `ncclwasm bench-rank`, their JSON
//! lines read and collected, the lines one rank has for the other relayed, both reaped — a rank
//! that dies or stalls fails the run with one line, never a hang.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ncclwasm_inspect::render;

use super::wait::{secs, stall};
use super::wire::{
    Completions, CpuUse, DeviceLine, Msg, Observed, PLUGIN_DONE, PairTiming, ROLES, Role,
    RoundTrips, SCALE_DONE, Scale, Timing,
};
use crate::Error;

/// What the ranks reported: the streams' timings from the receiver, the ping-pongs' and the
/// gets' from the sender.
#[derive(Debug)]
pub struct Measured {
    pub abi: u32,
    pub devices: Vec<DeviceLine>,
    pub plugin: Vec<Timing>,
    pub tcp: Vec<Timing>,
    pub plugin_latency: Vec<RoundTrips>,
    pub tcp_latency: Vec<RoundTrips>,
    /// From the sender.
    pub observed: Option<Observed>,
    /// The one-sided table the ranks used (`ncclRmaPlugin_vN`).
    pub rma_abi: u32,
    pub puts: Vec<Timing>,
    pub put_signals: Vec<RoundTrips>,
    pub gets: Vec<Completions>,
    /// Each rank's connection-scale part and its close time, by rank.
    pub scale: [Option<(Scale, Option<f64>)>; 2],
    /// Each rank's CPU per part and size, in the order it reported them, by rank.
    pub cpu: [Vec<CpuUse>; 2],
}

/// How many rows each table gets, and how many timings each row is made of.
#[derive(Debug)]
pub struct Expected {
    pub sizes: usize,
    pub latency_sizes: usize,
    pub repeats: usize,
    pub connections: u32,
}

/// The two rank processes; killed (and reaped) on drop unless they finished.
#[derive(Debug)]
pub struct Ranks {
    /// Each child's name in a failure's line.
    names: Vec<&'static str>,
    children: Vec<Child>,
    /// Each rank's stdin: the peer's handle, the TCP port (the sender) and the end of the run
    /// go there.
    stdins: Vec<ChildStdin>,
    events: mpsc::Receiver<(usize, Option<Msg>)>,
    /// Each rank's stderr, read to the end (and relayed line by line under `NCCL_DEBUG`).
    errors: Vec<Option<std::thread::JoinHandle<String>>>,
}

/// How long a rank that is done (or failed) may take to exit: `finalize` stops the plugin's
/// threads.
const REAP: Duration = Duration::from_secs(10);

impl Ranks {
    pub fn start(rank_args: &[String], env: &[(String, Option<String>)]) -> Result<Ranks, Error> {
        let children = ROLES.map(|(role, name)| {
            let role = if role == Role::Recv { "recv" } else { "send" };
            let mut args = vec![
                "bench-rank".to_owned(),
                "--role".to_owned(),
                role.to_owned(),
            ];
            args.extend_from_slice(rank_args);
            (name, args)
        });
        Ranks::spawn(&children, env)
    }

    /// `--single-process`: one child, `ncclwasm bench-pairs` with `args`.
    pub fn start_single(args: &[String], env: &[(String, Option<String>)]) -> Result<Ranks, Error> {
        let mut command = vec!["bench-pairs".to_owned()];
        command.extend_from_slice(args);
        Ranks::spawn(&[("single process", command)], env)
    }

    /// Starts this binary once per `(name, arguments)`, each with `env` applied.
    fn spawn(
        children: &[(&'static str, Vec<String>)],
        env: &[(String, Option<String>)],
    ) -> Result<Ranks, Error> {
        let exe = std::env::current_exe()
            .map_err(|e| Error::run(format!("cannot re-run this binary: {e}")))?;
        let (tx, events) = mpsc::channel();
        // With NCCL_DEBUG set the ranks' plugin prints what NCCL would (its logger is NULL
        // here), and the operator sees it as it comes, each line under its rank's name.
        let relay = env
            .iter()
            .find(|(k, _)| k == "NCCL_DEBUG")
            .map_or(std::env::var_os("NCCL_DEBUG").is_some(), |(_, v)| {
                v.is_some()
            });
        let tty = std::io::stderr().is_terminal();
        let mut ranks = Ranks {
            names: children.iter().map(|(name, _)| *name).collect(),
            children: Vec::new(),
            stdins: Vec::new(),
            events,
            errors: Vec::new(),
        };
        for (i, (_, args)) in children.iter().enumerate() {
            let mut cmd = Command::new(&exe);
            cmd.args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                match v {
                    Some(v) => cmd.env(k, v),
                    None => cmd.env_remove(k),
                };
            }
            let mut child = cmd
                .spawn()
                .map_err(|e| Error::run(format!("cannot start a rank: {e}")))?;
            let stdout = child.stdout.take().expect("piped");
            let stderr = child.stderr.take().expect("piped");
            let name = ranks.names[i];
            ranks.stdins.push(child.stdin.take().expect("piped"));
            ranks.children.push(child);
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    // Anything else on stdout (a library printing) is not ours to interpret.
                    let Ok(msg) = serde_json::from_str::<Msg>(&line) else {
                        continue;
                    };
                    if tx.send((i, Some(msg))).is_err() {
                        break;
                    }
                }
                let _ = tx.send((i, None));
            });
            ranks.errors.push(Some(std::thread::spawn(move || {
                let mut text = String::new();
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if relay {
                        // On a terminal, over the progress line rather than after it.
                        let clear = if tty { "\r\x1b[K" } else { "" };
                        eprintln!("{clear}[rank {i} {name}] {line}");
                    }
                    text.push_str(&line);
                    text.push('\n');
                }
                text
            })));
        }
        Ok(ranks)
    }

    /// Rank `i`'s exit status, waiting at most [`REAP`]; a rank still running then is killed.
    fn reap(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        let child = &mut self.children[i];
        let start = std::time::Instant::now();
        while start.elapsed() < REAP {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Why rank `i` stopped: its `error:` line, or its exit status.
    fn failure(&mut self, i: usize) -> Error {
        let name = self.names[i];
        let status = self.reap(i);
        let text = self.errors[i]
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .find(|l| l.starts_with("error: "))
            .map(|l| l.trim_start_matches("error: ").to_owned())
            .or_else(|| {
                text.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(str::to_owned)
            });
        // The plugin WARNs on stderr when it has no NCCL logger: its last word says why.
        let warn = text
            .lines()
            .rev()
            .find_map(|l| Some(l.split_once(" NCCL WARN ")?.1))
            .map_or(String::new(), |w| format!(" [{w}]"));
        match (line, status) {
            (Some(l), _) => Error::run(format!("bench rank {i} ({name}) failed: {l}{warn}")),
            (None, Some(s)) => Error::run(format!("bench rank {i} ({name}) stopped ({s})")),
            (None, None) => Error::run(format!(
                "bench rank {i} ({name}) stopped answering and was killed"
            )),
        }
    }

    /// One line to rank `i`.
    fn relay(&mut self, i: usize, line: &str) -> Result<(), Error> {
        let to = &mut self.stdins[i];
        if writeln!(to, "{line}").and_then(|()| to.flush()).is_err() {
            return Err(self.failure(i));
        }
        Ok(())
    }

    /// Relays and collects until both ranks are done; every wait bounded.
    pub fn drive(mut self, expected: &Expected) -> Result<Measured, Error> {
        let mut m = Measured {
            abi: 0,
            devices: Vec::new(),
            plugin: Vec::new(),
            tcp: Vec::new(),
            plugin_latency: Vec::new(),
            tcp_latency: Vec::new(),
            observed: None,
            rma_abi: 0,
            puts: Vec::new(),
            put_signals: Vec::new(),
            gets: Vec::new(),
            scale: [None, None],
            cpu: [Vec::new(), Vec::new()],
        };
        let progress = Progress::new();
        let (timings, latency_timings) = (
            expected.sizes * expected.repeats,
            expected.latency_sizes * expected.repeats,
        );
        let mut done = [false; 2];
        // How often each rank said it is done up to a point: the parent answers when both
        // have said so as often.
        let mut plugin_done = [0u32; 2];
        while !done.iter().all(|&d| d) {
            let (i, msg) = self.next()?;
            match msg {
                None if !done[i] => return Err(self.failure(i)),
                None => {}
                Some(Msg::Done) => done[i] = true,
                // Both ranks load the same library; the receiver's view is shown.
                Some(Msg::Hello { abi, devices }) if i == 0 => {
                    m.abi = abi;
                    m.devices = devices;
                }
                Some(Msg::Hello { .. }) => {}
                Some(Msg::Observed(o)) => m.observed = Some(o),
                // Only `bench-pairs` times pairs; a rank still moving only resets the bound.
                Some(Msg::Pairs(_) | Msg::Moving) => {}
                Some(Msg::Cpu(c)) => m.cpu[i].push(c),
                // Each rank connects to the other's listener.
                Some(Msg::Handle(h)) => self.relay(1 - i, &h)?,
                Some(Msg::TcpPort(p)) => self.relay(1, &p.to_string())?,
                Some(Msg::PluginDone) => {
                    plugin_done[i] += 1;
                    if plugin_done[0] == plugin_done[1] {
                        for r in 0..ROLES.len() {
                            self.relay(r, PLUGIN_DONE)?;
                        }
                    }
                }
                Some(Msg::Plugin(t)) => {
                    m.plugin.push(t);
                    progress.show("plugin", t.size, m.plugin.len(), timings);
                }
                Some(Msg::PluginPingPong(r)) => {
                    m.plugin_latency.push(r);
                    let n = m.plugin_latency.len();
                    progress.show("plugin ping-pong", r.size, n, latency_timings);
                }
                Some(Msg::Tcp(t)) => {
                    m.tcp.push(t);
                    progress.show("tcp", t.size, m.tcp.len(), timings);
                }
                Some(Msg::TcpPingPong(r)) => {
                    m.tcp_latency.push(r);
                    let n = m.tcp_latency.len();
                    progress.show("tcp ping-pong", r.size, n, latency_timings);
                }
                // Both ranks use the same table; each connects with the other's handle.
                Some(Msg::RmaHandle { abi, handle }) => {
                    m.rma_abi = abi;
                    self.relay(1 - i, &handle)?;
                }
                Some(Msg::Put(t)) => {
                    m.puts.push(t);
                    progress.show("one-sided put", t.size, m.puts.len(), expected.sizes);
                }
                Some(Msg::PutSignal(r)) => {
                    m.put_signals.push(r);
                    let n = m.put_signals.len();
                    progress.show("one-sided put+signal", r.size, n, expected.sizes);
                }
                Some(Msg::Get(g)) => {
                    m.gets.push(g);
                    let n = m.gets.len();
                    progress.show("one-sided get", g.size, n, expected.sizes);
                    if n == expected.sizes && expected.connections > 0 {
                        progress.phase(&format!("{} connections", expected.connections));
                    }
                }
                // The receiver's handles, to the sender.
                Some(Msg::Handles(h)) => self.relay(1, &h.join(","))?,
                Some(Msg::Scale(s)) => {
                    m.scale[i] = Some((s, None));
                    if m.scale.iter().all(Option::is_some) {
                        for r in 0..ROLES.len() {
                            self.relay(r, SCALE_DONE)?;
                        }
                    }
                }
                Some(Msg::ScaleClosed(secs)) => {
                    if let Some((_, close)) = &mut m.scale[i] {
                        *close = Some(secs);
                    }
                }
            }
        }
        progress.clear();
        self.finish()?;
        Ok(m)
    }

    /// The next line of any child (`None`: that child's stdout closed). A child gives up after
    /// its own stall bound without progress, and says while it moves ([`Msg::Moving`]);
    /// [`hang`] covers one that hangs anyway — stuck in a call, or stopped.
    fn next(&self) -> Result<(usize, Option<Msg>), Error> {
        self.events.recv_timeout(hang()).map_err(|_| {
            Error::run(format!(
                "the bench made no progress for {}: no transfer completed and no rank said anything (stuck or stopped)",
                secs(hang())
            ))
        })
    }

    /// Every child reaped once all said they were done: one that did not exit cleanly fails
    /// the run with its reason.
    fn finish(&mut self) -> Result<(), Error> {
        for i in 0..self.children.len() {
            if !self.reap(i).is_some_and(|s| s.success()) {
                return Err(self.failure(i));
            }
        }
        self.children.clear();
        Ok(())
    }
}

/// How long the parent waits for any line before it gives up on the children: twice a rank's
/// own bound, so a rank that gives up is heard first, with its reason.
fn hang() -> Duration {
    2 * stall()
}

/// What the `--single-process` child reported.
#[derive(Debug)]
pub struct SingleMeasured {
    pub abi: u32,
    pub devices: Vec<DeviceLine>,
    pub pairs: Vec<PairTiming>,
    /// `None` when the library does not export `ncclwasm_send_comm_stats`.
    pub observed: Option<Observed>,
}

impl Ranks {
    /// Collects what the `--single-process` child says until it is done (`expected`: its
    /// timings, for the progress line); every wait bounded.
    pub fn drive_single(mut self, expected: usize) -> Result<SingleMeasured, Error> {
        let mut m = SingleMeasured {
            abi: 0,
            devices: Vec::new(),
            pairs: Vec::new(),
            observed: None,
        };
        let progress = Progress::new();
        loop {
            let (_, msg) = self.next()?;
            match msg {
                None => return Err(self.failure(0)),
                Some(Msg::Done) => break,
                Some(Msg::Hello { abi, devices }) => {
                    m.abi = abi;
                    m.devices = devices;
                }
                Some(Msg::Pairs(p)) => {
                    m.pairs.push(p);
                    let phase = format!("pairs, {} in flight,", p.depth);
                    progress.show(&phase, p.size, m.pairs.len(), expected);
                }
                Some(Msg::Observed(o)) => m.observed = Some(o),
                Some(Msg::Moving) => {}
                Some(other) => {
                    return Err(Error::run(format!(
                        "the single-process bench said {other:?}, which only a rank says"
                    )));
                }
            }
        }
        progress.clear();
        self.finish()?;
        Ok(m)
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One overwritten status line on stderr, only when it is a terminal.
#[derive(Debug)]
struct Progress {
    tty: bool,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, phase: &str, size: u64, n: usize, total: usize) {
        if self.tty {
            eprint!(
                "\r\x1b[Kbench: {phase} {} ({n}/{total})",
                render::size(size)
            );
        }
    }

    fn phase(&self, phase: &str) {
        if self.tty {
            eprint!("\r\x1b[Kbench: {phase}");
        }
    }

    fn clear(&self) {
        if self.tty {
            eprint!("\r\x1b[K");
        }
    }
}
