//! `cargo xtask ci`: every check, in order, one summary line each; stops at the first failure.
//!
//! Two things keep it short on a machine of two cores:
//! - **One build.** Every step that builds or runs the workspace's tests and binaries does it
//!   with the same flags (`crate::WORKSPACE`: the whole workspace, every feature), so the
//!   `build` step's compilation serves the parity, test, sandbox, doc-test, bridge and e2e
//!   steps as it is. The features step only checks; loom and the bridge's wheel build apart
//!   (loom's cfg and maturin's single package change what is compiled).
//! - **Downloads beside the build.** What the steps fetch and install into the cache (the
//!   fixtures, the venvs of the bridge, vLLM and TRL) waits on the network and the disk more
//!   than on the CPU: it starts on threads of its own with the run (`Preparation`), and a
//!   step that needs it waits for it (`Step::needs`).

use std::{
    thread::{self, JoinHandle},
    time::Instant,
};

use anyhow::{Context, bail};

use crate::{
    bridge, cargo, cargo_workspace, features, loom, msrv, parity, run_checked, sandbox_user, tidy,
    vllm,
};

/// One step of CI.
struct Step {
    name: &'static str,
    /// The preparation it waits for before it starts, if any.
    needs: Option<Prep>,
    run: fn() -> anyhow::Result<()>,
}

/// What is fetched and installed on a thread of its own while the first steps build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prep {
    /// The fixtures (tokenizers, templates, the MCP SDK's and the agents' venvs, opencode)
    /// and the bridge's test venv.
    Fixtures,
    /// vLLM's venv (torch), then TRL's venv, which reads torch from it.
    Vllm,
}

impl Prep {
    fn start(self) -> JoinHandle<anyhow::Result<()>> {
        thread::spawn(move || {
            let started = Instant::now();
            let result = match self {
                Prep::Fixtures => bridge::prepare(),
                Prep::Vllm => bridge::prepare_trl(),
            };
            match &result {
                Ok(()) => eprintln!("ci: {self:?} prepared in {:.1?}", started.elapsed()),
                Err(error) => eprintln!("ci: preparing {self:?} FAILED: {error:#}"),
            }
            result
        })
    }
}

/// The preparations under way, each joined the first time a step needs it.
struct Preparation {
    running: Vec<(Prep, Option<JoinHandle<anyhow::Result<()>>>)>,
}

impl Preparation {
    fn start() -> Preparation {
        Preparation {
            running: [Prep::Fixtures, Prep::Vllm]
                .into_iter()
                .map(|prep| (prep, Some(prep.start())))
                .collect(),
        }
    }

    /// Waits for `prep` (at once when it is done); its error, each time it is asked for.
    fn wait(&mut self, prep: Prep) -> anyhow::Result<()> {
        let Some((_, handle)) = self.running.iter_mut().find(|(p, _)| *p == prep) else {
            bail!("{prep:?} was never started");
        };
        if let Some(running) = handle.take() {
            let waited = Instant::now();
            let result = running
                .join()
                .map_err(|_| anyhow::anyhow!("preparing {prep:?} panicked"))?;
            if waited.elapsed().as_secs() > 0 {
                eprintln!("ci: waited {:.1?} for {prep:?}", waited.elapsed());
            }
            result.with_context(|| format!("preparing {prep:?} failed"))?;
        }
        Ok(())
    }
}

const STEPS: &[Step] = &[
    Step {
        needs: None,
        name: "fmt",
        run: || run_checked(&mut cargo(&["fmt", "--all", "--", "--check"])),
    },
    Step {
        needs: None,
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
        needs: None,
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
        needs: None,
        name: "build",
        // The tests and binaries of every later step, built once (`crate::WORKSPACE`).
        run: || run_checked(&mut cargo_workspace(&["test"], &["--no-run"])),
    },
    Step {
        needs: Some(Prep::Fixtures),
        name: "parity",
        run: parity::run,
    },
    Step {
        needs: Some(Prep::Fixtures),
        name: "test",
        run: || {
            run_checked(&mut cargo_workspace(
                &["nextest", "run"],
                &[
                    "--profile",
                    "ci",
                    // The real-vLLM suite needs its server: the e2e step starts one and runs it.
                    "-E",
                    "not binary_id(async-grpo-vllm-client::e2e) and not binary_id(async-grpo-cli::e2e)",
                ],
            ))
        },
    },
    Step {
        needs: None,
        name: "sandbox as a user",
        run: sandbox_user::run,
    },
    Step {
        needs: None,
        name: "doc tests",
        run: || run_checked(&mut cargo_workspace(&["test"], &["--doc"])),
    },
    Step {
        needs: None,
        name: "features",
        run: features::run,
    },
    Step {
        needs: Some(Prep::Fixtures),
        name: "bridge (wheel, pytest, typing)",
        run: bridge::pytest,
    },
    Step {
        needs: None,
        name: "bridge (sdist)",
        run: bridge::sdist,
    },
    Step {
        needs: None,
        name: "loom",
        run: loom::run,
    },
    Step {
        needs: None,
        name: "msrv",
        run: msrv::run,
    },
    Step {
        needs: None,
        name: "tidy",
        run: tidy::run,
    },
    Step {
        needs: Some(Prep::Vllm),
        name: "e2e (real vLLM)",
        run: vllm::e2e,
    },
    Step {
        needs: Some(Prep::Vllm),
        name: "TRL trainer",
        run: bridge::trl,
    },
];

pub(crate) fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut preparation = Preparation::start();
    for step in STEPS {
        if let Some(prep) = step.needs {
            preparation.wait(prep)?;
        }
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
