//! `ncclwasm policy check FILE`: is this file a policy the plugin would load? What is tried is
//! [`ncclwasm_inspect::check`]; exit status 1 with one line naming the cause when any step
//! fails.

use std::path::PathBuf;

use clap::Args as ClapArgs;
use ncclwasm_inspect::check::{Checked, check};
use ncclwasm_inspect::render::{self, field, json};
use ncclwasm_inspect::setup::{self, ConfigArgs};

use crate::fail::{Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The policy component (.wasm) to check
    #[arg(value_name = "FILE")]
    pub file: PathBuf,

    #[command(flatten)]
    pub config: ConfigArgs,

    /// Print the result as JSON (shape in host/cli/README.md)
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let checked = check(&args.file, setup::settings(&args.config)?)?;
    let text = if args.json {
        json(&checked)?
    } else {
        render(&checked)
    };
    Ok(Outcome::success(text))
}

pub fn render(c: &Checked) -> String {
    let hooks = if c.hooks.is_empty() {
        "none (the built-in default makes every decision)".to_owned()
    } else {
        c.hooks.join(", ")
    };
    let mut out = field("policy", &format!("{} {}", c.policy.name, c.policy.version));
    out += &field("file", &c.file);
    if let Some(sha) = &c.policy.sha256 {
        out += &field("sha256", sha);
    }
    out += &field("hooks", &hooks);
    out += &field("size", &format!("{} KiB", c.size_bytes.div_ceil(1024)));
    out += &field(
        "imports",
        &if c.imports.is_empty() {
            "none".to_owned()
        } else {
            c.imports.join(", ")
        },
    );
    out += &field(
        "compile",
        &format!("{} ({})", render::duration(c.compile_ms / 1e3), c.cache),
    );
    out + &field(
        "trial",
        &format!("every hook answered without fault on {}", c.trial),
    )
}
