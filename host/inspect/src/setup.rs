//! What every subcommand sets up the same way: the settings handed to the built-in default and
//! to `init`, the policy to load, the topologies, and the parsing of command-line values.
//!
//! The CLI builds the same [`PolicyHost`] the plugin runs, so what `explain` shows is what the
//! plugin would decide; only the inputs differ (topology files instead of discovery, explicit
//! `--env`/`--config` on top of the environment).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use clap::Args;
use ncclwasm_model::file::{self, Limit};
use ncclwasm_model::telemetry::Telemetry;
use ncclwasm_model::{Port, Topology};
use ncclwasm_policy::{FailureMode, PolicyHost, Settings};

use crate::Error;
use crate::report::PolicyView;

/// Options that configure the policy and the built-in default (every subcommand has them).
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// The string handed to the policy's `init` as NCCL_WASM_POLICY_CONFIG [default: that
    /// variable's value in the environment]
    #[arg(long, value_name = "S")]
    pub config: Option<String>,

    /// An NCCL_IB_* setting on top of the process environment (repeatable), so settings can be
    /// tried offline; the built-in default and the policy's `init` both get it
    #[arg(long = "env", value_name = "NCCL_IB_X=v", value_parser = parse_env_pair)]
    pub env: Vec<(String, String)>,
}

/// The machines of the sample connection (`explain` and `diff`).
#[derive(Debug, Args)]
pub struct MachineArgs {
    /// The local machine's topology file (format in topologies/README.md)
    #[arg(long, short = 't', value_name = "T")]
    pub topology: PathBuf,

    /// The peer machine's topology file [default: the same machine]
    #[arg(long, value_name = "T2")]
    pub peer: Option<PathBuf>,

    /// A telemetry snapshot of the local machine (format in host/cli/README.md): what a
    /// policy's `telemetry.read` returns [default: every port idle]
    #[arg(long, value_name = "FILE")]
    pub telemetry: Option<PathBuf>,
}

/// The policy a subcommand runs: a component file, or the built-in default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyArg {
    /// `builtin`: no wasm policy; NCCL's own decisions (to use a file named `builtin`, write
    /// `./builtin`).
    Builtin,
    File(PathBuf),
}

impl PolicyArg {
    /// `given`, else `NCCL_WASM_POLICY` as the plugin reads it, else the built-in default: the
    /// policy the plugin would run here (`devices`).
    pub fn or_from_env(given: Option<&PolicyArg>) -> PolicyArg {
        match given {
            Some(p) => p.clone(),
            None => std::env::var_os(ncclwasm_policy::ENV_POLICY)
                .filter(|p| !p.is_empty())
                .map_or(PolicyArg::Builtin, |p| PolicyArg::File(PathBuf::from(p))),
        }
    }
}

impl FromStr for PolicyArg {
    type Err = String;

    fn from_str(s: &str) -> Result<PolicyArg, String> {
        match s {
            "" => Err("empty; give a .wasm component or `builtin`".into()),
            "builtin" => Ok(PolicyArg::Builtin),
            path => Ok(PolicyArg::File(PathBuf::from(path))),
        }
    }
}

/// The engine settings: the limits from the environment as the plugin reads them
/// (`NCCL_WASM_POLICY_TIMEOUT_MS`, `_MEMORY_MB`, `_CACHE_DIR`), `NCCL_IB_*` from the environment
/// with `--env` pairs overriding, `--config` over `NCCL_WASM_POLICY_CONFIG`. No policy path (the
/// caller loads it, to tell load failures apart), no watcher, and `open` failure so a faulting
/// hook shows up as a fallback in the output instead of stopping it.
pub fn settings(args: &ConfigArgs) -> Result<Settings, Error> {
    let mut s = Settings::from_env()?;
    s.policy = None;
    s.reload = None;
    s.failure = FailureMode::Open;
    if let Some(config) = &args.config {
        s.config = Some(config.clone());
    }
    let mut ib: BTreeMap<String, String> = s.ib.drain(..).collect();
    ib.extend(args.env.iter().cloned());
    s.ib = ib.into_iter().collect();
    Ok(s)
}

/// The settings of a `policy test` case: only its `NCCL_IB_*` pairs and its config, so a run
/// does not depend on the shell it is started from, and strict
/// ([`STRICT_CONFIG`](ncclwasm_default::STRICT_CONFIG)): a misspelt name or a value NCCL would
/// read otherwise is the case file's mistake. The engine limits still come from the
/// environment.
pub fn isolated_settings(
    ib: Vec<(String, String)>,
    config: Option<String>,
) -> Result<Settings, Error> {
    let mut settings = settings(&ConfigArgs {
        config: None,
        env: Vec::new(),
    })?;
    settings.ib = ib;
    settings
        .ib
        .push((ncclwasm_default::STRICT_CONFIG.to_owned(), "1".to_owned()));
    settings.config = config;
    Ok(settings)
}

