//! One rollout: the multi-turn loop prompt -> generate -> parse -> tools -> next prompt,
//! feeding each sampled turn to the reconciler as it arrives.
//!
//! Where the prompt mode is decided: before each turn after the first, append mode asks the
//! template for the ids that follow the last answer
//! ([`IncrementalRender::delta`](crate::IncrementalRender::delta)) and sends the previous
//! prompt + the sampled ids + those; when the template has no exact delta, or in rerender
//! mode, the whole conversation is rendered (incrementally) instead and the reconciler
//! compares it with the sampled ids.

use std::{fmt, panic::AssertUnwindSafe, slice};

use futures::FutureExt;

use serde::Serialize;
use serde_json::Value;

use super::group::GroupState;
use super::{
    PromptMode, Shared,
    episode::{EpisodeRequest, EpisodeSlot, EpisodeStatus, Lease, Verdict},
    generator::{Finish, GenerateRequest, Generator},
    health::Counters,
};
use crate::{
    Message, NoExactDelta, Reconciler, RenderError, RenderState, RolloutId, Tally, TrainingRow,
    TurnRecord, parse::split_reasoning,
};

/// A rollout that ended with a conversation.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) rollout_id: RolloutId,
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
}

impl Finished {
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
}

impl FailureCause {
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
        }
    }

    /// Whether trying the same prompt again may succeed.
    fn is_retryable(self) -> bool {
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

/// Runs a rollout with its retries, its deadline and cancellation.
pub(crate) async fn run<G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    rollout_id: RolloutId,
) -> Result<Finished, RolloutFailure> {
    let (row, group_id) = (&group.row, group.group_id);
    let config = &shared.config;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        Counters::add(&shared.counters.rollouts_started, 1);
        // The attempt's episode, if it opens one, is back here however the attempt ends.
        let episode = EpisodeSlot::default();
        let outcome = tokio::select! {
            biased;
            () = shared.cancel.cancelled() => {
                Err((FailureCause::Cancelled, "cancelled by the drain".to_owned()))
            }
            () = shared.stale(group, config.max_staleness.unwrap_or(0)), if config.max_staleness.is_some() => {
                Err((FailureCause::Stale, format!(
                    "the group's first turn was sampled under version {}, more than {} behind the current {}",
                    group.first_version().unwrap_or(0),
                    config.max_staleness.unwrap_or(0),
                    shared.model_version(),
                )))
            }
            outcome = tokio::time::timeout(
                config.rollout_timeout,
                AssertUnwindSafe(converse(shared, group, rollout_id, attempt, &episode)).catch_unwind(),
            ) => match outcome {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(panic)) => Err((FailureCause::Panic, panic_message(&*panic))),
                Err(_) => Err((
                    FailureCause::Deadline,
                    format!("still running after the rollout timeout of {:?}", config.rollout_timeout),
                )),
            },
        };
        // Before the rollout gives back its permit: open episodes never outnumber it.
        episode.close().await;
        match outcome {
            Ok(mut finished) => {
                finished.attempts = attempt;
                return Ok(finished);
            }
            Err((cause, message))
                if cause.is_retryable() && (attempt as usize) <= config.retries =>
            {
                Counters::add(&shared.counters.rollouts_retried, 1);
                tracing::debug!(rollout = rollout_id.0, attempt, cause = cause.as_str(), %message, "retrying the rollout");
            }
            Err((cause, message)) => {
                return Err(RolloutFailure {
                    rollout_id,
                    group_id,
                    line: row.line,
                    attempts: attempt,
                    cause,
                    message,
                });
            }
        }
    }
}

/// A panic's message, as far as it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    format!("panicked: {text}")
}

/// Most continuations of an answer the server aborted part-way (a pause for a weight update
/// aborts requests; the tokens so far stay and sampling resumes after them).
const MAX_CONTINUATIONS: usize = 8;

