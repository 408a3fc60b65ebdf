//! `NCCL_IB_*` variables, parsed once into an [`IbConfig`].
//!
//! Defaults are NCCL's (`NCCL_PARAM` defaults of NCCL 2.30's `net_ib`). A value NCCL accepts is
//! accepted and read as NCCL reads it — a malformed `NCCL_IB_ADDR_RANGE` or an unknown
//! `NCCL_IB_ADDR_FAMILY` ignored, a negative `NCCL_IB_GID_INDEX` taken as automatic, `20x` read
//! by `strtoll` as 20, an `NCCL_IB_HCA` entry with a space kept as a name that matches nothing —
//! so a job that ran on NCCL's own IB transport runs the same on this plugin; but where NCCL
//! is silent, each such reading is a [`ConfigWarning`] naming the variable and what was done,
//! which the host WARNs and `ncclwasm doctor` shows. With `NCCL_WASM_STRICT_CONFIG=1` the first
//! warning is an error instead, for operators who want a misspelt setting to stop the job. What
//! stays refused are values this plugin cannot carry out (out-of-range QP attributes, which NCCL
//! would hand to the NIC and fail on at connect time).
//! Integers are read as NCCL's `strtoll(…, 0)` does: decimal, `0x` hex, or octal after a
//! leading `0`, up to the first character that is none of those.

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

/// A `NCCL_IB_*` value NCCL accepts but reads other than its author probably meant: the
/// built-in default does what NCCL does and says so.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value}: {problem}; {action}")]
pub struct ConfigWarning {
    /// The variable, e.g. `NCCL_IB_ADDR_RANGE`.
    pub name: String,
    /// The value as given.
    pub value: String,
    /// What NCCL makes of it, e.g. `not address/prefix-length`.
    pub problem: String,
    /// What was done, e.g. `ignored, as NCCL does: every address is in range`.
    pub action: String,
}

/// The warning for an `NCCL_IB_*` name NCCL does not read: NCCL ignores it silently.
fn unknown_variable(name: &str, value: &str) -> ConfigWarning {
    let problem = match ncclwasm_model::spelling::closest(name, NCCL_IB_VARIABLES) {
        Some(meant) => format!("not a variable NCCL reads (did you mean {meant}?)"),
        None => "not a variable NCCL reads".to_owned(),
    };
    ConfigWarning {
        name: name.to_owned(),
        value: value.to_owned(),
        problem,
        action: "ignored, as NCCL ignores it".to_owned(),
    }
}

/// `NCCL_WASM_STRICT_CONFIG=1`: refuse every value [`IbConfig`] would otherwise accept with a
/// [`ConfigWarning`]. Read from the same pairs (so a wasm policy's `init` sees it too).
pub const STRICT_CONFIG: &str = "NCCL_WASM_STRICT_CONFIG";

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

/// Rail and plane of an `NCCL_IB_HCA` entry that gives none (`NCCL_NET_ID_UNDEF`).
pub const NET_ID_UNDEF: i16 = -1;

