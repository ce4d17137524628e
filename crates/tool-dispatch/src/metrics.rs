//! Per-tool counters and latency histograms, and the snapshot the dispatcher exposes.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::{
    sync::{self, AtomicU64, AtomicUsize, Mutex, Ordering},
    tool::Outcome,
};

/// Longest latency a histogram resolves (one hour); longer ones are recorded as this.
const HISTOGRAM_MAX_MICROS: u64 = 3_600_000_000;

/// Upper bounds of the latency histograms' buckets as metrics systems read them
/// ([`ToolSnapshot::latency_buckets`]; Prometheus's `le`); the last bucket, `+Inf`, is implied.
pub const LATENCY_BUCKETS: [Duration; 16] = [
    Duration::from_millis(1),
    Duration::from_micros(2_500),
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_millis(2_500),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(300),
];

/// The live metrics of one tool.
#[derive(Debug)]
pub(crate) struct ToolMetrics {
    calls: AtomicU64,
    outcomes: [AtomicU64; OUTCOMES.len()],
    histograms: Mutex<Histograms>,
}

#[derive(Debug)]
struct Histograms {
    latency: Histogram<u64>,
    queue_wait: Histogram<u64>,
}

const OUTCOMES: [Outcome; 8] = [
    Outcome::Ok,
    Outcome::UnknownTool,
    Outcome::InvalidArguments,
    Outcome::Failed,
    Outcome::Panicked,
    Outcome::TimedOut,
    Outcome::Cancelled,
    Outcome::Unavailable,
];

fn slot(outcome: Outcome) -> usize {
    OUTCOMES.iter().position(|o| *o == outcome).unwrap_or(0)
}

fn histogram() -> Histogram<u64> {
    // Two significant figures over 1 us ..= 1 h: about 30 KiB per histogram.
    Histogram::new_with_bounds(1, HISTOGRAM_MAX_MICROS, 2)
        .unwrap_or_else(|_| unreachable!("the bounds are valid constants"))
}

impl ToolMetrics {
    pub(crate) fn new() -> ToolMetrics {
        ToolMetrics {
            calls: AtomicU64::new(0),
            outcomes: Default::default(),
            histograms: Mutex::new(Histograms {
                latency: histogram(),
                queue_wait: histogram(),
            }),
        }
    }

    pub(crate) fn record(&self, outcome: Outcome, latency: Duration, queue_wait: Option<Duration>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.outcomes[slot(outcome)].fetch_add(1, Ordering::Relaxed);
        let mut histograms = sync::lock(&self.histograms);
        histograms.latency.saturating_record(micros(latency));
        if let Some(wait) = queue_wait {
            histograms.queue_wait.saturating_record(micros(wait));
        }
    }

    fn count(&self, outcome: Outcome) -> u64 {
        self.outcomes[slot(outcome)].load(Ordering::Relaxed)
    }

    pub(crate) fn snapshot(&self, name: &str) -> ToolSnapshot {
        let histograms = sync::lock(&self.histograms);
        ToolSnapshot {
            name: name.to_owned(),
            calls: self.calls.load(Ordering::Relaxed),
            ok: self.count(Outcome::Ok),
            invalid_arguments: self.count(Outcome::InvalidArguments),
            failed: self.count(Outcome::Failed),
            panicked: self.count(Outcome::Panicked),
            timed_out: self.count(Outcome::TimedOut),
            cancelled: self.count(Outcome::Cancelled),
            unavailable: self.count(Outcome::Unavailable),
            // The tool's own count, which the dispatcher fills in (`ToolDispatcher::metrics`).
            sessions_lost: 0,
            latency: Percentiles::of(&histograms.latency),
            latency_buckets: buckets(&histograms.latency),
            latency_sum: Duration::from_micros(
                (histograms.latency.mean() * histograms.latency.len() as f64) as u64,
            ),
            queue_wait: Percentiles::of(&histograms.queue_wait),
        }
    }
}

