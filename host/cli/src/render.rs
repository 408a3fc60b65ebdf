//! Small text helpers shared by the human renderers: aligned tables and readable quantities.

use ncclwasm_model::LinkLayer;

/// Rows printed with aligned columns; the last column is not padded, so long reasons simply run
/// on rather than widening every line.
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
                    line += cell;
                } else {
                    line += cell;
                    line += &" ".repeat(width[c] - cell.chars().count() + 2);
                }
            }
            out += line.trim_end();
            out.push('\n');
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

/// A label and its text, the label padded to the width every section header uses.
pub fn field(label: &str, text: &str) -> String {
    format!("{label:<LABEL_WIDTH$}{text}\n")
}

/// Width of the label column of section headers.
pub const LABEL_WIDTH: usize = 12;

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
