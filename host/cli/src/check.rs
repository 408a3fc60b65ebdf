//! `ncclwasm policy check FILE`: is this file a policy the plugin would load? What is tried is
//! [`ncclwasm_inspect::check`]; exit status 1 with one line naming the cause when any step
//! fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args as ClapArgs;
use ncclwasm_author::progress::{self, Step};
use ncclwasm_inspect::check::{Checked, LongCompile, check, long_compile};
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
    let settings = setup::settings(&args.config)?;
    let step = long_compile(&args.file, &settings).map(|long| {
        Step::start(
            &format!("compiling {}", name(&args.file)),
            Some(&why(&long)),
        )
    });
    let checked = check(&args.file, settings)?;
    if let Some(step) = step {
        step.finish(&format!("{} {}", name(&args.file), checked.cache));
    }
    let text = if args.json {
        json(&checked)?
    } else {
        render(&checked)
    };
    Ok(Outcome::success(text))
}

/// The file's name alone: the progress line has room for little else.
fn name(file: &Path) -> String {
    file.file_name()
        .unwrap_or(file.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// Why the step is long, said before it starts: the size, how long on a fast and on a slow
/// machine, once or at every load.
fn why(long: &LongCompile) -> String {
    // Rounded to 5 s: an estimate, not a promise.
    let about = |d: Duration| progress::elapsed(Duration::from_secs(d.as_secs().div_ceil(5) * 5));
    let first = format!(
        "{} on one core, {} to {}",
        render::bytes(long.bytes),
        about(long.fastest),
        about(long.slowest)
    );
    match &long.cache {
        Ok(dir) => format!(
            "{first} the first time; later loads read the compiled-policy cache in {}",
            dir.display()
        ),
        Err(none) => format!("{first} at every load: no compiled-policy cache ({none})"),
    }
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
