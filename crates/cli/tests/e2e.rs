//! `async-grpo rollout` against a real vLLM server on CPU (SmolLM2-135M-Instruct).
//!
//! `cargo xtask e2e` (the last step of `cargo xtask ci`) starts the server with
//! `cargo xtask vllm-cpu` and passes `VLLM_URL` and `VLLM_MODEL_DIR` (the model's Hugging
//! Face folder: its tokenizer and chat template), and a reward model's server beside it
//! (`VLLM_REWARD_URL`, `VLLM_REWARD_MODEL_DIR`, `VLLM_REWARD_MODEL_NAME`, and `VLLM_PYTHON`,
//! the venv whose transformers scores the same conversations for comparison). Without them every test fails, saying so:
//! this suite never skips.

use std::{path::Path, process::Command};

use rollout_core::ChatTokenizer;
use serde_json::Value;
use test_support::ScratchDir;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run this suite with `cargo xtask e2e`, which starts vLLM")
    })
}

fn scratch(name: &str) -> ScratchDir {
    ScratchDir::new(&format!("async-grpo-e2e-{name}"))
}

fn rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("the output")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a complete JSON row"))
        .collect()
}

fn numbers<T: serde::de::DeserializeOwned>(row: &Value, field: &str) -> Vec<T> {
    serde_json::from_value(row[field].clone()).expect("a list of numbers")
}

#[test]
fn a_small_run_against_vllm_gives_rows_of_real_ids_and_logprobs() {
    let (url, model_dir) = (env("VLLM_URL"), env("VLLM_MODEL_DIR"));
    let dir = scratch("rollout");
    let dataset = dir.join("questions.jsonl");
    std::fs::write(
        &dataset,
        "{\"prompt\": \"What is 2 + 3? Answer with a number.\", \"answer\": \"5\"}\n\
         {\"prompt\": [{\"role\": \"system\", \"content\": \"You add numbers.\"}, {\"role\": \"user\", \"content\": \"What is 10 + 7?\"}], \"answer\": \"17\"}\n\
         {\"prompt\": \"Say hello.\", \"answer\": \"hello\"}\n",
    )
    .expect("the dataset");
    let out = dir.join("rows.jsonl");
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--server", &url, "--tokenizer", &model_dir])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(&out)
        .args([
            "--num-generations",
            "4",
            "--max-tokens",
            "24",
            "--max-turns",
            "2",
        ])
        .args([
            "--seed",
            "7",
            "--reward",
            "numeric:answer",
            "--reward",
            "regex:[Hh]ello@0.5",
        ])
        .args(["--progress", "log"])
        .env("NO_COLOR", "1")
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        !stderr.contains("built-in simulator"),
        "a server was given: {stderr}"
    );

    let rows = rows(&out);
    assert_eq!(rows.len(), 12, "3 groups of 4: {stderr}");
    let tokenizer = ChatTokenizer::from_dir(&model_dir).expect("the model's tokenizer");
    let vocab = tokenizer.tokenizer().get_vocab_size(true) as u32;
    let eos = tokenizer.eos_token_id().expect("SmolLM2 names its EOS");
    for row in &rows {
        let ids: Vec<u32> = numbers(row, "input_ids");
        let mask: Vec<u8> = numbers(row, "completion_mask");
        let logprobs: Vec<f32> = numbers(row, "old_log_probs");
        assert_eq!((mask.len(), logprobs.len()), (ids.len(), ids.len()));
        assert!(ids.iter().all(|&id| id < vocab), "ids in the vocabulary");

        // The prompt part is the chat template's rendering of the prompt, token for token.
        let prompt: Vec<rollout_core::Message> =
            serde_json::from_value(row["prompt"].clone()).expect("prompt messages");
        let rendered = tokenizer
            .apply_chat_template(&prompt, &rollout_core::RenderOptions::generation())
            .expect("the prompt renders");
        let start = mask.iter().position(|&m| m == 1).expect("sampled tokens");
        assert_eq!(ids[..start], rendered.ids[..], "the prompt ids");

        // Sampled tokens carry real logprobs; everything else 0.
        let sampled: Vec<u32> = (0..ids.len())
            .filter(|&i| mask[i] == 1)
            .map(|i| ids[i])
            .collect();
        for (i, &m) in mask.iter().enumerate() {
            if m == 1 {
                assert!(
                    logprobs[i] <= 0.0 && logprobs[i] > -1e4,
                    "a logprob: {}",
                    logprobs[i]
                );
            } else {
                assert_eq!(logprobs[i], 0.0, "context carries no logprob");
            }
        }
        assert!(
            logprobs.iter().any(|&l| l < 0.0),
            "a real model is not certain of every token"
        );
        // The answer in `completion` is the text of the sampled ids.
        let answer = row["completion"][0]["content"].as_str().expect("an answer");
        let text_ids = match sampled.split_last() {
            Some((last, rest)) if *last == eos => rest,
            _ => &sampled[..],
        };
        let decoded = tokenizer
            .tokenizer()
            .decode(text_ids, false)
            .expect("decodes");
        assert_eq!(decoded, answer);
        assert!(row["reward"].is_number(), "scored: {row}");
        assert!(row["advantage"].is_number());
    }
}

