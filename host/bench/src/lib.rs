//! `ncclwasm bench`: two ranks (processes) send through the built plugin library exactly as NCCL
//! drives it and, size by size, over a plain TCP socket, and two tables compare the two:
//! bandwidth (a stream of messages) and latency (a ping-pong, one message each way). A third
//! table is one-sided: the same ranks drive the library's RMA table as NCCL's GIN proxy does —
//! puts, puts with a signal, gets — and its puts stand against the two-sided bandwidth of the
//! same run.
//!
//! The parent process only orchestrates: it resolves the library, fabric, topology and policy,
//! picks the device as `policy explain` picks its sample connection's (the vNIC of NCCL core's
//! default fusion when the policy accepts it), starts the two ranks ([`rank`]) with the
//! matching `NCCL_WASM_*` environment, relays the listen handles and the TCP port between them,
//! and renders what the ranks timed and what the sender's connection reported it ran — the
//! plan and the bytes per QP, from the plugin itself rather than recomputed here. Each size runs
//! `--repeats` times on each transport, alternating, and each ratio is the median of the
//! repeats' with its least–greatest ([`spread`]). A rank that dies or stalls fails the run with
//! one line, never a hang; a long measurement that still moves is never cut short.
//!
//! With `--single-process` the parent starts one child instead ([`pairs`]), which owns both ends
//! of one connection and times matched `irecv` + `isend` + `test` pairs through the library —
//! this plugin or any other — on the soft fabric's in-process delivery: the plugin's own cost
//! per message, with no second process, socket or fabric thread in the figure.
//!
//! # Why a crate of its own
//! The bench is a multi-process driver over the plugin's C ABI (`ncclwasm_abi::load`), TCP
//! baselines and their tables; it shares with the policy tooling only how a run is set up
//! (`ncclwasm_inspect`: the fabric, the policy, the sample connection's device) and the text
//! forms of a report. On its own it keeps the CLI small, and the CLI only delegates.
//!
//! The processes are this binary again: the parent starts each rank as `<exe> bench-rank …`
//! and the single-process child as `<exe> bench-pairs …` (`std::env::current_exe`), so the
//! program that calls [`run`] must answer those two hidden subcommands with [`run_rank`] and
//! [`run_pairs`] ([`RankArgs`], [`PairArgs`] are their arguments) — `ncclwasm` does. A rank
//! reports its failure as the program's one `error: ` line on stderr, which the parent quotes.
//!
//! The modules, each using only those after it in this list (no circle):
//! * [`driver`]: the parent — options, what to run, the report;
//! * [`ranks`]: the rank processes as the parent sees them: started, read, relayed, reaped;
//! * [`tables`]: the report's rows and how it prints;
//! * [`pairs`]: `--single-process`, the child that owns both ends of a connection and times
//!   matched pairs;
//! * [`rank`]: one rank — the plugin's half of each part, in order;
//! * [`one_sided`]: a rank's one-sided part, through the library's RMA table;
//! * [`tcp`]: the TCP baseline's half;
//! * [`cpu`]: what each part of a rank cost in CPU;
//! * [`scale`]: the connection-scale part;
//! * [`workload`]: how many transfers and which bytes, and their check;
//! * [`wait`]: every wait bounded by a time without progress — a stream of transfers through
//!   either table included —, how a rank gives up, and how it tells the parent it still moves;
//! * [`wire`]: what the parent and the ranks say to each other (command line and JSON lines);
//! * [`spread`]: how sure a figure is — the median of the repeats and their least–greatest.
//!
//! Two variables are internal, for the tests: `NCCL_WASM_BENCH_STALL_MS`, every wait's bound
//! without progress (30 s; the parent's is twice it), and `NCCL_WASM_BENCH_PACE_MS`, a delay
//! after each transfer a stream completes — a rank slow but moving, or one that stopped.
#![forbid(unsafe_code)]

mod cpu;
mod driver;
mod error;
mod one_sided;
mod pairs;
mod rank;
mod ranks;
mod scale;
mod spread;
mod tables;
mod tcp;
mod wait;
mod wire;
mod workload;

pub use driver::{Args, run};
pub use error::Error;
pub use pairs::{PairArgs, run as run_pairs};
pub use rank::run as run_rank;
pub use wire::RankArgs;
