//! The reconciler: each classification, threshold edges, masks, log-prob alignment, errors.

use async_grpo_rollout_core::{
    ExpertDtype, ReconcileError, Reconciler, ReconcilerConfig, RolloutId, RoutedExperts, Tally,
    TrainingRow, Transition, TurnRecord, VersionSpan, reconcile,
};
use proptest::prelude::*;

const ID: RolloutId = RolloutId(7);

fn config(fork_threshold_tokens: usize) -> ReconcilerConfig {
    ReconcilerConfig {
        fork_threshold_tokens,
    }
}

/// A turn whose sampled token `t` has log-prob `-t / 100`, so alignment is checkable.
fn turn(prompt: &[u32], sampled: &[u32]) -> TurnRecord {
    TurnRecord::new(
        prompt.to_vec(),
        sampled.to_vec(),
        sampled.iter().map(|&t| logprob_of(t)).collect(),
        0,
    )
}

fn logprob_of(token: u32) -> f32 {
    -(token as f32) / 100.0
}

fn one_row(reconciler: Reconciler) -> (TrainingRow, Tally) {
    let mut reconciled = reconciler.finish();
    assert_eq!(reconciled.rows.len(), 1, "{:?}", reconciled.rows);
    (reconciled.rows.remove(0), reconciled.tally)
}

#[test]
fn the_first_turn_starts_a_row_with_its_prompt_as_context() {
    let mut reconciler = Reconciler::new(ID, config(4));
    assert_eq!(
        reconciler.push(&turn(&[1, 2, 3], &[10, 11])),
        Ok(Transition::Start)
    );
    let (row, tally) = one_row(reconciler);
    assert_eq!(row.rollout_id, ID);
    assert_eq!(row.input_ids, [1, 2, 3, 10, 11]);
    assert_eq!(row.completion_mask, [0, 0, 0, 1, 1]);
    assert_eq!(row.old_log_probs, [0.0, 0.0, 0.0, -0.10, -0.11]);
    assert_eq!(row.turns, 1);
    assert_eq!(tally, Tally::default());
}

#[test]
fn a_clean_turn_appends_only_the_new_prompt_tokens_as_context() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler
        .push(&turn(&[1, 2], &[10, 11]))
        .expect("valid turns");
    assert_eq!(
        reconciler.push(&turn(&[1, 2, 10, 11, 3, 4], &[12])),
        Ok(Transition::Clean)
    );
    let (row, tally) = one_row(reconciler);
    assert_eq!(row.input_ids, [1, 2, 10, 11, 3, 4, 12]);
    assert_eq!(row.completion_mask, [0, 0, 1, 1, 0, 0, 1]);
    assert_eq!(row.old_log_probs, [0.0, 0.0, -0.10, -0.11, 0.0, 0.0, -0.12]);
    assert_eq!(
        tally,
        Tally {
            clean: 1,
            ..Tally::default()
        }
    );
}

#[test]
fn a_prompt_equal_to_the_held_tokens_is_clean() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler.push(&turn(&[1], &[10])).expect("valid turns");
    assert_eq!(
        reconciler.push(&turn(&[1, 10], &[11])),
        Ok(Transition::Clean)
    );
    let (row, _) = one_row(reconciler);
    assert_eq!(row.input_ids, [1, 10, 11]);
    assert_eq!(row.completion_mask, [0, 1, 1]);
}

#[test]
fn drift_inside_the_last_answer_overwrites_it_as_context() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler
        .push(&turn(&[1, 2], &[10, 11, 12]))
        .expect("valid turns");
    // The answer re-tokenized as 10, 99 (11 and 12 merged differently), then a tool result.
    assert_eq!(
        reconciler.push(&turn(&[1, 2, 10, 99, 5], &[13])),
        Ok(Transition::Realign { drift_tokens: 2 })
    );
    let (row, tally) = one_row(reconciler);
    assert_eq!(row.input_ids, [1, 2, 10, 99, 5, 13]);
    assert_eq!(row.completion_mask, [0, 0, 1, 0, 0, 1]);
    assert_eq!(row.old_log_probs, [0.0, 0.0, -0.10, 0.0, 0.0, -0.13]);
    assert_eq!(
        tally,
        Tally {
            realign: 1,
            drift_tokens: 2,
            ..Tally::default()
        }
    );
}

