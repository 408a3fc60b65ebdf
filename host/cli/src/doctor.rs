//! `ncclwasm doctor`: one screen of what will hold the plugin back on this host, each line OK,
//! WARN or FAIL with the fix. Exit status 0 when nothing FAILs, 1 otherwise. The checks are
//! [`ncclwasm_inspect::doctor`]'s; this prints them.

use clap::Args as ClapArgs;
use ncclwasm_inspect::doctor::{Doctor, Status};
use ncclwasm_inspect::render::json;

use crate::fail::{Exit, Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Print the checks as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let doctor = Doctor::this_host();
    let text = if args.json {
        json(&doctor)?
    } else {
        render(&doctor)
    };
    Ok(Outcome {
        text,
        exit: if doctor.failed {
            Exit::No
        } else {
            Exit::Success
        },
    })
}

/// Width of the status and name columns.
const STATUS_WIDTH: usize = 6;
const NAME_WIDTH: usize = 12;

/// One line per check; the fix on the next line, under the detail.
pub fn render(d: &Doctor) -> String {
    let mut out = String::new();
    for c in &d.checks {
        let status = match c.status {
            Status::Ok => "OK",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        out += &format!(
            "{status:<STATUS_WIDTH$}{:<NAME_WIDTH$}{}\n",
            c.name, c.detail
        );
        if !c.fix.is_empty() {
            out += &format!(
                "{:indent$}fix: {}\n",
                "",
                c.fix,
                indent = STATUS_WIDTH + NAME_WIDTH
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_inspect::doctor::Check;

    #[test]
    fn a_check_is_one_line_and_its_fix_goes_under_the_detail() {
        let text = render(&Doctor {
            checks: vec![Check {
                name: "config",
                status: Status::Warn,
                detail: "NCCL_IB_GID_INDEX=-5: negative".into(),
                fix: "unset it".into(),
            }],
            failed: false,
        });
        assert_eq!(
            text,
            "WARN  config      NCCL_IB_GID_INDEX=-5: negative\n                  fix: unset it\n"
        );
    }
}
