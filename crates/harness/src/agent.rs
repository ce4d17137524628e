//! [`ProgramAgent`]: a loop-owning agent program (a coding agent such as opencode) run once
//! per rollout attempt against the recording [`Proxy`], as the loop's
//! [`rollout::Agent`].
//!
//! Each attempt gets a directory of its own (an unguessable name in a private root, mode 0700,
//! removed at the end), a proxy key of its own (`OPENAI_BASE_URL`, `OPENAI_API_KEY` in the
//! agent's environment), its `setup` commands run in the directory, then the agent, killed
//! whole when it exits, times out, or the attempt is dropped (a drain, Ctrl-C, the rollout's
//! deadline). Its output is kept, capped, for the log. Then `verify` runs in the directory,
//! the dataset row as JSON on its stdin: its reward is the number it prints, else its exit
//! code (0 is 1.0, 1 is 0.0, anything else unscorable).
//!
//! Every program of an attempt runs in the [`Sandbox`] of [`ProgramConfig::sandbox`]:
//! bubblewrap by default, each in a PID namespace of its own, with the environment cleared to
//! what the table gives, the file system read-only but its own directory and a private
//! `/tmp`, the other attempts' directories hidden, and (by default, for a library user with
//! no forwarder) the host's network: it must reach the proxy, which answers only this
//! attempt's key. Nothing of one attempt is visible to another: directory, key, processes,
//! environment.
//!
//! With a [`ProgramConfig::forwarder`] and a sandbox without the host's network, the agent
//! reaches its proxy and nothing else: it runs under the forwarder (a program that serves
//! [`forward`]), which listens on the proxy's own port inside the agent's network namespace
//! and hands each connection through a Unix socket in the attempt's directory to the proxy.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use futures::future::BoxFuture;
use process::{Finished, Isolation, Program, Sandbox};
use rollout::{Agent, AgentError, AgentOutcome, AgentRun, DatasetRow, Verdict};
use serde_json::Value;
use tokio::{
    io::copy_bidirectional,
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
};

use crate::{proxy::Proxy, sync::Arc};

/// How to run the agent program.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProgramConfig {
    /// The agent's command line; `{prompt}` (the task's text), `{workdir}` and `{task_json}`
    /// (the dataset row as JSON, answer columns included: keep it out of the agent's own
    /// command) are replaced in each argument, in one pass.
    pub command: Vec<String>,
    /// More environment variables for the agent, setup and verify (the proxy's URL and key
    /// are added).
    pub env: BTreeMap<String, String>,
    /// Commands run in the directory before the agent, in order (each must exit 0).
    pub setup: Vec<Vec<String>>,
    /// The command that judges the directory after the agent exited; the dataset row comes as
    /// JSON on its stdin.
    pub verify: Option<Vec<String>>,
    /// How long the agent may run before its process group is killed.
    pub timeout: Duration,
    /// How long each setup and verify command may run.
    pub command_timeout: Duration,
    /// Where the private root of the attempts' directories is made.
    pub workdir_root: PathBuf,
    /// Bytes of the agent's stdout and of its stderr kept for the log.
    pub max_output: usize,
    /// Where the agent, setup and verify run: bubblewrap with the host's network by default.
    pub sandbox: Sandbox,
    /// A program that serves [`forward`] (the binary's `agent-forward`, say), run inside the
    /// sandbox: with it, an agent in a sandbox without the host's network reaches its proxy
    /// (and nothing else). Without it, such an agent reaches nothing.
    pub forwarder: Option<Vec<String>>,
}

impl ProgramConfig {
    /// Runs `command` with the defaults: 10 minutes, 2 minutes per setup or verify command,
    /// directories under the system's temporary directory, 64 KiB of output kept, the default
    /// sandbox with the host's network (to reach the proxy).
    pub fn new(command: Vec<String>) -> ProgramConfig {
        ProgramConfig {
            command,
            env: BTreeMap::new(),
            setup: Vec::new(),
            verify: None,
            timeout: Duration::from_secs(600),
            command_timeout: Duration::from_secs(120),
            workdir_root: std::env::temp_dir(),
            max_output: 64 * 1024,
            sandbox: Sandbox::default().network(true),
            forwarder: None,
        }
    }
}

/// An agent program as the loop's agent; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ProgramAgent {
    proxy: Arc<Proxy>,
    config: Arc<ProgramConfig>,
    root: Arc<PrivateRoot>,
}

