//! The one error type of this crate, and the vocabulary of failures ([`Hook`] is
//! `ncclwasm_model`'s, made from its list of hooks).

use std::fmt;

pub use ncclwasm_model::Hook;

/// Makes [`FailureCause`] with [`FailureCause::ALL`] and the names, from one list.
macro_rules! failure_causes {
    ($($(#[$doc:meta])* $cause:ident => $name:literal,)*) => {
        /// Why a guest call produced no usable answer (`docs/architecture.md`, "The failure
        /// model"). Kept apart from answers the guest *chose* (`none`, `init` returning `err`):
        /// those are the policy's decisions, these are faults.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum FailureCause {
            $($(#[$doc])* $cause,)*
        }

        impl FailureCause {
            /// Every cause, in declaration order (the order of `Stats::faults`).
            pub const ALL: [FailureCause; [$($name),*].len()] = [$(FailureCause::$cause),*];

            pub fn name(self) -> &'static str {
                match self {
                    $(FailureCause::$cause => $name,)*
                }
            }
        }
    };
}

failure_causes! {
    /// The guest trapped (`unreachable`, a panic, an out-of-bounds access, stack exhaustion).
    Trap => "trap",
    /// The call ran past `NCCL_WASM_POLICY_TIMEOUT_MS` and was interrupted.
    Timeout => "timeout",
    /// The guest asked for more memory than `NCCL_WASM_POLICY_MEMORY_MB`.
    OutOfMemory => "out of memory",
    /// The answer failed validation.
    InvalidAnswer => "invalid answer",
    /// A fresh instance (made after an earlier fault) could not be instantiated or `init`-ed.
    Init => "re-init failed",
}

impl FailureCause {
    /// The position of this cause in [`FailureCause::ALL`].
    pub fn index(self) -> usize {
        // Declaration order is `ALL`'s order, and the enum has no explicit discriminants.
        self as usize
    }
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can go wrong in the policy engine. Each message ends with what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// An `NCCL_WASM_POLICY*` variable has a value the engine will not guess about.
    #[error("{var}={value:?} is invalid: {why}; fix or unset it")]
    Setting {
        var: &'static str,
        value: String,
        why: String,
    },

    /// The `NCCL_IB_*` settings the built-in default honours are invalid.
    #[error("{0}")]
    IbConfig(#[from] ncclwasm_default::ConfigError),

    /// The policy file could not be read, or is not a regular file of at most
    /// [`Limit::POLICY`](ncclwasm_model::file::Limit::POLICY) (the message names the file and
    /// what it is).
    #[error("{source}; check NCCL_WASM_POLICY")]
    Read {
        #[source]
        source: ncclwasm_model::file::FileError,
    },

    /// The bytes are not a component of world `ncclwasm:policy/policy`.
    #[error("{what} is not a policy component: {why}")]
    NotAPolicy { what: String, why: String },

    /// Cranelift refused the component (malformed or unsupported wasm).
    #[error(
        "policy {what} does not compile: {detail}; rebuild it for wasm32-wasip2 from wit/policy.wit"
    )]
    Compile { what: String, detail: String },

    /// The component could not be instantiated (e.g. its start-up code trapped).
    #[error("policy {what} cannot be instantiated: {detail}; fix the policy")]
    Instantiate { what: String, detail: String },

    /// The policy's `init` returned `err`: the policy refused the configuration.
    #[error(
        "policy {what} refused to start: init returned {message:?}; fix NCCL_WASM_POLICY_CONFIG or the NCCL_IB_* settings it objects to"
    )]
    InitRefused { what: String, message: String },

    /// `init` or a dry-run hook of a new policy faulted; the previous policy stays.
    #[error(
        "policy {what} failed its trial run in {hook} ({cause}): {detail}; the previous policy keeps running, fix the policy"
    )]
    Trial {
        what: String,
        hook: Hook,
        cause: FailureCause,
        detail: String,
    },

    /// A live policy faulted and `NCCL_WASM_POLICY_FAILURE=closed` forbids falling back.
    #[error(
        "policy {policy} failed in {hook} ({cause}): {detail}; fix the policy, or set NCCL_WASM_POLICY_FAILURE=open to fall back to the built-in default"
    )]
    Failed {
        policy: String,
        hook: Hook,
        cause: FailureCause,
        detail: String,
    },

    /// The wasm engine or one of its threads could not be created.
    #[error("the policy engine cannot start: {0}; check memory and thread limits")]
    Engine(String),
}