/// One `NCCL_IB_HCA` entry, NCCL 2.30's `<hca>:<port>:<rail>:<plane>`: a device name (prefix
/// unless the list is exact), and the numbers NCCL reads with `atoi` after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaEntry {
    pub name: String,
    /// `None`: any port (the field absent, empty or -1). `Some(0)`, a negative or too large
    /// number (what `atoi` makes of `x`, `-5`, `300`) matches no port, as in NCCL.
    pub port: Option<i32>,
    /// The rail of the devices this entry selects ([`NET_ID_UNDEF`] when not given); NCCL 2.30
    /// reports it as the device's `railId`.
    pub rail: i16,
    /// The plane, likewise (`planeId`).
    pub plane: i16,
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
    /// Reads a list as `parseStringList` after `ncclInitDevices` has taken off the leading `^`
    /// and `=`, keeping what NCCL keeps; the second value says, one line each, what NCCL reads
    /// other than its author probably meant: entries without a name (dropped), whitespace or a
    /// misplaced `^`/`=` in a name (kept: it matches nothing), fields that `atoi` does not read
    /// as the number written, names longer than the 63 bytes NCCL keeps (cut), more than
    /// [`MAX_IB_DEVS`] entries (the rest dropped), and an empty list after `^` (every device
    /// excluded) or `=` (no filter).
    fn read(raw: &str) -> (HcaFilter, Vec<String>) {
        let (list, mut notes) = NameList::read(raw, "device");
        let (exclude, exact) = (list.exclude, list.exact);
        let mut entries = Vec::new();
        for NameEntry {
            mut name,
            port,
            rail,
            plane,
        } in list.entries
        {
            if name.len() > MAX_NAME {
                let cut = name.floor_char_boundary(MAX_NAME);
                notes.push(format!(
                    "entry {name:?} is longer than the {MAX_NAME} bytes NCCL keeps of a name; cut to {:?}",
                    &name[..cut]
                ));
                name.truncate(cut);
            }
            let mut number = |field: &str, text: Option<String>| -> i32 {
                let Some(text) = text else { return -1 };
                let n = atoi(&text);
                if text.trim() != n.to_string() {
                    notes.push(format!(
                        "entry {name:?}: the {field} field {text:?} is read by atoi as {n}, as NCCL does"
                    ));
                }
                n
            };
            let port = number("port", port);
            let rail = number("rail", rail) as i16;
            let plane = number("plane", plane) as i16;
            if port == 0 || port < -1 || port > i32::from(u8::MAX) {
                notes.push(format!(
                    "entry {name:?}: port {port} is no port number (1..255), so the entry matches no port"
                ));
            }
            entries.push(HcaEntry {
                name,
                port: (port != -1).then_some(port),
                rail,
                plane,
            });
        }
        if entries.len() > MAX_IB_DEVS {
            notes.push(format!(
                "{} entries; NCCL reads the first {MAX_IB_DEVS} and drops the rest",
                entries.len()
            ));
            entries.truncate(MAX_IB_DEVS);
        }
        if entries.is_empty() && exclude {
            notes.push(
                "the device list after '^' is empty, so every device is excluded and NCCL's IB transport has no device".into(),
            );
        } else if entries.is_empty() && exact {
            notes.push("the device list after '=' is empty, so every device is used".into());
        }
        (
            HcaFilter {
                exclude,
                exact,
                entries,
            },
            notes,
        )
    }

    /// Whether a port passes the filter: an entry matches when its name equals the device name
    /// (exact lists) or is a prefix of it (so `mlx5_1` also matches `mlx5_10`), and its port, if
    /// given, is the port; an exclude list inverts the result (an empty one excludes every
    /// port); as `matchIfList` in `ncclIbInitDevices`.
    pub fn admits(&self, device: &str, port: u8) -> bool {
        let listed = self.entries.is_empty() || self.entry_for(device, port).is_some();
        listed != self.exclude
    }

    /// The first entry that matches the port (`matchIfList`'s `ifId`): where NCCL 2.30 takes the
    /// device's rail and plane from; `None` when none matches (so for every port an exclude list
    /// admits).
    pub fn entry_for(&self, device: &str, port: u8) -> Option<&HcaEntry> {
        self.entries.iter().find(|e| {
            name_list::matches(self.exact, &e.name, device)
                && e.port.is_none_or(|p| p == i32::from(port))
        })
    }
}

/// `NCCL_IB_ADDR_RANGE`: the subnet RoCE GIDs must be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrRange {
    pub addr: IpAddr,
    /// At most the address's length. Negative when the text said so (`10.0.0.0/-8`): NCCL
    /// keeps such a mask, and no GID is then in the range.
    pub prefix_len: i32,
}

