//! Interface-name lists as NCCL's socket layer reads them (`NCCL_SOCKET_IFNAME`, and the fixed
//! lists of its automatic choice): comma-separated names, each a prefix of the interface name;
//! a leading `^` excludes the listed names instead, a `=` after it makes the names exact. The
//! list is read by `ncclwasm_model::name_list`, the parser `NCCL_IB_HCA` shares.
//!
//! NCCL splits each entry at `:` and keeps what follows as a port, which interface matching
//! never looks at (`eth0:5` matches like `eth0`); we accept and ignore it the same way. Where
//! NCCL would silently pick nothing or drop part of the value (an empty list, a `^`/`=`
//! elsewhere than at the start, whitespace, more than 16 entries, a name longer than it keeps),
//! the value is refused with the reason, so a misspelt setting cannot send the handshake over
//! an interface nobody meant.

use ncclwasm_model::name_list::{self, NameList};

/// NCCL reads at most this many entries (`MAX_IFS`) and drops the rest.
const MAX_ENTRIES: usize = 16;
/// NCCL keeps this many bytes of each entry (`netIf::prefix` is 64 bytes with the NUL).
const MAX_NAME: usize = 63;

/// A parsed interface-name list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IfPattern {
    /// `^`: the names are the interfaces *not* to use.
    exclude: bool,
    /// `=`: names must equal the interface name, not merely start it.
    exact: bool,
    names: Vec<String>,
}

impl IfPattern {
    /// One of NCCL's own lists for its automatic choice (prefixes, known to be valid).
    pub(crate) fn prefixes(exclude: bool, names: &[&str]) -> IfPattern {
        IfPattern {
            exclude,
            exact: false,
            names: names.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    /// Parses a user's list (ports read and dropped); the error says what is wrong with it.
    pub(crate) fn parse(raw: &str) -> Result<IfPattern, String> {
        let list = NameList::parse(raw, "interface")?;
        let names: Vec<String> = list.entries.into_iter().map(|e| e.name).collect();
        if let Some(long) = names.iter().find(|n| n.len() > MAX_NAME) {
            return Err(format!(
                "{long:?} is longer than the {MAX_NAME} bytes NCCL keeps of a name"
            ));
        }
        if names.is_empty() {
            return Err("the list names no interface".to_owned());
        }
        if names.len() > MAX_ENTRIES {
            return Err(format!(
                "{} entries; NCCL reads at most {MAX_ENTRIES} and drops the rest",
                names.len()
            ));
        }
        Ok(IfPattern {
            exclude: list.exclude,
            exact: list.exact,
            names,
        })
    }

    /// Whether interface `ifname` is one the list selects (`matchIfList` with no port).
    pub(crate) fn admits(&self, ifname: &str) -> bool {
        let listed = self
            .names
            .iter()
            .any(|n| name_list::matches(self.exact, n, ifname));
        listed != self.exclude
    }

    /// The interfaces the list selects, in words, for the log and error messages.
    pub(crate) fn describe(&self) -> String {
        let names: Vec<String> = self
            .names
            .iter()
            .map(|n| {
                if self.exact {
                    format!("{n:?}")
                } else {
                    format!("{n}*")
                }
            })
            .collect();
        let list = match names.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        if self.exclude {
            format!("not named {list}")
        } else {
            format!("named {list}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(raw: &str) -> IfPattern {
        IfPattern::parse(raw).unwrap()
    }

    #[test]
    fn names_are_prefixes_unless_exact() {
        let eth = p("eth");
        assert!(eth.admits("eth0") && eth.admits("eth") && !eth.admits("en0"));
        let exact = p("=eth0");
        assert!(exact.admits("eth0") && !exact.admits("eth01") && !exact.admits("eth"));
    }

    #[test]
    fn a_comma_list_admits_any_entry_and_skips_empty_entries() {
        let list = p("ib,,enp1s0,");
        assert!(list.admits("ib0") && list.admits("enp1s0f1") && !list.admits("eth0"));
        assert_eq!(list.names, ["ib", "enp1s0"]);
    }

    #[test]
    fn caret_excludes_and_caret_equals_excludes_exact_names() {
        let not_lo = p("^lo,docker");
        assert!(!not_lo.admits("lo") && !not_lo.admits("docker0") && not_lo.admits("eth0"));
        let not_exact = p("^=eth0");
        assert!(!not_exact.admits("eth0") && not_exact.admits("eth01"));
        // NCCL recognises "^=" only in this order.
        assert!(IfPattern::parse("=^eth0").is_err());
    }

    #[test]
    fn the_port_field_is_read_and_ignored() {
        let with_port = p("eth0:5,ib:1:2:3");
        assert_eq!(with_port.names, ["eth0", "ib"]);
        assert!(with_port.admits("eth0") && with_port.admits("ib0"));
    }

    #[test]
    fn refuses_what_nccl_would_silently_misread() {
        for (raw, why) in [
            ("^", "names no interface"),
            ("^=", "names no interface"),
            (",,", "names no interface"),
            (":5", "no interface name"),
            ("eth0, eth1", "whitespace"),
            ("eth0,^lo", "only recognised once, at the start"),
        ] {
            let e = IfPattern::parse(raw).unwrap_err();
            assert!(e.contains(why), "{raw:?}: {e}");
        }
        let many = vec!["e"; 17].join(",");
        assert!(IfPattern::parse(&many).unwrap_err().contains("at most 16"));
        assert!(IfPattern::parse(&vec!["e"; 16].join(",")).is_ok());
        let long = "x".repeat(64);
        assert!(IfPattern::parse(&long).unwrap_err().contains("63 bytes"));
        assert!(IfPattern::parse(&"x".repeat(63)).is_ok());
    }

    #[test]
    fn describes_itself() {
        assert_eq!(p("lo").describe(), "named lo*");
        assert_eq!(p("=lo").describe(), "named \"lo\"");
        assert_eq!(
            IfPattern::prefixes(true, &["docker", "lo", "virbr"]).describe(),
            "not named docker*, lo* or virbr*"
        );
    }
}
