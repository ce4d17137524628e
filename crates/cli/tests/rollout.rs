//! `async-grpo rollout` end to end: the binary against the simulator (one the test starts and
//! records, or the built-in one), read back through the rows it writes and what it prints.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use rollout_core::TrainingSample;
use serde_json::{Value, json};
use test_support::ScratchDir;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    runtime::Runtime,
};
use vllm_sim::{Exchange, SimConfig, Simulator};

/// The quickstart's tokenizer directory (tokenizer.json and its chat template).
pub(crate) fn quickstart() -> PathBuf {
    crate::repository().join("examples/quickstart")
}

/// A TOML string holding `path`.
pub(crate) fn toml_path(path: &Path) -> String {
    format!("{:?}", path.display().to_string())
}

/// Question `i` of the test datasets and its answer, as the calculator writes it.
pub(crate) fn question(i: usize) -> (String, String) {
    let a = 2 + (i * 7) % 40;
    let b = 3 + (i * 11) % 30;
    if i.is_multiple_of(2) {
        (format!("What is {a} + {b}?"), (a + b).to_string())
    } else {
        (format!("What is {a} * {b}?"), (a * b).to_string())
    }
}

/// A dataset line for question `i`.
pub(crate) fn dataset_line(i: usize) -> String {
    let (prompt, answer) = question(i);
    json!({ "prompt": prompt, "answer": answer }).to_string()
}

/// A fresh directory for one test, with a dataset and a config file in it.
pub(crate) struct Case {
    pub(crate) dir: ScratchDir,
}

/// What a run left: its exit code, its stderr, and the rows of its output file.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) code: Option<i32>,
    pub(crate) stderr: String,
    pub(crate) rows: Vec<TrainingSample>,
}

impl Outcome {
    /// Asserts that the run's stderr holds `text`.
    #[track_caller]
    pub(crate) fn assert_said(&self, text: &str) {
        assert!(
            self.stderr.contains(text),
            "{text:?} is not in the run's stderr:\n{}",
            self.stderr
        );
    }
}

impl Case {
    /// A case in a fresh directory, removed when the test passes (see [`ScratchDir`]).
    pub(crate) fn new(name: &str) -> Case {
        Case {
            dir: ScratchDir::new(&format!("async-grpo-rollout-{name}")),
        }
    }

    pub(crate) fn dataset(&self) -> PathBuf {
        self.dir.join("rows.jsonl")
    }

    pub(crate) fn out(&self) -> PathBuf {
        self.dir.join("out.jsonl")
    }

    pub(crate) fn config_file(&self) -> PathBuf {
        self.dir.join("run.toml")
    }

    /// Writes a dataset of `rows` questions.
    pub(crate) fn write_dataset(&self, rows: usize) {
        let text: String = (0..rows).map(|i| dataset_line(i) + "\n").collect();
        std::fs::write(self.dataset(), text).expect("write the dataset");
    }

    /// Writes run.toml: the dataset, the quickstart tokenizer, `rest` (top-level keys first), and
    /// a numeric reward.
    pub(crate) fn write_config(&self, rest: &str) {
        let text = format!(
            "dataset = {}\ntokenizer = {}\nestimator = \"trl\"\n{rest}\n\n[[rewards]]\nspec = \"numeric:answer\"\n",
            toml_path(&self.dataset()),
            toml_path(&quickstart()),
        );
        std::fs::write(self.config_file(), text).expect("write the config");
    }

    /// The command `async-grpo rollout --config run.toml --out out.jsonl --progress off ARGS`.
    pub(crate) fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
        command
            .arg("rollout")
            .arg("--config")
            .arg(self.config_file())
            .arg("--out")
            .arg(self.out())
            .args(["--progress", "off"])
            .args(args)
            .current_dir(&self.dir)
            // `TEST_RUST_LOG=info,async_grpo_harness=debug` shows what each agent printed,
            // `async_grpo_process=debug` each program's command line.
            .env(
                "RUST_LOG",
                std::env::var("TEST_RUST_LOG").unwrap_or("info".into()),
            )
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0");
        command
    }

    /// Runs the binary to the end; the rows are read back when it succeeded.
    pub(crate) fn rollout(&self, args: &[&str]) -> Outcome {
        self.run(self.command(args))
    }

    /// Runs `command` (made by [`Case::command`]) to the end; the rows are read back when it
    /// succeeded.
    pub(crate) fn run(&self, mut command: Command) -> Outcome {
        let output = command
            .stdin(Stdio::null())
            .output()
            .expect("the binary starts");
        let code = output.status.code();
        Outcome {
            code,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            rows: if code == Some(0) {
                self.rows()
            } else {
                Vec::new()
            },
        }
    }

    /// Every line of the output file, each a complete training row.
    pub(crate) fn rows(&self) -> Vec<TrainingSample> {
        let Ok(text) = std::fs::read_to_string(self.out()) else {
            return Vec::new();
        };
        text.lines()
            .enumerate()
            .map(|(i, line)| {
                serde_json::from_str(line).unwrap_or_else(|e| {
                    panic!(
                        "line {} of the output is not a training row ({e}): {line}",
                        i + 1
                    )
                })
            })
            .collect()
    }
}

