//! Benchmarks of the tool dispatcher: added latency, saturated throughput, scheduler lag.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-tool-dispatch --bench dispatch`). Prints a
//! markdown table and, when `BENCH_OUT` names a folder, writes `tool-dispatch.json` there.
//! Figures are recorded in BENCHMARKS.md with the machine and date.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use async_grpo_tool_dispatch::{
    Arguments, DispatcherConfig, Registry, Tool, ToolCall, ToolDispatcher, ToolError, ToolSpec,
};
use hdrhistogram::Histogram;
use serde_json::{Value, json};

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

fn micros_at(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn noop_sync(_: Arguments) -> Result<Value, ToolError> {
    Ok(Value::Null)
}

fn dispatcher(config: DispatcherConfig) -> ToolDispatcher {
    let registry = Registry::new()
        .with(Tool::new_sync(
            ToolSpec::new("noop_sync", "Does nothing"),
            noop_sync,
        ))
        .and_then(|r| {
            r.with(Tool::new_async(
                ToolSpec::new("noop_async", "Does nothing"),
                |_: Arguments| async { Ok::<_, ToolError>(Value::Null) },
            ))
        })
        .and_then(|r| {
            r.with(Tool::new_sync(
                ToolSpec::new("block", "Blocks for 50 ms"),
                |_: Arguments| {
                    std::thread::sleep(Duration::from_millis(50));
                    Ok(Value::Null)
                },
            ))
        })
        .expect("valid tools");
    ToolDispatcher::new(registry, config)
}

/// Latency of single-call turns, one after another, through `ToolDispatcher::run`.
async fn latency(tool: &str, calls: usize) -> Histogram<u64> {
    let dispatcher = dispatcher(DispatcherConfig::new(4));
    let call = || vec![ToolCall::new(tool, json!({}))];
    for _ in 0..calls / 10 {
        let _ = dispatcher.run(call()).await;
    }
    let mut h = histogram();
    for _ in 0..calls {
        let started = Instant::now();
        let results = dispatcher.run(call()).await.expect("open");
        h.record(nanos(started.elapsed())).expect("in range");
        assert!(results[0].is_ok());
    }
    dispatcher.shutdown(Duration::from_secs(5)).await;
    h
}

/// Calls per second of no-op sync calls from 64 concurrent callers through an 8-thread pool.
async fn saturated_throughput(duration: Duration) -> f64 {
    let dispatcher = dispatcher(DispatcherConfig::new(8));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let callers: Vec<_> = (0..64)
        .map(|_| {
            let (dispatcher, stop, done) =
                (dispatcher.clone(), Arc::clone(&stop), Arc::clone(&done));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let _ = dispatcher
                        .run(vec![ToolCall::new("noop_sync", json!({}))])
                        .await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let calls = done.load(Ordering::Relaxed);
    for caller in callers {
        let _ = caller.await;
    }
    dispatcher.shutdown(Duration::from_secs(5)).await;
    calls as f64 / elapsed.as_secs_f64()
}

/// Scheduler lag while 64 sync tools block (50 ms each, in a loop) and 10,000 async no-op
/// calls run: a thread outside the runtime sends a timestamp every millisecond, and a task
/// on the runtime records how long each took to be received.
async fn scheduler_lag() -> (Histogram<u64>, Duration) {
    let dispatcher = dispatcher(DispatcherConfig::new(64));
    let stop = Arc::new(AtomicBool::new(false));

    let blockers: Vec<_> = (0..64)
        .map(|_| {
            let (dispatcher, stop) = (dispatcher.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let _ = dispatcher
                        .run(vec![ToolCall::new("block", json!({}))])
                        .await;
                }
            })
        })
        .collect();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let sender_stop = Arc::clone(&stop);
    let sender = std::thread::spawn(move || {
        while !sender_stop.load(Ordering::Relaxed) {
            if tx.send(Instant::now()).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    let probe = tokio::spawn(async move {
        let mut h = histogram();
        while let Some(sent) = rx.recv().await {
            h.record(nanos(sent.elapsed())).expect("in range");
        }
        h
    });

    // Let the blockers fill the pool, then run the async calls from 100 tasks.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let workers: Vec<_> = (0..100)
        .map(|_| {
            let dispatcher = dispatcher.clone();
            tokio::spawn(async move {
                for _ in 0..100 {
                    let _ = dispatcher
                        .run(vec![ToolCall::new("noop_async", json!({}))])
                        .await;
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.await;
    }
    let async_phase = started.elapsed();
    // Keep measuring a little longer under the blocking load alone.
    tokio::time::sleep(Duration::from_millis(500)).await;

    stop.store(true, Ordering::Relaxed);
    let _ = sender.join();
    let lag = probe.await.expect("the probe does not panic");
    for blocker in blockers {
        let _ = blocker.await;
    }
    dispatcher.shutdown(Duration::from_secs(5)).await;
    (lag, async_phase)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let sync = latency("noop_sync", 50_000).await;
        let asynchronous = latency("noop_async", 200_000).await;
        let throughput = saturated_throughput(Duration::from_secs(3)).await;
        let (lag, async_phase) = scheduler_lag().await;

        let rows = [
            (
                "no-op sync tool, added latency p50",
                micros_at(&sync, 0.5),
                "us",
                "<= 20",
            ),
            (
                "no-op sync tool, added latency p99",
                micros_at(&sync, 0.99),
                "us",
                "<= 200",
            ),
            (
                "no-op async tool, added latency p50",
                micros_at(&asynchronous, 0.5),
                "us",
                "<= 2",
            ),
            (
                "no-op async tool, added latency p99",
                micros_at(&asynchronous, 0.99),
                "us",
                "-",
            ),
            (
                "no-op sync calls/s, 64 callers, 8 threads",
                throughput,
                "calls/s",
                "-",
            ),
            (
                "scheduler lag p50, 64 blocking sync tools + 10k async calls",
                micros_at(&lag, 0.5),
                "us",
                "-",
            ),
            (
                "scheduler lag p99, 64 blocking sync tools + 10k async calls",
                micros_at(&lag, 0.99),
                "us",
                "< 1000",
            ),
            ("scheduler lag max", micros_at(&lag, 1.0), "us", "-"),
        ];
        println!("| measure | value | unit | target |");
        println!("|---|---:|---|---|");
        for (name, value, unit, target) in rows {
            println!("| {name} | {value:.1} | {unit} | {target} |");
        }
        println!(
            "(10k async calls took {async_phase:.1?} alongside the blocking tools; {} lag samples)",
            lag.len()
        );

        if let Some(out) = std::env::var_os("BENCH_OUT") {
            let results: serde_json::Map<String, Value> = rows
                .iter()
                .map(|(name, value, unit, _)| (format!("{name} ({unit})"), json!(value)))
                .collect();
            let path = std::path::Path::new(&out).join("tool-dispatch.json");
            let text = serde_json::to_string_pretty(&results).expect("serializable");
            std::fs::write(&path, text).expect("the results folder is writable");
            println!("wrote {}", path.display());
        }
    });
}