/// A small run against the real server: `dataset` and `rewards` (a config file's
/// `[[rewards]]` tables) written in `dir`, groups of 2, at most 16 tokens per answer; it
/// must succeed. Returns the rows and the run's stderr.
fn small_run(dir: &Path, dataset: &str, rewards: &str, seed: u32) -> (Vec<Value>, String) {
    let (url, model_dir) = (env("VLLM_URL"), env("VLLM_MODEL_DIR"));
    let (data, config, out) = (
        dir.join("questions.jsonl"),
        dir.join("rewards.toml"),
        dir.join("rows.jsonl"),
    );
    std::fs::write(&data, dataset).expect("the dataset");
    std::fs::write(&config, rewards).expect("the config");
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--server", &url, "--tokenizer", &model_dir])
        .arg("--config")
        .arg(&config)
        .arg("--dataset")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .args(["--num-generations", "2", "--max-tokens", "16"])
        .args(["--seed", &seed.to_string(), "--progress", "log"])
        .env("NO_COLOR", "1")
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    (rows(&out), stderr)
}

#[test]
fn the_real_server_judges_completions_through_its_chat_endpoint() {
    let (url, model) = (env("VLLM_URL"), env("VLLM_MODEL_NAME"));
    let dir = scratch("judge");
    // The policy's own server is the judge: the tiny model may answer a number or not, and
    // either is fine; what must hold is that the request went through and was read.
    let (rows, stderr) = small_run(
        &dir,
        "{\"prompt\": \"What is 2 + 3? Answer with a number.\", \"answer\": \"5\"}\n",
        &format!(
            "[[rewards]]\nspec = \"numeric:answer\"\n\n[[rewards]]\nkind = \"judge\"\nurl = \
             \"{url}/v1/chat/completions\"\nmodel = \"{model}\"\nmax_tokens = 8\ntemplate = \
             \"\"\"Question: {{prompt}}\nReference answer: {{answer}}\nResponse: {{completion}}\n\
             Rate the response from 0 to 10. Reply with the number only.\"\"\"\n"
        ),
        7,
    );
    // Two calls, none lost to the transport or an error status: each answer was read, as a
    // score or as unreadable.
    assert!(
        stderr
            .contains("reward 'judge' made 2 calls (0 retried attempts, 0 answers from its cache)"),
        "{stderr}"
    );
    assert!(stderr.contains("(0 transport, 0 status, "), "{stderr}");
    assert_eq!(rows.len(), 2, "{stderr}");
    for row in &rows {
        let judged = &row["rewards"]["judge"];
        assert!(judged.is_number() || judged.is_null(), "{row}");
    }
}

/// Scores conversations (JSON on stdin, one list of messages each) with a reward model in
/// transformers, in float32: the conversation rendered by the model's own chat template,
/// the score head's output at the last token.
const REFERENCE_SCORES_PY: &str = r#"
import json, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
folder = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
for messages in json.load(sys.stdin):
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=True)["input_ids"]
    with torch.no_grad():
        print(model(torch.tensor([ids])).logits[0][0].item())
"#;

