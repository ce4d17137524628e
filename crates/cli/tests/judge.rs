//! An LLM judge (`kind = "judge"`) through the binary, with the simulator as the policy's
//! server and, on a second one, as the judge (`POST /judge/FORMAT/v1/chat/completions`: a
//! completion that contains the reference between `<answer>` tags scores 1, else 0).

use std::time::Duration;

use vllm_sim::{Faults, SimConfig, Simulator};

use super::{
    rewards::{answer_text, assert_column_empty, assert_scores_match, service},
    rollout::{Case, Outcome, question, quickstart, runtime, simulator},
};

/// A template for one completion, with the tags the simulator's judge reads.
const EACH: &str = "Question: {prompt}\nReference: <answer>{answer}</answer>\nResponse: \
                    <completion>{completion}</completion>\nAnswer 1 if the response is right, else 0.";

/// A template for the whole group.
const GROUP: &str = "Question: {prompt}\nReference: <answer>{answer}</answer>\n{completions}\n\
                     Answer {{\"scores\": [...]}}, one per response.";

/// A case of `rows` questions in groups of `generations`, rolled out against `model` with a
/// judge (named `judge`) at the judge simulator's `format` endpoint and `fields` added to its
/// table, besides the numeric reward.
fn judged(
    model: &Simulator,
    name: &str,
    rows: usize,
    generations: usize,
    url: &str,
    fields: &str,
) -> (Case, Outcome) {
    let case = judge_case(name, rows, generations, url, fields);
    let outcome = case.rollout(&["--server", &model.url()]);
    (case, outcome)
}

fn judge_case(name: &str, rows: usize, generations: usize, url: &str, fields: &str) -> Case {
    let case = Case::new(name);
    case.write_dataset(rows);
    case.write_config(&format!(
        "num_generations = {generations}\n\n[[tools]]\nname = \"calculator\"\nkind = \
         \"calculator\"\n\n[[rewards]]\nkind = \"judge\"\nurl = \"{url}\"\nmodel = \
         \"judge\"\n{fields}\n"
    ));
    case
}

/// The judge simulator's endpoint answering in `format`.
fn endpoint(judge: &Simulator, format: &str) -> String {
    format!("{}/judge/{format}/v1/chat/completions", judge.url())
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

#[test]
fn a_judge_of_each_completion_reads_numbers_json_fields_and_labels_within_its_concurrency() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let template = format!("template = {}", toml_string(EACH));
    let formats = [
        ("number", String::new()),
        ("json", "score = \"json\"".to_owned()),
        (
            "labels",
            "score = \"labels\"\nlabels = { CORRECT = 1, INCORRECT = 0 }".to_owned(),
        ),
    ];
    for (format, score) in formats {
        let judge = service(&runtime, Duration::from_millis(50), Faults::default());
        let fields = format!("{template}\n{score}\nconcurrency = 2");
        let name = format!("judge-each-{format}");
        let (_case, outcome) = judged(&model, &name, 6, 2, &endpoint(&judge, format), &fields);
        assert_eq!(outcome.code, Some(0), "{format}: {}", outcome.stderr);
        assert_eq!(outcome.rows.len(), 12, "{format}");
        let scored = assert_scores_match(&outcome.rows, "judge");
        assert!(scored[0] > 0 && scored[1] > 0, "{format}: {scored:?}");
        let counters = judge.counters();
        assert_eq!(counters.judges, 12, "{format}: one request per completion");
        assert!(
            counters.judges_in_flight_max <= 2,
            "{format}: at most 2 at once: {counters:?}"
        );
        assert!(
            outcome.stderr.contains(
                "reward 'judge' made 12 calls (0 retried attempts, 0 answers from its cache); 0 \
                 failed"
            ),
            "{format}: {}",
            outcome.stderr
        );
    }
}

