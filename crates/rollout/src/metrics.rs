//! [`Metrics`]: everything the loop counts, at one moment, in one value. It is the one source
//! every report reads: [`Metrics::values`] as flat named numbers (what the Python bridge pushes
//! to TRL's `metrics_queue`), and with the `prometheus` feature [`Metrics::encode`], the
//! Prometheus exposition (through `prometheus-client`'s encoder).

use std::time::Duration;

use scoring::RewardStats;
use serde::Serialize;
use tool_dispatch::MetricsSnapshot;

use crate::{FailureCause, GeneratorStats, Health, LatencySnapshot};

/// What the loop has done and how it is doing; see [`Engine::metrics`](crate::Engine::metrics).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Metrics {
    /// Gauges and counters of the loop.
    pub health: Health,
    /// Rollouts that failed after their retries, by cause (every cause, zeros included).
    pub failures: Vec<(FailureCause, u64)>,
    /// How long each generation request took (each continuation of an aborted answer is
    /// one).
    pub generation_latency: LatencySnapshot,
    /// The generator's own counters (retries, ejections).
    pub generator: GeneratorStats,
    /// The tool dispatcher's, when the loop runs tools: an environment's session tools are
    /// counted there by name too (its sessions' tools are made from it).
    pub tools: Option<MetricsSnapshot>,
    /// Each reward function's counts by name, in the scorer's order: groups it ran on, and
    /// those it failed on by cause (an error, a panic, a timeout, the wrong number of scores).
    pub rewards: Vec<(String, RewardStats)>,
}

impl Metrics {
    /// Every number under a flat name: the loop's counters by their field names
    /// (`rollouts_completed`, `turns`, ...), `failures/CAUSE`, the gauges (`in_flight`,
    /// `queued`, `model_version`, `paused`, `admission_closed`, `heartbeat_age_s`,
    /// `scheduler_lag_p99_s`, `scheduler_lag_max_s`), the generator's (`server_retries`,
    /// `server_failures`, `server_ejections`) and, per tool, `tools/NAME/calls`,
    /// `tools/NAME/failed`, `tools/NAME/timed_out`, `tools/NAME/unavailable`,
    /// `tools/NAME/sessions_lost`, with `tools/unknown_name` and
    /// `tool_threads_stuck`, and per reward function `reward_functions/NAME/groups` and
    /// `reward_functions/NAME/CAUSE` for the groups it failed on (`errors`, `panics`,
    /// `timeouts`, `wrong_length`), and for one that calls a service (a judge)
    /// `reward_functions/NAME/calls`, `call_retries`, `cache_hits` and
    /// `calls_failed/CAUSE` (`transport`, `status`, `unreadable`).
    pub fn values(&self) -> Vec<(String, f64)> {
        let health = &self.health;
        let mut values = Vec::new();
        if let Ok(serde_json::Value::Object(counters)) = serde_json::to_value(health.stats) {
            for (key, value) in counters {
                if let Some(number) = value.as_f64() {
                    values.push((key, number));
                }
            }
        }
        for (cause, count) in &self.failures {
            values.push((format!("failures/{}", cause.as_str()), *count as f64));
        }
        let seconds = Duration::as_secs_f64;
        values.extend([
            ("heartbeat_age_s".to_owned(), seconds(&health.heartbeat_age)),
            (
                "scheduler_lag_p99_s".to_owned(),
                seconds(&health.scheduler_lag_p99),
            ),
            (
                "scheduler_lag_max_s".to_owned(),
                seconds(&health.scheduler_lag_max),
            ),
            ("in_flight".to_owned(), health.in_flight as f64),
            ("queued".to_owned(), health.queued as f64),
            ("model_version".to_owned(), health.model_version as f64),
            ("paused".to_owned(), f64::from(u8::from(health.paused))),
            (
                "admission_closed".to_owned(),
                f64::from(u8::from(health.admission_closed)),
            ),
            ("server_retries".to_owned(), self.generator.retries as f64),
            ("server_failures".to_owned(), self.generator.failures as f64),
            (
                "server_ejections".to_owned(),
                self.generator.ejections as f64,
            ),
        ]);
        if let Some(tools) = &self.tools {
            for tool in &tools.tools {
                let name = &tool.name;
                values.push((format!("tools/{name}/calls"), tool.calls as f64));
                values.push((format!("tools/{name}/failed"), tool.failed as f64));
                values.push((format!("tools/{name}/timed_out"), tool.timed_out as f64));
                values.push((format!("tools/{name}/unavailable"), tool.unavailable as f64));
                values.push((
                    format!("tools/{name}/sessions_lost"),
                    tool.sessions_lost as f64,
                ));
            }
            values.push(("tools/unknown_name".to_owned(), tools.unknown_tool as f64));
            values.push(("tool_threads_stuck".to_owned(), tools.pool.stuck as f64));
        }
        for (name, stats) in &self.rewards {
            values.push((
                format!("reward_functions/{name}/groups"),
                stats.groups as f64,
            ));
            for (what, _, count) in reward_failures(stats) {
                values.push((format!("reward_functions/{name}/{what}"), count as f64));
            }
            if let Some(calls) = &stats.calls {
                for (what, count) in [
                    ("calls", calls.calls),
                    ("call_retries", calls.retries),
                    ("cache_hits", calls.cache_hits),
                ] {
                    values.push((format!("reward_functions/{name}/{what}"), count as f64));
                }
                for (cause, count) in calls.failures() {
                    values.push((
                        format!("reward_functions/{name}/calls_failed/{cause}"),
                        count as f64,
                    ));
                }
            }
        }
        values
    }
}

