//! One rollout: the multi-turn loop prompt -> generate -> parse -> tools -> next prompt,
//! feeding each sampled turn to the reconciler as it arrives.
//!
//! Where the prompt mode is decided: before each turn after the first, append mode asks the
//! template for the ids that follow the last answer
//! ([`IncrementalRender::delta`](crate::IncrementalRender::delta)) and sends the previous
//! prompt + the sampled ids + those; when the template has no exact delta, or in rerender
//! mode, the whole conversation is rendered (incrementally) instead and the reconciler
//! compares it with the sampled ids.

use std::{panic::AssertUnwindSafe, sync::Arc};

use futures::FutureExt;
use serde_json::Value;

use crate::{
    PromptMode,
    agent::{Agent, AgentRun, SampleRefused, Sampled, Sampler},
    episode::{EpisodeRequest, EpisodeSlot, EpisodeStatus, Lease},
    generator::{Finish, GenerateRequest, Generator},
    group::GroupState,
    health::Counters,
    lock,
    outcome::{Failure, FailureCause, Finished, RolloutFailure, Stop},
    shared::Shared,
};
use rollout_core::{
    ChatTokenizer, Message, NoExactDelta, ParsedCall, Reconciler, RenderError, RenderState,
    RolloutId, TurnRecord, parse::split_reasoning,
};

/// Runs a rollout with its retries, its deadline and cancellation.
pub(crate) async fn run<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: &Arc<GroupState>,
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
        let aborted = lock(&shared.abort).clone();
        let outcome = tokio::select! {
            biased;
            () = shared.cancel.cancelled() => {
                Err((FailureCause::Cancelled, "cancelled by the drain".to_owned()))
            }
            () = aborted.cancelled() => {
                Counters::add(&shared.counters.rollouts_aborted, 1);
                Err((FailureCause::Cancelled, "aborted by a pause".to_owned()))
            }
            () = group.stale(shared, config.max_staleness.unwrap_or(0)), if config.max_staleness.is_some() => {
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
                Ok(Err(panic)) => Err((
                    FailureCause::Panic,
                    format!("panicked: {}", process::panic_message(&*panic)),
                )),
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

/// Most continuations of an answer the server aborted part-way (a pause for a weight update
/// aborts requests; the tokens so far stay and sampling resumes after them).
const MAX_CONTINUATIONS: usize = 8;

/// One attempt at a conversation: turn after turn until the model answers without a call,
/// `max_turns`, the token budget, the context, or the end of its episode.
async fn converse<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: &Arc<GroupState>,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
    if let Some(agent) = &shared.agent {
        // Boxed: inline, the agent's state would make every rollout's task larger (3.4 KiB
        // instead of 2.5 KiB), with or without an agent.
        return Box::pin(drive_agent(
            shared,
            group,
            agent.as_ref(),
            rollout_id,
            attempt,
            slot,
        ))
        .await;
    }
    let lease = open_episode(shared, group, rollout_id, attempt, slot).await?;
    let initial = lease
        .as_ref()
        .map(|lease| lease.get().initial_messages())
        .unwrap_or_default();
    let first = match &lease {
        Some(lease) => {
            let tools = lease.get().tools().registry().to_openai();
            Arc::new(episode_prompt(shared, group, tools, &initial).await?)
        }
        None => Arc::clone(group.first.as_ref().map_err(|e| render_error(e.clone()))?),
    };
    let mut conversation = Conversation {
        shared,
        group,
        first,
        render: None,
        reconciler: Reconciler::new(rollout_id, shared.config.reconciler),
        finished: Finished::new(rollout_id, attempt),
        last: None,
        lease,
    };
    for turn in 0..shared.config.max_turns {
        let prompt_ids = conversation.prompt(turn).await?;
        let Some(limit) = conversation.limit(turn, prompt_ids.len())? else {
            break;
        };
        let (prompt_ids, answer, finish) = conversation.sample(turn, prompt_ids, limit).await?;
        let (assistant_at, calls) = conversation.answer(&answer)?;
        if finish != Finish::Stop {
            conversation.finished.stop = limit.cut_by();
            break;
        }
        if !conversation.call_tools(calls).await? {
            conversation.finished.stop = Stop::Answer;
            break;
        }
        if conversation.episode_done()? {
            conversation.finished.stop = Stop::Done;
            break;
        }
        if shared.config.prompt_mode == PromptMode::Append {
            conversation.last = Some((prompt_ids, assistant_at, answer.last().copied()));
        }
    }
    let mut prompt = initial;
    prompt.extend(group.row.prompt.iter().cloned());
    conversation.finished.prompt = prompt;
    conversation.verify().await;
    Ok(conversation.finish())
}

/// The attempt's episode, opened in the run's environment (none without one) and lent out
/// of the rollout task's `slot`.
async fn open_episode<'s, G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &'s EpisodeSlot,
) -> Result<Option<Lease<'s>>, Failure> {
    let Some(environment) = &shared.environment else {
        return Ok(None);
    };
    let seed = request_seed(
        shared.config.sampling.seed.unwrap_or(0),
        rollout_id,
        attempt,
        usize::MAX,
        0,
    );
    let request = EpisodeRequest::new(&group.row, seed, format!("r{}-a{attempt}", rollout_id.0));
    let episode = environment
        .open(request)
        .await
        .map_err(|e| (FailureCause::SessionCreate, e.0))?;
    Ok(Some(slot.lease(episode).await))
}

