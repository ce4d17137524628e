//! `cargo xtask ci`: every check, in order, one summary line each; stops at the first failure.

use std::time::Instant;

use anyhow::bail;

use crate::{
    bridge, cargo, features, fixtures, loom, parity, run_checked, sandbox_user, tidy, vllm,
};

/// One step of CI.
struct Step {
    name: &'static str,
    run: fn() -> anyhow::Result<()>,
}

const STEPS: &[Step] = &[
    Step {
        name: "fmt",
        run: || run_checked(&mut cargo(&["fmt", "--all", "--", "--check"])),
    },
    Step {
        name: "clippy",
        run: || {
            run_checked(&mut cargo(&[
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--",
                "-D",
                "warnings",
            ]))
        },
    },
    Step {
        name: "package",
        run: || {
            // Every published crate packs as crates.io would take it: manifest, metadata and
            // files, its workspace dependencies resolved among the packages made together.
            // Not rebuilt from the archives (`--no-verify`): the other steps build the same
            // sources, and rebuilding would compile every dependency a second time.
            run_checked(&mut cargo(&[
                "package",
                "--workspace",
                "--no-verify",
                "--allow-dirty",
                "--exclude",
                "test-support",
                "--exclude",
                "trl-bridge",
                "--exclude",
                "xtask",
            ]))
        },
    },
    Step {
        name: "fixtures",
        run: fixtures::run,
    },
    Step {
        name: "parity",
        run: parity::run,
    },
    Step {
        name: "test",
        run: || {
            run_checked(&mut cargo(&[
                "nextest",
                "run",
                "--profile",
                "ci",
                "--workspace",
                "--all-features",
                // The real-vLLM suite needs its server: the e2e step starts one and runs it.
                "-E",
                "not binary_id(async-grpo-vllm-client::e2e) and not binary_id(async-grpo-cli::e2e)",
            ]))
        },
    },
    Step {
        name: "sandbox as a user",
        run: sandbox_user::run,
    },
    Step {
        name: "doc tests",
        run: || {
            run_checked(&mut cargo(&[
                "test",
                "--doc",
                "--workspace",
                "--all-features",
            ]))
        },
    },
    Step {
        name: "features",
        run: features::run,
    },
    Step {
        name: "bridge (pytest)",
        run: bridge::pytest,
    },
    Step {
        name: "loom",
        run: loom::run,
    },
    Step {
        name: "tidy",
        run: tidy::run,
    },
    Step {
        name: "e2e (real vLLM)",
        run: vllm::e2e,
    },
    Step {
        name: "TRL trainer",
        run: bridge::trl,
    },
];

pub(crate) fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    for step in STEPS {
        eprintln!("ci: {} ...", step.name);
        let step_started = Instant::now();
        if let Err(error) = (step.run)() {
            eprintln!(
                "ci: {} FAILED after {:.1?}: {error:#}",
                step.name,
                step_started.elapsed()
            );
            bail!("ci failed at step '{}'", step.name);
        }
        eprintln!("ci: {} ok ({:.1?})", step.name, step_started.elapsed());
    }
    eprintln!(
        "ci: all {} steps passed in {:.1?}",
        STEPS.len(),
        started.elapsed()
    );
    Ok(())
}
