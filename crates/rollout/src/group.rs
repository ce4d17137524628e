//! A group's rollouts coming together: when the last one ends, the group is scored, its
//! advantages computed and its samples sent out through the output slot it reserved when it
//! was admitted.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use scoring::{Completion, Credit, Group, GroupAdvantages, GroupKind, GroupScores};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc::OwnedPermit;

use crate::{
    Generator, PromptMode, StaleTokens,
    health::Counters,
    lock,
    outcome::{FailureCause, Finished, RolloutFailure, Stop},
    shared::Shared,
};
use rollout_core::{
    AdvantageSpan, Message, RenderError, RenderState, SampleMetrics, TrainingRow, TrainingSample,
};

use crate::DatasetRow;

/// A scored group: its training samples, and the rollouts that failed.
#[derive(Debug, Clone)]
pub struct ScoredGroup {
    /// The group's id (admission order, from 0).
    pub group_id: u64,
    /// One sample per training row of each successful rollout, in rollout order.
    pub samples: Vec<TrainingSample>,
    /// Rollouts of the group that failed; the group was scored on the others.
    pub failures: Vec<RolloutFailure>,
    /// Reward statistics of the group, under TRL's metric names (`reward`, `reward_std`,
    /// `rewards/NAME/mean`, `frac_reward_zero_std`, ...).
    pub metrics: BTreeMap<String, f64>,
}

/// How a rollout of the group ended.
type Outcome = Result<Finished, RolloutFailure>;

/// A group in flight.
pub(crate) struct GroupState {
    pub(crate) group_id: u64,
    pub(crate) row: DatasetRow,
    /// The prompt rendered once for every rollout of the group to start from.
    pub(crate) first: Result<Arc<RenderState>, RenderError>,
    /// The version of the group's first request (`u64::MAX` before it).
    first_version: AtomicU64,
    /// Each rollout's outcome once it ends; boxed, so that a group waiting for its rollouts
    /// holds a pointer per rollout rather than room for a whole conversation.
    outcomes: Mutex<Vec<Option<Box<Outcome>>>>,
    remaining: AtomicUsize,
    output: Mutex<Option<OwnedPermit<ScoredGroup>>>,
}

