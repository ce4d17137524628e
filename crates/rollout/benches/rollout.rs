//! The rollout loop against the vLLM simulator over real HTTP.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-rollout --bench rollout`). Each
//! scenario runs in a process of its own (this program started again with
//! `ROLLOUT_BENCH_ONLY=NAME`), so that its memory figure starts from a clean heap; the
//! simulator (`vllm_sim`: scripted answers, not a model) runs in a further child
//! process, so that the CPU time and resident memory measured are the engine's alone (loop,
//! HTTP client, tools and scoring, on a 2-worker runtime). Both processes share the
//! machine's 2 cores. Scenarios:
//!
//! - `zero`: zero latency, one calculator round per rollout: turns/s and CPU per turn;
//! - `1024`, `4096`: 200 ms per request with that many rollouts in flight: achieved turns/s
//!   against the ideal `in_flight / 200 ms`, resident memory per in-flight rollout, and the
//!   time a drain takes with every rollout mid-request;
//! - `4096-loop`: the same 4096 rollouts against an in-process generator that sleeps 200 ms
//!   and answers fixed ids: the loop's own capacity, without HTTP or a simulator;
//! - `blocking`: 64 rollouts whose sync tool blocks its thread for 500 ms: the heartbeat's
//!   p99 lag.
//! - `tool-results`: 1024 rollouts in flight at 200 ms per request, two tool rounds each,
//!   every tool result about 2 KB of text, with Qwen3's real tokenizer and chat template
//!   (from `cargo xtask fixtures`; the scenario is skipped without them): the scheduler lag
//!   while every later turn's prompt is built from a long tool result.
//!
//! Prints a markdown table and, when `BENCH_OUT` names a folder, writes
//! `rollout-loop.json` there.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    io::{BufRead, BufReader, Read},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use async_grpo_rollout::{
    DatasetError, DatasetRow, Engine, Finish, GenerateError, GenerateRequest, Generation,
    Generator, RolloutConfig,
};
use rollout_core::{ChatTemplate, ChatTokenizer, Message};
use scoring::{Scorer, ScorerConfig, builtin};
use serde_json::{Map, Value, json};
use test_support::cpu_seconds;
use tool_dispatch::{DispatcherConfig, Registry, Tool, ToolDispatcher, ToolSpec};
use vllm_client::{Client, ClientConfig};
use vllm_sim::{SimConfig, SimRouting, Simulator, training_tokenizer};

const TEMPLATE: &str = "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}\
{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
{%- for call in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

const SCENARIOS: [&str; 8] = [
    "zero",
    "1024",
    "1024-two-turns",
    "1024-routing",
    "4096",
    "4096-loop",
    "blocking",
    "tool-results",
];

/// Where `cargo xtask fixtures` puts Qwen3's tokenizer and chat template.
fn qwen3_dir() -> std::path::PathBuf {
    test_support::cache_dir().join("qwen3")
}

/// This process's resident memory.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|pages| pages.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
}

fn rows() -> impl Iterator<Item = Result<DatasetRow, DatasetError>> + Send + 'static {
    (0..).map(|i: usize| {
        let (a, b) = (i % 97 + 2, i % 89 + 3);
        let columns: Map<String, Value> = json!({ "answer": (a * b).to_string() })
            .as_object()
            .cloned()
            .unwrap_or_default();
        Ok(DatasetRow {
            source: "rows.jsonl".into(),
            line: i + 1,
            prompt: vec![Message::user(format!("What is {a} * {b}?"))],
            columns,
        })
    })
}

/// The training tokenizer with a ChatML template, or Qwen3's own (`real`).
fn tokenizer(real: bool) -> ChatTokenizer {
    if real {
        return ChatTokenizer::from_dir(qwen3_dir()).expect("Qwen3's tokenizer and template");
    }
    let template = ChatTemplate::new("chatml-tools", TEMPLATE).expect("the template compiles");
    let specials = json!({ "eos_token": "<|im_end|>" })
        .as_object()
        .cloned()
        .unwrap_or_default();
    ChatTokenizer::new(training_tokenizer(), template, specials)
}

