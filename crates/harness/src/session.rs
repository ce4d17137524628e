//! The session shapes, after OpenEnv's harness (`ResourceSessionFactory`,
//! `ResourceSession`, `ToolResult`, `VerifyResult`): an async pair ([`SessionFactory`],
//! [`Session`]) and a blocking pair ([`SyncSessionFactory`], [`SyncSession`]), both
//! first-class.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use rollout_core::Message;
use serde_json::{Map, Value};
use tool_dispatch::ToolSpec;

/// What a session is created for: one rollout attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The dataset row as its JSON object: `prompt` (messages) and every other column.
    pub row: Map<String, Value>,
    /// The episode's seed.
    pub seed: u64,
    /// A name unique within the run.
    pub episode_id: String,
}

/// What a tool call gave.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolOutput {
    /// What the model reads (a string as it is, anything else as JSON).
    pub content: Value,
    /// The episode is over: the conversation ends after this turn's calls and is verified.
    pub done: bool,
    /// The call failed in a way the model should read (`{"error": ...}`); the episode goes on.
    pub error: Option<String>,
    /// Anything else the environment says about the call (not shown to the model): kept
    /// in the row's `environment.tools`, as `{"name", "metadata"}`.
    pub metadata: Map<String, Value>,
    /// The call's reward, if the environment gave one: summed over a turn's calls into the
    /// turn's entry of the row's `step_rewards`. [`step_reward`] reads it where OpenEnv and
    /// MCP servers put it.
    pub reward: Option<f64>,
}

/// A step reward in `value`, an object: its `reward` field when that is a finite number
/// (OpenEnv's `ToolResult.metadata["reward"]` or `data["reward"]`, an MCP result's structured
/// `reward`). Anything else there is no reward.
pub fn step_reward(value: &Map<String, Value>) -> Option<f64> {
    value
        .get("reward")
        .and_then(Value::as_f64)
        .filter(|reward| reward.is_finite())
}

impl ToolOutput {
    /// A result the model reads.
    pub fn new(content: impl Into<Value>) -> ToolOutput {
        ToolOutput {
            content: content.into(),
            ..ToolOutput::default()
        }
    }

    /// Marks the episode as over.
    #[must_use]
    pub fn done(mut self) -> ToolOutput {
        self.done = true;
        self
    }
}

/// What verifying an episode found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verification {
    /// The reward; `None` when the episode cannot be judged (unscorable).
    pub env_reward: Option<f64>,
    /// Whether the environment considers the task finished.
    pub done: bool,
    /// Numbers to report with the sample (`env/NAME` in its metrics).
    pub metrics: BTreeMap<String, f64>,
    /// Anything else verify said (OpenEnv's `artifacts`, metrics that are not numbers):
    /// kept in the row's `environment.artifacts`.
    pub artifacts: Map<String, Value>,
}

impl Verification {
    /// A verification with `reward`.
    pub fn reward(reward: f64) -> Verification {
        Verification {
            env_reward: Some(reward),
            ..Verification::default()
        }
    }
}

/// A session's call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SessionError {
    message: String,
    fatal: bool,
}

impl SessionError {
    /// A failure the episode survives: from a tool call, the model reads it as the call's
    /// error.
    pub fn new(message: impl Into<String>) -> SessionError {
        SessionError {
            message: message.into(),
            fatal: false,
        }
    }

    /// The environment itself broke (its process exited, its answers make no sense): the
    /// rollout fails with cause `environment`.
    pub fn fatal(message: impl Into<String>) -> SessionError {
        SessionError {
            message: message.into(),
            fatal: true,
        }
    }

    /// Whether the environment broke.
    pub fn is_fatal(&self) -> bool {
        self.fatal
    }

    /// What happened.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// An async environment session: one per rollout attempt. Its methods are awaited on the
/// runtime, so they must not block.
pub trait Session: Send + Sync + 'static {
    /// Messages that start the conversation, before the dataset row's prompt (none by
    /// default).
    fn initial_messages(&self) -> Vec<Message> {
        Vec::new()
    }
    /// The tools the model may call: name, description, JSON-schema parameters.
    fn tools(&self) -> Vec<ToolSpec>;
    /// Runs one tool call.
    fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> BoxFuture<'_, Result<ToolOutput, SessionError>>;
    /// Judges the episode from its transcript (prompt and completion messages, the final
    /// assistant message's tool calls included). Called once, at the end.
    fn verify(&self, transcript: &[Message]) -> BoxFuture<'_, Result<Verification, SessionError>>;
    /// Frees what the session holds. Called exactly once.
    fn close(&self) -> BoxFuture<'_, ()>;
}

/// Creates async sessions.
pub trait SessionFactory: Send + Sync + 'static {
    /// A session for `task`. Dropping the future before it resolves must leave nothing
    /// running.
    fn create(&self, task: Task) -> BoxFuture<'_, Result<Box<dyn Session>, SessionError>>;
}

/// A blocking environment session: every call runs on the tool pool's threads, never on the
/// runtime.
pub trait SyncSession: Send + Sync + 'static {
    /// Messages that start the conversation, before the dataset row's prompt (none by
    /// default).
    fn initial_messages(&self) -> Vec<Message> {
        Vec::new()
    }
    /// The tools the model may call.
    fn tools(&self) -> Vec<ToolSpec>;
    /// Runs one tool call.
    fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<ToolOutput, SessionError>;
    /// Judges the episode from its transcript. Called once, at the end.
    fn verify(&self, transcript: &[Message]) -> Result<Verification, SessionError>;
    /// Frees what the session holds. Called exactly once.
    fn close(&self);
}

/// Creates blocking sessions (on the tool pool's threads).
pub trait SyncSessionFactory: Send + Sync + 'static {
    /// A session for `task`.
    fn create(&self, task: &Task) -> Result<Box<dyn SyncSession>, SessionError>;
}
