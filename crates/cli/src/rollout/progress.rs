//! Progress of a run: an `indicatif` bar when stderr is a terminal (log lines print above
//! it), a log line now and then otherwise.

use std::{
    io::{IsTerminal, Write},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rollout::{Engine, Health};
use serde::{Deserialize, Serialize};
use vllm_client::Client;

/// How progress shows (`--progress`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mode {
    /// A bar when stderr is a terminal, else log lines.
    #[default]
    Auto,
    /// A progress bar (log lines when stderr is not a terminal).
    Bar,
    /// A log line now and then.
    Log,
    /// Nothing.
    Off,
}

/// The bar on stderr, if one is shown: log lines are written with it suspended.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn shown_bar() -> Option<ProgressBar> {
    BAR.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

/// Stderr for log lines: while a bar is shown, each line is written with the bar cleared
/// and redrawn below it ([`ProgressBar::suspend`]), so the two never run into each other.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match shown_bar() {
            Some(bar) => bar.suspend(|| std::io::stderr().lock().write(buf)),
            None => std::io::stderr().lock().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// What the writer has written so far.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    pub(crate) groups: AtomicU64,
    pub(crate) samples: AtomicU64,
    pub(crate) tokens: AtomicU64,
    rewards: Mutex<(f64, u64)>,
}

impl Totals {
    pub(crate) fn add_reward(&self, reward: f64) {
        let mut rewards = self.rewards.lock().unwrap_or_else(PoisonError::into_inner);
        rewards.0 += reward;
        rewards.1 += 1;
    }

    /// The mean of the groups' mean rewards.
    pub(crate) fn mean_reward(&self) -> Option<f64> {
        let rewards = self.rewards.lock().unwrap_or_else(PoisonError::into_inner);
        (rewards.1 > 0).then(|| rewards.0 / rewards.1 as f64)
    }
}

/// The progress display, updated by a task of its own.
pub(crate) struct Progress {
    task: Option<tokio::task::JoinHandle<()>>,
    bar: Option<ProgressBar>,
    paused: Arc<AtomicBool>,
    totals: Arc<Totals>,
    started: Instant,
}

impl Progress {
    pub(crate) fn start(
        mode: Mode,
        total: Option<u64>,
        totals: Arc<Totals>,
        engine: Arc<Engine<Client>>,
    ) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = match mode {
            Mode::Bar | Mode::Auto if terminal => Some(new_bar(total)),
            Mode::Bar | Mode::Auto | Mode::Log | Mode::Off => None,
        };
        let period = match (&bar, mode) {
            (Some(_), _) => Some(Duration::from_millis(200)),
            (None, Mode::Off) => None,
            (None, _) => Some(Duration::from_secs(10)),
        };
        *BAR.lock().unwrap_or_else(PoisonError::into_inner) = bar.clone();
        let paused = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let task = period.map(|period| {
            let (paused, totals, bar) = (Arc::clone(&paused), Arc::clone(&totals), bar.clone());
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                ticks.tick().await;
                loop {
                    ticks.tick().await;
                    if paused.load(Ordering::Relaxed) {
                        continue;
                    }
                    let health = engine.health();
                    match &bar {
                        Some(bar) => {
                            bar.set_position(totals.groups.load(Ordering::Relaxed));
                            bar.set_message(rates(&health, &totals, started.elapsed()));
                        }
                        None => {
                            tracing::info!("{}", status(&health, &totals, total, started.elapsed()))
                        }
                    }
                }
            })
        });
        Progress {
            task,
            bar,
            paused,
            totals,
            started,
        }
    }

    /// Stops drawing (a message is about to be printed, and the run is ending).
    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
        self.clear();
    }

    fn clear(&self) {
        *BAR.lock().unwrap_or_else(PoisonError::into_inner) = None;
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// Stops the display, leaving the last status on its own line.
    pub(crate) async fn finish(mut self, health: &Health, total: Option<u64>) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
            self.clear();
            eprintln!(
                "{}",
                status(health, &self.totals, total, self.started.elapsed())
            );
        }
    }
}

/// A bar of `total` groups, or a spinner counting them when the total is not known.
fn new_bar(total: Option<u64>) -> ProgressBar {
    let (bar, template) = match total {
        Some(total) => (
            ProgressBar::new(total),
            "[{bar:20}] {pos}/{len} groups | {msg}",
        ),
        None => (ProgressBar::new_spinner(), "{spinner} {pos} groups | {msg}"),
    };
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(5));
    bar
}

/// One status line: groups done, then the rates and counts of [`rates`].
fn status(health: &Health, totals: &Totals, total: Option<u64>, elapsed: Duration) -> String {
    let groups = totals.groups.load(Ordering::Relaxed);
    let done = match total {
        Some(total) => format!("{groups}/{total} groups"),
        None => format!("{groups} groups"),
    };
    format!("{done} | {}", rates(health, totals, elapsed))
}

/// Samples/s, tokens/s, rollouts in flight, tool calls, failed rollouts, mean reward.
fn rates(health: &Health, totals: &Totals, elapsed: Duration) -> String {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    let samples = totals.samples.load(Ordering::Relaxed);
    let stats = &health.stats;
    format!(
        "{:.1} samples/s | {:.0} tokens/s | {} in flight | {} tool calls | {} failed | reward {}",
        samples as f64 / seconds,
        stats.sampled_tokens as f64 / seconds,
        health.in_flight,
        stats.tool_calls,
        stats.rollouts_failed,
        totals
            .mean_reward()
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
    )
}