#[test]
fn a_judge_of_the_whole_group_asks_once_per_group_and_a_miscount_empties_the_group() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let template = format!("template = {}\nmode = \"group\"", toml_string(GROUP));
    for (format, score) in [
        ("json", "score = \"json\""),
        (
            "labels",
            "score = \"json\"\nlabels = { CORRECT = 1, INCORRECT = 0 }",
        ),
    ] {
        let before = judge.counters().judges;
        let fields = format!("{template}\n{score}");
        let name = format!("judge-group-{format}");
        let (_case, outcome) = judged(&model, &name, 5, 3, &endpoint(&judge, format), &fields);
        assert_eq!(outcome.code, Some(0), "{format}: {}", outcome.stderr);
        assert_eq!(outcome.rows.len(), 15, "{format}");
        assert_scores_match(&outcome.rows, "judge");
        assert_eq!(
            judge.counters().judges - before,
            5,
            "{format}: one per group"
        );
    }

    // One score fewer than completions: unscorable group, counted as the wrong length.
    let (_case, outcome) = judged(
        &model,
        "judge-group-short",
        2,
        3,
        &endpoint(&judge, "short"),
        &format!("{template}\nscore = \"json\""),
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "judge");
    outcome.assert_said(
        "reward 'judge' failed on 2 of 2 groups (0 errors, 0 timeouts, 0 panics, 2 with the \
             wrong number of scores)",
    );
}

#[test]
fn a_judge_that_answers_garbage_503s_or_cannot_be_reached_leaves_its_column_empty_and_is_counted() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let template = format!("template = {}", toml_string(EACH));

    // No score in the answer: unreadable, not retried.
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let fields = format!("{template}\nattempts = 3");
    let (_case, outcome) = judged(
        &model,
        "judge-garbage",
        3,
        2,
        &endpoint(&judge, "garbage"),
        &fields,
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "judge");
    assert!(
        outcome.rows.iter().all(|row| row.reward.is_some()),
        "the numeric reward still scores"
    );
    assert_eq!(judge.counters().judges, 6, "not retried");
    outcome.assert_said(
        "reward 'judge' made 6 calls (0 retried attempts, 0 answers from its cache); 6 \
             failed (0 transport, 0 status, 6 unreadable)",
    );
    outcome.assert_said("no number in the answer: \"I would rather not say.\"");

    // Every request answered 503: retried, then counted by its status.
    let failing = Faults {
        error_503: 1.0,
        ..Faults::default()
    };
    let judge = service(&runtime, Duration::ZERO, failing);
    let fields = format!("{template}\nattempts = 2");
    let (_case, outcome) = judged(
        &model,
        "judge-503",
        2,
        2,
        &endpoint(&judge, "number"),
        &fields,
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "judge");
    assert_eq!(judge.counters().judges, 8, "two attempts per completion");
    outcome.assert_said(
        "reward 'judge' made 4 calls (4 retried attempts, 0 answers from its cache); 4 \
             failed (0 transport, 4 status, 0 unreadable)",
    );
    outcome.assert_said("answered 503 (after 2 attempts)");

    // Nothing listens: a transport failure, retried too.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let url = format!(
        "http://{}/v1/chat/completions",
        closed.local_addr().expect("an address")
    );
    drop(closed);
    let (_case, outcome) = judged(&model, "judge-closed", 1, 2, &url, &fields);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_column_empty(&outcome.rows, "judge");
    outcome.assert_said(
        "reward 'judge' made 2 calls (2 retried attempts, 0 answers from its cache); 2 \
             failed (2 transport, 0 status, 0 unreadable)",
    );
}

