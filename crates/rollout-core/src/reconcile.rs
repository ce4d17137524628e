//! The turn reconciler: a conversation's turn records in, training rows out.
//!
//! A row holds the tokens of the conversation so far (the *held* tokens). Each new turn's
//! prompt is compared with them:
//!
//! - **CLEAN**: the held tokens are a prefix of the new prompt. The rest of the prompt
//!   (tool results, the next user message, template tokens) is appended as context.
//! - **REALIGN**: the prompt leaves the held tokens inside the last answer (the tokens
//!   sampled by the previous turn of this row) and fewer than `fork_threshold_tokens` held
//!   tokens differ. Typical cause: the answer was re-rendered from parsed text and tokenizes
//!   a little differently. The differing held tokens are overwritten by the prompt's, as
//!   context (mask 0, log-prob 0): the trainer then sees exactly what the model was
//!   conditioned on, at the cost of not training on those few tokens.
//! - **FORK**: anything else (history rewritten before the last answer, or too much drift):
//!   the row is closed and a new row starts from the new prompt.
//!
//! Every transition and every drifted token is counted in a [`Tally`]. The work is linear in
//! the tokens of the turns given.

use serde::{Deserialize, Serialize};

use crate::{RowRouting, TurnRecord, VersionSpan};

/// Identifies the rollout (one conversation) a training row comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RolloutId(pub u64);

/// How the reconciler treats drift (a settings file key and, with the `clap` feature, a flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(default)]
pub struct ReconcilerConfig {
    /// Re-rendered prompts drifting from the sampled ids by more than this many tokens start
    /// a new training row; fewer are realigned (0: never realign)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub fork_threshold_tokens: usize,
}

impl Default for ReconcilerConfig {
    /// `fork_threshold_tokens: 16`: retokenization drift is a handful of tokens at the
    /// answer's edges; a larger difference means the history was rewritten.
    fn default() -> Self {
        Self {
            fork_threshold_tokens: 16,
        }
    }
}

/// One training sequence: the ids, which of them were sampled, and their old log-probs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingRow {
    /// The rollout the row belongs to (a forked conversation has several rows).
    pub rollout_id: RolloutId,
    /// Every token of the sequence: prompts, sampled answers, template and tool tokens.
    pub input_ids: Vec<u32>,
    /// `1` for a sampled token that is trained on, `0` for everything else.
    pub completion_mask: Vec<u8>,
    /// The sampling log-prob of each sampled token, `0.0` everywhere else.
    pub old_log_probs: Vec<f32>,
    /// The oldest model version among the row's sampled tokens (the version of its first
    /// turn when it holds none).
    pub model_version: u64,
    /// The model version of each sampled token, as spans of `input_ids` in order: every
    /// sampled token is in exactly one span; context tokens are in none.
    pub token_versions: Vec<VersionSpan>,
    /// How many turns the row holds.
    pub turns: usize,
    /// With routing replay, the experts routed for every token of `input_ids`.
    pub routed_experts: Option<RowRouting>,
    /// Where each answer's sampled ids are in `input_ids`, in order: one span per answer the
    /// row holds. The continuation of an answer (a turn whose prompt is exactly the held
    /// tokens, as after an abort) extends its answer's span; a realigned answer's span ends
    /// where its overwritten tokens begin.
    pub turn_spans: Vec<std::ops::Range<usize>>,
}

impl TrainingRow {
    /// The number of tokens trained on (`completion_mask` ones).
    pub fn trained_tokens(&self) -> usize {
        self.completion_mask.iter().filter(|&&m| m == 1).count()
    }
}

/// How a turn related to the held tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The first turn of a conversation: a row starts.
    Start,
    /// The held tokens are a prefix of the new prompt.
    Clean,
    /// The prompt differs inside the last answer; `drift_tokens` held tokens were
    /// overwritten as context.
    Realign {
        /// Held tokens replaced by the prompt's.
        drift_tokens: usize,
    },
    /// The prompt differs too much or too early; a new row starts.
    Fork {
        /// Held tokens from the first difference to the end of the closed row.
        drift_tokens: usize,
    },
}

/// Counts of transitions and drift for one conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Turns whose prompt extended the held tokens.
    pub clean: u64,
    /// Turns realigned inside the last answer.
    pub realign: u64,
    /// Turns that started a new row.
    pub fork: u64,
    /// Held tokens that differed from the next prompt, over realigns and forks.
    pub drift_tokens: u64,
}

