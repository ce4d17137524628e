//! `cargo xtask parity`: chat templates rendered in Rust against transformers, per template.
//!
//! Makes sure the expected outputs are in the cache (`cargo xtask fixtures`), then runs the
//! parity test of rollout-core, which prints the pass count of each template and every
//! mismatch (an explained one says why), and fails on any unexplained mismatch.

use crate::{cargo, fixtures, run_checked};

pub(crate) fn run() -> anyhow::Result<()> {
    fixtures::run()?;
    run_checked(&mut cargo(&[
        "test",
        "--package",
        "rollout-core",
        "--test",
        "tests",
        "--",
        "--exact",
        "parity::every_template_renders_every_case_as_transformers_does",
        "--nocapture",
    ]))
}