impl ProgramAgent {
    /// Runs `config`'s program against `proxy`; makes the private root of the attempts'
    /// directories (removed when the last clone of the agent is dropped).
    pub fn new(proxy: Arc<Proxy>, config: ProgramConfig) -> Result<ProgramAgent, AgentError> {
        let root = PrivateRoot::new(&config.workdir_root)?;
        Ok(ProgramAgent {
            proxy,
            config: Arc::new(config),
            root: Arc::new(root),
        })
    }

    /// The private root of the attempts' directories.
    pub fn root(&self) -> &Path {
        &self.root.0
    }
}

impl Agent for ProgramAgent {
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>> {
        let this = self.clone();
        Box::pin(async move { this.attempt(run).await })
    }
}

/// The relay's socket, in the attempt's directory.
const RELAY_SOCKET: &str = ".async-grpo-proxy.sock";

/// Hands each connection to a Unix socket in an attempt's directory on to the proxy, until
/// dropped (the socket file is removed then).
struct Relay {
    socket: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    fn start(dir: &Path, proxy: std::net::SocketAddr) -> Result<Relay, AgentError> {
        let socket = dir.join(RELAY_SOCKET);
        let cannot =
            |e: std::io::Error| AgentError(format!("cannot listen on {}: {e}", socket.display()));
        // A socket's path is at most 108 bytes, and a directory under a long TMPDIR is longer:
        // bound through the directory's descriptor, the path is short whatever the directory.
        let opened = std::fs::File::open(dir).map_err(cannot)?;
        let short = format!(
            "/proc/self/fd/{}/{RELAY_SOCKET}",
            std::os::fd::AsRawFd::as_raw_fd(&opened)
        );
        let listener = UnixListener::bind(&short).map_err(cannot)?;
        drop(opened);
        let task = tokio::spawn(async move {
            while let Ok((mut inside, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outside) = TcpStream::connect(proxy).await {
                        let _ = copy_bidirectional(&mut inside, &mut outside).await;
                    }
                });
            }
        });
        Ok(Relay { socket, task })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The forwarder's side, inside an agent's sandbox: listens on 127.0.0.1:`port` of the
/// sandbox's own network namespace, starts `argv` (with this process's environment and
/// stdio), and hands each connection to the Unix socket `socket`, until the program exits.
/// Returns how it exited. The binary's `agent-forward` serves this.
pub async fn forward(
    port: u16,
    socket: PathBuf,
    argv: &[String],
) -> std::io::Result<std::process::ExitStatus> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("no program to run"))?;
    // Started once the port is bound: the agent's first request finds it open.
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .kill_on_drop(true)
        .spawn()?;
    let accept = async {
        loop {
            let (mut inside, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => return error,
            };
            let socket = socket.clone();
            tokio::spawn(async move {
                if let Ok(mut outside) = UnixStream::connect(&socket).await {
                    let _ = copy_bidirectional(&mut inside, &mut outside).await;
                }
            });
        }
    };
    tokio::select! {
        status = child.wait() => status,
        error = accept => Err(error),
    }
}

/// A directory only its owner may enter (0700, an unguessable name), removed when dropped.
#[derive(Debug)]
struct PrivateRoot(PathBuf);

impl PrivateRoot {
    fn new(parent: &Path) -> Result<PrivateRoot, AgentError> {
        let cannot = |e: std::io::Error| {
            AgentError(format!(
                "cannot make a private directory under {}: {e}",
                parent.display()
            ))
        };
        std::fs::create_dir_all(parent).map_err(cannot)?;
        let dir = parent.join(format!("async-grpo-agents-{}", random_name()?));
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(&dir).map_err(cannot)?;
        Ok(PrivateRoot(dir))
    }
}

impl Drop for PrivateRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// 128 random bits as hex, or an error: never a name that can be guessed.
fn random_name() -> Result<String, AgentError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| AgentError(format!("the OS gave no random bytes for a name: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// An attempt's directory, removed when dropped.
struct Workdir(PathBuf);

impl Drop for Workdir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), %error, "cannot remove an agent's directory");
        }
    }
}