impl AddrRange {
    /// Whether `gid` lies in the range: for an IPv4 range the last four GID bytes are compared
    /// (whatever the GID's family), for IPv6 the leading bits; a negative prefix length matches
    /// nothing; as `matchGidAddrPrefix`.
    pub fn contains(&self, gid: &Gid) -> bool {
        let (want, have): (&[u8], &[u8]) = match &self.addr {
            IpAddr::V4(v4) => (&v4.octets(), &gid.raw[12..]),
            IpAddr::V6(v6) => (&v6.octets(), &gid.raw[..]),
        };
        let Ok(bits) = usize::try_from(self.prefix_len) else {
            return false;
        };
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
    /// `NCCL_IB_GID_INDEX` (default -1: `None`, automatic selection on RoCE; so is any
    /// negative value, as NCCL reads it).
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
    /// `NCCL_IB_DEVICE_PCI_ORDER` (NCCL 2.30, default 1): order the devices by PCI address
    /// rather than as discovery found them, so every node of a job numbers them alike.
    pub device_pci_order: bool,
    sources: Vec<Setting>,
    ignored: Vec<(String, String)>,
    warnings: Vec<ConfigWarning>,
}

/// The variables [`IbConfig`] reads, with NCCL's defaults as NCCL would print them.
const KNOWN: [(&str, &str); 20] = [
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
    ("NCCL_IB_DEVICE_PCI_ORDER", "1"),
];

/// Every `NCCL_IB_*` variable NCCL 2.30 reads (its IB transport and core): a name outside
/// this list is no setting at all, most likely a misspelt one, and gets a [`ConfigWarning`]
/// naming the closest of these.
pub const NCCL_IB_VARIABLES: &[&str] = &[
    "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_IB_ADDR_FAMILY",
    "NCCL_IB_ADDR_RANGE",
    "NCCL_IB_AR_THRESHOLD",
    "NCCL_IB_DATA_DIRECT",
    "NCCL_IB_DEVICE_PCI_ORDER",
    "NCCL_IB_DISABLE",
    "NCCL_IB_ECE_ENABLE",
    "NCCL_IB_FIFO_TC",
    "NCCL_IB_GDR_FLUSH_DISABLE",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_HCA",
    "NCCL_IB_MERGE_NICS",
    "NCCL_IB_MERGE_VFS",
    "NCCL_IB_MQP_RETRY_ALL",
    "NCCL_IB_MQP_RETRY_CNT",
    "NCCL_IB_MQP_RETRY_SLEEP_MSEC",
    "NCCL_IB_OOO_RQ",
    "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_IB_PKEY",
    "NCCL_IB_PREPOST_RECEIVE_WORK_REQUESTS",
    "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_QUERY_PORT_SPEED",
    "NCCL_IB_RECEIVER_SIDE_MATCHING_SCHEME",
    "NCCL_IB_RESILIENCY_PORT_FAILOVER",
    "NCCL_IB_RESILIENCY_PORT_FAILOVER_MAX_ATTEMPTS",
    "NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ACK_TIMEOUT",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_INTERVAL",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_BATCH_SIZE",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_SEQUENCE_SIZE",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ALIVE_MSG_TIMEOUT",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_ATTEMPTS_MAX",
    "NCCL_IB_RESILIENCY_PORT_RECOVERY_START_DELAY",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_RETURN_ASYNC_EVENTS",
    "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_IB_ROUTABLE_FLID_GID_INDEX",
    "NCCL_IB_SL",
    "NCCL_IB_SPLIT_DATA_ON_QPS",
    "NCCL_IB_SUBNET_AWARE_ROUTING",
    "NCCL_IB_SUBNET_PREFIX_LEN",
    "NCCL_IB_TC",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_USE_INLINE",
    "NCCL_IB_WARN_RAIL_LOCAL",
];

/// The bytes of a name NCCL keeps (`netIf::prefix` is 64 bytes with the NUL).
const MAX_NAME: usize = 63;

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
            device_pci_order: true,
            sources: KNOWN
                .iter()
                .map(|&(name, default)| Setting {
                    name,
                    value: default.to_owned(),
                    source: Source::Default,
                })
                .collect(),
            ignored: Vec::new(),
            warnings: Vec::new(),
        }
    }
}

