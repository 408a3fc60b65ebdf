//! Name lists as NCCL writes them in `NCCL_IB_HCA` and `NCCL_SOCKET_IFNAME` (its
//! `parseStringList` and `matchIfList`): comma-separated entries `name[:port]`, names matching
//! as prefixes; a leading `^` turns the list into the names *not* to use, a `=` after it makes
//! names match exactly. One parser for both, so the two variables read alike; each caller
//! checks the port field and the list's length by its own rules.
//!
//! NCCL keeps whatever it is given: whitespace becomes part of a name, a `^` or `=` anywhere
//! but at the start is a character of a name, an entry without a name is dropped. Such a list
//! matches nothing a user meant, so it is refused here with the entry named.

/// One entry: the name, and what followed its first `:` (NCCL's port field).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameEntry {
    pub name: String,
    pub port: Option<String>,
}

/// A parsed list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameList {
    /// `^` at the start: the entries are excluded, everything else is used.
    pub exclude: bool,
    /// `=` (after any `^`): names match exactly instead of by prefix.
    pub exact: bool,
    /// Empty entries (`a,,b`) are skipped, as NCCL's `strtok` does.
    pub entries: Vec<NameEntry>,
}

impl NameList {
    /// Parses `raw`; `thing` names what the list lists (`"device"`, `"interface"`) in the error.
    pub fn parse(raw: &str, thing: &str) -> Result<NameList, String> {
        let (exclude, rest) = match raw.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, raw),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let entries = rest
            .split(',')
            .filter(|item| !item.is_empty())
            .map(|item| Self::entry(item, thing))
            .collect::<Result<_, _>>()?;
        Ok(NameList {
            exclude,
            exact,
            entries,
        })
    }

    fn entry(item: &str, thing: &str) -> Result<NameEntry, String> {
        let (name, port) = match item.split_once(':') {
            Some((name, port)) => (name, Some(port.to_owned())),
            None => (item, None),
        };
        if name.is_empty() {
            return Err(format!("entry {item:?} has no {thing} name"));
        }
        if name.contains(char::is_whitespace) {
            return Err(format!(
                "entry {item:?} contains whitespace, which NCCL keeps as part of the name (it would match no {thing})"
            ));
        }
        if name.contains(['^', '=']) {
            return Err(format!(
                "entry {item:?}: '^' and '=' are only recognised once, at the start of the list, in the order \"^=\""
            ));
        }
        Ok(NameEntry {
            name: name.to_owned(),
            port,
        })
    }
}

/// Whether a listed name matches `name`: equal in an exact list, else a prefix of it (so
/// `mlx5_1` also matches `mlx5_10`), as NCCL's `matchIf`.
pub fn matches(exact: bool, listed: &str, name: &str) -> bool {
    if exact {
        name == listed
    } else {
        name.starts_with(listed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_caret_equals_entries_and_ports() {
        let l = NameList::parse("^=a:1,,b", "device").unwrap();
        assert!(l.exclude && l.exact);
        assert_eq!(
            l.entries,
            [
                NameEntry {
                    name: "a".into(),
                    port: Some("1".into())
                },
                NameEntry {
                    name: "b".into(),
                    port: None
                }
            ]
        );
        assert!(matches(true, "a", "a") && !matches(true, "a", "ab"));
        assert!(matches(false, "a", "ab") && !matches(false, "ab", "a"));
        assert!(NameList::parse("", "device").unwrap().entries.is_empty());
    }

    #[test]
    fn refuses_what_nccl_would_keep_as_part_of_a_name() {
        for (raw, why) in [
            (":1", "has no interface name"),
            ("a, b", "whitespace"),
            ("=^a", "only recognised once"),
            ("a,^b", "only recognised once"),
        ] {
            let e = NameList::parse(raw, "interface").unwrap_err();
            assert!(e.contains(why), "{raw:?}: {e}");
        }
    }
}
