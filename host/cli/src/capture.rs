//! `ncclwasm topology capture`: this host's devices, as discovery reports them, written as a
//! topology file (format in topologies/README.md), so an operator can try policies offline on
//! a copy of a real node: `policy explain` on the file makes the decisions `devices` shows here.

use std::path::PathBuf;

use clap::Args as ClapArgs;
use ncclwasm_inspect::live;
use ncclwasm_model::Topology;

use crate::fail::{Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Write the file here instead of to stdout
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
}

pub fn run(args: &Args) -> Result<Outcome, Fail> {
    let live = live::discover()?;
    if live.ports.is_empty() {
        return Err(Fail::trouble(format!(
            "no RDMA port discovered on the {} fabric ({}): nothing to capture",
            live.fabric.name, live.fabric.why
        )));
    }
    let text = format!(
        "# {}: {} (`ncclwasm topology capture`)\n{}",
        live.topology.name,
        live.fabric.why,
        live.topology.to_toml()
    );
    // What is written must load: a value the loader refuses (a PCI path without a function
    // address, say) is reported here rather than by the operator's next command.
    Topology::parse(&text, "the captured topology")?;
    match &args.output {
        None => Ok(Outcome::success(text)),
        Some(path) => {
            std::fs::write(path, &text)
                .map_err(|e| Fail::trouble(format!("cannot write {}: {e}", path.display())))?;
            Ok(Outcome::success(format!(
                "wrote {} ({} port(s) of {} device(s))\n",
                path.display(),
                live.ports.len(),
                live.topology.devices.len()
            )))
        }
    }
}