impl IbConfig {
    /// Reads the `NCCL_IB_*` pairs (as [`env_pairs`] collects them, or as handed to a policy's
    /// `init`). Other keys are skipped; `NCCL_IB_*` keys this crate does not use are kept in
    /// [`IbConfig::ignored`]; an empty value means unset (as NCCL); a later pair overrides an
    /// earlier one. `NCCL_IB_ADDR_RANGE` is read in the family `NCCL_IB_ADDR_FAMILY` names,
    /// wherever either appears. Values NCCL accepts but misreads are [`IbConfig::warnings`];
    /// with [`STRICT_CONFIG`]`=1` among the pairs, the first of them is the error instead.
    pub fn from_pairs(pairs: &[(String, String)]) -> Result<IbConfig, ConfigError> {
        let mut cfg = IbConfig::default();
        let mut given: Vec<(&'static str, &str)> = Vec::new();
        let strict = pairs
            .iter()
            .rev()
            .find(|(k, _)| k == STRICT_CONFIG)
            .is_some_and(|(_, v)| v.trim() == "1");
        for (key, value) in pairs {
            if !key.starts_with("NCCL_IB_") || value.is_empty() {
                continue;
            }
            match KNOWN.iter().find(|(name, _)| name == key) {
                Some(&(name, _)) => {
                    given.retain(|(n, _)| *n != name);
                    given.push((name, value));
                }
                None if NCCL_IB_VARIABLES.contains(&key.as_str()) => {
                    cfg.ignored.retain(|(k, _)| k != key);
                    cfg.ignored.push((key.clone(), value.clone()));
                }
                None => {
                    cfg.warnings.retain(|w| w.name != *key);
                    cfg.warnings.push(unknown_variable(key, value));
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
        match cfg.warnings.first() {
            Some(w) if strict => Err(ConfigError {
                name: w.name.clone(),
                value: w.value.clone(),
                problem: format!("{} ({STRICT_CONFIG}=1 refuses it)", w.problem),
                default: KNOWN
                    .iter()
                    .find(|(n, _)| *n == w.name)
                    .map_or("none, NCCL does not read it", |(_, d)| d),
            }),
            _ => Ok(cfg),
        }
    }

    /// Values accepted as NCCL accepts them, each with what was done: what the host WARNs once
    /// and `ncclwasm doctor` lists.
    pub fn warnings(&self) -> &[ConfigWarning] {
        &self.warnings
    }

    /// Every variable the built-in default reads, with its value and source, in a fixed order:
    /// what the host logs once at start.
    pub fn sources(&self) -> &[Setting] {
        &self.sources
    }

    /// `NCCL_IB_*` pairs NCCL reads but the built-in default does not (the transport reads some
    /// of them itself, e.g. `NCCL_IB_MERGE_VFS`, `NCCL_IB_GDR_FLUSH_DISABLE`). A name NCCL does
    /// not read at all is a [`ConfigWarning`] instead ([`NCCL_IB_VARIABLES`]).
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
        let parsed = parse_int(value);
        let int = || {
            parsed
                .map(|(v, _)| v)
                .ok_or_else(|| fail("beyond a 64-bit integer".into()))
        };
        // (problem, action) for what is accepted as NCCL accepts it.
        let mut notes: Vec<(String, String)> = Vec::new();
        let textual = matches!(
            name,
            "NCCL_IB_HCA" | "NCCL_IB_ADDR_FAMILY" | "NCCL_IB_ADDR_RANGE"
        );
        if let Some((v, false)) = parsed
            && !textual
        {
            notes.push((
                format!("not an integer; NCCL's strtoll reads it as {v}"),
                format!("{v} used, as NCCL does"),
            ));
        }
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
            "NCCL_IB_HCA" => {
                let (hca, hca_notes) = HcaFilter::read(value);
                self.hca = hca;
                notes.extend(
                    hca_notes
                        .into_iter()
                        .map(|n| (n, "read as NCCL reads it".to_owned())),
                );
            }
            "NCCL_IB_GID_INDEX" => {
                let v = int()?;
                if v > i64::from(i32::MAX) {
                    return Err(fail("is larger than any GID table".into()));
                }
                self.gid_index = u32::try_from(v).ok();
                if v < -1 {
                    notes.push((
                        "negative".into(),
                        "read as -1, automatic selection, as NCCL does (it forces only indices >= 0)"
                            .into(),
                    ));
                }
            }
            "NCCL_IB_ADDR_FAMILY" => {
                // Compared as NCCL's strcmp does: no trimming, no other spelling.
                self.addr_family = match value {
                    "AF_INET6" => AddrFamily::Ipv6,
                    "AF_INET" => AddrFamily::Ipv4,
                    _ => {
                        notes.push((
                            "is neither AF_INET nor AF_INET6".into(),
                            "AF_INET used, as NCCL does".into(),
                        ));
                        AddrFamily::Ipv4
                    }
                }
            }
            "NCCL_IB_ADDR_RANGE" => {
                let (range, problem) = parse_range(value, self.addr_family);
                self.addr_range = range;
                if let Some(problem) = problem {
                    let action = match range {
                        None => "ignored, as NCCL does: every address is in range".to_owned(),
                        Some(r) => format!("read as {r}, as NCCL does"),
                    };
                    notes.push((problem, action));
                }
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
            "NCCL_IB_DEVICE_PCI_ORDER" => self.device_pci_order = flag()?,
            _ => unreachable!("only names from KNOWN are set"),
        }
        self.warnings
            .extend(notes.into_iter().map(|(problem, action)| ConfigWarning {
                name: name.to_owned(),
                value: value.to_owned(),
                problem,
                action,
            }));
        Ok(())
    }
}

/// Reads an integer as `strtoll(text, NULL, 0)` does: leading whitespace and a sign, then `0x`
/// hex, octal after a leading `0`, or decimal, up to the first character that is none of those
/// (`20x` is 20, `abc` is 0). The flag says whether that was the whole text (trailing spaces
/// aside). `None` beyond 64 bits, where NCCL falls back to the default.
fn parse_int(text: &str) -> Option<(i64, bool)> {
    let t = text.trim_start();
    let (negative, rest) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let hex = rest
        .strip_prefix("0x")
        .or_else(|| rest.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()));
    let (radix, digits) = match hex {
        Some(h) => (16, h),
        None if rest.starts_with('0') => (8, rest),
        None => (10, rest),
    };
    let len = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    let magnitude = if len == 0 {
        0
    } else {
        i128::from(u64::from_str_radix(&digits[..len], radix).ok()?)
    };
    let v = i64::try_from(if negative { -magnitude } else { magnitude }).ok()?;
    let whole = len > 0 && digits[len..].trim_end().is_empty();
    Some((v, whole))
}

/// `atoi`, as NCCL reads the numeric fields of `NCCL_IB_HCA`: decimal, up to the first other
/// character, 0 when there is none; beyond 32 bits wraps as glibc's `(int)strtol` does.
fn atoi(text: &str) -> i32 {
    let t = text.trim_start();
    let (negative, rest) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let len = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let magnitude = rest[..len]
        .parse::<i64>()
        .unwrap_or(if len == 0 { 0 } else { i64::MAX });
    (if negative { -magnitude } else { magnitude }) as i32
}

/// `address/bits` in `family`, as `envIbAddrRange` reads it: no `/`, an address that is not of
/// `family`, or a mask longer than the family's give no range; the mask is `strtol`'s reading
/// (`x` is 0, every address; a negative one matches nothing). The second value says what NCCL
/// made of a value that is not a plain `address/bits`.
fn parse_range(text: &str, family: AddrFamily) -> (Option<AddrRange>, Option<String>) {
    let Some((addr, bits)) = text.split_once('/') else {
        return (
            None,
            Some("not address/prefix-length (e.g. 10.0.0.0/16)".to_owned()),
        );
    };
    let (max, fam) = match family {
        AddrFamily::Ipv4 => (32, "AF_INET"),
        AddrFamily::Ipv6 => (128, "AF_INET6"),
    };
    let parsed = match family {
        AddrFamily::Ipv4 => addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4),
        AddrFamily::Ipv6 => addr.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6),
    };
    let Some(addr) = parsed else {
        return (
            None,
            Some(format!(
                "{addr:?} is not an {fam} address (NCCL_IB_ADDR_FAMILY is {fam})"
            )),
        );
    };
    let prefix_len = atoi(bits);
    if prefix_len > max {
        return (
            None,
            Some(format!("the prefix length {prefix_len} exceeds {max}")),
        );
    }
    let problem = if bits.trim() != prefix_len.to_string() {
        Some(format!("the prefix length {bits:?} reads as {prefix_len}"))
    } else if prefix_len < 0 {
        Some("a negative prefix length matches no address".to_owned())
    } else {
        None
    };
    (Some(AddrRange { addr, prefix_len }), problem)
}

