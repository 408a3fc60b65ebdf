//! `NCCL_IB_*` variables, parsed once into an [`IbConfig`].
//!
//! Defaults are NCCL's (`NCCL_PARAM` defaults in `net_ib.cc`). Where NCCL quietly ignores a value
//! it cannot use (a malformed `NCCL_IB_ADDR_RANGE`, an unknown `NCCL_IB_ADDR_FAMILY`, `abc` read by
//! `strtoll` as 0, a misspelt HCA list), we refuse it with an error that names the variable, the
//! value and the rule: a silently ignored setting is how a job ends up on the wrong GID.
//! Integers are read as NCCL's `strtoll(…, 0)` does: decimal, `0x` hex, or octal after a
//! leading `0`.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use ncclwasm_model::name_list::{self, NameEntry, NameList};
use ncclwasm_model::{AddrFamily, Gid};

use crate::MAX_IB_DEVS;

/// A `NCCL_IB_*` value the built-in default refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value}: {problem}; fix it, or unset {name} for NCCL's default: {default}")]
pub struct ConfigError {
    /// The variable, e.g. `NCCL_IB_TIMEOUT`.
    pub name: String,
    /// The value as given.
    pub value: String,
    /// What is wrong with it, e.g. `must be 1..31`.
    pub problem: String,
    /// NCCL's default for the variable, for the message.
    pub default: &'static str,
}

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// NCCL's default: the variable was unset or empty.
    Default,
    /// The environment (or the pairs the host handed over).
    Environment,
}

/// One variable the built-in default reads, with its value and source, for the one-time log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub name: &'static str,
    pub value: String,
    pub source: Source,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Source::Default => "default",
            Source::Environment => "environment",
        };
        write!(f, "{}={} ({source})", self.name, self.value)
    }
}

/// One `NCCL_IB_HCA` entry: a device name (prefix unless the list is exact) and maybe a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaEntry {
    pub name: String,
    pub port: Option<u8>,
}

/// `NCCL_IB_HCA`: which devices and ports NCCL may use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HcaFilter {
    /// `^` at the start: the entries are excluded, everything else is used.
    pub exclude: bool,
    /// `=` (after any `^`): names match exactly instead of by prefix.
    pub exact: bool,
    /// Empty: no filter.
    pub entries: Vec<HcaEntry>,
}

impl HcaFilter {
    /// Parses a list as `parseStringList` after `ncclIbInit` has taken off the leading `^` and
    /// `=`. Unlike NCCL, refuses empty lists after `^`/`=` (NCCL would exclude everything),
    /// entries without a name, non-numeric or zero ports, extra `:` fields, whitespace inside
    /// names (NCCL keeps it, so the entry matches nothing), misplaced `^`/`=`, and more than
    /// [`MAX_IB_DEVS`] entries (NCCL drops the rest).
    fn parse(raw: &str) -> Result<HcaFilter, String> {
        let list = NameList::parse(raw, "device")?;
        let (exclude, exact) = (list.exclude, list.exact);
        let mut entries = Vec::new();
        for NameEntry { name, port } in list.entries {
            let port = match port {
                None => None,
                Some(p) => match p.parse::<u8>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => {
                        return Err(format!(
                            "entry \"{name}:{p}\": the port after ':' must be a number 1..255 (write name or name:port)"
                        ));
                    }
                },
            };
            entries.push(HcaEntry { name, port });
        }
        if entries.is_empty() && (exclude || exact) {
            return Err(if exclude {
                "the device list after '^' is empty (NCCL would then exclude every device)".into()
            } else {
                "the device list after '=' is empty (NCCL would then use every device)".into()
            });
        }
        if entries.len() > MAX_IB_DEVS {
            return Err(format!(
                "{} entries; NCCL reads at most {MAX_IB_DEVS} and silently drops the rest",
                entries.len()
            ));
        }
        Ok(HcaFilter {
            exclude,
            exact,
            entries,
        })
    }

    /// Whether a port passes the filter: an entry matches when its name equals the device name
    /// (exact lists) or is a prefix of it (so `mlx5_1` also matches `mlx5_10`), and its port, if
    /// given, is the port; an exclude list inverts the result; as `matchIfList` in `ncclIbInit`.
    pub fn admits(&self, device: &str, port: u8) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let listed = self.entries.iter().any(|e| {
            name_list::matches(self.exact, &e.name, device) && e.port.is_none_or(|p| p == port)
        });
        listed != self.exclude
    }
}