impl ProgramAgent {
    async fn attempt(&self, run: AgentRun) -> Result<AgentOutcome, AgentError> {
        let config = &self.config;
        let workdir = make_workdir(&self.root.0)?;
        let task = Value::Object(run.row.to_json()).to_string();
        let prompt = task_text(&run.row);
        let session = self
            .proxy
            .try_session(run.sampler)
            .map_err(|e| AgentError(e.to_string()))?;
        let mut env = config.env.clone();
        env.insert("OPENAI_BASE_URL".into(), session.base_url().to_owned());
        env.insert("OPENAI_API_KEY".into(), session.key().to_owned());
        env.insert("ASYNC_GRPO_EPISODE".into(), run.episode_id.clone());
        let place = Placeholders {
            prompt: &prompt,
            workdir: &workdir.0,
            task: &task,
        };
        for (index, argv) in config.setup.iter().enumerate() {
            let finished = self
                .program(
                    place.fill_all(argv),
                    &place,
                    &env,
                    Vec::new(),
                    config.command_timeout,
                )
                .await
                .map_err(|e| AgentError(format!("setup[{index}]: {e}")))?;
            if !finished.status.success() {
                return Err(AgentError(format!(
                    "setup[{index}] exited with {}: {}",
                    finished.status,
                    tail(&finished.stderr)
                )));
            }
        }
        let mut argv = place.fill_all(&config.command);
        // Only its proxy: a relay from a socket in the directory to the proxy, and the agent
        // under the forwarder that listens on the proxy's port in its network namespace.
        let relay = match &config.forwarder {
            Some(forwarder)
                if config.sandbox.isolation == Isolation::Bwrap && !config.sandbox.network =>
            {
                let relay = Relay::start(&workdir.0, self.proxy.local_addr())?;
                let mut wrapped = forwarder.clone();
                wrapped.extend([
                    "--port".to_owned(),
                    self.proxy.local_addr().port().to_string(),
                    // Relative: the forwarder runs in the directory, and a socket's path must
                    // be short (108 bytes).
                    "--socket".to_owned(),
                    RELAY_SOCKET.to_owned(),
                    "--".to_owned(),
                ]);
                wrapped.append(&mut argv);
                argv = wrapped;
                Some(relay)
            }
            _ => None,
        };
        let ran = self
            .program(argv, &place, &env, Vec::new(), config.timeout)
            .await;
        drop(relay);
        let mut metrics = BTreeMap::new();
        match &ran {
            Ok(finished) => {
                let code = finished.status.code().map_or(-1.0, f64::from);
                metrics.insert("agent_exit_code".to_owned(), code);
                metrics.insert("agent_timed_out".to_owned(), 0.0);
                tracing::debug!(
                    episode = %run.episode_id,
                    status = %finished.status,
                    stdout = %tail(&finished.stdout),
                    stderr = %tail(&finished.stderr),
                    "the agent exited"
                );
            }
            Err(error) => {
                metrics.insert("agent_timed_out".to_owned(), 1.0);
                tracing::warn!(episode = %run.episode_id, %error, "the agent did not finish");
            }
        }
        let transcript = session.finish().await;
        if let Err(error) = &ran
            && transcript.stats.requests == 0
        {
            return Err(AgentError(format!("the agent did not run: {error}")));
        }
        let verdict = match &config.verify {
            Some(argv) => Some(self.verify(argv, &place, &env).await),
            None => None,
        };
        let stats = transcript.stats;
        metrics.insert("capture_reused_turns".into(), stats.reused_turns as f64);
        metrics.insert("capture_rendered_turns".into(), stats.rendered_turns as f64);
        metrics.insert("capture_limited_turns".into(), stats.limited as f64);
        let mut outcome = AgentOutcome::new(transcript.prompt, transcript.completion)
            .tool_calls(stats.tool_calls);
        outcome.metrics = metrics;
        if let Some(verdict) = verdict {
            outcome = outcome.verdict(verdict);
        }
        drop(workdir);
        Ok(outcome)
    }

    /// Runs `argv` (its placeholders already replaced) in the attempt's directory and sandbox
    /// with `env` and `input` on stdin.
    async fn program(
        &self,
        argv: Vec<String>,
        place: &Placeholders<'_>,
        env: &BTreeMap<String, String>,
        input: Vec<u8>,
        timeout: Duration,
    ) -> Result<Finished, String> {
        let sandbox = self.config.sandbox.clone().hide(&self.root.0);
        Program::new(argv)
            .envs(env.clone())
            .dir(place.workdir)
            .sandbox(sandbox)
            .run(input, timeout, self.config.max_output)
            .await
            .map_err(|e| e.to_string())
    }

