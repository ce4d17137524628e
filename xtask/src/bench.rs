//! `cargo xtask bench`: runs the benchmarks; each writes its results under `target/bench/`.

use crate::{cargo, root, run_checked};

pub(crate) fn run() -> anyhow::Result<()> {
    let out = root().join("target").join("bench");
    std::fs::create_dir_all(&out)?;
    for (package, bench) in [
        ("tool-dispatch", "dispatch"),
        ("scoring", "scoring"),
        ("rollout-core", "turns"),
    ] {
        if package == "rollout-core" {
            // The turn benchmark runs on the real Qwen3 tokenizer.
            crate::fixtures::run()?;
        }
        run_checked(
            cargo(&["bench", "--package", package, "--bench", bench]).env("BENCH_OUT", &out),
        )?;
    }
    eprintln!("bench: results in {}", out.display());
    Ok(())
}
