//! A white-box rollout: the engine's own loop, prompt -> generate -> parse -> tools -> next
//! prompt, in an environment's episode when the run has one.

use std::sync::Arc;

use super::{
    Limit, Room, TurnState, finish_rows, off_runtime, open_episode, render_error, room,
    sample_answer,
};
use crate::{
    EpisodeStatus, Finish, Generator, PromptMode,
    group::GroupState,
    health::Counters,
    outcome::{Failure, FailureCause, Finished, Stop},
    shared::Shared,
    slot::{EpisodeSlot, Lease},
};
use rollout_core::{
    ChatTokenizer, Message, NoExactDelta, ParsedCall, Reconciler, RenderError, RenderState,
    RolloutId, parse::split_reasoning,
};
use serde_json::Value;

/// One attempt at a conversation: turn after turn until the model answers without a call,
/// `max_turns`, the token budget, the context, or the end of its episode.
pub(super) async fn converse<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: &Arc<GroupState>,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
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
        own_tools: None,
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
    let mut options = shared.wiring.options.clone();
    options.tools = (!tools.is_empty()).then_some(tools);
    let (task, group, initial) = (Arc::clone(shared), Arc::clone(group), initial.to_vec());
    off_runtime(shared, move || {
        let mut render = task.wiring.tokenizer.incremental(options)?;
        render.push(&initial);
        render.push(&group.row.prompt);
        render.prompt()?;
        Ok(render.into_state())
    })
    .await?
    .map_err(render_error)
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
    /// Without an environment, the run's tools as this rollout runs them when a tool has an
    /// instance per rollout (a Python session): made at the first call, dropped with the
    /// conversation however the attempt ends, and with it what the instances hold. Boxed:
    /// most rollouts never have one.
    own_tools: Option<Box<tool_dispatch::ToolDispatcher>>,
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
            let next = next_prompt(&shared.wiring.tokenizer, &first, state, &added, last);
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
            .wiring
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
        let parsed = shared.wiring.parser.parse(text);
        Counters::add(
            &shared.tallies.counters.parse_failures,
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
        if self.lease.is_none() && self.own_tools.is_none() && !calls.is_empty() {
            self.own_tools = shared
                .wiring
                .tools
                .as_ref()
                .and_then(tool_dispatch::ToolDispatcher::for_rollout)
                .map(Box::new);
        }
        let tools = match (&self.lease, &self.own_tools) {
            (Some(lease), _) => Some(lease.get().tools()),
            (None, Some(own)) => Some(&**own),
            (None, None) => shared.wiring.tools.as_ref(),
        };
        let Some(tools) = tools.filter(|_| !calls.is_empty()) else {
            return Ok(false);
        };
        let calls: Vec<tool_dispatch::ToolCall> = calls.into_iter().map(tool_call).collect();
        self.finished.tool_calls += calls.len() as u64;
        Counters::add(&shared.tallies.counters.tool_calls, calls.len() as u64);
        let results = tools
            .run(calls)
            .await
            .map_err(|e| (FailureCause::Cancelled, format!("tools: {e}")))?;
        if let Some(unavailable) = results
            .iter()
            .find(|r| r.outcome == tool_dispatch::Outcome::Unavailable)
        {
            let message = serde_json::from_str::<Value>(&unavailable.content)
                .ok()
                .and_then(|content| content.get("error")?.as_str().map(str::to_owned))
                .unwrap_or_else(|| unavailable.content.clone());
            return Err((FailureCause::ToolBackend, message));
        }
        for result in results {
            if !result.is_ok() {
                self.finished.tool_errors += 1;
                Counters::add(&shared.tallies.counters.tool_errors, 1);
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

/// A parsed call as the dispatcher runs it.
fn tool_call(call: ParsedCall) -> tool_dispatch::ToolCall {
    tool_dispatch::ToolCall::new(call.name, call.arguments).with_id(call.id)
}

/// A tool's result as the conversation's next message.
fn tool_message(result: &tool_dispatch::ToolResult) -> Message {
    Message::tool_result(&result.name, &result.content, result.call_id.clone())
}
