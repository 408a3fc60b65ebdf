//! Name lists as NCCL writes them in `NCCL_IB_HCA` and `NCCL_SOCKET_IFNAME` (its
//! `parseStringList` and `matchIfList`): comma-separated entries
//! `name[:port[:rail[:plane]]]` (NCCL 2.30 added the rail and plane fields), names matching as
//! prefixes; a leading `^` turns the list into the names *not* to use, a `=` after it makes
//! names match exactly. One reader for both, so the two variables read alike; each caller
//! checks the numeric fields and the list's length by its own rules.
//!
//! NCCL keeps whatever it is given: whitespace becomes part of a name, a `^` or `=` anywhere
//! but at the start is a character of a name, an entry without a name is dropped, fields after
//! the fourth are dropped. [`NameList::read`] does exactly that and returns, beside the list,
//! one note per such oddity, so a caller that follows NCCL can WARN about each;
//! [`NameList::parse`] refuses the list at the first oddity instead, for callers (the
//! handshake's interface list) that refuse what NCCL would quietly misread.

/// One entry: the name, and the fields NCCL reads after it (`None`: absent or empty, which
/// NCCL reads as -1, "any").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameEntry {
    pub name: String,
    pub port: Option<String>,
    /// NCCL 2.30's third field: the rail this device is on.
    pub rail: Option<String>,
    /// NCCL 2.30's fourth field: the plane this device is on.
    pub plane: Option<String>,
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
    /// Reads `raw` as NCCL does, and says what in it NCCL would read other than its author
    /// probably meant (an entry without a name, whitespace or a misplaced `^`/`=` in a name,
    /// fields beyond the plane); `thing` names what the list lists (`"device"`, `"interface"`).
    pub fn read(raw: &str, thing: &str) -> (NameList, Vec<String>) {
        let (exclude, rest) = match raw.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, raw),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let mut notes = Vec::new();
        let mut entries = Vec::new();
        for item in rest.split(',').filter(|item| !item.is_empty()) {
            let mut fields = item.split(':');
            let name = fields.next().unwrap_or_default();
            let mut field = || fields.next().filter(|f| !f.is_empty()).map(str::to_owned);
            let (port, rail, plane) = (field(), field(), field());
            if name.is_empty() {
                notes.push(format!("entry {item:?} has no {thing} name; NCCL skips it"));
                continue;
            }
            if name.contains(char::is_whitespace) {
                notes.push(format!(
                    "entry {item:?} contains whitespace, which NCCL keeps as part of the name, so it matches no {thing}"
                ));
            } else if name.contains(['^', '=']) {
                notes.push(format!(
                    "entry {item:?}: '^' and '=' are only recognised once, at the start of the list, in the order \"^=\"; NCCL reads this one as part of the name, so it matches no {thing}"
                ));
            }
            if fields.next().is_some() {
                notes.push(format!(
                    "entry {item:?} has more than the four fields name:port:rail:plane; NCCL ignores the rest"
                ));
            }
            entries.push(NameEntry {
                name: name.to_owned(),
                port,
                rail,
                plane,
            });
        }
        (
            NameList {
                exclude,
                exact,
                entries,
            },
            notes,
        )
    }

    /// Reads `raw` as [`NameList::read`] does, but refuses it at the first oddity.
    pub fn parse(raw: &str, thing: &str) -> Result<NameList, String> {
        let (list, notes) = NameList::read(raw, thing);
        match notes.into_iter().next() {
            Some(note) => Err(note),
            None => Ok(list),
        }
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
                    port: Some("1".into()),
                    ..NameEntry::default()
                },
                NameEntry {
                    name: "b".into(),
                    ..NameEntry::default()
                }
            ]
        );
        assert!(matches(true, "a", "a") && !matches(true, "a", "ab"));
        assert!(matches(false, "a", "ab") && !matches(false, "ab", "a"));
        assert!(NameList::parse("", "device").unwrap().entries.is_empty());
    }

    /// NCCL 2.30's `<hca>:<port>:<rail>:<plane>`: empty fields read as absent.
    #[test]
    fn reads_rail_and_plane_fields() {
        let l = NameList::parse("mlx5_0:1:3:0,mlx5_1::2,mlx5_2:::1", "device").unwrap();
        let fields: Vec<_> = l
            .entries
            .iter()
            .map(|e| (e.port.as_deref(), e.rail.as_deref(), e.plane.as_deref()))
            .collect();
        assert_eq!(
            fields,
            [
                (Some("1"), Some("3"), Some("0")),
                (None, Some("2"), None),
                (None, None, Some("1"))
            ]
        );
    }

    #[test]
    fn refuses_what_nccl_would_keep_as_part_of_a_name() {
        for (raw, why) in [
            (":1", "has no interface name"),
            ("a, b", "whitespace"),
            ("=^a", "only recognised once"),
            ("a,^b", "only recognised once"),
            ("a:1:2:3:4", "more than the four fields"),
        ] {
            let e = NameList::parse(raw, "interface").unwrap_err();
            assert!(e.contains(why), "{raw:?}: {e}");
        }
    }

    /// `read` keeps what NCCL keeps: the whitespace-named entry stays (it matches nothing), the
    /// nameless one goes; one note each.
    #[test]
    fn read_keeps_what_nccl_keeps_and_notes_it() {
        let (l, notes) = NameList::read("mlx5_0, mlx5_1,:1", "device");
        let names: Vec<&str> = l.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["mlx5_0", " mlx5_1"]);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("whitespace") && notes[1].contains("NCCL skips it"));
    }
}