#[test]
fn a_judge_with_a_cache_asks_each_distinct_request_once() {
    let runtime = runtime();
    // Every completion right: a group's completions are the same text, so the same request.
    let mut config = SimConfig::from_tokenizer_file(&quickstart().join("tokenizer.json"))
        .expect("the quickstart tokenizer loads");
    config.tool_rounds = 1;
    config.tool_name = "calculator".to_owned();
    // No words after "The answer is N.": the text is the same for the same N.
    config.answer_tokens = 1;
    config.correct_rate = 1.0;
    let model = runtime
        .block_on(Simulator::start(
            config,
            "127.0.0.1:0".parse().expect("an address"),
        ))
        .expect("the simulator starts");
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let template = format!("template = {}", toml_string(EACH));
    let url = endpoint(&judge, "number");

    let (_case, outcome) = judged(
        &model,
        "judge-cache",
        4,
        4,
        &url,
        &format!("{template}\ncache = 100"),
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(
        judge.counters().judges,
        4,
        "one request per group, its 4 completions alike"
    );
    outcome
        .assert_said("reward 'judge' made 4 calls (0 retried attempts, 12 answers from its cache)");

    // Without a cache every completion is asked.
    let (_case, outcome) = judged(&model, "judge-no-cache", 4, 4, &url, &template);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(judge.counters().judges, 4 + 16);
}

#[test]
fn a_judge_s_key_is_sent_to_it_and_hidden_from_the_programs_the_run_starts() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let template = format!("template = {}", toml_string(EACH));
    // An unsandboxed command reward that scores 1 when it sees the key's variable, else 0.
    let snoop = "[[rewards]]\nkind = \"command\"\nname = \"snoop\"\nprogram = [\"sh\", \"-c\", \
                 \"cat >/dev/null; if [ -n \\\"${JUDGE_KEY+x}\\\" ]; then echo '[1, 1]'; else \
                 echo '[0, 0]'; fi\"]";
    let fields = format!("{template}\napi_key_env = \"JUDGE_KEY\"\n\n{snoop}");
    let case = judge_case("judge-key", 3, 2, &endpoint(&judge, "number"), &fields);
    let mut command = case.command(&["--server", &model.url()]);
    command.env("JUDGE_KEY", "sim-judge-key");
    let outcome = case.run(command);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_scores_match(&outcome.rows, "judge");
    let counters = judge.counters();
    assert_eq!(counters.judges_with_key, counters.judges, "{counters:?}");
    assert_eq!(counters.judges, 6);
    for row in &outcome.rows {
        assert_eq!(
            row.rewards.get("snoop").and_then(|v| v.as_f64()),
            Some(0.0),
            "the command reward saw the key: {row:?}"
        );
    }

    // The variable not set: refused before the run, naming it.
    let case = judge_case("judge-no-key", 1, 2, &endpoint(&judge, "number"), &fields);
    let mut command = case.command(&["--server", &model.url()]);
    command.env_remove("JUDGE_KEY");
    let outcome = case.run(command);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    outcome.assert_said("api_key_env = \"JUDGE_KEY\": the environment variable is not set");
}

#[test]
fn a_judge_table_that_does_not_hold_together_is_refused_before_the_run() {
    let runtime = runtime();
    let model = simulator(&runtime, 0, "calculator");
    let url = "http://127.0.0.1:9/v1/chat/completions";
    for (fields, expected) in [
        (
            format!("template = {}\nmode = \"group\"", toml_string(GROUP)),
            "a judge in group mode reads its scores as a JSON array",
        ),
        (
            format!("template = {}", toml_string(GROUP)),
            "the template of a judge in each mode names {completion} (what it judges), not \
             {completions}",
        ),
        (
            format!("template = {}\nscore = \"labels\"", toml_string(EACH)),
            "score = \"labels\" needs `labels = { LABEL = SCORE, ... }`",
        ),
        (
            "template = \"Rate {completion\"".to_owned(),
            "the template's '{' at byte 5 is not closed",
        ),
        (
            format!("template = {}\nmode = \"pairs\"", toml_string(EACH)),
            "mode = \"pairs\": expected \"each\" or \"group\"",
        ),
        (
            "score = \"number\"".to_owned(),
            "kind \"judge\" needs `template`",
        ),
    ] {
        let case = judge_case("judge-refused", 1, 2, url, &fields);
        let outcome = case.rollout(&["--server", &model.url()]);
        assert_eq!(outcome.code, Some(1), "{fields}: {}", outcome.stderr);
        assert!(
            outcome.stderr.contains(expected),
            "{fields}: {}",
            outcome.stderr
        );
        assert!(
            outcome.stderr.contains("rewards[0]") || outcome.stderr.contains("run.toml"),
            "{fields}: the place: {}",
            outcome.stderr
        );
    }
}

#[test]
fn the_judge_example_runs_offline_against_the_simulator_as_judge() {
    let runtime = runtime();
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let example = quickstart().join("../judge/config.toml");
    let text = std::fs::read_to_string(&example).expect("the example's config");
    let quickstart = quickstart();
    let text = text
        .replace("http://127.0.0.1:8001", &judge.url())
        .replace("\"../quickstart", &format!("\"{}", quickstart.display()));
    let case = Case::new("judge-example");
    std::fs::write(case.config_file(), text).expect("the config");
    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 64);
    for row in &outcome.rows {
        let prompt = row.prompt[0].content().unwrap_or_default().to_owned();
        let line = std::fs::read_to_string(quickstart.join("arithmetic.jsonl"))
            .expect("the dataset")
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("a row"))
            .find(|value| value["prompt"] == prompt.as_str())
            .expect("the row's prompt is in the dataset");
        let answer = line["answer"].as_str().expect("an answer");
        let expected = f64::from(u8::from(answer_text(row).contains(answer)));
        assert!(
            row.reward_notes.contains_key("judge") && !row.reward_notes.contains_key("ranker"),
            "the example keeps the first judge's answers only: {row:?}"
        );
        for name in ["judge", "ranker"] {
            assert_eq!(
                row.rewards.get(name).and_then(|v| v.as_f64()),
                Some(expected),
                "{name}: {row:?}"
            );
        }
    }
    outcome.assert_said(
        "reward 'ranker' made 16 calls (0 retried attempts, 0 answers from its cache); 0 failed",
    );
    outcome.assert_said("reward 'judge' made ");
}

