//! Group advantages: GRPO, Dr. GRPO, RLOO and batch-level std, with their knobs, per
//! completion or, with [`Credit::Turn`], per turn from the turns' discounted returns.
//!
//! Which completions form the baseline is decided here, once: a completion enters its
//! group's mean and std only if it has a reward within [`MAX_REWARD`] of 0 *and* produced a
//! training row. An unscorable completion, one whose reward is NaN, infinite or beyond the
//! bound, or one whose trace was empty (a failed session, no recovered tokens), gets
//! advantage 0 and never shifts its siblings' advantages. Within the bound the group's sums
//! and squares cannot overflow; an advantage that still comes out NaN or infinite (an `eps`
//! of 0 over a std that underflowed) makes the group [`GroupKind::NonFinite`], dropped, never a
//! row with a non-finite advantage.

use serde::{Deserialize, Serialize};

/// The largest magnitude of a reward (or a turn's return) the estimators take: one beyond it
/// is left out of the baseline as a NaN is, and counted in [`GroupAdvantages::non_finite`].
/// Rewards are small numbers; `1e12` leaves every sane scale room while keeping the group's
/// sum and squares far from overflow (a judge answering `1e308` would overflow them).
pub const MAX_REWARD: f64 = 1e12;

/// How the baseline and the scale are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Estimator {
    /// `(r - mean) / std` over the group.
    Grpo,
    /// `r - mean`: no division by the std (Dr. GRPO).
    DrGrpo,
    /// `r - mean of the others` (RLOO's leave-one-out baseline), equal to
    /// `n / (n - 1) * (r - mean)`; no std.
    Rloo,
    /// `(r - group mean) / std over every baseline reward of the batch`.
    BatchStd,
}

/// Which standard deviation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdKind {
    /// Divide by `n` (numpy's default).
    Population,
    /// Divide by `n - 1` (torch's default).
    Unbiased,
}

/// Where the epsilon goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EpsPlacement {
    /// `(r - mean) / (std + eps)`.
    AddToStd,
    /// `(r - mean) / sqrt(var + eps)`.
    InsideSqrt,
}

/// What an advantage is given to: the whole completion, or each of its turns.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Credit {
    /// One advantage per completion, from its reward (outcome-only GRPO).
    #[default]
    Episode,
    /// One advantage per assistant turn, from the turn's discounted return: the step rewards
    /// an environment gave the turn's tool calls and those of the turns after it, and the
    /// completion's reward at its last turn, each `gamma` times the one before it. The
    /// estimator's baseline and scale are those of the group's episode returns (the returns
    /// of first turns); see [`turn_advantages`].
    Turn {
        /// The discount per turn, in `[0, 1]`.
        gamma: f64,
    },
}

/// The estimator and its knobs. [`AdvantageConfig::default`] is the `trl` preset.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdvantageConfig {
    /// The estimator.
    pub estimator: Estimator,
    /// Population or unbiased std (GRPO and batch std).
    pub std: StdKind,
    /// The epsilon that keeps the division finite.
    pub eps: f64,
    /// Where the epsilon goes.
    pub eps_placement: EpsPlacement,
    /// Clip every advantage to `[-clip, clip]`.
    pub clip: Option<f64>,
    /// Drop groups whose baseline rewards are all equal (they carry no signal).
    pub drop_zero_variance: bool,
    /// Per completion (the default) or per turn.
    #[serde(default)]
    pub credit: Credit,
}

/// The presets, by name, for configuration files and flags.
pub const PRESETS: [&str; 5] = ["trl", "grpo", "dr_grpo", "rloo", "batch"];