/// A turn record that cannot be reconciled; nothing of it was applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReconcileError {
    /// Logprobs do not line up with the sampled ids.
    #[error(
        "turn {turn}: {sampled} sampled ids but {logprobs} logprobs; the server must return one logprob per sampled token (request logprobs: 0)"
    )]
    LogprobsLength {
        /// Index of the turn in the conversation.
        turn: usize,
        /// Sampled ids given.
        sampled: usize,
        /// Logprobs given.
        logprobs: usize,
    },
    /// The mask does not line up with the sampled ids.
    #[error(
        "turn {turn}: {sampled} sampled ids but a mask of {mask}; give one entry per sampled id"
    )]
    MaskLength {
        /// Index of the turn in the conversation.
        turn: usize,
        /// Sampled ids given.
        sampled: usize,
        /// Mask entries given.
        mask: usize,
    },
    /// A prompt without tokens cannot have been sent.
    #[error("turn {turn}: the prompt has no token ids; record the ids that were sent")]
    EmptyPrompt {
        /// Index of the turn in the conversation.
        turn: usize,
    },
    /// The routing a server reported does not fit the turn's tokens or the row's layout.
    #[error("turn {turn}: routed experts: {problem}")]
    Routing {
        /// Index of the turn in the conversation.
        turn: usize,
        /// What does not fit.
        problem: String,
    },
    /// A log-prob is NaN (the server clamps -inf to a finite value; NaN is a bug upstream).
    #[error("turn {turn}: logprob of sampled token {index} is NaN")]
    NanLogprob {
        /// Index of the turn in the conversation.
        turn: usize,
        /// Index of the sampled token.
        index: usize,
    },
}

/// The rows and tally of a finished conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Reconciled {
    /// One row, or several when the conversation forked, in order.
    pub rows: Vec<TrainingRow>,
    /// What happened at each turn boundary.
    pub tally: Tally,
}

/// Builds the training rows of one conversation, turn by turn.
#[derive(Debug, Clone)]
pub struct Reconciler {
    config: ReconcilerConfig,
    rollout_id: RolloutId,
    rows: Vec<TrainingRow>,
    current: Option<Open>,
    turns: usize,
    tally: Tally,
}

/// The row being built and where its last answer starts.
#[derive(Debug, Clone)]
struct Open {
    row: TrainingRow,
    last_answer_start: usize,
}

impl Reconciler {
    /// A reconciler for the conversation `rollout_id`.
    pub fn new(rollout_id: RolloutId, config: ReconcilerConfig) -> Self {
        Self {
            config,
            rollout_id,
            rows: Vec::new(),
            current: None,
            turns: 0,
            tally: Tally::default(),
        }
    }

    /// The tokens held by the open row (what a clean next prompt starts with).
    pub fn held(&self) -> &[u32] {
        self.current
            .as_ref()
            .map_or(&[][..], |open| &open.row.input_ids)
    }

    /// The transitions counted so far.
    pub fn tally(&self) -> Tally {
        self.tally
    }

    /// How a turn with this prompt would relate to the held tokens, and how many of them it
    /// shares.
    fn classify(&self, prompt_ids: &[u32]) -> (Transition, usize) {
        let Some(open) = self.current.as_ref() else {
            return (Transition::Start, 0);
        };
        let held = &open.row.input_ids;
        let common = common_prefix(held, prompt_ids);
        let drift_tokens = held.len() - common;
        let transition = if drift_tokens == 0 {
            Transition::Clean
        } else if common >= open.last_answer_start
            && drift_tokens < self.config.fork_threshold_tokens
        {
            Transition::Realign { drift_tokens }
        } else {
            Transition::Fork { drift_tokens }
        };
        (transition, common)
    }

    /// With routing replay, the first position of a request with this prompt whose routing
    /// the row would lack: ask the server for the routing from there on
    /// (`routed_experts_prompt_start`), so that each token's is reported once.
    pub fn routing_wanted_from(&self, prompt_ids: &[u32]) -> usize {
        let have = |open: &Open| open.row.routed_experts.as_ref().map_or(0, |r| r.tokens());
        match (self.classify(prompt_ids), self.current.as_ref()) {
            ((Transition::Clean, _), Some(open)) => have(open),
            ((Transition::Realign { .. }, common), Some(open)) => have(open).min(common),
            _ => 0,
        }
    }

