//! `cargo xtask loom`: the loom models of the tool pool, then each with its planted bug.
//!
//! The models live in `crates/tool-dispatch/src/pool/models.rs` (the pool) and
//! `crates/tool-dispatch/src/call_state/models.rs` (a call's waiter against its job, and the
//! call's slot). They are compiled with the crate-specific `--cfg tool_dispatch_loom` (a
//! global `--cfg loom` would change tokio and break the async layer), in release with debug
//! assertions, in their own target directory so that the changed flags do not invalidate the
//! main build.
//!
//! A model that cannot fail proves nothing. So after the models pass, each planted bug (a
//! `Faults` flag of the crate, `TOOL_DISPATCH_LOOM_FAULTS=name`) is run against the model
//! that must catch it, in a process of its own, and the check demands that the model fails
//! *with the assertion it names*: a crash, a loom deadlock report or a panic about the fault
//! itself is not a catch. The crate's list of faults and this one must match: a fault this
//! check plants but the crate does not know, or one the crate has but nobody plants, is an
//! error of the check.
//!
//! The first run must pass every model of `MODELS` by name, so that a renamed model or module
//! (which `models::` or `--exact` would match no more, and libtest passes with 0 tests) fails
//! the check.

use std::{
    collections::BTreeSet,
    process::{Command, Output, Stdio},
    time::Instant,
};

use anyhow::{Context, bail};

use crate::{cargo, libtest, root, run_checked};

/// The package whose sync primitives loom model-checks.
pub(crate) const PACKAGE: &str = "async-grpo-tool-dispatch";

/// Its folder under `crates/`: in its `src/`, only `sync.rs` names `std::sync` (the others
/// import from it, so that loom's types can be swapped in), which `cargo xtask tidy` checks.
pub(crate) const FOLDER: &str = "tool-dispatch";

/// One planted bug: the fault, the model that must catch it, and the text of the assertion
/// that must fail.
struct Planted {
    fault: &'static str,
    model: &'static str,
    assertion: &'static str,
}

const PLANTED: &[Planted] = &[
    Planted {
        fault: "spawn_past_max",
        model: "pool::models::loom_running_jobs_never_exceed_max_threads",
        assertion: "more jobs ran at once than the pool has threads",
    },
    Planted {
        fault: "pool_never_grows",
        model: "pool::models::loom_two_blocked_jobs_run_at_once_on_two_threads",
        assertion: "never came true: two blocked jobs ran at once",
    },
    Planted {
        fault: "running_not_counted",
        model: "pool::models::loom_two_blocked_jobs_run_at_once_on_two_threads",
        assertion: "the pool counts every running job",
    },
    Planted {
        fault: "submit_skips_wakeup",
        model: "pool::models::loom_a_submitted_job_runs_before_shutdown_is_asked_for",
        assertion: "never came true: a job submitted to an idle pool ran",
    },
    Planted {
        fault: "submit_ignores_shutdown",
        model: "pool::models::loom_job_racing_shutdown_is_run_or_cancelled",
        assertion: "a job racing shutdown was lost",
    },
    Planted {
        fault: "close_drops_queued",
        model: "pool::models::loom_shutdown_cancels_or_runs_every_queued_job",
        assertion: "a queued job was lost at shutdown",
    },
    Planted {
        fault: "shutdown_skips_join",
        model: "pool::models::loom_shutdown_cancels_or_runs_every_queued_job",
        assertion: "a thread counted as joined had not exited",
    },
    Planted {
        fault: "close_skips_wakeup",
        model: "pool::models::loom_shutdown_wakes_idle_threads",
        assertion: "never came true: every pool thread exited",
    },
    Planted {
        fault: "run_abandoned_job",
        model: "call_state::models::loom_waiter_and_job_agree",
        assertion: "the stuck-thread gauge went below zero",
    },
    Planted {
        fault: "count_stuck_after_cas",
        model: "call_state::models::loom_waiter_and_job_agree",
        assertion: "the stuck-thread gauge went below zero",
    },
    Planted {
        fault: "skipped_job_keeps_slot",
        model: "call_state::models::loom_a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up",
        assertion: "a slot was never returned",
    },
    Planted {
        fault: "finished_job_releases_slot_twice",
        model: "call_state::models::loom_a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up",
        assertion: "a slot was released twice",
    },
    Planted {
        fault: "waiting_drop_keeps_call",
        model: "call_state::models::loom_a_call_whose_waiter_is_dropped_while_queued_never_runs",
        assertion: "a call whose waiter was dropped while it was queued ran anyway",
    },
];