/// A runtime for the simulator and the test's own servers, serving while the binary runs.
pub(crate) fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// A recording simulator with the quickstart tokenizer, calling `tool_name` for
/// `tool_rounds` turns.
pub(crate) fn simulator(runtime: &Runtime, tool_rounds: usize, tool_name: &str) -> Simulator {
    let mut config = SimConfig::from_tokenizer_file(&quickstart().join("tokenizer.json"))
        .expect("the quickstart tokenizer loads");
    config.record = true;
    config.tool_rounds = tool_rounds;
    config.tool_name = tool_name.to_owned();
    config.answer_tokens = 8;
    config.correct_rate = 0.5;
    runtime
        .block_on(Simulator::start(
            config,
            "127.0.0.1:0".parse().expect("an address"),
        ))
        .expect("the simulator starts")
}

/// An HTTP endpoint answering every request with 200 and `body`; counts the requests.
fn http_endpoint(runtime: &Runtime, body: &'static str) -> (String, Arc<AtomicUsize>) {
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind 127.0.0.1:0");
    let url = format!(
        "http://{}/tool",
        listener.local_addr().expect("a local address")
    );
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&requests);
    runtime.spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                // Read the head, then as much body as Content-Length says, then answer.
                let mut request = Vec::new();
                let mut chunk = [0u8; 4096];
                let complete = |request: &[u8]| {
                    let text = String::from_utf8_lossy(request);
                    let Some(head_end) = text.find("\r\n\r\n") else {
                        return false;
                    };
                    let length = text[..head_end]
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    request.len() >= head_end + 4 + length
                };
                while !complete(&request) {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&chunk[..n]),
                    }
                }
                counter.fetch_add(1, Ordering::Relaxed);
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, requests)
}

/// Every mask-1 token of every row is a token the simulator sampled, in an exchange whose
/// prompt is the row up to it, with the logprob it was sent with; mask-0 tokens have
/// logprob 0. Returns the number of sampled runs of each row.
pub(crate) fn assert_rows_are_what_was_sampled(
    rows: &[TrainingSample],
    transcript: &[Exchange],
) -> Vec<usize> {
    assert!(!transcript.is_empty(), "the simulator recorded nothing");
    let mut runs_per_row = Vec::new();
    for row in rows {
        let (ids, mask, logprobs) = (&row.input_ids, &row.completion_mask, &row.old_log_probs);
        assert_eq!(ids.len(), mask.len(), "row {:?}", row.rollout_id);
        assert_eq!(ids.len(), logprobs.len(), "row {:?}", row.rollout_id);
        let mut runs = 0;
        let mut p = 0;
        while p < ids.len() {
            if mask[p] == 0 {
                assert_eq!(
                    logprobs[p], 0.0,
                    "rollout {:?}: position {p} is not trained on but has a logprob",
                    row.rollout_id
                );
                p += 1;
                continue;
            }
            let end = (p..ids.len()).find(|&i| mask[i] == 0).unwrap_or(ids.len());
            let run = &ids[p..end];
            let exchanges: Vec<&Exchange> = transcript
                .iter()
                .filter(|s| s.prompt_ids.as_slice() == &ids[..p] && s.token_ids.as_slice() == run)
                .collect();
            assert!(
                !exchanges.is_empty(),
                "rollout {:?}: the tokens at {p}..{end} ({run:?}) after that prompt are not an answer the simulator sent",
                row.rollout_id
            );
            let expected: Vec<f32> = logprobs[p..end].to_vec();
            assert!(
                exchanges.iter().any(|s| {
                    s.logprobs.iter().map(|&l| l as f32).collect::<Vec<_>>() == expected
                }),
                "rollout {:?}: the logprobs at {p}..{end} are not the ones sent: {expected:?} vs {:?}",
                row.rollout_id,
                exchanges[0].logprobs
            );
            runs += 1;
            p = end;
        }
        runs_per_row.push(runs);
    }
    runs_per_row
}

