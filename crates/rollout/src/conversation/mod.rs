//! One rollout: the multi-turn loop prompt -> generate -> parse -> tools -> next prompt,
//! feeding each sampled turn to the reconciler as it arrives.
//!
//! Where the prompt mode is decided: before each turn after the first, append mode asks the
//! template for the ids that follow the last answer
//! ([`IncrementalRender::delta`](crate::IncrementalRender::delta)) and sends the previous
//! prompt + the sampled ids + those; when the template has no exact delta, or in rerender
//! mode, the whole conversation is rendered (incrementally) instead and the reconciler
//! compares it with the sampled ids.

mod agent;
mod white_box;

use std::{panic::AssertUnwindSafe, sync::Arc};

use futures::FutureExt;

use crate::{
    EpisodeRequest, Finish, GenerateRequest, Generation, Generator,
    group::GroupState,
    health::Counters,
    lock,
    outcome::{Failure, FailureCause, Finished, RolloutFailure, Stop},
    shared::Shared,
    slot::{EpisodeSlot, Lease},
};
use rollout_core::{ReconcileError, Reconciler, RenderError, RolloutId, TurnRecord};

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
        Counters::add(&shared.tallies.counters.rollouts_started, 1);
        // The attempt's episode, if it opens one, is back here however the attempt ends.
        let episode = EpisodeSlot::default();
        let aborted = lock(&shared.control.abort).clone();
        let outcome = tokio::select! {
            biased;
            () = shared.control.cancel.cancelled() => {
                Err((FailureCause::Cancelled, "cancelled by the drain".to_owned()))
            }
            () = aborted.cancelled() => {
                Counters::add(&shared.tallies.counters.rollouts_aborted, 1);
                Err((FailureCause::Cancelled, "aborted by a pause".to_owned()))
            }
            () = group.stale(shared, config.max_staleness.unwrap_or(0)), if config.max_staleness.is_some() => {
                Err((FailureCause::Stale, format!(
                    "the group's first turn was sampled under version {}, more than {} behind the current {}",
                    group.first_version().unwrap_or(0),
                    config.max_staleness.unwrap_or(0),
                    shared.control.model_version(),
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
                Counters::add(&shared.tallies.counters.rollouts_retried, 1);
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

/// One attempt at a rollout: the agent's, when the run has one, else the engine's own loop.
async fn converse<G: Generator>(
    shared: &Arc<Shared<G>>,
    group: &Arc<GroupState>,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
    match &shared.wiring.agent {
        // Boxed: inline, the agent's state would make every rollout's task larger (3.4 KiB
        // instead of 2.5 KiB), with or without an agent.
        Some(agent) => {
            Box::pin(agent::drive(
                shared,
                group,
                agent.as_ref(),
                rollout_id,
                attempt,
                slot,
            ))
            .await
        }
        None => white_box::converse(shared, group, rollout_id, attempt, slot).await,
    }
}

/// Most continuations of an answer the server aborted part-way (a pause for a weight update
/// aborts requests; the tokens so far stay and sampling resumes after them).
const MAX_CONTINUATIONS: usize = 8;

/// The attempt's episode, opened in the run's environment (none without one) and lent out
/// of the rollout task's `slot`.
async fn open_episode<'s, G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &'s EpisodeSlot,
) -> Result<Option<Lease<'s>>, Failure> {
    let Some(environment) = &shared.wiring.environment else {
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
        .control
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

/// A rollout's outcome with its rows and tally from the reconciler.
fn finish_rows<G>(shared: &Shared<G>, mut finished: Finished, reconciler: Reconciler) -> Finished {
    let reconciled = reconciler.finish();
    finished.tally = reconciled.tally;
    finished.rows = reconciled.rows;
    if finished.versions.0 == u64::MAX {
        finished.versions.0 = shared.control.model_version();
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
    let room = match shared.wiring.max_model_len {
        Some(limit) => (limit as usize).saturating_sub(prompt_len),
        None => usize::MAX,
    };
    if room == 0 {
        return Room::Context {
            context: shared.wiring.max_model_len.unwrap_or(0),
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
        // Held while a pause in continue mode lasts, and read before the version: a request
        // sent after a weight update carries the new version, and none is on the wire while
        // the weights change.
        let on_wire = shared.control.requests.read().await;
        let version = shared.control.model_version();
        group.sampled_under(version);
        let routed_experts_from = shared
            .config
            .routed_experts
            .then(|| reconciler.routing_wanted_from(&prompt_ids));
        let request = GenerateRequest {
            rollout: rollout_id,
            turn,
            prompt_ids: &prompt_ids,
            max_tokens: (max_tokens - answer.len()) as u32,
            sampling,
            seed: sampling
                .seed
                .map(|seed| request_seed(seed, rollout_id, finished.attempts, turn, segment)),
            routed_experts_from,
        };
        Counters::add(
            &shared.tallies.counters.prompt_tokens,
            prompt_ids.len() as u64,
        );
        let sent = std::time::Instant::now();
        let generation = shared.wiring.generator.generate(request).await;
        drop(on_wire);
        shared.tallies.generation_latency.record(sent.elapsed());
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
        Counters::add(&shared.tallies.counters.turns, 1);
        Counters::add(
            &shared.tallies.counters.sampled_tokens,
            generation.token_ids.len() as u64,
        );
        finished.turns += 1;
        finished.versions.0 = finished.versions.0.min(version);
        finished.versions.1 = finished.versions.1.max(version);
        let finish = generation.finish;
        if let Some(from) = routed_experts_from {
            check_routing_reported(shared, &generation, prompt_ids.len(), from)?;
        }
        let record = TurnRecord::new(
            prompt_ids,
            generation.token_ids,
            generation.logprobs,
            version,
        )
        .with_routed_experts(generation.routed_experts);
        reconciler.push(&record).map_err(|e| {
            let cause = match e {
                ReconcileError::Routing { .. } => FailureCause::Routing,
                _ => FailureCause::Reconcile,
            };
            (cause, e.to_string())
        })?;
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
        Counters::add(&shared.tallies.counters.answers_continued, 1);
    }
}

/// With routing replay, stops the run at the first answer that should carry routed experts
/// and does not: the server was not started to report them. An answer the server ended
/// before running the model has none to report.
fn check_routing_reported<G>(
    shared: &Shared<G>,
    generation: &Generation,
    prompt_len: usize,
    from: usize,
) -> Result<(), Failure> {
    let positions = prompt_len + generation.token_ids.len();
    if generation.routed_experts.is_some()
        || positions.saturating_sub(1) <= from
        || generation.finish == Finish::Abort
    {
        return Ok(());
    }
    let reason = "routed_experts is on but the server reported no routed experts: start vLLM \
                  with --enable-return-routed-experts (it needs VLLM_USE_V2_MODEL_RUNNER=1 \
                  and prefix caching), or turn routed_experts off"
        .to_owned();
    shared.control.stop_run(reason.clone());
    Err((FailureCause::Routing, reason))
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
