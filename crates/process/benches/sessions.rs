//! What a `python` tool call costs with `session = "call"` (a new sandboxed interpreter per
//! call, the default) and in a warm session (`session = "rollout"`), for an empty statement:
//! p50 and p99 of the call's latency; then what idle sessions hold: 256 of them started
//! through the warm pool at once, their memory (PSS of every process of theirs) and the
//! machine's `MemAvailable` before and after.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-process --bench sessions`).
//! `SESSIONS` sets how many idle sessions (default 256), `PYTHON` the interpreter (default
//! `/usr/bin/python3` where it exists, else `python3` on PATH). Prints a markdown table and,
//! when `BENCH_OUT` names a folder, writes `sessions.json` there. Figures are recorded in
//! BENCHMARKS.md with the machine and date.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::time::{Duration, Instant};

use async_grpo_process::{InterpreterPool, InterpreterSpec, Program, Sandbox};
use serde_json::json;

const CALLS: usize = 200;

fn at(sorted: &[f64], q: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn sorted(mut times: Vec<f64>) -> Vec<f64> {
    times.sort_by(f64::total_cmp);
    times
}

/// KiB of `MemAvailable` now.
fn available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Processes whose command line holds `marker`, and the KiB of PSS they hold together.
fn pss_of(marker: &str) -> (usize, u64) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    let mut count = 0;
    let mut kib = 0;
    for entry in entries.flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(marker) {
            continue;
        }
        count += 1;
        let rollup = std::fs::read_to_string(entry.path().join("smaps_rollup")).unwrap_or_default();
        kib += rollup
            .lines()
            .find_map(|line| line.strip_prefix("Pss:"))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    (count, kib)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sandbox = Sandbox::default();
    sandbox.check().expect("the sandbox can be had here");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| {
        if std::path::Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3".to_owned()
        } else {
            "python3".to_owned()
        }
    });
    let support = async_grpo_process::cgroup_support();

    // A new sandboxed interpreter per call, as `session = "call"` runs one.
    let fresh = Program::new([python.as_str(), "-I", "-"]).sandbox(sandbox.clone());
    let mut per_call = Vec::with_capacity(CALLS / 4);
    for _ in 0..CALLS / 4 {
        let started = Instant::now();
        let finished = fresh
            .run(b"pass".to_vec(), Duration::from_secs(30), 4096)
            .await
            .expect("the interpreter runs");
        assert!(finished.status.success(), "{finished:?}");
        per_call.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let per_call = sorted(per_call);

    // A warm session: the first call takes an interpreter the pool started ahead.
    let pool = InterpreterPool::new(InterpreterSpec::new(&python, sandbox.clone()), 1, 2);
    while pool.stats().warm < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let mut session = pool.acquire().await.expect("a warm interpreter");
    let first = session.run("pass", 4096).await.expect("the cell runs");
    let first_ms = started.elapsed().as_secs_f64() * 1000.0;
    assert!(!first.raised);
    let mut warm = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let started = Instant::now();
        let cell = session.run("pass", 4096).await.expect("the cell runs");
        assert!(!cell.raised, "{cell:?}");
        warm.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let warm = sorted(warm);
    drop(session);
    drop(pool);

    // Idle sessions: started through a pool that keeps them all warm.
    let count: usize = std::env::var("SESSIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(256);
    let marker = format!("bench-idle-{}", std::process::id());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = available_kib();
    let started = Instant::now();
    let idle = InterpreterPool::new(
        InterpreterSpec::new(&python, sandbox.clone()).arg(&marker),
        count,
        count,
    );
    while idle.stats().warm < count {
        assert_eq!(idle.stats().start_failures, 0, "{:?}", idle.stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fill_s = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = available_kib();
    let (processes, pss_kib) = pss_of(&marker);
    drop(idle);

    let per_session_mib = pss_kib as f64 / 1024.0 / count as f64;
    let available_mib = before.saturating_sub(after) as f64 / 1024.0;
    println!("interpreter: {python}; cgroups: {support:?}\n");
    println!("| python call | p50 ms | p99 ms |");
    println!("|---|---:|---:|");
    println!(
        "| new sandboxed interpreter per call (`session = \"call\"`) | {:.1} | {:.1} |",
        at(&per_call, 0.5),
        at(&per_call, 0.99)
    );
    println!(
        "| warm session (`session = \"rollout\"`) | {:.2} | {:.2} |",
        at(&warm, 0.5),
        at(&warm, 0.99)
    );
    println!("\nfirst call of a session on a warm interpreter: {first_ms:.2} ms");
    println!(
        "\n{count} idle sessions: started in {fill_s:.1} s; {processes} processes, PSS {:.0} MiB \
         in all ({per_session_mib:.1} MiB a session); MemAvailable fell {available_mib:.0} MiB \
         ({:.1} MiB a session)",
        pss_kib as f64 / 1024.0,
        available_mib / count as f64
    );
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let results = json!({
            "python": python,
            "cgroups": format!("{support:?}"),
            "per_call": {"p50_ms": at(&per_call, 0.5), "p99_ms": at(&per_call, 0.99), "calls": per_call.len()},
            "warm_session": {"p50_ms": at(&warm, 0.5), "p99_ms": at(&warm, 0.99), "calls": warm.len(), "first_call_ms": first_ms},
            "idle": {"sessions": count, "fill_s": fill_s, "processes": processes, "pss_mib": pss_kib as f64 / 1024.0, "mem_available_drop_mib": available_mib},
        });
        let path = std::path::Path::new(&out).join("sessions.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&results).expect("json"))
            .expect("the results are written");
    }
}