impl AdvantageConfig {
    /// A named preset:
    /// - `trl`: GRPO, `(r - mean) / (std + 1e-8)` with the population std over the scorable
    ///   completions (TRL's async GRPO);
    /// - `grpo`: GRPO with the unbiased std and `1e-6` (verl's default);
    /// - `dr_grpo`: `r - mean`;
    /// - `rloo`: leave-one-out baseline;
    /// - `batch`: group mean, population std over the whole batch, `1e-8`.
    pub fn preset(name: &str) -> Option<AdvantageConfig> {
        let base = AdvantageConfig {
            estimator: Estimator::Grpo,
            std: StdKind::Population,
            eps: 1e-8,
            eps_placement: EpsPlacement::AddToStd,
            clip: None,
            drop_zero_variance: false,
            credit: Credit::Episode,
        };
        Some(match name {
            "trl" => base,
            "grpo" => AdvantageConfig {
                std: StdKind::Unbiased,
                eps: 1e-6,
                ..base
            },
            "dr_grpo" => AdvantageConfig {
                estimator: Estimator::DrGrpo,
                ..base
            },
            "rloo" => AdvantageConfig {
                estimator: Estimator::Rloo,
                ..base
            },
            "batch" => AdvantageConfig {
                estimator: Estimator::BatchStd,
                ..base
            },
            _ => return None,
        })
    }
}

impl AdvantageConfig {
    /// Checks the knobs a configuration file can get wrong: `eps` finite and `>= 0`, `clip`
    /// finite and `>= 0`, a turn credit's `gamma` in `[0, 1]`. The estimators never panic on
    /// a bad value (a NaN or negative clip is ignored), but a loader should refuse it with
    /// this message.
    pub fn validate(&self) -> Result<(), InvalidAdvantageConfig> {
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(InvalidAdvantageConfig::Eps(self.eps));
        }
        if let Some(clip) = self.clip
            && !(clip.is_finite() && clip >= 0.0)
        {
            return Err(InvalidAdvantageConfig::Clip(clip));
        }
        if let Credit::Turn { gamma } = self.credit
            && !(0.0..=1.0).contains(&gamma)
        {
            return Err(InvalidAdvantageConfig::Gamma(gamma));
        }
        Ok(())
    }
}

/// A knob of [`AdvantageConfig`] that [`AdvantageConfig::validate`] refuses.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum InvalidAdvantageConfig {
    /// `eps` is negative or not finite.
    #[error("eps must be a finite number >= 0, got {0}")]
    Eps(f64),
    /// `clip` is negative or not finite.
    #[error("clip must be a finite number >= 0, got {0}")]
    Clip(f64),
    /// A turn credit's `gamma` is outside `[0, 1]`.
    #[error("gamma must be a number from 0 to 1, got {0}")]
    Gamma(f64),
}

impl Default for AdvantageConfig {
    fn default() -> AdvantageConfig {
        AdvantageConfig::preset("trl").unwrap_or_else(|| unreachable!("trl is a preset"))
    }
}

/// What the estimator needs to know of one completion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompletionReward {
    /// The combined reward; `None` when unscorable.
    pub reward: Option<f64>,
    /// Whether the completion produced a training row (false for an empty trace).
    pub has_training_row: bool,
}

impl CompletionReward {
    /// A scorable completion with a training row.
    pub fn scored(reward: f64) -> CompletionReward {
        CompletionReward {
            reward: Some(reward),
            has_training_row: true,
        }
    }

    /// An unscorable completion with a training row.
    pub fn unscorable() -> CompletionReward {
        CompletionReward {
            reward: None,
            has_training_row: true,
        }
    }

    fn baseline_reward(&self) -> Option<f64> {
        self.reward
            .filter(|r| in_range(*r) && self.has_training_row)
    }
}

/// Whether a reward is one the estimators take: finite and within [`MAX_REWARD`].
pub fn in_range(reward: f64) -> bool {
    reward.is_finite() && reward.abs() <= MAX_REWARD
}

/// What kind of group the estimator saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Two or more baseline rewards, not all equal.
    Normal,
    /// No completion entered the baseline: every advantage is 0.
    Empty,
    /// One completion entered the baseline: nothing to compare it with, advantage 0.
    Singleton,
    /// Every baseline reward is equal: advantage 0 (the group is dropped when configured).
    ZeroVariance,
    /// An advantage came out NaN or infinite (possible only with `eps = 0` over a std that
    /// underflowed): an error of the group, which is dropped, every advantage 0.
    NonFinite,
}

