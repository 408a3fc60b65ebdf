//! The one error type of the verbs layer.

use std::fmt;

/// What went wrong in the verbs layer; each variant says which verb, on which object, and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// The verbs library could not be opened (no rdma-core on this host, or a wrong
    /// `NCCL_WASM_IBVERBS_PATH`); the IB fabric is simply absent.
    #[error("cannot load the verbs library {path}: {reason}")]
    Load { path: String, reason: String },
    /// The library lacks a mandatory `IBVERBS_1.1` entry point: it is not a usable libibverbs.
    #[error("{path} does not export {symbol}; it is not a usable libibverbs")]
    MissingSymbol { path: String, symbol: &'static str },
    /// A verb returned an error (`verb` without its `ibv_` prefix; a direct-verbs function such
    /// as `mlx5dv_reg_dmabuf_mr` by its full name).
    #[error("{} on {object} failed: {}", VerbName(verb), Errno(*errno))]
    Verb {
        verb: &'static str,
        object: String,
        errno: i32,
    },
    /// Posting a work request chain failed; the WRs before `index` were posted.
    #[error("ibv_post_{verb} on QP {qpn} refused work request #{index}: {}", Errno(*errno))]
    Post {
        verb: &'static str,
        qpn: u32,
        index: usize,
        errno: i32,
    },
    /// The verbs library is too old for this entry point (or the provider lacks the op).
    #[error(
        "{} is not provided by the {fabric} verbs library; use the classic entry point",
        VerbName(verb)
    )]
    Unsupported {
        verb: &'static str,
        fabric: &'static str,
    },
    /// No device with that name; `ncclwasm devices` lists the names this host has.
    #[error("no verbs device named {0:?}")]
    NoSuchDevice(String),
    /// An argument the wrapper refuses before calling the provider.
    #[error("invalid argument: {0}")]
    Invalid(String),
}

impl VerbsError {
    /// The errno of a failed verb or post, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VerbsError::Verb { errno, .. } | VerbsError::Post { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// Displays an errno as `strerror (os error n)`.
struct Errno(i32);

/// A verb's C name: libibverbs' `ibv_` prefix, unless it is a provider's direct verb.
struct VerbName<'a>(&'a str);

impl fmt::Display for VerbName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.starts_with("mlx5dv_") {
            f.write_str(self.0)
        } else {
            write!(f, "ibv_{}", self.0)
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&std::io::Error::from_raw_os_error(self.0), f)
    }
}

/// The errno left by the last failed call on this thread (EIO when the provider set none, so an
/// error is never reported as success).
pub(crate) fn last_errno() -> i32 {
    match std::io::Error::last_os_error().raw_os_error() {
        Some(0) | None => libc::EIO,
        Some(e) => e,
    }
}

/// Maps an `int` verb return (0, positive errno, or -1 with `errno`) to a result.
pub(crate) fn check(rc: i32, verb: &'static str, object: impl FnOnce() -> String) -> Result<()> {
    match rc {
        0 => Ok(()),
        e if e > 0 => Err(VerbsError::Verb {
            verb,
            object: object(),
            errno: e,
        }),
        _ => Err(VerbsError::Verb {
            verb,
            object: object(),
            errno: last_errno(),
        }),
    }
}

/// The text of a caught panic's payload, for the WARN that reports it: every crate that catches
/// panics at a boundary (the C entry points of the plugin and of the soft provider, background
/// threads) reports them the same way.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}
