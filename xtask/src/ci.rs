//! `cargo xtask ci`: every check, in order, one summary line each; stops at the first failure.
//!
//! Three things keep it short on a machine of two cores:
//! - **One build.** Every step that builds or runs the workspace's tests and binaries does it
//!   with the same flags (`crate::WORKSPACE`: the whole workspace, every feature), so the
//!   `build` step's compilation serves the parity, test, sandbox, doc-test, bridge and e2e
//!   steps as it is. The features step only checks; loom, msrv and the bridge's wheel build
//!   apart (loom's cfg, msrv's toolchain and maturin's single package change what is
//!   compiled), each in a target folder (or profile) of its own.
//! - **Downloads beside the build.** What the steps fetch and install into the cache (the
//!   fixtures, the venvs of the bridge, vLLM and TRL) waits on the network and the disk more
//!   than on the CPU: it starts on threads of its own with the run ([`Job`]), and a step that
//!   needs it waits for it (`Step::needs`).
//! - **The compiles that stand apart fill the CPU the steps leave idle.** The tests, the
//!   pytest suite, e2e and TRL's trainer wait on servers and sleeps for a third of their
//!   time. The release wheel, the MSRV check and loom's build run beside them, one after
//!   another, at the lowest CPU priority (nice 19, inherited by cargo and rustc), so that a
//!   step's own work comes first and the compiles take mostly what it leaves (BENCHMARKS.md
//!   has each step's share of the CPU, and theirs). The steps
//!   that need them (the bridge's, msrv and loom) come late, so that the compiles have had
//!   the most idle time by then.
//!
//! A step that fails ends the run; a compile under way beside it is not stopped and finishes
//! on its own (cargo's lock on its target folder keeps a second run waiting for it).

use std::{
    panic::{self, AssertUnwindSafe},
    sync::mpsc::{self, Receiver},
    thread,
    time::Instant,
};

use anyhow::{Context, anyhow, bail};

use crate::{
    bridge, cargo, cargo_workspace, features, loom, msrv, parity, run_checked, sandbox_user, tidy,
    vllm,
};

/// One step of CI.
struct Step {
    name: &'static str,
    /// The jobs beside the steps it waits for before it starts.
    needs: &'static [Job],
    run: fn() -> anyhow::Result<()>,
}

/// Work done beside the steps, on a thread of its own, that a step waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Job {
    /// The fixtures (tokenizers, templates, the MCP SDK's and the agents' venvs, opencode),
    /// maturin's venv and the bridge's test venv.
    Fixtures,
    /// vLLM's venv (torch), then TRL's venv, which reads torch from it.
    Vllm,
    /// The release wheel, compiled into `target/release`; the bridge's steps find it built.
    Wheel,
    /// The workspace checked with the Rust of `rust-version` (`target/msrv`): the msrv step.
    Msrv,
    /// The loom models' test binary (`target/loom`); the loom step runs it.
    LoomBuild,
}

/// The threads beside the steps, each running its jobs in order: the fixtures first, since
/// they install the maturin the wheel's build runs (two threads making one venv would race),
/// then the compiles, in the order the steps need them.
const BESIDE: [&[Job]; 2] = [
    &[Job::Fixtures, Job::Wheel, Job::Msrv, Job::LoomBuild],
    &[Job::Vllm],
];

impl Job {
    fn run(self) -> anyhow::Result<()> {
        match self {
            Job::Fixtures => bridge::prepare(),
            Job::Vllm => bridge::prepare_trl(),
            Job::Wheel => bridge::build_wheel().map(drop),
            Job::Msrv => msrv::run(),
            Job::LoomBuild => loom::build(),
        }
    }

    /// A compile, which takes every CPU it is given, rather than a download.
    fn compiles(self) -> bool {
        matches!(self, Job::Wheel | Job::Msrv | Job::LoomBuild)
    }
}

/// The jobs beside the steps: their results as they come, each kept for every step that
/// asks.
struct Beside {
    results: Receiver<(Job, anyhow::Result<()>)>,
    finished: Vec<(Job, Result<(), String>)>,
}

impl Beside {
    /// Starts every thread of [`BESIDE`].
    fn start() -> Beside {
        let (sender, results) = mpsc::channel();
        for jobs in BESIDE {
            let sender = sender.clone();
            thread::spawn(move || {
                let mut lowered = false;
                for &job in jobs {
                    if job.compiles() && !lowered {
                        // This thread's nice value, which the processes it starts inherit
                        // (on Linux it is a thread's, not the whole process's).
                        if let Err(error) = rustix::process::setpriority_process(None, 19) {
                            eprintln!(
                                "ci: the compiles beside the steps keep their priority: {error}"
                            );
                        }
                        lowered = true;
                    }
                    let started = Instant::now();
                    let result = panic::catch_unwind(AssertUnwindSafe(|| job.run()))
                        .unwrap_or_else(|_| Err(anyhow!("{job:?} panicked")));
                    match &result {
                        Ok(()) => eprintln!("ci: {job:?} done beside in {:.1?}", started.elapsed()),
                        Err(error) => eprintln!("ci: {job:?} beside FAILED: {error:#}"),
                    }
                    if sender.send((job, result)).is_err() {
                        // The run is over.
                        return;
                    }
                }
            });
        }
        Beside {
            results,
            finished: Vec::new(),
        }
    }