/// One attempt at a conversation.
async fn converse<G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
    let config = &shared.config;
    let counters = &shared.counters;
    let render_error = |e: RenderError| (FailureCause::Render, e.to_string());
    let mut lease = match &shared.environment {
        Some(environment) => {
            let seed = request_seed(
                config.sampling.seed.unwrap_or(0),
                rollout_id,
                attempt,
                usize::MAX,
                0,
            );
            let request =
                EpisodeRequest::new(&group.row, seed, format!("r{}-a{attempt}", rollout_id.0));
            let episode = environment
                .open(request)
                .await
                .map_err(|e| (FailureCause::SessionCreate, e.0))?;
            Some(slot.lease(episode))
        }
        None => None,
    };
    let initial = lease
        .as_ref()
        .map(|lease| lease.get().initial_messages())
        .unwrap_or_default();
    let episode_first: RenderState;
    let first = match &lease {
        Some(lease) => {
            episode_first = episode_prompt(shared, group, lease, &initial).map_err(render_error)?;
            &episode_first
        }
        None => group.first.as_ref().map_err(|e| render_error(e.clone()))?,
    };
    let mut render = shared
        .tokenizer
        .resume(first.clone())
        .map_err(render_error)?;
    let mut reconciler = Reconciler::new(rollout_id, config.reconciler);
    let mut finished = Finished {
        rollout_id,
        messages: Vec::new(),
        rows: Vec::new(),
        tally: Tally::default(),
        sampled: Vec::new(),
        turns: 0,
        tool_calls: 0,
        tool_errors: 0,
        versions: (u64::MAX, 0),
        stop: Stop::MaxTurns,
        attempts: attempt,
        fallbacks: 0,
        verdict: None,
    };
    let append = config.prompt_mode == PromptMode::Append;
    // Append mode: the last turn's prompt and answer, where the answer's message is in the
    // conversation, and the id the answer ended on.
    let mut last: Option<(Vec<u32>, usize, Option<u32>)> = None;
    for turn in 0..config.max_turns {
        // The group's prompt was rendered once with a generation prompt: turn 0 sends it.
        let mut prompt_ids = if turn == 0 {
            render.ids().to_vec()
        } else {
            let delta = last.take().map(|(ids, assistant, stop)| {
                let delta = match stop {
                    Some(stop) => render.delta(first, assistant, stop),
                    None => Err(NoExactDelta::NoStopToken { last: None }),
                };
                (ids, delta)
            });
            match delta {
                Some((mut ids, Ok(delta))) => {
                    ids.extend_from_slice(&delta);
                    ids
                }
                Some((_, Err(reason))) => {
                    finished.fallbacks += 1;
                    shared.fell_back(&reason);
                    render.prompt().map_err(render_error)?.ids.to_vec()
                }
                None => render.prompt().map_err(render_error)?.ids.to_vec(),
            }
        };
        let room = match shared.max_model_len {
            Some(limit) => {
                let room = (limit as usize).saturating_sub(prompt_ids.len());
                if room == 0 {
                    if turn == 0 {
                        return Err((
                            FailureCause::PromptTooLong,
                            format!(
                                "the prompt is {} tokens, the model's context is {limit}: nothing is left to sample",
                                prompt_ids.len()
                            ),
                        ));
                    }
                    finished.stop = Stop::Context;
                    break;
                }
                room
            }
            None => usize::MAX,
        };
        let budget = match config.max_total_tokens {
            Some(total) => (total as usize).saturating_sub(finished.sampled.len()),
            None => usize::MAX,
        };
        if budget == 0 {
            finished.stop = Stop::TokenBudget;
            break;
        }
        let max_tokens = (config.max_tokens as usize).min(room).min(budget);

        // Sample the answer, continuing after aborts; each segment is its own turn record.
        let mut answer: Vec<u32> = Vec::new();
        let mut finish;
        let mut segment = 0;
        loop {
            let version = shared.model_version();
            group.sampled_under(version);
            let request = GenerateRequest {
                rollout: rollout_id,
                turn,
                prompt_ids: &prompt_ids,
                max_tokens: (max_tokens - answer.len()) as u32,
                sampling: &config.sampling,
                seed: config
                    .sampling
                    .seed
                    .map(|seed| request_seed(seed, rollout_id, attempt, turn, segment)),
            };
            let generation = shared.generator.generate(request).await.map_err(|e| {
                let cause = if e.is_prompt_too_long() {
                    FailureCause::PromptTooLong
                } else if e.is_server_unavailable() {
                    FailureCause::Unavailable
                } else {
                    FailureCause::Generation
                };
                (cause, e.to_string())
            })?;
            Counters::add(&counters.turns, 1);
            Counters::add(&counters.sampled_tokens, generation.token_ids.len() as u64);
            finished.turns += 1;
            finished.versions.0 = finished.versions.0.min(version);
            finished.versions.1 = finished.versions.1.max(version);
            finish = generation.finish;
            let record = TurnRecord::new(
                prompt_ids,
                generation.token_ids,
                generation.logprobs,
                version,
            );
            reconciler
                .push(&record)
                .map_err(|e| (FailureCause::Reconcile, e.to_string()))?;
            let TurnRecord {
                prompt_ids: sent,
                sampled_ids,
                ..
            } = record;
            // What the next request continues: the prompt sent and the ids sampled.
            prompt_ids = sent;
            prompt_ids.extend_from_slice(&sampled_ids);
            answer.extend_from_slice(&sampled_ids);
            segment += 1;
            if finish != Finish::Abort || answer.len() >= max_tokens || segment > MAX_CONTINUATIONS
            {
                break;
            }
        }
        finished.sampled.extend_from_slice(&answer);

        let text = shared.decode(&answer).map_err(render_error)?;
        // Append mode never renders the answer into the next prompt, so its reasoning can go
        // to a field of its own; rerender mode keeps the text as the template will read it.
        let (reasoning, text) = if append {
            split_reasoning(&text)
        } else {
            (None, text.as_str())
        };
        let parsed = shared.parser.parse(text);
        Counters::add(&counters.parse_failures, parsed.failures.len() as u64);
        let mut message = Message::assistant(parsed.content);
        if let Some(reasoning) = reasoning {
            message = message.with("reasoning_content", Value::from(reasoning));
        }
        if !parsed.tool_calls.is_empty() {
            message = message.with_tool_calls(&parsed.tool_calls);
        }
        let assistant_at = render.len();
        render.push(slice::from_ref(&message));
        finished.messages.push(message);

        if finish != Finish::Stop {
            finished.stop = if max_tokens < config.max_tokens as usize && max_tokens == room {
                Stop::Context
            } else {
                Stop::Length
            };
            break;
        }
        let tools = match &lease {
            Some(lease) => Some(lease.get().tools()),
            None => shared.tools.as_ref(),
        };
        let Some(tools) = tools.filter(|_| !parsed.tool_calls.is_empty()) else {
            finished.stop = Stop::Answer;
            break;
        };
        let calls = parsed
            .tool_calls
            .into_iter()
            .map(|call| tool_dispatch::ToolCall::new(call.name, call.arguments).with_id(call.id))
            .collect::<Vec<_>>();
        finished.tool_calls += calls.len() as u64;
        Counters::add(&counters.tool_calls, calls.len() as u64);
        let results = tools
            .run(calls)
            .await
            .map_err(|e| (FailureCause::Cancelled, format!("tools: {e}")))?;
        let start = finished.messages.len();
        for result in results {
            if !result.is_ok() {
                finished.tool_errors += 1;
                Counters::add(&counters.tool_errors, 1);
            }
            let Value::Object(map) = result.to_message() else {
                unreachable!("a tool result's message is an object");
            };
            let message = Message::try_from(map)
                .unwrap_or_else(|e| unreachable!("a tool result's message has a role: {e}"));
            finished.messages.push(message);
        }
        render.push(&finished.messages[start..]);
        if let Some(lease) = &lease {
            match lease.get().status() {
                EpisodeStatus::Running => {}
                EpisodeStatus::Done => {
                    finished.stop = Stop::Done;
                    break;
                }
                EpisodeStatus::Failed(message) => {
                    return Err((FailureCause::Environment, message));
                }
            }
        }
        if append {
            last = Some((prompt_ids, assistant_at, answer.last().copied()));
        }
    }
    if let Some(lease) = &mut lease {
        // The whole conversation, the last assistant message's tool calls included.
        let mut transcript = initial;
        transcript.extend(group.row.prompt.iter().cloned());
        transcript.extend(finished.messages.iter().cloned());
        finished.verdict = Some(lease.get_mut().verify(transcript).await);
    }
    let reconciled = reconciler.finish();
    finished.tally = reconciled.tally;
    finished.rows = reconciled.rows;
    if finished.versions.0 == u64::MAX {
        finished.versions.0 = shared.model_version();
        finished.versions.1 = finished.versions.0;
    }
    Ok(finished)
}

