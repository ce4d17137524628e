//! The loop's extension point for agents that own their loop: an [`Agent`] runs a rollout's
//! whole conversation itself (a coding agent behind an OpenAI-compatible proxy, say) and
//! samples every turn through the [`Sampler`] it is given.
//!
//! The engine stays the one that samples: each [`Sampler::sample`] is a turn of the rollout,
//! sent by the engine's own generator with the model version, seeds, abort continuations,
//! counters and limits of any white-box turn, and fed to the rollout's reconciler as it
//! arrives. So the training rows are built from exactly what the server sampled, whatever the
//! agent does with the text; the agent only says what it sent (the prompt ids of each turn)
//! and, at the end, the transcript ([`AgentOutcome`]). A turn past `max_turns`, the token
//! budget or the context is refused with a [`SampleRefused`] naming the limit (the proxy
//! answers it as an OpenAI server that hit a limit).
//!
//! An attempt whose agent never sampled a turn is a failure with cause `empty_trace`: it has
//! no row to train on, and its reward (if verify gave one) must not enter its group's
//! baseline.

use std::{collections::BTreeMap, fmt};

use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

use crate::{Finish, episode::Verdict};
use rollout_core::{Message, RolloutId};

use crate::DatasetRow;

/// A loop-owning agent: one run per rollout attempt.
pub trait Agent: Send + Sync + 'static {
    /// Runs one attempt to its end: the agent's whole conversation, its turns sampled through
    /// `run.sampler`, then whatever judges it. Dropping the future (a deadline, a drain) must
    /// stop the agent and free what it holds.
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>>;
}

/// What an agent is asked to run.
#[derive(Debug)]
#[non_exhaustive]
pub struct AgentRun {
    /// The dataset row (its prompt is the task).
    pub row: DatasetRow,
    /// The rollout.
    pub rollout_id: RolloutId,
    /// The attempt, from 1.
    pub attempt: u32,
    /// A name unique within the run: `r{rollout}-a{attempt}`.
    pub episode_id: String,
    /// Samples the rollout's turns.
    pub sampler: Sampler,
}

impl AgentRun {
    /// The run of `row` as `attempt` of `rollout_id`, sampling through `sampler`; its
    /// `episode_id` is `r{rollout}-a{attempt}`.
    pub fn new(row: DatasetRow, rollout_id: RolloutId, attempt: u32, sampler: Sampler) -> AgentRun {
        AgentRun {
            episode_id: format!("r{}-a{attempt}", rollout_id.0),
            row,
            rollout_id,
            attempt,
            sampler,
        }
    }
}

/// How an agent's run ended.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct AgentOutcome {
    /// What the agent sent the model first (its system prompt, the task).
    pub prompt: Vec<Message>,
    /// The rest of its final transcript: every assistant message (the last one's tool calls
    /// included), tool result and further user message.
    pub completion: Vec<Message>,
    /// What judging the outcome found (the `env` reward column); `None` when nothing judges.
    pub verdict: Option<Verdict>,
    /// Tool calls the agent's answers made.
    pub tool_calls: u64,
    /// Further numbers about the run, added to the sample's metrics.
    pub metrics: BTreeMap<String, f64>,
    /// The conversation whose turns become the rollout's rows (see
    /// [`Sampler::sample_in`]); the turns of the others are counted
    /// (`agent_side_conversations`, `agent_side_turns`) and not trained on. `None`: every
    /// conversation's turns become rows of their own.
    pub main_conversation: Option<usize>,
}

impl AgentOutcome {
    /// An outcome with this transcript.
    pub fn new(prompt: Vec<Message>, completion: Vec<Message>) -> AgentOutcome {
        AgentOutcome {
            prompt,
            completion,
            ..AgentOutcome::default()
        }
    }

    /// Sets the verdict.
    #[must_use]
    pub fn verdict(mut self, verdict: Verdict) -> AgentOutcome {
        self.verdict = Some(verdict);
        self
    }

    /// Sets the count of tool calls.
    #[must_use]
    pub fn tool_calls(mut self, calls: u64) -> AgentOutcome {
        self.tool_calls = calls;
        self
    }

    /// Keeps only the turns of `conversation` as rows.
    #[must_use]
    pub fn main_conversation(mut self, conversation: usize) -> AgentOutcome {
        self.main_conversation = Some(conversation);
        self
    }
}

/// An agent's run failed (it could not start, it crashed before answering): the attempt fails
/// with cause `agent`, retried like a generation failure.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct AgentError(pub String);

