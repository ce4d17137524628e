//! `cargo xtask bench`: runs the benchmarks; each writes its results under `target/bench/`.

use crate::{cargo, root, run_checked};

pub(crate) fn run() -> anyhow::Result<()> {
    let out = root().join("target").join("bench");
    std::fs::create_dir_all(&out)?;
    let benches = [
        ("tool-dispatch", "dispatch", ""),
        ("scoring", "scoring", ""),
        ("vllm-client", "client", ""),
        ("rollout-core", "turns", ""),
        ("rollout-core", "rollout", ""),
        ("harness", "sessions", ""),
        ("harness", "proxy", ""),
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
    eprintln!("bench: results in {}", out.display());
    Ok(())
}
