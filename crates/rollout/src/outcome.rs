//! How a rollout ended: [`Finished`] with a conversation, or failed with a [`FailureCause`].
//! What a rollout hands its group, so that the conversation (which produces it) and the group
//! (which scores it) each depend on this module and not on each other.

use std::{collections::BTreeMap, fmt};

use serde::Serialize;

use crate::Verdict;
use rollout_core::{Message, RolloutId, Tally, TrainingRow};

/// A rollout that ended with a conversation.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) rollout_id: RolloutId,
    /// What the model was prompted with first: the dataset row's prompt, after the initial
    /// messages of the rollout's environment session when it ran in one; what a loop-owning
    /// agent sent first when one ran it.
    pub(crate) prompt: Vec<Message>,
    /// The messages the rollout added: assistant turns and tool results.
    pub(crate) messages: Vec<Message>,
    pub(crate) rows: Vec<TrainingRow>,
    pub(crate) tally: Tally,
    /// Every sampled id, in order (what length rewards measure).
    pub(crate) sampled: Vec<u32>,
    pub(crate) turns: u64,
    pub(crate) tool_calls: u64,
    pub(crate) tool_errors: u64,
    pub(crate) versions: (u64, u64),
    pub(crate) stop: Stop,
    pub(crate) attempts: u32,
    /// Turns whose next prompt append mode re-rendered whole (no exact token delta).
    pub(crate) fallbacks: u64,
    /// What the rollout's environment found, when it ran in one.
    pub(crate) verdict: Option<Verdict>,
    /// Further numbers for the sample's metrics (a loop-owning agent's).
    pub(crate) metrics: BTreeMap<String, f64>,
    /// One per assistant message: the step reward its tool calls got from the rollout's
    /// environment (`None` when none did). Empty for an agent's conversations.
    pub(crate) step_rewards: Vec<Option<f64>>,
}

impl Finished {
    /// A conversation about to start: nothing produced yet, stopped by `max_turns` unless
    /// something else stops it first.
    pub(crate) fn new(rollout_id: RolloutId, attempts: u32) -> Finished {
        Finished {
            rollout_id,
            prompt: Vec::new(),
            messages: Vec::new(),
            rows: Vec::new(),
            tally: Tally::default(),
            sampled: Vec::new(),
            turns: 0,
            tool_calls: 0,
            tool_errors: 0,
            versions: (u64::MAX, 0),
            stop: Stop::MaxTurns,
            attempts,
            fallbacks: 0,
            verdict: None,
            metrics: BTreeMap::new(),
            step_rewards: Vec::new(),
        }
    }

    /// The step reward of each of its turns, one per span of its rows (`turn_spans`), in
    /// order: the environment's, or `None` for a turn it gave none (every turn of a rollout
    /// outside an environment, or of an agent's conversations).
    pub(crate) fn turn_step_rewards(&self) -> Vec<Option<f64>> {
        let turns = self.rows.iter().map(|row| row.turn_spans.len()).sum();
        let mut steps = self.step_rewards.clone();
        steps.resize(turns, None);
        steps
    }

    /// The last assistant message's content: what answer rewards read.
    pub(crate) fn answer(&self) -> String {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role() == "assistant")
            .and_then(Message::content)
            .unwrap_or_default()
            .to_owned()
    }
}

/// Why a conversation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The model answered without a tool call.
    Answer,
    /// `max_turns` generation calls were made.
    MaxTurns,
    /// The rollout's token budget was spent.
    TokenBudget,
    /// The context is full.
    Context,
    /// The last answer was cut at `max_tokens`.
    Length,
    /// A tool of the rollout's environment ended the episode.
    Done,
}