/// One turn an agent asks for, as the side that samples receives it.
#[derive(Debug)]
pub struct SampleRequest {
    prompt_ids: Vec<u32>,
    /// What the agent asked for at most; the engine clips it to `max_tokens`, the context
    /// and the budget.
    max_tokens: Option<u32>,
    /// The agent's conversation the turn belongs to, when it said.
    conversation: Option<usize>,
    reply: oneshot::Sender<Result<Sampled, SampleRefused>>,
}

impl SampleRequest {
    /// The exact ids to send.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    /// Most tokens the agent asked for, if it said.
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_tokens
    }

    /// The agent's conversation the turn belongs to ([`Sampler::sample_in`]), if it said.
    pub fn conversation(&self) -> Option<usize> {
        self.conversation
    }

    /// Answers the request (an agent that stopped waiting is not told).
    pub fn answer(self, answer: Result<Sampled, SampleRefused>) {
        let _ = self.reply.send(answer);
    }
}

/// What the engine sampled for a turn.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Sampled {
    /// The sampled ids (an answer continued after aborts is one answer).
    pub token_ids: Vec<u32>,
    /// Why sampling stopped: [`Finish::Length`] also when a limit cut it.
    pub finish: Finish,
}

impl Sampled {
    /// What was sampled for a turn.
    pub fn new(token_ids: Vec<u32>, finish: Finish) -> Sampled {
        Sampled { token_ids, finish }
    }
}

/// Why a turn was not sampled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SampleRefused {
    /// The rollout made `max_turns` turns.
    #[error("the rollout made its {0} turns (max_turns)")]
    MaxTurns(usize),
    /// The rollout sampled its `max_total_tokens`.
    #[error("the rollout sampled its {0} tokens (max_total_tokens)")]
    TokenBudget(u32),
    /// The prompt leaves no room in the model's context.
    #[error("the prompt is {prompt} tokens, the model's context is {context}")]
    Context {
        /// The prompt's tokens.
        prompt: usize,
        /// The model's context.
        context: u32,
    },
    /// The turn could not be sampled (the generator failed, the rollout is ending); the
    /// rollout fails with the generator's cause.
    #[error("{0}")]
    Failed(String),
}

/// Samples the turns of one agent rollout through the engine; cheap to clone.
#[derive(Clone)]
pub struct Sampler {
    requests: mpsc::Sender<SampleRequest>,
}

impl fmt::Debug for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler whose turns are answered by whoever holds the returned [`SampleRequests`]
    /// (the engine does it for its agents; programs and tests sampling outside an engine can
    /// too).
    pub fn channel() -> (Sampler, SampleRequests) {
        let (requests, receiver) = mpsc::channel(1);
        (Sampler { requests }, SampleRequests(receiver))
    }

    /// Samples one turn after `prompt_ids` (the exact ids to send), at most `max_tokens`
    /// tokens when the agent asks for fewer than the run allows. Turns of one rollout are
    /// sampled one at a time, in the order asked.
    pub async fn sample(
        &self,
        prompt_ids: Vec<u32>,
        max_tokens: Option<u32>,
    ) -> Result<Sampled, SampleRefused> {
        self.request(None, prompt_ids, max_tokens).await
    }

    /// Samples one turn of the agent's `conversation` (0, 1, ... in the order the agent
    /// started them): each conversation's turns are reconciled into rows of their own, and
    /// [`AgentOutcome::main_conversation`] may keep only one's. Turns sampled with
    /// [`sample`](Self::sample) belong to no conversation (rows of their own, never the
    /// main conversation's).
    pub async fn sample_in(
        &self,
        conversation: usize,
        prompt_ids: Vec<u32>,
        max_tokens: Option<u32>,
    ) -> Result<Sampled, SampleRefused> {
        self.request(Some(conversation), prompt_ids, max_tokens)
            .await
    }

    async fn request(
        &self,
        conversation: Option<usize>,
        prompt_ids: Vec<u32>,
        max_tokens: Option<u32>,
    ) -> Result<Sampled, SampleRefused> {
        let (reply, answer) = oneshot::channel();
        let request = SampleRequest {
            prompt_ids,
            max_tokens,
            conversation,
            reply,
        };
        let ended = || SampleRefused::Failed("the rollout has ended".to_owned());
        self.requests.send(request).await.map_err(|_| ended())?;
        answer.await.map_err(|_| ended())?
    }
}

/// The sampling side of a [`Sampler`]: where its requests arrive, in order.
#[derive(Debug)]
pub struct SampleRequests(mpsc::Receiver<SampleRequest>);

impl SampleRequests {
    /// The next request; `None` once every clone of the sampler is gone.
    pub async fn next(&mut self) -> Option<SampleRequest> {
        self.0.recv().await
    }
}
