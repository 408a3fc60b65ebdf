//! Helpers for the workspace's tests, kept in one place so every test binary uses the same
//! rules:
//!
//! - [`skip`]: a test that cannot run here says so (`SKIP: …`) and is counted by
//!   `cargo xtask test`, instead of passing silently.
//! - [`child`]: a test that re-runs itself in a child process gets proof that the child really
//!   ran it (a renamed test would otherwise run zero tests and "pass"); children that talk to
//!   each other (a listen handle, a barrier) do it through [`child::relay`].
//! - [`topologies`]: the topology corpus, read from the directory, so a new file is covered by
//!   every corpus test without editing a list; [`over_bounds`], a file past what a topology
//!   may ask for, which every reader must refuse alike.
//! - [`wait_until`]: waiting on a condition with a deadline, never a bare sleep.
//! - [`guest`]: the path of a guest `cargo xtask guests` built; [`cdylib`]: a shared library of
//!   the workspace, built the way the tests' own build built it.
//! - [`netns`]: network namespaces joined by veth pairs, as hosts of a multi-node test,
//!   removed when the test ends.
//! - [`median_per_call`]: the figures benches print beside criterion's, measured in the same
//!   run.
//! - [`scratch`]: throw-away directories with hostile files in them (FIFOs, sparse giants,
//!   symlinks), and [`scratch::within`], which turns a hang into a failure.
//!
//! Dev-only (`publish = false`) and free of workspace dependencies, so any crate's tests can use
//! it.

#![forbid(unsafe_code)]

mod built;
pub mod child;
mod corpus;
mod guest;
pub mod netns;
pub mod scratch;
mod skip;
mod timing;
mod wait;

pub use built::{c_program, cdylib};
pub use corpus::{over_bounds, topologies, topology};
pub use guest::{built_guest, guest};
pub use skip::{SKIP_LOG_ENV, skip};
pub use timing::median_per_call;
pub use wait::wait_until;
