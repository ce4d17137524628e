//! [`ProgramAgent`]: a loop-owning agent program (a coding agent such as opencode) run once
//! per rollout attempt against the recording [`Proxy`], as the loop's
//! [`rollout_api::Agent`].
//!
//! Each attempt gets a directory of its own (an unguessable name in a private root, mode 0700,
//! removed at the end), a proxy key of its own (`OPENAI_BASE_URL`, `OPENAI_API_KEY` in the
//! agent's environment), its `setup` commands run in the directory, then the agent, killed
//! whole when it exits, times out, or the attempt is dropped (a drain, Ctrl-C, the rollout's
//! deadline). Its output is kept, capped, for the log. Then `verify` runs in the directory,
//! the dataset row as JSON on its stdin: its reward is the number it prints, else its exit
//! code (0 is 1.0, 1 is 0.0, anything else unscorable).
//!
//! Every program of an attempt runs in the [`Sandbox`] given to [`ProgramAgent::new`] as the
//! config's `sandbox`, `network` and `limits` keys change it ([`ProgramConfig::sandbox_in`]):
//! bubblewrap by default, each in a PID namespace of its own, with the environment cleared to
//! what the table gives, the file system read-only but its own directory and a private
//! `/tmp`, the other attempts' directories hidden, and (for a library user with no forwarder,
//! `Sandbox::default().network(true)`) the host's network: it must reach the proxy, which
//! answers only this attempt's key. Nothing of one attempt is visible to another: directory,
//! key, processes, environment.
//!
//! [`ProgramConfig`] is also the `[agent]` table of a settings file (serde, its defaults
//! those of [`ProgramConfig::new`], checked by [`ProgramConfig::validate`]).
//!
//! With a [`ProgramConfig::forwarder`] and a sandbox without the host's network, the agent
//! reaches its proxy and nothing else: it runs under the forwarder (a program that serves
//! [`forward`]), which listens on the proxy's own port inside the agent's network namespace
//! and hands each connection through a Unix socket in the attempt's directory to the proxy.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use futures::future::BoxFuture;
use process::{Finished, Isolation, Program, Sandbox, SandboxKeys};
use rollout_api::{Agent, AgentError, AgentOutcome, AgentRun, DatasetRow, Verdict};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::{
    io::copy_bidirectional,
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
};

use crate::{SettingError, proxy::Proxy};