/// `NCCL_IB_ADDR_RANGE`: the subnet RoCE GIDs must be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrRange {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl AddrRange {
    /// Whether `gid` lies in the range: for an IPv4 range the last four GID bytes are compared
    /// (whatever the GID's family), for IPv6 the leading bits; as `matchGidAddrPrefix`.
    pub fn contains(&self, gid: &Gid) -> bool {
        let (want, have): (&[u8], &[u8]) = match &self.addr {
            IpAddr::V4(v4) => (&v4.octets(), &gid.raw[12..]),
            IpAddr::V6(v6) => (&v6.octets(), &gid.raw[..]),
        };
        let bits = usize::from(self.prefix_len);
        let full = bits / 8;
        if want[..full] != have[..full] {
            return false;
        }
        let rem = bits % 8;
        rem == 0 || {
            let mask = 0xffu8 << (8 - rem);
            want[full] & mask == have[full] & mask
        }
    }
}

impl fmt::Display for AddrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// Everything the built-in default reads from `NCCL_IB_*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbConfig {
    /// `NCCL_IB_HCA` (default: no filter).
    pub hca: HcaFilter,
    /// `NCCL_IB_GID_INDEX` (default -1: `None`, automatic selection on RoCE).
    pub gid_index: Option<u32>,
    /// `NCCL_IB_ADDR_FAMILY` (`AF_INET`, the default, or `AF_INET6`).
    pub addr_family: AddrFamily,
    /// `NCCL_IB_ADDR_RANGE` (default: none).
    pub addr_range: Option<AddrRange>,
    /// `NCCL_IB_ROCE_VERSION_NUM` (default 2).
    pub roce_version: u8,
    /// `NCCL_IB_ROUTABLE_FLID_GID_INDEX` (default 1).
    pub routable_flid_gid_index: u32,
    /// `NCCL_IB_MERGE_NICS` (default 1).
    pub merge_nics: bool,
    /// `NCCL_IB_QPS_PER_CONNECTION` (default 1).
    pub qps_per_connection: u32,
    /// `NCCL_IB_SPLIT_DATA_ON_QPS` (default 0).
    pub split_data_on_qps: bool,
    /// `NCCL_IB_ADAPTIVE_ROUTING` (default -2: `None`, on for IB and off for RoCE).
    pub adaptive_routing: Option<bool>,
    /// `NCCL_IB_AR_THRESHOLD` in bytes (default 8192).
    pub ar_threshold: u64,
    /// `NCCL_IB_TC` (default -1: `None`, the communicator's traffic class or 0).
    pub tc: Option<u8>,
    /// `NCCL_IB_SL` (default -1: `None`, the communicator's traffic class or 0).
    pub sl: Option<u8>,
    /// `NCCL_IB_FIFO_TC` (default -1: `None`, the data TC).
    pub fifo_tc: Option<u8>,
    /// `NCCL_IB_ECE_ENABLE` (default 1).
    pub ece: bool,
    /// `NCCL_IB_TIMEOUT` (default 20).
    pub timeout: u8,
    /// `NCCL_IB_RETRY_CNT` (default 7).
    pub retry_cnt: u8,
    /// `NCCL_IB_RESILIENCY_PORT_FAILOVER` (NCCL 2.30, default 0): when a port of a connection's
    /// vNIC fails, carry its traffic over the surviving ports instead of failing the connection.
    pub port_failover: bool,
    /// `NCCL_IB_RESILIENCY_PORT_RECOVERY` (NCCL 2.30, default 0): when a failed port comes back,
    /// use it again.
    pub port_recovery: bool,
    sources: Vec<Setting>,
    ignored: Vec<(String, String)>,
}