/// A reward function's failed groups by cause: the name in [`Metrics::values`], the outcome
/// in the exposition, the count.
fn reward_failures(stats: &RewardStats) -> [(&'static str, &'static str, u64); 4] {
    [
        ("errors", "error", stats.errors),
        ("panics", "panic", stats.panics),
        ("timeouts", "timeout", stats.timeouts),
        ("wrong_length", "wrong_length", stats.wrong_length),
    ]
}

#[cfg(feature = "prometheus")]
mod prometheus {
    //! The Prometheus exposition of [`Metrics`], written by `prometheus-client`'s encoder.

    use std::{collections::HashMap, fmt};

    use prometheus_client::{
        encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet},
        metrics::MetricType::{self, Counter, Gauge},
    };

    use scoring::CallStats;

    use super::{LatencySnapshot, Metrics, reward_failures};

    /// Writes one metric family of one sample (no labels).
    fn single(
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        kind: MetricType,
        value: f64,
    ) -> fmt::Result {
        let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
        sample(&mut metric, kind, value)
    }

    fn sample(metric: &mut MetricEncoder<'_>, kind: MetricType, value: f64) -> fmt::Result {
        match kind {
            MetricType::Counter => {
                metric.encode_counter::<NoLabelSet, _, f64>(&(value.max(0.0) as u64), None)
            }
            _ => metric.encode_gauge(&value),
        }
    }

    /// Writes one family with one sample per label value.
    fn labelled(
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        kind: MetricType,
        samples: &[(&[(&str, &str)], f64)],
    ) -> fmt::Result {
        let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
        for (labels, value) in samples {
            let labels: Vec<(&str, &str)> = labels.to_vec();
            let mut family = metric.encode_family(&labels)?;
            sample(&mut family, kind, *value)?;
        }
        Ok(())
    }

    /// The encoder takes each bucket's own count (it writes them cumulated, and the `+Inf`
    /// bucket from `count`): the snapshot's cumulative counts are turned back into those.
    fn histogram(metric: &mut MetricEncoder<'_>, latency: &LatencySnapshot) -> fmt::Result {
        let mut below = 0;
        let buckets: Vec<(f64, u64)> = latency
            .buckets
            .iter()
            .map(|(bound, cumulative)| {
                let own = cumulative.saturating_sub(below);
                below = below.max(*cumulative);
                (bound.as_secs_f64(), own)
            })
            .collect();
        metric.encode_histogram::<NoLabelSet>(
            latency.sum.as_secs_f64(),
            latency.count,
            &buckets,
            None::<&HashMap<usize, _>>,
        )
    }

    impl Metrics {
        /// Writes every metric, each name prefixed `async_grpo_` (counters end in `_total`
        /// as the encoder writes them): rollouts and groups by outcome, failures by cause,
        /// turns, prompt and sampled tokens, tool calls by tool and outcome, tool and
        /// generation latency histograms, retries, server ejections, the scheduler's lag,
        /// rollouts in flight and queued, staleness drops, the model version, append-mode
        /// fallbacks. Call it from a `prometheus_client::collector::Collector`.
        pub fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            self.encode_rollouts(encoder)?;
            self.encode_failures(encoder)?;
            self.encode_groups(encoder)?;
            self.encode_counters(encoder)?;
            self.encode_tools(encoder)?;
            self.encode_rewards(encoder)?;
            self.encode_generation_latency(encoder)?;
            self.encode_gauges(encoder)
        }

        /// Rollouts by outcome, and the attempts started, retried and aborted by a pause.
        fn encode_rollouts(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let stats = &self.health.stats;
            let n = |value: u64| value as f64;
            labelled(
                encoder,
                "async_grpo_rollouts",
                "Rollouts that ended, by outcome (failed: after their retries).",
                Counter,
                &[
                    (&[("outcome", "completed")], n(stats.rollouts_completed)),
                    (&[("outcome", "failed")], n(stats.rollouts_failed)),
                    (&[("outcome", "cancelled")], n(stats.rollouts_cancelled)),
                ],
            )?;
            single(
                encoder,
                "async_grpo_rollouts_started",
                "Rollout attempts started (a retry counts again).",
                Counter,
                n(stats.rollouts_started),
            )?;
            single(
                encoder,
                "async_grpo_rollout_retries",
                "Rollout attempts retried after a failure.",
                Counter,
                n(stats.rollouts_retried),
            )?;
            single(
                encoder,
                "async_grpo_rollouts_aborted_by_pause",
                "Rollouts a pause in abort mode cancelled (also cancelled rollouts).",
                Counter,
                n(stats.rollouts_aborted),
            )
        }

        /// Rollouts that failed after their retries, one sample per cause.
        fn encode_failures(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let causes: Vec<([(&str, &str); 1], f64)> = self
                .failures
                .iter()
                .map(|(cause, count)| ([("cause", cause.as_str())], *count as f64))
                .collect();
            let causes: Vec<(&[(&str, &str)], f64)> = causes
                .iter()
                .map(|(labels, value)| (labels.as_slice(), *value))
                .collect();
            labelled(
                encoder,
                "async_grpo_rollout_failures",
                "Rollouts that failed after their retries, by cause.",
                Counter,
                &causes,
            )
        }

        /// Admission: the groups admitted, and how each ended (completed or why dropped).
        fn encode_groups(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let stats = &self.health.stats;
            let n = |value: u64| value as f64;
            single(
                encoder,
                "async_grpo_groups_admitted",
                "Groups admitted (one dataset row each).",
                Counter,
                n(stats.groups_admitted),
            )?;
            labelled(
                encoder,
                "async_grpo_groups",
                "Groups that ended, by outcome: completed (scored and sent), or dropped as \
                 too_small, zero_variance, non_finite (an advantage NaN or infinite), cancelled \
                 (by a drain or a pause) or stale (more than max_staleness versions behind).",
                Counter,
                &[
                    (&[("outcome", "completed")], n(stats.groups_completed)),
                    (&[("outcome", "too_small")], n(stats.groups_too_small)),
                    (
                        &[("outcome", "zero_variance")],
                        n(stats.groups_zero_variance),
                    ),
                    (&[("outcome", "non_finite")], n(stats.groups_non_finite)),
                    (&[("outcome", "cancelled")], n(stats.groups_cancelled)),
                    (&[("outcome", "stale")], n(stats.groups_stale)),
                ],
            )
        }

        /// The work done, one counter each: turns, tokens, samples, unreadable tool calls,
        /// forks, append-mode fallbacks, bad rows, and the client's retries and ejections.
        fn encode_counters(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let stats = &self.health.stats;
            for (name, help, value) in [
                ("async_grpo_turns", "Generation calls.", stats.turns),
                (
                    "async_grpo_prompt_tokens",
                    "Prompt tokens sent (each turn's whole prompt).",
                    stats.prompt_tokens,
                ),
                (
                    "async_grpo_sampled_tokens",
                    "Tokens sampled.",
                    stats.sampled_tokens,
                ),
                (
                    "async_grpo_samples",
                    "Training samples the loop handed to its output.",
                    stats.samples,
                ),
                (
                    "async_grpo_tool_call_parse_failures",
                    "Tool calls the parser could not read.",
                    stats.parse_failures,
                ),
                (
                    "async_grpo_forked_rollouts",
                    "Rollouts whose conversation forked into more than one training row.",
                    stats.forked_rollouts,
                ),
                (
                    "async_grpo_prompt_mode_fallbacks",
                    "Turns append mode had to re-render whole (no exact token delta).",
                    stats.append_fallbacks,
                ),
                (
                    "async_grpo_bad_rows",
                    "Dataset rows skipped as bad.",
                    stats.bad_rows,
                ),
                (
                    "async_grpo_answers_continued",
                    "Answers the server ended early (a pause in continue mode) continued from \
                     the tokens they had.",
                    stats.answers_continued,
                ),
                (
                    "async_grpo_rows_offpolicy_dropped",
                    "Training rows dropped for a token more than max_token_staleness versions \
                     old.",
                    stats.rows_offpolicy_dropped,
                ),
                (
                    "async_grpo_tokens_offpolicy_masked",
                    "Sampled tokens more than max_token_staleness versions old, masked out of \
                     training.",
                    stats.tokens_offpolicy_masked,
                ),
                (
                    "async_grpo_routing_missing_tokens",
                    "Tokens of rows written whose routed experts the server did not report.",
                    stats.routing_missing_tokens,
                ),
                (
                    "async_grpo_server_retries",
                    "Server requests retried by the client.",
                    self.generator.retries,
                ),
                (
                    "async_grpo_server_ejections",
                    "Servers ejected after a failure.",
                    self.generator.ejections,
                ),
            ] {
                single(encoder, name, help, Counter, value as f64)?;
            }
            Ok(())
        }

        /// The generation latency histogram.
        fn encode_generation_latency(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let mut metric = encoder.encode_descriptor(
                "async_grpo_generation_duration_seconds",
                "How long each generation request took.",
                None,
                MetricType::Histogram,
            )?;
            histogram(&mut metric, &self.generation_latency)
        }

        /// The gauges: rollouts in flight and queued, the model version, whether admission is
        /// paused or closed, the heartbeat's age and the scheduler's lag.
        fn encode_gauges(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let health = &self.health;
            for (name, help, value) in [
                (
                    "async_grpo_rollouts_in_flight",
                    "Rollouts running.",
                    health.in_flight as f64,
                ),
                (
                    "async_grpo_rollouts_queued",
                    "Rollouts of admitted groups waiting for a slot.",
                    health.queued as f64,
                ),
                (
                    "async_grpo_model_version",
                    "The model version turns are sampled under now.",
                    health.model_version as f64,
                ),
                (
                    "async_grpo_paused",
                    "1 while admission is paused.",
                    f64::from(u8::from(health.paused)),
                ),
                (
                    "async_grpo_admission_closed",
                    "1 once admission has stopped for good (dataset done, limit, drain).",
                    f64::from(u8::from(health.admission_closed)),
                ),
                (
                    "async_grpo_heartbeat_age_seconds",
                    "Time since the runtime's heartbeat task last ran.",
                    health.heartbeat_age.as_secs_f64(),
                ),
                (
                    "async_grpo_scheduler_lag_p99_seconds",
                    "99th percentile of how late the heartbeat woke, since the start.",
                    health.scheduler_lag_p99.as_secs_f64(),
                ),
                (
                    "async_grpo_scheduler_lag_max_seconds",
                    "The largest lateness of the heartbeat, since the start.",
                    health.scheduler_lag_max.as_secs_f64(),
                ),
            ] {
                single(encoder, name, help, Gauge, value)?;
            }
            Ok(())
        }

        /// Groups each reward function ran on, and those it failed on by cause.
        fn encode_rewards(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            if self.rewards.is_empty() {
                return Ok(());
            }
            let mut metric = encoder.encode_descriptor(
                "async_grpo_reward_function_groups",
                "Groups each reward function ran on, by outcome: scored, or failed by cause \
                 (error, panic, timeout, wrong_length); a failed function's column is empty \
                 for that group.",
                None,
                MetricType::Counter,
            )?;
            for (name, stats) in &self.rewards {
                let failures = reward_failures(stats);
                let failed: u64 = failures.iter().map(|(_, _, count)| count).sum();
                let scored = stats.groups.saturating_sub(failed);
                let outcomes = std::iter::once(("scored", scored))
                    .chain(failures.map(|(_, outcome, count)| (outcome, count)));
                for (outcome, count) in outcomes {
                    let labels = [("reward", name.as_str()), ("outcome", outcome)];
                    let mut family = metric.encode_family(&labels)?;
                    sample(&mut family, MetricType::Counter, count as f64)?;
                }
            }
            let calls: Vec<(&str, &CallStats)> = self
                .rewards
                .iter()
                .filter_map(|(name, stats)| Some((name.as_str(), stats.calls.as_ref()?)))
                .collect();
            if calls.is_empty() {
                return Ok(());
            }
            let mut metric = encoder.encode_descriptor(
                "async_grpo_reward_calls",
                "Calls of each reward function that calls a service (a judge, a reward \
                 service), by outcome: answered, cached (from its cache, no call), or failed \
                 by cause (transport, status, unreadable), which leaves what it scores \
                 unscorable.",
                None,
                MetricType::Counter,
            )?;
            for (name, calls) in &calls {
                let failures = calls.failures();
                let answered = calls.calls.saturating_sub(calls.failed());
                let outcomes = [("answered", answered), ("cached", calls.cache_hits)]
                    .into_iter()
                    .chain(failures);
                for (outcome, count) in outcomes {
                    let labels = [("reward", *name), ("outcome", outcome)];
                    let mut family = metric.encode_family(&labels)?;
                    sample(&mut family, MetricType::Counter, count as f64)?;
                }
            }
            let mut metric = encoder.encode_descriptor(
                "async_grpo_reward_call_retries",
                "Attempts each reward function that calls a service made again after one \
                 failed.",
                None,
                MetricType::Counter,
            )?;
            for (name, calls) in &calls {
                let labels = [("reward", *name)];
                let mut family = metric.encode_family(&labels)?;
                sample(&mut family, MetricType::Counter, calls.retries as f64)?;
            }
            Ok(())
        }

        /// Tool calls by tool and outcome, and each tool's latency histogram.
        fn encode_tools(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
            let Some(tools) = &self.tools else {
                return Ok(());
            };
            let mut metric = encoder.encode_descriptor(
                "async_grpo_tool_calls",
                "Tool calls, by tool and outcome (unknown_tool: a name no tool has).",
                None,
                MetricType::Counter,
            )?;
            for tool in &tools.tools {
                for (outcome, count) in [
                    ("ok", tool.ok),
                    ("invalid_arguments", tool.invalid_arguments),
                    ("failed", tool.failed),
                    ("panicked", tool.panicked),
                    ("timed_out", tool.timed_out),
                    ("cancelled", tool.cancelled),
                    ("unavailable", tool.unavailable),
                ] {
                    let labels = [("tool", tool.name.as_str()), ("outcome", outcome)];
                    let mut family = metric.encode_family(&labels)?;
                    sample(&mut family, MetricType::Counter, count as f64)?;
                }
            }
            let labels = [("tool", ""), ("outcome", "unknown_tool")];
            let mut family = metric.encode_family(&labels)?;
            sample(&mut family, MetricType::Counter, tools.unknown_tool as f64)?;
            let mut metric = encoder.encode_descriptor(
                "async_grpo_tool_sessions_lost",
                "Sessions of a per-rollout tool (a python session) that lost their state \
                 part-way: the interpreter or kernel died or was killed at a call's timeout.",
                None,
                MetricType::Counter,
            )?;
            for tool in &tools.tools {
                let labels = [("tool", tool.name.as_str())];
                let mut family = metric.encode_family(&labels)?;
                sample(&mut family, MetricType::Counter, tool.sessions_lost as f64)?;
            }
            let mut metric = encoder.encode_descriptor(
                "async_grpo_tool_call_duration_seconds",
                "How long each tool call took, from its start to its result.",
                None,
                MetricType::Histogram,
            )?;
            for tool in &tools.tools {
                let labels = [("tool", tool.name.as_str())];
                let mut family = metric.encode_family(&labels)?;
                histogram(
                    &mut family,
                    &LatencySnapshot {
                        buckets: tool.latency_buckets.clone(),
                        count: tool.latency.count,
                        sum: tool.latency_sum,
                    },
                )?;
            }
            Ok(())
        }
    }
}