    /// The reward `verify` gives: the number it prints, else its exit code (0: 1.0, 1: 0.0).
    async fn verify(
        &self,
        argv: &[String],
        place: &Placeholders<'_>,
        env: &BTreeMap<String, String>,
    ) -> Verdict {
        let finished = match self
            .program(
                place.fill_all(argv),
                place,
                env,
                place.task.as_bytes().to_vec(),
                self.config.command_timeout,
            )
            .await
        {
            Ok(finished) => finished,
            Err(error) => return unverified(format!("verify: {error}")),
        };
        if let Ok(reward) = finished.stdout.trim().parse::<f64>()
            && reward.is_finite()
        {
            return Verdict {
                reward: Some(reward),
                ..Verdict::default()
            };
        }
        match finished.status.code() {
            Some(0) => Verdict {
                reward: Some(1.0),
                ..Verdict::default()
            },
            Some(1) => Verdict {
                reward: Some(0.0),
                ..Verdict::default()
            },
            _ => unverified(format!(
                "verify exited with {}: {}",
                finished.status,
                tail(&finished.stderr)
            )),
        }
    }
}

fn unverified(error: String) -> Verdict {
    Verdict {
        error: Some(error),
        ..Verdict::default()
    }
}

/// What the placeholders of a command line stand for.
struct Placeholders<'a> {
    prompt: &'a str,
    workdir: &'a Path,
    task: &'a str,
}

impl Placeholders<'_> {
    /// Every argument of `argv` filled.
    fn fill_all(&self, argv: &[String]) -> Vec<String> {
        argv.iter().map(|arg| self.fill(arg)).collect()
    }

    /// `arg` with each placeholder replaced, in one pass: what a value brings in (a prompt
    /// that says `{task_json}`) is never replaced again.
    fn fill(&self, arg: &str) -> String {
        let workdir = self.workdir.to_string_lossy();
        let values = [
            ("{prompt}", self.prompt),
            ("{workdir}", &*workdir),
            ("{task_json}", self.task),
        ];
        let mut filled = String::with_capacity(arg.len());
        let mut rest = arg;
        while !rest.is_empty() {
            match values.iter().find(|(name, _)| rest.starts_with(name)) {
                Some((name, value)) => {
                    filled.push_str(value);
                    rest = &rest[name.len()..];
                }
                None => {
                    let next = rest.chars().next().map_or(1, char::len_utf8);
                    filled.push_str(&rest[..next]);
                    rest = &rest[next..];
                }
            }
        }
        filled
    }
}

/// A fresh directory for the attempt, with an unguessable name, in the agent's private root.
fn make_workdir(root: &Path) -> Result<Workdir, AgentError> {
    let dir = root.join(random_name()?);
    std::fs::create_dir(&dir).map_err(|e| {
        AgentError(format!(
            "cannot make a directory under {}: {e}",
            root.display()
        ))
    })?;
    Ok(Workdir(dir))
}

/// The task's text: the row's last user message.
fn task_text(row: &DatasetRow) -> String {
    row.prompt
        .iter()
        .rev()
        .find(|m| m.role() == "user")
        .and_then(|m| m.content())
        .unwrap_or_default()
        .to_owned()
}

/// The last 2000 characters of an output, for messages.
fn tail(text: &str) -> &str {
    process::tail(text, 2000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_replaced_in_one_pass() {
        let place = Placeholders {
            prompt: "say {task_json} and {workdir}",
            workdir: Path::new("/w"),
            task: r#"{"answer": "42"}"#,
        };
        assert_eq!(
            place.fill("--task={prompt} in {workdir}"),
            "--task=say {task_json} and {workdir} in /w"
        );
        assert_eq!(place.fill("{task_json}"), r#"{"answer": "42"}"#);
        assert_eq!(place.fill("{prompt"), "{prompt");
    }

    #[test]
    fn attempt_directories_are_private_and_unguessable() {
        let parent = std::env::temp_dir();
        let root = PrivateRoot::new(&parent).expect("a private root");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&root.0).map(|m| m.permissions().mode() & 0o777);
            assert_eq!(mode.ok(), Some(0o700));
        }
        let (a, b) = (
            make_workdir(&root.0).expect("made"),
            make_workdir(&root.0).expect("made"),
        );
        let name = |dir: &Workdir| dir.0.file_name().map(|n| n.to_string_lossy().into_owned());
        assert_ne!(name(&a), name(&b));
        assert!(name(&a).is_some_and(|n| n.len() == 32), "{:?}", name(&a));
        let path = root.0.clone();
        drop((a, b, root));
        assert!(!path.exists());
    }
}