#[test]
fn a_judge_keeps_its_answers_on_the_rows_only_when_asked() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let each = format!("template = {}", toml_string(EACH));
    let url = endpoint(&judge, "number");

    let fields = format!("{each}\nkeep_answers = true");
    let (_case, outcome) = judged(&model, "judge-keep", 3, 2, &url, &fields);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_scores_match(&outcome.rows, "judge");
    for row in &outcome.rows {
        let score = row.rewards["judge"].as_f64().expect("scored");
        let expected = format!(
            "<think>The reference has 1 answer; compare it with 2 eyes.</think>\nScore: {score}"
        );
        assert_eq!(
            row.reward_notes.get("judge").and_then(|v| v.as_str()),
            Some(expected.as_str()),
            "{row:?}"
        );
        assert_eq!(
            row.reward_notes.len(),
            1,
            "only the judge keeps notes: {row:?}"
        );
    }

    // In group mode every completion gets the group's answer.
    let group = format!(
        "template = {}\nmode = \"group\"\nscore = \"json\"\nkeep_answers = true",
        toml_string(GROUP)
    );
    let (_case, outcome) = judged(
        &model,
        "judge-keep-group",
        2,
        3,
        &endpoint(&judge, "json"),
        &group,
    );
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    for row in &outcome.rows {
        let note = row.reward_notes["judge"].as_str().expect("a note");
        let scores: serde_json::Value = serde_json::from_str(note).expect("the JSON answer");
        assert_eq!(scores["scores"].as_array().map(Vec::len), Some(3), "{note}");
    }

    // Not asked: no note.
    let (_case, outcome) = judged(&model, "judge-no-keep", 2, 2, &url, &each);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(outcome.rows.iter().all(|row| row.reward_notes.is_empty()));
}

#[test]
fn a_judge_answering_what_overflows_or_is_no_number_leaves_finite_advantages_never_null() {
    let runtime = runtime();
    let model = simulator(&runtime, 1, "calculator");
    let judge = service(&runtime, Duration::ZERO, Faults::default());
    let fields = format!("template = {}\nscore = \"json\"", toml_string(EACH));
    // The right completions' scores: beyond the bound (unscored, counted) or no JSON number
    // (unreadable); the wrong ones score 0.
    for (value, readable) in [
        ("1e308", true),
        ("-1e308", true),
        ("1.7976931348623157e308", true),
        ("1e13", true),
        ("NaN", false),
        ("Infinity", false),
    ] {
        let url = endpoint(&judge, &format!("value:{value}"));
        let name = format!("judge-value-{}", value.replace(['.', '-'], "_"));
        // Rows that hold `"advantage": null` would not read as rows at all.
        let (_case, outcome) = judged(&model, &name, 4, 2, &url, &fields);
        assert_eq!(outcome.code, Some(0), "{value}: {}", outcome.stderr);
        assert_eq!(outcome.rows.len(), 8, "{value}");
        let mut right = 0;
        for row in &outcome.rows {
            assert!(row.advantage.is_finite(), "{value}: {row:?}");
            let (_, answer) = question(row.group_id as usize);
            let expected = if answer_text(row).contains(&answer) {
                right += 1;
                None
            } else {
                Some(0.0)
            };
            assert_eq!(row.rewards["judge"].as_f64(), expected, "{value}: {row:?}");
        }
        assert!(right > 0, "{value}: some completion is right");
        if readable {
            outcome.assert_said(&format!(
                "reward 'judge' gave {right} scores that were NaN, infinite or beyond ±1e12"
            ));
        } else {
            outcome.assert_said(&format!(
                "{right} failed (0 transport, 0 status, {right} unreadable)"
            ));
        }
    }
}