/// Every model, each of which the first run (`models::`) must pass by name: a renamed model or
/// module is an error of the check, not a model that silently stopped running. A model added
/// to the crate runs without being listed here.
const MODELS: &[&str] = &[
    "pool::models::loom_running_jobs_never_exceed_max_threads",
    "pool::models::loom_two_blocked_jobs_run_at_once_on_two_threads",
    "pool::models::loom_a_submitted_job_runs_before_shutdown_is_asked_for",
    "pool::models::loom_job_racing_shutdown_is_run_or_cancelled",
    "pool::models::loom_shutdown_cancels_or_runs_every_queued_job",
    "pool::models::loom_shutdown_wakes_idle_threads",
    "call_state::models::loom_waiter_and_job_agree",
    "call_state::models::loom_a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up",
    "call_state::models::loom_a_slot_comes_back_once_when_shutdown_cancels_its_call",
    "call_state::models::loom_a_call_whose_waiter_is_dropped_while_queued_never_runs",
];

/// What the crate says when `TOOL_DISPATCH_LOOM_FAULTS` names a fault it does not know; the
/// list of the ones it knows follows.
const UNKNOWN_FAULT: &str = "in TOOL_DISPATCH_LOOM_FAULTS; known faults: ";

/// The models' test binary, built and not run: `cargo xtask ci` builds it beside its steps,
/// so that its loom step compiles nothing.
pub(crate) fn build() -> anyhow::Result<()> {
    run_checked(&mut loom_test(&["--no-run"]))
}

fn loom_test(extra: &[&str]) -> Command {
    let mut args = vec!["test", "--package", PACKAGE, "--release", "--lib"];
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

/// Runs one model with `faults` planted; captures its output.
fn run_with_faults(model: &str, faults: &str) -> anyhow::Result<Output> {
    loom_test(&["--quiet", "--", "--exact", model])
        .env("TOOL_DISPATCH_LOOM_FAULTS", faults)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("could not run {model} with TOOL_DISPATCH_LOOM_FAULTS={faults}"))
}

/// How a model run with a planted fault went.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// It failed with the expected assertion.
    Caught,
    /// It passed: the model does not catch the fault.
    Missed,
    /// No test ran: the model's name is wrong.
    NoSuchModel,
    /// The crate does not know the fault: the check is wrong.
    UnknownFault,
    /// It failed, but not with the expected assertion (another assertion, a crash, a loom
    /// deadlock report): the model does not show that it catches this fault.
    FailedOtherwise,
}

fn judge(success: bool, output: &str, assertion: &str) -> Verdict {
    if output.contains(UNKNOWN_FAULT) {
        Verdict::UnknownFault
    } else if output.contains("running 0 tests") {
        Verdict::NoSuchModel
    } else if success {
        Verdict::Missed
    } else if output.contains(assertion) {
        Verdict::Caught
    } else {
        Verdict::FailedOtherwise
    }
}

/// The first panic message in a test's output, for the error that shows it.
fn panic_message(output: &str) -> String {
    let mut lines = output.lines();
    while let Some(line) = lines.next() {
        if line.contains("panicked at") {
            return lines.next().unwrap_or_default().trim().to_owned();
        }
    }
    "no panic message".to_owned()
}

/// The faults the crate knows, as its `Faults::from_env` lists them when given a name it does
/// not know.
fn known_faults() -> anyhow::Result<BTreeSet<String>> {
    let model = PLANTED[0].model;
    let output = run_with_faults(model, "no_such_fault")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let Some(start) = text.find(UNKNOWN_FAULT) else {
        bail!(
            "{model} ran with the unknown fault `no_such_fault` without refusing it; \
             the crate must panic on a fault it does not know\n{text}"
        );
    };
    let list = text[start + UNKNOWN_FAULT.len()..]
        .lines()
        .next()
        .unwrap_or_default();
    Ok(list.split(',').map(|name| name.trim().to_owned()).collect())
}

