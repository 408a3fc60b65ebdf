//! The engine's settings, from the environment (`docs/architecture.md`, "Configuration") or given explicitly.
//!
//! Every variable is parsed strictly: a typo in `NCCL_WASM_POLICY_TIMEOUT_MS` must not silently
//! become "no limit". An invalid value is refused with the variable's name and the accepted range,
//! and every value in effect is logged once with where it came from.

use std::path::PathBuf;
use std::time::Duration;

use ncclwasm_model::private_dir;

use crate::PolicyError;

/// Component path; unset or empty = the built-in default.
pub const ENV_POLICY: &str = "NCCL_WASM_POLICY";
/// Free-form string handed to the policy's `init` under this same key.
pub const ENV_CONFIG: &str = "NCCL_WASM_POLICY_CONFIG";
/// How often the watcher looks at the policy file, in ms; 0 = never.
pub const ENV_RELOAD_MS: &str = "NCCL_WASM_POLICY_RELOAD_MS";
/// Wall-clock bound of one guest call, in ms.
pub const ENV_TIMEOUT_MS: &str = "NCCL_WASM_POLICY_TIMEOUT_MS";
/// Linear-memory bound of one guest instance, in MiB.
pub const ENV_MEMORY_MB: &str = "NCCL_WASM_POLICY_MEMORY_MB";
/// `open` (fall back to the built-in default) or `closed` (fail the NCCL call).
pub const ENV_FAILURE: &str = "NCCL_WASM_POLICY_FAILURE";
/// Where compiled components are kept on disk ([`PolicyCache`]): unset = the per-user private
/// directory, `off` = in memory only, anything else = that directory.
pub const ENV_CACHE_DIR: &str = "NCCL_WASM_POLICY_CACHE_DIR";

/// Every `NCCL_WASM_*` variable the plugin reads, whichever part reads it: the engine's above,
/// the fabric choice and the soft fabric's machine (`ncclwasm-soft`), the library the `ib`
/// fabric opens and the sysfs root (`ncclwasm-verbs`), strict configuration
/// (`ncclwasm-default`), and the delivery of the soft provider's `libibverbs.so.1` stand-in
/// (`soft-ibverbs`, which the `ib` fabric may open). Any other name with the prefix is most likely misspelt: the host WARNs
/// it with the closest of these, and `ncclwasm doctor` lists it.
pub const WASM_VARIABLES: &[&str] = &[
    ENV_POLICY,
    ENV_CONFIG,
    ENV_RELOAD_MS,
    ENV_TIMEOUT_MS,
    ENV_MEMORY_MB,
    ENV_FAILURE,
    ENV_CACHE_DIR,
    "NCCL_WASM_FABRIC",
    "NCCL_WASM_TOPOLOGY",
    "NCCL_WASM_IBVERBS_PATH",
    "NCCL_WASM_SYSFS_ROOT",
    "NCCL_WASM_SOFT_DELIVERY",
    "NCCL_WASM_SOFT_CMA",
    "NCCL_WASM_TELEMETRY_FILE",
    "NCCL_WASM_METRICS_FILE",
    ncclwasm_default::STRICT_CONFIG,
];

const TIMEOUT_RANGE_MS: (u64, u64) = (1, 60_000);
const MEMORY_RANGE_MB: (u64, u64) = (1, 4096);
const RELOAD_RANGE_MS: (u64, u64) = (0, 3_600_000);

/// What happens when a policy traps, times out, runs out of memory or answers nonsense.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FailureMode {
    /// WARN once and use the built-in default for that decision: a broken policy degrades to
    /// stock NCCL behaviour instead of stopping the job.
    #[default]
    Open,
    /// Return an error (the plugin maps it to `ncclInvalidUsage`): for operators who would
    /// rather stop than run with decisions they did not write.
    Closed,
}