/// The first prompt of a rollout in an environment: the episode's `tools` and initial
/// messages, then the dataset row's prompt. Each episode may offer other tools, so it is
/// rendered per rollout: whole, through the chat template, off the runtime (see
/// [`off_runtime`]), as a group's prompt is rendered on the dataset's reader thread.
async fn episode_prompt<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: &Arc<GroupState>,
    tools: Vec<Value>,
    initial: &[Message],
) -> Result<RenderState, Failure> {
    let mut options = shared.options.clone();
    options.tools = (!tools.is_empty()).then_some(tools);
    let (task, group, initial) = (Arc::clone(shared), Arc::clone(group), initial.to_vec());
    off_runtime(shared, move || {
        let mut render = task.tokenizer.incremental(options)?;
        render.push(&initial);
        render.push(&group.row.prompt);
        render.prompt()?;
        Ok(render.into_state())
    })
    .await?
    .map_err(render_error)
}

/// Runs `job` (a template render and its tokenization) on a blocking thread, at most
/// `render_threads` (the machine's cores) at once, so that the runtime's workers keep
/// serving every other rollout meanwhile. Tokenizing a 2 KB tool result with a real
/// tokenizer takes about a millisecond; with a thousand rollouts in flight, such turns run on
/// a worker held the runtime seconds behind (BENCHMARKS.md, `tool-results`).
async fn off_runtime<G, T: Send + 'static>(
    shared: &Shared<G>,
    job: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Failure> {
    let _slot = shared
        .render_threads
        .acquire()
        .await
        .map_err(|_| (FailureCause::Cancelled, "the engine is closing".to_owned()))?;
    match tokio::task::spawn_blocking(job).await {
        Ok(value) => Ok(value),
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => Err((
            FailureCause::Cancelled,
            "the runtime shut down while a prompt was rendered".to_owned(),
        )),
    }
}

/// A later turn's prompt, built off the runtime.
struct NextPrompt {
    /// The conversation's rendering, for the turn after.
    state: RenderState,
    ids: Vec<u32>,
    /// Why append mode had no exact delta, when it fell back to rendering the whole prompt.
    fell_back: Option<NoExactDelta>,
}

