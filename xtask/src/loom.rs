//! `cargo xtask loom`: the loom models of the tool pool, then each with its planted bug.
//!
//! The models live in `crates/tool-dispatch/src/pool/models.rs` (the pool) and
//! `crates/tool-dispatch/src/call_state.rs` (a call's waiter against its job). They are compiled with the
//! crate-specific `--cfg tool_dispatch_loom` (a global `--cfg loom` would change tokio and
//! break the async layer), in release with debug assertions, in their own target directory
//! so that the changed flags do not invalidate the main build.

use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::{cargo, root, run_checked};

/// Each planted bug (a `Faults` flag of the pool) and the model that must catch it.
const PLANTED: &[(&str, &str)] = &[
    (
        "spawn_past_max",
        "pool::models::loom_running_jobs_never_exceed_max_threads",
    ),
    (
        "submit_ignores_shutdown",
        "pool::models::loom_job_racing_shutdown_is_run_or_cancelled",
    ),
    (
        "close_drops_queued",
        "pool::models::loom_shutdown_cancels_or_runs_every_queued_job",
    ),
    (
        "close_skips_wakeup",
        "pool::models::loom_shutdown_wakes_idle_threads",
    ),
    (
        "run_abandoned_job",
        "call_state::models::loom_waiter_and_job_agree",
    ),
    (
        "count_stuck_after_cas",
        "call_state::models::loom_waiter_and_job_agree",
    ),
];

fn loom_test(extra: &[&str]) -> Command {
    let mut args = vec!["test", "--package", "tool-dispatch", "--release", "--lib"];
    args.extend_from_slice(extra);
    let mut command = cargo(&args);
    let rustflags = std::env::var("RUSTFLAGS").unwrap_or_default();
    command
        .env(
            "RUSTFLAGS",
            format!("{rustflags} --cfg tool_dispatch_loom").trim_start(),
        )
        .env("CARGO_TARGET_DIR", root().join("target").join("loom"))
        .env("CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS", "true")
        .env(
            "LOOM_MAX_PREEMPTIONS",
            std::env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "3".to_owned()),
        )
        .env_remove("TOOL_DISPATCH_LOOM_FAULTS");
    command
}

pub(crate) fn run() -> anyhow::Result<()> {
    run_checked(&mut loom_test(&["--", "models::"]))?;

    for (fault, model) in PLANTED {
        let test = (*model).to_owned();
        let output = loom_test(&["--quiet", "--", "--exact", &test])
            .env("TOOL_DISPATCH_LOOM_FAULTS", fault)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .with_context(|| format!("could not run {test} with the planted fault {fault}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if output.status.success() {
            bail!("the planted bug {fault} was not caught: {model} passed with it\n{stdout}");
        }
        if stdout.contains("running 0 tests") {
            bail!("no loom model named {model}: the planted bug {fault} was never tried");
        }
        eprintln!("loom: planted bug {fault:<24} caught by {model}");
    }
    eprintln!(
        "loom: every model passes; {} planted bugs caught",
        PLANTED.len()
    );
    Ok(())
}