/// The calculator; its result is padded to about `result_bytes` of text, as a tool that
/// prints a log or a file would answer.
fn tools(block: Option<Duration>, result_bytes: usize, threads: usize) -> ToolDispatcher {
    let spec = ToolSpec::new("calculator", "Evaluate arithmetic").parameters(
        json!({ "type": "object", "properties": { "expression": { "type": "string" } } }),
    );
    let tool = Tool::new_sync(spec, move |args| {
        if let Some(block) = block {
            std::thread::sleep(block);
        }
        let expression = args
            .get("expression")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let value = tool_dispatch::builtin::evaluate(expression)?;
        if result_bytes == 0 {
            return Ok(json!(value));
        }
        let mut text = String::with_capacity(result_bytes + 100);
        for line in 1.. {
            if text.len() >= result_bytes {
                break;
            }
            text.push_str(&format!(
                "step {line}: evaluated the expression '{expression}' and checked it, status ok\n"
            ));
        }
        text.push_str(&format!("result: {value}"));
        Ok(json!(text))
    });
    let registry = Registry::new().with(tool).expect("one tool");
    ToolDispatcher::new(registry, DispatcherConfig::new(threads))
}

struct Scenario {
    in_flight: usize,
    latency: Duration,
    tool_rounds: usize,
    tool_block: Option<Duration>,
    /// Bytes of text in each tool result (0: the bare number).
    result_bytes: usize,
    /// Qwen3's tokenizer and template, for the engine and the simulator.
    real_tokenizer: bool,
    /// Routing replay: the simulator plays a MoE model of [`ROUTER`], the engine keeps it.
    routing: bool,
    warmup: Duration,
    measure: Duration,
}

impl Scenario {
    fn named(name: &str) -> Scenario {
        let (in_flight, latency, tool_rounds, tool_block) = match name {
            "zero" => (256, Duration::ZERO, 1, None),
            "1024" => (1024, Duration::from_millis(200), 0, None),
            // Two turns (a tool round): each rollout holds its first turn's routing while its
            // second is on the wire.
            "1024-two-turns" | "1024-routing" => (1024, Duration::from_millis(200), 1, None),
            "4096" | "4096-loop" => (4096, Duration::from_millis(200), 0, None),
            "tool-results" => (1024, Duration::from_millis(200), 2, None),
            _ => (64, Duration::ZERO, 3, Some(Duration::from_millis(500))),
        };
        let real = name == "tool-results";
        Scenario {
            in_flight,
            latency,
            tool_rounds,
            tool_block,
            result_bytes: if real { 2048 } else { 0 },
            real_tokenizer: real,
            routing: name == "1024-routing",
            warmup: Duration::from_secs(2),
            measure: Duration::from_secs(6),
        }
    }
}

struct Measured {
    turns_per_second: f64,
    cpu_ms_per_turn: f64,
    resident_per_rollout: f64,
    tokens_per_sample: f64,
    lag_p99: Duration,
    probe_p99: Duration,
    probe_samples: usize,
    drain: Duration,
    drain_clean: bool,
    failed: u64,
}

/// The simulator, in a child process: this program with `ROLLOUT_BENCH_SIMULATOR` set.
struct SimulatorProcess {
    child: std::process::Child,
    url: String,
}

impl SimulatorProcess {
    fn start(scenario: &Scenario) -> SimulatorProcess {
        let mut child = Command::new(std::env::current_exe().expect("this program"))
            .env(
                "ROLLOUT_BENCH_SIMULATOR",
                format!(
                    "{},{},{},{}",
                    scenario.latency.as_millis(),
                    scenario.tool_rounds,
                    u8::from(scenario.real_tokenizer),
                    u8::from(scenario.routing)
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the simulator process starts");
        let stdout = child.stdout.take().expect("piped");
        let mut url = String::new();
        BufReader::new(stdout)
            .read_line(&mut url)
            .expect("the simulator says its address");
        SimulatorProcess {
            child,
            url: url.trim().to_owned(),
        }
    }
}

impl Drop for SimulatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The router of the `1024-routing` scenario: Qwen3-30B-A3B's shape (48 MoE layers, top 8 of
/// 128 experts), so each token's routing is 384 bytes.
const ROUTER: SimRouting = SimRouting {
    layers: 48,
    top_k: 8,
    experts: 128,
};

/// The child side: serve until the parent closes stdin.
fn serve_simulator(spec: &str) {
    let mut parts = spec.split(',').map(|p| p.parse::<u64>().unwrap_or(0));
    let latency = Duration::from_millis(parts.next().unwrap_or(0));
    let tool_rounds = parts.next().unwrap_or(0) as usize;
    let real = parts.next() == Some(1);
    let routing = parts.next() == Some(1);
    let tokenizer = if real {
        tokenizers::Tokenizer::from_file(qwen3_dir().join("tokenizer.json"))
            .expect("Qwen3's tokenizer")
    } else {
        training_tokenizer()
    };
    let mut config = SimConfig::new(tokenizer);
    config.latency = latency;
    config.tool_rounds = tool_rounds;
    config.answer_tokens = 16;
    config.routed_experts = routing.then_some(ROUTER);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let sim = Simulator::start(config, "127.0.0.1:0".parse().expect("an address"))
            .await
            .expect("the simulator starts");
        println!("{}", sim.url());
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await;
        sim.stop().await;
    });
}

