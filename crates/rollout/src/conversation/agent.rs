//! A loop-owning agent's rollout: the agent runs the conversation and asks for each turn
//! through its [`Sampler`]; the engine samples it as it samples a white-box turn, and
//! reconciles each of the agent's conversations apart.

use super::{Room, TurnState, open_episode, room, sample_answer};
use crate::{
    Agent, AgentRun, Finish, Generator, SampleRefused, Sampled, Sampler,
    group::GroupState,
    health::Counters,
    outcome::{Failure, FailureCause, Finished, Stop},
    shared::Shared,
    slot::EpisodeSlot,
};
use rollout_core::{Reconciler, RolloutId};

/// One attempt of a loop-owning agent: the agent runs the conversation, and the engine
/// samples each turn it asks for (limits, model versions, the reconciler) until its run ends.
/// A generation failure ends the attempt at once (dropping the agent's run stops it). With
/// an environment, the attempt's episode is opened first (its tools are not the agent's) and
/// its verify judges the agent's transcript.
pub(super) async fn drive<G: Generator>(
    shared: &Shared<G>,
    group: &GroupState,
    agent: &dyn Agent,
    rollout_id: RolloutId,
    attempt: u32,
    slot: &EpisodeSlot,
) -> Result<Finished, Failure> {
    let mut lease = open_episode(shared, group, rollout_id, attempt, slot).await?;
    let (sampler, mut requests) = Sampler::channel();
    let mut run = agent.run(AgentRun::new(
        group.row.clone(),
        rollout_id,
        attempt,
        sampler,
    ));
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
    Counters::add(&shared.tallies.counters.tool_calls, outcome.tool_calls);
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
        finished.versions.0 = shared.control.model_version();
        finished.versions.1 = finished.versions.0;
    }
    finished
}
