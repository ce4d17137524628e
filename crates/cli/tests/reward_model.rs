//! A reward model (`kind = "reward_model"`) through the binary, with the simulator as the
//! policy's server and, on a second one, as a reward model on vLLM's pooling runner (`POST
//! /classify`: a conversation scores `messages + chars / 1000`, through a sigmoid unless
//! `use_activation` is false).

use std::time::Duration;

use rollout_core::TrainingSample;
use vllm_sim::{Faults, Simulator};

use super::{
    rewards::{assert_column_empty, service},
    rollout::{Case, Outcome, runtime, simulator},
};

/// A case of `rows` questions in groups of 2 with a tool round, rolled out against `model`
/// with a reward model (named `rm`) at `url` and `fields` added to its table, besides the
/// numeric reward.
fn scored(model: &Simulator, name: &str, rows: usize, url: &str, fields: &str) -> Outcome {
    let case = Case::new(name);
    case.write_dataset(rows);
    case.write_config(&format!(
        "num_generations = 2\n\n[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n\n\
         [[rewards]]\nkind = \"reward_model\"\nname = \"rm\"\nurl = \"{url}\"\n{fields}\n"
    ));
    case.rollout(&["--server", &model.url()])
}

/// What the simulator's reward model gives a row's conversation, before any activation.
fn raw_score(row: &TrainingSample) -> f64 {
    let last = row.completion.last().expect("a completion");
    let chars = last.content().unwrap_or_default().chars().count();
    (row.prompt.len() + row.completion.len()) as f64 + chars as f64 / 1000.0
}

/// The model the simulator serves (`SimSettings`' default), as the reward model.
const MODEL: &str = "sim";

#[test]
fn a_reward_model_scores_each_whole_conversation_within_its_concurrency() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    for activation in [false, true] {
        let rm = service(&runtime, Duration::from_millis(50), Faults::default());
        let url = format!("{}/classify", rm.url());
        let fields = format!("model = \"{MODEL}\"\nconcurrency = 2\nactivation = {activation}");
        let name = format!("rm-activation-{activation}");
        let outcome = scored(&model, &name, 6, &url, &fields);
        assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
        assert_eq!(outcome.rows.len(), 12);
        let mut tool_turns = 0;
        for row in &outcome.rows {
            // The prompt, the tool round and the answer: the whole conversation was sent.
            tool_turns += usize::from(row.completion.iter().any(|m| m.role() == "tool"));
            let raw = raw_score(row);
            let expected = if activation {
                1.0 / (1.0 + (-raw).exp())
            } else {
                raw
            };
            let got = row.rewards["rm"].as_f64().expect("scored");
            assert!(
                (got - expected).abs() < 1e-9,
                "{got} vs {expected}: {row:?}"
            );
        }
        assert!(tool_turns > 0, "some rows hold a tool round");
        let counters = rm.counters();
        assert_eq!(counters.classifications, 12, "one request per completion");
        assert!(
            counters.classifications_in_flight_max <= 2,
            "at most 2 at once: {counters:?}"
        );
        outcome.assert_said(
            "reward 'rm' made 12 calls (0 retried attempts, 0 answers from its cache); 0 failed",
        );
    }
}

#[test]
fn a_reward_model_that_fails_leaves_its_completions_unscorable_and_counts_why() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let rm = service(&runtime, Duration::ZERO, Faults::default());
    let url = format!("{}/classify", rm.url());

    // A model the server does not serve: a 404, not retried.
    let outcome = scored(
        &model,
        "rm-unknown",
        2,
        &url,
        "model = \"other\"\nattempts = 3",
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "rm");
    assert!(
        outcome.rows.iter().all(|row| row.reward.is_some()),
        "the numeric reward still scores"
    );
    assert_eq!(rm.counters().classifications, 4, "not retried");
    outcome.assert_said(
        "reward 'rm' made 4 calls (0 retried attempts, 0 answers from its cache); 4 failed (0 \
         transport, 4 status, 0 unreadable)",
    );
    outcome.assert_said("answered 404");

    // A class the model does not have: unreadable.
    let fields = format!("model = \"{MODEL}\"\nclass_index = 1");
    let outcome = scored(&model, "rm-class", 1, &url, &fields);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "rm");
    outcome.assert_said("2 failed (0 transport, 0 status, 2 unreadable)");
    outcome.assert_said("with a number at index 1");

    // Every request answered 503: retried, then counted by its status.
    let failing = service(
        &runtime,
        Duration::ZERO,
        Faults {
            error_503: 1.0,
            ..Faults::default()
        },
    );
    let url = format!("{}/classify", failing.url());
    let fields = format!("model = \"{MODEL}\"\nattempts = 2");
    let outcome = scored(&model, "rm-503", 1, &url, &fields);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "rm");
    assert_eq!(failing.counters().classifications, 4, "two attempts each");
    outcome.assert_said(
        "reward 'rm' made 2 calls (2 retried attempts, 0 answers from its cache); 2 failed (0 \
         transport, 2 status, 0 unreadable)",
    );
}

#[test]
fn a_reward_model_table_that_does_not_hold_together_is_refused_before_the_run() {
    let runtime = runtime();
    let model = simulator(&runtime, 0, "calculator");
    let url = "http://127.0.0.1:9/classify";
    for (fields, said) in [
        ("", "kind \"reward_model\" needs `model`"),
        (
            "model = \"rm\"\ntemplate = \"{completion}\"",
            "`template` is not a field of kind \"reward_model\"",
        ),
        ("model = \"rm\"\nclass_index = -1", "expected usize"),
    ] {
        let outcome = scored(&model, "rm-refused", 1, url, fields);
        assert_eq!(outcome.code, Some(1), "{fields}: {}", outcome.stderr);
        outcome.assert_said(said);
        outcome.assert_said("run.toml");
        assert!(outcome.rows.is_empty(), "{fields}");
    }
}
