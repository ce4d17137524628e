//! Counters, the heartbeat and scheduler-lag watchdog, and what `health()` and `shutdown()`
//! report.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tool_dispatch::LATENCY_BUCKETS;

use crate::lock;

macro_rules! counters {
    ($(#[$meta:meta])* $name:ident / $snapshot:ident { $($(#[$field_meta:meta])* $field:ident,)* }) => {
        #[derive(Debug, Default)]
        pub(crate) struct $name { $(pub(crate) $field: AtomicU64,)* }

        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
        #[non_exhaustive]
        pub struct $snapshot { $($(#[$field_meta])* pub $field: u64,)* }

        impl $name {
            pub(crate) fn snapshot(&self) -> $snapshot {
                $snapshot { $($field: self.$field.load(Ordering::Relaxed),)* }
            }
        }
    };
}

counters! {
    /// What the loop has done so far.
    Counters / Stats {
        /// Groups admitted (one dataset row each).
        groups_admitted,
        /// Groups scored and handed to the output.
        groups_completed,
        /// Groups dropped because fewer than `min_group_size` rollouts succeeded.
        groups_too_small,
        /// Groups dropped by the advantage estimator's zero-variance filter.
        groups_zero_variance,
        /// Groups dropped because an advantage came out NaN or infinite (see
        /// `scoring::GroupKind::NonFinite`), each logged as an error.
        groups_non_finite,
        /// Groups dropped because a drain cancelled some of their rollouts.
        groups_cancelled,
        /// Groups cancelled because they fell more than `max_staleness` versions behind.
        groups_stale,
        /// Rollouts started (each retry counts once more).
        rollouts_started,
        /// Rollouts that produced a conversation.
        rollouts_completed,
        /// Rollouts that failed after their retries.
        rollouts_failed,
        /// Of those, rollouts that failed because no server could be reached: they say
        /// nothing of the rollouts themselves, so they do not count against
        /// `max_failure_rate`.
        rollouts_unavailable,
        /// Attempts retried after a failure.
        rollouts_retried,
        /// Rollouts cancelled by a drain (started or not).
        rollouts_cancelled,
        /// Generation calls.
        turns,
        /// Tokens sent as prompts (every turn's whole prompt).
        prompt_tokens,
        /// Tokens sampled.
        sampled_tokens,
        /// Tool calls made.
        tool_calls,
        /// Tool calls that answered with an error (unknown tool, bad arguments, failure,
        /// panic, timeout).
        tool_errors,
        /// Tool calls the parser could not read (left as content).
        parse_failures,
        /// Conversations that forked into more than one training row.
        forked_rollouts,
        /// Turns whose next prompt append mode re-rendered whole, the template having no
        /// exact token delta after the answer.
        append_fallbacks,
        /// Training samples written out.
        samples,
        /// Dataset rows skipped as bad.
        bad_rows,
        /// Rollouts a pause in `abort` mode cancelled (also in `rollouts_cancelled`).
        rollouts_aborted,
        /// Answers the server ended early (a pause in `continue` mode, or the server's own
        /// `/pause?mode=abort`) that were continued from the tokens they had.
        answers_continued,
        /// Training rows dropped for holding a token sampled more than
        /// `max_token_staleness` versions before the version current when its group was
        /// complete (`stale_tokens = "drop"`).
        rows_offpolicy_dropped,
        /// Tokens kept as context (mask 0) for the same reason (`stale_tokens = "mask"`).
        tokens_offpolicy_masked,
        /// Tokens of the rows written whose routed experts the server did not report (with
        /// `routed_experts`: each row's last token, and any the server left out).
        routing_missing_tokens,
    }
}

/// A latency histogram of fixed buckets (tool-dispatch's [`LATENCY_BUCKETS`], so that
/// generation and tool latencies read alike), recorded with atomics only.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    /// Per bucket, then the `+Inf` bucket (not cumulative).
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Latency {
    pub(crate) fn record(&self, latency: Duration) {
        let bucket = LATENCY_BUCKETS
            .iter()
            .position(|bound| latency <= *bound)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LatencySnapshot {
        let mut cumulative = 0;
        let mut buckets = Vec::with_capacity(LATENCY_BUCKETS.len());
        for (bound, count) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += count.load(Ordering::Relaxed);
            buckets.push((*bound, cumulative));
        }
        let count = cumulative + self.buckets[LATENCY_BUCKETS.len()].load(Ordering::Relaxed);
        LatencySnapshot {
            buckets,
            count,
            sum: Duration::from_micros(self.sum_micros.load(Ordering::Relaxed)),
        }
    }
}

/// A latency histogram as Prometheus exposes one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LatencySnapshot {
    /// `(upper bound, observations at most that long)`, cumulative, for each of
    /// [`LATENCY_BUCKETS`].
    pub buckets: Vec<(Duration, u64)>,
    /// Every observation (the `+Inf` bucket).
    pub count: u64,
    /// Their sum.
    pub sum: Duration,
}

/// Rollouts that failed, by cause: one counter per [`FailureCause`](crate::FailureCause).
#[derive(Debug, Default)]
pub(crate) struct Failures([AtomicU64; crate::FailureCause::ALL.len()]);

impl Failures {
    pub(crate) fn add(&self, cause: crate::FailureCause) {
        self.0[cause.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Vec<(crate::FailureCause, u64)> {
        crate::FailureCause::ALL
            .iter()
            .zip(&self.0)
            .map(|(cause, count)| (*cause, count.load(Ordering::Relaxed)))
            .collect()
    }
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// How the loop is doing, as [`Engine::health`](crate::Engine::health) reports it.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// Time since the heartbeat last ran; it runs every `heartbeat` interval unless the
    /// runtime's workers are blocked.
    pub heartbeat_age: Duration,
    /// 99th percentile of how late the heartbeat woke, since the start.
    pub scheduler_lag_p99: Duration,
    /// The largest lateness of the heartbeat since the start.
    pub scheduler_lag_max: Duration,
    /// Rollouts running.
    pub in_flight: usize,
    /// Rollouts of admitted groups waiting for a slot.
    pub queued: usize,
    /// The model version turns are now sampled under.
    pub model_version: u64,
    /// Whether admission has stopped (dataset done, group limit reached, or a drain).
    pub admission_closed: bool,
    /// Whether admission is paused ([`Engine::pause`](crate::Engine::pause)).
    pub paused: bool,
    /// Why no server can take requests, when none can (every one down or ejected).
    pub servers_unavailable: Option<String>,
    /// Counters.
    pub stats: Stats,
}

/// The heartbeat's record: when it last ran and how late it woke.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    start: Instant,
    last_micros: AtomicU64,
    lag: Mutex<Histogram<u64>>,
}

impl Default for Heartbeat {
    fn default() -> Heartbeat {
        let lag = Histogram::new_with_bounds(1, 3_600_000_000, 3)
            .unwrap_or_else(|e| unreachable!("fixed histogram bounds are valid: {e}"));
        Heartbeat {
            start: Instant::now(),
            last_micros: AtomicU64::new(0),
            lag: Mutex::new(lag),
        }
    }
}

impl Heartbeat {
    fn beat(&self, lag: Duration) {
        let now = self.start.elapsed().as_micros() as u64;
        self.last_micros.store(now, Ordering::Relaxed);
        let _ = lock(&self.lag).record(lag.as_micros().max(1) as u64);
    }

    pub(crate) fn age(&self) -> Duration {
        let now = self.start.elapsed().as_micros() as u64;
        Duration::from_micros(now.saturating_sub(self.last_micros.load(Ordering::Relaxed)))
    }

    pub(crate) fn lag(&self) -> (Duration, Duration) {
        let lag = lock(&self.lag);
        (
            Duration::from_micros(lag.value_at_quantile(0.99)),
            Duration::from_micros(lag.max()),
        )
    }

    /// Beats every `period` until `stop`, warning when a wake-up is later than `warn_after`.
    /// It is a task of its own: no tool, reward or rollout runs on it.
    pub(crate) async fn run(
        &self,
        period: Duration,
        warn_after: Duration,
        stop: CancellationToken,
    ) {
        loop {
            let before = Instant::now();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(period) => {}
            }
            let lag = before.elapsed().saturating_sub(period);
            self.beat(lag);
            if lag > warn_after {
                tracing::warn!(
                    lag_ms = lag.as_secs_f64() * 1e3,
                    "the heartbeat woke late: something blocks the runtime's workers"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_lands_in_the_first_bucket_that_holds_it_and_the_counts_add_up() {
        let latency = Latency::default();
        for ms in [0, 1, 2, 3, 400, 1_000_000] {
            latency.record(Duration::from_millis(ms));
        }
        let snapshot = latency.snapshot();
        assert_eq!(snapshot.count, 6);
        assert_eq!(snapshot.sum, Duration::from_millis(1_000_406));
        let at = |bound: Duration| {
            snapshot
                .buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map(|(_, count)| *count)
        };
        assert_eq!(at(Duration::from_millis(1)), Some(2), "0 ms and 1 ms");
        assert_eq!(at(Duration::from_micros(2_500)), Some(3));
        assert_eq!(at(Duration::from_millis(5)), Some(4));
        assert_eq!(at(Duration::from_millis(250)), Some(4));
        assert_eq!(at(Duration::from_millis(500)), Some(5));
        assert_eq!(
            snapshot.buckets.last().map(|(_, count)| *count),
            Some(5),
            "1000 s is past the last bound: only in the +Inf count"
        );
    }

    #[test]
    fn each_failure_is_counted_under_its_own_cause() {
        let failures = Failures::default();
        for (n, cause) in crate::FailureCause::ALL.iter().enumerate() {
            for _ in 0..=n {
                failures.add(*cause);
            }
        }
        let counted: Vec<(&str, u64)> = failures
            .snapshot()
            .into_iter()
            .map(|(cause, count)| (cause.as_str(), count))
            .collect();
        let expected: Vec<(&str, u64)> = crate::FailureCause::ALL
            .iter()
            .enumerate()
            .map(|(n, cause)| (cause.as_str(), n as u64 + 1))
            .collect();
        assert_eq!(counted, expected);
        for cause in ["agent", "empty_trace"] {
            assert!(counted.iter().any(|(name, _)| *name == cause), "{cause}");
        }
    }
}