#[test]
fn a_prompt_that_cuts_the_last_answer_short_is_realigned() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler
        .push(&turn(&[1], &[10, 11, 2]))
        .expect("valid turns");
    // The template dropped the sampled end-of-turn token 2 and the prompt stops there.
    assert_eq!(
        reconciler.push(&turn(&[1, 10, 11], &[12])),
        Ok(Transition::Realign { drift_tokens: 1 })
    );
    let (row, _) = one_row(reconciler);
    assert_eq!(row.input_ids, [1, 10, 11, 12]);
    assert_eq!(row.completion_mask, [0, 1, 1, 1]);
}

#[test]
fn drift_one_below_the_threshold_realigns_and_at_the_threshold_forks() {
    let first = turn(&[1], &[10, 11, 12, 13]);
    // 3 held tokens differ (11, 12, 13).
    let next = turn(&[1, 10, 50, 51, 52, 5], &[14]);
    let realigned = reconcile(ID, &[first.clone(), next.clone()], config(4)).expect("valid turns");
    assert_eq!(realigned.rows.len(), 1);
    assert_eq!(realigned.tally.realign, 1);
    assert_eq!(realigned.tally.drift_tokens, 3);

    let forked = reconcile(ID, &[first, next], config(3)).expect("valid turns");
    assert_eq!(forked.rows.len(), 2);
    assert_eq!(
        forked.tally,
        Tally {
            fork: 1,
            drift_tokens: 3,
            ..Tally::default()
        }
    );
}

#[test]
fn a_zero_threshold_never_realigns() {
    let turns = [turn(&[1], &[10, 11]), turn(&[1, 10, 12], &[13])];
    let reconciled = reconcile(ID, &turns, config(0)).expect("valid turns");
    assert_eq!(reconciled.tally.fork, 1);
    assert_eq!(reconciled.rows.len(), 2);
}

#[test]
fn history_rewritten_before_the_last_answer_forks_a_new_row() {
    let mut reconciler = Reconciler::new(ID, config(100));
    reconciler
        .push(&turn(&[1, 2, 3], &[10, 11]))
        .expect("valid turns");
    // One token of the earlier prompt changed: drift is small but outside the last answer.
    assert_eq!(
        reconciler.push(&turn(&[1, 2, 4, 10, 11, 5], &[12])),
        Ok(Transition::Fork { drift_tokens: 3 })
    );
    let reconciled = reconciler.finish();
    let [closed, opened] = &reconciled.rows[..] else {
        panic!("two rows expected: {:?}", reconciled.rows);
    };
    assert_eq!(closed.input_ids, [1, 2, 3, 10, 11]);
    assert_eq!(closed.completion_mask, [0, 0, 0, 1, 1]);
    assert_eq!(opened.rollout_id, ID);
    assert_eq!(opened.input_ids, [1, 2, 4, 10, 11, 5, 12]);
    assert_eq!(opened.completion_mask, [0, 0, 0, 0, 0, 0, 1]);
    assert_eq!(opened.old_log_probs[6], -0.12);
    assert_eq!(
        reconciled.tally,
        Tally {
            fork: 1,
            drift_tokens: 3,
            ..Tally::default()
        }
    );
}

#[test]
fn finished_rows_hold_no_more_memory_than_their_tokens() {
    let mut reconciler = Reconciler::new(ID, config(100));
    let prompt: Vec<u32> = (1..=150).collect();
    reconciler
        .push(&turn(&prompt, &[900; 12]))
        .expect("valid turns");
    // A fork closes a row mid-conversation: it is cut too.
    let mut forked = prompt.clone();
    forked[0] = 0;
    forked.extend([900; 12]);
    forked.push(7);
    reconciler
        .push(&turn(&forked, &[901; 3]))
        .expect("valid turns");
    let reconciled = reconciler.finish();
    assert_eq!(reconciled.rows.len(), 2, "{:?}", reconciled.tally);
    for row in &reconciled.rows {
        // Appending the answer to the prompt's exact-size vectors doubled their capacity.
        assert_eq!(row.input_ids.capacity(), row.input_ids.len());
        assert_eq!(row.completion_mask.capacity(), row.completion_mask.len());
        assert_eq!(row.old_log_probs.capacity(), row.old_log_probs.len());
    }
}

