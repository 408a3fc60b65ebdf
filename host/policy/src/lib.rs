//! The policy engine of nccl-net-wasm: loads WebAssembly policy components, bounds them in time
//! and memory, validates every answer, and hot-swaps them under a running job.
//!
//! # How it fits
//! The transport asks for each decision through its `Decisions` trait, which the plugin backs
//! with a [`PolicyHost`]; the CLI asks the [`PolicyHost`] directly. There is one method per hook
//! of `ncclwasm_model::for_each_hook!` — `select_devices`, `select_gid`, `group_devices`,
//! `make_vnic`, `plan_connection`, `on_port_event` — generated from that list together with the
//! counters of [`Stats`] and the `policy-info.hooks` flags; `init` is called once per instance
//! before any of them. The host asks the current policy — a component of world
//! `ncclwasm:policy/policy` (`wit/policy.wit`) — or, when there is none, when it answers `none`,
//! or when it does not implement the hook, the built-in default (`ncclwasm-default`, NCCL's own
//! decisions). Every [`Decision`] carries its reason and its [`Source`], so `ncclwasm policy
//! explain` and the NCCL INFO log can say who decided and why. `docs/architecture.md`, "How to
//! add a hook", lists the files a new hook touches.
//!
//! # Failure model (`docs/architecture.md`, "The failure model")
//! A trap, a timeout, running out of memory, or an answer that fails
//! `ncclwasm_model::validate` is a fault. With [`FailureMode::Open`] the host WARNs once per
//! (policy, hook, cause) and uses the built-in default for that decision; with
//! [`FailureMode::Closed`] the call returns [`PolicyError::Failed`]. A faulted instance is thrown
//! away and the next call gets a fresh, `init`-ed one.
//!
//! # Hot swap (`docs/architecture.md`, "Hot swap")
//! [`PolicyHost::swap_from_path`], [`PolicyHost::swap_from_bytes`] and the watcher thread
//! (`NCCL_WASM_POLICY_RELOAD_MS`) compile, instantiate, `init` and — once
//! [`PolicyHost::set_topology`] told the live ports — try every hook before publishing with one
//! atomic store. Each call loads the current version once and is answered by an instance of
//! that version taken from its pool, so concurrent callers never see half of two versions.
#![forbid(unsafe_code)]

mod backtrace;
mod config;
mod convert;
mod decisions;
mod engine;
mod error;
mod host;
mod watch;

pub use config::{
    ENV_CACHE_DIR, ENV_CONFIG, ENV_FAILURE, ENV_MEMORY_MB, ENV_POLICY, ENV_RELOAD_MS,
    ENV_TIMEOUT_MS, FailureMode, PolicyCache, Settings, WASM_VARIABLES,
};
pub use engine::{Compilation, CompileCache};
pub use error::{FailureCause, Hook, PolicyError};
pub use host::{Decision, PolicyHost, PolicyId, Source, Stats};