/// Where the engine keeps compiled components between processes.
///
/// Compiling a policy takes tens of ms or more and every rank of a node loads the same file, so by default the first rank compiles and the others load its
/// artefact from wasmtime's on-disk cache. wasmtime keys each entry by its own version, the
/// engine's configuration and the component's bytes, so an artefact is never loaded into an
/// engine it was not made for. It maps the artefact as native code, hence [`PolicyCache::PerUser`]
/// lives where only this user can write.
///
/// Shipping precompiled `.cwasm` files beside the policies was the other way: it saves the first
/// rank's compile too, but a `.cwasm` loads only into the exact wasmtime version and engine
/// configuration that made it, and only through `Component::deserialize`, which is `unsafe`
/// (the bytes are trusted to be native code wasmtime produced) — an `unsafe` this
/// `#![forbid(unsafe_code)]` crate would have to take on for a file anyone who can write the
/// install directory controls. The cache gets the same load time from the second rank on, with
/// wasmtime's own checks, so nothing precompiled is shipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PolicyCache {
    /// `policy-cache` in the per-user private directory (`ncclwasm_model::private_dir`):
    /// `$XDG_RUNTIME_DIR/ncclwasm`, else `$TMPDIR/ncclwasm-<euid>`, created 0700. When that
    /// directory is refused (a symlink, not ours, a wrong mode), the engine WARNs once and runs
    /// without the disk cache: loading a policy never fails because of the cache.
    #[default]
    PerUser,
    /// `NCCL_WASM_POLICY_CACHE_DIR=off`: compiled components stay in this process's memory.
    Off,
    /// `NCCL_WASM_POLICY_CACHE_DIR=DIR`: the operator's directory, used as given (its
    /// permissions are the operator's to choose); an unusable one is WARNed once and the engine
    /// compiles in memory, as for the default.
    Dir(PathBuf),
}

impl PolicyCache {
    /// The directory the engine compiles through, as it opens it: `None` when the cache is off.
    /// The per-user one is created (and checked) here; a refusal is the `Err` the engine WARNs
    /// with before compiling in memory. Public so a tool can say up front where a long compile
    /// will be kept (`ncclwasm policy check`).
    pub fn directory(&self) -> Result<Option<PathBuf>, String> {
        match self {
            PolicyCache::Off => Ok(None),
            PolicyCache::Dir(dir) => Ok(Some(dir.clone())),
            PolicyCache::PerUser => private_dir::private_dir("the compiled-policy cache")
                .map(|dir| Some(dir.join("policy-cache"))),
        }
    }
}

/// Everything the engine needs to know; build with [`Settings::from_env`] or start from
/// [`Settings::default`] and set fields (the CLI and the tests do).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// The policy component; `None` = the built-in default.
    pub policy: Option<PathBuf>,
    /// `NCCL_WASM_POLICY_CONFIG`, passed to `init` under that key when set.
    pub config: Option<String>,
    /// Watch interval of the policy file; `None` = no watcher.
    pub reload: Option<Duration>,
    /// Bound of one guest call (enforced with epoch interruption, so ± one tick).
    pub timeout: Duration,
    /// Bound of one guest instance's linear memory, in MiB.
    pub memory_mb: u32,
    pub failure: FailureMode,
    /// The `NCCL_IB_*` variables in effect, sorted by name: the built-in default honours them
    /// and `init` receives them.
    pub ib: Vec<(String, String)>,
    /// Where compiled components are kept across processes.
    pub cache: PolicyCache,
    /// How many devices one vNIC or group may fuse (NCCL's `maxDevsPerNic`: 4 before 2.30, 8
    /// after); the plugin sets it from the NCCL version it was loaded by.
    pub max_devs_per_nic: usize,
    /// `NCCL_WASM_*` names set that no part of the plugin reads, sorted ([`WASM_VARIABLES`]).
    pub unknown: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            policy: None,
            config: None,
            reload: None,
            timeout: Duration::from_millis(100),
            memory_mb: 64,
            failure: FailureMode::Open,
            ib: Vec::new(),
            cache: PolicyCache::PerUser,
            max_devs_per_nic: 4,
            unknown: Vec::new(),
        }
    }
}

impl Settings {
    /// Read the process environment. Not `std::env::vars`, which panics when any variable of
    /// the process is not UTF-8 (and the plugin lives in other people's processes): names that are
    /// not UTF-8 cannot be ours and are skipped; a lossy value is refused by the parsers below,
    /// with its name.
    pub fn from_env() -> Result<Settings, PolicyError> {
        Settings::from_vars(std::env::vars_os().filter_map(|(name, value)| {
            Some((
                name.into_string().ok()?,
                value.to_string_lossy().into_owned(),
            ))
        }))
    }