#[test]
fn realign_is_measured_against_the_last_answer_not_earlier_ones() {
    let mut reconciler = Reconciler::new(ID, config(100));
    reconciler.push(&turn(&[1], &[10])).expect("valid turns");
    reconciler
        .push(&turn(&[1, 10, 2], &[20, 21]))
        .expect("valid turns");
    // The first answer (10) changed: that is history, not the last answer.
    assert_eq!(
        reconciler.push(&turn(&[1, 11, 2, 20, 21, 3], &[30])),
        Ok(Transition::Fork { drift_tokens: 4 })
    );
}

#[test]
fn a_per_token_mask_keeps_masked_tokens_out_of_training_but_keeps_their_logprobs() {
    let turns = [turn(&[1], &[10, 11, 12]).with_mask(vec![true, false, true])];
    let row = &reconcile(ID, &turns, config(4)).expect("valid turns").rows[0];
    assert_eq!(row.input_ids, [1, 10, 11, 12]);
    assert_eq!(row.completion_mask, [0, 1, 0, 1]);
    assert_eq!(row.old_log_probs, [0.0, -0.10, -0.11, -0.12]);
    assert_eq!(row.trained_tokens(), 2);
}

#[test]
fn a_row_carries_the_oldest_model_version_of_its_turns() {
    let mut second = turn(&[1, 10, 2], &[11]);
    second.model_version = 3;
    let mut first = turn(&[1], &[10]);
    first.model_version = 5;
    let row = &reconcile(ID, &[first, second], config(4))
        .expect("valid turns")
        .rows[0];
    assert_eq!(row.model_version, 3);
    assert_eq!(row.turns, 2);
}

fn versioned(prompt: &[u32], sampled: &[u32], version: u64) -> TurnRecord {
    let mut record = turn(prompt, sampled);
    record.model_version = version;
    record
}

fn span(start: usize, end: usize, version: u64) -> VersionSpan {
    VersionSpan {
        start,
        end,
        version,
    }
}

#[test]
fn each_sampled_token_keeps_the_version_that_sampled_it() {
    let mut reconciler = Reconciler::new(ID, config(4));
    for record in [
        // An answer sampled under 1, aborted after [3, 4]; continued under 2 with [5] (the
        // prompt is exactly the held tokens), then continued again under 2 with [6].
        versioned(&[1, 2], &[3, 4], 1),
        versioned(&[1, 2, 3, 4], &[5], 2),
        versioned(&[1, 2, 3, 4, 5], &[6], 2),
        // A tool result [9], then the next answer under 2.
        versioned(&[1, 2, 3, 4, 5, 6, 9], &[7, 8], 2),
    ] {
        reconciler.push(&record).expect("valid turns");
    }
    let (row, _) = one_row(reconciler);
    assert_eq!(
        row.token_versions,
        [span(2, 4, 1), span(4, 6, 2), span(7, 9, 2)]
    );
    assert_eq!(row.model_version, 1, "the oldest among its tokens");
}

#[test]
fn a_realigned_token_loses_its_version_and_the_row_its_oldest_when_none_is_left() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler
        .push(&versioned(&[1], &[2, 3], 1))
        .expect("valid turns");
    // The answer re-rendered from [2, 3] to [2, 4]: 3 is overwritten as context.
    reconciler
        .push(&versioned(&[1, 2, 4, 5], &[6], 2))
        .expect("valid turns");
    let (row, _) = one_row(reconciler);
    assert_eq!(row.token_versions, [span(1, 2, 1), span(4, 5, 2)]);

    // Every token of version 1 overwritten: the row's oldest version is 2.
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler.push(&versioned(&[1], &[2], 1)).expect("valid");
    reconciler
        .push(&versioned(&[1, 7, 5], &[6], 2))
        .expect("valid turns");
    let (row, _) = one_row(reconciler);
    assert_eq!(row.token_versions, [span(3, 4, 2)]);
    assert_eq!(row.model_version, 2);
}