#[test]
fn a_reward_model_on_the_real_pooling_runner_scores_each_conversation_as_transformers_does() {
    let (reward_url, reward_dir, reward_name, python) = (
        env("VLLM_REWARD_URL"),
        env("VLLM_REWARD_MODEL_DIR"),
        env("VLLM_REWARD_MODEL_NAME"),
        env("VLLM_PYTHON"),
    );
    let dir = scratch("reward-model");
    let (rows, stderr) = small_run(
        &dir,
        "{\"prompt\": \"What is 2 + 3?\", \"answer\": \"5\"}\n\
         {\"prompt\": \"Name a colour.\", \"answer\": \"red\"}\n",
        &format!(
            "[[rewards]]\nkind = \"reward_model\"\nurl = \"{reward_url}/classify\"\nmodel = \
             \"{reward_name}\"\n"
        ),
        3,
    );
    assert!(
        stderr.contains("reward 'reward_model' made 4 calls (0 retried attempts, 0 answers from its cache); 0 failed"),
        "{stderr}"
    );
    assert_eq!(rows.len(), 4, "{stderr}");

    // The same conversations scored by transformers from the same folder.
    let conversations: Vec<Value> = rows
        .iter()
        .map(|row| {
            let mut messages = row["prompt"].as_array().expect("prompt messages").clone();
            messages.extend(
                row["completion"]
                    .as_array()
                    .expect("completion messages")
                    .iter()
                    .cloned(),
            );
            Value::Array(messages)
        })
        .collect();
    let mut child = Command::new(&python)
        .args(["-c", REFERENCE_SCORES_PY, &reward_dir])
        .env("HF_HUB_OFFLINE", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the reference scorer starts");
    serde_json::to_writer(child.stdin.take().expect("stdin"), &conversations)
        .expect("the conversations are sent");
    let reference = child.wait_with_output().expect("the reference scorer ends");
    assert!(
        reference.status.success(),
        "{}",
        String::from_utf8_lossy(&reference.stderr)
    );
    let expected: Vec<f64> = String::from_utf8_lossy(&reference.stdout)
        .lines()
        .map(|line| line.parse().expect("a score per line"))
        .collect();
    assert_eq!(expected.len(), rows.len());
    for (row, expected) in rows.iter().zip(expected) {
        let got = row["rewards"]["reward_model"].as_f64().expect("scored");
        // The server computes in bfloat16, the reference in float32.
        assert!(
            (got - expected).abs() < 0.05,
            "vLLM {got}, transformers {expected}: {row}"
        );
    }
}

/// `GET {url}/metrics`, the Prometheus text vLLM serves.
fn metrics(url: &str) -> String {
    use std::io::{Read, Write};
    let address = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("vLLM answers");
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .expect("the request is sent");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("the response is read");
    response
}

/// The sum of a metric's samples (every label set).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests vLLM finished (any reason it counts as a success: stop, length, ...).
fn finished_requests(url: &str) -> f64 {
    metric(&metrics(url), "vllm:request_success_total")
}

#[test]
fn ctrl_c_past_the_drain_deadline_aborts_the_requests_on_the_server() {
    let (url, model_dir) = (env("VLLM_URL"), env("VLLM_MODEL_DIR"));
    let dir = scratch("drain");
    let dataset = dir.join("stories.jsonl");
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Write a very long story about the number {i}.\", \"answer\": \"{i}\"}}\n"))
        .collect();
    std::fs::write(&dataset, rows).expect("the dataset");
    let finished_before = finished_requests(&url);
    let child = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--server", &url, "--tokenizer", &model_dir])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(dir.join("rows.jsonl"))
        // Long answers: the requests in flight would run for many seconds to the end.
        .args([
            "--num-generations",
            "4",
            "--max-inflight",
            "8",
            "--max-tokens",
            "1500",
        ])
        .args([
            "--reward",
            "numeric:answer",
            "--drain-timeout",
            "1s",
            "--progress",
            "log",
        ])
        .env("NO_COLOR", "1")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let started = std::time::Instant::now();
    while metric(&metrics(&url), "vllm:num_requests_running") < 8.0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(120),
            "the rollouts never reached the server"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let output = child.wait_with_output().expect("the binary ends");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "an unclean drain: {stderr}");
    assert!(stderr.contains("drain NOT clean"), "{stderr}");

    // Dropped requests are aborted by vLLM, not run to the end: nothing runs a moment later,
    // and none of them is counted as finished.
    let stopped = std::time::Instant::now();
    while metric(&metrics(&url), "vllm:num_requests_running") > 0.0 {
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(5),
            "vLLM still runs the cancelled requests: {}",
            metrics(&url)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let completed_turns: f64 = stderr
        .lines()
        .find_map(|line| {
            // "... N cancelled; T turns, S tokens sampled, ..."
            let (_, rest) = line.split_once(" cancelled; ")?;
            rest.split(" turns").next()?.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("the summary counts turns: {stderr}"));
    assert_eq!(
        finished_requests(&url) - finished_before,
        completed_turns,
        "only the turns the engine completed finished on the server: {stderr}"
    );
}