    /// Read settings from name/value pairs shaped like the environment (so tests need not touch
    /// the real one). Unknown `NCCL_WASM_*` names are ignored; `NCCL_IB_*` pairs (and
    /// `NCCL_WASM_STRICT_CONFIG`, which decides how they are read) are collected.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, PolicyError> {
        let mut s = Settings::default();
        for (name, value) in vars {
            match name.as_str() {
                ENV_POLICY => s.policy = non_empty(&value).map(PathBuf::from),
                ENV_CONFIG => s.config = Some(value),
                ENV_RELOAD_MS => {
                    let ms = number(ENV_RELOAD_MS, &value, RELOAD_RANGE_MS, "milliseconds")?;
                    s.reload = (ms > 0).then(|| Duration::from_millis(ms));
                }
                ENV_TIMEOUT_MS => {
                    let ms = number(ENV_TIMEOUT_MS, &value, TIMEOUT_RANGE_MS, "milliseconds")?;
                    s.timeout = Duration::from_millis(ms);
                }
                ENV_MEMORY_MB => {
                    let mb = number(ENV_MEMORY_MB, &value, MEMORY_RANGE_MB, "MiB")?;
                    s.memory_mb = u32::try_from(mb).expect("range fits u32");
                }
                ENV_FAILURE => {
                    s.failure = match value.trim().to_ascii_lowercase().as_str() {
                        "open" => FailureMode::Open,
                        "closed" => FailureMode::Closed,
                        _ => {
                            return Err(invalid(
                                ENV_FAILURE,
                                &value,
                                "expected `open` or `closed`",
                            ));
                        }
                    }
                }
                ENV_CACHE_DIR => s.cache = cache(&value),
                _ if name.starts_with("NCCL_IB_") || name == ncclwasm_default::STRICT_CONFIG => {
                    s.ib.push((name, value))
                }
                _ if name.starts_with("NCCL_WASM_") && !WASM_VARIABLES.contains(&name.as_str()) => {
                    s.unknown.push(name)
                }
                _ => {}
            }
        }
        s.ib.sort();
        s.unknown.sort();
        Ok(s)
    }

    /// One line per [`Settings::unknown`] name, with the known name it most likely meant.
    pub fn unknown_warnings(&self) -> Vec<String> {
        self.unknown
            .iter()
            .map(|name| {
                let meant = ncclwasm_model::spelling::closest(name, WASM_VARIABLES)
                    .map_or(String::new(), |m| format!(" (did you mean {m}?)"));
                format!("{name}: not a variable the plugin reads{meant}; ignored")
            })
            .collect()
    }

    /// Log every value in effect once, so an operator can see what the engine runs with.
    pub(crate) fn log(&self) {
        tracing::info!(
            target: "ncclwasm::policy",
            policy = %self.policy.as_ref().map_or("built-in default".into(), |p| p.display().to_string()),
            reload_ms = self.reload.map_or(0, |d| d.as_millis()),
            timeout_ms = self.timeout.as_millis(),
            memory_mb = self.memory_mb,
            failure = ?self.failure,
            cache = ?self.cache,
            config = ?self.config,
            "policy engine settings (from NCCL_WASM_POLICY* or explicit)"
        );
    }

    /// What `init` receives: `NCCL_WASM_POLICY_CONFIG` (when set) and the `NCCL_IB_*` pairs.
    pub(crate) fn init_pairs(&self) -> Vec<(String, String)> {
        let config = self
            .config
            .iter()
            .map(|c| (ENV_CONFIG.to_owned(), c.clone()));
        config.chain(self.ib.iter().cloned()).collect()
    }
}

fn non_empty(value: &str) -> Option<&str> {
    let v = value.trim();
    (!v.is_empty()).then_some(v)
}

/// `off` in words disables the disk cache; an empty value reads as unset (the per-user
/// default), as for every `NCCL_WASM_*` variable, because a templated environment
/// (`NCCL_WASM_POLICY_CACHE_DIR=${X}`) yields empty values that mean "not given". A directory
/// literally named `off` is `./off`.
fn cache(value: &str) -> PolicyCache {
    match non_empty(value) {
        None => PolicyCache::PerUser,
        Some(v) if v.eq_ignore_ascii_case("off") => PolicyCache::Off,
        Some(v) => PolicyCache::Dir(PathBuf::from(v)),
    }
}