    /// Waits for `job` (at once when it is done); its error, each time it is asked for.
    fn wait(&mut self, job: Job) -> anyhow::Result<()> {
        let waited = Instant::now();
        let result = loop {
            if let Some((_, result)) = self.finished.iter().find(|(done, _)| *done == job) {
                break result;
            }
            let Ok((done, result)) = self.results.recv() else {
                bail!("{job:?} is not among the jobs beside the steps (BESIDE)");
            };
            self.finished
                .push((done, result.map_err(|error| format!("{error:#}"))));
        };
        if waited.elapsed().as_secs() > 0 {
            eprintln!("ci: waited {:.1?} for {job:?}", waited.elapsed());
        }
        result
            .clone()
            .map_err(|error| anyhow!(error))
            .with_context(|| format!("{job:?}, beside the steps, failed"))
    }
}

const STEPS: &[Step] = &[
    Step {
        needs: &[],
        name: "fmt",
        run: || run_checked(&mut cargo(&["fmt", "--all", "--", "--check"])),
    },
    Step {
        needs: &[],
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
        needs: &[],
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
        needs: &[],
        name: "build",
        // The tests and binaries of every later step, built once (`crate::WORKSPACE`).
        run: || run_checked(&mut cargo_workspace(&["test"], &["--no-run"])),
    },
    Step {
        needs: &[Job::Fixtures],
        name: "parity",
        run: parity::run,
    },
    Step {
        needs: &[Job::Fixtures],
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
        needs: &[],
        name: "sandbox as a user",
        run: sandbox_user::run,
    },
    Step {
        needs: &[],
        name: "doc tests",
        run: || run_checked(&mut cargo_workspace(&["test"], &["--doc"])),
    },
    Step {
        needs: &[],
        name: "features",
        run: features::run,
    },
    Step {
        needs: &[Job::Fixtures, Job::Vllm],
        name: "e2e (real vLLM)",
        run: vllm::e2e,
    },
    Step {
        needs: &[Job::Fixtures, Job::Wheel],
        name: "bridge (wheel, pytest, typing)",
        run: bridge::pytest,
    },
    Step {
        needs: &[Job::Wheel],
        name: "bridge (sdist)",
        run: bridge::sdist,
    },
    Step {
        needs: &[Job::Fixtures, Job::Vllm, Job::Wheel],
        name: "TRL trainer",
        run: bridge::trl,
    },
    Step {
        needs: &[Job::LoomBuild],
        name: "loom",
        run: loom::run,
    },
    Step {
        needs: &[Job::Msrv],
        name: "msrv",
        // The check ran beside the steps (`Job::Msrv`); waiting for it was the step.
        run: || Ok(()),
    },
    Step {
        needs: &[],
        name: "tidy",
        run: tidy::run,
    },
];

pub(crate) fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut beside = Beside::start();
    for step in STEPS {
        eprintln!("ci: {} ...", step.name);
        let step_started = Instant::now();
        let result = step
            .needs
            .iter()
            .try_for_each(|&job| beside.wait(job))
            .and_then(|()| (step.run)());
        if let Err(error) = result {
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

#[cfg(test)]
mod tests {
    use super::{BESIDE, Job, STEPS};

    #[test]
    fn every_job_a_step_needs_runs_beside_the_steps_once() {
        let beside: Vec<Job> = BESIDE
            .iter()
            .flat_map(|jobs| jobs.iter().copied())
            .collect();
        for step in STEPS {
            for job in step.needs {
                assert!(
                    beside.contains(job),
                    "step {:?} needs {job:?}, which no thread of BESIDE runs: it would wait for \
                     every thread to end, then fail",
                    step.name
                );
            }
        }
        for (i, job) in beside.iter().enumerate() {
            assert!(
                !beside[i + 1..].contains(job),
                "{job:?} runs twice beside the steps"
            );
        }
    }

    /// A thread lowers its priority at its first compile and keeps it low: a download after
    /// a compile would run at the lowest priority, behind the steps.
    #[test]
    fn on_each_thread_the_downloads_come_before_the_compiles() {
        for jobs in BESIDE {
            let first_compile = jobs.iter().position(|job| job.compiles());
            if let Some(first) = first_compile {
                for job in &jobs[first..] {
                    assert!(
                        job.compiles(),
                        "{job:?} would run niced, after a compile on its thread"
                    );
                }
            }
        }
    }

    /// The fixtures install maturin's venv, which the wheel's build runs: two threads making
    /// one venv at once would race, so the wheel follows the fixtures on their thread.
    #[test]
    fn the_wheel_is_built_after_the_fixtures_on_their_thread() {
        let thread = BESIDE
            .iter()
            .find(|jobs| jobs.contains(&Job::Wheel))
            .expect("the wheel is built beside the steps");
        let position = |job| thread.iter().position(|j| *j == job);
        let fixtures = position(Job::Fixtures);
        assert!(
            fixtures.is_some() && fixtures < position(Job::Wheel),
            "the wheel's thread runs {thread:?}"
        );
    }
}