#[test]
fn a_turn_with_nothing_sampled_adds_only_context() {
    let turns = [turn(&[1], &[10]), turn(&[1, 10, 2], &[])];
    let row = &reconcile(ID, &turns, config(4)).expect("valid turns").rows[0];
    assert_eq!(row.input_ids, [1, 10, 2]);
    assert_eq!(row.completion_mask, [0, 1, 0]);
}

#[test]
fn malformed_turns_are_errors_that_name_the_turn_and_change_nothing() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler.push(&turn(&[1], &[10])).expect("valid turns");
    let mut short_logprobs = turn(&[1, 10], &[11, 12]);
    short_logprobs.logprobs.pop();
    let error = reconciler
        .push(&short_logprobs)
        .expect_err("an invalid turn");
    assert_eq!(
        error,
        ReconcileError::LogprobsLength {
            turn: 1,
            sampled: 2,
            logprobs: 1
        }
    );
    assert!(
        error
            .to_string()
            .starts_with("turn 1: 2 sampled ids but 1 logprobs"),
        "{error}"
    );
    assert_eq!(
        reconciler.push(&turn(&[1, 10], &[11]).with_mask(vec![true, true])),
        Err(ReconcileError::MaskLength {
            turn: 1,
            sampled: 1,
            mask: 2
        })
    );
    assert_eq!(
        reconciler.push(&turn(&[], &[11])),
        Err(ReconcileError::EmptyPrompt { turn: 1 })
    );
    let mut nan = turn(&[1, 10], &[11, 12]);
    nan.logprobs[1] = f32::NAN;
    assert_eq!(
        reconciler.push(&nan),
        Err(ReconcileError::NanLogprob { turn: 1, index: 1 })
    );
    assert_eq!(reconciler.held(), [1, 10]);
    assert_eq!(
        reconciler.push(&turn(&[1, 10, 2], &[11])),
        Ok(Transition::Clean)
    );
    let (row, _) = one_row(reconciler);
    assert_eq!(row.input_ids, [1, 10, 2, 11]);
}

/// An append-only conversation: each prompt is the held tokens plus new context.
fn append_only() -> impl Strategy<Value = Vec<(Vec<u32>, Vec<u32>)>> {
    prop::collection::vec(
        (
            prop::collection::vec(0u32..1000, 1..20),
            prop::collection::vec(1000u32..2000, 0..20),
        ),
        1..12,
    )
}

proptest! {
    #[test]
    fn in_append_only_conversations_the_trained_tokens_are_exactly_the_sampled_ones(
        steps in append_only()
    ) {
        let mut held = Vec::new();
        let mut turns = Vec::new();
        let mut all_sampled = Vec::new();
        for (context, sampled) in &steps {
            held.extend_from_slice(context);
            turns.push(turn(&held, sampled));
            held.extend_from_slice(sampled);
            all_sampled.extend_from_slice(sampled);
        }
        let reconciled = reconcile(ID, &turns, config(4)).expect("valid turns");
        prop_assert_eq!(reconciled.rows.len(), 1);
        let row = &reconciled.rows[0];
        prop_assert_eq!(&row.input_ids, &held);
        let trained: Vec<u32> = row.input_ids.iter().zip(&row.completion_mask)
            .filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        prop_assert_eq!(&trained, &all_sampled);
        for ((token, mask), logprob) in row.input_ids.iter().zip(&row.completion_mask).zip(&row.old_log_probs) {
            let expected = if *mask == 1 { logprob_of(*token) } else { 0.0 };
            prop_assert_eq!(*logprob, expected);
        }
        prop_assert_eq!(reconciled.tally, Tally { clean: steps.len() as u64 - 1, ..Tally::default() });
    }

    #[test]
    fn any_sequence_of_prompts_gives_rows_of_consistent_lengths(
        steps in prop::collection::vec(
            (prop::collection::vec(0u32..4, 1..12), prop::collection::vec(0u32..4, 0..6)), 1..10),
        threshold in 0usize..6,
    ) {
        let turns: Vec<TurnRecord> = steps.iter().map(|(p, s)| turn(p, s)).collect();
        let reconciled = reconcile(ID, &turns, config(threshold)).expect("valid turns");
        let tally = reconciled.tally;
        prop_assert_eq!(tally.clean + tally.realign + tally.fork, steps.len() as u64 - 1);
        prop_assert_eq!(reconciled.rows.len() as u64, tally.fork + 1);
        for row in &reconciled.rows {
            prop_assert_eq!(row.input_ids.len(), row.completion_mask.len());
            prop_assert_eq!(row.input_ids.len(), row.old_log_probs.len());
        }
        // Every sampled token (mask 1 here: no turn has a mask) is in exactly one version
        // span, and nothing else is.
        for row in &reconciled.rows {
            let mut covered = vec![0u8; row.input_ids.len()];
            for span in &row.token_versions {
                prop_assert!(span.start < span.end && span.end <= row.input_ids.len());
                for c in &mut covered[span.start..span.end] {
                    *c += 1;
                }
            }
            prop_assert_eq!(&covered, &row.completion_mask);
        }
        // The last row ends with the last turn's prompt and sampled ids.
        let (last_prompt, last_sampled) = &steps[steps.len() - 1];
        let last = &reconciled.rows[reconciled.rows.len() - 1];
        let expected: Vec<u32> = last_prompt.iter().chain(last_sampled).copied().collect();
        prop_assert_eq!(&last.input_ids, &expected);
    }
}

