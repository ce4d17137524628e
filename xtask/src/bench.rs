//! `cargo xtask bench`: runs the benchmarks; each writes its results under `target/bench/`.
//! `cargo xtask bench listen` runs only the control endpoint's cost (see [`listen`]);
//! `cargo xtask bench trl [ARGS]` the bridge and the binary against TRL's worker
//! (`crate::bridge::bench`, ARGS to its script).

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::{cargo, root, run_checked};

pub(crate) fn run(only: Option<&str>) -> anyhow::Result<()> {
    match only {
        Some("listen") => return listen(),
        Some("trl") => return crate::bridge::bench(),
        _ => {}
    }
    let out = root().join("target").join("bench");
    std::fs::create_dir_all(&out)?;
    let benches = [
        ("async-grpo-tool-dispatch", "dispatch", ""),
        ("async-grpo-scoring", "scoring", ""),
        ("async-grpo-vllm-sim", "client", ""),
        ("async-grpo-vllm-sim", "judge", ""),
        ("async-grpo-rollout-core", "turns", ""),
        ("async-grpo-rollout", "rollout", ""),
        ("async-grpo-harness", "sessions", ""),
        ("async-grpo-harness", "proxy", ""),
        ("async-grpo-process", "spawn", ""),
        ("async-grpo-process", "sessions", ""),
        ("async-grpo-cli", "rows", ""),
    ];
    for (package, bench, features) in benches {
        if bench == "turns" {
            // The turn benchmark runs on the real Qwen3 tokenizer (and the session benchmark
            // on the MCP venv, which this installs too).
            crate::fixtures::run()?;
        }
        run_checked(
            cargo(&[
                "bench",
                "--package",
                package,
                "--bench",
                bench,
                "--features",
                features,
            ])
            .env("BENCH_OUT", &out),
        )?;
    }
    listen()?;
    eprintln!("bench: results in {}", out.display());
    Ok(())
}

/// Groups each measured run rolls out.
const LISTEN_GROUPS: &str = "1500";
/// Runs of each kind, alternated.
const LISTEN_RUNS: usize = 3;

/// The cost of the control endpoint and its metrics: the release binary rolls out the
/// quickstart against its built-in simulator (zero latency, so the engine's CPU is what
/// limits it) without `--listen`, then with it and a scraper fetching `/metrics` every
/// 100 ms (Prometheus's default is 15 s: a pessimistic load), alternately. Reports turns/s
/// and the process's CPU (user + system, simulator included) per turn.
fn listen() -> anyhow::Result<()> {
    run_checked(&mut cargo(&["build", "--release", "-p", "async-grpo-cli"]))?;
    let binary = root().join("target/release/async-grpo");
    let mut lines = Vec::new();
    for run in 0..LISTEN_RUNS {
        for listen in [false, true] {
            let (turns_per_s, cpu_per_turn_ms, scrapes) = measure(&binary, listen)?;
            let line = format!(
                "{{\"run\": {run}, \"listen\": {listen}, \"turns_per_s\": {turns_per_s:.0}, \
                 \"cpu_per_turn_ms\": {cpu_per_turn_ms:.4}, \"scrapes\": {scrapes}}}"
            );
            eprintln!("bench listen: {line}");
            lines.push(line);
        }
    }
    let out = root().join("target/bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join("listen.json"),
        format!("[{}]\n", lines.join(",\n")),
    )?;
    Ok(())
}

/// One run: turns/s, CPU per turn in ms, and how many scrapes answered.
fn measure(binary: &Path, listen: bool) -> anyhow::Result<(f64, f64, u64)> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut command = Command::new("/usr/bin/time");
    command
        .args(["-f", "cpu %U %S"])
        .arg(binary)
        .args(["rollout", "--config"])
        .arg(root().join("examples/quickstart.toml"))
        .args([
            "--groups",
            LISTEN_GROUPS,
            "--epochs",
            "100",
            "--max-inflight",
            "256",
        ])
        .args(["--progress", "off", "--out", "/dev/null", "--overwrite"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if listen {
        command.args(["--listen", &port.to_string()]);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let scrapes = Arc::new(AtomicU64::new(0));
    let scraper = listen.then(|| {
        let (stop, scrapes) = (Arc::clone(&stop), Arc::clone(&scrapes));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if scrape(port).is_ok() {
                    scrapes.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    });
    let started = Instant::now();
    let output = command.output().context("cannot run /usr/bin/time")?;
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    if let Some(scraper) = scraper {
        let _ = scraper.join();
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("the rollout failed:\n{stderr}");
    }
    let number_before = |word: &str| -> Option<f64> {
        let words: Vec<&str> = stderr.split_whitespace().collect();
        words
            .windows(2)
            .find(|pair| pair[1].trim_end_matches([',', ';']) == word)
            .and_then(|pair| pair[0].parse().ok())
    };
    let turns = number_before("turns").context("no turn count in the summary")?;
    let cpu: f64 = stderr
        .lines()
        .find_map(|line| line.strip_prefix("cpu "))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|n| n.parse::<f64>().ok())
                .sum()
        })
        .context("no CPU times from /usr/bin/time")?;
    Ok((
        turns / elapsed,
        cpu * 1e3 / turns,
        scrapes.load(Ordering::Relaxed),
    ))
}

/// One `GET /metrics`, read to the end.
fn scrape(port: u16) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut body = Vec::new();
    stream.read_to_end(&mut body)?;
    if body.starts_with(b"HTTP/1.1 200") {
        Ok(())
    } else {
        Err(std::io::Error::other("not a 200"))
    }
}