/// Cumulative counts at each of [`LATENCY_BUCKETS`] (to the histogram's precision).
fn buckets(histogram: &Histogram<u64>) -> Vec<(Duration, u64)> {
    LATENCY_BUCKETS
        .iter()
        .map(|bound| (*bound, histogram.count_between(0, micros(*bound))))
        .collect()
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// Dispatcher-wide gauges and counters that are not per tool.
#[derive(Debug, Default)]
pub(crate) struct Gauges {
    /// Calls to names no tool has.
    pub(crate) unknown_tool: AtomicU64,
    /// Calls started and not finished yet, sync and async.
    pub(crate) running_calls: AtomicUsize,
    /// Pool threads running a call whose caller stopped waiting (timeout or drop).
    pub(crate) stuck_threads: AtomicUsize,
    /// Calls finished with any outcome but `Cancelled`.
    pub(crate) finished: AtomicU64,
    /// Calls cancelled before they ran: refused or taken off the queue by shutdown, or not
    /// yet started in their turn when it began.
    pub(crate) cancelled: AtomicU64,
    /// Calls cancelled while they ran, when the shutdown deadline passed (also `Cancelled`).
    pub(crate) aborted: AtomicU64,
}

/// Latency percentiles of one histogram.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    /// How many values were recorded.
    pub count: u64,
    /// Median.
    pub p50: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest value.
    pub max: Duration,
}

impl Percentiles {
    fn of(histogram: &Histogram<u64>) -> Percentiles {
        if histogram.is_empty() {
            return Percentiles::default();
        }
        let at = |q: f64| Duration::from_micros(histogram.value_at_quantile(q));
        Percentiles {
            count: histogram.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: Duration::from_micros(histogram.max()),
        }
    }
}

/// The metrics of one tool at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ToolSnapshot {
    /// The tool's name.
    pub name: String,
    /// Calls that reached the tool's entry (unknown names are counted apart).
    pub calls: u64,
    /// Calls that returned a value.
    pub ok: u64,
    /// Calls refused for their arguments.
    pub invalid_arguments: u64,
    /// Calls where the tool returned an error.
    pub failed: u64,
    /// Calls where the tool panicked.
    pub panicked: u64,
    /// Calls that timed out.
    pub timed_out: u64,
    /// Calls cancelled by shutdown.
    pub cancelled: u64,
    /// Calls whose tool's backend could not serve them.
    pub unavailable: u64,
    /// For a tool with a session per rollout: sessions that lost their state part-way (an
    /// interpreter or kernel that died, or was killed at a call's timeout).
    pub sessions_lost: u64,
    /// From call start to result.
    pub latency: Percentiles,
    /// The same latencies as cumulative counts: calls at most as long as each of
    /// [`LATENCY_BUCKETS`] (`latency.count` is the `+Inf` bucket).
    pub latency_buckets: Vec<(Duration, u64)>,
    /// Every call's latency added up (to the histogram's precision, two figures).
    pub latency_sum: Duration,
    /// Wait for a pool thread (sync tools only).
    pub queue_wait: Percentiles,
}

/// The thread pool at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PoolSnapshot {
    /// The most threads the pool runs.
    pub max_threads: usize,
    /// Threads started so far and alive.
    pub threads: usize,
    /// Threads running a call.
    pub busy: usize,
    /// Calls waiting for a thread.
    pub queued: usize,
    /// Threads running a call whose caller stopped waiting (timed out or dropped); each is
    /// freed when its tool returns.
    pub stuck: usize,
    /// Jobs the pool has run, skipped ones included.
    pub completed: u64,
}

/// Everything the dispatcher counts, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MetricsSnapshot {
    /// One entry per tool, in registration order.
    pub tools: Vec<ToolSnapshot>,
    /// Calls to a name that no tool has.
    pub unknown_tool: u64,
    /// Calls in progress.
    pub running_calls: usize,
    /// The sync tools' thread pool.
    pub pool: PoolSnapshot,
}

impl MetricsSnapshot {
    /// The snapshot of one tool, by name.
    pub fn tool(&self, name: &str) -> Option<&ToolSnapshot> {
        self.tools.iter().find(|tool| tool.name == name)
    }

    /// Emits the snapshot as `tracing` events at INFO: one per tool and one for the pool.
    pub fn emit(&self) {
        for tool in &self.tools {
            tracing::info!(
                target: "tool_dispatch::metrics",
                tool = %tool.name,
                calls = tool.calls,
                ok = tool.ok,
                invalid_arguments = tool.invalid_arguments,
                failed = tool.failed,
                panicked = tool.panicked,
                timed_out = tool.timed_out,
                cancelled = tool.cancelled,
                latency_p50_us = tool.latency.p50.as_micros() as u64,
                latency_p99_us = tool.latency.p99.as_micros() as u64,
                queue_wait_p99_us = tool.queue_wait.p99.as_micros() as u64,
                "tool metrics"
            );
        }
        tracing::info!(
            target: "tool_dispatch::metrics",
            unknown_tool = self.unknown_tool,
            running_calls = self.running_calls,
            max_threads = self.pool.max_threads,
            threads = self.pool.threads,
            busy = self.pool.busy,
            queued = self.pool.queued,
            stuck = self.pool.stuck,
            "tool pool metrics"
        );
    }
}