pub(crate) fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    libtest::run(&mut loom_test(&["--", "models::"]))?.expect(
        "the loom run",
        MODELS,
        "a model renamed or moved? MODELS in xtask/src/loom.rs lists them",
    )?;
    eprintln!(
        "loom: every model passes, the {} listed included ({:.0?})",
        MODELS.len(),
        started.elapsed()
    );

    let known = known_faults()?;
    let planted: BTreeSet<String> = PLANTED.iter().map(|p| p.fault.to_owned()).collect();
    if let Some(fault) = planted.difference(&known).next() {
        bail!(
            "this check plants `{fault}`, which the crate does not know (it knows: {})",
            known.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    if let Some(fault) = known.difference(&planted).next() {
        bail!("the crate's fault `{fault}` is never planted: add it to PLANTED with its model");
    }

    for Planted {
        fault,
        model,
        assertion,
    } in PLANTED
    {
        let output = run_with_faults(model, fault)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        match judge(output.status.success(), &text, assertion) {
            Verdict::Caught => {
                eprintln!("loom: planted bug {fault:<32} caught by {model}: {assertion}");
            }
            Verdict::Missed => {
                bail!("the planted bug {fault} was not caught: {model} passed with it\n{text}")
            }
            Verdict::NoSuchModel => {
                bail!("no loom model named {model}: the planted bug {fault} was never tried")
            }
            Verdict::UnknownFault => {
                bail!("the crate does not know the fault {fault}: the check is wrong\n{text}")
            }
            Verdict::FailedOtherwise => bail!(
                "{model} failed with the planted bug {fault}, but not with the assertion \
                 {assertion:?} (first panic: {:?}; status {})\n{text}",
                panic_message(&text),
                output.status
            ),
        }
    }
    eprintln!(
        "loom: every model passes; {} planted bugs caught, each by its assertion ({:.0?} in all)",
        PLANTED.len(),
        started.elapsed()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{MODELS, PLANTED, Verdict, judge, panic_message};

    #[test]
    fn every_model_a_bug_is_planted_in_is_one_the_first_run_must_pass() {
        for planted in PLANTED {
            assert!(MODELS.contains(&planted.model), "{}", planted.model);
        }
    }

    const ASSERTION: &str = "a slot was never returned";

    #[test]
    fn the_expected_assertion_is_a_catch() {
        let output = "thread 'm' panicked at src/x.rs:1:1:\na slot was never returned: 1 free\n";
        assert_eq!(judge(false, output, ASSERTION), Verdict::Caught);
        assert_eq!(panic_message(output), "a slot was never returned: 1 free");
    }

    #[test]
    fn a_passing_model_misses_the_fault() {
        assert_eq!(
            judge(true, "test result: ok. 1 passed", ASSERTION),
            Verdict::Missed
        );
    }

    #[test]
    fn a_panic_about_an_unknown_fault_is_an_error_of_the_check() {
        let output = "panicked at src/pool.rs:1:1:\nunknown fault \"typo\" in \
                      TOOL_DISPATCH_LOOM_FAULTS; known faults: a, b\n";
        assert_eq!(judge(false, output, ASSERTION), Verdict::UnknownFault);
    }

    #[test]
    fn a_loom_deadlock_report_or_abort_is_not_a_catch() {
        let output = "panicked at loom/src/rt/execution.rs:215:13:\ndeadlock; threads = []\n\
                      thread caused non-unwinding panic. aborting.\n";
        assert_eq!(judge(false, output, ASSERTION), Verdict::FailedOtherwise);
    }

    #[test]
    fn another_assertion_is_not_a_catch() {
        let output = "panicked at src/x.rs:1:1:\na slot was released twice\n";
        assert_eq!(judge(false, output, ASSERTION), Verdict::FailedOtherwise);
    }

    #[test]
    fn a_model_name_that_matches_nothing_is_an_error() {
        assert_eq!(
            judge(
                true,
                "running 0 tests\ntest result: ok. 0 passed",
                ASSERTION
            ),
            Verdict::NoSuchModel
        );
    }
}
