//! Progress of a run: a bar redrawn in place when stderr is a terminal, a log line now and
//! then otherwise.

use std::{
    io::{IsTerminal, Write},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rollout_core::rollout::{Engine, Health};
use vllm_client::Client;

use super::config::Progress as Mode;

/// Whether a bar is on stderr's last line now: log lines clear it first ([`LogWriter`]).
static BAR_SHOWN: AtomicBool = AtomicBool::new(false);

/// Stderr for log lines: when a bar occupies the last line, it is cleared first (the bar
/// is redrawn on its next tick), so log lines and the bar do not run into each other.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut stderr = std::io::stderr().lock();
        if BAR_SHOWN.swap(false, Ordering::Relaxed) {
            stderr.write_all(b"\r\x1b[2K")?;
        }
        stderr.write(buf)
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
        let mut rewards = self.rewards.lock().unwrap_or_else(|e| e.into_inner());
        rewards.0 += reward;
        rewards.1 += 1;
    }

    /// The mean of the groups' mean rewards.
    pub(crate) fn mean_reward(&self) -> Option<f64> {
        let rewards = self.rewards.lock().unwrap_or_else(|e| e.into_inner());
        (rewards.1 > 0).then(|| rewards.0 / rewards.1 as f64)
    }
}

/// The progress display, running on a task of its own.
pub(crate) struct Progress {
    task: Option<tokio::task::JoinHandle<()>>,
    bar: bool,
    paused: Arc<AtomicBool>,
    totals: Arc<Totals>,
    total: Option<u64>,
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
        let (bar, period) = match mode {
            Mode::Off => (false, None),
            Mode::Bar => (true, Some(Duration::from_millis(200))),
            Mode::Auto if terminal => (true, Some(Duration::from_millis(200))),
            Mode::Auto | Mode::Log => (false, Some(Duration::from_secs(10))),
        };
        let paused = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let task = period.map(|period| {
            let (paused, totals) = (Arc::clone(&paused), Arc::clone(&totals));
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(period);
                ticks.tick().await;
                loop {
                    ticks.tick().await;
                    if paused.load(Ordering::Relaxed) {
                        continue;
                    }
                    let line = status(&engine.health(), &totals, total, started.elapsed());
                    if bar {
                        let mut stderr = std::io::stderr().lock();
                        let _ = write!(stderr, "\r\x1b[2K{line}");
                        let _ = stderr.flush();
                        BAR_SHOWN.store(true, Ordering::Relaxed);
                    } else {
                        tracing::info!("{line}");
                    }
                }
            })
        });
        Progress {
            task,
            bar,
            paused,
            totals,
            total,
            started,
        }
    }

    /// Stops drawing (a message is about to be printed).
    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
        self.clear();
    }

    fn clear(&self) {
        if self.bar && BAR_SHOWN.swap(false, Ordering::Relaxed) {
            let mut stderr = std::io::stderr().lock();
            let _ = write!(stderr, "\r\x1b[2K");
            let _ = stderr.flush();
        }
    }

    /// Stops the display, leaving the last status on its own line.
    pub(crate) async fn finish(mut self, health: &Health) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
            self.clear();
            eprintln!(
                "{}",
                status(health, &self.totals, self.total, self.started.elapsed())
            );
        }
    }
}

/// One status line.
fn status(health: &Health, totals: &Totals, total: Option<u64>, elapsed: Duration) -> String {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    let groups = totals.groups.load(Ordering::Relaxed);
    let samples = totals.samples.load(Ordering::Relaxed);
    let stats = &health.stats;
    let done = match total {
        Some(total) if total > 0 => {
            let width = 20;
            let filled = ((groups.min(total) * width) / total) as usize;
            format!(
                "[{}{}] {groups}/{total} groups",
                "=".repeat(filled),
                " ".repeat(width as usize - filled)
            )
        }
        _ => format!("{groups} groups"),
    };
    format!(
        "{done} | {:.1} samples/s | {:.0} tokens/s | {} in flight | {} tool calls | {} failed | reward {}",
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
