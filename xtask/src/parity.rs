//! `cargo xtask parity`: chat templates rendered in Rust against transformers, per template.
//!
//! Makes sure the expected outputs are in the cache (`cargo xtask fixtures`), then runs the
//! parity test of rollout-core, which prints the pass count of each template and every
//! mismatch (an explained one says why), and fails on any unexplained mismatch. The step fails
//! too when that test did not run: a renamed test matches the exact name below no more, and
//! libtest passes with 0 tests.

use crate::{cargo_workspace, fixtures, libtest};

/// The parity test, by its exact name.
const TEST: &str = "parity::every_template_renders_every_case_as_transformers_does";

pub(crate) fn run() -> anyhow::Result<()> {
    fixtures::run()?;
    // Every package's `tests` binary, of the test step's build (the workspace with every
    // feature, which a `--package` would build again with its own); only rollout-core's has it.
    libtest::run(&mut cargo_workspace(
        &["test"],
        &["--test", "tests", "--", "--exact", TEST, "--nocapture"],
    ))?
    .expect(
        "the parity step",
        &[TEST],
        "is the parity test in crates/rollout-core/tests/parity.rs still named so? \
         (xtask/src/parity.rs names it)",
    )
}