#[test]
fn each_answer_has_its_span_a_continuation_extends_it_and_a_realign_shortens_it() {
    let mut reconciler = Reconciler::new(ID, config(4));
    // An answer [3, 4] after the prompt [1, 2], continued with [5] (an aborted answer: the
    // next prompt is exactly the held tokens), then a second answer [6, 7] after [9, 9].
    for (prompt, sampled) in [
        (&[1, 2][..], &[3, 4][..]),
        (&[1, 2, 3, 4], &[5]),
        (&[1, 2, 3, 4, 5, 9, 9], &[6, 7]),
    ] {
        reconciler
            .push(&turn(prompt, sampled))
            .expect("valid turns");
    }
    assert_eq!(reconciler.held(), [1, 2, 3, 4, 5, 9, 9, 6, 7]);
    // The next prompt re-renders the last answer's 7 as 8: realigned, so the second answer's
    // span ends before the overwritten token; a third answer [11] follows.
    assert_eq!(
        reconciler.push(&turn(&[1, 2, 3, 4, 5, 9, 9, 6, 8, 10], &[11])),
        Ok(Transition::Realign { drift_tokens: 1 })
    );
    let (row, _) = one_row(reconciler);
    assert_eq!(row.turn_spans, [2..5, 7..8, 10..11]);
    for span in &row.turn_spans {
        assert!(row.completion_mask[span.clone()].iter().all(|&m| m == 1));
    }
    assert_eq!(row.turns, 4, "four turn records");
}

#[test]
fn a_forked_row_holds_the_spans_of_its_own_answers() {
    let mut reconciler = Reconciler::new(ID, config(2));
    reconciler.push(&turn(&[1], &[2, 3])).expect("valid");
    reconciler.push(&turn(&[9, 9, 9], &[4])).expect("valid");
    let reconciled = reconciler.finish();
    let spans: Vec<Vec<(usize, usize)>> = reconciled
        .rows
        .iter()
        .map(|row| row.turn_spans.iter().map(|s| (s.start, s.end)).collect())
        .collect();
    assert_eq!(spans, [[(1, 3)], [(3, 4)]]);
}

/// Routing as a server of 2 layers, top 1, reports it for the positions `start..` of a turn
/// of `positions` tokens: the expert of position `p` at layer `l` is `seed + 10 p + l`.
fn routed(start: usize, positions: usize, seed: u8) -> RoutedExperts {
    let tokens = positions - 1 - start;
    RoutedExperts {
        start,
        tokens,
        layers: 2,
        top_k: 1,
        dtype: ExpertDtype::Uint8,
        data: (start..positions - 1)
            .flat_map(|p| [seed + 10 * p as u8, seed + 10 * p as u8 + 1])
            .collect(),
    }
}

fn experts_of(row: &TrainingRow) -> Vec<Option<u16>> {
    let routing = row.routed_experts.as_ref().expect("routing");
    (0..row.input_ids.len())
        .map(|t| routing.experts(t, 1).map(|e| e[0]))
        .collect()
}

