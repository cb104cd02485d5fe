//! SVG plots of reports: throughput per second (failover and transition dips
//! show here) and the latency CDF on a log axis. Several reports share one
//! plot, so `tessera bench compare --plot` overlays them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::report::Report;

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] =
    ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// A line of (x, y) points with a name for the legend.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

enum Scale {
    Linear,
    Log10,
}

impl Scale {
    fn apply(&self, value: f64) -> f64 {
        match self {
            Scale::Linear => value,
            Scale::Log10 => value.max(1e-9).log10(),
        }
    }
}

struct Axis {
    label: &'static str,
    scale: Scale,
    min: f64,
    max: f64,
}

impl Axis {
    /// Where `value` falls, from 0 (min) to 1 (max).
    fn fraction(&self, value: f64) -> f64 {
        let (min, max) = (self.scale.apply(self.min), self.scale.apply(self.max));
        if max <= min {
            return 0.0;
        }
        ((self.scale.apply(value) - min) / (max - min)).clamp(0.0, 1.0)
    }

    fn ticks(&self) -> Vec<f64> {
        match self.scale {
            Scale::Log10 => {
                let (low, high) = (self.min.max(1.0).log10().floor() as i32, self.max.log10().ceil() as i32);
                (low..=high).map(|power| 10f64.powi(power)).collect()
            }
            Scale::Linear => {
                let step = nice_step((self.max - self.min) / 5.0);
                let first = (self.min / step).ceil() as i64;
                let last = (self.max / step).floor() as i64;
                (first..=last).map(|index| index as f64 * step).collect()
            }
        }
    }
}

fn nice_step(rough: f64) -> f64 {
    if rough <= 0.0 || !rough.is_finite() {
        return 1.0;
    }
    let power = 10f64.powf(rough.log10().floor());
    let mantissa = rough / power;
    let nice = if mantissa <= 1.0 {
        1.0
    } else if mantissa <= 2.0 {
        2.0
    } else if mantissa <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * power
}