/// The variables [`IbConfig`] reads, with NCCL's defaults as NCCL would print them.
const KNOWN: [(&str, &str); 19] = [
    ("NCCL_IB_HCA", "(unset: every port)"),
    ("NCCL_IB_GID_INDEX", "-1"),
    ("NCCL_IB_ADDR_FAMILY", "AF_INET"),
    ("NCCL_IB_ADDR_RANGE", "(unset: any address)"),
    ("NCCL_IB_ROCE_VERSION_NUM", "2"),
    ("NCCL_IB_ROUTABLE_FLID_GID_INDEX", "1"),
    ("NCCL_IB_MERGE_NICS", "1"),
    ("NCCL_IB_QPS_PER_CONNECTION", "1"),
    ("NCCL_IB_SPLIT_DATA_ON_QPS", "0"),
    ("NCCL_IB_ADAPTIVE_ROUTING", "-2"),
    ("NCCL_IB_AR_THRESHOLD", "8192"),
    ("NCCL_IB_TC", "-1"),
    ("NCCL_IB_SL", "-1"),
    ("NCCL_IB_FIFO_TC", "-1"),
    ("NCCL_IB_ECE_ENABLE", "1"),
    ("NCCL_IB_TIMEOUT", "20"),
    ("NCCL_IB_RETRY_CNT", "7"),
    ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "0"),
    ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "0"),
];

impl Default for IbConfig {
    /// NCCL's defaults, every setting sourced `Default`.
    fn default() -> IbConfig {
        IbConfig {
            hca: HcaFilter::default(),
            gid_index: None,
            addr_family: AddrFamily::Ipv4,
            addr_range: None,
            roce_version: 2,
            routable_flid_gid_index: 1,
            merge_nics: true,
            qps_per_connection: 1,
            split_data_on_qps: false,
            adaptive_routing: None,
            ar_threshold: 8192,
            tc: None,
            sl: None,
            fifo_tc: None,
            ece: true,
            timeout: 20,
            retry_cnt: 7,
            port_failover: false,
            port_recovery: false,
            sources: KNOWN
                .iter()
                .map(|&(name, default)| Setting {
                    name,
                    value: default.to_owned(),
                    source: Source::Default,
                })
                .collect(),
            ignored: Vec::new(),
        }
    }
}