#[cfg(all(test, feature = "prometheus"))]
mod tests {
    use std::time::Duration;

    use prometheus_client::{
        collector::Collector, encoding::DescriptorEncoder, registry::Registry,
    };

    use super::*;
    use crate::Stats;

    #[derive(Debug)]
    struct Fixed(Metrics);

    impl Collector for Fixed {
        fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            self.0.encode(&mut encoder)
        }
    }

    fn metrics(latency: LatencySnapshot) -> Metrics {
        let stats = Stats {
            turns: 7,
            groups_stale: 2,
            ..Stats::default()
        };
        Metrics {
            health: Health {
                heartbeat_age: Duration::from_millis(20),
                scheduler_lag_p99: Duration::ZERO,
                scheduler_lag_max: Duration::ZERO,
                in_flight: 3,
                queued: 1,
                model_version: 4,
                admission_closed: false,
                paused: true,
                servers_unavailable: None,
                stats,
            },
            failures: vec![(FailureCause::Deadline, 5)],
            generation_latency: latency,
            generator: GeneratorStats::new(10, 2, 1, 1),
            tools: None,
            rewards: vec![(
                "judge".to_owned(),
                RewardStats {
                    groups: 9,
                    errors: 2,
                    timeouts: 1,
                    calls: Some(scoring::CallStats {
                        calls: 30,
                        retries: 4,
                        cache_hits: 6,
                        transport: 1,
                        status: 2,
                        unreadable: 3,
                        last_failure: None,
                    }),
                    ..RewardStats::default()
                },
            )],
        }
    }

    #[test]
    fn the_exposition_counts_each_histogram_bucket_once_and_names_counters_with_total() {
        let latency = LatencySnapshot {
            buckets: vec![
                (Duration::from_millis(1), 2),
                (Duration::from_millis(10), 2),
                (Duration::from_millis(100), 5),
            ],
            count: 6,
            sum: Duration::from_millis(250),
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Fixed(metrics(latency))));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
            .expect("encoded");
        for line in [
            "async_grpo_turns_total 7",
            "async_grpo_groups_total{outcome=\"stale\"} 2",
            "async_grpo_rollout_failures_total{cause=\"deadline\"} 5",
            "async_grpo_model_version 4.0",
            "async_grpo_paused 1.0",
            "async_grpo_server_retries_total 2",
            "async_grpo_generation_duration_seconds_bucket{le=\"0.001\"} 2",
            "async_grpo_generation_duration_seconds_bucket{le=\"0.01\"} 2",
            "async_grpo_generation_duration_seconds_bucket{le=\"0.1\"} 5",
            "async_grpo_generation_duration_seconds_bucket{le=\"+Inf\"} 6",
            "async_grpo_generation_duration_seconds_count 6",
            "async_grpo_reward_function_groups_total{reward=\"judge\",outcome=\"scored\"} 6",
            "async_grpo_reward_function_groups_total{reward=\"judge\",outcome=\"error\"} 2",
            "async_grpo_reward_function_groups_total{reward=\"judge\",outcome=\"timeout\"} 1",
            "async_grpo_reward_calls_total{reward=\"judge\",outcome=\"answered\"} 24",
            "async_grpo_reward_calls_total{reward=\"judge\",outcome=\"cached\"} 6",
            "async_grpo_reward_calls_total{reward=\"judge\",outcome=\"status\"} 2",
            "async_grpo_reward_calls_total{reward=\"judge\",outcome=\"unreadable\"} 3",
            "async_grpo_reward_call_retries_total{reward=\"judge\"} 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in\n{text}");
        }
    }

    #[test]
    fn the_flat_values_are_the_same_numbers_under_the_bridge_s_names() {
        let values: std::collections::BTreeMap<String, f64> = metrics(LatencySnapshot::default())
            .values()
            .into_iter()
            .collect();
        assert_eq!(values["turns"], 7.0);
        assert_eq!(values["groups_stale"], 2.0);
        assert_eq!(values["failures/deadline"], 5.0);
        assert_eq!(values["in_flight"], 3.0);
        assert_eq!(values["paused"], 1.0);
        assert_eq!(values["server_retries"], 2.0);
        assert_eq!(values["reward_functions/judge/groups"], 9.0);
        assert_eq!(values["reward_functions/judge/timeouts"], 1.0);
        assert_eq!(values["reward_functions/judge/calls"], 30.0);
        assert_eq!(values["reward_functions/judge/cache_hits"], 6.0);
        assert_eq!(values["reward_functions/judge/calls_failed/transport"], 1.0);
    }
}