/// Builds the next prompt from the conversation's rendering (`first` when there is none
/// yet) and the messages `added` since it was last brought up to date. With `last` (append
/// mode: the previous prompt, where its answer is in the conversation, the id the answer
/// ended on) it is the previous prompt, the sampled ids (already in it) and the template's
/// delta; without, or when there is no exact delta, the conversation rendered.
fn next_prompt(
    tokenizer: &ChatTokenizer,
    first: &RenderState,
    state: Option<RenderState>,
    added: &[Message],
    last: Option<(Vec<u32>, usize, Option<u32>)>,
) -> Result<NextPrompt, RenderError> {
    let mut render = tokenizer.resume(state.unwrap_or_else(|| first.clone()))?;
    render.push(added);
    let fell_back = match last {
        Some((mut ids, assistant, Some(stop))) => match render.delta(first, assistant, stop) {
            Ok(delta) => {
                ids.extend_from_slice(&delta);
                return Ok(NextPrompt {
                    state: render.into_state(),
                    ids,
                    fell_back: None,
                });
            }
            Err(reason) => Some(reason),
        },
        Some((_, _, None)) => Some(NoExactDelta::NoStopToken { last: None }),
        None => None,
    };
    let ids = render.prompt()?.ids.to_vec();
    Ok(NextPrompt {
        state: render.into_state(),
        ids,
        fell_back,
    })
}

fn render_error(error: RenderError) -> Failure {
    (FailureCause::Render, error.chain())
}

/// How much one turn may sample, and what limits it.
#[derive(Debug, Clone, Copy)]
struct Limit {
    /// Tokens the turn may sample: `max_tokens`, the context left and the rollout's budget.
    max_tokens: usize,
    /// Whether the context left is what limits it.
    by_context: bool,
}

impl Limit {
    /// Why an answer that did not stop by itself was cut.
    fn cut_by(self) -> Stop {
        if self.by_context {
            Stop::Context
        } else {
            Stop::Length
        }
    }
}

/// A conversation in progress: its rendering, its reconciler and what it has produced.
struct Conversation<'a, G> {
    shared: &'a Arc<Shared<G>>,
    group: &'a GroupState,
    /// The group's prompt, rendered once (the episode's, in an environment).
    first: Arc<RenderState>,
    /// The conversation's rendering as of the last prompt: `first`, then the messages
    /// added before it. Made on the first turn after the first, so that a rollout that
    /// answers at once never copies `first`.
    render: Option<RenderState>,
    reconciler: Reconciler,
    finished: Finished,
    /// Append mode: the last turn's prompt and answer, where the answer's message is in the
    /// conversation, and the id the answer ended on.
    last: Option<(Vec<u32>, usize, Option<u32>)>,
    /// The episode the rollout runs in, when the run has an environment.
    lease: Option<Lease<'a>>,
}

