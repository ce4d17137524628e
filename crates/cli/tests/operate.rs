//! Operating a run: the control endpoint (health, Prometheus metrics, model versions, pause
//! and resume, the token), resume after SIGKILL, shards run at once, Parquet in and out,
//! stdout. The real binary against its built-in simulator, over real HTTP.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use reqwest::StatusCode;
use rollout_core::TrainingSample;
use serde_json::Value;

use super::rollout::{Case, question, runtime};

/// Top-level keys and tables of a run on the built-in simulator, answering after `latency`.
fn settings(rest: &str, latency: &str) -> String {
    format!(
        "num_generations = 4\nmax_turns = 3\n{rest}\n\n[[tools]]\nname = \"calculator\"\n\
         kind = \"calculator\"\n\n[simulator]\ntool_rounds = 1\ncorrect_rate = 0.5\n\
         answer_tokens = 6\nlatency = \"{latency}\"\n"
    )
}

/// The run of `case` writing to `out` (`-` for stdout) instead of the case's own output.
fn command_out(case: &Case, out: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
    command
        .arg("rollout")
        .arg("--config")
        .arg(case.config_file())
        .arg("--out")
        .arg(out)
        .args(["--progress", "off"])
        .args(args)
        .current_dir(&case.dir)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null());
    command
}

