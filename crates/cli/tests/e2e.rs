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
        // Both compute in float32 from the same weights; only kernels differ.
        assert!(
            (got - expected).abs() < 1e-3,
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

/// A client for the JSON endpoints these tests call, on a runtime of its own.
struct Http {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
}

impl Http {
    fn new() -> Http {
        Http {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime"),
            // No connection kept between calls: the runtime is idle between them, so a kept
            // one the server closed meanwhile (uvicorn after 5 s) would still look open.
            client: reqwest::Client::builder()
                .no_proxy()
                .pool_max_idle_per_host(0)
                .build()
                .expect("a client"),
        }
    }

    /// `POST url` with `body`: the status must be 200; the answer as JSON.
    fn post(&self, url: &str, body: &Value) -> Value {
        self.runtime.block_on(async {
            let response = self
                .client
                .post(url)
                .json(body)
                .timeout(std::time::Duration::from_secs(600))
                .send()
                .await
                .unwrap_or_else(|e| panic!("POST {url}: {e}"));
            let status = response.status();
            let text = response.text().await.expect("a body");
            assert!(status.is_success(), "POST {url}: {status}: {text}");
            serde_json::from_str(&text).unwrap_or(Value::Null)
        })
    }

    fn get(&self, url: &str) -> Value {
        self.runtime.block_on(async {
            let response = self
                .client
                .get(url)
                .send()
                .await
                .unwrap_or_else(|e| panic!("GET {url}: {e}"));
            response.json().await.expect("JSON")
        })
    }
}

/// The binary running in the background, its stderr collected; killed if still running
/// when dropped.
struct Background {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Background {
    fn spawn(mut command: Command) -> Background {
        let mut child = command
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("piped");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Background {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The control endpoint's address, from the line the binary logs when it listens.
    fn address(&mut self) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(std::time::Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("no control endpoint: {}", self.seen.join("\n")));
            self.seen.push(line.clone());
            if let Some(at) = line.find("control endpoint listening address=") {
                let rest = &line[at + "control endpoint listening address=".len()..];
                return rest
                    .split_whitespace()
                    .next()
                    .expect("an address")
                    .to_owned();
            }
        }
    }

    /// Waits for the run to end: whether it succeeded, and its stderr.
    fn wait(mut self) -> (bool, String) {
        let status = self.child.wait().expect("the binary ran");
        self.seen.extend(self.lines.try_iter());
        while let Ok(line) = self.lines.recv_timeout(std::time::Duration::from_secs(1)) {
            self.seen.push(line);
        }
        (status.success(), self.seen.join("\n"))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The logprob vLLM gives each token of `ids` after those before it (`prompt_logprobs`), the
/// first one's `None`.
fn rescored_logprobs(http: &Http, url: &str, model: &str, ids: &[u32]) -> Vec<Option<f64>> {
    let answer = http.post(
        &format!("{url}/v1/completions"),
        &serde_json::json!({
            "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0, "add_special_tokens": false,
        }),
    );
    let entries = answer["choices"][0]["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs");
    assert_eq!(entries.len(), ids.len());
    entries
        .iter()
        .zip(ids)
        .map(|(entry, id)| entry[id.to_string()]["logprob"].as_f64())
        .collect()
}

/// Weight updates on the real server: run alone (`cargo xtask e2e` runs this module after
/// the others), since it loads other weights into the server they share, and leaves the
/// first ones back. `VLLM_MODEL_V2_DIR` is the policy with every weight moved (xtask's
/// `build_perturbed.py`); the server's worker extension reloads weights exactly on CPU
/// (xtask's `vllm_ext/async_grpo_vllm_ext.py`).
mod weights {
    use super::*;

    /// Loads the weights in `dir` into the server and drops its prefix cache (computed under
    /// the others).
    fn load(http: &Http, url: &str, dir: &str) {
        let answer = http.post(
            &format!("{url}/collective_rpc"),
            &serde_json::json!({"method": "reload_weights_exactly", "kwargs": {"weights_path": dir}}),
        );
        assert!(answer["results"].is_array(), "{answer}");
        http.post(&format!("{url}/reset_prefix_cache"), &Value::Null);
    }

    #[test]
    fn a_weight_update_mid_run_in_continue_mode_labels_each_token_with_the_weights_that_sampled_it()
    {
        let (url, model_dir, name) = (
            env("VLLM_URL"),
            env("VLLM_MODEL_DIR"),
            env("VLLM_MODEL_NAME"),
        );
        let v2 = env("VLLM_MODEL_V2_DIR");
        let http = Http::new();
        let dir = scratch("weights");
        let dataset = dir.join("stories.jsonl");
        let prompts: String = ["a cat", "the sea", "a robot", "winter"]
            .iter()
            .map(|topic| {
                format!(
                    "{{\"prompt\": \"Write a long story about {topic}.\", \"answer\": \"1\"}}\n"
                )
            })
            .collect();
        std::fs::write(&dataset, prompts).expect("the dataset");
        let out = dir.join("rows.jsonl");
        let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
        command
            .args(["rollout", "--server", &url, "--tokenizer", &model_dir])
            .arg("--dataset")
            .arg(&dataset)
            .arg("--out")
            .arg(&out)
            .args([
                "--num-generations",
                "2",
                "--max-tokens",
                "96",
                "--max-turns",
                "1",
            ])
            .args([
                "--seed",
                "5",
                "--reward",
                "numeric:answer",
                "--in-flight",
                "continue",
            ])
            .args(["--listen", "127.0.0.1:0", "--progress", "off"])
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1");
        let mut run = Background::spawn(command);
        let control = format!("http://{}", run.address());
        // Part-way through the answers: 8 requests of up to 96 tokens at a few tokens a second
        // each on 2 cores.
        for _ in 0..600 {
            if http.get(&format!("{control}/health"))["in_flight"].as_u64() > Some(0) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_secs(3));
        http.post(&format!("{control}/pause"), &Value::Null);
        // No request of the run is on the wire: the weights change under none.
        load(&http, &url, &v2);
        http.post(
            &format!("{control}/model_version"),
            &serde_json::json!({"version": 1}),
        );
        http.post(&format!("{control}/resume"), &Value::Null);
        let (ok, stderr) = run.wait();
        assert!(ok, "{stderr}");
        assert!(
            stderr.contains("answers continued across a pause"),
            "{stderr}"
        );
        let rows = rows(&out);
        assert_eq!(rows.len(), 8, "{stderr}");

        // Every row re-scored under each weights: a token's old logprob is the one of the
        // weights its version names.
        let mut under_v2 = Vec::new();
        for row in &rows {
            let ids: Vec<u32> = numbers(row, "input_ids");
            under_v2.push(rescored_logprobs(&http, &url, &name, &ids));
        }
        load(&http, &url, &model_dir);
        // (own error, other error, tokens) per version.
        let mut errors = [(0.0f64, 0.0f64, 0usize); 2];
        let mut across = 0;
        for (row, under_v2) in rows.iter().zip(&under_v2) {
            let ids: Vec<u32> = numbers(row, "input_ids");
            let old: Vec<f32> = numbers(row, "old_log_probs");
            let under_v1 = rescored_logprobs(&http, &url, &name, &ids);
            let spans: Vec<rollout_core::VersionSpan> =
                serde_json::from_value(row["token_versions"].clone()).expect("token_versions");
            across +=
                usize::from(spans.first().map(|s| s.version) != spans.last().map(|s| s.version));
            for span in spans {
                let version = span.version as usize;
                assert!(version <= 1, "{span:?}");
                for at in span.start..span.end {
                    let (Some(v1), Some(v2)) = (under_v1[at], under_v2[at]) else {
                        panic!("no logprob at {at}");
                    };
                    let old = f64::from(old[at]);
                    let (own, other) = if version == 0 { (v1, v2) } else { (v2, v1) };
                    let slot = &mut errors[version];
                    slot.0 += (old - own).abs();
                    slot.1 += (old - other).abs();
                    slot.2 += 1;
                }
            }
        }
        assert!(across > 0, "no row holds tokens of both versions: {stderr}");
        for (version, (own, other, tokens)) in errors.iter().enumerate() {
            assert!(*tokens > 0, "no token of version {version}");
            let (own, other) = (own / *tokens as f64, other / *tokens as f64);
            eprintln!(
                "version {version}: {tokens} tokens, mean |old logprob - re-score| {own:.4} under its weights, {other:.4} under the others"
            );
            // bf16 decoding and prefill differ by a few hundredths; the two weights by more.
            assert!(
                own < 0.05 && other > 3.0 * own,
                "version {version}: {tokens} tokens, mean error {own:.4} under its own weights, {other:.4} under the others"
            );
        }
    }
}

/// Routing replay against a real mixture-of-experts model served with
/// `--enable-return-routed-experts` (`VLLM_MOE_URL`, `VLLM_MOE_DIR` its folder with its
/// tokenizer and chat template, `VLLM_MOE_NAME`): in `cargo xtask e2e` a 2-layer Qwen3-MoE of
/// random weights, top 2 of 8 experts, in float32, on vLLM's Model Runner V2 with Triton's
/// interpreter (about a token a second: the runs are small); `cargo xtask routing-replay`
/// runs the same against any server, such as a GPU machine's real MoE model.
mod routing {
    use super::*;
    use rollout_core::RowRouting;
    use vllm_client::RoutedExperts;

    /// Sends each row's whole `input_ids` back to the server: the routing it reports for every
    /// token but the last must be the row's, exactly, and the row's last token is missing.
    fn assert_rows_route_as_the_server_does(rows: &[Value]) {
        let (url, name) = (env("VLLM_MOE_URL"), env("VLLM_MOE_NAME"));
        let http = Http::new();
        assert!(!rows.is_empty());
        for row in rows {
            let ids: Vec<u32> = numbers(row, "input_ids");
            let routing: RowRouting =
                serde_json::from_value(row["routed_experts"].clone()).expect("routed_experts");
            assert_eq!(
                (routing.tokens(), routing.layers, routing.top_k),
                (ids.len(), 2, 2)
            );
            assert_eq!(
                routing.missing,
                std::iter::once(ids.len() - 1..ids.len()).collect::<Vec<_>>()
            );
            let answer = http.post(
                &format!("{url}/v1/completions"),
                &serde_json::json!({
                    "model": name, "prompt": ids, "max_tokens": 1, "temperature": 0,
                    "add_special_tokens": false, "routed_experts_prompt_start": 0,
                }),
            );
            let text = answer["choices"][0]["routed_experts"]
                .as_str()
                .expect("routing");
            let rescored = RoutedExperts::from_base64_npy(text).expect("an .npy array");
            assert_eq!(
                rescored.shape,
                [ids.len(), 2, 2],
                "the re-score covers every token"
            );
            let stride = 2 * 2;
            let known = (ids.len() - 1) * stride;
            let differing = (0..ids.len() - 1)
                .filter(|t| {
                    routing.data[t * stride..(t + 1) * stride]
                        != rescored.data[t * stride..(t + 1) * stride]
                })
                .collect::<Vec<_>>();
            assert!(
                differing.is_empty(),
                "tokens routed otherwise: {differing:?} of {}",
                ids.len()
            );
            assert_eq!(routing.data[..known], rescored.data[..known]);
        }
    }

    fn moe_run(dir: &Path, extra: &[&str]) -> Vec<Value> {
        let dataset = dir.join("questions.jsonl");
        std::fs::write(
            &dataset,
            "{\"prompt\": \"What is 2 + 3?\", \"answer\": \"5\"}\n{\"prompt\": \"Name a color.\", \"answer\": \"red\"}\n",
        )
        .expect("the dataset");
        let out = dir.join("rows.jsonl");
        let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
            .args([
                "rollout",
                "--server",
                &env("VLLM_MOE_URL"),
                "--tokenizer",
                &env("VLLM_MOE_DIR"),
            ])
            .arg("--dataset")
            .arg(&dataset)
            .arg("--out")
            .arg(&out)
            .args(["--num-generations", "2", "--max-tokens", "5", "--seed", "3"])
            .args([
                "--routed-experts",
                "--progress",
                "log",
                "--rollout-timeout",
                "20m",
            ])
            .args(extra)
            .env("NO_COLOR", "1")
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        let rows = rows(&out);
        assert_eq!(rows.len(), 4, "{stderr}");
        rows
    }

    #[test]
    fn white_box_rows_carry_the_experts_the_real_router_chose_for_every_token() {
        let dir = scratch("routing");
        let rows = moe_run(&dir, &["--reward", "numeric:answer", "--max-turns", "1"]);
        assert_rows_route_as_the_server_does(&rows);
    }

    #[test]
    fn an_agent_s_turns_through_the_recording_proxy_carry_the_experts_too() {
        let dir = scratch("routing-agent");
        let python = test_support::cache_dir().join("venv-agents/bin/python");
        assert!(
            python.is_file(),
            "{} is missing: run `cargo xtask fixtures`",
            python.display()
        );
        let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent");
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "max_turns = 2\n\n[agent]\ncommand = [{python:?}, {agent:?}, \"plain\", \"{{prompt}}\"]\n\
                 verify = [{python:?}, {verify:?}, \"{{task_json}}\"]\ntimeout = \"20m\"\n",
                python = python.display().to_string(),
                agent = agent.join("openai_agent.py").display().to_string(),
                verify = agent.join("verify.py").display().to_string(),
            ),
        )
        .expect("the config");
        let rows = moe_run(&dir, &["--config", config.to_str().expect("a path")]);
        assert_rows_route_as_the_server_does(&rows);
    }
}