fn number(
    var: &'static str,
    value: &str,
    (lo, hi): (u64, u64),
    unit: &str,
) -> Result<u64, PolicyError> {
    match value.trim().parse::<u64>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(invalid(
            var,
            value,
            &format!("expected a whole number of {unit} in {lo}..={hi}"),
        )),
    }
}

fn invalid(var: &'static str, value: &str, why: &str) -> PolicyError {
    PolicyError::Setting {
        var,
        value: value.to_owned(),
        why: why.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Result<Settings, PolicyError> {
        Settings::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    /// A misspelt `NCCL_WASM_*` is kept aside and warned with the name meant (the host WARNs
    /// these lines at start); known names of other parts are not.
    #[test]
    fn unknown_wasm_variables_are_named_with_the_one_meant() {
        let s = vars(&[
            ("NCCL_WASM_POLCY", "x.wasm"),
            ("NCCL_WASM_FABRIC", "soft"),
            ("NCCL_WASM_ZZZ", "1"),
        ])
        .unwrap();
        assert_eq!(s.policy, None);
        assert_eq!(
            s.unknown_warnings(),
            [
                "NCCL_WASM_POLCY: not a variable the plugin reads (did you mean NCCL_WASM_POLICY?); ignored",
                "NCCL_WASM_ZZZ: not a variable the plugin reads; ignored",
            ]
        );
    }

    #[test]
    fn parses_every_variable() {
        let s = vars(&[
            (ENV_POLICY, "/p.wasm"),
            (ENV_CONFIG, "x=1"),
            (ENV_RELOAD_MS, "250"),
            (ENV_TIMEOUT_MS, "20"),
            (ENV_MEMORY_MB, "16"),
            (ENV_FAILURE, "Closed"),
            ("NCCL_IB_HCA", "mlx5_0"),
            ("NCCL_IB_GID_INDEX", "3"),
            ("HOME", "/root"),
        ])
        .unwrap();
        assert_eq!(s.policy, Some(PathBuf::from("/p.wasm")));
        assert_eq!(s.reload, Some(Duration::from_millis(250)));
        assert_eq!(s.timeout, Duration::from_millis(20));
        assert_eq!(s.memory_mb, 16);
        assert_eq!(s.failure, FailureMode::Closed);
        assert_eq!(
            s.init_pairs(),
            [
                (ENV_CONFIG, "x=1"),
                ("NCCL_IB_GID_INDEX", "3"),
                ("NCCL_IB_HCA", "mlx5_0")
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }

    #[test]
    fn zero_reload_and_empty_policy_mean_off() {
        let s = vars(&[(ENV_RELOAD_MS, "0"), (ENV_POLICY, " ")]).unwrap();
        assert_eq!((s.reload, s.policy), (None, None));
    }

    #[test]
    fn the_cache_is_per_user_unless_off_or_a_directory_is_given() {
        let cache = |pairs: &[(&str, &str)]| vars(pairs).unwrap().cache;
        assert_eq!(cache(&[]), PolicyCache::PerUser);
        assert_eq!(cache(&[(ENV_CACHE_DIR, " ")]), PolicyCache::PerUser);
        assert_eq!(cache(&[(ENV_CACHE_DIR, "OFF")]), PolicyCache::Off);
        assert_eq!(
            cache(&[(ENV_CACHE_DIR, "./off")]),
            PolicyCache::Dir(PathBuf::from("./off"))
        );
        assert_eq!(Settings::default().cache, PolicyCache::PerUser);
    }

    #[test]
    fn refuses_invalid_values_naming_the_variable() {
        for (var, value) in [
            (ENV_TIMEOUT_MS, "0"),
            (ENV_TIMEOUT_MS, "ten"),
            (ENV_MEMORY_MB, "99999"),
            (ENV_RELOAD_MS, "-1"),
            (ENV_FAILURE, "maybe"),
        ] {
            let e = vars(&[(var, value)]).unwrap_err().to_string();
            assert!(e.contains(var) && e.contains(value), "{e}");
        }
    }
}
