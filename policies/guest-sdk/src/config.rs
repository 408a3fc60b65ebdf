//! What `init` receives, and the small `key=value` language policies share for
//! `NCCL_WASM_POLICY_CONFIG`, so every policy refuses a typo the same loud way.

use std::fmt::Display;
use std::str::FromStr;

/// The config key holding the operator's policy settings (the `NCCL_WASM_POLICY_CONFIG`
/// environment variable).
pub const POLICY_CONFIG_KEY: &str = "NCCL_WASM_POLICY_CONFIG";

/// The name/value pairs handed to `init`: [`POLICY_CONFIG_KEY`] plus every `NCCL_IB_*`
/// variable in effect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    pairs: Vec<(String, String)>,
}

impl Config {
    pub fn new(pairs: Vec<(String, String)>) -> Self {
        Config { pairs }
    }

    /// Every pair, as the host passed them (what the built-in default's own parser takes).
    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }

    /// The value of one variable.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The policy's own settings, parsed from [`POLICY_CONFIG_KEY`] (empty when unset).
    pub fn options(&self) -> Result<Options<'_>, String> {
        Options::parse(self.get(POLICY_CONFIG_KEY).unwrap_or(""))
    }
}

/// Settings written as `key=value` entries separated by commas, e.g.
/// `subnet=10.1.0.0/16, qps-per-pair=2`.
///
/// A policy [`take`](Options::take)s each key it knows and then calls
/// [`finish`](Options::finish), which refuses whatever is left: a misspelt key must fail
/// `init` rather than silently keep the default.
#[derive(Debug)]
pub struct Options<'a> {
    entries: Vec<(&'a str, &'a str)>,
    known: Vec<String>,
}

impl<'a> Options<'a> {
    pub fn parse(text: &'a str) -> Result<Self, String> {
        let mut entries: Vec<(&str, &str)> = Vec::new();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) = entry.split_once('=').ok_or_else(|| {
                format!("{POLICY_CONFIG_KEY}: `{entry}` is not of the form key=value")
            })?;
            let (key, value) = (key.trim(), value.trim());
            if entries.iter().any(|(k, _)| *k == key) {
                return Err(format!("{POLICY_CONFIG_KEY}: `{key}` is set twice"));
            }
            entries.push((key, value));
        }
        Ok(Options {
            entries,
            known: Vec::new(),
        })
    }

    /// Removes and parses `key`; `Ok(None)` when it is not set.
    pub fn take<T>(&mut self, key: &str) -> Result<Option<T>, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        self.known.push(key.to_owned());
        let Some(pos) = self.entries.iter().position(|(k, _)| *k == key) else {
            return Ok(None);
        };
        let (_, value) = self.entries.remove(pos);
        value
            .parse()
            .map(Some)
            .map_err(|e| format!("{POLICY_CONFIG_KEY}: `{key}={value}`: {e}"))
    }

    /// Fails on any entry no [`take`](Options::take) asked for, naming the keys that exist.
    pub fn finish(self) -> Result<(), String> {
        match self.entries.first() {
            None => Ok(()),
            Some((key, _)) if self.known.is_empty() => Err(format!(
                "{POLICY_CONFIG_KEY}: unknown setting `{key}` (this policy takes no settings)"
            )),
            Some((key, _)) => Err(format!(
                "{POLICY_CONFIG_KEY}: unknown setting `{key}` (known: {})",
                self.known.join(", ")
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(policy: &str) -> Config {
        Config::new(vec![
            ("NCCL_IB_HCA".into(), "mlx5".into()),
            (POLICY_CONFIG_KEY.into(), policy.into()),
        ])
    }

    #[test]
    fn takes_typed_values_and_defaults_missing_ones() {
        let c = config(" qps-per-pair = 2 ,, name=x ");
        let mut o = c.options().unwrap();
        assert_eq!(o.take::<u32>("qps-per-pair").unwrap(), Some(2));
        assert_eq!(o.take::<String>("name").unwrap().as_deref(), Some("x"));
        assert_eq!(o.take::<u32>("absent").unwrap(), None);
        o.finish().unwrap();
        assert_eq!(c.get("NCCL_IB_HCA"), Some("mlx5"));
    }

    #[test]
    fn unset_config_is_empty() {
        let c = Config::new(vec![]);
        c.options().unwrap().finish().unwrap();
    }

    #[test]
    fn refuses_typos_bad_values_and_duplicates() {
        let c = config("qps-per-par=2");
        let mut o = c.options().unwrap();
        o.take::<u32>("qps-per-pair").unwrap();
        let e = o.finish().unwrap_err();
        assert!(
            e.contains("`qps-per-par`") && e.contains("known: qps-per-pair"),
            "{e}"
        );

        let c = config("qps-per-pair=two");
        let e = c
            .options()
            .unwrap()
            .take::<u32>("qps-per-pair")
            .unwrap_err();
        assert!(e.contains("qps-per-pair=two"), "{e}");

        assert!(Options::parse("a=1,a=2").unwrap_err().contains("twice"));
        assert!(Options::parse("flag").unwrap_err().contains("key=value"));
        let e = Options::parse("x=1").unwrap().finish().unwrap_err();
        assert!(e.contains("takes no settings"), "{e}");
    }
}