/// The advantages of one group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupAdvantages {
    /// One advantage per completion, in order; 0 outside the baseline.
    pub advantages: Vec<f64>,
    /// What kind of group it was.
    pub kind: GroupKind,
    /// Whether the group is to be dropped (zero variance with `drop_zero_variance`, or
    /// [`GroupKind::NonFinite`]).
    pub dropped: bool,
    /// How many completions formed the baseline.
    pub baseline_size: usize,
    /// Mean of the baseline rewards (0 when empty).
    pub mean: f64,
    /// The std that scales the advantages: the group's (the batch's for
    /// [`Estimator::BatchStd`]), as configured; 0 when fewer than two rewards.
    pub std: f64,
    /// Completions whose reward was NaN, infinite or beyond [`MAX_REWARD`] (left out,
    /// advantage 0).
    pub non_finite: usize,
}

impl GroupAdvantages {
    /// The group as an error of its own when any of its advantages, or of `turns` (its
    /// completions' advantages per turn), is NaN or infinite: [`GroupKind::NonFinite`],
    /// dropped, every advantage 0. Unchanged otherwise.
    pub fn check_finite<'a>(mut self, turns: impl IntoIterator<Item = &'a f64>) -> Self {
        let finite = self.advantages.iter().all(|a| a.is_finite())
            && turns.into_iter().all(|a| a.is_finite());
        if finite {
            return self;
        }
        self.kind = GroupKind::NonFinite;
        self.dropped = true;
        self.advantages.iter_mut().for_each(|a| *a = 0.0);
        self
    }
}

/// Advantages of one group. For [`Estimator::BatchStd`] the std is the group's own; use
/// [`batch_advantages`] to share it across a batch.
pub fn group_advantages(
    completions: &[CompletionReward],
    config: &AdvantageConfig,
) -> GroupAdvantages {
    let stats = Stats::of(completions, config.std);
    let scale = stats.std;
    advantages_with(completions, config, &stats, scale)
}

/// Advantages of several groups at once. Every estimator but [`Estimator::BatchStd`] treats
/// each group on its own; batch std centres each group on its own mean and divides by the std
/// of every baseline reward in the batch.
pub fn batch_advantages(
    groups: &[Vec<CompletionReward>],
    config: &AdvantageConfig,
) -> Vec<GroupAdvantages> {
    if config.estimator != Estimator::BatchStd {
        return groups
            .iter()
            .map(|group| group_advantages(group, config))
            .collect();
    }
    let all: Vec<CompletionReward> = groups.iter().flatten().copied().collect();
    let batch = Stats::of(&all, config.std);
    groups
        .iter()
        .map(|group| {
            let stats = Stats::of(group, config.std);
            advantages_with(group, config, &stats, batch.std)
        })
        .collect()
}

/// Mean and std of the baseline rewards of some completions.
struct Stats {
    n: usize,
    mean: f64,
    std: f64,
    all_equal: bool,
    non_finite: usize,
}

impl Stats {
    fn of(completions: &[CompletionReward], kind: StdKind) -> Stats {
        let mut n = 0usize;
        let mut sum = 0.0;
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        let mut non_finite = 0;
        for completion in completions {
            if completion.reward.is_some_and(|r| !in_range(r)) {
                non_finite += 1;
            }
            if let Some(r) = completion.baseline_reward() {
                n += 1;
                sum += r;
                min = min.min(r);
                max = max.max(r);
            }
        }
        let mean = if n == 0 { 0.0 } else { sum / n as f64 };
        let divisor = match kind {
            StdKind::Population => n as f64,
            StdKind::Unbiased => n.saturating_sub(1) as f64,
        };
        let std = if n < 2 || divisor == 0.0 {
            0.0
        } else {
            let squares: f64 = completions
                .iter()
                .filter_map(CompletionReward::baseline_reward)
                .map(|r| (r - mean) * (r - mean))
                .sum();
            (squares / divisor).sqrt()
        };
        Stats {
            n,
            mean,
            std,
            all_equal: n > 0 && min == max,
            non_finite,
        }
    }
}