/// Each group id in `0..groups` is present with `num_generations` rollouts, one row each.
fn assert_groups_complete(rows: &[TrainingSample], groups: u64, num_generations: usize) {
    let mut by_group: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for row in rows {
        by_group
            .entry(row.group_id)
            .or_default()
            .insert(row.rollout_id.0);
    }
    assert_eq!(
        by_group.keys().copied().collect::<Vec<_>>(),
        (0..groups).collect::<Vec<_>>(),
        "the group ids written"
    );
    for (group, rollouts) in &by_group {
        assert_eq!(
            rollouts.len(),
            num_generations,
            "group {group}: rollouts {rollouts:?}"
        );
    }
    assert_eq!(rows.len() as u64, groups * num_generations as u64);
}

/// The advantages are TRL's: (r - mean) / (population std + 1e-8) over each group's rollouts.
fn assert_trl_advantages(rows: &[TrainingSample]) {
    let mut by_group: BTreeMap<u64, BTreeMap<u64, &TrainingSample>> = BTreeMap::new();
    for row in rows {
        by_group
            .entry(row.group_id)
            .or_default()
            .insert(row.rollout_id.0, row);
    }
    for (group, rollouts) in by_group {
        let rewards: Vec<f64> = rollouts
            .values()
            .map(|row| row.reward.expect("every rollout is scored"))
            .collect();
        let n = rewards.len() as f64;
        let mean = rewards.iter().sum::<f64>() / n;
        let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
        for row in rollouts.values() {
            let reward = row.reward.expect("scored");
            let expected = (reward - mean) / (std + 1e-8);
            assert!(
                (row.advantage - expected).abs() < 1e-6,
                "group {group} rollout {:?}: advantage {} but rewards {rewards:?} give {expected}",
                row.rollout_id,
                row.advantage
            );
        }
    }
}

/// The tool messages of a row's completion.
fn tool_messages(row: &TrainingSample) -> Vec<&rollout_core::Message> {
    row.completion
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect()
}

/// The question's answer, for a row's prompt.
fn answer_of(row: &TrainingSample) -> String {
    let prompt = row.prompt[0]["content"].as_str().expect("a text prompt");
    (0..64)
        .map(question)
        .find(|(q, _)| q == prompt)
        .map(|(_, answer)| answer)
        .expect("a question of the dataset")
}

/// `N` in the summary's "... tool calls (N errors)".
fn tool_errors(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.contains("tool calls ("))
        .expect("the summary counts tool calls");
    let after = &line[line.find("tool calls (").expect("found") + "tool calls (".len()..];
    after
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a number of tool errors")
}