impl<G: Generator> Conversation<'_, G> {
    /// The prompt of `turn`: the group's prompt first; then, in append mode, the previous
    /// prompt + the sampled ids + the template's delta, or the conversation rendered when
    /// there is no exact delta (counted) or in rerender mode. Built off the runtime.
    async fn prompt(&mut self, turn: usize) -> Result<Vec<u32>, Failure> {
        // The group's prompt was rendered once with a generation prompt: turn 0 sends it.
        if turn == 0 {
            return Ok(self.first.ids().to_vec());
        }
        // The messages added since the last render go with the job and come back with it.
        let rendered = self
            .render
            .as_ref()
            .map_or(0, |r| r.len() - self.first.len());
        let added = self.finished.messages.split_off(rendered);
        let (shared, first) = (Arc::clone(self.shared), Arc::clone(&self.first));
        let (state, last) = (self.render.take(), self.last.take());
        let (next, added) = off_runtime(self.shared, move || {
            let next = next_prompt(&shared.tokenizer, &first, state, &added, last);
            (next, added)
        })
        .await?;
        self.finished.messages.extend(added);
        let next = next.map_err(render_error)?;
        if let Some(reason) = &next.fell_back {
            self.finished.fallbacks += 1;
            self.shared.fell_back(reason);
        }
        self.render = Some(next.state);
        Ok(next.ids)
    }

    /// What `turn` may sample after a prompt of `prompt_len` tokens; `None` when nothing is
    /// left (the stop recorded), an error when even the first prompt fills the context.
    fn limit(&mut self, turn: usize, prompt_len: usize) -> Result<Option<Limit>, Failure> {
        match room(self.shared, &self.finished, prompt_len) {
            Room::Turn(limit) => Ok(Some(limit)),
            Room::Budget => {
                self.finished.stop = Stop::TokenBudget;
                Ok(None)
            }
            Room::Context { context } if turn == 0 => Err((
                FailureCause::PromptTooLong,
                format!(
                    "the prompt is {prompt_len} tokens, the model's context is {context}: nothing \
                     is left to sample"
                ),
            )),
            Room::Context { .. } => {
                self.finished.stop = Stop::Context;
                Ok(None)
            }
        }
    }

    /// Samples one answer (see [`sample_answer`]).
    async fn sample(
        &mut self,
        turn: usize,
        prompt_ids: Vec<u32>,
        limit: Limit,
    ) -> Result<(Vec<u32>, Vec<u32>, Finish), Failure> {
        sample_answer(
            TurnState {
                shared: self.shared,
                group: self.group,
                finished: &mut self.finished,
                reconciler: &mut self.reconciler,
            },
            turn,
            prompt_ids,
            limit.max_tokens,
        )
        .await
    }

    /// The answer as an assistant message, added to the conversation: decoded, its
    /// reasoning apart in append mode, its tool calls parsed. Returns where the message is in
    /// the rendering and the calls.
    fn answer(&mut self, answer: &[u32]) -> Result<(usize, Vec<ParsedCall>), Failure> {
        let shared = self.shared;
        let text = shared
            .tokenizer
            .decode_answer(answer)
            .map_err(render_error)?;
        // Append mode never renders the answer into the next prompt, so its reasoning can go
        // to a field of its own; rerender mode keeps the text as the template will read it.
        let (reasoning, text) = if shared.config.prompt_mode == PromptMode::Append {
            split_reasoning(&text)
        } else {
            (None, text.as_str())
        };
        let parsed = shared.parser.parse(text);
        Counters::add(
            &shared.counters.parse_failures,
            parsed.failures.len() as u64,
        );
        let mut message = Message::assistant(parsed.content);
        if let Some(reasoning) = reasoning {
            message = message.with("reasoning_content", Value::from(reasoning));
        }
        if !parsed.tool_calls.is_empty() {
            message = message.with_tool_calls(&parsed.tool_calls);
        }
        // Where the message is in the rendering (`first`, then the messages added).
        let assistant_at = self.first.len() + self.finished.messages.len();
        self.finished.messages.push(message);
        self.finished.step_rewards.push(None);
        Ok((assistant_at, parsed.tool_calls))
    }

    /// Runs the calls of an answer in order and adds their results to the conversation.
    /// `false` when there is nothing to run (no call, or no tools): the episode is over.
    async fn call_tools(&mut self, calls: Vec<ParsedCall>) -> Result<bool, Failure> {
        let shared = self.shared;
        let tools = match &self.lease {
            Some(lease) => Some(lease.get().tools()),
            None => shared.tools.as_ref(),
        };
        let Some(tools) = tools.filter(|_| !calls.is_empty()) else {
            return Ok(false);
        };
        let calls: Vec<tool_dispatch::ToolCall> = calls.into_iter().map(tool_call).collect();
        self.finished.tool_calls += calls.len() as u64;
        Counters::add(&shared.counters.tool_calls, calls.len() as u64);
        let results = tools
            .run(calls)
            .await
            .map_err(|e| (FailureCause::Cancelled, format!("tools: {e}")))?;
        for result in results {
            if !result.is_ok() {
                self.finished.tool_errors += 1;
                Counters::add(&shared.counters.tool_errors, 1);
            }
            self.finished.messages.push(tool_message(&result));
        }
        // What the environment gave these calls is the step reward of the answer that made them.
        if let Some(lease) = &mut self.lease
            && let Some(last) = self.finished.step_rewards.last_mut()
        {
            *last = lease.get_mut().take_step_reward();
        }
        Ok(true)
    }

    /// Whether a tool ended the episode; an error when the environment broke.
    fn episode_done(&self) -> Result<bool, Failure> {
        match self.lease.as_ref().map(|lease| lease.get().status()) {
            None | Some(EpisodeStatus::Running) => Ok(false),
            Some(EpisodeStatus::Done) => Ok(true),
            Some(EpisodeStatus::Failed(message)) => Err((FailureCause::Environment, message)),
        }
    }

    /// Has the episode judge the whole conversation (its initial messages, the prompt, every
    /// message the rollout added, the last answer's tool calls included), once.
    async fn verify(&mut self) {
        let Some(lease) = &mut self.lease else {
            return;
        };
        let mut transcript = self.finished.prompt.clone();
        transcript.extend(self.finished.messages.iter().cloned());
        self.finished.verdict = Some(lease.get_mut().verify(transcript).await);
    }

    /// The rollout's outcome: its rows and tally from the reconciler.
    fn finish(self) -> Finished {
        finish_rows(self.shared, self.finished, self.reconciler)
    }
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

