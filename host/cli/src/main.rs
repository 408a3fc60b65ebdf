//! `ncclwasm`: see what a routing policy decides before it runs on a cluster.
//!
//! Operators write policies and test them offline against topology files: `check`
//! says whether the plugin would load a file, `explain` shows every decision with its reason and
//! source, `diff` shows only the decisions two policies make differently; `bench` runs the built
//! plugin between two processes next to raw TCP. On the live machine, `devices` shows what the
//! plugin's discovery sees and what the policy decides on it, `topology capture` saves it as a
//! topology file, and `doctor` lists what would hold the plugin back. Each subcommand is a
//! module: argument struct, `run` (what would be decided comes from `ncclwasm_inspect`) and a
//! pure `render`; `bench` is `ncclwasm_bench`'s, which also runs the hidden `bench-rank` and
//! `bench-pairs` its processes are started as (this binary re-executed).
#![forbid(unsafe_code)]

mod author;
mod capture;
mod check;
#[cfg(test)]
mod corpus;
mod devices;
mod diff;
mod doctor;
mod explain;
mod fail;
mod policy_test;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ncclwasm_bench as bench;

use crate::fail::{Fail, Outcome};

const EXIT_STATUS: &str = "\
Exit status:
  0  done; for `diff`, the decisions are equal
  1  `diff`: the decisions differ; `check`: the file is not a usable policy; `doctor`: a
     check FAILed; `explain`: a hook of the policy faulted (the built-in default decided);
     `test`: a case failed
  2  invalid arguments or settings (e.g. an NCCL_IB_* value), unreadable topology or case
     file, a policy `explain`/`diff`/`test` cannot load, a `bench` rank that failed, or a
     `new`/`build` that could not make the project or the component

NCCL_IB_* settings come from the environment, with --env pairs on top; the built-in default
and the policy's init both get them. Engine limits come from NCCL_WASM_POLICY_TIMEOUT_MS and
NCCL_WASM_POLICY_MEMORY_MB, as in the plugin.";

#[derive(Debug, Parser)]
#[command(
    name = "ncclwasm",
    version,
    about = "Check, explain and compare nccl-net-wasm policies offline, against topology files; see what the plugin sees on this host; bench the plugin",
    after_help = EXIT_STATUS
)]
struct Cli {
    /// Log decisions and the policies' own log lines to stderr (-v: info, -vv: debug)
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Work with policy components
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// What the plugin discovers on this host, and every decision the policy makes on it
    #[command(after_help = EXIT_STATUS)]
    Devices(devices::Args),
    /// Topology files of live machines
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// What will hold the plugin back on this host: OK/WARN/FAIL lines with the fix (exit
    /// status 1 when something FAILs)
    #[command(after_help = EXIT_STATUS)]
    Doctor(doctor::Args),
    /// Two ranks send through the built plugin as NCCL drives it, next to a raw TCP baseline
    /// (or, with --single-process, one process times matched pairs through any plugin)
    #[command(after_help = EXIT_STATUS)]
    Bench(bench::Args),
    /// One rank of `bench` (started by it)
    #[command(hide = true)]
    BenchRank(bench::RankArgs),
    /// The process of `bench --single-process` (started by it)
    #[command(hide = true)]
    BenchPairs(bench::PairArgs),
}

#[derive(Debug, Subcommand)]
enum PolicyCommand {
    /// Would the plugin load FILE? Prints its name, version and the hooks it implements
    #[command(after_help = EXIT_STATUS)]
    Check(check::Args),
    /// Every decision a policy makes on a machine, with its reason and source
    #[command(after_help = EXIT_STATUS)]
    Explain(explain::Args),
    /// Only the decisions two policies make differently (exit status 1 when they differ)
    #[command(after_help = EXIT_STATUS)]
    Diff(diff::Args),
    /// Whether a policy makes the decisions its case files expect: a PASS/FAIL line per case
    /// with what differed (exit status 1 when a case fails)
    #[command(after_help = EXIT_STATUS)]
    Test(policy_test::Args),
    /// A new policy project in Rust, Python, JavaScript or C: its hooks stubbed as "no opinion",
    /// a README and a case file, buildable with what the release tarball ships
    #[command(after_help = EXIT_STATUS)]
    New(author::NewArgs),
    /// Build the policy project in DIR (made by `policy new`) into a component
    #[command(after_help = EXIT_STATUS)]
    Build(author::BuildArgs),
}

#[derive(Debug, Subcommand)]
enum TopologyCommand {
    /// Write this host's devices as a topology file (format in topologies/README.md), to try
    /// policies offline on a copy of this machine
    #[command(after_help = EXIT_STATUS)]
    Capture(capture::Args),
}

fn main() -> ExitCode {
    std::panic::set_hook(Box::new(|info| {
        let msg: Vec<String> = info
            .to_string()
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        eprintln!("error: internal error, please report it: {}", msg.join(" "));
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage(&e),
    };
    logging(cli.verbose);
    let result = match &cli.command {
        Command::Policy(PolicyCommand::Check(args)) => check::run(args),
        Command::Policy(PolicyCommand::Explain(args)) => explain::run(args),
        Command::Policy(PolicyCommand::Diff(args)) => diff::run(args),
        Command::Policy(PolicyCommand::Test(args)) => policy_test::run(args),
        Command::Policy(PolicyCommand::New(args)) => author::run_new(args),
        Command::Policy(PolicyCommand::Build(args)) => author::run_build(args),
        Command::Devices(args) => devices::run(args),
        Command::Topology(TopologyCommand::Capture(args)) => capture::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Bench(args) => bench::run(args).map(Outcome::success).map_err(Fail::from),
        Command::BenchRank(args) => bench::run_rank(args)
            .map(|()| Outcome::success(String::new()))
            .map_err(Fail::from),
        Command::BenchPairs(args) => bench::run_pairs(args)
            .map(|()| Outcome::success(String::new()))
            .map_err(Fail::from),
    };
    match result.and_then(print) {
        Ok(exit) => exit.into(),
        Err(fail) => {
            eprintln!("{}", fail.line());
            fail.exit.into()
        }
    }
}

/// Help and version go out as clap prints them; a usage error becomes one `error:` line.
fn usage(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            // Nothing useful to do if stdout is gone.
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            eprintln!("error: a subcommand is required; see `ncclwasm --help`");
            fail::Exit::Trouble.into()
        }
        _ => {
            // clap's first paragraph is the error (a list of missing arguments continues it on
            // indented lines); tips and usage follow after a blank line.
            let text = e.render().to_string();
            let first: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            eprintln!("{} (see --help)", first.join(" "));
            fail::Exit::Trouble.into()
        }
    }
}

/// Quiet by default (errors only); `-v` shows the engine's decisions and the guests' log lines.
/// Wasmtime and Cranelift stay at `warn` below `-vvv`: their debug output is about compiling.
fn logging(verbose: u8) {
    let filter = match verbose {
        0 => "error",
        1 => "warn,ncclwasm=info",
        2 => "warn,ncclwasm=debug",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .without_time()
        .init();
}

/// Write the outcome to stdout; a closed pipe (`| head`) is not an error.
fn print(outcome: Outcome) -> Result<fail::Exit, Fail> {
    let mut out = std::io::stdout().lock();
    match out
        .write_all(outcome.text.as_bytes())
        .and_then(|()| out.flush())
    {
        Ok(()) => Ok(outcome.exit),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(outcome.exit),
        Err(e) => Err(Fail::trouble(format!("cannot write the output: {e}"))),
    }
}