/// A generator without HTTP, for the loop's own capacity: every turn waits `latency`, then
/// answers the same ids (an answer and EOS) with made-up logprobs.
struct SleepingGenerator {
    latency: Duration,
    answer: Vec<u32>,
}

impl SleepingGenerator {
    fn new(latency: Duration) -> SleepingGenerator {
        let tokenizer = tokenizer(false);
        let mut answer = tokenizer
            .encode("The answer is 42. the model thinks about numbers and tools")
            .expect("encodes");
        answer.extend(tokenizer.eos_token_id());
        SleepingGenerator { latency, answer }
    }
}

impl Generator for SleepingGenerator {
    async fn generate(&self, request: GenerateRequest<'_>) -> Result<Generation, GenerateError> {
        tokio::time::sleep(self.latency).await;
        let n = self.answer.len().min(request.max_tokens as usize);
        Ok(Generation {
            token_ids: self.answer[..n].to_vec(),
            logprobs: vec![-0.5; n],
            finish: if n == self.answer.len() {
                Finish::Stop
            } else {
                Finish::Length
            },
            routed_experts: None,
        })
    }

    fn max_model_len(&self) -> Option<u32> {
        Some(4096)
    }
}

/// The client of the simulator at `url`, once it answers.
async fn client(url: String) -> Client {
    let client = Client::new(ClientConfig::new(url)).expect("a client");
    client
        .wait_until_ready(Duration::from_secs(10))
        .await
        .expect("the simulator is ready");
    client
}

