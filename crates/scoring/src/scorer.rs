//! [`Scorer`]: runs every reward function of a group concurrently and combines their columns.

use std::{
    collections::BTreeMap,
    fmt,
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{FutureExt, future::join_all};
use process::panic_message;
use serde::Serialize;

use crate::{
    advantage::{
        AdvantageConfig, CompletionReward, GroupAdvantages, GroupKind, MAX_REWARD,
        group_advantages, in_range, turn_advantages, turn_returns,
    },
    group::Group,
    pool::RewardPool,
    reward::{CallStats, Notes, Reward, Runner, Scores},
};

/// How a [`Scorer`] is sized.
#[derive(Debug, Clone)]
pub struct ScorerConfig {
    threads: usize,
    default_timeout: Duration,
    queue_timeout: Duration,
    thread_name: String,
}

impl Default for ScorerConfig {
    /// As many threads as the machine has cores, a 60 s timeout from a function's start, and
    /// up to 10 minutes waiting for a thread.
    fn default() -> ScorerConfig {
        ScorerConfig {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            default_timeout: Duration::from_secs(60),
            queue_timeout: Duration::from_secs(600),
            thread_name: "reward".to_owned(),
        }
    }
}

impl ScorerConfig {
    /// Threads for sync reward functions (at least 1).
    pub fn threads(mut self, threads: usize) -> ScorerConfig {
        self.threads = threads.max(1);
        self
    }

    /// The timeout of a function that sets none.
    pub fn default_timeout(mut self, timeout: Duration) -> ScorerConfig {
        self.default_timeout = timeout;
        self
    }

    /// How long a sync function may wait for a pool thread before its column is given up for
    /// that group (default 10 minutes). Its own timeout counts from when it starts.
    pub fn queue_timeout(mut self, timeout: Duration) -> ScorerConfig {
        self.queue_timeout = timeout;
        self
    }

    /// The prefix of the pool threads' names.
    pub fn thread_name(mut self, name: impl Into<String>) -> ScorerConfig {
        self.thread_name = name.into();
        self
    }
}

/// Why a [`Scorer`] could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScorerError {
    /// A reward function has an empty name.
    #[error("a reward function needs a non-empty name")]
    EmptyName,
    /// Two reward functions share a name (metrics would mix them).
    #[error("two reward functions are named '{name}'; rename one with Reward::named")]
    Duplicate {
        /// The shared name.
        name: String,
    },
    /// A weight is NaN or infinite.
    #[error("reward function '{name}' has weight {weight}, which is not a finite number")]
    BadWeight {
        /// The function's name.
        name: String,
        /// The weight given.
        weight: f64,
    },
    /// The thread pool could not start.
    #[error("could not start the reward thread pool: {0}")]
    Pool(String),
}

/// Why a column has no scores for a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The function returned an error.
    Error,
    /// The function panicked (caught).
    Panic,
    /// The function took longer than its timeout.
    Timeout,
    /// The function returned a different number of scores than there are completions.
    WrongLength,
}

/// A column's failure for one group, with the message kept for the metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ColumnFailure {
    /// What went wrong.
    pub kind: FailureKind,
    /// The error or panic message.
    pub message: String,
}

/// One reward function's scores for a group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Column {
    /// The function's name.
    pub name: String,
    /// Its weight.
    pub weight: f64,
    /// One score per completion; all `None` when the function failed.
    pub values: Vec<Option<f64>>,
    /// Why the function gave nothing, if it failed.
    pub failure: Option<ColumnFailure>,
    /// Completions whose score was NaN, infinite or beyond
    /// [`MAX_REWARD`](crate::MAX_REWARD): each is an error of its own, scored `None`.
    pub non_finite: Vec<usize>,
    /// One note per completion when the function keeps them (a judge's answers), else
    /// empty.
    pub notes: Notes,
}

/// Every column of a group, the combined rewards and the group's metrics.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupScores {
    /// One column per reward function, in registration order.
    pub columns: Vec<Column>,
    /// Per completion: the weighted sum of its scores, skipping `None`s; `None` when every
    /// column is `None` (the completion is unscorable).
    pub rewards: Vec<Option<f64>>,
    /// Summary of the group.
    pub metrics: GroupMetrics,
}

