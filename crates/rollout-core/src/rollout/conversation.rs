//! One rollout: the multi-turn loop prompt -> generate -> parse -> tools -> next prompt,
//! feeding each sampled turn to the reconciler as it arrives.
//!
//! Where the prompt mode is decided: before each turn after the first, append mode asks the
//! template for the ids that follow the last answer
//! ([`IncrementalRender::delta`](crate::IncrementalRender::delta)) and sends the previous
//! prompt + the sampled ids + those; when the template has no exact delta, or in rerender
//! mode, the whole conversation is rendered (incrementally) instead and the reconciler
//! compares it with the sampled ids.

use std::{panic::AssertUnwindSafe, slice};

use futures::FutureExt;
use serde_json::Value;

use super::{
    PromptMode, Shared,
    generator::{Finish, GenerateRequest, Generator},
    group::GroupState,
    health::Counters,
    outcome::{Failure, FailureCause, Finished, RolloutFailure, Stop},
};
use crate::{
    Message, NoExactDelta, Reconciler, RenderError, RolloutId, Tally, TurnRecord,
    parse::split_reasoning,
};

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
                AssertUnwindSafe(converse(shared, group, rollout_id, attempt)).catch_unwind(),
            ) => match outcome {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(panic)) => Err((FailureCause::Panic, panic_message(&*panic))),
                Err(_) => Err((
                    FailureCause::Deadline,
                    format!("still running after the rollout timeout of {:?}", config.rollout_timeout),
                )),
            },
        };
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
) -> Result<Finished, Failure> {
    let first = &group.first;
    let config = &shared.config;
    let counters = &shared.counters;
    let render_error = |e: RenderError| (FailureCause::Render, e.to_string());
    let first = first.as_ref().map_err(|e| render_error(e.clone()))?;
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
        let Some(tools) = shared
            .tools
            .as_ref()
            .filter(|_| !parsed.tool_calls.is_empty())
        else {
            finished.stop = Stop::Answer;
            break;
        };
        let calls = parsed
            .tool_calls
            .into_iter()
            .map(tool_dispatch::ToolCall::from)
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
            finished.messages.push(Message::from(&result));
        }
        render.push(&finished.messages[start..]);
        if append {
            last = Some((prompt_ids, assistant_at, answer.last().copied()));
        }
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

/// A parsed call as the dispatcher runs it.
impl From<crate::ParsedCall> for tool_dispatch::ToolCall {
    fn from(call: crate::ParsedCall) -> Self {
        tool_dispatch::ToolCall::new(call.name, call.arguments).with_id(call.id)
    }
}

/// A tool's result as the conversation's next message.
impl From<&tool_dispatch::ToolResult> for Message {
    fn from(result: &tool_dispatch::ToolResult) -> Self {
        Message::tool_result(&result.name, &result.content, result.call_id.clone())
    }
}