/// One attempt of a loop-owning agent: the agent runs the conversation, and the engine
/// samples each turn it asks for (limits, model versions, the reconciler) until its run ends.
/// A generation failure ends the attempt at once (dropping the agent's run stops it). With
/// an environment, the attempt's episode is opened first (its tools are not the agent's) and
/// its verify judges the agent's transcript.
async fn drive_agent<G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    agent: &dyn Agent,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
    let mut lease = open_episode(shared, group, rollout_id, attempt, slot).await?;
    let (sampler, mut requests) = Sampler::channel();
    let mut run = agent.run(AgentRun {
        row: group.row.clone(),
        rollout_id,
        attempt,
        episode_id: format!("r{}-a{attempt}", rollout_id.0),
        sampler,
    });
    let mut finished = Finished::new(rollout_id, attempt);
    finished.stop = Stop::Answer;
    let mut conversations: Vec<AgentConversation> = Vec::new();
    let mut answers = 0;
    let outcome = loop {
        tokio::select! {
            outcome = &mut run => break outcome,
            Some(request) = requests.next() => {
                let id = request.conversation();
                let at = match conversations.iter().position(|c| c.id == id) {
                    Some(at) => at,
                    None => {
                        let reconciler = Reconciler::new(rollout_id, shared.config.reconciler);
                        conversations.push(AgentConversation { id, reconciler, turns: 0 });
                        conversations.len() - 1
                    }
                };
                let conversation = &mut conversations[at];
                let state = TurnState { shared, group, finished: &mut finished, reconciler: &mut conversation.reconciler };
                let prompt_ids = request.prompt_ids().to_vec();
                let answer = agent_turn(state, answers, prompt_ids, request.max_tokens()).await?;
                answers += usize::from(answer.is_ok());
                conversation.turns += u64::from(answer.is_ok());
                request.answer(answer);
            }
        }
    };
    let outcome = outcome.map_err(|e| (FailureCause::Agent, e.0))?;
    if answers == 0 {
        return Err((
            FailureCause::EmptyTrace,
            "the agent ended without calling the model: no turn to train on".to_owned(),
        ));
    }
    Counters::add(&shared.counters.tool_calls, outcome.tool_calls);
    finished.prompt = outcome.prompt;
    finished.messages = outcome.completion;
    finished.verdict = match &mut lease {
        Some(lease) => {
            let mut transcript = finished.prompt.clone();
            transcript.extend(finished.messages.iter().cloned());
            Some(lease.get_mut().verify(transcript).await)
        }
        None => outcome.verdict,
    };
    finished.tool_calls = outcome.tool_calls;
    finished.metrics = outcome.metrics;
    let mut finished =
        conversation_rows(shared, finished, conversations, outcome.main_conversation);
    // Where the agent's history could not be continued from what was sampled.
    let forks = finished.tally.fork as f64;
    finished.metrics.insert("capture_forks".to_owned(), forks);
    Ok(finished)
}