impl GroupState {
    /// Resolves once the group's first turn is more than `max_staleness` versions behind
    /// the model version of `shared`.
    pub(crate) async fn stale<G>(&self, shared: &Shared<G>, max_staleness: u64) {
        let mut versions = shared.control.versions.subscribe();
        loop {
            let first = self.first_version();
            if first.is_some_and(|first| {
                *versions.borrow_and_update() > first.saturating_add(max_staleness)
            }) {
                return;
            }
            if versions.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    pub(crate) fn new(
        group_id: u64,
        row: DatasetRow,
        first: Result<RenderState, RenderError>,
        size: usize,
        output: OwnedPermit<ScoredGroup>,
    ) -> GroupState {
        GroupState {
            group_id,
            row,
            first: first.map(Arc::new),
            first_version: AtomicU64::new(u64::MAX),
            outcomes: Mutex::new((0..size).map(|_| None).collect()),
            remaining: AtomicUsize::new(size),
            output: Mutex::new(Some(output)),
        }
    }

    /// Notes a request sent under `version`.
    pub(crate) fn sampled_under(&self, version: u64) {
        self.first_version.fetch_min(version, Ordering::AcqRel);
    }

    /// The version of the group's first request, once one was sent.
    pub(crate) fn first_version(&self) -> Option<u64> {
        Some(self.first_version.load(Ordering::Acquire)).filter(|&v| v != u64::MAX)
    }

    /// Records rollout `index`'s outcome; `true` for the last one, whose caller finishes the
    /// group.
    pub(crate) fn complete(&self, index: usize, outcome: Outcome) -> bool {
        lock(&self.outcomes)[index] = Some(Box::new(outcome));
        self.remaining.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Marks the rollouts from `from` on as never started (admission stopped part-way);
    /// `true` when that completes the group.
    pub(crate) fn abandon_from(&self, from: usize, rollout_base: u64) -> bool {
        let mut last = false;
        let size = lock(&self.outcomes).len();
        for index in from..size {
            last = self.complete(
                index,
                Err(RolloutFailure {
                    rollout_id: rollout_core::RolloutId(rollout_base + index as u64),
                    group_id: self.group_id,
                    line: self.row.line,
                    attempts: 0,
                    cause: FailureCause::Cancelled,
                    message: "not started: admission stopped".to_owned(),
                }),
            );
        }
        last
    }
}

/// Scores a complete group and sends its samples, or drops it and counts why.
pub(crate) async fn finish<G: Generator>(shared: &Shared<G>, group: &GroupState) {
    let counters = &shared.tallies.counters;
    let outcomes = std::mem::take(&mut *lock(&group.outcomes));
    let Some(output) = lock(&group.output).take() else {
        return;
    };
    let Some((mut finished, failures)) = kept(shared, group, outcomes) else {
        return;
    };

    // What the samples need of each rollout is taken before its ids move into the group
    // the rewards see; the rewards see copies of the messages (the samples keep them typed).
    let append = shared.config.prompt_mode == PromptMode::Append;
    let metrics: Vec<SampleMetrics> = finished
        .iter()
        .map(|done| sample_metrics(done, append))
        .collect();
    let steps: Vec<Vec<Option<f64>>> = finished.iter().map(Finished::turn_step_rewards).collect();
    let (scores, advantages, per_turn) = score(shared, group, &mut finished, &steps).await;
    if advantages.kind == GroupKind::NonFinite {
        // Every reward the estimator took was finite and bounded, yet an advantage was not:
        // the group is an error of its own, never rows with a non-finite advantage.
        Counters::add(&counters.groups_non_finite, 1);
        tracing::error!(
            group = group.group_id,
            line = group.row.line,
            mean = advantages.mean,
            std = advantages.std,
            "the group's advantages came out NaN or infinite (eps = 0 over a std that \
             underflowed?); the group is dropped"
        );
        return;
    }
    if advantages.dropped {
        Counters::add(&counters.groups_zero_variance, 1);
        return;
    }

    let mut samples = Vec::new();
    for (index, ((done, metrics), steps)) in
        finished.into_iter().zip(metrics).zip(steps).enumerate()
    {
        let rewards: Map<String, Value> = scores
            .columns
            .iter()
            .map(|column| (column.name.clone(), json!(column.values[index])))
            .collect();
        let notes: Map<String, Value> = scores
            .columns
            .iter()
            .filter_map(|column| {
                let note = column.notes.get(index)?.as_ref()?;
                Some((column.name.clone(), Value::String(note.clone())))
            })
            .collect();
        if done.rows.len() > 1 {
            Counters::add(&counters.forked_rollouts, 1);
        }
        let environment = done
            .verdict
            .map(|verdict| verdict.details)
            .unwrap_or_default();
        // A rollout's one row takes what describes it; only a forked rollout's rows copy it.
        let described = (
            done.prompt,
            done.messages,
            rewards,
            metrics,
            environment,
            notes,
        );
        let copies = copies(described, done.rows.len());
        let given_steps = steps.iter().any(Option::is_some);
        let mut first_turn = 0;
        for (mut row, (prompt, completion, rewards, metrics, environment, reward_notes)) in
            done.rows.into_iter().zip(copies)
        {
            // The row's turns are the rollout's from `first_turn` on, one per span.
            let turns = first_turn..first_turn + row.turn_spans.len();
            first_turn = turns.end;
            if !fresh_enough(shared, &mut row) {
                continue;
            }
            if let Some(routing) = &row.routed_experts {
                Counters::add(
                    &counters.routing_missing_tokens,
                    routing.missing_tokens() as u64,
                );
            }
            let step_rewards = if given_steps {
                steps[turns.clone()].to_vec()
            } else {
                Vec::new()
            };
            let advantage_spans = match &per_turn {
                Some(per_turn) => row
                    .turn_spans
                    .iter()
                    .zip(&per_turn[index][turns])
                    .map(|(span, &advantage)| AdvantageSpan {
                        start: span.start,
                        end: span.end,
                        advantage,
                    })
                    .collect(),
                None => Vec::new(),
            };
            samples.push(TrainingSample {
                group_id: group.group_id,
                group_samples: 0,
                rollout_id: done.rollout_id,
                prompt,
                completion,
                input_ids: row.input_ids,
                completion_mask: row.completion_mask,
                old_log_probs: row.old_log_probs,
                advantage: advantages.advantages[index],
                reward: scores.rewards[index],
                rewards,
                model_version: row.model_version,
                token_versions: row.token_versions,
                routed_experts: row.routed_experts,
                metrics,
                environment,
                reward_notes,
                step_rewards,
                advantage_spans,
            });
        }
    }
    let group_samples = samples.len() as u64;
    for sample in &mut samples {
        sample.group_samples = group_samples;
    }
    Counters::add(&counters.groups_completed, 1);
    Counters::add(&counters.samples, group_samples);
    output.send(ScoredGroup {
        group_id: group.group_id,
        samples,
        failures,
        metrics: scores.metrics.to_map(),
    });
}

/// Applies `max_token_staleness` to a row about to be sent: its tokens sampled more than that
/// many versions before the current one are masked (`stale_tokens = "mask"`; a row left with
/// no trained token is dropped), or the row is dropped (`"drop"`). Whether it is kept.
fn fresh_enough<G>(shared: &Shared<G>, row: &mut TrainingRow) -> bool {
    let Some(bound) = shared.config.max_token_staleness else {
        return true;
    };
    let current = shared.control.model_version();
    let stale = |version: u64| current.saturating_sub(version) > bound;
    if !row.token_versions.iter().any(|span| stale(span.version)) {
        return true;
    }
    let counters = &shared.tallies.counters;
    if shared.config.stale_tokens == StaleTokens::Mask {
        let mut masked = 0;
        for span in row.token_versions.iter().filter(|span| stale(span.version)) {
            for mask in &mut row.completion_mask[span.start..span.end] {
                masked += u64::from(*mask);
                *mask = 0;
            }
        }
        Counters::add(&counters.tokens_offpolicy_masked, masked);
        if row.trained_tokens() > 0 {
            return true;
        }
    }
    Counters::add(&counters.rows_offpolicy_dropped, 1);
    false
}

/// `value` `n` times: `n - 1` copies, then `value` itself.
fn copies<T: Clone>(value: T, n: usize) -> impl Iterator<Item = T> {
    let mut value = Some(value);
    (0..n).filter_map(move |i| {
        if i + 1 == n {
            value.take()
        } else {
            value.clone()
        }
    })
}

/// The rollouts a group is scored on, and its failures; `None` (counted) when the group is
/// dropped: stale, cut by the drain, or with fewer than `min_group_size` successes.
fn kept<G>(
    shared: &Shared<G>,
    group: &GroupState,
    outcomes: Vec<Option<Box<Outcome>>>,
) -> Option<(Vec<Finished>, Vec<RolloutFailure>)> {
    let counters = &shared.tallies.counters;
    let mut finished = Vec::with_capacity(outcomes.len());
    let mut failures = Vec::new();
    for outcome in outcomes.into_iter().flatten() {
        match *outcome {
            Ok(done) => finished.push(done),
            Err(failure) => failures.push(failure),
        }
    }
    if failures.iter().any(|f| f.cause == FailureCause::Stale) {
        // A trainer would drop every sample of the group: none is sent.
        Counters::add(&counters.groups_stale, 1);
        tracing::debug!(group = group.group_id, "group dropped: stale");
        return None;
    }
    let cancelled = failures
        .iter()
        .filter(|f| f.cause == FailureCause::Cancelled)
        .count();
    if cancelled > 0 {
        // Scoring on the rollouts that happened to finish first would favour short answers.
        Counters::add(&counters.groups_cancelled, 1);
        tracing::debug!(
            group = group.group_id,
            cancelled,
            "group dropped: the drain cancelled some of its rollouts"
        );
        return None;
    }
    if finished.len() < shared.config.min_group_size.max(1) {
        Counters::add(&counters.groups_too_small, 1);
        tracing::warn!(
            group = group.group_id,
            line = group.row.line,
            succeeded = finished.len(),
            min_group_size = shared.config.min_group_size,
            first_failure = %failures.first().map(ToString::to_string).unwrap_or_default(),
            "group dropped: too few rollouts succeeded"
        );
        return None;
    }

    Some((finished, failures))
}

/// Scores the group on its rollouts' answers and computes their advantages; with turn
/// credit, each completion's advantage per turn too (`steps` holds each completion's step
/// rewards, one per turn).
async fn score<G>(
    shared: &Shared<G>,
    group: &GroupState,
    finished: &mut [Finished],
    steps: &[Vec<Option<f64>>],
) -> (GroupScores, GroupAdvantages, Option<Vec<Vec<f64>>>) {
    let completions = finished
        .iter_mut()
        .map(|done| Completion {
            text: done.answer(),
            messages: done.messages.iter().map(message_value).collect(),
            token_ids: std::mem::take(&mut done.sampled),
            has_training_row: !done.rows.is_empty(),
            rollout_reward: done.verdict.as_ref().and_then(|verdict| verdict.reward),
        })
        .collect();
    let scored = Arc::new(Group::new(
        Value::Array(group.row.prompt.iter().map(message_value).collect()),
        completions,
        group.row.columns.clone(),
    ));
    let scores = shared.wiring.scorer.score(Arc::clone(&scored)).await;
    let config = &shared.config.advantages;
    match config.credit {
        Credit::Episode => {
            let advantages = scores.advantages(&scored, config);
            (scores, advantages, None)
        }
        Credit::Turn { gamma } => {
            let (advantages, per_turn) = scores.advantages_per_turn(&scored, steps, gamma, config);
            (scores, advantages, Some(per_turn))
        }
    }
}

/// A message as the rewards see it: the JSON object it is.
fn message_value(message: &Message) -> Value {
    Value::Object(message.as_map().clone())
}

/// A sample's metrics (floats, as TRL's `RolloutSample.metrics`): `prompt_mode_append` is 1
/// when the rollout's prompts were built in append mode, 0 in rerender mode, and
/// `fallback_turns` counts the turns append mode had to re-render.
fn sample_metrics(done: &Finished, append: bool) -> SampleMetrics {
    // Sized once: the 13 always there, the environment's 3 and the named ones.
    let named = done.verdict.as_ref().map_or(0, |v| 3 + v.metrics.len()) + done.metrics.len();
    let mut metrics = SampleMetrics::with_capacity(13 + named);
    metrics.insert("turns", done.turns as f64);
    metrics.insert("prompt_mode_append", f64::from(u8::from(append)));
    metrics.insert("tool_calls", done.tool_calls as f64);
    metrics.insert("tool_errors", done.tool_errors as f64);
    metrics.insert("completion_tokens", done.sampled.len() as f64);
    metrics.insert("attempts", f64::from(done.attempts));
    metrics.insert("model_version_min", done.versions.0 as f64);
    metrics.insert("model_version_max", done.versions.1 as f64);
    metrics.insert("realigned_turns", done.tally.realign as f64);
    metrics.insert("forked_turns", done.tally.fork as f64);
    metrics.insert("drift_tokens", done.tally.drift_tokens as f64);
    metrics.insert("fallback_turns", done.fallbacks as f64);
    metrics.insert(
        "truncated",
        f64::from(u8::from(matches!(done.stop, Stop::Length | Stop::Context))),
    );
    if let Some(verdict) = &done.verdict {
        metrics.insert("env_done", f64::from(u8::from(done.stop == Stop::Done)));
        metrics.insert(
            "env_verified",
            f64::from(u8::from(verdict.reward.is_some())),
        );
        if let Some(done) = verdict.done {
            metrics.insert("env_verify_done", f64::from(u8::from(done)));
        }
        for (name, value) in &verdict.metrics {
            metrics.insert(format!("env/{name}"), *value);
        }
    }
    for (name, value) in &done.metrics {
        metrics.insert(name.clone(), *value);
    }
    metrics
}

#[cfg(test)]
mod tests {
    use super::copies;

    #[test]
    fn copies_gives_the_value_n_times_and_moves_it_last() {
        assert_eq!(copies(vec![7], 0).count(), 0);
        assert_eq!(copies(vec![7], 1).collect::<Vec<_>>(), [vec![7]]);
        assert_eq!(
            copies(vec![7], 3).collect::<Vec<_>>(),
            [vec![7], vec![7], vec![7]]
        );
        // The last is the value itself: its buffer, not a copy's.
        let value = vec![1, 2, 3];
        let buffer = value.as_ptr();
        let last = copies(value, 2).last();
        assert_eq!(last.map(|v| v.as_ptr()), Some(buffer));
    }
}