#[test]
fn each_token_keeps_the_routing_first_reported_and_the_last_token_is_missing() {
    let mut reconciler = Reconciler::new(ID, config(4));
    let first = turn(&[1, 2], &[3, 4]);
    assert_eq!(reconciler.routing_wanted_from(&first.prompt_ids), 0);
    reconciler
        .push(&first.clone().with_routed_experts(Some(routed(0, 4, 0))))
        .expect("valid");
    // The next prompt extends the held tokens: only the last sampled token lacks routing.
    let second = turn(&[1, 2, 3, 4, 5], &[6]);
    assert_eq!(reconciler.routing_wanted_from(&second.prompt_ids), 3);
    // A server that ignores the start and reports from 0 (other values, seed 100): the
    // tokens reported before are kept as first reported.
    reconciler
        .push(&second.with_routed_experts(Some(routed(0, 6, 100))))
        .expect("valid");
    let (row, _) = one_row(reconciler);
    assert_eq!(
        experts_of(&row),
        [Some(1), Some(11), Some(21), Some(131), Some(141), None]
    );
    assert_eq!(
        row.routed_experts.as_ref().map(|r| r.missing.clone()),
        Some(std::iter::once(5..6).collect::<Vec<_>>())
    );
}

#[test]
fn a_realign_or_a_fork_asks_for_the_routing_of_what_it_rewrites() {
    let mut reconciler = Reconciler::new(ID, config(4));
    reconciler
        .push(&turn(&[1], &[2, 3]).with_routed_experts(Some(routed(0, 3, 0))))
        .expect("valid");
    // [1, 2, 4, 5]: the answer's 3 re-rendered as 4, realigned at 2 tokens.
    assert_eq!(reconciler.routing_wanted_from(&[1, 2, 4, 5]), 2);
    // History rewritten before the last answer: a new row, from 0.
    assert_eq!(reconciler.routing_wanted_from(&[9, 9, 9]), 0);
    let error = reconciler
        .push(&turn(&[1, 2, 4, 5], &[6]).with_routed_experts(Some(routed(3, 5, 0))))
        .expect_err("position 2 would be lost");
    assert!(error.to_string().contains("would be lost"), "{error}");
    reconciler
        .push(&turn(&[1, 2, 4, 5], &[6]).with_routed_experts(Some(routed(2, 5, 50))))
        .expect("valid");
    let (row, _) = one_row(reconciler);
    assert_eq!(
        experts_of(&row),
        [Some(1), Some(11), Some(71), Some(81), None]
    );
}

#[test]
fn routing_that_does_not_fit_the_turn_or_the_row_is_refused_and_changes_nothing() {
    let mut reconciler = Reconciler::new(ID, config(4));
    let mut short = routed(0, 4, 0);
    short.tokens -= 1;
    short.data.truncate(short.data.len() - 2);
    let error = reconciler
        .push(&turn(&[1, 2], &[3, 4]).with_routed_experts(Some(short)))
        .expect_err("one position short");
    assert_eq!(
        error.to_string(),
        "turn 0: routed experts: the server reported 2 positions from position 0, but the \
         turn's 4 tokens need 3 (every token from there on but the last sampled)"
    );
    assert!(reconciler.held().is_empty(), "nothing was applied");
    reconciler
        .push(&turn(&[1, 2], &[3, 4]).with_routed_experts(Some(routed(0, 4, 0))))
        .expect("valid");
    let mut wider = routed(3, 6, 0);
    wider.dtype = ExpertDtype::Uint16;
    wider.data = wider.data.iter().flat_map(|&b| [b, 0]).collect();
    let error = reconciler
        .push(&turn(&[1, 2, 3, 4, 5], &[6]).with_routed_experts(Some(wider)))
        .expect_err("another layout");
    assert!(error.to_string().contains("after earlier turns"), "{error}");
    let mut bad_bytes = routed(3, 6, 0);
    bad_bytes.data.pop();
    let error = reconciler
        .push(&turn(&[1, 2, 3, 4, 5], &[6]).with_routed_experts(Some(bad_bytes)))
        .expect_err("a byte short");
    assert!(error.to_string().contains("which needs 4"), "{error}");
}
