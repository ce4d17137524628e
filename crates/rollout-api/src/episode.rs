//! The loop's extension point for environments: an [`Environment`] opens one [`Episode`] per
//! rollout attempt; the episode offers the rollout's tools, may end it, is verified at the
//! end and is closed exactly once, whatever way the attempt ended.
//!
//! How the loop uses it (async-grpo-rollout's `conversation.rs`): before the first turn it opens an episode
//! ([`Environment::open`]) and renders the prompt with the episode's tools and its initial
//! messages before the dataset row's prompt; tool calls go to the episode's
//! [`ToolDispatcher`] (same order, timeouts and error messages as `[[tools]]`); after each
//! turn's calls it reads [`Episode::status`] (done ends the conversation, failed fails the
//! rollout with cause `environment`); when the conversation ends it calls
//! [`Episode::verify`] once with the whole transcript (the final assistant message with its
//! tool calls included), whose reward becomes the completion's `rollout_reward` (the `env`
//! column). The episode is parked in a slot owned by the rollout's task, so that a finished,
//! failed, timed-out, panicked or cancelled attempt alike leaves it there, and the task closes
//! it ([`Episode::close`]) before it gives back its in-flight permit: open episodes never
//! outnumber `max_inflight`.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use serde_json::{Map, Value};
use tool_dispatch::ToolDispatcher;

use rollout_core::Message;

use crate::DatasetRow;

/// What an environment is asked to open an episode for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EpisodeRequest {
    /// The dataset row, as its JSON object: `prompt` (messages) and every other column.
    pub task: Map<String, Value>,
    /// A seed for the episode, derived from the run's seed and the rollout (0 without one).
    pub seed: u64,
    /// A name unique within the run: `r{rollout}-a{attempt}`.
    pub episode_id: String,
}

impl EpisodeRequest {
    /// The request for `row`, with `seed` and `episode_id`.
    pub fn new(row: &DatasetRow, seed: u64, episode_id: impl Into<String>) -> EpisodeRequest {
        EpisodeRequest {
            task: row.to_json(),
            seed,
            episode_id: episode_id.into(),
        }
    }
}

/// An environment could not open an episode (after its own retries): the rollout fails with
/// cause `session_create`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct OpenError(pub String);

/// Where an episode stands after a turn's tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EpisodeStatus {
    /// Going on.
    Running,
    /// A tool said the episode is over: the conversation ends and is verified.
    Done,
    /// The environment broke (its server exited, answered garbage): the rollout fails with
    /// cause `environment` and this message.
    Failed(String),
}

/// What [`Episode::verify`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verdict {
    /// The reward; `None` when the episode could not be verified (unscorable for `env`).
    pub reward: Option<f64>,
    /// Numbers the environment reported, added to the sample's metrics as `env/NAME`.
    pub metrics: BTreeMap<String, f64>,
    /// Why there is no reward, when verifying failed.
    pub error: Option<String>,
    /// Whether the environment considers the task finished, when it said (the sample's
    /// `env_verify_done` metric, 1 or 0).
    pub done: Option<bool>,
    /// What the environment said that is not a number: the sample's `environment` object.
    pub details: Map<String, Value>,
}

/// A source of episodes: one per rollout attempt.
pub trait Environment: Send + Sync + 'static {
    /// Opens an episode (retrying as the environment sees fit). Dropping the future before
    /// it resolves must leave nothing running.
    fn open(&self, request: EpisodeRequest) -> BoxFuture<'_, Result<Box<dyn Episode>, OpenError>>;
}

/// One rollout's episode: how the loop uses it is told at async-grpo-rollout's `EngineBuilder::environment`.
pub trait Episode: Send + 'static {
    /// Messages that start the conversation, before the dataset row's prompt.
    fn initial_messages(&self) -> Vec<Message>;
    /// The rollout's tools: rendered into its prompt, its calls run here.
    fn tools(&self) -> &ToolDispatcher;
    /// Whether a tool ended the episode or the environment broke.
    fn status(&self) -> EpisodeStatus;
    /// The step rewards the episode's tool calls gave since the last call (their sum), or
    /// `None` when none gave one. The loop calls it after each turn's calls: what it returns
    /// is that turn's entry of the rows' `step_rewards`. None by default.
    fn take_step_reward(&mut self) -> Option<f64> {
        None
    }
    /// Judges the episode from its whole transcript (prompt and completion messages). Called
    /// at most once, when the conversation ended.
    fn verify(&mut self, transcript: Vec<Message>) -> BoxFuture<'_, Verdict>;
    /// Ends the episode and frees what it holds. Called exactly once, on every path.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}