/// Runs `command` to its end: its exit code and stderr.
fn run_to_end(mut command: Command) -> (Option<i32>, String) {
    let output = command.output().expect("the binary runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A run in the background, its stderr read line by line, killed when dropped.
pub(crate) struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(case: &Case, args: &[&str]) -> Running {
        Running::spawn(case.command(args))
    }

    pub(crate) fn spawn(mut command: Command) -> Running {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first line of stderr containing `text` (the run's log so far on failure).
    fn line_with(&mut self, text: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(text) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {text:?}; stderr so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Where the control endpoint listens, from its log line.
    pub(crate) fn address(&mut self) -> SocketAddr {
        let line = self.line_with("control endpoint listening");
        let at = line.find("address=").expect("the line names the address") + "address=".len();
        line[at..]
            .split_whitespace()
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("an address in {line}"))
    }

    /// Waits for the process to end; its exit code and the rest of its stderr. A run still
    /// going after 100 s fails the test with its stderr (before nextest's timeout would end
    /// it without saying where it was).
    fn wait(mut self) -> (Option<i32>, String) {
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("the run can be waited on") {
                break status;
            }
            if started.elapsed() > Duration::from_secs(100) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                self.seen.extend(self.lines.try_iter());
                panic!(
                    "the run did not end within 100 s; its stderr:\n{}",
                    self.seen.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.seen.extend(self.lines.iter());
        (status.code(), self.seen.join("\n"))
    }

    fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success());
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP client of one run's control endpoint.
struct Endpoint {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    base: String,
    token: Option<&'static str>,
}

impl Endpoint {
    fn new(address: SocketAddr, token: Option<&'static str>) -> Endpoint {
        Endpoint {
            runtime: runtime(),
            // A request the run never answers fails the test, naming it.
            client: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("a client"),
            base: format!("http://{address}"),
            token,
        }
    }

    /// The endpoint of a run, once its engine runs (it answers "starting" before).
    fn running(address: SocketAddr, token: Option<&'static str>) -> Endpoint {
        let endpoint = Endpoint::new(address, token);
        endpoint.until("running", |h| h["starting"] == false);
        endpoint
    }

    fn send(&self, request: reqwest::RequestBuilder) -> (StatusCode, String) {
        let request = match self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        self.runtime.block_on(async {
            let response = request
                .send()
                .await
                .unwrap_or_else(|e| panic!("the endpoint did not answer: {e}"));
            let status = response.status();
            (status, response.text().await.expect("a body"))
        })
    }

    fn get(&self, path: &str) -> (StatusCode, String) {
        self.send(self.client.get(format!("{}{path}", self.base)))
    }

    fn post(&self, path: &str, body: Option<Value>) -> (StatusCode, String) {
        let request = self.client.post(format!("{}{path}", self.base));
        self.send(match body {
            Some(body) => request.json(&body),
            None => request,
        })
    }

    fn health(&self) -> Value {
        let (_, body) = self.get("/health");
        serde_json::from_str(&body).expect("/health is JSON")
    }

    /// Polls /health until `done` holds (the run's own pace, no deadline of the test's).
    fn until(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..3000 {
            let health = self.health();
            if done(&health) {
                return health;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("never {what}: {}", self.health());
    }

    /// The exposition, parsed by a Prometheus text parser: `name{labels}` to value.
    fn metrics(&self) -> BTreeMap<String, f64> {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, StatusCode::OK, "{text}");
        let lines = text.lines().map(|line| Ok(line.to_owned()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
        scrape
            .samples
            .into_iter()
            .map(|sample| {
                let value = match sample.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    prometheus_parse::Value::Histogram(buckets) => {
                        buckets.last().map_or(0.0, |b| b.count)
                    }
                    prometheus_parse::Value::Summary(_) => f64::NAN,
                };
                let mut labels: Vec<String> = sample
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                labels.sort();
                (format!("{}{{{}}}", sample.metric, labels.join(",")), value)
            })
            .collect()
    }
}

fn counter(health: &Value, name: &str) -> u64 {
    health["counters"][name].as_u64().unwrap_or(0)
}

#[test]
fn every_endpoint_but_health_wants_the_token_and_model_versions_only_grow() {
    let case = Case::new("control-auth");
    case.write_dataset(40);
    case.write_config(&settings("max_inflight = 4", "100ms"));
    // The token from the environment, as a deployment passes secrets.
    let mut run = Running::start_with_env(
        &case,
        &["--listen", "0"],
        "ASYNC_GRPO_LISTEN_TOKEN",
        "s3cret",
    );
    let address = run.address();
    assert!(
        address.ip().is_loopback(),
        "a port alone listens on 127.0.0.1"
    );
    let anonymous = Endpoint::new(address, None);
    let wrong = Endpoint::new(address, Some("guess"));
    let endpoint = Endpoint::running(address, Some("s3cret"));

    let (status, body) = anonymous.get("/health");
    assert_eq!(status, StatusCode::OK, "{body}");
    let health: Value = serde_json::from_str(&body).expect("JSON");
    for key in [
        "heartbeat_age_s",
        "in_flight",
        "queued",
        "counters",
        "model_version",
        "paused",
    ] {
        assert!(health.get(key).is_some(), "/health has {key}: {health}");
    }
    for (path, post) in [
        ("/metrics", false),
        ("/model_version", true),
        ("/pause", true),
        ("/resume", true),
    ] {
        for client in [&anonymous, &wrong] {
            let (status, _) = if post {
                client.post(path, Some(serde_json::json!({"version": 1})))
            } else {
                client.get(path)
            };
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} without the token");
        }
    }

    let version = |v: u64| endpoint.post("/model_version", Some(serde_json::json!({"version": v})));
    assert_eq!(version(3).0, StatusCode::OK);
    let (status, body) = version(2);
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let refused: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(refused["version"], 3, "the 409 says the current version");
    assert_eq!(
        version(3).0,
        StatusCode::OK,
        "the same version again is fine"
    );
    assert_eq!(endpoint.health()["model_version"], 3);
    assert_eq!(endpoint.metrics()["async_grpo_model_version{}"], 3.0);
    let (status, _) = endpoint.post("/pause?mode=sideways", None);
    assert_eq!(status, StatusCode::BAD_REQUEST, "an unknown pause mode");
    let (status, _) = endpoint.post("/model_version", Some(serde_json::json!({"v": 1})));
    assert!(status.is_client_error(), "a body without a version");
}

impl Running {
    fn start_with_env(case: &Case, args: &[&str], key: &str, value: &str) -> Running {
        let mut command = case.command(args);
        command.env(key, value);
        Running::spawn(command)
    }
}

/// The numbers of the run's summary lines, by the words that follow them.
fn summary_numbers(stderr: &str) -> BTreeMap<String, u64> {
    let mut numbers = BTreeMap::new();
    for line in stderr.lines().filter(|l| l.starts_with("async-grpo: ")) {
        let words: Vec<&str> = line
            .split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == '(' || c == ')')
            .filter(|w| !w.is_empty())
            .collect();
        for (i, word) in words.iter().enumerate() {
            if let Ok(n) = word.parse::<u64>() {
                let next = |k: usize| words.get(i + k).copied().unwrap_or_default();
                numbers.entry(next(1).to_owned()).or_insert(n);
                numbers
                    .entry(format!("{} {}", next(1), next(2)))
                    .or_insert(n);
            }
        }
    }
    numbers
}

#[test]
fn health_is_503_while_no_server_can_take_requests_and_200_again_when_one_can() {
    use crate::reliability::{free_port, simulator_process};
    let case = Case::new("control-health");
    case.write_dataset(40);
    case.write_config(&settings("max_inflight = 4\nretries = 0", "50ms"));
    let port = free_port();
    let server = format!("http://127.0.0.1:{port}");
    let mut simulator = simulator_process(port, 50);
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0", "--server", &server]);
    let endpoint = Endpoint::running(run.address(), None);
    assert_eq!(endpoint.get("/health").0, StatusCode::OK);
    simulator.kill().expect("the simulator is killed");
    simulator.wait().expect("reaped");
    let down = endpoint.until("unhealthy", |h| h["healthy"] == false);
    assert!(
        down["problem"]
            .as_str()
            .unwrap_or_default()
            .contains("no server"),
        "{down}"
    );
    assert_eq!(endpoint.get("/health").0, StatusCode::SERVICE_UNAVAILABLE);
    let mut simulator = simulator_process(port, 50);
    endpoint.until("healthy again", |h| h["healthy"] == true);
    assert_eq!(endpoint.get("/health").0, StatusCode::OK);
    run.terminate();
    let _ = run.wait();
    let _ = simulator.kill();
    let _ = simulator.wait();
}

#[test]
fn health_says_the_run_is_starting_while_it_waits_for_its_servers() {
    use crate::reliability::{free_port, simulator_process};
    let case = Case::new("control-starting");
    case.write_dataset(40);
    case.write_config(&settings("max_inflight = 4", "50ms"));
    let port = free_port();
    let server = format!("http://127.0.0.1:{port}");
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0", "--server", &server]);
    let endpoint = Endpoint::new(run.address(), None);
    let (status, body) = endpoint.get("/health");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let starting: Value = serde_json::from_str(&body).expect("/health is JSON");
    assert_eq!(starting["starting"], true, "{starting}");
    assert!(
        starting["problem"]
            .as_str()
            .is_some_and(|p| p.contains("waits for its servers")),
        "{starting}"
    );
    // Nothing to steer yet: said, not queued and lost.
    let (status, body) = endpoint.post("/model_version", Some(serde_json::json!({"version": 3})));
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(endpoint.get("/metrics").0, StatusCode::OK);

    let mut simulator = simulator_process(port, 50);
    let running = endpoint.until("running", |h| h["starting"] == false);
    assert_eq!(running["model_version"], 0, "{running}");
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let _ = simulator.kill();
    let _ = simulator.wait();
}

#[test]
fn a_paused_run_admits_nothing_and_its_metrics_match_the_summary_it_ends_with() {
    let case = Case::new("control-pause-wait");
    case.write_dataset(40);
    case.write_config(&settings("max_inflight = 8", "50ms"));
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0"]);
    let endpoint = Endpoint::running(run.address(), None);
    endpoint.until("a group written", |h| {
        h["groups_written"].as_u64() >= Some(1)
    });
    let (status, body) = endpoint.post("/pause?mode=wait", None);
    assert_eq!(status, StatusCode::OK, "{body}");
    let paused: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(
        paused["in_flight"], 0,
        "the pause answers once nothing runs"
    );
    let health = endpoint.health();
    assert_eq!(health["paused"], true);
    // The pause answers once nothing is generated. A group whose last rollout just ended may
    // still be scored (its permits are back before that), and the writer thread may still
    // be writing the last groups the engine handed over: the scrape waits for both.
    endpoint.until(
        "every group whose rollouts ended is scored or dropped, and written",
        |h| {
            let count = |name: &str| h["counters"][name].as_u64().unwrap_or(0);
            let finished: u64 = [
                "groups_completed",
                "groups_too_small",
                "groups_zero_variance",
                "groups_non_finite",
                "groups_cancelled",
                "groups_stale",
            ]
            .into_iter()
            .map(count)
            .sum();
            let ended = count("rollouts_completed") + count("rollouts_failed");
            finished * 4 == ended && h["samples_written"] == h["counters"]["samples"]
        },
    );
    let metrics = endpoint.metrics();
    let m = |name: &str| {
        metrics
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} in {metrics:?}")) as u64
    };
    assert_eq!(m("async_grpo_rollouts_in_flight{}"), 0);
    assert_eq!(m("async_grpo_paused{}"), 1);
    assert!(
        m("async_grpo_groups_admitted_total{}") < 40,
        "the pause held admission"
    );

    // Nothing runs while paused, so the drain a SIGTERM starts finds nothing to do and the
    // summary counts what the scrape counted.
    run.terminate();
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let summary = summary_numbers(&stderr);
    let s = |words: &str| {
        *summary
            .get(words)
            .unwrap_or_else(|| panic!("{words:?} in {summary:?}"))
    };
    assert_eq!(
        s("groups scored"),
        m("async_grpo_groups_total{outcome=completed}")
    );
    assert_eq!(
        s("rollouts completed"),
        m("async_grpo_rollouts_total{outcome=completed}")
    );
    assert_eq!(s("failed"), m("async_grpo_rollouts_total{outcome=failed}"));
    assert_eq!(s("turns"), m("async_grpo_turns_total{}"));
    assert_eq!(s("tokens sampled"), m("async_grpo_sampled_tokens_total{}"));
    assert_eq!(
        s("tool calls"),
        m("async_grpo_tool_calls_total{outcome=ok,tool=calculator}")
    );
    assert_eq!(s("training rows"), m("async_grpo_samples_written_total{}"));
    assert_eq!(s("stale"), m("async_grpo_groups_total{outcome=stale}"));
    assert_eq!(
        case.rows().len() as u64,
        m("async_grpo_samples_written_total{}")
    );
    assert_eq!(
        m("async_grpo_generation_duration_seconds{}"),
        m("async_grpo_turns_total{}"),
        "one generation latency per turn"
    );
    assert_eq!(
        m("async_grpo_tool_call_duration_seconds{tool=calculator}"),
        m("async_grpo_tool_calls_total{outcome=ok,tool=calculator}"),
        "one tool latency per call"
    );
}

#[test]
fn a_pause_that_aborts_cancels_the_rollouts_in_flight_and_a_resume_finishes_the_run() {
    let case = Case::new("control-pause-abort");
    case.write_dataset(12);
    case.write_config(&settings("max_inflight = 8", "300ms"));
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0"]);
    let endpoint = Endpoint::running(run.address(), None);
    endpoint.until("rollouts in flight", |h| h["in_flight"].as_u64() > Some(0));
    let (status, body) = endpoint.post("/pause?mode=abort", None);
    assert_eq!(status, StatusCode::OK, "{body}");
    let health = endpoint.health();
    assert_eq!(health["in_flight"], 0);
    let aborted = counter(&health, "rollouts_aborted");
    assert!(aborted > 0, "the pause cancelled rollouts: {health}");
    let (status, _) = endpoint.post("/resume", None);
    assert_eq!(status, StatusCode::OK);
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let groups: BTreeSet<u64> = case.rows().iter().map(|r| r.group_id).collect();
    let cancelled = summary_numbers(&stderr)["cancelled by"];
    assert!(cancelled > 0, "{stderr}");
    assert_eq!(
        groups.len() as u64 + cancelled,
        12,
        "every other group was rolled out"
    );
}

#[test]
fn a_pause_that_continues_keeps_the_rollouts_and_each_token_s_version_across_the_update() {
    let case = Case::new("control-pause-continue");
    case.write_dataset(4);
    // The run's in_flight is what a /pause without a mode does; an answer takes 140 ms.
    let config = settings("max_inflight = 8\nin_flight = \"continue\"", "0ms");
    case.write_config(&format!("{config}per_token = \"20ms\"\n"));
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0"]);
    let endpoint = Endpoint::running(run.address(), None);
    endpoint.until("rollouts in flight", |h| h["in_flight"].as_u64() > Some(4));
    // Part-way through the first answers (a tool call of about 22 tokens).
    std::thread::sleep(Duration::from_millis(150));
    let (status, body) = endpoint.post("/pause", None);
    assert_eq!(status, StatusCode::OK, "{body}");
    let paused: Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        paused["in_flight"].as_u64() > Some(0),
        "the rollouts stay in flight: {body}"
    );
    // The answers on the wire were interrupted with their tokens, and wait to go on.
    let health = endpoint.health();
    assert!(counter(&health, "answers_continued") > 0, "{health}");
    let (status, _) = endpoint.post("/model_version", Some(serde_json::json!({"version": 1})));
    assert_eq!(status, StatusCode::OK);
    let (status, _) = endpoint.post("/resume", None);
    assert_eq!(status, StatusCode::OK);
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("answers continued across a pause"),
        "{stderr}"
    );
    let rows = case.rows();
    assert_eq!(rows.len(), 16, "no rollout was dropped");
    let mut across = 0;
    for row in &rows {
        let mut covered = vec![0u8; row.input_ids.len()];
        for span in &row.token_versions {
            covered[span.start..span.end]
                .iter_mut()
                .for_each(|c| *c += 1);
        }
        assert_eq!(
            covered, row.completion_mask,
            "spans cover the sampled tokens"
        );
        let versions: BTreeSet<u64> = row.token_versions.iter().map(|s| s.version).collect();
        across += usize::from(versions.len() == 2);
        assert_eq!(row.model_version, *versions.first().expect("a version"));
    }
    assert!(
        across > 0,
        "no row holds tokens of both versions: {stderr}\n{:?}",
        rows.iter().map(|r| &r.token_versions).collect::<Vec<_>>()
    );
}

#[test]
fn admission_holds_a_group_that_would_outrun_the_staleness_bound_until_the_version_moves() {
    let case = Case::new("control-staleness");
    case.write_dataset(6);
    case.write_config(&settings(
        "max_inflight = 16\nmax_staleness = 0\ngroups_per_version = 1",
        "20ms",
    ));
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0"]);
    let endpoint = Endpoint::running(run.address(), None);
    let idle = |groups: u64| {
        move |h: &Value| {
            counter(h, "groups_completed") >= groups && h["in_flight"].as_u64() == Some(0)
        }
    };
    let health = endpoint.until("group 0 done", idle(1));
    assert_eq!(counter(&health, "groups_admitted"), 1, "{health}");
    let version = |v: u64| endpoint.post("/model_version", Some(serde_json::json!({"version": v})));
    assert_eq!(version(1).0, StatusCode::OK);
    let health = endpoint.until("group 1 done", idle(2));
    assert_eq!(counter(&health, "groups_admitted"), 2, "{health}");
    assert_eq!(version(10).0, StatusCode::OK);
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let versions: BTreeMap<u64, u64> = case
        .rows()
        .iter()
        .map(|r| (r.group_id, r.model_version))
        .collect();
    assert_eq!(versions.len(), 6);
    assert_eq!((versions[&0], versions[&1]), (0, 1), "{versions:?}");
}

#[test]
fn a_version_posted_while_groups_run_cancels_those_left_too_far_behind_and_counts_them() {
    let case = Case::new("control-stale");
    case.write_dataset(8);
    case.write_config(&settings("max_inflight = 8\nmax_staleness = 0", "300ms"));
    let mut run = Running::start(&case, &["--listen", "127.0.0.1:0"]);
    let endpoint = Endpoint::running(run.address(), None);
    endpoint.until("rollouts in flight", |h| h["in_flight"].as_u64() > Some(0));
    let (status, _) = endpoint.post("/model_version", Some(serde_json::json!({"version": 1})));
    assert_eq!(status, StatusCode::OK);
    let health = endpoint.until("a stale group", |h| counter(h, "groups_stale") > 0);
    let stale = counter(&health, "groups_stale");
    let metrics = endpoint.metrics();
    assert!(metrics["async_grpo_groups_total{outcome=stale}"] >= stale as f64);
    let (code, stderr) = run.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let summary = summary_numbers(&stderr);
    assert!(summary["stale"] >= stale, "{stderr}");
    assert_eq!(
        summary["groups scored"] + summary["stale"],
        8,
        "every group was scored or dropped as stale: {stderr}"
    );
}

/// Every group of the output, checked whole and written once: id to rows.
fn groups_of(rows: &[TrainingSample]) -> BTreeMap<u64, usize> {
    let mut groups: BTreeMap<u64, usize> = BTreeMap::new();
    let mut last = None;
    for row in rows {
        if last != Some(row.group_id) {
            assert!(
                !groups.contains_key(&row.group_id),
                "group {} written twice",
                row.group_id
            );
        }
        last = Some(row.group_id);
        *groups.entry(row.group_id).or_default() += 1;
    }
    for row in rows {
        assert_eq!(
            groups[&row.group_id] as u64, row.group_samples,
            "group {} whole",
            row.group_id
        );
    }
    groups
}

/// A small generator of kill delays, seeded by the clock and printed, so a failure can be
/// replayed by setting `KILL_SEED`.
fn kill_delays() -> impl FnMut() -> Duration {
    let seed = std::env::var("KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("KILL_SEED={seed}");
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        Duration::from_millis(100 + (state >> 33) % 1500)
    }
}

#[test]
fn a_run_killed_at_random_points_and_resumed_writes_every_group_of_the_pass_once() {
    let case = Case::new("resume-kill");
    case.write_dataset(40);
    case.write_config(&settings("max_inflight = 4\nseed = 5", "40ms"));
    let mut delay = kill_delays();
    let mut kills = 0;
    for _ in 0..4 {
        let mut child = case
            .command(&["--resume"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the binary starts");
        std::thread::sleep(delay());
        if child.try_wait().expect("a status").is_some() {
            break;
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        kills += 1;
    }
    assert!(kills > 0, "the run was killed at least once");
    let outcome = case.rollout(&["--resume"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(outcome.stderr.contains("resuming"), "{}", outcome.stderr);
    let groups = groups_of(&outcome.rows);
    assert_eq!(
        groups.keys().copied().collect::<Vec<_>>(),
        (0..40).collect::<Vec<_>>(),
        "after {kills} kills"
    );
}

/// The output of `case` cut as `cut` says from a finished run's lines, then resumed: what
/// the resumed run said, after checking that every group is there once and whole.
fn resume_after(case: &Case, cut: impl Fn(&[&str]) -> String) -> String {
    let text = std::fs::read_to_string(case.out()).expect("the output");
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(case.out(), cut(&lines)).expect("write the cut file");
    let outcome = case.rollout(&["--resume"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    let groups = groups_of(&outcome.rows);
    assert_eq!(
        groups.keys().copied().collect::<Vec<_>>(),
        (0..5).collect::<Vec<_>>()
    );
    outcome.stderr
}

#[test]
fn resuming_drops_a_torn_last_line_and_a_group_cut_short_and_says_so() {
    let case = Case::new("resume-torn");
    case.write_dataset(5);
    case.write_config(&settings("max_inflight = 8", "0ms"));
    let first = case.rollout(&[]);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    let whole = |lines: &[&str]| -> String { lines.iter().map(|l| format!("{l}\n")).collect() };

    // The last group is gone and half a line of a new one follows: only the half line goes.
    let size = first.rows.last().expect("rows").group_samples as usize;
    let said = resume_after(&case, |lines| {
        let mut text = whole(&lines[..lines.len() - size]);
        text.push_str(&lines[0][..lines[0].len() / 2]);
        text
    });
    assert!(said.contains("dropped a torn last line"), "{said}");
    assert!(!said.contains("cut mid-write"), "{said}");

    // The last group lost its last row: the rest of it goes, and it is rolled out again.
    let cut_group = case.rows().last().expect("rows").group_id;
    let said = resume_after(&case, |lines| whole(&lines[..lines.len() - 1]));
    assert!(
        said.contains(&format!("dropped group {cut_group}, cut mid-write")),
        "{said}"
    );
    assert!(!said.contains("dropped a torn"), "{said}");
    assert_eq!(
        case.rows().last().map(|r| r.group_id),
        Some(cut_group),
        "rolled out again"
    );

    // Nothing left to roll out: the torn line still goes.
    let said = resume_after(&case, |lines| {
        let mut text = whole(lines);
        text.push_str("{\"group_id\":");
        text
    });
    assert!(said.contains("nothing left to roll out"), "{said}");
    assert!(said.contains("dropped a torn last line"), "{said}");
}

#[test]
fn groups_counts_the_groups_of_the_whole_run_when_it_is_resumed() {
    let case = Case::new("resume-groups");
    case.write_dataset(12);
    case.write_config(&settings("max_inflight = 8", "0ms"));
    let scored = |stderr: &str| summary_numbers(stderr)["groups scored"];
    let first = case.rollout(&["--groups", "4"]);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert_eq!(scored(&first.stderr), 4, "{}", first.stderr);
    // Groups dropped (zero variance) are not in the output: the resumed run rolls them out.
    let kept = groups_of(&first.rows).len() as u64;

    let second = case.rollout(&["--groups", "7", "--resume"]);
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert_eq!(scored(&second.stderr), 7 - kept, "{}", second.stderr);

    let third = case.rollout(&["--groups", "3", "--resume"]);
    assert_eq!(third.code, Some(0), "{}", third.stderr);
    assert!(
        third.stderr.contains("nothing left to roll out"),
        "{}",
        third.stderr
    );
}

#[test]
fn shards_run_at_once_roll_out_disjoint_parts_whose_union_is_the_whole_run() {
    let case = Case::new("shards");
    case.write_dataset(13);
    case.write_config(&settings(
        "max_inflight = 8\nepochs = 2\nshuffle = true\nseed = 9",
        "5ms",
    ));
    let count = 3;
    let children: Vec<(Child, std::path::PathBuf)> = (0..count)
        .map(|index| {
            let out = case.dir.join(format!("shard-{index}.jsonl"));
            let shard = format!("{index}/{count}");
            let child = command_out(&case, &out, &["--shard", &shard])
                .stderr(Stdio::null())
                .spawn()
                .expect("the binary starts");
            (child, out)
        })
        .collect();
    let mut union = BTreeMap::new();
    let mut prompts: BTreeMap<u64, String> = BTreeMap::new();
    for (index, (mut child, out)) in children.into_iter().enumerate() {
        assert!(child.wait().expect("ends").success(), "shard {index}");
        let text = std::fs::read_to_string(&out).expect("the shard's output");
        let rows: Vec<TrainingSample> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a row"))
            .collect();
        for (group, size) in groups_of(&rows) {
            assert!(
                union.insert(group, (index, size)).is_none(),
                "group {group} in two shards"
            );
        }
        for row in rows {
            let prompt = row.prompt[0].content().unwrap_or_default().to_owned();
            prompts.insert(row.group_id, prompt);
        }
    }
    assert_eq!(
        union.keys().copied().collect::<Vec<_>>(),
        (0..26).collect::<Vec<_>>()
    );
    // Both passes hold every question once, each in an order of its own.
    let pass =
        |p: u64| -> Vec<String> { (p * 13..p * 13 + 13).map(|g| prompts[&g].clone()).collect() };
    let (first, second) = (pass(0), pass(1));
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(sorted(first.clone()), sorted(second.clone()));
    assert_eq!(sorted(first.clone()).len(), 13);
    assert_ne!(first, second, "each pass is shuffled anew");
}

#[test]
fn a_shard_rolls_out_the_rows_whose_index_modulo_its_count_is_its_index() {
    let case = Case::new("shard-rows");
    case.write_dataset(7);
    case.write_config(&settings("max_inflight = 8", "0ms"));
    let outcome = case.rollout(&["--shard", "1/3"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    let groups: Vec<u64> = groups_of(&outcome.rows).into_keys().collect();
    assert_eq!(groups, [1, 4], "shard 1/3 of 7 rows: rows 1 and 4");
    for row in &outcome.rows {
        let index = usize::try_from(row.group_id).expect("a small id");
        assert_eq!(
            row.prompt[0].content(),
            Some(question(index).0.as_str()),
            "group {} is the row of the same index",
            row.group_id
        );
    }
}

#[test]
fn a_shard_that_holds_no_row_is_refused_before_the_output_is_touched() {
    let case = Case::new("shard-empty");
    case.write_dataset(3);
    case.write_config(&settings("max_inflight = 8", "0ms"));
    for args in [&["--shard", "5/6"][..], &["--shard", "5/6", "--check"][..]] {
        let outcome = case.rollout(args);
        assert_ne!(outcome.code, Some(0), "{args:?}: {}", outcome.stderr);
        assert!(
            outcome
                .stderr
                .contains("shard 5/6 holds no row of a dataset of 3 rows"),
            "{args:?}: {}",
            outcome.stderr
        );
        assert!(!case.out().exists(), "{args:?}: nothing written");
    }
}

#[test]
fn out_dash_writes_the_rows_to_stdout_and_nothing_else() {
    let case = Case::new("stdout");
    case.write_dataset(3);
    case.write_config(&settings("max_inflight = 8", "0ms"));
    let output = command_out(&case, Path::new("-"), &[])
        .output()
        .expect("the binary runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("utf-8");
    let rows: Vec<TrainingSample> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(groups_of(&rows).len(), 3);
    assert!(!case.out().exists() || std::fs::read(case.out()).is_ok_and(|b| b.is_empty()));
}

#[test]
fn operating_settings_that_cannot_work_are_refused_with_where_they_came_from() {
    let case = Case::new("operate-settings");
    case.write_dataset(3);
    case.write_config(&settings("shard = \"2/2\"", "0ms"));
    let outcome = case.rollout(&["--check"]);
    assert_ne!(outcome.code, Some(0));
    assert!(
        outcome.stderr.contains("run.toml:") && outcome.stderr.contains("I/N"),
        "{}",
        outcome.stderr
    );
    case.write_config(&settings("shard = \"1/2\"\nepochs = 3", "0ms"));
    let outcome = case.rollout(&["--check"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    for (args, expected) in [
        (&["--resume", "--overwrite"][..], "--resume and --overwrite"),
        (&["--listen", "localhost:x"][..], "--listen"),
        (&["--epochs", "0"][..], "--epochs"),
        (&["--shard", "1/0"][..], "I/N"),
    ] {
        let outcome = case.rollout(args);
        assert_ne!(outcome.code, Some(0), "{args:?}");
        assert!(
            outcome.stderr.contains(expected),
            "{args:?}: {}",
            outcome.stderr
        );
    }
}

mod parquet_files {
    use std::{io::Cursor, sync::Arc};

    use arrow_schema::{DataType, Field, Fields, Schema};
    use parquet::{
        arrow::{ArrowWriter, arrow_reader::ParquetRecordBatchReaderBuilder},
        basic::{BrotliLevel, Compression, GzipLevel, ZstdLevel},
        file::properties::WriterProperties,
    };

    use super::*;
    use crate::rollout::dataset_line;

    /// The dataset as Hugging Face datasets saves one: `prompt` a list of `{content, role}`
    /// structs, `answer` a string, in two row groups. Returns each row's question.
    fn write_hf_dataset(path: &std::path::Path, rows: usize) -> Vec<String> {
        write_dataset_with(path, rows, Compression::SNAPPY)
    }

    /// [`write_hf_dataset`]'s file, its pages compressed with `codec`.
    fn write_dataset_with(path: &std::path::Path, rows: usize, codec: Compression) -> Vec<String> {
        let message = Fields::from(vec![
            Field::new("content", DataType::Utf8, true),
            Field::new("role", DataType::Utf8, true),
        ]);
        let list = DataType::List(Arc::new(Field::new_list_field(
            DataType::Struct(message),
            true,
        )));
        let schema = Arc::new(Schema::new(vec![
            Field::new("prompt", list, true),
            Field::new("answer", DataType::Utf8, true),
        ]));
        let mut questions = Vec::new();
        let lines: Vec<String> = (0..rows)
            .map(|i| {
                let row: Value = serde_json::from_str(&dataset_line(i)).expect("a row");
                let question = row["prompt"].as_str().expect("a text prompt").to_owned();
                questions.push(question.clone());
                serde_json::json!({
                    "prompt": [{"content": question, "role": "user"}],
                    "answer": row["answer"],
                })
                .to_string()
            })
            .collect();
        let file = std::fs::File::create(path).expect("create the dataset");
        let properties = WriterProperties::builder().set_compression(codec).build();
        let mut writer =
            ArrowWriter::try_new(file, Arc::clone(&schema), Some(properties)).expect("a writer");
        for chunk in lines.chunks(rows.div_ceil(2)) {
            let text = chunk.join("\n");
            let reader = arrow_json::ReaderBuilder::new(Arc::clone(&schema))
                .build(Cursor::new(text.into_bytes()))
                .expect("a JSON reader");
            for batch in reader {
                writer.write(&batch.expect("a batch")).expect("written");
            }
            writer.flush().expect("a row group");
        }
        writer.close().expect("closed");
        questions
    }

    /// The training rows of a Parquet output, through arrow's JSON writer.
    fn read_rows(path: &std::path::Path) -> Vec<TrainingSample> {
        let file = std::fs::File::open(path).expect("the output");
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .and_then(|b| b.build())
            .expect("a Parquet file");
        let mut rows = Vec::new();
        for batch in reader {
            let mut writer = arrow_json::LineDelimitedWriter::new(Vec::new());
            writer.write(&batch.expect("a batch")).expect("as JSON");
            writer.finish().expect("as JSON");
            for line in String::from_utf8(writer.into_inner())
                .expect("utf-8")
                .lines()
            {
                let mut row: serde_json::Map<String, Value> =
                    serde_json::from_str(line).expect("an object");
                for key in [
                    "prompt",
                    "completion",
                    "rewards",
                    "metrics",
                    "token_versions",
                ] {
                    let text = row[key].as_str().expect("JSON text").to_owned();
                    row.insert(key.to_owned(), serde_json::from_str(&text).expect("JSON"));
                }
                rows.push(serde_json::from_value(Value::Object(row)).expect("a training row"));
            }
        }
        rows
    }

    #[test]
    fn a_hugging_face_parquet_dataset_rolls_out_to_a_parquet_output_that_reads_back() {
        let case = Case::new("parquet");
        let dataset = case.dir.join("train.parquet");
        let questions = write_hf_dataset(&dataset, 7);
        case.write_config(&settings("max_inflight = 8", "0ms"));
        let out = case.dir.join("rows.parquet");
        let (code, stderr) = run_to_end(command_out(
            &case,
            &out,
            &["--dataset", dataset.to_str().expect("utf-8")],
        ));
        assert_eq!(code, Some(0), "{stderr}");
        let rows = read_rows(&out);
        let groups = groups_of(&rows);
        assert_eq!(
            groups.keys().copied().collect::<Vec<_>>(),
            (0..7).collect::<Vec<_>>()
        );
        for row in &rows {
            assert_eq!(
                row.prompt[0].content(),
                Some(questions[row.group_id as usize].as_str())
            );
            assert_eq!(row.input_ids.len(), row.completion_mask.len());
            assert_eq!(row.input_ids.len(), row.old_log_probs.len());
            assert!(row.completion_mask.contains(&1));
        }
        assert!(
            !crate::operate::journal(&out).exists(),
            "the journal is gone once written"
        );
    }

    #[test]
    fn parquet_datasets_read_whichever_codec_wrote_them() {
        // Snappy is what pyarrow and Hugging Face datasets write, zstd what Polars writes;
        // the rest are pyarrow's other choices.
        for (name, codec) in [
            ("none", Compression::UNCOMPRESSED),
            ("snappy", Compression::SNAPPY),
            ("zstd", Compression::ZSTD(ZstdLevel::default())),
            ("gzip", Compression::GZIP(GzipLevel::default())),
            ("brotli", Compression::BROTLI(BrotliLevel::default())),
            ("lz4", Compression::LZ4_RAW),
        ] {
            let case = Case::new(&format!("parquet-{name}"));
            let dataset = case.dir.join("train.parquet");
            write_dataset_with(&dataset, 5, codec);
            case.write_config(&settings("", "0ms"));
            let out = case.dir.join("rows.jsonl");
            let (code, stderr) = run_to_end(command_out(
                &case,
                &out,
                &["--dataset", dataset.to_str().expect("utf-8"), "--check"],
            ));
            assert_eq!(code, Some(0), "{name}: {stderr}");
            assert!(
                stderr.contains("5 dataset rows to roll out"),
                "{name}: {stderr}"
            );
        }
    }

    #[test]
    fn a_killed_parquet_run_resumes_from_its_journal() {
        let case = Case::new("parquet-resume");
        case.write_dataset(12);
        case.write_config(&settings("max_inflight = 4", "40ms"));
        let out = case.dir.join("rows.parquet");
        let mut child = command_out(&case, &out, &[])
            .stderr(Stdio::null())
            .spawn()
            .expect("the binary starts");
        let journal = crate::operate::journal(&out);
        while std::fs::metadata(&journal).map_or(0, |m| m.len()) == 0 {
            assert!(
                child.try_wait().expect("a status").is_none(),
                "killed before a group"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        assert!(!out.exists(), "a Parquet file is written only at the end");
        let (code, stderr) = run_to_end(command_out(&case, &out, &[]));
        assert_ne!(
            code,
            Some(0),
            "a journal left over is not overwritten silently"
        );
        assert!(stderr.contains("--resume"), "{stderr}");
        let (code, stderr) = run_to_end(command_out(&case, &out, &["--resume"]));
        assert_eq!(code, Some(0), "{stderr}");
        let groups = groups_of(&read_rows(&out));
        assert_eq!(
            groups.keys().copied().collect::<Vec<_>>(),
            (0..12).collect::<Vec<_>>()
        );
    }
}

/// The journal a Parquet output is written from.
fn journal(out: &std::path::Path) -> std::path::PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial.jsonl");
    std::path::PathBuf::from(name)
}
