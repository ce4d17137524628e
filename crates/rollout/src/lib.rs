//! The rollout loop: dataset rows in, scored groups of training samples out.
//!
//! [`Engine`] admits one group per dataset row (`num_generations` rollouts sharing a group
//! id), runs at most `max_inflight` rollouts at once, and drives each through the multi-turn
//! loop: build the prompt (in [`PromptMode::Append`], the previous prompt + the sampled ids +
//! the template's ids for what follows; in [`PromptMode::Rerender`], the conversation rendered
//! incrementally), sample a turn with the [`Generator`], parse tool calls, run them in order
//! through the [`ToolDispatcher`](tool_dispatch::ToolDispatcher), append the results, and again, until the model answers without a call, `max_turns`, the token budget, the context
//! or the rollout's deadline. Each sampled turn goes to the reconciler as it arrives. When a
//! group's last rollout ends the group is scored, its advantages computed, and its samples
//! sent to the output, a bounded channel.
//!
//! - **Backpressure**: a group reserves its output slot before it is admitted. A consumer
//!   that falls behind stops admission; nothing is dropped and in-flight work is unaffected.
//! - **Failure isolation**: a rollout that fails (generation, rendering, deadline) is retried
//!   up to `retries` times, then recorded with its cause; its group is scored on the rest
//!   when at least `min_group_size` remain, else dropped and counted.
//! - **Model versions and staleness**: each turn records the version set by
//!   [`Engine::set_model_version`] when its request was sent; with `max_staleness`, a group
//!   whose first turn falls more than that many versions behind is cancelled at once (a
//!   trainer would drop its samples), so work is not generated only to be thrown away. A
//!   sample carries its group's first version and, in its metrics,
//!   the span of its own turns.
//!   With `groups_per_version` too, admission holds a group the trainer could not take
//!   within the bound (AReaL's rule; see [`RolloutConfig::groups_per_version`]).
//! - **Pause**: [`Engine::pause`] holds admission until [`Engine::resume`], letting the
//!   rollouts in flight finish ([`InFlight::Wait`]) or cancelling them
//!   ([`InFlight::Abort`]).
//! - **Health and metrics**: a heartbeat task, independent of rollouts, tools and rewards,
//!   measures how late the runtime wakes it ([`Engine::health`]); [`Engine::metrics`] is
//!   everything counted, the one source of every report ([`Metrics`]).
//! - **Drain**: [`Engine::shutdown`] stops admission, lets in-flight rollouts finish until a
//!   deadline, cancels the rest (dropping their requests aborts them on the server), scores
//!   every complete group, closes the output and the tool pool, and reports.
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `vllm-client` | yes | [`Generator`] for vllm-client's `Client` | vllm-client |
//! | `prometheus` | no | [`Metrics::encode`]: the metrics as a Prometheus exposition | prometheus-client |
//! | `clap` | no | `clap::Args` for [`RolloutConfig`] and what it holds, so that a program declares none of its flags again | clap |

mod admission;
mod builder;
mod config;
mod conversation;
mod engine;
mod group;
mod health;
mod metrics;
mod outcome;
mod shared;
mod slot;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The keys a serde struct reads (scoring's, which reward tables use too).
pub use scoring::field_names;

/// The engine's API, apart from its loop: every item of async-grpo-rollout-api.
pub use rollout_api::*;

pub use crate::{
    builder::EngineBuilder,
    config::{InFlight, PromptMode, RolloutConfig, StaleTokens},
    engine::{DrainReport, Engine, EngineError, Groups},
    group::ScoredGroup,
    health::{Health, LatencySnapshot, Stats},
    metrics::Metrics,
    outcome::{FailureCause, RolloutFailure},
    shared::FAILURE_RATE_MIN_ROLLOUTS,
};

/// Locks `mutex`, going on when a panicking holder poisoned it: every value guarded in this
/// crate is left consistent between statements.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
