//! Latency histograms (HDR, microseconds) and the final report: throughput,
//! per-operation percentiles, errors by kind, and a per-second time series.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Latencies up to an hour are recorded exactly to three significant digits.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// What one connection (or the merge of all) saw.
#[derive(Clone, Debug, Default)]
pub struct Recorder {
    latencies: BTreeMap<&'static str, Histogram<u64>>,
    pub errors: BTreeMap<String, u64>,
    /// Operations completed in each second since the start.
    pub per_second: Vec<u64>,
}

impl Recorder {
    /// Records an operation's latency under its name (`read`, `update`, ...).
    pub fn record(&mut self, name: &'static str, latency: Duration, second: usize) {
        let micros = (latency.as_micros() as u64).clamp(1, 3_600_000_000);
        self.latencies.entry(name).or_insert_with(new_histogram).saturating_record(micros);
        if self.per_second.len() <= second {
            self.per_second.resize(second + 1, 0);
        }
        self.per_second[second] += 1;
    }

    /// Counts an error by its kind (the first word of a server error, or a
    /// transport failure).
    pub fn error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    pub fn merge(&mut self, other: &Recorder) {
        for (name, histogram) in &other.latencies {
            self.latencies.entry(name).or_insert_with(new_histogram).add(histogram).expect("same bounds");
        }
        for (kind, count) in &other.errors {
            *self.errors.entry(kind.clone()).or_default() += count;
        }
        if self.per_second.len() < other.per_second.len() {
            self.per_second.resize(other.per_second.len(), 0);
        }
        for (slot, count) in self.per_second.iter_mut().zip(&other.per_second) {
            *slot += count;
        }
    }

    pub fn report(&self, workload: &str, elapsed: Duration) -> Report {
        let operations: u64 = self.latencies.values().map(Histogram::len).sum();
        let latency = self
            .latencies
            .iter()
            .map(|(name, histogram)| {
                let at = |quantile: f64| histogram.value_at_quantile(quantile);
                let summary = LatencySummary {
                    count: histogram.len(),
                    mean_us: histogram.mean(),
                    p50_us: at(0.50),
                    p90_us: at(0.90),
                    p99_us: at(0.99),
                    p999_us: at(0.999),
                    max_us: histogram.max(),
                    cdf: CDF_QUANTILES.iter().map(|quantile| (*quantile, at(*quantile))).collect(),
                };
                (name.to_string(), summary)
            })
            .collect();
        Report {
            workload: workload.to_string(),
            elapsed_s: elapsed.as_secs_f64(),
            operations,
            throughput_ops_per_s: operations as f64 / elapsed.as_secs_f64().max(1e-9),
            latency,
            errors: self.errors.clone(),
            per_second: self.per_second.clone(),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// (quantile, latency) pairs for plotting the distribution.
    #[serde(default)]
    pub cdf: Vec<(f64, u64)>,
}

/// Where the latency distribution is sampled: evenly to the 90th percentile,
/// then ever closer to the tail.
const CDF_QUANTILES: [f64; 27] = [
    0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9,
    0.95, 0.98, 0.99, 0.995, 0.999, 0.9995, 0.9999, 1.0,
];

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub workload: String,
    pub elapsed_s: f64,
    pub operations: u64,
    pub throughput_ops_per_s: f64,
    pub latency: BTreeMap<String, LatencySummary>,
    pub errors: BTreeMap<String, u64>,
    pub per_second: Vec<u64>,
}

impl Report {
    /// The human-readable summary.
    pub fn render(&self) -> String {
        let mut out = format!(
            "workload {}: {} operations in {:.2} s = {:.0} ops/s\n",
            self.workload, self.operations, self.elapsed_s, self.throughput_ops_per_s
        );
        out.push_str("operation      count   mean µs    p50    p90    p99  p99.9      max\n");
        for (name, summary) in &self.latency {
            out.push_str(&format!(
                "{name:<9} {:>10} {:>9.1} {:>6} {:>6} {:>6} {:>6} {:>8}\n",
                summary.count,
                summary.mean_us,
                summary.p50_us,
                summary.p90_us,
                summary.p99_us,
                summary.p999_us,
                summary.max_us
            ));
        }
        if self.errors.is_empty() {
            out.push_str("errors: none\n");
        } else {
            let errors: Vec<String> =
                self.errors.iter().map(|(kind, count)| format!("{kind}={count}")).collect();
            out.push_str(&format!("errors: {}\n", errors.join(" ")));
        }
        out
    }