async fn run<G: Generator>(scenario: &Scenario, generator: G) -> Measured {
    let scorer = Scorer::new(
        vec![builtin::from_spec("numeric:answer").expect("a spec")],
        ScorerConfig::default(),
    )
    .expect("a scorer");
    let mut config = RolloutConfig::default();
    config.num_generations = 8;
    config.max_inflight = scenario.in_flight;
    config.max_turns = 4;
    config.max_tokens = 64;
    config.output_buffer = 1024;
    config.routed_experts = scenario.routing;
    let resident_before = resident_bytes();
    let (engine, mut groups) =
        Engine::builder(generator, tokenizer(scenario.real_tokenizer), scorer)
            .tools(tools(
                scenario.tool_block,
                scenario.result_bytes,
                scenario.in_flight.min(256),
            ))
            .config(config)
            .start(rows())
            .expect("the loop starts");
    // A consumer that keeps up, as a trainer's reader would.
    let consumer = tokio::spawn(async move {
        let (mut samples, mut tokens) = (0u64, 0u64);
        while let Some(group) = groups.recv().await {
            samples += group.samples.len() as u64;
            tokens += group
                .samples
                .iter()
                .map(|s| s.input_ids.len() as u64)
                .sum::<u64>();
        }
        (samples, tokens)
    });
    tokio::time::sleep(scenario.warmup).await;
    // The scheduler-lag probe: a thread outside the runtime sends a timestamp every
    // millisecond; a task on the runtime records how late each arrives.
    // Only where it is reported: its thousand wake-ups a second are not free.
    let probing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        scenario.tool_block.is_some() || scenario.result_bytes > 0,
    ));
    let (stamps, mut received) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let sender = {
        let probing = std::sync::Arc::clone(&probing);
        std::thread::spawn(move || {
            while probing.load(std::sync::atomic::Ordering::Relaxed) {
                if stamps.send(Instant::now()).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let probe = tokio::spawn(async move {
        let mut lags = Vec::new();
        while let Some(sent) = received.recv().await {
            lags.push(sent.elapsed());
        }
        lags
    });
    let (turns_before, cpu_before, started) =
        (engine.health().stats.turns, cpu_seconds(), Instant::now());
    let mut per_rollout = Vec::new();
    while started.elapsed() < scenario.measure {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let in_flight = engine.health().in_flight.max(1) as f64;
        per_rollout.push(resident_bytes().saturating_sub(resident_before) as f64 / in_flight);
    }
    let health = engine.health();
    let elapsed = started.elapsed().as_secs_f64();
    probing.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || sender.join()).await;
    let mut lags = probe.await.unwrap_or_default();
    lags.sort();
    let probe_p99 = lags
        .get(lags.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default();
    let turns = (health.stats.turns - turns_before) as f64;
    let cpu = cpu_seconds() - cpu_before;
    let report = engine.shutdown(Duration::from_secs(30)).await;
    let (samples, tokens) = consumer.await.unwrap_or((0, 0));
    per_rollout.sort_by(f64::total_cmp);
    Measured {
        turns_per_second: turns / elapsed,
        cpu_ms_per_turn: cpu / turns.max(1.0) * 1e3,
        resident_per_rollout: per_rollout.last().copied().unwrap_or(0.0),
        tokens_per_sample: tokens as f64 / samples.max(1) as f64,
        lag_p99: health.scheduler_lag_p99,
        probe_p99,
        probe_samples: lags.len(),
        drain: report.elapsed,
        drain_clean: report.clean,
        failed: report.stats.rollouts_failed,
    }
}

/// Runs one scenario in this process; prints its table rows and returns its results.
fn scenario(name: &str) -> Map<String, Value> {
    let scenario = Scenario::named(name);
    if scenario.real_tokenizer && !qwen3_dir().join("tokenizer.json").is_file() {
        println!(
            "| {name} | skipped: no Qwen3 tokenizer in {} (`cargo xtask fixtures`) | - |",
            qwen3_dir().display()
        );
        return Map::new();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let measured = if name == "4096-loop" {
        runtime.block_on(run(&scenario, SleepingGenerator::new(scenario.latency)))
    } else {
        let simulator = SimulatorProcess::start(&scenario);
        runtime.block_on(async { run(&scenario, client(simulator.url.clone()).await).await })
    };
    let in_flight = scenario.in_flight;
    let mut report = Report::new(&measured);
    match name {
        "zero" => {
            report.row(
                format!("turns/s, zero latency, {in_flight} in flight, 1 tool round"),
                format!("{:.0}", measured.turns_per_second),
                "-",
                json!(measured.turns_per_second),
            );
            report.cpu("engine CPU ms per turn, zero latency (loop, HTTP client, tool, scoring)");
        }
        "4096-loop" => {
            report.achieved(
                format!(
                    "loop alone (in-process generator sleeping 200 ms, no HTTP), {in_flight} in flight: achieved / ideal turns/s"
                ),
                &scenario,
                ">= 95%",
            );
            report.cpu("loop alone: engine CPU ms per turn");
            report.memory(
                format!("loop alone: resident memory per in-flight rollout, {in_flight} in flight"),
                "<= 10 KiB",
            );
        }
        "tool-results" => {
            report.achieved(
                format!(
                    "tool results of ~2 KB, Qwen3 tokenizer, {in_flight} in flight, 200 ms latency: achieved / ideal turns/s"
                ),
                &scenario,
                "-",
            );
            report.cpu("tool results of ~2 KB: engine CPU ms per turn");
            report.lags(
                "tool results of ~2 KB: scheduler lag p99 (1 ms probe)",
                "tool results of ~2 KB: the engine's heartbeat lag p99",
            );
        }
        "1024-two-turns" | "1024-routing" => {
            let what = if name == "1024-routing" {
                "two turns, routing replay (48 layers, top 8 of 128)"
            } else {
                "two turns, no routing"
            };
            report.achieved(
                format!("{what}, 200 ms latency, {in_flight} in flight: achieved / ideal turns/s"),
                &scenario,
                "-",
            );
            report.cpu(&format!("{what}: engine CPU ms per turn"));
            report.memory(
                format!(
                    "{what}: engine resident memory per in-flight rollout, {in_flight} in flight"
                ),
                "-",
            );
        }
        "blocking" => report.lags(
            "scheduler lag p99 while 64 sync tools block for 500 ms each (1 ms probe)",
            "the engine's heartbeat lag p99 (100 ms sleeps, 1 ms timer)",
        ),
        _ => {
            report.achieved(
                format!("achieved / ideal turns/s, 200 ms latency, {in_flight} in flight"),
                &scenario,
                ">= 95%",
            );
            report.cpu(&format!("engine CPU ms per turn, {in_flight} in flight"));
            report.memory(
                format!("engine resident memory per in-flight rollout, {in_flight} in flight"),
                if in_flight == 1024 { "<= 56 KiB" } else { "-" },
            );
            report.row(
                format!("drain time, {in_flight} rollouts mid-request"),
                format!(
                    "{:.0} ms ({})",
                    measured.drain.as_secs_f64() * 1e3,
                    if measured.drain_clean {
                        "clean"
                    } else {
                        "not clean"
                    }
                ),
                "-",
                json!(measured.drain.as_secs_f64()),
            );
            report.row(
                format!("failed rollouts, {in_flight} in flight"),
                measured.failed.to_string(),
                "0",
                json!(measured.failed),
            );
        }
    }
    report.results
}

/// A scenario's table rows, printed as they come and kept by name for `BENCH_OUT`.
struct Report<'m> {
    measured: &'m Measured,
    results: Map<String, Value>,
}

impl<'m> Report<'m> {
    fn new(measured: &'m Measured) -> Report<'m> {
        Report {
            measured,
            results: Map::new(),
        }
    }

    fn row(&mut self, measure: String, value: String, target: &str, raw: Value) {
        println!("| {measure} | {value} | {target} |");
        self.results.insert(measure, raw);
    }

    /// Turns/s against the ideal `in_flight / latency`, in percent.
    fn achieved(&mut self, measure: String, scenario: &Scenario, target: &str) {
        let ideal = scenario.in_flight as f64 / scenario.latency.as_secs_f64();
        let turns = self.measured.turns_per_second;
        let achieved = turns / ideal * 100.0;
        self.row(
            measure,
            format!("{achieved:.1}% ({turns:.0} of {ideal:.0})"),
            target,
            json!(achieved),
        );
    }

    fn cpu(&mut self, measure: &str) {
        let cpu = self.measured.cpu_ms_per_turn;
        self.row(measure.into(), format!("{cpu:.3}"), "-", json!(cpu));
    }

    fn memory(&mut self, measure: String, target: &str) {
        let (bytes, tokens) = (
            self.measured.resident_per_rollout,
            self.measured.tokens_per_sample,
        );
        self.row(
            measure,
            format!("{:.1} KiB (samples of ~{tokens:.0} tokens)", bytes / 1024.0),
            target,
            json!(bytes),
        );
    }

    /// The 1 ms probe's lag p99 and the heartbeat's.
    fn lags(&mut self, probe: &str, heartbeat: &str) {
        let (probe_ms, samples, heartbeat_ms) = (
            self.measured.probe_p99.as_secs_f64() * 1e3,
            self.measured.probe_samples,
            self.measured.lag_p99.as_secs_f64() * 1e3,
        );
        self.row(
            probe.into(),
            format!("{probe_ms:.3} ms ({samples} samples)"),
            "< 2 ms",
            json!(probe_ms),
        );
        self.row(
            heartbeat.into(),
            format!("{heartbeat_ms:.2} ms"),
            "-",
            json!(heartbeat_ms),
        );
    }
}

fn main() {
    if let Ok(spec) = std::env::var("ROLLOUT_BENCH_SIMULATOR") {
        serve_simulator(&spec);
        return;
    }
    if let Ok(name) = std::env::var("ROLLOUT_BENCH_ONLY") {
        let results = scenario(&name);
        if let Ok(path) = std::env::var("ROLLOUT_BENCH_RESULTS") {
            std::fs::write(path, serde_json::to_string(&results).expect("json")).expect("writable");
        }
        return;
    }
    println!("| measure | value | target |");
    println!("|---|---:|---|");
    let mut results = Map::new();
    for name in SCENARIOS {
        let path =
            std::env::temp_dir().join(format!("rollout-bench-{}-{name}.json", std::process::id()));
        let status = Command::new(std::env::current_exe().expect("this program"))
            .env("ROLLOUT_BENCH_ONLY", name)
            .env("ROLLOUT_BENCH_RESULTS", &path)
            .status()
            .expect("the scenario runs");
        assert!(status.success(), "scenario {name} failed: {status}");
        let text = std::fs::read_to_string(&path).expect("the scenario's results");
        let _ = std::fs::remove_file(&path);
        if let Ok(Value::Object(map)) = serde_json::from_str(&text) {
            results.extend(map);
        }
    }
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let path = std::path::Path::new(&out).join("rollout-loop.json");
        std::fs::write(&path, serde_json::to_string_pretty(&results).expect("json"))
            .expect("writable");
        println!("wrote {}", path.display());
    }
}