impl GroupScores {
    /// The group's advantages: `group` says which completions produced a training row.
    pub fn advantages(&self, group: &Group, config: &AdvantageConfig) -> GroupAdvantages {
        group_advantages(&self.completion_rewards(group), config)
    }

    /// With turn-level credit: the group's advantages over its completions' episode returns,
    /// and each completion's advantage per turn. `steps` holds each completion's step
    /// rewards, one per turn; a turn's return is its step reward plus `gamma` times the next
    /// turn's, the completion's reward counting at its last turn ([`turn_returns`]). An
    /// unscorable completion's turns get 0.
    pub fn advantages_per_turn(
        &self,
        group: &Group,
        steps: &[Vec<Option<f64>>],
        gamma: f64,
        config: &AdvantageConfig,
    ) -> (GroupAdvantages, Vec<Vec<f64>>) {
        let returns: Vec<Option<Vec<f64>>> = self
            .rewards
            .iter()
            .zip(steps)
            .map(|(reward, steps)| reward.map(|outcome| turn_returns(steps, outcome, gamma)))
            .collect();
        let episodes: Vec<CompletionReward> = self
            .completion_rewards(group)
            .into_iter()
            .zip(&returns)
            .map(|(completion, returns)| CompletionReward {
                reward: returns.as_ref().map(|returns| returns[0]),
                ..completion
            })
            .collect();
        let advantages = group_advantages(&episodes, config);
        let per_turn: Vec<Vec<f64>> = returns
            .iter()
            .zip(&episodes)
            .zip(steps)
            .map(|((returns, episode), steps)| match returns {
                Some(returns) => turn_advantages(returns, episode, &advantages, config),
                None => vec![0.0; steps.len()],
            })
            .collect();
        let advantages = advantages.check_finite(per_turn.iter().flatten());
        if advantages.kind == GroupKind::NonFinite {
            let zeros = per_turn
                .iter()
                .map(|turns| vec![0.0; turns.len()])
                .collect();
            return (advantages, zeros);
        }
        (advantages, per_turn)
    }

    /// What the estimators take, per completion.
    pub fn completion_rewards(&self, group: &Group) -> Vec<CompletionReward> {
        self.rewards
            .iter()
            .zip(&group.completions)
            .map(|(reward, completion)| CompletionReward {
                reward: *reward,
                has_training_row: completion.has_training_row,
            })
            .collect()
    }
}

/// A column's summary over one group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ColumnMetrics {
    /// The function's name.
    pub name: String,
    /// Mean of its scores (None when it scored nothing).
    pub mean: Option<f64>,
    /// Population std of its scores (None when it scored nothing).
    pub std: Option<f64>,
    /// Whether the function failed on this group.
    pub failed: bool,
}

/// A group's summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupMetrics {
    /// Mean combined reward over the scorable completions.
    pub reward_mean: Option<f64>,
    /// Population std of the combined reward over the scorable completions.
    pub reward_std: Option<f64>,
    /// One entry per column.
    pub columns: Vec<ColumnMetrics>,
    /// Fraction of completions that are unscorable.
    pub frac_unscorable: f64,
    /// Whether every scorable completion has the same combined reward.
    pub zero_std: bool,
}

impl GroupMetrics {
    fn new(columns: &[Column], rewards: &[Option<f64>]) -> GroupMetrics {
        let (reward_mean, reward_std) = mean_std(rewards.iter().flatten().copied());
        let scorable = rewards.iter().flatten().count();
        GroupMetrics {
            reward_mean,
            reward_std,
            columns: columns
                .iter()
                .map(|column| {
                    let (mean, std) = mean_std(column.values.iter().flatten().copied());
                    ColumnMetrics {
                        name: column.name.clone(),
                        mean,
                        std,
                        failed: column.failure.is_some(),
                    }
                })
                .collect(),
            frac_unscorable: if rewards.is_empty() {
                0.0
            } else {
                (rewards.len() - scorable) as f64 / rewards.len() as f64
            },
            zero_std: reward_std == Some(0.0),
        }
    }

