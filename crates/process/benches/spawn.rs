//! What the sandbox costs a program: a `python` tool call's interpreter and an agent's start,
//! each run plainly (no sandbox, no limits: the engine's process before the sandbox) and in
//! the default sandbox (bubblewrap, `prlimit`), one after another, the same number of times.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-process --bench spawn`). Prints a markdown
//! table and, when `BENCH_OUT` names a folder, writes `process.json` there. Figures are
//! recorded in BENCHMARKS.md with the machine and date.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::time::{Duration, Instant};

use async_grpo_process::{Program, Sandbox};
use serde_json::json;

const RUNS: usize = 60;

/// Milliseconds of each run of `program` fed `input`, sorted.
async fn measure(program: &Program, input: &[u8]) -> Vec<f64> {
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let started = Instant::now();
        let finished = program
            .run(input.to_vec(), Duration::from_secs(30), 4096)
            .await
            .expect("the program runs");
        assert!(finished.status.success(), "{finished:?}");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    times
}

fn at(sorted: &[f64], q: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let sandbox = Sandbox::default();
    sandbox.check().expect("the sandbox can be had here");
    let python = ["python3", "-I", "-"];
    let code = b"print(17 * 23)".as_slice();
    let agent = ["sh", "-c", "exit 0"];
    let cases = [
        (
            "python call",
            "plain",
            Program::new(python).sandbox(Sandbox::none()),
            code,
        ),
        (
            "python call",
            "sandboxed",
            Program::new(python).sandbox(sandbox.clone()),
            code,
        ),
        (
            "agent start",
            "plain",
            Program::new(agent).sandbox(Sandbox::none()),
            b"".as_slice(),
        ),
        (
            "agent start",
            "sandboxed",
            Program::new(agent).sandbox(sandbox.clone().network(true)),
            b"".as_slice(),
        ),
    ];
    println!("| program | run | p50 ms | p90 ms | mean ms |");
    println!("|---|---|---:|---:|---:|");
    let mut results = Vec::new();
    for (what, how, program, input) in &cases {
        // One run first, so that neither side pays for a cold page cache.
        let _ = program
            .run(input.to_vec(), Duration::from_secs(30), 4096)
            .await;
        let times = measure(program, input).await;
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let (p50, p90) = (at(&times, 0.5), at(&times, 0.9));
        println!("| {what} | {how} | {p50:.1} | {p90:.1} | {mean:.1} |");
        results.push(json!({"program": what, "run": how, "p50_ms": p50, "p90_ms": p90, "mean_ms": mean, "runs": RUNS}));
    }
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let path = std::path::Path::new(&out).join("process.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&results).expect("json"))
            .expect("the results are written");
    }
}
