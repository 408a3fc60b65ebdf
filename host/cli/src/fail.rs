//! How the CLI stops: an exit status and one line for stderr.
//!
//! Scripts branch on the status and operators read the line, so every failure path ends here
//! rather than in a panic or a multi-line error chain.

use std::fmt;
use std::process::ExitCode;

use ncclwasm_inspect::render::one_line;
use ncclwasm_model::TopologyError;

/// The exit statuses, documented in `--help` and README.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Done; for `diff`, the decisions are equal.
    Success,
    /// `diff`: the decisions differ. `check`: the file is not a usable policy.
    No,
    /// Could not do what was asked: invalid arguments or settings, an unreadable topology or
    /// policy (for `explain`/`diff`), an engine failure.
    Trouble,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        match e {
            Exit::Success => ExitCode::SUCCESS,
            Exit::No => ExitCode::from(1),
            Exit::Trouble => ExitCode::from(2),
        }
    }
}

/// What a subcommand prints on stdout, and how the process exits.
#[derive(Debug)]
pub struct Outcome {
    pub text: String,
    pub exit: Exit,
}

impl Outcome {
    pub fn success(text: String) -> Outcome {
        Outcome {
            text,
            exit: Exit::Success,
        }
    }
}

/// A failure: what to print (without the `error: ` prefix) and how to exit.
#[derive(Debug)]
pub struct Fail {
    pub exit: Exit,
    message: String,
}

impl Fail {
    pub fn trouble(message: impl fmt::Display) -> Fail {
        Fail {
            exit: Exit::Trouble,
            message: message.to_string(),
        }
    }

    pub fn no(message: impl fmt::Display) -> Fail {
        Fail {
            exit: Exit::No,
            message: message.to_string(),
        }
    }

    /// The message as one line: wasmtime and I/O errors may carry newlines, and stderr gets
    /// exactly one line per failure.
    pub fn line(&self) -> String {
        format!("error: {}", one_line(&self.message))
    }
}

/// A file `policy check` finds the plugin would refuse is the file's fault (exit 1); anything
/// else the tool could not work out is trouble (exit 2).
impl From<ncclwasm_inspect::Error> for Fail {
    fn from(e: ncclwasm_inspect::Error) -> Fail {
        match e {
            ncclwasm_inspect::Error::Rejected(why) => Fail::no(why),
            e => Fail::trouble(e),
        }
    }
}

/// Every way a bench stops early — its setup, a rank, the plugin — is trouble (exit 2).
impl From<ncclwasm_bench::Error> for Fail {
    fn from(e: ncclwasm_bench::Error) -> Fail {
        Fail::trouble(e)
    }
}

impl From<TopologyError> for Fail {
    fn from(e: TopologyError) -> Fail {
        Fail::trouble(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_is_one_line_with_the_prefix() {
        let f = Fail::no("first\n  second\tthird");
        assert_eq!(f.line(), "error: first second third");
        assert_eq!(f.exit, Exit::No);
    }
}