    /// The metrics under the names TRL logs: `reward`, `reward_std`, `rewards/<name>/mean`,
    /// `rewards/<name>/std`, `frac_reward_zero_std`, plus `frac_unscorable`. Values that do
    /// not exist for this group (no scorable completion) are left out.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        let mut map = BTreeMap::new();
        if let Some(mean) = self.reward_mean {
            map.insert("reward".to_owned(), mean);
        }
        if let Some(std) = self.reward_std {
            map.insert("reward_std".to_owned(), std);
        }
        for column in &self.columns {
            if let Some(mean) = column.mean {
                map.insert(format!("rewards/{}/mean", column.name), mean);
            }
            if let Some(std) = column.std {
                map.insert(format!("rewards/{}/std", column.name), std);
            }
        }
        map.insert(
            "frac_reward_zero_std".to_owned(),
            if self.zero_std { 1.0 } else { 0.0 },
        );
        map.insert("frac_unscorable".to_owned(), self.frac_unscorable);
        map
    }
}

fn mean_std(values: impl Iterator<Item = f64> + Clone) -> (Option<f64>, Option<f64>) {
    let n = values.clone().count();
    if n == 0 {
        return (None, None);
    }
    let mean = values.clone().sum::<f64>() / n as f64;
    let variance = values.map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
    (Some(mean), Some(variance.sqrt()))
}

/// Counts of one reward function over every group scored so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RewardStats {
    /// Groups the function was run on.
    pub groups: u64,
    /// Groups where it returned an error.
    pub errors: u64,
    /// Groups where it panicked.
    pub panics: u64,
    /// Groups where it timed out.
    pub timeouts: u64,
    /// Groups where it returned the wrong number of scores.
    pub wrong_length: u64,
    /// Scores that were NaN, infinite or beyond [`MAX_REWARD`](crate::MAX_REWARD).
    pub non_finite: u64,
    /// The most recent failure, with its message.
    pub last_failure: Option<ColumnFailure>,
    /// For a function that calls a service (a judge, a reward service), what its calls did.
    pub calls: Option<CallStats>,
}

#[derive(Debug, Default)]
struct Counters {
    groups: AtomicU64,
    errors: AtomicU64,
    panics: AtomicU64,
    timeouts: AtomicU64,
    wrong_length: AtomicU64,
    non_finite: AtomicU64,
    last_failure: Mutex<Option<ColumnFailure>>,
}