fn advantages_with(
    completions: &[CompletionReward],
    config: &AdvantageConfig,
    stats: &Stats,
    scale: f64,
) -> GroupAdvantages {
    let kind = match stats.n {
        0 => GroupKind::Empty,
        1 => GroupKind::Singleton,
        _ if stats.all_equal => GroupKind::ZeroVariance,
        _ => GroupKind::Normal,
    };
    let advantages = completions
        .iter()
        .map(|completion| match (kind, completion.baseline_reward()) {
            (GroupKind::Normal, Some(r)) => advantage(config, stats.n, stats.mean, scale, r, r),
            _ => 0.0,
        })
        .collect();
    GroupAdvantages {
        advantages,
        kind,
        dropped: kind == GroupKind::ZeroVariance && config.drop_zero_variance,
        baseline_size: stats.n,
        mean: stats.mean,
        std: scale,
        non_finite: stats.non_finite,
    }
    .check_finite(std::iter::empty())
}

/// The advantage of `value` (a reward, or a turn's return) of a completion whose own baseline
/// reward is `own`, in a group of `n` baseline rewards of mean `mean`, scaled by `scale`;
/// clipped as configured. RLOO's baseline leaves `own` out: `(n * mean - own) / (n - 1)`,
/// which for `value == own` is `n / (n - 1) * (own - mean)`.
fn advantage(
    config: &AdvantageConfig,
    n: usize,
    mean: f64,
    scale: f64,
    own: f64,
    value: f64,
) -> f64 {
    let n = n as f64;
    let a = match config.estimator {
        Estimator::Grpo | Estimator::BatchStd => (value - mean) / denominator(config, scale),
        Estimator::DrGrpo => value - mean,
        Estimator::Rloo => value - (n * mean - own) / (n - 1.0),
    };
    match config.clip {
        Some(clip) if clip >= 0.0 => a.clamp(-clip, clip),
        _ => a,
    }
}

/// What GRPO and batch std divide by: the scale with the epsilon where it is configured.
fn denominator(config: &AdvantageConfig, scale: f64) -> f64 {
    match config.eps_placement {
        EpsPlacement::AddToStd => scale + config.eps,
        EpsPlacement::InsideSqrt => (scale * scale + config.eps).sqrt(),
    }
}

/// The discounted return of each turn of a completion: `step_rewards[t]` (a missing one is 0)
/// plus, at the last turn, the completion's `outcome` reward, then `gamma` times the next
/// turn's return. A completion without turns has one return, its outcome.
///
/// ```
/// use async_grpo_scoring::turn_returns;
/// // Two turns: a step reward of 0.5 on the first, an outcome of 1.
/// assert_eq!(turn_returns(&[Some(0.5), None], 1.0, 0.5), vec![1.0, 1.0]);
/// ```
pub fn turn_returns(step_rewards: &[Option<f64>], outcome: f64, gamma: f64) -> Vec<f64> {
    let turns = step_rewards.len().max(1);
    let mut returns = vec![0.0; turns];
    let mut next = 0.0;
    for t in (0..turns).rev() {
        let step = step_rewards.get(t).copied().flatten().unwrap_or(0.0);
        let outcome = if t + 1 == turns { outcome } else { 0.0 };
        next = step + outcome + gamma * next;
        returns[t] = next;
    }
    returns
}

/// The advantage of each turn of `completion` (whose reward the estimator was given is its
/// episode return, `returns[0]`), in the group `group` that [`group_advantages`] computed
/// over the episode returns: each turn's return goes through the same baseline and scale
/// (for RLOO, the mean of the other completions' episode returns), then the clip. Outside
/// the baseline, or in a group that is not [`GroupKind::Normal`], every turn's advantage is 0,
/// as the completion's is.
pub fn turn_advantages(
    returns: &[f64],
    completion: &CompletionReward,
    group: &GroupAdvantages,
    config: &AdvantageConfig,
) -> Vec<f64> {
    match (group.kind, completion.baseline_reward()) {
        (GroupKind::Normal, Some(own)) => returns
            .iter()
            .map(|&value| {
                advantage(
                    config,
                    group.baseline_size,
                    group.mean,
                    group.std,
                    own,
                    value,
                )
            })
            .collect(),
        _ => vec![0.0; returns.len()],
    }
}
