//! How sure a figure is. Each size runs several times on each transport, alternating (plugin,
//! TCP, plugin, TCP, …, so a host whose load drifts moves both alike), and a ratio is each
//! repeat's plugin figure against its own baseline: the figure shown is the median of those
//! ratios — one noisy repeat does not decide it — with their least and greatest, so a reader
//! sees how far the repeats disagreed (the same 64 MiB row once read 1.98× and then 1.21×
//! from one run each).

/// The median of `values`, which it sorts (the mean of the middle two when their count is
/// even); `None` when there are none.
pub fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_unstable_by(f64::total_cmp);
    let n = values.len();
    (n > 0).then(|| (values[(n - 1) / 2] + values[n / 2]) / 2.0)
}

/// The repeats of one figure: their median, least and greatest, and how many there were.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub repeats: usize,
}

impl Spread {
    /// `None` when there are no values.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut sorted = values.to_vec();
        let median = median(&mut sorted)?;
        Some(Spread {
            median,
            min: sorted[0],
            max: sorted[sorted.len() - 1],
            repeats: sorted.len(),
        })
    }

    /// A ratio as the tables print it: `1.62× (1.41–1.80)`, the median and the min–max; one
    /// repeat has no spread to show: `1.62×`. Three significant digits (`19.6×`, `755×`) keep
    /// the cell narrow enough for a table of 100 columns.
    pub fn ratio(&self) -> String {
        let median = digits(self.median);
        if self.repeats > 1 {
            format!("{median}× ({}–{})", digits(self.min), digits(self.max))
        } else {
            format!("{median}×")
        }
    }
}

/// `x` to about three significant digits: 0.04, 1.62, 19.6, 755.
fn digits(x: f64) -> String {
    match x.abs() {
        a if a < 10.0 => format!("{x:.2}"),
        a if a < 100.0 => format!("{x:.1}"),
        _ => format!("{x:.0}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_odd_and_an_even_count() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&mut []), None);
    }

    #[test]
    fn a_spread_is_the_median_and_the_extremes_of_its_repeats() {
        // The 64 MiB row of two runs a week apart, and a third repeat between them.
        let s = Spread::of(&[1.98, 1.21, 1.62]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.repeats), (1.62, 1.21, 1.98, 3));
        assert_eq!(s.ratio(), "1.62× (1.21–1.98)");
        // One noisy repeat among five moves the extremes, not the median.
        let s = Spread::of(&[1.5, 1.6, 9.0, 1.55, 1.58]).unwrap();
        assert_eq!(s.median, 1.58);
        assert_eq!(s.ratio(), "1.58× (1.50–9.00)");
        assert_eq!(Spread::of(&[0.5]).unwrap().ratio(), "0.50×");
        let s = Spread::of(&[19.61, 17.56, 754.82]).unwrap();
        assert_eq!(s.ratio(), "19.6× (17.6–755)");
        assert_eq!(Spread::of(&[]), None);
    }
}
