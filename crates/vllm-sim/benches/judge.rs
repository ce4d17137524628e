//! An LLM judge's throughput against the simulator as judge at zero latency: completions
//! judged per second through `Scorer::score` (groups of 8 from 16 concurrent callers, at most
//! 64 requests in flight), and the CPU each judged completion costs the engine's side (the
//! process's CPU less the simulator's threads').
//!
//! The engine's side runs on a 1-worker runtime and the simulator on another 1-worker
//! runtime, so that each has one of the machine's 2 cores.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-vllm-sim --bench judge`).
//! Prints a markdown table and, when `BENCH_OUT` names a folder, writes `judge.json`.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
use scoring::{
    Completion, Group, Scorer, ScorerConfig,
    builtin::{JudgeConfig, JudgeMode, ScoreFormat, ServiceConfig, judge},
};
use serde_json::{Map, Value, json};
use test_support::{cpu_seconds, threads_cpu_seconds};

const GROUP: usize = 8;
const CALLERS: usize = 16;

/// Group `i`: a question, its answer, and 8 completions of which the even ones are right.
fn group(i: usize) -> (Group, Vec<Option<f64>>) {
    let answer = (1000 + i).to_string();
    let completions = (0..GROUP)
        .map(|k| {
            let said = if k % 2 == 0 {
                answer.clone()
            } else {
                format!("{}", 7 * k)
            };
            Completion::from_text(format!(
                "Reasoning step {k} for group {i}. The answer is {said}."
            ))
        })
        .collect();
    let mut row = Map::new();
    row.insert("answer".to_owned(), Value::String(answer));
    let expected = (0..GROUP)
        .map(|k| Some(if k % 2 == 0 { 1.0 } else { 0.0 }))
        .collect();
    (
        Group::new(format!("What is {i} + 1000?"), completions, row),
        expected,
    )
}

struct Measured {
    mode: &'static str,
    completions_per_s: f64,
    requests_per_s: f64,
    engine_us_per_completion: f64,
    total_us_per_completion: f64,
}

fn measure(mode: JudgeMode, judge_url: &str, duration: Duration) -> Measured {
    let (template, score, name) = match mode {
        JudgeMode::Each => (
            "Q: {prompt}\n<answer>{answer}</answer>\n<completion>{completion}</completion>",
            ScoreFormat::Number,
            "each",
        ),
        JudgeMode::Group => (
            "Q: {prompt}\n<answer>{answer}</answer>\n{completions}",
            ScoreFormat::Json {
                field: "scores".to_owned(),
            },
            "group",
        ),
    };
    let format = if mode == JudgeMode::Each {
        "number"
    } else {
        "json"
    };
    let url = format!("{judge_url}/judge/{format}/v1/chat/completions");
    let reward = judge(
        ServiceConfig::new(url).concurrency(64).attempts(1),
        JudgeConfig::new("judge", template).mode(mode).score(score),
    )
    .expect("a judge");
    let engine = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("engine")
        .enable_all()
        .build()
        .expect("a runtime");
    engine.block_on(async move {
        let scorer =
            Scorer::new(vec![reward], ScorerConfig::default().threads(1)).expect("a scorer");
        // Check the scores are right before timing.
        for i in 0..4 {
            let (group, expected) = group(i);
            let scored = scorer.score(Arc::new(group)).await;
            assert_eq!(scored.columns[0].values, expected, "{name}: group {i}");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let groups = Arc::new(AtomicU64::new(0));
        let before = scorer.stats()[0]
            .1
            .calls
            .clone()
            .expect("a judge counts its calls");
        let (cpu, sim_cpu, start) = (cpu_seconds(), threads_cpu_seconds("sim"), Instant::now());
        let callers: Vec<_> = (0..CALLERS)
            .map(|c| {
                let (scorer, stop, groups) =
                    (scorer.clone(), Arc::clone(&stop), Arc::clone(&groups));
                tokio::spawn(async move {
                    let mut i = c;
                    while !stop.load(Ordering::Relaxed) {
                        let (group, _) = group(i);
                        let scored = scorer.score(Arc::new(group)).await;
                        assert!(
                            scored.columns[0].failure.is_none(),
                            "{:?}",
                            scored.columns[0]
                        );
                        groups.fetch_add(1, Ordering::Relaxed);
                        i += CALLERS;
                    }
                })
            })
            .collect();
        tokio::time::sleep(duration).await;
        stop.store(true, Ordering::Relaxed);
        for caller in callers {
            caller.await.expect("a caller");
        }
        let elapsed = start.elapsed().as_secs_f64();
        let total = cpu_seconds() - cpu;
        let engine_cpu = total - (threads_cpu_seconds("sim") - sim_cpu);
        let after = scorer.stats()[0]
            .1
            .calls
            .clone()
            .expect("a judge counts its calls");
        let completions = groups.load(Ordering::Relaxed) as f64 * GROUP as f64;
        assert_eq!(after.failed(), before.failed(), "{name}: no call failed");
        Measured {
            mode: name,
            completions_per_s: completions / elapsed,
            requests_per_s: (after.calls - before.calls) as f64 / elapsed,
            engine_us_per_completion: engine_cpu / completions * 1e6,
            total_us_per_completion: total / completions * 1e6,
        }
    })
}

fn main() {
    let simulator = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("sim")
        .enable_all()
        .build()
        .expect("a runtime");
    let sim = simulator
        .block_on(Simulator::start(
            SimConfig::new(training_tokenizer()),
            "127.0.0.1:0".parse().expect("an address"),
        ))
        .expect("the simulator");
    let duration = Duration::from_secs(3);
    let results = [
        measure(JudgeMode::Each, &sim.url(), duration),
        measure(JudgeMode::Group, &sim.url(), duration),
    ];
    println!(
        "| mode | completions judged/s | requests/s | engine CPU per completion | process CPU per completion |"
    );
    println!("|---|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {:.0} | {:.0} | {:.1} us | {:.1} us |",
            r.mode,
            r.completions_per_s,
            r.requests_per_s,
            r.engine_us_per_completion,
            r.total_us_per_completion
        );
    }
    if let Some(dir) = std::env::var_os("BENCH_OUT") {
        let report: Vec<Value> = results
            .iter()
            .map(|r| {
                json!({
                    "mode": r.mode,
                    "completions_per_s": r.completions_per_s,
                    "requests_per_s": r.requests_per_s,
                    "engine_us_per_completion": r.engine_us_per_completion,
                    "total_us_per_completion": r.total_us_per_completion,
                })
            })
            .collect();
        let path = std::path::Path::new(&dir).join("judge.json");
        std::fs::write(&path, serde_json::to_string_pretty(&report).expect("JSON"))
            .expect("write the report");
    }
    drop(sim);
}