    /// Adds the next turn of the conversation. On error nothing is changed.
    pub fn push(&mut self, turn: &TurnRecord) -> Result<Transition, ReconcileError> {
        self.validate(turn)?;
        let (transition, common) = self.classify(&turn.prompt_ids);
        self.check_routing(turn, transition, common)?;
        self.turns += 1;
        match (transition, self.current.as_mut()) {
            (Transition::Start, _) | (_, None) => {
                self.current = Some(Open::start(self.rollout_id, turn));
            }
            (Transition::Clean, Some(open)) => {
                open.extend_context(&turn.prompt_ids[common..]);
                self.tally.clean += 1;
            }
            (Transition::Realign { .. }, Some(open)) => {
                open.truncate(common);
                open.extend_context(&turn.prompt_ids[common..]);
                self.tally.realign += 1;
            }
            (Transition::Fork { .. }, Some(_)) => self.tally.fork += 1,
        }
        match transition {
            Transition::Fork { drift_tokens } => {
                self.tally.drift_tokens += drift_tokens as u64;
                if let Some(open) = self.current.replace(Open::start(self.rollout_id, turn)) {
                    self.rows.push(open.row);
                }
                self.append_sampled(turn);
            }
            Transition::Realign { drift_tokens } => {
                self.tally.drift_tokens += drift_tokens as u64;
                self.append_sampled(turn);
            }
            Transition::Start | Transition::Clean => self.append_sampled(turn),
        }
        if let Some(open) = self.current.as_mut() {
            open.take_routing(turn);
        }
        Ok(transition)
    }

    /// Refuses routing that does not cover the turn's positions from where it starts to the
    /// last but one (the server never runs the model on the last id it samples), or whose
    /// layout differs from the row's.
    fn check_routing(
        &self,
        turn: &TurnRecord,
        transition: Transition,
        common: usize,
    ) -> Result<(), ReconcileError> {
        let Some(reported) = &turn.routed_experts else {
            return Ok(());
        };
        let problem = |problem: String| ReconcileError::Routing {
            turn: self.turns,
            problem,
        };
        let positions = turn.prompt_ids.len() + turn.sampled_ids.len();
        let expected = (positions - 1).saturating_sub(reported.start);
        if reported.tokens != expected {
            return Err(problem(format!(
                "the server reported {} positions from position {}, but the turn's {positions} \
                 tokens need {expected} (every token from there on but the last sampled)",
                reported.tokens, reported.start
            )));
        }
        let bytes = reported.tokens * reported.stride();
        if reported.data.len() != bytes {
            return Err(problem(format!(
                "{} bytes of ids for shape [{}, {}, {}] of {:?}, which needs {bytes}",
                reported.data.len(),
                reported.tokens,
                reported.layers,
                reported.top_k,
                reported.dtype
            )));
        }
        let continued = matches!(transition, Transition::Clean | Transition::Realign { .. });
        if let (true, Some(open)) = (continued, self.current.as_ref())
            && let Some(routing) = &open.row.routed_experts
        {
            if !routing.fits(reported) {
                return Err(problem(format!(
                    "[{} layers, top {}, {:?}] after earlier turns of [{} layers, top {}, {:?}]",
                    reported.layers,
                    reported.top_k,
                    reported.dtype,
                    routing.layers,
                    routing.top_k,
                    routing.dtype
                )));
            }
            let have = routing.tokens().min(common);
            if reported.start > have {
                return Err(problem(format!(
                    "reported from position {}, but the row has the routing of {have} tokens \
                     only: positions in between would be lost",
                    reported.start
                )));
            }
        } else if reported.start != 0 {
            return Err(problem(format!(
                "the row starts with this turn but the routing from position {}",
                reported.start
            )));
        }
        Ok(())
    }

    /// Closes the open row and returns every row with the tally. Each row's vectors are cut
    /// to their length: grown by doubling as turns were appended, they would otherwise keep
    /// up to twice the memory while the row waits to be scored and trained on.
    pub fn finish(mut self) -> Reconciled {
        self.rows.extend(self.current.take().map(|open| open.row));
        for row in &mut self.rows {
            row.input_ids.shrink_to_fit();
            row.completion_mask.shrink_to_fit();
            row.old_log_probs.shrink_to_fit();
            if let Some(oldest) = row.token_versions.iter().map(|s| s.version).min() {
                row.model_version = oldest;
            }
            if let Some(routing) = &mut row.routed_experts {
                routing.pad_to(row.input_ids.len());
                routing.data.shrink_to_fit();
            }
        }
        Reconciled {
            rows: self.rows,
            tally: self.tally,
        }
    }

    fn append_sampled(&mut self, turn: &TurnRecord) {
        if let Some(open) = self.current.as_mut() {
            open.append_sampled(turn);
        }
    }

