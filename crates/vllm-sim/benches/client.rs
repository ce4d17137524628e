//! Client throughput against the simulator at zero latency: generate calls per second from
//! 256 concurrent callers, and process CPU time per call, with client and simulator sharing
//! one 2-worker runtime (the machine's 2 cores).
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-vllm-sim --bench client`).
//! Prints a markdown table and, when `BENCH_OUT` names a folder, writes `vllm-client.json`.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
use serde_json::{Value, json};
use test_support::cpu_seconds;
use vllm_client::{Client, ClientConfig, GenerateParams, RetryPolicy};

async fn run(callers: usize, duration: Duration) -> (f64, f64, u64) {
    let mut config = SimConfig::new(training_tokenizer());
    config.answer_tokens = 16;
    let sim = Simulator::start(config, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("sim");
    let client = Client::new(
        ClientConfig::new(sim.url())
            .model("sim")
            .retry(RetryPolicy::never()),
    )
    .expect("client");
    let params = GenerateParams {
        max_tokens: 32,
        ..GenerateParams::default()
    };
    let prompt: Vec<u32> = (1..=64).collect();

    // Warm up the connection pool, and check the answers are real.
    let check = client
        .generate(&prompt, &params)
        .await
        .expect("a completion");
    assert_eq!((check.token_ids.len(), check.logprobs.len()), (17, 17));

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..callers)
        .map(|_| {
            let (client, params, prompt) = (client.clone(), params.clone(), prompt.clone());
            let (stop, done, failed) = (Arc::clone(&stop), Arc::clone(&done), Arc::clone(&failed));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    match client.generate(&prompt, &params).await {
                        Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    let (started, cpu_started) = (Instant::now(), cpu_seconds());
    tokio::time::sleep(duration).await;
    let calls = done.load(Ordering::Relaxed);
    let (elapsed, cpu) = (started.elapsed().as_secs_f64(), cpu_seconds() - cpu_started);
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    sim.stop().await;
    (
        calls as f64 / elapsed,
        cpu / calls as f64 * 1e6,
        failed.load(Ordering::Relaxed),
    )
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (per_second, cpu_us, failed) = runtime.block_on(run(256, Duration::from_secs(5)));
    println!("| measure | value | target |");
    println!("|---|---:|---|");
    println!(
        "| generate calls/s, 256 concurrent, client + simulator on 2 cores | {per_second:.0} | >= 20000 |"
    );
    println!("| process CPU time per call (client + simulator) | {cpu_us:.1} us | - |");
    println!("| failed calls | {failed} | 0 |");
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let results: serde_json::Map<String, Value> = [
            (
                "generate calls/s, 256 concurrent".to_owned(),
                json!(per_second),
            ),
            (
                "CPU us per call (client + simulator)".to_owned(),
                json!(cpu_us),
            ),
            ("failed calls".to_owned(), json!(failed)),
        ]
        .into_iter()
        .collect();
        let path = std::path::Path::new(&out).join("vllm-client.json");
        std::fs::write(&path, serde_json::to_string_pretty(&results).expect("json"))
            .expect("writable");
        println!("wrote {}", path.display());
    }
}