/// The first prompt of a rollout in an environment: the episode's tools and initial
/// messages, then the dataset row's prompt, rendered on the rollout's own task (each episode
/// may offer other tools).
fn episode_prompt<G>(
    shared: &Shared<G>,
    group: &GroupState,
    lease: &Lease<'_>,
    initial: &[Message],
) -> Result<RenderState, RenderError> {
    let mut options = shared.options.clone();
    let specs = lease.get().tools().registry().to_openai();
    options.tools = (!specs.is_empty()).then_some(specs);
    let mut render = shared.tokenizer.incremental(options)?;
    render.push(initial);
    render.push(&group.row.prompt);
    render.prompt()?;
    Ok(render.state())
}

/// A request's seed: distinct for each run seed, rollout, attempt, turn and continuation,
/// and at most `i64::MAX`, the largest seed vLLM accepts.
fn request_seed(seed: u64, rollout: RolloutId, attempt: u32, turn: usize, segment: usize) -> u64 {
    let mut x = seed ^ 0x9e37_79b9_7f4a_7c15;
    for part in [rollout.0, u64::from(attempt), turn as u64, segment as u64] {
        x = (x ^ part).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 31;
    }
    x >> 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_seeds_differ_and_fit_what_vllm_accepts() {
        let mut seen = std::collections::HashSet::new();
        for rollout in 0..64 {
            for attempt in 1..3 {
                for turn in 0..4 {
                    let seed = request_seed(u64::MAX, RolloutId(rollout), attempt, turn, 0);
                    assert!(seed <= i64::MAX as u64);
                    assert!(seen.insert(seed), "seeds are distinct");
                }
            }
        }
    }
}
