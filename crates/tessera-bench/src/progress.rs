//! Progress of a long command on stderr: a bar (indicatif) when stderr is a
//! terminal, and otherwise a plain line now and then, which CI logs and
//! files keep readable (a bar's redraws would fill them with `\r`).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;

/// How often a plain line is written when stderr is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

pub struct Progress {
    what: String,
    total: Option<u64>,
    started: Instant,
    bar: Option<ProgressBar>,
    plain: Mutex<Plain>,
}

struct Plain {
    done: u64,
    message: String,
    last_line: Instant,
}

impl Progress {
    /// Progress through `total` units of `what` (seeds, operations), or an
    /// open-ended count.
    pub fn new(what: &str, total: Option<u64>) -> Self {
        let on_terminal = std::io::stderr().is_terminal();
        Self::with_bar(what, total, on_terminal)
    }

    fn with_bar(what: &str, total: Option<u64>, bar: bool) -> Self {
        let started = Instant::now();
        let bar = bar.then(|| {
            let (bar, template) = match total {
                Some(total) => (
                    ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr()),
                    "{prefix} [{bar:30}] {human_pos}/{human_len} {per_sec} ETA {eta} {msg}",
                ),
                None => (
                    ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
                    "{prefix} {spinner} {elapsed} {human_pos} {per_sec} {msg}",
                ),
            };
            let style =
                ProgressStyle::with_template(template).expect("a valid template").progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(what.to_string());
            bar
        });
        let plain = Mutex::new(Plain { done: 0, message: String::new(), last_line: started });
        Self { what: what.to_string(), total, started, bar, plain }
    }

    /// `units` more done, with a word on how it goes (failures so far, a rate).
    pub fn advance(&self, units: u64, message: &str) {
        let mut plain = self.plain.lock();
        plain.done += units;
        self.show(&mut plain, message);
    }

    /// `done` units done so far.
    pub fn set(&self, done: u64, message: &str) {
        let mut plain = self.plain.lock();
        plain.done = done;
        self.show(&mut plain, message);
    }

    fn show(&self, plain: &mut Plain, message: &str) {
        if plain.message != message {
            plain.message = message.to_string();
        }
        match &self.bar {
            Some(bar) => {
                bar.set_position(plain.done);
                bar.set_message(plain.message.clone());
            }
            None => {
                if plain.last_line.elapsed() >= PLAIN_EVERY {
                    plain.last_line = Instant::now();
                    eprintln!("{}", self.line(plain));
                }
            }
        }
    }

    /// A line for a log: units done (of how many), the rate, the time left.
    fn line(&self, plain: &Plain) -> String {
        let seconds = self.started.elapsed().as_secs_f64();
        let rate = plain.done as f64 / seconds.max(1e-9);
        let mut line = format!("{}: {}", self.what, plain.done);
        if let Some(total) = self.total {
            let left = total.saturating_sub(plain.done) as f64 / rate.max(1e-9);
            line += &format!(
                "/{total} ({:.0}%), {rate:.1}/s, {left:.0} s left",
                100.0 * plain.done as f64 / total.max(1) as f64
            );
        } else {
            line += &format!(" in {seconds:.0} s, {rate:.1}/s");
        }
        if !plain.message.is_empty() {
            line += &format!(", {}", plain.message);
        }
        line
    }

    /// Prints a line of results to stdout without breaking the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }

    /// Clears the bar; a plain log gets a last line.
    pub fn finish(self) {
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => {
                let plain = self.plain.lock();
                if self.started.elapsed() >= PLAIN_EVERY {
                    eprintln!("{}", self.line(&plain));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_line_says_how_far_how_fast_and_how_long_is_left() {
        let progress = Progress::with_bar("sim", Some(200), false);
        progress.advance(50, "0 failed");
        let line = progress.line(&progress.plain.lock());
        assert!(line.starts_with("sim: 50/200 (25%), "), "{line}");
        assert!(line.contains("/s, ") && line.contains(" s left, 0 failed"), "{line}");
        let open = Progress::with_bar("bench", None, false);
        open.set(1_000, "");
        let line = open.line(&open.plain.lock());
        assert!(line.starts_with("bench: 1000 in ") && line.ends_with("/s"), "{line}");
    }
}
