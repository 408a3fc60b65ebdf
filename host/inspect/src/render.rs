//! Small text helpers shared by the human renderers — the CLI's, `bench`'s and the details of
//! `doctor`'s checks: aligned tables, readable quantities, one-line messages, `--json`.

use ncclwasm_model::LinkLayer;
use serde::Serialize;

use crate::Error;

/// Rows printed with aligned columns; the last column is not padded, and a long last cell (a
/// reason) is wrapped to [`WIDTH`] under its own column rather than widening every line.
#[derive(Debug)]
pub struct Table {
    indent: usize,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(indent: usize, header: &[&str]) -> Table {
        Table {
            indent,
            rows: vec![header.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let width: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = " ".repeat(self.indent);
            for (c, cell) in row.iter().enumerate() {
                if c + 1 == row.len() {
                    let column = line.chars().count();
                    line += &wrap(cell, column);
                } else {
                    line += cell;
                    line += &" ".repeat(width[c] - cell.chars().count() + 2);
                }
            }
            for l in line.lines() {
                out += l.trim_end();
                out.push('\n');
            }
        }
        out
    }
}

/// `header` and one row of `cells` per item, rendered as a [`Table`].
pub fn table<T>(
    indent: usize,
    header: &[&str],
    items: &[T],
    cells: impl Fn(&T) -> Vec<String>,
) -> String {
    let mut t = Table::new(indent, header);
    for item in items {
        t.row(cells(item));
    }
    t.render()
}

/// `8`, `4K`, `64K`, `1M`, `64M`: exact binary multiples with a suffix, anything else in bytes.
pub fn size(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A byte count for a reader: bytes below 1 KiB, else the largest binary unit with one decimal
/// (`3.1 MiB`).
pub fn bytes(n: u64) -> String {
    let mut unit = "B";
    let mut value = n as f64;
    for u in ["KiB", "MiB", "GiB", "TiB"] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "B" {
        format!("{n} B")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// A duration in the largest unit that keeps it above 1, with two significant digits.
pub fn duration(secs: f64) -> String {
    let (value, unit) = if secs >= 1.0 {
        (secs, "s")
    } else if secs >= 1e-3 {
        (secs * 1e3, "ms")
    } else {
        (secs * 1e6, "µs")
    };
    if value >= 10.0 {
        format!("{value:.0} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// Link speed in Gb/s, as NICs are sold.
pub fn speed(mbps: u32) -> String {
    if mbps.is_multiple_of(1000) {
        format!("{}G", mbps / 1000)
    } else {
        format!("{:.1}G", f64::from(mbps) / 1000.0)
    }
}

/// How NCCL's logs name a link layer.
pub fn link(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::Infiniband => "IB",
        LinkLayer::Ethernet => "RoCE",
    }
}

/// A label and its text, the label padded to the width every section header uses (a label as
/// wide still gets a space); a long text is wrapped to [`WIDTH`] under itself.
pub fn field(label: &str, text: &str) -> String {
    let column = (label.chars().count() + 1).max(LABEL_WIDTH);
    format!("{label:<column$}{}\n", wrap(text, column))
}

/// Width of the label column of section headers.
pub const LABEL_WIDTH: usize = 12;

/// The width human output is kept to (a terminal split in two, a review comment).
pub const WIDTH: usize = 100;

/// Narrowest column worth wrapping into; text starting further right continues on lines indented
/// to [`LABEL_WIDTH`] instead.
const MIN_WRAP: usize = 30;

/// `text` that starts at `column`, broken at spaces into lines that end by [`WIDTH`], the
/// continuation lines indented to `column` (or to [`LABEL_WIDTH`] when `column` leaves less than
/// [`MIN_WRAP`]). A word longer than the room stays whole.
pub fn wrap(text: &str, column: usize) -> String {
    let mut room = WIDTH.saturating_sub(column);
    if text.chars().count() <= room {
        return text.to_owned();
    }
    let indent = if room < MIN_WRAP { LABEL_WIDTH } else { column };
    let mut out = String::new();
    let mut len = 0;
    for word in text.split(' ') {
        let n = word.chars().count();
        // A first word with no room beside it starts on the next line.
        let fits = len + usize::from(len > 0) + n <= room;
        if !fits && (len > 0 || (out.is_empty() && room < MIN_WRAP)) {
            out.push('\n');
            out += &" ".repeat(indent);
            room = WIDTH - indent;
            len = 0;
        } else if len > 0 {
            out.push(' ');
            len += 1;
        }
        out += word;
        len += n;
    }
    out
}

/// `message` on one line: wasmtime and I/O errors may carry newlines, and a failure is one line
/// of stderr or one line of a report.
pub fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `--json` output: pretty, one document, newline-terminated.
pub fn json<T: Serialize>(value: &T) -> Result<String, Error> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_all_but_the_last_column() {
        let mut t = Table::new(2, &["a", "bbb", "why"]);
        t.row(vec!["long".into(), "x".into(), "because".into()]);
        assert_eq!(t.render(), "  a     bbb  why\n  long  x    because\n");
    }

    #[test]
    fn long_text_wraps_under_its_column() {
        let words = "word ".repeat(40);
        let text = field("  why", words.trim_end());
        assert!(text.lines().count() > 1, "{text}");
        for line in text.lines() {
            assert!(line.chars().count() <= WIDTH, "{line}");
        }
        assert!(
            text.lines()
                .skip(1)
                .all(|l| l.starts_with(&" ".repeat(LABEL_WIDTH)))
        );
        assert_eq!(text.split_whitespace().count(), 41);
        assert_eq!(field("peer devices", "2"), "peer devices 2\n");
        // Short text is left alone; text starting too far right continues further left, and a
        // first word with no room beside it starts there.
        assert_eq!(wrap("short", 90), "short");
        let far = wrap(words.trim_end(), 80);
        assert!(far.starts_with("word word word word\n"), "{far}");
        for l in far.lines().skip(1) {
            assert!(l.starts_with(&" ".repeat(LABEL_WIDTH)), "{far}");
            assert!(!l.starts_with(&" ".repeat(LABEL_WIDTH + 1)), "{far}");
            assert!(l.chars().count() <= WIDTH, "{far}");
        }
        assert_eq!(
            wrap(&format!("{} b", "a".repeat(25)), 80),
            format!("\n{}{} b", " ".repeat(LABEL_WIDTH), "a".repeat(25))
        );
    }

    #[test]
    fn sizes_and_durations_read_naturally() {
        assert_eq!(
            [8, 4096, 65536, 1 << 20, 64 << 20, 1 << 30, 1000, 1536].map(size),
            ["8", "4K", "64K", "1M", "64M", "1G", "1000", "1536"]
        );
        assert_eq!(duration(4.294967296), "4.3 s");
        assert_eq!(duration(0.000_065_536), "66 µs");
        assert_eq!(duration(0.0042), "4.2 ms");
        assert_eq!(speed(400_000), "400G");
        assert_eq!(speed(12_500), "12.5G");
    }
}