impl IbConfig {
    /// Reads the `NCCL_IB_*` pairs (as [`env_pairs`] collects them, or as handed to a policy's
    /// `init`). Other keys are skipped; `NCCL_IB_*` keys this crate does not use are kept in
    /// [`IbConfig::ignored`]; an empty value means unset (as NCCL), while a value of only spaces
    /// is refused; a later pair overrides an earlier one. `NCCL_IB_ADDR_RANGE` is read in the
    /// family `NCCL_IB_ADDR_FAMILY` names, wherever either appears.
    pub fn from_pairs(pairs: &[(String, String)]) -> Result<IbConfig, ConfigError> {
        let mut cfg = IbConfig::default();
        let mut given: Vec<(&'static str, &str)> = Vec::new();
        for (key, value) in pairs {
            if !key.starts_with("NCCL_IB_") || value.is_empty() {
                continue;
            }
            match KNOWN.iter().find(|(name, _)| name == key) {
                Some(&(name, _)) => {
                    given.retain(|(n, _)| *n != name);
                    given.push((name, value));
                }
                None => {
                    cfg.ignored.retain(|(k, _)| k != key);
                    cfg.ignored.push((key.clone(), value.clone()));
                }
            }
        }
        // The family first: the range is read in it.
        given.sort_by_key(|(name, _)| *name != "NCCL_IB_ADDR_FAMILY");
        for &(name, value) in &given {
            cfg.set(name, value)?;
            let setting = cfg
                .sources
                .iter_mut()
                .find(|s| s.name == name)
                .expect("every known name has a setting");
            setting.value = value.to_owned();
            setting.source = Source::Environment;
        }
        Ok(cfg)
    }

    /// Every variable the built-in default reads, with its value and source, in a fixed order:
    /// what the host logs once at start.
    pub fn sources(&self) -> &[Setting] {
        &self.sources
    }

    /// `NCCL_IB_*` pairs given but not read by the built-in default (the transport reads some of
    /// them itself, e.g. `NCCL_IB_PKEY`, `NCCL_IB_USE_INLINE`, `NCCL_IB_GDR_FLUSH_DISABLE`).
    pub fn ignored(&self) -> &[(String, String)] {
        &self.ignored
    }

    /// Whether `name` was set (non-empty) rather than defaulted.
    pub fn is_set(&self, name: &str) -> bool {
        self.sources
            .iter()
            .any(|s| s.name == name && s.source == Source::Environment)
    }

    fn set(&mut self, name: &'static str, value: &str) -> Result<(), ConfigError> {
        let default = KNOWN
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("", |(_, d)| d);
        let fail = |problem: String| ConfigError {
            name: name.to_owned(),
            value: value.to_owned(),
            problem,
            default,
        };
        let int = || parse_int(value).ok_or_else(|| fail("not an integer".into()));
        let ranged = |lo: i64, hi: i64, what: &str| {
            let v = int()?;
            if (lo..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(fail(format!("must be {what}")))
            }
        };
        let flag = || ranged(0, 1, "0 or 1").map(|v| v == 1);
        // -1 (or -2) is NCCL's own "not set" sentinel, so writing it explicitly is allowed.
        let optional = |hi: i64, what: &str| {
            let v = ranged(-1, hi, what)?;
            Ok::<_, ConfigError>((v >= 0).then_some(v))
        };
        match name {
            "NCCL_IB_HCA" => self.hca = HcaFilter::parse(value).map_err(fail)?,
            "NCCL_IB_GID_INDEX" => {
                let what = "-1 (automatic) or a GID index 0..=255";
                self.gid_index = optional(255, what)?.map(|v| v as u32);
            }
            "NCCL_IB_ADDR_FAMILY" => {
                self.addr_family = match value.trim() {
                    "AF_INET" => AddrFamily::Ipv4,
                    "AF_INET6" => AddrFamily::Ipv6,
                    _ => {
                        return Err(fail(
                            "must be AF_INET or AF_INET6 (NCCL would silently use AF_INET)".into(),
                        ));
                    }
                }
            }
            "NCCL_IB_ADDR_RANGE" => {
                self.addr_range = Some(parse_range(value.trim(), self.addr_family).map_err(fail)?)
            }
            "NCCL_IB_ROCE_VERSION_NUM" => self.roce_version = ranged(1, 2, "1 or 2")? as u8,
            "NCCL_IB_ROUTABLE_FLID_GID_INDEX" => {
                self.routable_flid_gid_index = ranged(0, 255, "a GID index 0..=255")? as u32
            }
            "NCCL_IB_MERGE_NICS" => self.merge_nics = flag()?,
            "NCCL_IB_QPS_PER_CONNECTION" => {
                self.qps_per_connection =
                    ranged(1, 128, "1..128 (NCCL allows 128 QPs per connection)")? as u32
            }
            "NCCL_IB_SPLIT_DATA_ON_QPS" => self.split_data_on_qps = flag()?,
            "NCCL_IB_ADAPTIVE_ROUTING" => {
                self.adaptive_routing = match int()? {
                    -2 => None,
                    0 => Some(false),
                    1 => Some(true),
                    _ => return Err(fail("must be 0, 1 or -2 (by link layer)".into())),
                }
            }
            "NCCL_IB_AR_THRESHOLD" => {
                self.ar_threshold = ranged(0, i64::MAX, "a byte count >= 0")? as u64
            }
            "NCCL_IB_TC" => self.tc = optional(255, "-1 (unset) or 0..255")?.map(|v| v as u8),
            "NCCL_IB_SL" => self.sl = optional(15, "-1 (unset) or 0..15")?.map(|v| v as u8),
            "NCCL_IB_FIFO_TC" => {
                self.fifo_tc = optional(255, "-1 (unset) or 0..255")?.map(|v| v as u8)
            }
            "NCCL_IB_ECE_ENABLE" => self.ece = flag()?,
            "NCCL_IB_TIMEOUT" => self.timeout = ranged(1, 31, "1..31")? as u8,
            "NCCL_IB_RETRY_CNT" => self.retry_cnt = ranged(0, 7, "0..7")? as u8,
            "NCCL_IB_RESILIENCY_PORT_FAILOVER" => self.port_failover = flag()?,
            "NCCL_IB_RESILIENCY_PORT_RECOVERY" => self.port_recovery = flag()?,
            _ => unreachable!("only names from KNOWN are set"),
        }
        Ok(())
    }
}

/// Reads an integer as `strtoll(text, NULL, 0)` would, but only when the whole text is the
/// number: `20`, `-1`, `0x14`, `024` (octal) are 20/-1/20/20; `abc` and `20x` are refused.
fn parse_int(text: &str) -> Option<i64> {
    let t = text.trim();
    let (negative, digits) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let (radix, digits) = if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        (16, hex)
    } else if digits.len() > 1 && digits.starts_with('0') {
        (8, &digits[1..])
    } else {
        (10, digits)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = i64::from_str_radix(digits, radix).ok()?;
    Some(if negative { -magnitude } else { magnitude })
}

/// `address/bits` in `family`, as `envIbAddrRange` reads it; the cases NCCL ignores with an
/// INFO line (no `/`, an address of the other family, a bad or too long mask) are errors here.
fn parse_range(text: &str, family: AddrFamily) -> Result<AddrRange, String> {
    let (addr, bits) = text.split_once('/').ok_or_else(|| {
        "must be address/prefix-length, e.g. 10.0.0.0/16 (NCCL would ignore it)".to_owned()
    })?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not an IP address (NCCL would ignore the range)"))?;
    let (max, fam) = match family {
        AddrFamily::Ipv4 => (32, "AF_INET"),
        AddrFamily::Ipv6 => (128, "AF_INET6"),
    };
    if addr.is_ipv4() != (family == AddrFamily::Ipv4) {
        return Err(format!(
            "{addr} is not an {fam} address and NCCL_IB_ADDR_FAMILY is {fam} (NCCL would ignore the range); set NCCL_IB_ADDR_FAMILY to match"
        ));
    }
    let prefix_len = bits
        .parse::<u8>()
        .ok()
        .filter(|&b| u32::from(b) <= max)
        .ok_or_else(|| format!("the prefix length {bits:?} must be 0..{max} for {fam}"))?;
    Ok(AddrRange { addr, prefix_len })
}

/// The `NCCL_IB_*` variables of this process, sorted by name: what the host reads into an
/// [`IbConfig`] and hands, unchanged, to a wasm policy's `init`. A value that is not UTF-8 is
/// passed on with replacement characters, so parsing refuses it loudly rather than dropping it.
pub fn env_pairs() -> Vec<(String, String)> {
    let pairs: BTreeSet<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            k.starts_with("NCCL_IB_")
                .then(|| (k, v.to_string_lossy().into_owned()))
        })
        .collect();
    pairs.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{cfg, owned};

    fn refused(name: &str, value: &str) -> String {
        match IbConfig::from_pairs(&owned(&[(name, value)])) {
            Ok(_) => panic!("{name}={value} was accepted"),
            Err(e) => {
                assert_eq!((e.name.as_str(), e.value.as_str()), (name, value));
                e.to_string()
            }
        }
    }

    #[test]
    fn defaults_are_nccls() {
        let c = IbConfig::from_pairs(&[]).unwrap();
        assert_eq!(c, IbConfig::default());
        assert!(c.hca.entries.is_empty());
        assert_eq!(
            (c.gid_index, c.addr_family, c.addr_range),
            (None, AddrFamily::Ipv4, None)
        );
        assert_eq!((c.roce_version, c.routable_flid_gid_index), (2, 1));
        assert!(c.merge_nics && !c.split_data_on_qps && c.ece);
        assert_eq!(
            (c.qps_per_connection, c.adaptive_routing, c.ar_threshold),
            (1, None, 8192)
        );
        assert_eq!((c.tc, c.sl, c.fifo_tc), (None, None, None));
        assert_eq!((c.timeout, c.retry_cnt), (20, 7));
        assert!(!c.port_failover && !c.port_recovery);
        assert_eq!(c.sources().len(), 19);
        assert!(c.sources().iter().all(|s| s.source == Source::Default));
    }

    #[test]
    fn values_and_sources() {
        let c = cfg(&[
            ("NCCL_IB_TIMEOUT", "0x16"),
            ("NCCL_IB_RETRY_CNT", " 5 "),
            ("NCCL_IB_TC", "106"),
            ("NCCL_IB_SL", "-1"),
            ("NCCL_IB_QPS_PER_CONNECTION", "4"),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", "1"),
            ("NCCL_IB_ADAPTIVE_ROUTING", "0"),
            ("NCCL_IB_AR_THRESHOLD", "65536"),
            ("NCCL_IB_ECE_ENABLE", "0"),
            ("NCCL_IB_MERGE_NICS", "0"),
            ("NCCL_IB_GID_INDEX", "3"),
            ("NCCL_IB_ROCE_VERSION_NUM", "1"),
            ("NCCL_IB_ROUTABLE_FLID_GID_INDEX", "2"),
            ("NCCL_IB_FIFO_TC", "010"),
        ]);
        assert_eq!(
            (c.timeout, c.retry_cnt, c.tc, c.sl),
            (22, 5, Some(106), None)
        );
        assert_eq!((c.qps_per_connection, c.split_data_on_qps), (4, true));
        assert_eq!(
            (c.adaptive_routing, c.ar_threshold, c.ece, c.merge_nics),
            (Some(false), 65536, false, false)
        );
        assert_eq!(
            (c.gid_index, c.roce_version, c.routable_flid_gid_index),
            (Some(3), 1, 2)
        );
        assert_eq!(
            c.fifo_tc,
            Some(8),
            "a leading 0 is octal, as strtoll reads it"
        );
        let timeout = c
            .sources()
            .iter()
            .find(|s| s.name == "NCCL_IB_TIMEOUT")
            .unwrap();
        assert_eq!(timeout.to_string(), "NCCL_IB_TIMEOUT=0x16 (environment)");
        let hca = c
            .sources()
            .iter()
            .find(|s| s.name == "NCCL_IB_HCA")
            .unwrap();
        assert_eq!(hca.to_string(), "NCCL_IB_HCA=(unset: every port) (default)");
        assert!(c.is_set("NCCL_IB_SL") && !c.is_set("NCCL_IB_HCA"));
    }

    #[test]
    fn empty_values_unset_later_pairs_win_and_unknown_keys_are_kept() {
        let c = cfg(&[
            ("NCCL_IB_TIMEOUT", "12"),
            ("NCCL_IB_TIMEOUT", "14"),
            ("NCCL_IB_TC", ""),
            ("NCCL_IB_PKEY", "1"),
            ("NCCL_IB_FUTURE_KNOB", "x"),
            ("NCCL_WASM_POLICY_CONFIG", "whatever"),
            ("NCCL_DEBUG", "INFO"),
        ]);
        assert_eq!((c.timeout, c.tc), (14, None));
        assert!(!c.is_set("NCCL_IB_TC"));
        assert_eq!(
            c.ignored(),
            &owned(&[("NCCL_IB_PKEY", "1"), ("NCCL_IB_FUTURE_KNOB", "x")])[..]
        );
    }

    #[test]
    fn out_of_range_values_are_refused_with_variable_value_and_rule() {
        assert_eq!(
            refused("NCCL_IB_TIMEOUT", "40"),
            "NCCL_IB_TIMEOUT=40: must be 1..31; fix it, or unset NCCL_IB_TIMEOUT for NCCL's default: 20"
        );
        let cases = [
            ("NCCL_IB_TIMEOUT", "0", "must be 1..31"),
            ("NCCL_IB_RETRY_CNT", "8", "must be 0..7"),
            ("NCCL_IB_SL", "16", "must be -1 (unset) or 0..15"),
            ("NCCL_IB_TC", "256", "must be -1 (unset) or 0..255"),
            ("NCCL_IB_FIFO_TC", "-2", "must be -1 (unset) or 0..255"),
            ("NCCL_IB_GID_INDEX", "-3", "must be -1 (automatic)"),
            ("NCCL_IB_ROCE_VERSION_NUM", "3", "must be 1 or 2"),
            ("NCCL_IB_QPS_PER_CONNECTION", "0", "must be 1..128"),
            ("NCCL_IB_QPS_PER_CONNECTION", "129", "must be 1..128"),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", "2", "must be 0 or 1"),
            ("NCCL_IB_MERGE_NICS", "yes", "not an integer"),
            ("NCCL_IB_ADAPTIVE_ROUTING", "2", "must be 0, 1 or -2"),
            ("NCCL_IB_AR_THRESHOLD", "-1", "must be a byte count"),
            ("NCCL_IB_ECE_ENABLE", "1x", "not an integer"),
            ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "2", "must be 0 or 1"),
            ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "on", "not an integer"),
            (
                "NCCL_IB_ROUTABLE_FLID_GID_INDEX",
                "-1",
                "must be a GID index",
            ),
            ("NCCL_IB_TIMEOUT", "abc", "not an integer"),
            ("NCCL_IB_TIMEOUT", "09", "not an integer"),
            ("NCCL_IB_TIMEOUT", " ", "not an integer"),
        ];
        for (name, value, why) in cases {
            let e = refused(name, value);
            assert!(e.starts_with(&format!("{name}={value}: {why}")), "{e}");
        }
    }

    #[test]
    fn address_family_and_range() {
        let c = cfg(&[("NCCL_IB_ADDR_RANGE", "10.0.0.0/16")]);
        assert_eq!(c.addr_range.unwrap().to_string(), "10.0.0.0/16");
        // The range is read in the family, whichever pair comes first.
        let c = cfg(&[
            ("NCCL_IB_ADDR_RANGE", "fd00::/8"),
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
        ]);
        assert_eq!(
            (c.addr_family, c.addr_range.unwrap().prefix_len),
            (AddrFamily::Ipv6, 8)
        );
        assert!(refused("NCCL_IB_ADDR_FAMILY", "inet6").contains("must be AF_INET or AF_INET6"));
        let e = refused("NCCL_IB_ADDR_RANGE", "10.0.0.0");
        assert!(
            e.contains("must be address/prefix-length") && e.contains("NCCL would ignore it"),
            "{e}"
        );
        assert!(refused("NCCL_IB_ADDR_RANGE", "fd00::/8").contains("not an AF_INET address"));
        assert!(refused("NCCL_IB_ADDR_RANGE", "10.0.0.0/33").contains("must be 0..32"));
        assert!(refused("NCCL_IB_ADDR_RANGE", "10.0.0.0/x").contains("must be 0..32"));
        assert!(refused("NCCL_IB_ADDR_RANGE", "10.0.0/8").contains("not an IP address"));
    }

    #[test]
    fn range_matching_follows_match_gid_addr_prefix() {
        use ncclwasm_model::{Gid, GidType};
        let gid = |t: &str| Gid::new(0, t.parse().unwrap(), GidType::RoceV2, 0);
        let v4 = |r: &str| parse_range(r, AddrFamily::Ipv4).unwrap();
        let v6 = |r: &str| parse_range(r, AddrFamily::Ipv6).unwrap();
        assert!(v4("10.1.0.0/16").contains(&gid("::ffff:10.1.2.3")));
        assert!(!v4("10.1.0.0/16").contains(&gid("::ffff:10.2.2.3")));
        assert!(v4("10.1.2.3/32").contains(&gid("::ffff:10.1.2.3")));
        assert!(v4("10.0.0.0/0").contains(&gid("fe80::1")));
        assert!(v4("192.168.0.0/17").contains(&gid("::ffff:192.168.127.1")));
        assert!(!v4("192.168.0.0/17").contains(&gid("::ffff:192.168.128.1")));
        assert!(v6("fd00:1::/32").contains(&gid("fd00:1::5")));
        assert!(!v6("fd00:1::/32").contains(&gid("fd00:2::5")));
        assert!(v6("fd00:1:8000::/33").contains(&gid("fd00:1:8000::1")));
        assert!(!v6("fd00:1:8000::/33").contains(&gid("fd00:1:7fff::1")));
    }

    #[test]
    fn hca_lists() {
        let h = |v: &str| cfg(&[("NCCL_IB_HCA", v)]).hca;
        let f = h("mlx5_1,mlx5_2:1");
        assert!(!f.exclude && !f.exact);
        assert_eq!(
            f.entries,
            vec![
                HcaEntry {
                    name: "mlx5_1".into(),
                    port: None
                },
                HcaEntry {
                    name: "mlx5_2".into(),
                    port: Some(1)
                },
            ]
        );
        assert!(
            f.admits("mlx5_1", 1) && f.admits("mlx5_10", 1),
            "prefix match, as NCCL"
        );
        assert!(f.admits("mlx5_2", 1) && !f.admits("mlx5_2", 2) && !f.admits("mlx5_3", 1));
        let exact = h("=mlx5_1");
        assert!(exact.exact && exact.admits("mlx5_1", 1) && !exact.admits("mlx5_10", 1));
        let not = h("^mlx5_1");
        assert!(
            not.exclude
                && !not.admits("mlx5_1", 1)
                && !not.admits("mlx5_10", 1)
                && not.admits("mlx5_2", 1)
        );
        let not_exact = h("^=mlx5_1:2");
        assert!(
            not_exact.admits("mlx5_10", 2)
                && not_exact.admits("mlx5_1", 1)
                && !not_exact.admits("mlx5_1", 2)
        );
        assert_eq!(
            h("mlx5_0,,mlx5_1,").entries.len(),
            2,
            "empty entries are skipped, as NCCL"
        );
        for (value, why) in [
            (
                "^",
                "list after '^' is empty (NCCL would then exclude every device)",
            ),
            ("^=", "list after '^' is empty"),
            (
                "=",
                "list after '=' is empty (NCCL would then use every device)",
            ),
            (" mlx5_0", "contains whitespace"),
            (":1", "has no device name"),
            ("mlx5_0, mlx5_1", "contains whitespace"),
            ("=^mlx5_0", "only recognised once, at the start"),
            ("mlx5_0,^mlx5_1", "only recognised once, at the start"),
            ("mlx5_0:x", "the port after ':' must be a number 1..255"),
            ("mlx5_0:0", "the port after ':' must be a number 1..255"),
            ("mlx5_0:1:2", "the port after ':' must be a number 1..255"),
        ] {
            let e = refused("NCCL_IB_HCA", value);
            assert!(e.contains(why), "{value}: {e}");
        }
        let many = (0..33)
            .map(|i| format!("mlx5_{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(refused("NCCL_IB_HCA", &many).contains("at most 32"));
    }

    #[test]
    fn integers_read_like_strtoll_base_0() {
        assert_eq!(parse_int("20"), Some(20));
        assert_eq!(parse_int("-1"), Some(-1));
        assert_eq!(parse_int("+7"), Some(7));
        assert_eq!(parse_int("0x1F"), Some(31));
        assert_eq!(parse_int("017"), Some(15));
        assert_eq!(parse_int("0"), Some(0));
        for bad in [
            "",
            "-",
            "0x",
            "1.5",
            "1e3",
            "twenty",
            "99999999999999999999",
        ] {
            assert_eq!(parse_int(bad), None, "{bad}");
        }
    }

    #[test]
    fn env_pairs_collects_only_nccl_ib_variables() {
        // The test process may carry NCCL_* settings of its own; only the prefix is checked.
        assert!(env_pairs().iter().all(|(k, _)| k.starts_with("NCCL_IB_")));
        let pairs = env_pairs();
        let mut sorted = pairs.clone();
        sorted.sort();
        assert_eq!(pairs, sorted);
    }
}
