//! What nccl-net-wasm would decide, as data: the library behind the `ncclwasm` tool's commands.
//!
//! The tool builds the same [`PolicyHost`](ncclwasm_policy::PolicyHost) the plugin runs and
//! asks it every decision the plugin asks ([`report`]), on a topology file or on this host's own
//! discovery ([`live`]); it loads a policy file as the plugin would ([`check`]) and lists what
//! would hold the plugin back here ([`doctor`]). Every answer is plain serialisable data, so the
//! CLI's renderers are pure functions over it and `--json` prints this same structure.
//!
//! # Why a crate of its own
//! Computing a decision needs the policy engine, the built-in default, the verbs providers and
//! the transport's `init`; showing one needs none of them. Keeping the computation here lets the
//! CLI be argument parsing and rendering over four crates, and lets `ncclwasm-bench` resolve its
//! run (fabric, policy, sample device) exactly as `policy explain` and `devices` do without
//! depending on the CLI. The few text forms every report of the tool shares — units, aligned
//! columns, a plan's rows ([`render`], [`report::plan_rows`]) — live here too, so `explain`,
//! `doctor` and `bench` cannot drift apart.
#![forbid(unsafe_code)]

pub mod check;
pub mod doctor;
mod error;
pub mod live;
pub mod render;
pub mod report;
pub mod setup;

pub use error::Error;