/// How to run the agent program, and the `[agent]` table of a settings file that says so:
/// every key below but the run-time fields ([`workdir_root`](ProgramConfig::workdir_root),
/// [`max_output`](ProgramConfig::max_output), [`forwarder`](ProgramConfig::forwarder)), with
/// [`ProgramConfig::new`]'s defaults; an unknown key is refused.
///
/// ```toml
/// [agent]
/// command = ["opencode", "run", "--format", "json", "{prompt}"]  # {prompt} {workdir} {task_json}
/// env = { OPENCODE_DISABLE_AUTOUPDATE = "1" }   # plus OPENAI_BASE_URL / OPENAI_API_KEY per rollout
/// workdir = "fresh"                             # a new directory per rollout, removed after verify
/// setup = ["./setup.sh"]                        # optional, in the workdir, before the agent
/// verify = ["python3", "./verify.py"]          # in the workdir after the agent, the row as JSON on stdin
/// timeout = "10m"                               # the agent's; then its process group is killed
/// command_timeout = "2m"                        # each setup and verify command's
/// weight = 1.0                                  # of the `env` column (verify's reward)
/// sandbox = "bwrap"                             # or "none": with the engine's permissions
/// network = false                               # only its proxy (true: the host's network)
/// limits = { memory_mib = 8192 }                # process::Limits; unset fields keep defaults
/// conversations = "main"                        # rows of the main conversation only ("all": each its own)
/// ```
///
/// `setup` is one command (`["./setup.sh", "arg"]`) or a list of them (`[["make"], ["./x"]]`);
/// one is written back as one. `sandbox`, `network` and `limits` change the sandbox the
/// programs are started in ([`ProgramConfig::sandbox_in`]); a key left out keeps that
/// sandbox's value.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", schemars(transform = command_required))]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ProgramConfig {
    /// The agent's command line; `{prompt}` (the task's text), `{workdir}` and `{task_json}`
    /// (the dataset row as JSON, answer columns included: keep it out of the agent's own
    /// command) are replaced in each argument, in one pass.
    // Required, but read as empty when missing and refused by `validate`: serde would name a
    // missing key before a misspelt one, in a table with flattened keys.
    #[serde(default)]
    pub command: Vec<String>,
    /// More environment variables for the agent, setup and verify (the proxy's URL and key
    /// are added).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Where each attempt runs.
    #[serde(default)]
    pub workdir: Workdir,
    /// Commands run in the directory before the agent, in order (each must exit 0).
    #[serde(default, with = "commands", skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "schema", schemars(with = "Vec<Vec<String>>"))]
    pub setup: Vec<Vec<String>>,
    /// The command that judges the directory after the agent exited; the dataset row comes as
    /// JSON on its stdin. Its reward is the number it prints, else its exit code (0: 1.0,
    /// 1: 0.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Vec<String>>,
    /// How long the agent may run before its process group is killed.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub timeout: Duration,
    /// How long each setup and verify command may run.
    #[serde(default = "default_command_timeout", with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub command_timeout: Duration,
    /// The weight of the `env` reward column that `verify` gives, among the run's rewards
    /// (for whoever builds them: the agent itself only reports the reward).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// The `sandbox`, `network` and `limits` keys: how the programs are isolated, whether
    /// they get the host's network, their resource limits; each unset keeps the sandbox's own.
    #[serde(flatten)]
    pub keys: SandboxKeys,
    /// Which of the agent's conversations with its proxy become training rows.
    #[serde(default)]
    pub conversations: Conversations,
    /// Where the private root of the attempts' directories is made (run time, not a key: the
    /// system's temporary directory).
    #[serde(skip, default = "std::env::temp_dir")]
    pub workdir_root: PathBuf,
    /// Bytes of the agent's stdout and of its stderr kept for the log (run time, not a key).
    #[serde(skip, default = "default_max_output")]
    pub max_output: usize,
    /// A program that serves [`forward`] (the binary's `agent-forward`, say), run inside the
    /// sandbox: with it, an agent in a sandbox without the host's network reaches its proxy
    /// (and nothing else). Without it, such an agent reaches nothing. Run time, not a key.
    #[serde(skip)]
    pub forwarder: Option<Vec<String>>,
}

/// The schema says what `validate` does: `command` is required, though serde reads a table
/// without one (as empty, to refuse it by name after the keys are checked).
#[cfg(feature = "schema")]
fn command_required(schema: &mut schemars::Schema) {
    if let Some(command) = schema
        .get_mut("properties")
        .and_then(|properties| properties.get_mut("command"))
        .and_then(serde_json::Value::as_object_mut)
    {
        command.remove("default");
    }
    let required = schema
        .ensure_object()
        .entry("required")
        .or_insert_with(|| serde_json::Value::Array(Vec::new()));
    if let Some(required) = required.as_array_mut() {
        required.push("command".into());
    }
}

/// Where an agent runs (`workdir`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Workdir {
    /// `"fresh"`: a new directory per rollout attempt (an unguessable name in a private root),
    /// removed after verify.
    #[default]
    Fresh,
}

/// Which of an agent's conversations become training rows (`conversations`).
///
/// An agent may hold several conversations with the proxy: opencode asks for a title for
/// its session beside the task itself, other agents summarize or compact. Each is its own
/// conversation (its prompt does not continue the others), so each would be a row of its
/// own, trained with the task's reward though it did not earn it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Conversations {
    /// `"main"`: only the main conversation's turns become rows: the one with the most
    /// answers (the latest of equals), which is also the transcript `verify` and the row's
    /// `prompt`/`completion` show. The longest rather than the one that ends the run: an
    /// agent's last request may well be a side one (a title, a summary), its work is where it
    /// asked the most. The others' turns are counted in the row's metrics
    /// (`agent_side_conversations`, `agent_side_turns`); raw `/v1/completions` requests
    /// belong to no conversation and are counted there too.
    #[default]
    Main,
    /// `"all"`: every conversation's turns become rows of their own.
    All,
}

fn default_timeout() -> Duration {
    Duration::from_secs(600)
}

fn default_command_timeout() -> Duration {
    Duration::from_secs(120)
}

fn default_weight() -> f64 {
    1.0
}

fn default_max_output() -> usize {
    64 * 1024
}