    fn validate(&self, turn: &TurnRecord) -> Result<(), ReconcileError> {
        let index = self.turns;
        if turn.prompt_ids.is_empty() {
            return Err(ReconcileError::EmptyPrompt { turn: index });
        }
        if turn.sampled_ids.len() != turn.logprobs.len() {
            return Err(ReconcileError::LogprobsLength {
                turn: index,
                sampled: turn.sampled_ids.len(),
                logprobs: turn.logprobs.len(),
            });
        }
        if let Some(mask) = &turn.mask
            && mask.len() != turn.sampled_ids.len()
        {
            return Err(ReconcileError::MaskLength {
                turn: index,
                sampled: turn.sampled_ids.len(),
                mask: mask.len(),
            });
        }
        if let Some(position) = turn.logprobs.iter().position(|l| l.is_nan()) {
            return Err(ReconcileError::NanLogprob {
                turn: index,
                index: position,
            });
        }
        Ok(())
    }
}

impl Open {
    /// A row holding the turn's prompt as context (its sampled ids come next).
    fn start(rollout_id: RolloutId, turn: &TurnRecord) -> Self {
        let mut open = Self {
            row: TrainingRow {
                rollout_id,
                input_ids: Vec::new(),
                completion_mask: Vec::new(),
                old_log_probs: Vec::new(),
                model_version: turn.model_version,
                token_versions: Vec::new(),
                routed_experts: None,
                turns: 0,
                turn_spans: Vec::new(),
            },
            last_answer_start: 0,
        };
        open.extend_context(&turn.prompt_ids);
        open
    }

    fn extend_context(&mut self, ids: &[u32]) {
        let row = &mut self.row;
        row.input_ids.extend_from_slice(ids);
        row.completion_mask.resize(row.input_ids.len(), 0);
        row.old_log_probs.resize(row.input_ids.len(), 0.0);
    }

    fn truncate(&mut self, len: usize) {
        let row = &mut self.row;
        row.input_ids.truncate(len);
        row.completion_mask.truncate(len);
        row.old_log_probs.truncate(len);
        if let Some(last) = row.turn_spans.last_mut() {
            last.end = last.end.min(len);
        }
        if let Some(routing) = &mut row.routed_experts {
            routing.truncate(len);
        }
        // Overwritten tokens are context now: no version of theirs is kept.
        row.token_versions.retain(|span| span.start < len);
        if let Some(last) = row.token_versions.last_mut() {
            last.end = last.end.min(len);
        }
    }

    /// Takes the turn's routing of the tokens the row has none for (after the turn's ids
    /// were appended: the row is the turn's prompt then its sampled ids).
    fn take_routing(&mut self, turn: &TurnRecord) {
        let Some(reported) = &turn.routed_experts else {
            return;
        };
        let routing = self
            .row
            .routed_experts
            .get_or_insert_with(|| RowRouting::like(reported));
        // The positions between what the row has and where the report starts were checked
        // to be none; those before it are kept as first reported.
        let have = routing.tokens();
        if reported.start + reported.tokens > have {
            routing.extend_from(reported, have.max(reported.start));
        }
    }

    fn append_sampled(&mut self, turn: &TurnRecord) {
        let row = &mut self.row;
        let start = row.input_ids.len();
        self.last_answer_start = start;
        let end = start + turn.sampled_ids.len();
        match row.turn_spans.last_mut() {
            // Nothing came between the last answer and these ids: they continue it.
            Some(last) if last.end == start && start > 0 && turn.prompt_ids.len() == start => {
                last.end = end;
            }
            _ => row.turn_spans.push(start..end),
        }
        row.input_ids.extend_from_slice(&turn.sampled_ids);
        row.old_log_probs.extend_from_slice(&turn.logprobs);
        match &turn.mask {
            Some(mask) => row
                .completion_mask
                .extend(mask.iter().map(|&trained| u8::from(trained))),
            None => row.completion_mask.resize(row.input_ids.len(), 1),
        }
        match row.token_versions.last_mut() {
            Some(last) if last.end == start && last.version == turn.model_version => {
                last.end = end;
            }
            _ if end > start => row.token_versions.push(VersionSpan {
                start,
                end,
                version: turn.model_version,
            }),
            _ => {}
        }
        row.turns += 1;
    }
}

/// Reconciles a whole conversation at once.
pub fn reconcile(
    rollout_id: RolloutId,
    turns: &[TurnRecord],
    config: ReconcilerConfig,
) -> Result<Reconciled, ReconcileError> {
    let mut reconciler = Reconciler::new(rollout_id, config);
    for turn in turns {
        reconciler.push(turn)?;
    }
    Ok(reconciler.finish())
}

/// Length of the longest common prefix, compared a block at a time first (a memcmp for ids
/// and bytes), then element by element.
pub(crate) fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    const BLOCK: usize = 256;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_crosses_block_boundaries() {
        let a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 1000);
        b[300] = 7;
        assert_eq!(common_prefix(&a, &b), 300);
        assert_eq!(common_prefix(&a[..10], &b), 10);
        assert_eq!(common_prefix(&[], &b), 0);
    }
}