/// The bytes of a policy file, through the bounded reader; the message names the file and
/// what is wrong with it.
pub fn read_policy(path: &std::path::Path) -> Result<Vec<u8>, String> {
    file::read(path, Limit::POLICY).map_err(|e| e.to_string())
}

/// A host deciding with `policy`. A file that cannot be loaded is trouble here (`check` makes
/// its own distinction); invalid `NCCL_IB_*` settings always are.
pub fn host(settings: Settings, policy: &PolicyArg) -> Result<(PolicyHost, PolicyView), Error> {
    let host = PolicyHost::new(settings)?;
    let view = match policy {
        PolicyArg::Builtin => PolicyView::builtin(),
        PolicyArg::File(path) => {
            let bytes = read_policy(path).map_err(Error::Input)?;
            let id = host.swap_from_bytes(&bytes, &path.display().to_string())?;
            PolicyView::wasm(&id)
        }
    };
    Ok((host, view))
}

/// The snapshot file a `--telemetry` names, laid over the machine's `ports` (a topology's, or
/// the live ones `devices` discovers).
pub fn telemetry(path: Option<&Path>, ports: &[Port]) -> Result<Option<Telemetry>, Error> {
    path.map(|path| Telemetry::load(path, ports))
        .transpose()
        .map_err(Error::Input)
}

/// The local machine and the peer's (`None`: the same machine).
pub fn topologies(args: &MachineArgs) -> Result<(Topology, Option<Topology>), Error> {
    let local = Topology::load(&args.topology)?;
    let peer = args.peer.as_ref().map(Topology::load).transpose()?;
    Ok((local, peer))
}

/// `NAME=VALUE` for `--env`: only `NCCL_IB_*` names, the variables the built-in default reads
/// and `init` receives; an empty value means unset, as in the environment.
pub fn parse_env_pair(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAME=VALUE, e.g. NCCL_IB_TIMEOUT=22"))?;
    if !name.starts_with("NCCL_IB_") || name.len() == "NCCL_IB_".len() {
        return Err(format!(
            "{name:?} is not an NCCL_IB_* variable; --env takes only those (use --config for NCCL_WASM_POLICY_CONFIG)"
        ));
    }
    Ok((name.to_owned(), value.to_owned()))
}

/// Message sizes to stripe: explain's default list.
pub const DEFAULT_SIZES: &str = "8,4K,64K,1M,64M";

/// One size of `--sizes LIST` in bytes: a number with an optional binary suffix (`K`, `M`, `G`,
/// optionally followed by `iB` or `B`), e.g. `8`, `4K`, `64MiB`.
pub fn parse_size(item: &str) -> Result<u64, String> {
    let upper = item.trim().to_ascii_uppercase();
    let number = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, shift) = match number.as_bytes().last() {
        Some(b'K') => (&number[..number.len() - 1], 10),
        Some(b'M') => (&number[..number.len() - 1], 20),
        Some(b'G') => (&number[..number.len() - 1], 30),
        _ => (number, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| {
            format!(
                "{item:?} is not a size; write bytes with an optional K, M or G, e.g. 8,4K,1M,64M"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        let sizes: Result<Vec<u64>, String> = DEFAULT_SIZES.split(',').map(parse_size).collect();
        assert_eq!(sizes.unwrap(), [8, 4096, 65536, 1 << 20, 64 << 20]);
        let sizes: Result<Vec<u64>, String> =
            "1,2k, 3KiB,4MB,1g".split(',').map(parse_size).collect();
        assert_eq!(sizes.unwrap(), [1, 2048, 3072, 4 << 20, 1 << 30]);
        for bad in ["", "4X", "K", "-1", "1.5K", "99999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn env_pairs_are_nccl_ib_only() {
        assert_eq!(
            parse_env_pair("NCCL_IB_HCA=mlx5_0:1").unwrap(),
            ("NCCL_IB_HCA".into(), "mlx5_0:1".into())
        );
        assert_eq!(
            parse_env_pair("NCCL_IB_TC=").unwrap(),
            ("NCCL_IB_TC".into(), String::new())
        );
        assert!(
            parse_env_pair("NCCL_IB_TIMEOUT")
                .unwrap_err()
                .contains("NAME=VALUE")
        );
        assert!(
            parse_env_pair("NCCL_WASM_POLICY_CONFIG=x")
                .unwrap_err()
                .contains("--config")
        );
        assert!(parse_env_pair("NCCL_IB_=1").is_err());
    }

    #[test]
    fn builtin_is_a_keyword() {
        assert_eq!("builtin".parse(), Ok(PolicyArg::Builtin));
        assert_eq!(
            "./builtin".parse(),
            Ok(PolicyArg::File(PathBuf::from("./builtin")))
        );
    }
}