impl ProgramConfig {
    /// Runs `command` with the defaults (the table's when a key is left out): 10 minutes,
    /// 2 minutes per setup or verify command, no setup, no verify, a weight of 1, the
    /// sandbox as given; directories under the system's temporary directory, 64 KiB of
    /// output kept, no forwarder.
    pub fn new(command: Vec<String>) -> ProgramConfig {
        ProgramConfig {
            command,
            env: BTreeMap::new(),
            workdir: Workdir::default(),
            setup: Vec::new(),
            verify: None,
            timeout: default_timeout(),
            command_timeout: default_command_timeout(),
            weight: default_weight(),
            keys: SandboxKeys::default(),
            conversations: Conversations::default(),
            workdir_root: std::env::temp_dir(),
            max_output: default_max_output(),
            forwarder: None,
        }
    }

    /// The sandbox the agent, setup and verify run in: `base` (the default sandbox with the
    /// host's network, for a library user without a forwarder; a run's files hidden, for the
    /// binary) as the `sandbox`, `network` and `limits` keys change it.
    pub fn sandbox_in(&self, base: &Sandbox) -> Sandbox {
        self.keys.apply(base.clone())
    }

    /// Every command line with its key, for messages: `command`, then `setup` (`setup[i]`
    /// among several), then `verify`.
    pub fn command_lines_mut(&mut self) -> impl Iterator<Item = (String, &mut Vec<String>)> {
        let count = self.setup.len();
        std::iter::once(("command".to_owned(), &mut self.command))
            .chain(
                self.setup
                    .iter_mut()
                    .enumerate()
                    .map(move |(index, argv)| (commands::key("setup", index, count), argv)),
            )
            .chain(
                self.verify
                    .iter_mut()
                    .map(|argv| ("verify".to_owned(), argv)),
            )
    }

    /// Whether `verify` gives a reward (the `env` column).
    pub fn verifies(&self) -> bool {
        self.verify.is_some()
    }

    /// Checks the values: every command line has a program, the timeouts are longer than
    /// zero, the weight is a finite number. Whether the programs exist and the sandbox can be
    /// had here is the caller's to check.
    pub fn validate(&self) -> Result<(), SettingError> {
        let empty =
            |key: String| SettingError::at(key, "empty; expected the program and its arguments");
        if self.command.is_empty() {
            return Err(empty("command".to_owned()));
        }
        for (index, argv) in self.setup.iter().enumerate() {
            if argv.is_empty() {
                return Err(empty(commands::key("setup", index, self.setup.len())));
            }
        }
        if self.verify.as_ref().is_some_and(Vec::is_empty) {
            return Err(empty("verify".to_owned()));
        }
        if self.timeout.is_zero() || self.command_timeout.is_zero() {
            return Err(SettingError::new(
                "timeout and command_timeout must be longer than zero",
            ));
        }
        if !self.weight.is_finite() {
            return Err(SettingError::at(
                "weight",
                format!("expected a finite number, got {}", self.weight),
            ));
        }
        self.keys
            .check()
            .map_err(|(key, problem)| SettingError::at(key, problem))
    }

    /// The agent, run against `proxy`, its programs in `sandbox` as the table changes it
    /// (see [`ProgramAgent::new`]).
    pub fn agent(&self, proxy: Arc<Proxy>, sandbox: Sandbox) -> Result<ProgramAgent, AgentError> {
        ProgramAgent::new(proxy, self.clone(), sandbox)
    }
}

/// `setup`'s keys: one command line (`["./setup.sh", "arg"]`) or a list of them
/// (`[["make"], ["./check.sh"]]`), one written back as one. An empty list is one empty
/// command line, refused by [`ProgramConfig::validate`] as such.
mod commands {
    use serde::{
        Deserialize, Deserializer, Serialize, Serializer,
        de::{self, SeqAccess, Visitor},
    };

    /// The key of the `index`th of `count` command lines under `name`: `setup` for the
    /// only one, `setup[1]` among several.
    pub(super) fn key(name: &str, index: usize, count: usize) -> String {
        if count == 1 {
            name.to_owned()
        } else {
            format!("{name}[{index}]")
        }
    }