fn tick_label(value: f64) -> String {
    if value >= 1e6 {
        format!("{}M", value / 1e6)
    } else if value >= 1e3 {
        format!("{}k", value / 1e3)
    } else {
        // Rounded, so that 3 × 0.2 prints as 0.6.
        format!("{}", (value * 1e6).round() / 1e6)
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn svg(title: &str, x: &Axis, y: &Axis, series: &[Series]) -> String {
    let (plot_width, plot_height) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let to_x = |value: f64| LEFT + x.fraction(value) * plot_width;
    let to_y = |value: f64| TOP + (1.0 - y.fraction(value)) * plot_height;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{}</text>"#,
        LEFT + plot_width / 2.0,
        escape(title)
    );
    for tick in x.ticks() {
        let at = to_x(tick);
        let _ = writeln!(
            out,
            r##"<line x1="{at:.1}" y1="{TOP}" x2="{at:.1}" y2="{:.1}" stroke="#e5e5e5"/>"##,
            TOP + plot_height
        );
        let _ = writeln!(
            out,
            r#"<text x="{at:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_height + 18.0,
            tick_label(tick)
        );
    }
    for tick in y.ticks() {
        let at = to_y(tick);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#e5e5e5"/>"##,
            LEFT + plot_width
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            at + 4.0,
            tick_label(tick)
        );
    }
    let _ = writeln!(
        out,
        r#"<rect x="{LEFT}" y="{TOP}" width="{plot_width}" height="{plot_height}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_width / 2.0,
        HEIGHT - 16.0,
        x.label
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_height / 2.0,
        y.label
    );
    for (index, line) in series.iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        let points: Vec<String> =
            line.points.iter().map(|(px, py)| format!("{:.1},{:.1}", to_x(*px), to_y(*py))).collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let legend_y = TOP + 16.0 + index as f64 * 18.0;
        let legend_x = LEFT + plot_width + 14.0;
        let _ = writeln!(
            out,
            r#"<line x1="{legend_x}" y1="{legend_y}" x2="{}" y2="{legend_y}" stroke="{color}" stroke-width="3"/>"#,
            legend_x + 20.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">{}</text>"#,
            legend_x + 26.0,
            legend_y + 4.0,
            escape(&line.name)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Operations per second over the run, one line per report.
pub fn throughput_svg(reports: &[(String, &Report)]) -> String {
    let series: Vec<Series> = reports
        .iter()
        .map(|(name, report)| Series {
            name: name.clone(),
            points: report
                .per_second
                .iter()
                .enumerate()
                .map(|(second, count)| (second as f64, *count as f64))
                .collect(),
        })
        .collect();
    let seconds = series.iter().map(|line| line.points.len()).max().unwrap_or(1).max(2) as f64 - 1.0;
    let peak = series.iter().flat_map(|line| line.points.iter().map(|(_, y)| *y)).fold(1.0, f64::max);
    let x = Axis { label: "seconds since start", scale: Scale::Linear, min: 0.0, max: seconds };
    let y = Axis { label: "operations per second", scale: Scale::Linear, min: 0.0, max: peak * 1.1 };
    svg("Throughput over time", &x, &y, &series)
}

/// The share of operations answered within each latency, per report and operation.
pub fn latency_cdf_svg(reports: &[(String, &Report)]) -> String {
    let mut series = Vec::new();
    for (name, report) in reports {
        for (operation, summary) in &report.latency {
            let label = if reports.len() > 1 { format!("{name} {operation}") } else { operation.clone() };
            series.push(Series {
                name: label,
                points: summary.cdf.iter().map(|(quantile, micros)| (*micros as f64, *quantile)).collect(),
            });
        }
    }
    let slowest = series.iter().flat_map(|line| line.points.iter().map(|(x, _)| *x)).fold(10.0, f64::max);
    let fastest = series.iter().flat_map(|line| line.points.iter().map(|(x, _)| *x)).fold(slowest, f64::min);
    // Whole decades, so that every tick lies on the axis.
    let (min, max) = (10f64.powf(fastest.max(1.0).log10().floor()), 10f64.powf(slowest.log10().ceil()));
    let x = Axis { label: "latency (µs, log scale)", scale: Scale::Log10, min, max: max.max(min * 10.0) };
    let y = Axis { label: "share of operations", scale: Scale::Linear, min: 0.0, max: 1.0 };
    svg("Latency CDF", &x, &y, &series)
}

/// Writes `throughput.svg` and `latency-cdf.svg` into `dir`.
pub fn write_plots_of(reports: &[(String, &Report)], dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
    let mut written = Vec::new();
    for (file, text) in
        [("throughput.svg", throughput_svg(reports)), ("latency-cdf.svg", latency_cdf_svg(reports))]
    {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|error| format!("{}: {error}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// The plots of one run.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, String> {
    write_plots_of(&[(report.workload.clone(), report)], dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Recorder;
    use std::time::Duration;

    #[test]
    fn plots_are_svg_with_one_line_per_series() {
        let mut recorder = Recorder::default();
        for micros in 1..=2000u64 {
            recorder.record("read", Duration::from_micros(micros), (micros / 500) as usize);
            recorder.record("update", Duration::from_micros(micros * 3), (micros / 500) as usize);
        }
        let report = recorder.report("A", Duration::from_secs(4));
        let cdf = latency_cdf_svg(&[("A".into(), &report)]);
        assert!(cdf.starts_with("<svg") && cdf.trim_end().ends_with("</svg>"));
        assert_eq!(cdf.matches("<polyline").count(), 2);
        let throughput = throughput_svg(&[("a".into(), &report), ("b".into(), &report)]);
        assert_eq!(throughput.matches("<polyline").count(), 2);
        assert!(throughput.contains(">b</text>"));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(write_plots(&report, dir.path()).unwrap().len(), 2);
    }

    #[test]
    fn axes_have_readable_ticks() {
        assert_eq!(nice_step(230.0), 500.0);
        assert_eq!(nice_step(0.19), 0.2);
        let log = Axis { label: "", scale: Scale::Log10, min: 10.0, max: 100_000.0 };
        assert_eq!(log.ticks(), vec![10.0, 100.0, 1000.0, 10_000.0, 100_000.0]);
        assert_eq!(tick_label(20_000.0), "20k");
        assert_eq!(tick_label(3.0 * 0.2), "0.6");
    }
}