#[test]
fn every_trained_token_is_a_token_the_server_sampled_with_its_logprob() {
    let case = Case::new("plain");
    case.write_dataset(3);
    case.write_config("num_generations = 4\n");
    let runtime = runtime();
    let sim = simulator(&runtime, 0, "calculator");
    let outcome = case.rollout(&["--server", &sim.url()]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(
        !outcome.stderr.contains("built-in simulator"),
        "{}",
        outcome.stderr
    );
    assert_groups_complete(&outcome.rows, 3, 4);
    let runs = assert_rows_are_what_was_sampled(&outcome.rows, &sim.transcript());
    assert!(runs.iter().all(|&n| n == 1), "one answer per row: {runs:?}");
    assert_trl_advantages(&outcome.rows);
}

/// Runs the tool scenario with `tools` (TOML, the first is the one called) and returns the
/// rows, having checked them against the transcript.
fn tool_run(name: &str, runtime: &Runtime, tools: &str, first: &str) -> Vec<TrainingSample> {
    let case = Case::new(name);
    case.write_dataset(3);
    case.write_config(&format!("num_generations = 4\nmax_turns = 3\n\n{tools}"));
    let sim = simulator(runtime, 1, first);
    let outcome = case.rollout(&["--server", &sim.url()]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_groups_complete(&outcome.rows, 3, 4);
    let runs = assert_rows_are_what_was_sampled(&outcome.rows, &sim.transcript());
    for (row, runs) in outcome.rows.iter().zip(runs) {
        let assistant = row
            .completion
            .iter()
            .filter(|m| m["role"] == "assistant")
            .count();
        assert_eq!(
            assistant, 2,
            "a tool call, then the answer: {:?}",
            row.completion
        );
        assert_eq!(runs, assistant, "each assistant turn is one sampled run");
        assert_eq!(tool_messages(row).len(), 1, "{:?}", row.completion);
    }
    assert_trl_advantages(&outcome.rows);
    assert_eq!(tool_errors(&outcome.stderr), 0, "{}", outcome.stderr);
    outcome.rows
}

const CALCULATOR: &str = "[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n";
const ECHO: &str =
    "[[tools]]\nname = \"echo\"\nkind = \"command\"\ncommand = [\"cat\"]\ntimeout = \"10s\"\n";

fn lookup(url: &str) -> String {
    format!("[[tools]]\nname = \"lookup\"\nkind = \"http\"\nurl = {url:?}\ntimeout = \"10s\"\n")
}

#[test]
fn tool_turns_keep_sampled_tokens_and_tool_results_reach_the_conversation() {
    let runtime = runtime();
    let (url, requests) = http_endpoint(&runtime, "42");
    let lookup = lookup(&url);

    // A sync tool called: the calculator's value for the question.
    let rows = tool_run(
        "tools-calculator",
        &runtime,
        &format!("{CALCULATOR}\n{lookup}\n{ECHO}"),
        "calculator",
    );
    for row in &rows {
        assert_eq!(
            tool_messages(row)[0]["content"],
            answer_of(row),
            "{:?}",
            row.completion
        );
    }
    assert_eq!(
        requests.load(Ordering::Relaxed),
        0,
        "only the calculator was called"
    );
    // Some answers repeat the tool's result and some do not: the rewards differ.
    let rewards: BTreeSet<String> = rows.iter().map(|r| format!("{:?}", r.reward)).collect();
    assert!(rewards.len() > 1, "rewards {rewards:?}");

    // An async tool called: the endpoint's body, once per rollout.
    let rows = tool_run(
        "tools-http",
        &runtime,
        &format!("{lookup}\n{CALCULATOR}\n{ECHO}"),
        "lookup",
    );
    for row in &rows {
        assert_eq!(
            tool_messages(row)[0]["content"],
            "42",
            "{:?}",
            row.completion
        );
        assert_eq!(tool_messages(row)[0]["name"], "lookup");
    }
    assert_eq!(requests.load(Ordering::Relaxed), rows.len());

    // A command: `cat` answers with the arguments it read.
    let rows = tool_run(
        "tools-command",
        &runtime,
        &format!("{ECHO}\n{CALCULATOR}\n{lookup}"),
        "echo",
    );
    for row in &rows {
        let prompt = row.prompt[0]["content"].as_str().expect("a text prompt");
        let expression = prompt.trim_start_matches("What is ").trim_end_matches('?');
        let content = tool_messages(row)[0]["content"]
            .as_str()
            .expect("a text result");
        let echoed: Value = serde_json::from_str(content).expect("cat echoes the JSON arguments");
        assert_eq!(echoed, json!({ "expression": expression }));
    }
}

#[test]
fn every_group_completes_when_the_server_answers_some_requests_503() {
    let case = Case::new("faults");
    case.write_dataset(16);
    case.write_config(
        "num_generations = 4\n\n[simulator]\nanswer_tokens = 4\nerror_503 = 0.1\nfault_seed = 3\n",
    );
    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("503"),
        "some requests were answered 503 and retried: {}",
        outcome.stderr
    );
    assert_groups_complete(&outcome.rows, 16, 4);
}

#[test]
fn a_tool_that_hangs_times_out_and_the_rollouts_still_finish() {
    let case = Case::new("hang");
    case.write_dataset(2);
    case.write_config(
        "num_generations = 2\nmax_turns = 3\n\n[[tools]]\nname = \"slow\"\nkind = \"command\"\ncommand = [\"sleep\", \"30\"]\ntimeout = \"1s\"\n\n[simulator]\ntool_rounds = 1\nanswer_tokens = 8\n",
    );
    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_groups_complete(&outcome.rows, 2, 2);
    for row in &outcome.rows {
        let tools = tool_messages(row);
        assert_eq!(tools.len(), 1, "{:?}", row.completion);
        let content = tools[0]["content"].as_str().expect("a text result");
        assert!(content.contains("timed out"), "{content}");
    }
    assert_eq!(tool_errors(&outcome.stderr), 4, "{}", outcome.stderr);
}

#[test]
fn a_bad_dataset_row_stops_the_run_with_its_line_unless_skipped() {
    let case = Case::new("bad-row");
    let lines = [
        dataset_line(0),
        dataset_line(1),
        "this line is not JSON".to_owned(),
        dataset_line(3),
    ];
    std::fs::write(case.dataset(), lines.join("\n") + "\n").expect("write the dataset");
    case.write_config("num_generations = 2\n");

    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    let place = format!("{}:3", case.dataset().display());
    assert!(
        outcome.stderr.contains(&place),
        "{place} in {}",
        outcome.stderr
    );

    let outcome = case.rollout(&["--skip-bad-rows", "--overwrite"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("1 bad dataset row(s) skipped"),
        "{}",
        outcome.stderr
    );
    assert!(
        outcome.stderr.contains(&place),
        "{place} in {}",
        outcome.stderr
    );
    let prompts: BTreeSet<&str> = outcome
        .rows
        .iter()
        .map(|r| r.prompt[0]["content"].as_str().expect("a text prompt"))
        .collect();
    let expected: BTreeSet<String> = [0, 1, 3].into_iter().map(|i| question(i).0).collect();
    assert_eq!(
        prompts,
        expected.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let mut per_group: BTreeMap<u64, usize> = BTreeMap::new();
    for row in &outcome.rows {
        *per_group.entry(row.group_id).or_default() += 1;
    }
    assert_eq!(per_group.len(), 3, "{per_group:?}");
    assert!(per_group.values().all(|&n| n == 2), "{per_group:?}");
}

/// Waits for `child` to exit, killing it (and failing) if it is still running after a
/// generous bound.
pub(crate) fn wait(child: &mut Child) -> Option<i32> {
    exit_within(
        child,
        Duration::from_secs(120),
        "two minutes after the signal",
    )
}

/// Polls `path` until it holds `text`.
pub(crate) fn wait_for_stderr(path: &Path, text: &str, child: &mut Child) {
    stderr_within(path, text, child, Duration::from_secs(120));
}

/// Waits for `child` to exit, for `bound` at most: past it the child is killed and the test
/// fails, saying what it waited for.
pub(crate) fn exit_within(child: &mut Child, bound: Duration, what: &str) -> Option<i32> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run did not end within {bound:?}: {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `path` until it holds `text`, for `bound` at most.
pub(crate) fn stderr_within(path: &Path, text: &str, child: &mut Child, bound: Duration) {
    let deadline = Instant::now() + bound;
    while !std::fs::read_to_string(path).is_ok_and(|stderr| stderr.contains(text)) {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no {text:?} on stderr within {bound:?}: {}",
                std::fs::read_to_string(path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a long run, sends `signals` SIGINTs once a group is written (each after the
/// drain has begun), and returns the outcome.
fn interrupted(case: &Case, latency: &str, signals: usize, args: &[&str]) -> Outcome {
    case.write_dataset(400);
    case.write_config(&format!(
        "num_generations = 4\nmax_inflight = 16\n\n[simulator]\nanswer_tokens = 4\nlatency = \"{latency}\"\n"
    ));
    let stderr_path = case.dir.join("stderr.txt");
    let mut child = case
        .command(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&stderr_path).expect("create the stderr file"))
        .spawn()
        .expect("the binary starts");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(case.out()).is_ok_and(|text| text.contains('\n')) {
        if let Some(status) = child.try_wait().expect("poll the child") {
            panic!(
                "the run ended ({status}) before a group was written: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no group written within two minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..signals {
        let sent = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "SIGINT sent");
        if signals > 1 {
            // The first starts the drain, the next finds it under way.
            wait_for_stderr(&stderr_path, "draining", &mut child);
        }
    }
    let code = wait(&mut child);
    Outcome {
        code,
        stderr: std::fs::read_to_string(&stderr_path).expect("read stderr"),
        rows: case.rows(),
    }
}

/// The groups written are whole: each of its ids has four rollouts.
fn assert_written_groups_whole(rows: &[TrainingSample]) {
    assert!(!rows.is_empty());
    let mut per_group: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for row in rows {
        per_group
            .entry(row.group_id)
            .or_default()
            .insert(row.rollout_id.0);
    }
    for (group, rollouts) in &per_group {
        assert_eq!(rollouts.len(), 4, "group {group}: {rollouts:?}");
    }
    assert!(
        per_group.len() < 400,
        "the signal stopped the run before the dataset's end"
    );
}

#[test]
fn ctrl_c_drains_and_leaves_whole_groups_with_the_exit_code_of_the_drain() {
    let case = Case::new("ctrl-c");
    let outcome = interrupted(&case, "300ms", 1, &[]);
    assert!(
        outcome.stderr.contains("Ctrl-C: draining"),
        "{}",
        outcome.stderr
    );
    assert_written_groups_whole(&outcome.rows);
    let clean = outcome.stderr.contains("drain clean");
    assert!(
        clean || outcome.stderr.contains("drain NOT clean"),
        "a drain report: {}",
        outcome.stderr
    );
    // The wording agrees with itself: a clean drain cancelled no rollout in flight (only
    // admitted ones not yet started), an unclean one says how many it cancelled.
    assert!(
        if clean {
            outcome
                .stderr
                .contains("drain clean: every rollout in flight finished")
        } else {
            outcome.stderr.contains("rollouts in flight cancelled")
        },
        "{}",
        outcome.stderr
    );
    assert_eq!(
        outcome.code,
        Some(if clean { 0 } else { 2 }),
        "{}",
        outcome.stderr
    );
}

#[test]
fn ctrl_c_with_a_drain_shorter_than_a_request_exits_2_and_says_not_clean() {
    let case = Case::new("ctrl-c-short");
    let outcome = interrupted(&case, "1500ms", 1, &["--drain-timeout", "1ms"]);
    assert_written_groups_whole(&outcome.rows);
    assert!(
        outcome.stderr.contains("drain NOT clean"),
        "{}",
        outcome.stderr
    );
    assert_eq!(outcome.code, Some(2), "{}", outcome.stderr);
}

#[test]
fn a_second_ctrl_c_cancels_the_rollouts_in_flight_and_the_drain_is_not_clean() {
    let case = Case::new("ctrl-c-twice");
    // The rollouts in flight wait seconds for their answer; the second signal ends them.
    let outcome = interrupted(&case, "3s", 2, &[]);
    assert!(
        outcome
            .stderr
            .contains("again: cancelling the rollouts in flight"),
        "{}",
        outcome.stderr
    );
    assert_written_groups_whole(&outcome.rows);
    assert!(
        outcome.stderr.contains("drain NOT clean"),
        "rollouts were cancelled: {}",
        outcome.stderr
    );
    assert!(
        !outcome
            .stderr
            .contains("(0 rollouts cancelled at the deadline"),
        "{}",
        outcome.stderr
    );
    assert_eq!(outcome.code, Some(2), "{}", outcome.stderr);
}

#[test]
fn the_quickstart_runs_offline_with_rewards_that_vary() {
    let case = Case::new("quickstart");
    let config = crate::repository().join("examples/quickstart.toml");
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .arg("rollout")
        .arg("--config")
        .arg(&config)
        .arg("--out")
        .arg(case.out())
        .args(["--progress", "log"])
        .current_dir(&case.dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("the binary starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(first.contains("built-in simulator"), "{first}");
    let rows = case.rows();
    assert_groups_complete(&rows, 64, 8);
    let mean = rows.iter().map(|r| r.reward.expect("scored")).sum::<f64>() / rows.len() as f64;
    assert!(mean > 0.0 && mean < 1.0, "mean reward {mean}");
}

#[test]
fn an_existing_output_file_is_refused_unless_overwrite_is_given() {
    let case = Case::new("overwrite");
    case.write_dataset(2);
    case.write_config("num_generations = 2\n");
    std::fs::write(case.out(), "earlier rows\n").expect("write");

    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    let out = case.out().display().to_string();
    assert!(
        outcome.stderr.contains(&out) && outcome.stderr.contains("--overwrite"),
        "{}",
        outcome.stderr
    );
    assert_eq!(
        std::fs::read_to_string(case.out()).expect("read"),
        "earlier rows\n",
        "the file is left alone"
    );

    let outcome = case.rollout(&["--overwrite"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_groups_complete(&outcome.rows, 2, 2);
}