    pub(super) fn serialize<S: Serializer>(
        commands: &[Vec<String>],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match commands {
            [one] => one.serialize(serializer),
            many => many.serialize(serializer),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Vec<String>>, D::Error> {
        let items = Vec::<Item>::deserialize(deserializer)?;
        if items.iter().all(|item| matches!(item, Item::Argument(_))) {
            let argv = items
                .into_iter()
                .filter_map(|item| match item {
                    Item::Argument(arg) => Some(arg),
                    Item::Command(_) => None,
                })
                .collect();
            return Ok(vec![argv]);
        }
        items
            .into_iter()
            .map(|item| match item {
                Item::Command(argv) => Ok(argv),
                Item::Argument(arg) => Err(de::Error::custom(format!(
                    "expected one command line [\"./setup.sh\", \"arg\"] or a list of them \
                     [[\"make\"], [\"./setup.sh\"]], not both: '{arg}' is not a list"
                ))),
            })
            .collect()
    }

    /// One item of the list: an argument of the one command line, or a command line.
    enum Item {
        Argument(String),
        Command(Vec<String>),
    }

    impl<'de> Deserialize<'de> for Item {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Item, D::Error> {
            deserializer.deserialize_any(ItemVisitor)
        }
    }

    struct ItemVisitor;

    impl<'de> Visitor<'de> for ItemVisitor {
        type Value = Item;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "a string (the program or an argument) or a list of strings (a command line)",
            )
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Item, E> {
            Ok(Item::Argument(text.to_owned()))
        }

        fn visit_string<E: de::Error>(self, text: String) -> Result<Item, E> {
            Ok(Item::Argument(text))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
            let mut argv = Vec::new();
            while let Some(arg) = seq.next_element::<String>()? {
                argv.push(arg);
            }
            Ok(Item::Command(argv))
        }
    }
}

/// An agent program as the loop's agent; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ProgramAgent {
    proxy: Arc<Proxy>,
    config: Arc<ProgramConfig>,
    sandbox: Arc<Sandbox>,
    root: Arc<PrivateRoot>,
}

impl ProgramAgent {
    /// Runs `config`'s program against `proxy`, in `sandbox` as `config`'s keys change it
    /// ([`ProgramConfig::sandbox_in`]; `Sandbox::default().network(true)` for a library user
    /// without a forwarder: the agent must reach the proxy); makes the private root of the
    /// attempts' directories (removed when the last clone of the agent is dropped).
    pub fn new(
        proxy: Arc<Proxy>,
        config: ProgramConfig,
        sandbox: Sandbox,
    ) -> Result<ProgramAgent, AgentError> {
        let root = PrivateRoot::new(&config.workdir_root)?;
        Ok(ProgramAgent {
            proxy,
            sandbox: Arc::new(config.sandbox_in(&sandbox)),
            config: Arc::new(config),
            root: Arc::new(root),
        })
    }

    /// The sandbox its programs run in (each with the other attempts' directories hidden).
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
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
struct AttemptDir(PathBuf);

impl Drop for AttemptDir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), %error, "cannot remove an agent's directory");
        }
    }
}

