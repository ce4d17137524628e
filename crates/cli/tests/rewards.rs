//! Rewards from a reward service (`kind = "http"`), through the binary, with the simulator as
//! both the model server and the service (`POST /reward`: a completion whose text contains
//! the row's answer scores 1, else 0).

use std::time::Duration;

use rollout_core::TrainingSample;
use tokio::runtime::Runtime;
use vllm_sim::{Faults, SimConfig, Simulator};

use super::rollout::{Case, question, quickstart, runtime, simulator};

/// A second simulator, used only as the reward service: it answers after `latency`, with
/// `faults`.
pub(crate) fn service(runtime: &Runtime, latency: Duration, faults: Faults) -> Simulator {
    let mut config = SimConfig::from_tokenizer_file(&quickstart().join("tokenizer.json"))
        .expect("the quickstart tokenizer loads");
    config.latency = latency;
    config.faults = faults;
    runtime
        .block_on(Simulator::start(
            config,
            "127.0.0.1:0".parse().expect("an address"),
        ))
        .expect("the reward service starts")
}

/// A case named `name` of `rows` questions, groups of 2, rolled out against `model` with the `http`
/// reward named `service` at `url` (besides the numeric reward), with `fields` added to its
/// table.
fn run(
    model: &Simulator,
    name: &str,
    rows: usize,
    url: &str,
    fields: &str,
) -> (Case, super::rollout::Outcome) {
    let case = Case::new(name);
    case.write_dataset(rows);
    case.write_config(&format!(
        "num_generations = 2\n\n[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n\n\
         [[rewards]]\nkind = \"http\"\nname = \"service\"\nurl = \"{url}\"\n{fields}\n"
    ));
    let outcome = case.rollout(&["--server", &model.url()]);
    (case, outcome)
}

/// The final answer of a row's completion.
pub(crate) fn answer_text(row: &TrainingSample) -> &str {
    row.completion
        .iter()
        .rev()
        .find(|message| message.role() == "assistant")
        .and_then(|message| message.content())
        .unwrap_or_default()
}

/// Asserts that the reward `column` scored each row 1 when its answer holds the row's answer
/// (the simulator's rule as a reward service and as a judge), else 0, and returns how many of
/// each.
#[track_caller]
pub(crate) fn assert_scores_match(rows: &[TrainingSample], column: &str) -> [usize; 2] {
    let mut scored = [0, 0];
    for row in rows {
        let (_, answer) = question(row.group_id as usize);
        let expected = usize::from(answer_text(row).contains(&answer));
        let got = row.rewards.get(column).and_then(|v| v.as_f64());
        assert_eq!(
            got,
            Some(expected as f64),
            "{column}, group {}: {row:?}",
            row.group_id
        );
        scored[expected] += 1;
    }
    scored
}

/// Asserts that there are rows and that none has a score of the reward `column`.
#[track_caller]
pub(crate) fn assert_column_empty(rows: &[TrainingSample], column: &str) {
    assert!(!rows.is_empty());
    for row in rows {
        assert_eq!(
            row.rewards.get(column),
            Some(&serde_json::Value::Null),
            "{column}: {row:?}"
        );
    }
}

#[test]
fn a_reward_service_scores_every_completion_once_per_group_within_its_concurrency() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let service = service(&runtime, Duration::from_millis(200), Faults::default());
    let url = format!("{}/reward", service.url());
    let (_case, outcome) = run(&model, "http-reward-scores", 12, &url, "concurrency = 2");
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 24);

    let scored = assert_scores_match(&outcome.rows, "service");
    // The simulator answers right half of the time: the service's scores vary.
    assert!(scored[0] > 0 && scored[1] > 0, "{scored:?}");
    assert!(
        !outcome.stderr.contains("reward 'service' failed"),
        "{}",
        outcome.stderr
    );
    let counters = service.counters();
    assert_eq!(counters.rewards, 12, "one request per group");
    assert!(
        counters.rewards_in_flight_max <= 2,
        "at most 2 requests at once: {counters:?}"
    );
}

#[test]
fn scores_read_from_an_object_are_the_same_and_a_service_that_miscounts_is_counted() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let service = service(&runtime, Duration::ZERO, Faults::default());
    let url = format!("{}/reward?shape=object", service.url());
    let (_case, outcome) = run(&model, "http-reward-object", 4, &url, "");
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 8);
    assert_scores_match(&outcome.rows, "service");

    // One score fewer than completions: the column is empty for the group, counted.
    let url = format!("{}/reward?shape=short", service.url());
    let (_case, outcome) = run(&model, "http-reward-short", 2, &url, "");
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "service");
    outcome.assert_said(
        "reward 'service' failed on 2 of 2 groups (0 errors, 0 timeouts, 0 panics, 2 with \
             the wrong number of scores)",
    );
}

#[test]
fn a_service_that_answers_503_is_retried_then_leaves_its_column_empty_and_the_run_goes_on() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let failing = Faults {
        error_503: 1.0,
        ..Faults::default()
    };
    let service = service(&runtime, Duration::ZERO, failing);
    let url = format!("{}/reward", service.url());
    let (_case, outcome) = run(&model, "http-reward-503", 3, &url, "attempts = 2");
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 6);
    assert_column_empty(&outcome.rows, "service");
    // The numeric reward still scored every row.
    assert!(outcome.rows.iter().all(|row| row.reward.is_some()));
    assert_eq!(
        service.counters().rewards,
        6,
        "two attempts per group: {:?}",
        service.counters()
    );
    outcome.assert_said(
        "reward 'service' failed on 3 of 3 groups (3 errors, 0 timeouts, 0 panics, 0 with \
             the wrong number of scores)",
    );
    outcome.assert_said("answered 503 (after 2 attempts)");
}

#[test]
fn an_answer_that_is_not_one_score_per_completion_is_not_retried_and_leaves_the_column_empty() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let service = service(&runtime, Duration::ZERO, Faults::default());
    // `/reset_prefix_cache` answers a POST with 200 and `{}`: an answer that cannot be read,
    // which another attempt would not change.
    let url = format!("{}/reset_prefix_cache", service.url());
    let (_case, outcome) = run(&model, "http-reward-unreadable", 3, &url, "attempts = 3");
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "service");
    assert_eq!(
        service.counters().requests,
        3,
        "one attempt per group: {:?}",
        service.counters()
    );
    outcome.assert_said("expected a JSON array with one number or null per completion");
}

#[test]
fn a_reward_service_url_that_is_not_http_is_refused_before_the_run() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let (case, outcome) = run(&model, "http-reward-ftp", 1, "ftp://example.com/score", "");
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    outcome.assert_said("reward service URL 'ftp://example.com/score'");
    assert!(!case.out().exists(), "the output was created");
}
