//! Reward functions and group advantages for GRPO-style reinforcement learning.
//!
//! Two halves, usable apart:
//!
//! - **Scoring** (`Scorer`, feature `scorer`): reward functions see a whole [`Group`] (the prompt, every
//!   completion's messages, text and token ids, and the dataset row) and return one optional
//!   score per completion. Sync functions run on the scorer's own thread pool (never the
//!   runtime's workers, never the tool pool); async ones are awaited; all functions of a group
//!   run at once. A function that errors, panics or times out leaves its column empty for
//!   that group, counted, and the group is scored on the others. The combined reward is the
//!   weighted sum of the columns that scored, `None` when none did.
//! - **Advantages** ([`group_advantages`], [`batch_advantages`]): GRPO, Dr. GRPO, RLOO and
//!   batch-level std, with population or unbiased std, epsilon value and placement, clipping,
//!   and an optional filter for zero-variance groups ([`AdvantageConfig`], presets in
//!   [`PRESETS`]). Unscorable completions and completions without a training row get
//!   advantage 0 and stay out of their siblings' baseline.
//!
//! Built-in rewards (exact, regex, numeric, length, command) are in [`builtin`].
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | (none) | | the estimators, [`Group`], [`Reward`], the `exact` and `length` rewards | serde, futures |
//! | `scorer` | yes | `Scorer`: a group's reward functions run at once, sync ones on a pool of their own | tokio, rayon, tracing |
//! | `regex` | yes | the `regex` and `numeric` rewards | regex |
//! | `command` | yes | the `command` reward, a program scoring the group | tokio (`process`), rustix |
//! | `http` | no | the `http`, `judge` and `reward_model` rewards: a reward service scoring the group, an LLM judge on a chat endpoint, a reward model on vLLM's pooling runner | reqwest |
//! | `table` | no | `RewardTable`: any built-in reward described by its settings (serde), as config files and the bridge give them | the features of every kind |
//! | `schema` | no | `schemars::JsonSchema` for `RewardTable` (with `table`), from which the binary writes its settings reference | schemars |
//!
//! # The estimators alone
//!
//! With no feature, this crate is the advantage math: rewards in, advantages out.
//!
//! ```
//! use async_grpo_scoring::{
//!     AdvantageConfig, CompletionReward, Estimator, GroupKind, group_advantages,
//! };
//!
//! // Four completions of one prompt; the third could not be scored.
//! let group = [
//!     CompletionReward::scored(1.0),
//!     CompletionReward::scored(0.0),
//!     CompletionReward::unscorable(),
//!     CompletionReward::scored(0.5),
//! ];
//! // TRL's formula: (r - mean) / (population std + 1e-8), over the scored ones.
//! let grpo = group_advantages(&group, &AdvantageConfig::default());
//! assert_eq!(grpo.kind, GroupKind::Normal);
//! assert!(grpo.advantages[0] > 0.0 && grpo.advantages[1] < 0.0);
//! assert_eq!(grpo.advantages[2], 0.0); // unscorable: no advantage, not in the baseline
//!
//! // RLOO: each reward against the mean of the others.
//! let rloo = AdvantageConfig { estimator: Estimator::Rloo, ..AdvantageConfig::default() };
//! let rloo = group_advantages(&group, &rloo);
//! assert!((rloo.advantages[0] - 0.75).abs() < 1e-9); // 1.0 - mean(0.0, 0.5)
//! ```
//!
//! # Scoring a group
//!
//! With `scorer` (and `regex` for the `numeric` reward):
//!
//! ```
//! # #[cfg(all(feature = "scorer", feature = "regex"))]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//!
//! use async_grpo_scoring::{
//!     AdvantageConfig, Completion, Group, Reward, Scorer, ScorerConfig, builtin,
//! };
//! use serde_json::json;
//!
//! let scorer = Scorer::new(
//!     vec![
//!         builtin::from_spec("numeric:answer")?,
//!         Reward::new_sync("short", |group: &Group| {
//!             Ok(group.completions.iter().map(|c| Some(if c.text.len() < 20 { 0.1 } else { 0.0 })).collect())
//!         }),
//!     ],
//!     ScorerConfig::default(),
//! )?;
//! let group = Arc::new(Group::new(
//!     "What is 6 * 7?",
//!     vec![Completion::from_text("\\boxed{42}"), Completion::from_text("It is 41, I believe, after some thought.")],
//!     json!({ "answer": "42" }).as_object().cloned().unwrap_or_default(),
//! ));
//!
//! let scores = scorer.score(Arc::clone(&group)).await;
//! assert_eq!(scores.rewards, [Some(1.1), Some(0.0)]);
//!
//! // TRL's formula: (r - mean) / (population std + 1e-8).
//! let advantages = scores.advantages(&group, &AdvantageConfig::default());
//! assert!((advantages.advantages[0] - 1.0).abs() < 1e-6);
//! assert!((advantages.advantages[1] + 1.0).abs() < 1e-6);
//! # Ok(())
//! # }
//! # #[cfg(not(all(feature = "scorer", feature = "regex")))]
//! # fn main() {}
//! ```

mod advantage;
pub mod builtin;
mod group;
#[cfg(feature = "scorer")]
mod pool;
mod reward;
#[cfg(feature = "scorer")]
mod scorer;
#[cfg(feature = "table")]
mod table;

#[cfg(feature = "scorer")]
pub use crate::scorer::{
    Column, ColumnFailure, ColumnMetrics, FailureKind, GroupMetrics, GroupScores, RewardStats,
    Scorer, ScorerConfig, ScorerError,
};
#[cfg(feature = "table")]
pub use crate::table::{
    BuildContext, ColumnSettings, CommandSettings, HttpSettings, JudgeSettings, LengthSettings,
    RegexSettings, RewardKind, RewardModelSettings, RewardSource, RewardTable, Served,
    ServiceSettings,
};
pub use crate::{
    advantage::{
        AdvantageConfig, CompletionReward, Credit, EpsPlacement, Estimator, GroupAdvantages,
        GroupKind, InvalidAdvantageConfig, MAX_REWARD, PRESETS, StdKind, batch_advantages,
        group_advantages, in_range, turn_advantages, turn_returns,
    },
    group::{Completion, Group},
    reward::{AsyncReward, CallStats, Notes, Reward, RewardError, Scores, SyncReward},
};
/// The keys a serde struct reads, and the error of a setting that cannot work (a reward
/// table's): async-grpo-settings', for every settings table of the engine.
pub use settings::{SettingError, field_names};