impl Counters {
    fn snapshot(&self) -> RewardStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        RewardStats {
            groups: get(&self.groups),
            errors: get(&self.errors),
            panics: get(&self.panics),
            timeouts: get(&self.timeouts),
            wrong_length: get(&self.wrong_length),
            non_finite: get(&self.non_finite),
            last_failure: self
                .last_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            calls: None,
        }
    }

    fn count(&self, failure: Option<&ColumnFailure>) {
        self.groups.fetch_add(1, Ordering::Relaxed);
        let Some(failure) = failure else { return };
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(failure.clone());
        let counter = match failure.kind {
            FailureKind::Error => &self.errors,
            FailureKind::Panic => &self.panics,
            FailureKind::Timeout => &self.timeouts,
            FailureKind::WrongLength => &self.wrong_length,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Scores groups: every reward function of a group runs at once (sync ones on the scorer's
/// own pool, async ones awaited); a function that fails, panics or times out leaves its
/// column `None` for that group, counted, and the group is scored on the other columns.
/// Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Scorer {
    inner: Arc<Inner>,
}

struct Inner {
    rewards: Vec<Reward>,
    counters: Vec<Counters>,
    pool: RewardPool,
    default_timeout: Duration,
    queue_timeout: Duration,
}

impl Scorer {
    /// A scorer for `rewards`, in this order. Requires a tokio runtime with time enabled.
    pub fn new(rewards: Vec<Reward>, config: ScorerConfig) -> Result<Scorer, ScorerError> {
        Scorer::check(&rewards)?;
        let pool = RewardPool::new(config.threads, &config.thread_name)
            .map_err(|error| ScorerError::Pool(error.to_string()))?;
        let counters = rewards.iter().map(|_| Counters::default()).collect();
        Ok(Scorer {
            inner: Arc::new(Inner {
                rewards,
                counters,
                pool,
                default_timeout: config.default_timeout,
                queue_timeout: config.queue_timeout,
            }),
        })
    }

    /// What [`Scorer::new`] checks of `rewards` before it starts anything: every name given
    /// and none twice, every weight finite.
    pub fn check(rewards: &[Reward]) -> Result<(), ScorerError> {
        let mut names = std::collections::HashSet::new();
        for reward in rewards {
            if reward.name.trim().is_empty() {
                return Err(ScorerError::EmptyName);
            }
            if !names.insert(reward.name.as_str()) {
                return Err(ScorerError::Duplicate {
                    name: reward.name.clone(),
                });
            }
            if !reward.weight.is_finite() {
                return Err(ScorerError::BadWeight {
                    name: reward.name.clone(),
                    weight: reward.weight,
                });
            }
        }
        Ok(())
    }

    /// The reward functions, in order.
    pub fn rewards(&self) -> &[Reward] {
        &self.inner.rewards
    }

    /// Counts per reward function, by name, in order.
    pub fn stats(&self) -> Vec<(String, RewardStats)> {
        self.inner
            .rewards
            .iter()
            .zip(&self.inner.counters)
            .map(|(reward, counters)| {
                let mut stats = counters.snapshot();
                if let Runner::Async(function) = &reward.runner {
                    stats.calls = function.calls();
                }
                (reward.name.clone(), stats)
            })
            .collect()
    }

    /// Scores one group.
    pub async fn score(&self, group: Arc<Group>) -> GroupScores {
        let columns = join_all(
            self.inner
                .rewards
                .iter()
                .zip(&self.inner.counters)
                .map(|(reward, counters)| self.column(reward, counters, Arc::clone(&group))),
        )
        .await;
        let rewards = combine(&columns, group.len());
        let metrics = GroupMetrics::new(&columns, &rewards);
        GroupScores {
            columns,
            rewards,
            metrics,
        }
    }

    async fn column(&self, reward: &Reward, counters: &Counters, group: Arc<Group>) -> Column {
        let expected = group.len();
        let result = self.run(reward, group).await.and_then(|(scores, notes)| {
            if scores.len() == expected {
                Ok((scores, notes))
            } else {
                Err(failure(
                    FailureKind::WrongLength,
                    format!(
                        "returned {} score(s) for {expected} completion(s)",
                        scores.len()
                    ),
                ))
            }
        });

        let mut column = Column {
            name: reward.name.clone(),
            weight: reward.weight,
            values: vec![None; expected],
            failure: None,
            non_finite: Vec::new(),
            notes: Notes::new(),
        };
        match result {
            Ok((scores, notes)) => {
                if notes.len() == expected {
                    column.notes = notes;
                }
                for (index, score) in scores.into_iter().enumerate() {
                    match score {
                        Some(value) if !in_range(value) => column.non_finite.push(index),
                        other => column.values[index] = other,
                    }
                }
                if !column.non_finite.is_empty() {
                    counters
                        .non_finite
                        .fetch_add(column.non_finite.len() as u64, Ordering::Relaxed);
                    tracing::warn!(
                        target: "scoring",
                        reward = %reward.name,
                        completions = ?column.non_finite,
                        "reward function returned NaN, infinite or out-of-range scores (beyond ±{MAX_REWARD:e}); those completions are unscored in this column"
                    );
                }
            }
            Err(failed) => {
                tracing::warn!(
                    target: "scoring",
                    reward = %reward.name,
                    kind = ?failed.kind,
                    message = %failed.message,
                    "reward function failed on a group; its column is empty for that group"
                );
                column.failure = Some(failed);
            }
        }
        counters.count(column.failure.as_ref());
        column
    }

    /// Runs one function on one group: its scores, or why there are none.
    async fn run(
        &self,
        reward: &Reward,
        group: Arc<Group>,
    ) -> Result<(Scores, Notes), ColumnFailure> {
        let timeout = reward.timeout.unwrap_or(self.inner.default_timeout);
        match &reward.runner {
            Runner::Sync(function) => {
                let function = Arc::clone(function);
                let (started, done) = self.inner.pool.run(move || function.score(&group));
                // The timeout counts from the start: a busy pool is not the function's fault.
                let queue_timeout = self.inner.queue_timeout;
                if tokio::time::timeout(queue_timeout, started).await.is_err() {
                    let message =
                        format!("waited {queue_timeout:?} for a reward thread (all busy); not run");
                    return Err(failure(FailureKind::Timeout, message));
                }
                match tokio::time::timeout(timeout, done).await {
                    Ok(Ok(Ok(result))) => result
                        .map(|scores| (scores, Notes::new()))
                        .map_err(|e| failure(FailureKind::Error, e.to_string())),
                    Ok(Ok(Err(panic))) => {
                        Err(failure(FailureKind::Panic, panic_message(panic.as_ref())))
                    }
                    Ok(Err(_dropped)) => Err(failure(
                        FailureKind::Error,
                        "the reward pool dropped the job".into(),
                    )),
                    Err(_elapsed) => Err(timed_out(timeout)),
                }
            }
            Runner::Inline(function) => {
                match std::panic::catch_unwind(AssertUnwindSafe(|| function.score(&group))) {
                    Ok(result) => result
                        .map(|scores| (scores, Notes::new()))
                        .map_err(|e| failure(FailureKind::Error, e.to_string())),
                    Err(panic) => Err(failure(FailureKind::Panic, panic_message(panic.as_ref()))),
                }
            }
            Runner::Async(function) => {
                let score = || function.score_with_notes(group);
                match std::panic::catch_unwind(AssertUnwindSafe(score)) {
                    Err(panic) => Err(failure(FailureKind::Panic, panic_message(panic.as_ref()))),
                    Ok(future) => {
                        match tokio::time::timeout(timeout, AssertUnwindSafe(future).catch_unwind())
                            .await
                        {
                            Ok(Ok(result)) => {
                                result.map_err(|e| failure(FailureKind::Error, e.to_string()))
                            }
                            Ok(Err(panic)) => {
                                Err(failure(FailureKind::Panic, panic_message(panic.as_ref())))
                            }
                            Err(_elapsed) => Err(timed_out(timeout)),
                        }
                    }
                }
            }
        }
    }
}

impl fmt::Debug for Scorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scorer")
            .field("rewards", &self.inner.rewards)
            .field("pool", &self.inner.pool)
            .field("default_timeout", &self.inner.default_timeout)
            .finish()
    }
}

/// The weighted sum of each completion's scores, skipping `None`s; `None` (unscorable, with a
/// warning) where the sum falls beyond [`MAX_REWARD`](crate::MAX_REWARD), as a weight can
/// make it.
fn combine(columns: &[Column], completions: usize) -> Vec<Option<f64>> {
    (0..completions)
        .map(|index| {
            let sum = columns.iter().fold(None, |sum: Option<f64>, column| {
                match column.values[index] {
                    Some(value) => Some(sum.unwrap_or(0.0) + column.weight * value),
                    None => sum,
                }
            });
            match sum {
                Some(reward) if !in_range(reward) => {
                    tracing::warn!(
                        target: "scoring",
                        completion = index,
                        reward,
                        "the weighted sum of a completion's scores is beyond ±{MAX_REWARD:e}; the completion is unscorable"
                    );
                    None
                }
                other => other,
            }
        })
        .collect()
}

fn failure(kind: FailureKind, message: String) -> ColumnFailure {
    ColumnFailure { kind, message }
}

fn timed_out(timeout: Duration) -> ColumnFailure {
    failure(FailureKind::Timeout, format!("timed out after {timeout:?}"))
}