/// Samples the turn an agent asked for, or refuses it past a limit (the stop recorded).
async fn agent_turn<G: Generator>(
    state: TurnState<'_, '_, G>,
    turn: usize,
    prompt_ids: Vec<u32>,
    asked: Option<u32>,
) -> Result<Result<Sampled, SampleRefused>, Failure> {
    let TurnState {
        shared,
        group,
        finished,
        reconciler,
    } = state;
    let config = &shared.config;
    if turn >= config.max_turns {
        finished.stop = Stop::MaxTurns;
        return Ok(Err(SampleRefused::MaxTurns(config.max_turns)));
    }
    let limit = match room(shared, finished, prompt_ids.len()) {
        Room::Turn(limit) => limit,
        Room::Budget => {
            finished.stop = Stop::TokenBudget;
            let budget = config.max_total_tokens.unwrap_or(0);
            return Ok(Err(SampleRefused::TokenBudget(budget)));
        }
        Room::Context { context } => {
            finished.stop = Stop::Context;
            let prompt = prompt_ids.len();
            return Ok(Err(SampleRefused::Context { prompt, context }));
        }
    };
    let max_tokens = match asked.filter(|&n| n > 0) {
        Some(asked) => limit.max_tokens.min(asked as usize),
        None => limit.max_tokens,
    };
    let state = TurnState {
        shared,
        group,
        finished: &mut *finished,
        reconciler,
    };
    let (_, token_ids, finish) = sample_answer(state, turn, prompt_ids, max_tokens).await?;
    // An answer still aborted after its continuations is as cut as one at `max_tokens`.
    let finish = match finish {
        Finish::Stop => Finish::Stop,
        Finish::Length | Finish::Abort => {
            finished.stop = if max_tokens == limit.max_tokens {
                limit.cut_by()
            } else {
                Stop::Length
            };
            Finish::Length
        }
    };
    if finish == Finish::Stop {
        finished.stop = Stop::Answer;
    }
    Ok(Ok(Sampled::new(token_ids, finish)))
}

/// A rollout's outcome with its rows and tally from the reconciler.
fn finish_rows<G>(shared: &Shared<G>, mut finished: Finished, reconciler: Reconciler) -> Finished {
    let reconciled = reconciler.finish();
    finished.tally = reconciled.tally;
    finished.rows = reconciled.rows;
    if finished.versions.0 == u64::MAX {
        finished.versions.0 = shared.model_version();
        finished.versions.1 = finished.versions.0;
    }
    finished
}

/// One of an agent's conversations ([`Sampler::sample_in`](crate::Sampler::sample_in)):
/// reconciled apart from the others, in the order they started.
struct AgentConversation {
    id: Option<usize>,
    reconciler: Reconciler,
    /// Turns sampled in it.
    turns: u64,
}

/// An agent's rollout with the rows of its conversations: only `main`'s when it is given
/// (the others' turns counted: `agent_side_conversations`, `agent_side_turns`), else every
/// conversation's, in the order they started.
fn conversation_rows<G>(
    shared: &Shared<G>,
    mut finished: Finished,
    conversations: Vec<AgentConversation>,
    main: Option<usize>,
) -> Finished {
    let (mut side_conversations, mut side_turns) = (0u64, 0u64);
    let (mut rows, mut tally) = (Vec::new(), std::mem::take(&mut finished.tally));
    for conversation in conversations {
        if main.is_some() && conversation.id != main {
            side_conversations += 1;
            side_turns += conversation.turns;
            continue;
        }
        let reconciled = conversation.reconciler.finish();
        rows.extend(reconciled.rows);
        let from = reconciled.tally;
        tally.clean += from.clean;
        tally.realign += from.realign;
        tally.fork += from.fork;
        tally.drift_tokens += from.drift_tokens;
    }
    if main.is_some() {
        let metrics = &mut finished.metrics;
        metrics.insert(
            "agent_side_conversations".to_owned(),
            side_conversations as f64,
        );
        metrics.insert("agent_side_turns".to_owned(), side_turns as f64);
    }
    finished.tally = tally;
    finished.rows = rows;
    if finished.versions.0 == u64::MAX {
        finished.versions.0 = shared.model_version();
        finished.versions.1 = finished.versions.0;
    }
    finished
}

