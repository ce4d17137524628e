//! Scoring throughput: the advantage math alone, and whole groups through the scorer.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-scoring --bench scoring`). Prints a
//! markdown table and, when `BENCH_OUT` names a folder, writes `scoring.json` there.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]

use std::{
    hint::black_box,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use async_grpo_scoring::{
    AdvantageConfig, Completion, CompletionReward, Group, Scorer, ScorerConfig, builtin,
    group_advantages,
};
use serde_json::{Value, json};

const GROUP: usize = 16;

/// Combines two reward columns and computes the group's advantages, for as many groups as
/// fit in `duration`; returns groups per second.
fn math_alone(duration: Duration) -> f64 {
    let config = AdvantageConfig::default();
    // Two columns of 16 scores each, varied per group so nothing is constant-folded.
    let columns: Vec<[Vec<Option<f64>>; 2]> = (0..1024)
        .map(|g| {
            let exact = (0..GROUP)
                .map(|i| Some(((g + i) % 3 == 0) as u8 as f64))
                .collect();
            let length = (0..GROUP)
                .map(|i| Some(-(((g * 7 + i) % 10) as f64) / 10.0))
                .collect();
            [exact, length]
        })
        .collect();
    let started = Instant::now();
    let mut groups = 0u64;
    let mut completions = Vec::with_capacity(GROUP);
    while started.elapsed() < duration {
        for [exact, length] in &columns {
            completions.clear();
            completions.extend(exact.iter().zip(length).map(|(a, b)| {
                let reward = match (a, b) {
                    (None, None) => None,
                    _ => Some(a.unwrap_or(0.0) + 0.5 * b.unwrap_or(0.0)),
                };
                CompletionReward {
                    reward,
                    has_training_row: true,
                }
            }));
            black_box(group_advantages(black_box(&completions), &config));
        }
        groups += columns.len() as u64;
    }
    groups as f64 / started.elapsed().as_secs_f64()
}

/// Whole groups of 16 through `Scorer::score` with two built-in rewards (exact match and the
/// length penalty, both sync, on the scorer's pool), from 64 concurrent callers.
async fn scorer_throughput(duration: Duration) -> f64 {
    let scorer = Scorer::new(
        vec![
            builtin::from_spec("exact:answer").expect("valid"),
            builtin::from_spec("length:512:128@0.5").expect("valid"),
        ],
        ScorerConfig::default(),
    )
    .expect("valid");
    let row = json!({ "answer": "42" })
        .as_object()
        .cloned()
        .unwrap_or_default();
    let group = Arc::new(Group::new(
        Value::String("What is 6 * 7?".into()),
        (0..GROUP)
            .map(|i| {
                Completion::from_text(if i % 2 == 0 { "42" } else { "41" })
                    .with_token_ids(vec![1; 100 + i * 30])
            })
            .collect(),
        row,
    ));
    // The work is real: even completions match and are short (reward 1), odd ones do not
    // (0); the last ones run past 384 tokens into the length penalty.
    let check = scorer.score(Arc::clone(&group)).await;
    assert_eq!(check.rewards[..2], [Some(1.0), Some(0.0)]);
    assert!(
        check.columns[1].values[15].is_some_and(|p| p < 0.0),
        "{:?}",
        check.columns[1].values
    );
    assert!(check.columns.iter().all(|c| c.failure.is_none()));

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let callers: Vec<_> = (0..64)
        .map(|_| {
            let (scorer, group, stop, done) = (
                scorer.clone(),
                Arc::clone(&group),
                Arc::clone(&stop),
                Arc::clone(&done),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    black_box(scorer.score(Arc::clone(&group)).await);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let groups = done.load(Ordering::Relaxed);
    for caller in callers {
        let _ = caller.await;
    }
    groups as f64 / elapsed.as_secs_f64()
}

fn main() {
    let math = math_alone(Duration::from_secs(2));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let scored = runtime.block_on(scorer_throughput(Duration::from_secs(3)));

    let rows = [
        (
            "advantage math alone, groups of 16 (combine 2 columns + trl advantages)",
            math,
            ">= 50000",
        ),
        (
            "Scorer::score, groups of 16, exact + length on the pool, 64 callers",
            scored,
            "-",
        ),
    ];
    println!("| measure | groups/s | target |");
    println!("|---|---:|---|");
    for (name, value, target) in rows {
        println!("| {name} | {value:.0} | {target} |");
    }
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let results: serde_json::Map<String, Value> = rows
            .iter()
            .map(|(name, value, _)| (format!("{name} (groups/s)"), json!(value)))
            .collect();
        let path = std::path::Path::new(&out).join("scoring.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&results).expect("serializable"),
        )
        .expect("the results folder is writable");
        println!("wrote {}", path.display());
    }
}