/// Why a rollout failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureCause {
    /// The generator failed (after its own retries).
    Generation,
    /// No server could be reached (after the generator's own retries).
    Unavailable,
    /// The prompt does not fit in the context.
    PromptTooLong,
    /// The chat template or the tokenizer failed.
    Render,
    /// The turns could not be made into training rows.
    Reconcile,
    /// The rollout ran past its deadline.
    Deadline,
    /// A drain cancelled it.
    Cancelled,
    /// Something it ran panicked (a generator, the tokenizer): a bug, isolated.
    Panic,
    /// Its group fell more than `max_staleness` model versions behind.
    Stale,
    /// The environment could not open an episode for it (after the environment's own
    /// retries).
    SessionCreate,
    /// Its environment broke mid-episode (a server that exited, answered garbage).
    Environment,
    /// Its loop-owning agent could not run, or failed before it ended.
    Agent,
    /// Its loop-owning agent ended without calling the model: nothing to train on.
    EmptyTrace,
    /// With routing replay, the server's routed experts were missing or did not fit the
    /// tokens.
    Routing,
    /// A tool's backend could not serve a call (a Jupyter gateway down or refusing a kernel):
    /// not the model's doing, so not trained on.
    ToolBackend,
}

impl FailureCause {
    /// Every cause, in declaration order.
    pub const ALL: [FailureCause; 15] = [
        FailureCause::Generation,
        FailureCause::Unavailable,
        FailureCause::PromptTooLong,
        FailureCause::Render,
        FailureCause::Reconcile,
        FailureCause::Deadline,
        FailureCause::Cancelled,
        FailureCause::Panic,
        FailureCause::Stale,
        FailureCause::SessionCreate,
        FailureCause::Environment,
        FailureCause::Agent,
        FailureCause::EmptyTrace,
        FailureCause::Routing,
        FailureCause::ToolBackend,
    ];

    /// The cause's place in [`FailureCause::ALL`] (a match, so that a new cause cannot be
    /// counted as another).
    pub(crate) fn index(self) -> usize {
        match self {
            FailureCause::Generation => 0,
            FailureCause::Unavailable => 1,
            FailureCause::PromptTooLong => 2,
            FailureCause::Render => 3,
            FailureCause::Reconcile => 4,
            FailureCause::Deadline => 5,
            FailureCause::Cancelled => 6,
            FailureCause::Panic => 7,
            FailureCause::Stale => 8,
            FailureCause::SessionCreate => 9,
            FailureCause::Environment => 10,
            FailureCause::Agent => 11,
            FailureCause::EmptyTrace => 12,
            FailureCause::Routing => 13,
            FailureCause::ToolBackend => 14,
        }
    }

    /// The cause's name: `generation`, `prompt_too_long`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::Generation => "generation",
            FailureCause::Unavailable => "unavailable",
            FailureCause::PromptTooLong => "prompt_too_long",
            FailureCause::Render => "render",
            FailureCause::Reconcile => "reconcile",
            FailureCause::Deadline => "deadline",
            FailureCause::Cancelled => "cancelled",
            FailureCause::Panic => "panic",
            FailureCause::Stale => "stale",
            FailureCause::SessionCreate => "session_create",
            FailureCause::Environment => "environment",
            FailureCause::Agent => "agent",
            FailureCause::EmptyTrace => "empty_trace",
            FailureCause::Routing => "routing",
            FailureCause::ToolBackend => "tool_backend",
        }
    }

    /// Whether trying the same prompt again may succeed.
    pub(crate) fn is_retryable(self) -> bool {
        !matches!(
            self,
            FailureCause::PromptTooLong
                | FailureCause::Cancelled
                | FailureCause::Panic
                | FailureCause::Stale
                | FailureCause::SessionCreate
        )
    }
}

/// A rollout that failed, with its cause; its group is scored without it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RolloutFailure {
    /// The rollout.
    pub rollout_id: RolloutId,
    /// The group it belonged to.
    pub group_id: u64,
    /// The dataset line of its prompt (0 when the rows did not come from a file).
    pub line: usize,
    /// Attempts made.
    pub attempts: u32,
    /// Why the last attempt failed.
    pub cause: FailureCause,
    /// What happened, for a person.
    pub message: String,
}

impl fmt::Display for RolloutFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rollout {} (group {}, line {}) failed after {} attempt(s): {}: {}",
            self.rollout_id.0,
            self.group_id,
            self.line,
            self.attempts,
            self.cause.as_str(),
            self.message
        )
    }
}

pub(crate) type Failure = (FailureCause, String);