/// The `NCCL_IB_*` variables of this process (and [`STRICT_CONFIG`]), sorted by name: what the host reads into an
/// [`IbConfig`] and hands, unchanged, to a wasm policy's `init`. A value that is not UTF-8 is
/// passed on with replacement characters, so parsing refuses it loudly rather than dropping it.
pub fn env_pairs() -> Vec<(String, String)> {
    let pairs: BTreeSet<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            (k.starts_with("NCCL_IB_") || k == STRICT_CONFIG)
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
        assert!(c.device_pci_order);
        assert_eq!(c.sources().len(), 20);
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
    fn empty_values_unset_later_pairs_win_and_other_keys_are_kept_or_warned() {
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
        assert_eq!(c.ignored(), &owned(&[("NCCL_IB_PKEY", "1")])[..]);
        // A name NCCL does not read is a warning, not a setting.
        assert_eq!(c.warnings().len(), 1);
        assert_eq!(c.warnings()[0].name, "NCCL_IB_FUTURE_KNOB");
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
            ("NCCL_IB_ROCE_VERSION_NUM", "3", "must be 1 or 2"),
            ("NCCL_IB_QPS_PER_CONNECTION", "0", "must be 1..128"),
            ("NCCL_IB_QPS_PER_CONNECTION", "129", "must be 1..128"),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", "2", "must be 0 or 1"),
            ("NCCL_IB_MERGE_NICS", "2", "must be 0 or 1"),
            ("NCCL_IB_ADAPTIVE_ROUTING", "2", "must be 0, 1 or -2"),
            ("NCCL_IB_AR_THRESHOLD", "-1", "must be a byte count"),
            ("NCCL_IB_ECE_ENABLE", "2x", "must be 0 or 1"),
            ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "2", "must be 0 or 1"),
            ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "2", "must be 0 or 1"),
            (
                "NCCL_IB_ROUTABLE_FLID_GID_INDEX",
                "-1",
                "must be a GID index",
            ),
            ("NCCL_IB_TIMEOUT", "abc", "must be 1..31"),
            ("NCCL_IB_TIMEOUT", "09", "must be 1..31"),
            ("NCCL_IB_TIMEOUT", " ", "must be 1..31"),
            (
                "NCCL_IB_TIMEOUT",
                "99999999999999999999",
                "beyond a 64-bit integer",
            ),
            (
                "NCCL_IB_GID_INDEX",
                "4294967296",
                "is larger than any GID table",
            ),
        ];
        for (name, value, why) in cases {
            let e = refused(name, value);
            assert!(e.starts_with(&format!("{name}={value}: {why}")), "{e}");
        }
    }

    /// Issue 18, point 8: a name NCCL does not read is a warning naming the closest one it
    /// does; a variable NCCL reads and the built-in default does not stays quietly ignored.
    #[test]
    fn a_misspelt_variable_is_a_warning_naming_the_one_meant() {
        let c = cfg(&[("NCCL_IB_HCAA", "mlx5_0"), ("NCCL_IB_PKEY", "1")]);
        assert!(
            c.hca.entries.is_empty(),
            "the misspelt filter applies nothing"
        );
        assert_eq!(c.ignored(), [("NCCL_IB_PKEY".into(), "1".into())]);
        let w: Vec<String> = c.warnings().iter().map(ToString::to_string).collect();
        assert_eq!(
            w,
            [
                "NCCL_IB_HCAA=mlx5_0: not a variable NCCL reads (did you mean NCCL_IB_HCA?); \
              ignored, as NCCL ignores it"
            ]
        );
        let far = cfg(&[("NCCL_IB_SOMETHING_NEW", "1")]);
        assert_eq!(
            far.warnings()[0].problem,
            "not a variable NCCL reads",
            "no suggestion when nothing is close"
        );
        let strict = IbConfig::from_pairs(&[
            ("NCCL_IB_HCAA".into(), "mlx5_0".into()),
            (STRICT_CONFIG.into(), "1".into()),
        ])
        .unwrap_err()
        .to_string();
        assert!(strict.contains("did you mean NCCL_IB_HCA?"), "{strict}");
    }

    #[test]
    fn address_family_and_range() {
        let c = cfg(&[("NCCL_IB_ADDR_RANGE", "10.0.0.0/16")]);
        assert_eq!(c.addr_range.unwrap().to_string(), "10.0.0.0/16");
        assert!(c.warnings().is_empty());
        // The range is read in the family, whichever pair comes first.
        let c = cfg(&[
            ("NCCL_IB_ADDR_RANGE", "fd00::/8"),
            ("NCCL_IB_ADDR_FAMILY", "AF_INET6"),
        ]);
        assert_eq!(
            (c.addr_family, c.addr_range.unwrap().prefix_len),
            (AddrFamily::Ipv6, 8)
        );
    }

    /// Issue 21, point 5: what NCCL's `envIbAddrFamily`/`envIbAddrRange` accept is accepted and
    /// read as they read it, each with a warning naming the variable and what was done.
    #[test]
    fn family_and_range_nccl_accepts_are_read_as_nccl_reads_them_with_a_warning() {
        let one = |name: &str, value: &str| {
            let c = cfg(&[(name, value)]);
            assert_eq!(c.warnings().len(), 1, "{name}={value}: {:?}", c.warnings());
            let w = c.warnings()[0].to_string();
            assert!(w.starts_with(&format!("{name}={value}: ")), "{w}");
            (c, w)
        };
        let (c, w) = one("NCCL_IB_ADDR_FAMILY", "inet6");
        assert_eq!(c.addr_family, AddrFamily::Ipv4);
        assert!(w.contains("AF_INET used, as NCCL does"), "{w}");
        let (c, _) = one("NCCL_IB_ADDR_FAMILY", " AF_INET6");
        assert_eq!(c.addr_family, AddrFamily::Ipv4, "strcmp, no trimming");
        for garbage in ["garbage", "10.0.0.0", "fd00::/8", "10.0.0.0/33", "10.0.0/8"] {
            let (c, w) = one("NCCL_IB_ADDR_RANGE", garbage);
            assert_eq!(c.addr_range, None, "{garbage}");
            assert!(
                w.ends_with("ignored, as NCCL does: every address is in range"),
                "{w}"
            );
        }
        let (c, w) = one("NCCL_IB_ADDR_RANGE", "10.0.0.0/x");
        assert_eq!(c.addr_range.unwrap().prefix_len, 0, "strtol reads x as 0");
        assert!(w.ends_with("read as 10.0.0.0/0, as NCCL does"), "{w}");
        let (c, _) = one("NCCL_IB_ADDR_RANGE", "10.0.0.0/-8");
        let r = c.addr_range.unwrap();
        let gid = Gid::new(
            0,
            "::ffff:10.0.0.1".parse().unwrap(),
            ncclwasm_model::GidType::RoceV2,
            0,
        );
        assert!(
            !r.contains(&gid),
            "a negative mask matches nothing, as NCCL's loop"
        );
    }

    /// Issue 21, point 5: `NCCL_IB_GID_INDEX=-5` is automatic selection in NCCL
    /// (`ncclIbGetGidIndex` forces only indices >= 0); strict mode refuses it.
    #[test]
    fn a_negative_gid_index_is_automatic_and_strict_mode_refuses_it() {
        let c = cfg(&[("NCCL_IB_GID_INDEX", "-5")]);
        assert_eq!(c.gid_index, None);
        assert!(
            c.warnings()[0]
                .to_string()
                .contains("read as -1, automatic selection"),
            "{:?}",
            c.warnings()
        );
        assert!(cfg(&[("NCCL_IB_GID_INDEX", "-1")]).warnings().is_empty());
        assert_eq!(cfg(&[("NCCL_IB_GID_INDEX", "300")]).gid_index, Some(300));
        let c = cfg(&[("NCCL_IB_TIMEOUT", "18x")]);
        assert_eq!(c.timeout, 18);
        assert!(c.warnings()[0].to_string().contains("reads it as 18"));
        let strict = owned(&[("NCCL_IB_GID_INDEX", "-5"), (STRICT_CONFIG, "1")]);
        let e = IbConfig::from_pairs(&strict).unwrap_err().to_string();
        assert!(
            e.starts_with("NCCL_IB_GID_INDEX=-5: negative (NCCL_WASM_STRICT_CONFIG=1 refuses it)"),
            "{e}"
        );
        let lax = owned(&[("NCCL_IB_GID_INDEX", "-5"), (STRICT_CONFIG, "0")]);
        assert!(IbConfig::from_pairs(&lax).is_ok());
    }

    #[test]
    fn range_matching_follows_match_gid_addr_prefix() {
        use ncclwasm_model::{Gid, GidType};
        let gid = |t: &str| Gid::new(0, t.parse().unwrap(), GidType::RoceV2, 0);
        let v4 = |r: &str| parse_range(r, AddrFamily::Ipv4).0.unwrap();
        let v6 = |r: &str| parse_range(r, AddrFamily::Ipv6).0.unwrap();
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

    fn entry(name: &str, port: Option<i32>) -> HcaEntry {
        HcaEntry {
            name: name.into(),
            port,
            rail: NET_ID_UNDEF,
            plane: NET_ID_UNDEF,
        }
    }

    #[test]
    fn hca_lists() {
        let h = |v: &str| cfg(&[("NCCL_IB_HCA", v)]).hca;
        let f = h("mlx5_1,mlx5_2:1");
        assert!(!f.exclude && !f.exact);
        assert_eq!(
            f.entries,
            vec![entry("mlx5_1", None), entry("mlx5_2", Some(1))]
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
        assert!(
            cfg(&[("NCCL_IB_HCA", "mlx5_0,,mlx5_1,")])
                .warnings()
                .is_empty()
        );
    }

    /// Issue 21, point 5: every `NCCL_IB_HCA` NCCL 2.30's `parseStringList`/`matchIfList`
    /// accept is read as they read it, with a warning per oddity naming the variable.
    #[test]
    fn hca_lists_nccl_accepts_are_read_as_nccl_reads_them_with_a_warning() {
        let read = |v: &str| {
            let c = cfg(&[("NCCL_IB_HCA", v)]);
            let w: Vec<String> = c.warnings().iter().map(|w| w.to_string()).collect();
            assert!(
                w.iter()
                    .all(|w| w.starts_with(&format!("NCCL_IB_HCA={v}: "))),
                "{w:?}"
            );
            (c.hca, w)
        };
        // A space after a comma: NCCL keeps " mlx5_1" as a name, which matches nothing.
        let (f, w) = read("mlx5_0, mlx5_1");
        assert!(f.admits("mlx5_0", 1) && !f.admits("mlx5_1", 1));
        assert!(w.len() == 1 && w[0].contains("whitespace"), "{w:?}");
        // NCCL 2.30's rail and plane fields, kept for railId/planeId.
        let (f, w) = read("mlx5_0:1:0:1,mlx5_1::1");
        assert!(w.is_empty(), "{w:?}");
        let e = f.entry_for("mlx5_0", 1).unwrap();
        assert_eq!((e.port, e.rail, e.plane), (Some(1), 0, 1));
        let e = f.entry_for("mlx5_1", 2).unwrap();
        assert_eq!((e.port, e.rail, e.plane), (None, 1, NET_ID_UNDEF));
        // `^` alone excludes every device; `=` alone filters nothing.
        let (f, w) = read("^");
        assert!(!f.admits("mlx5_0", 1) && w[0].contains("every device is excluded"));
        let (f, w) = read("=");
        assert!(f.admits("mlx5_0", 1) && w[0].contains("every device is used"));
        // Misplaced ^/=, nameless entries, atoi'd ports, extra fields.
        for (value, why, admits_mlx5_0_1) in [
            ("=^mlx5_0", "only recognised once", false),
            ("mlx5_0,^mlx5_1", "only recognised once", true),
            (":1,mlx5_0", "NCCL skips it", true),
            ("mlx5_0:x", "read by atoi as 0", false),
            ("mlx5_0:0", "matches no port", false),
            ("mlx5_0:1x", "read by atoi as 1", true),
            ("mlx5_0:1:2:3:4", "more than the four fields", true),
        ] {
            let (f, w) = read(value);
            assert!(w.iter().any(|w| w.contains(why)), "{value}: {w:?}");
            assert_eq!(f.admits("mlx5_0", 1), admits_mlx5_0_1, "{value}");
        }
        let many = (0..33)
            .map(|i| format!("mlx5_{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let (f, w) = read(&many);
        assert_eq!(f.entries.len(), 32);
        assert!(w[0].contains("reads the first 32"), "{w:?}");
        let e = IbConfig::from_pairs(&owned(&[("NCCL_IB_HCA", "^"), (STRICT_CONFIG, "1")]));
        assert!(e.is_err());
    }

    #[test]
    fn integers_read_like_strtoll_base_0() {
        assert_eq!(parse_int("20"), Some((20, true)));
        assert_eq!(parse_int("-1"), Some((-1, true)));
        assert_eq!(parse_int("+7"), Some((7, true)));
        assert_eq!(parse_int(" 5 "), Some((5, true)));
        assert_eq!(parse_int("0x1F"), Some((31, true)));
        assert_eq!(parse_int("017"), Some((15, true)));
        assert_eq!(parse_int("0"), Some((0, true)));
        assert_eq!(parse_int("20x"), Some((20, false)));
        assert_eq!(parse_int("0x"), Some((0, false)));
        assert_eq!(parse_int("09"), Some((0, false)));
        assert_eq!(parse_int("1.5"), Some((1, false)));
        for none in ["", "-", "twenty"] {
            assert_eq!(parse_int(none), Some((0, false)), "{none}");
        }
        assert_eq!(parse_int("99999999999999999999"), None);
        assert_eq!(atoi(" 12ab"), 12);
        assert_eq!(atoi("x"), 0);
        assert_eq!(atoi("-3"), -3);
    }

    #[test]
    fn env_pairs_collects_only_nccl_ib_variables() {
        // The test process may carry NCCL_* settings of its own; only the prefix is checked.
        assert!(
            env_pairs()
                .iter()
                .all(|(k, _)| k.starts_with("NCCL_IB_") || k == STRICT_CONFIG)
        );
        let pairs = env_pairs();
        let mut sorted = pairs.clone();
        sorted.sort();
        assert_eq!(pairs, sorted);
    }
}