/// How much a turn may sample after its prompt.
enum Room {
    /// This much.
    Turn(Limit),
    /// Nothing: the rollout's token budget is spent.
    Budget,
    /// Nothing: the prompt fills the model's context.
    Context {
        /// The model's context.
        context: u32,
    },
}

/// What a turn after a prompt of `prompt_len` tokens may sample: `max_tokens`, clipped to the
/// context left and the rollout's token budget.
fn room<G>(shared: &Shared<G>, finished: &Finished, prompt_len: usize) -> Room {
    let config = &shared.config;
    let room = match shared.max_model_len {
        Some(limit) => (limit as usize).saturating_sub(prompt_len),
        None => usize::MAX,
    };
    if room == 0 {
        return Room::Context {
            context: shared.max_model_len.unwrap_or(0),
        };
    }
    let budget = match config.max_total_tokens {
        Some(total) => (total as usize).saturating_sub(finished.sampled.len()),
        None => usize::MAX,
    };
    if budget == 0 {
        return Room::Budget;
    }
    let max_tokens = (config.max_tokens as usize).min(room).min(budget);
    Room::Turn(Limit {
        max_tokens,
        by_context: max_tokens < config.max_tokens as usize && max_tokens == room,
    })
}

/// What sampling a turn updates: the rollout's outcome so far and its reconciler.
struct TurnState<'a, 'b, G> {
    shared: &'a Shared<G>,
    group: &'a GroupState,
    finished: &'b mut Finished,
    reconciler: &'b mut Reconciler,
}

/// Samples one answer of at most `max_tokens`, continuing after aborts (each segment its own
/// turn record, fed to the reconciler as it arrives). Returns the prompt extended by the
/// answer, the answer and how it finished.
async fn sample_answer<G: Generator>(
    to: TurnState<'_, '_, G>,
    turn: usize,
    mut prompt_ids: Vec<u32>,
    max_tokens: usize,
) -> Result<(Vec<u32>, Vec<u32>, Finish), Failure> {
    let TurnState {
        shared,
        group,
        finished,
        reconciler,
    } = to;
    let rollout_id = finished.rollout_id;
    let sampling = &shared.config.sampling;
    let mut answer: Vec<u32> = Vec::new();
    let mut segment = 0;
    loop {
        let version = shared.model_version();
        group.sampled_under(version);
        let request = GenerateRequest {
            rollout: rollout_id,
            turn,
            prompt_ids: &prompt_ids,
            max_tokens: (max_tokens - answer.len()) as u32,
            sampling,
            seed: sampling
                .seed
                .map(|seed| request_seed(seed, rollout_id, finished.attempts, turn, segment)),
        };
        Counters::add(&shared.counters.prompt_tokens, prompt_ids.len() as u64);
        let sent = std::time::Instant::now();
        let generation = shared.generator.generate(request).await;
        shared.generation_latency.record(sent.elapsed());
        let generation = generation.map_err(|e| {
            let cause = if e.is_prompt_too_long() {
                FailureCause::PromptTooLong
            } else if e.is_server_unavailable() {
                FailureCause::Unavailable
            } else {
                FailureCause::Generation
            };
            (cause, e.to_string())
        })?;
        Counters::add(&shared.counters.turns, 1);
        Counters::add(
            &shared.counters.sampled_tokens,
            generation.token_ids.len() as u64,
        );
        finished.turns += 1;
        finished.versions.0 = finished.versions.0.min(version);
        finished.versions.1 = finished.versions.1.max(version);
        let finish = generation.finish;
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
        if finish != Finish::Abort || answer.len() >= max_tokens || segment > MAX_CONTINUATIONS {
            finished.sampled.extend_from_slice(&answer);
            return Ok((prompt_ids, answer, finish));
        }
    }
}

/// A parsed call as the dispatcher runs it.
fn tool_call(call: ParsedCall) -> tool_dispatch::ToolCall {
    tool_dispatch::ToolCall::new(call.name, call.arguments).with_id(call.id)
}

/// A tool's result as the conversation's next message.
fn tool_message(result: &tool_dispatch::ToolResult) -> Message {
    Message::tool_result(&result.name, &result.content, result.call_id.clone())
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
