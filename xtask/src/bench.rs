//! `cargo xtask bench`: runs the benchmarks; each writes its results under `target/bench/`.

use crate::{cargo, root, run_checked};

pub(crate) fn run() -> anyhow::Result<()> {
    let out = root().join("target").join("bench");
    std::fs::create_dir_all(&out)?;
    run_checked(
        cargo(&["bench", "--package", "tool-dispatch", "--bench", "dispatch"])
            .env("BENCH_OUT", &out),
    )?;
    eprintln!("bench: results in {}", out.display());
    Ok(())
}