    /// One CSV row per operation kind.
    pub fn csv(&self) -> String {
        let mut out = String::from(
            "workload,operation,count,throughput_ops_per_s,mean_us,p50_us,p90_us,p99_us,p999_us,max_us\n",
        );
        for (name, s) in &self.latency {
            out.push_str(&format!(
                "{},{name},{},{:.1},{:.1},{},{},{},{},{}\n",
                self.workload,
                s.count,
                self.throughput_ops_per_s,
                s.mean_us,
                s.p50_us,
                s.p90_us,
                s.p99_us,
                s.p999_us,
                s.max_us
            ));
        }
        out
    }
}

/// A side-by-side table of several reports, each with its ratio to the first:
/// throughput, and p50 / p99 of every operation the first report has.
pub fn compare(reports: &[(String, Report)]) -> String {
    let Some((_, baseline)) = reports.first() else { return String::new() };
    let mut out = String::from("| run | ops/s | ratio |");
    for operation in baseline.latency.keys() {
        out.push_str(&format!(" {operation} p50 µs | ratio | {operation} p99 µs | ratio |"));
    }
    out.push('\n');
    out.push_str(&"|---".repeat(3 + 4 * baseline.latency.len()));
    out.push_str("|\n");
    let ratio = |value: f64, base: f64| if base > 0.0 { format!("{:.2}x", value / base) } else { "-".into() };
    for (name, report) in reports {
        out.push_str(&format!(
            "| {name} | {:.0} | {} |",
            report.throughput_ops_per_s,
            ratio(report.throughput_ops_per_s, baseline.throughput_ops_per_s)
        ));
        for (operation, base) in &baseline.latency {
            match report.latency.get(operation) {
                Some(summary) => out.push_str(&format!(
                    " {} | {} | {} | {} |",
                    summary.p50_us,
                    ratio(summary.p50_us as f64, base.p50_us as f64),
                    summary.p99_us,
                    ratio(summary.p99_us as f64, base.p99_us as f64)
                )),
                None => out.push_str(" - | - | - | - |"),
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_merge_and_errors_are_counted() {
        let mut first = Recorder::default();
        let mut second = Recorder::default();
        for micros in 1..=1000u64 {
            let recorder = if micros % 2 == 0 { &mut first } else { &mut second };
            recorder.record("read", Duration::from_micros(micros), (micros / 500) as usize);
        }
        second.error("WRONGTYPE");
        second.error("WRONGTYPE");
        first.merge(&second);
        let report = first.report("A", Duration::from_secs(2));
        let read = &report.latency["read"];
        assert_eq!(read.count, 1000);
        assert!((499..=501).contains(&read.p50_us), "p50 {}", read.p50_us);
        assert!((989..=991).contains(&read.p99_us), "p99 {}", read.p99_us);
        assert_eq!(read.max_us, 1000);
        assert_eq!(report.throughput_ops_per_s, 500.0);
        assert_eq!(report.errors["WRONGTYPE"], 2);
        assert_eq!(report.per_second, vec![499, 500, 1]);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["latency"]["read"]["count"], 1000);
        assert!(report.csv().lines().nth(1).unwrap().starts_with("A,read,1000,"));
        assert!(report.render().contains("WRONGTYPE=2"));
        let back: Report = serde_json::from_value(json).unwrap();
        assert_eq!(back, report);
    }

    #[test]
    fn comparisons_give_ratios_to_the_first_report() {
        let mut fast = Recorder::default();
        let mut slow = Recorder::default();
        for _ in 0..100 {
            fast.record("read", Duration::from_micros(100), 0);
            slow.record("read", Duration::from_micros(200), 0);
        }
        let table = compare(&[
            ("redis".into(), fast.report("C", Duration::from_secs(1))),
            ("tessera".into(), slow.report("C", Duration::from_secs(2))),
        ]);
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 4);
        assert!(rows[2].starts_with("| redis | 100 | 1.00x | 100 | 1.00x |"), "{}", rows[2]);
        assert!(rows[3].starts_with("| tessera | 50 | 0.50x | 200 | 2.00x |"), "{}", rows[3]);
    }
}