/// The agent's exit code and whether it timed out, as the outcome's metrics; logged.
fn exit_metrics(ran: &Result<Finished, String>, episode: &str) -> BTreeMap<String, f64> {
    let mut metrics = BTreeMap::new();
    match ran {
        Ok(finished) => {
            let code = finished.status.code().map_or(-1.0, f64::from);
            metrics.insert("agent_exit_code".to_owned(), code);
            metrics.insert("agent_timed_out".to_owned(), 0.0);
            tracing::debug!(
                episode,
                status = %finished.status,
                stdout = %tail(&finished.stdout),
                stderr = %tail(&finished.stderr),
                "the agent exited"
            );
        }
        Err(error) => {
            metrics.insert("agent_timed_out".to_owned(), 1.0);
            tracing::warn!(episode, %error, "the agent did not finish");
        }
    }
    metrics
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
        self.setup(&place, &env).await?;
        let (argv, relay) = self.command_line(&place, &workdir)?;
        let ran = self
            .program(argv, &place, &env, Vec::new(), config.timeout)
            .await;
        drop(relay);
        let mut metrics = exit_metrics(&ran, &run.episode_id);
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
        if let (Conversations::Main, Some(main)) =
            (config.conversations, transcript.main_conversation)
        {
            outcome = outcome.main_conversation(main);
        }
        if let Some(verdict) = verdict {
            outcome = outcome.verdict(verdict);
        }
        drop(workdir);
        Ok(outcome)
    }

    /// Runs the setup commands in order; each must exit 0.
    async fn setup(
        &self,
        place: &Placeholders<'_>,
        env: &BTreeMap<String, String>,
    ) -> Result<(), AgentError> {
        for (index, argv) in self.config.setup.iter().enumerate() {
            let finished = self
                .program(
                    place.fill_all(argv),
                    place,
                    env,
                    Vec::new(),
                    self.config.command_timeout,
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
        Ok(())
    }

    /// The agent's command line, and, when the agent may reach only its proxy, the relay it
    /// reaches it through: a relay from a socket in the directory to the proxy, and the
    /// agent under the forwarder that listens on the proxy's port in its network namespace.
    fn command_line(
        &self,
        place: &Placeholders<'_>,
        workdir: &AttemptDir,
    ) -> Result<(Vec<String>, Option<Relay>), AgentError> {
        let argv = place.fill_all(&self.config.command);
        let Some(forwarder) = &self.config.forwarder else {
            return Ok((argv, None));
        };
        if self.sandbox.isolation != Isolation::Bwrap || self.sandbox.network {
            return Ok((argv, None));
        }
        let relay = Relay::start(&workdir.0, self.proxy.local_addr())?;
        let mut wrapped = forwarder.clone();
        wrapped.extend([
            "--port".to_owned(),
            self.proxy.local_addr().port().to_string(),
            // Relative: the forwarder runs in the directory, and a socket's path must be
            // short (108 bytes).
            "--socket".to_owned(),
            RELAY_SOCKET.to_owned(),
            "--".to_owned(),
        ]);
        wrapped.extend(argv);
        Ok((wrapped, Some(relay)))
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
        let sandbox = Sandbox::clone(&self.sandbox).hide(&self.root.0);
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
fn make_workdir(root: &Path) -> Result<AttemptDir, AgentError> {
    let dir = root.join(random_name()?);
    std::fs::create_dir(&dir).map_err(|e| {
        AgentError(format!(
            "cannot make a directory under {}: {e}",
            root.display()
        ))
    })?;
    Ok(AttemptDir(dir))
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
    use serde_json::json;

    use super::*;

    fn table(value: Value) -> Result<ProgramConfig, String> {
        serde_json::from_value(value).map_err(|e| e.to_string())
    }

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| (*arg).to_owned()).collect()
    }

    #[test]
    fn a_table_with_only_a_command_is_program_config_new() {
        let read = table(json!({"command": ["agent", "{prompt}"]})).expect("a table");
        assert_eq!(read, ProgramConfig::new(argv(&["agent", "{prompt}"])));
        assert_eq!(read.timeout, Duration::from_secs(600));
        assert_eq!(read.command_timeout, Duration::from_secs(120));
        assert_eq!(read.weight, 1.0);
        assert_eq!(read.workdir, Workdir::Fresh);
        assert_eq!(read.conversations, Conversations::Main);
        assert_eq!(read.max_output, 64 * 1024);
        assert!(read.forwarder.is_none() && !read.keys.is_set());
        // What is decided at run time is no key, and is not written.
        let written = serde_json::to_value(&read).expect("written");
        assert_eq!(
            written,
            json!({
                "command": ["agent", "{prompt}"],
                "workdir": "fresh",
                "timeout": "10m",
                "command_timeout": "2m",
                "weight": 1.0,
                "conversations": "main",
            })
        );
        let all = table(json!({"command": ["a"], "conversations": "all"})).expect("a table");
        assert_eq!(all.conversations, Conversations::All);
        let refused =
            table(json!({"command": ["a"], "conversations": "longest"})).expect_err("not a choice");
        assert!(refused.contains("unknown variant `longest`"), "{refused}");
        for key in ["workdir_root", "max_output", "forwarder"] {
            let refused = table(json!({"command": ["a"], key: 1})).expect_err(key);
            assert!(
                refused.contains(&format!("unknown field `{key}`")),
                "{refused}"
            );
        }
    }

    #[test]
    fn setup_is_one_command_or_a_list_of_them_and_one_is_written_as_one() {
        let one = table(json!({"command": ["a"], "setup": ["./setup.sh", "x"]})).expect("one");
        assert_eq!(one.setup, vec![argv(&["./setup.sh", "x"])]);
        assert_eq!(
            serde_json::to_value(&one).expect("written")["setup"],
            json!(["./setup.sh", "x"])
        );
        let two =
            table(json!({"command": ["a"], "setup": [["make"], ["./x", "y"]]})).expect("a list");
        assert_eq!(two.setup, vec![argv(&["make"]), argv(&["./x", "y"])]);
        assert_eq!(
            serde_json::to_value(&two).expect("written")["setup"],
            json!([["make"], ["./x", "y"]])
        );
        let back: ProgramConfig =
            serde_json::from_value(serde_json::to_value(&two).expect("written")).expect("read");
        assert_eq!(back, two);
        let mixed = table(json!({"command": ["a"], "setup": [["make"], "x"]})).expect_err("mixed");
        assert!(mixed.contains("not both"), "{mixed}");
        let number = table(json!({"command": ["a"], "setup": [1]})).expect_err("a number");
        assert!(number.contains("expected a string"), "{number}");
        // An empty list is one empty command line, which validate refuses as such.
        let empty = table(json!({"command": ["a"], "setup": []})).expect("read");
        assert_eq!(empty.setup, vec![Vec::<String>::new()]);
        assert_eq!(
            empty.validate().map_err(|e| e.to_string()),
            Err("setup: empty; expected the program and its arguments".to_owned())
        );
    }

    #[test]
    fn validate_names_the_key_that_cannot_work() {
        let problem = |value: Value| {
            table(value)
                .expect("a table")
                .validate()
                .map_err(|e| e.within("agent").to_string())
                .err()
        };
        assert_eq!(problem(json!({"command": ["a"], "verify": ["v"]})), None);
        assert_eq!(
            problem(json!({"command": []})).as_deref(),
            Some("agent.command: empty; expected the program and its arguments")
        );
        assert_eq!(
            problem(json!({"command": ["a"], "setup": [["s"], []]})).as_deref(),
            Some("agent.setup[1]: empty; expected the program and its arguments")
        );
        assert_eq!(
            problem(json!({"command": ["a"], "verify": []})).as_deref(),
            Some("agent.verify: empty; expected the program and its arguments")
        );
        assert_eq!(
            problem(json!({"command": ["a"], "command_timeout": "0s"})).as_deref(),
            Some("agent: timeout and command_timeout must be longer than zero")
        );
        let mut config = ProgramConfig::new(argv(&["a"]));
        config.weight = f64::NAN;
        assert_eq!(
            config.validate().map_err(|e| e.within("agent").to_string()),
            Err("agent.weight: expected a finite number, got NaN".to_owned())
        );
    }

    #[test]
    fn every_command_line_comes_with_its_key() {
        let mut config = table(json!({
            "command": ["a"],
            "setup": [["s"], ["t"]],
            "verify": ["v"],
        }))
        .expect("a table");
        let keys: Vec<String> = config.command_lines_mut().map(|(key, _)| key).collect();
        assert_eq!(keys, ["command", "setup[0]", "setup[1]", "verify"]);
        config.setup.pop();
        let keys: Vec<String> = config.command_lines_mut().map(|(key, _)| key).collect();
        assert_eq!(keys, ["command", "setup", "verify"]);
    }

    #[test]
    fn a_misspelt_command_is_named_and_a_missing_one_refused_by_validate() {
        let misspelt = table(json!({"comand": ["a"]})).expect_err("refused");
        assert!(misspelt.starts_with("unknown field `comand`"), "{misspelt}");
        let missing = table(json!({"timeout": "5s"})).expect("read");
        assert_eq!(
            missing.validate().map_err(|e| e.to_string()),
            Err("command: empty; expected the program and its arguments".to_owned())
        );
    }

    #[test]
    fn the_sandbox_keys_change_the_sandbox_given_and_only_what_they_set() {
        let base = Sandbox::default().hide("/run-files");
        let config = table(json!({"command": ["a"]})).expect("a table");
        assert_eq!(config.sandbox_in(&base), base);
        let config = table(json!({
            "command": ["a"],
            "sandbox": "none",
            "limits": {"memory_mib": 100},
        }))
        .expect("a table");
        let sandbox = config.sandbox_in(&base);
        assert_eq!(sandbox.isolation, Isolation::None);
        assert!(!sandbox.network, "network kept from the base");
        assert_eq!(sandbox.limits.memory_mib, 100);
        assert_eq!(sandbox.hidden(), base.hidden());
    }

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
        let name = |dir: &AttemptDir| dir.0.file_name().map(|n| n.to_string_lossy().into_owned());
        assert_ne!(name(&a), name(&b));
        assert!(name(&a).is_some_and(|n| n.len() == 32), "{:?}", name(&a));
        let path = root.0.clone();
        drop((a, b, root));
        assert!(!path.exists());
    }
}
