//! MCP servers as environments, through the official Rust SDK (`rmcp`): one MCP session per
//! rollout attempt, over stdio (a server process of its own, started by the `process` crate
//! in its own process group, killed whole when the session closes; unsandboxed unless
//! [`McpConfig::sandbox`] says otherwise, never with the engine's secrets) or streamable HTTP
//! (one MCP session on a running server).
//!
//! The conventions a server follows (see `examples/environment/`):
//! - `tools/list` gives the model's tools, minus the verify tool and the reset tool.
//! - **reset** (optional): when the server has a tool named `reset`, it is called once right
//!   after the handshake with whichever of `task` (the dataset row as a JSON object), `seed`
//!   and `episode_id` its input schema declares. It is never shown to the model.
//! - **done**: a tool result whose structured content (or text, parsed as JSON) is an
//!   object with `"done": true` ends the episode after that turn's calls.
//! - **verify** (required, `verify_tool`): called once at the end, with `transcript` (the
//!   conversation's messages) when its input schema declares it. Its result is a number (the
//!   reward; Python's MCP SDK wraps it as `{"result": x}`), or an object
//!   `{"reward": x, "done": ..., "metrics": {...}}`, or `null` (unscorable); as
//!   structured content or as JSON text. Its numeric metrics are the row's `env/NAME`
//!   metrics; the rest of its object (`artifacts`, other keys, metrics that are not numbers)
//!   is the row's `environment.artifacts`. A tool result's structured content is its
//!   metadata's `structured` (the row's `environment.tools`).
//! - A tool result with `isError` is an error the model reads; the episode goes on. A server
//!   that exits, or whose connection breaks, fails the rollout (cause `environment`); one
//!   that does not start, does not complete the handshake, lists no tools or lacks the
//!   verify tool fails its creation (cause `session_create`), each naming the server.

use std::{borrow::Cow, collections::BTreeMap, fmt, process::Stdio, sync::Mutex, time::Duration};

use futures::future::BoxFuture;
use process::{ProcessGroup, Program, Sandbox, SandboxKeys};
use rmcp::{
    RoleClient, ServiceError, ServiceExt,
    model::{CallToolRequestParams, CallToolResult},
    service::RunningService,
    transport::{StreamableHttpClientTransport, TokioChildProcess},
};
use rollout_core::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::io::AsyncReadExt;
use tool_dispatch::{ToolDispatcher, ToolSpec};

use crate::{
    Harness, HarnessConfig, SettingError,
    environment::DEFAULT_TIMEOUT,
    lock,
    session::{Session, SessionError, SessionFactory, Task, ToolOutput, Verification, step_reward},
};

/// The tool that receives the task, when a server has one.
pub const RESET_TOOL: &str = "reset";

/// The verify tool's name unless set.
pub const DEFAULT_VERIFY_TOOL: &str = "verify";

/// Where the MCP server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum McpServer {
    /// A program speaking MCP on stdio, started once per session: the argv.
    Command(Vec<String>),
    /// A streamable-HTTP endpoint (`http://127.0.0.1:9000/mcp`), one MCP session per
    /// rollout.
    Url(String),
}

impl fmt::Display for McpServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            McpServer::Command(argv) => write!(f, "MCP server `{}`", argv.join(" ")),
            McpServer::Url(url) => write!(f, "MCP server {url}"),
        }
    }
}

/// An MCP environment's settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct McpConfig {
    /// The server.
    pub server: McpServer,
    /// The tool called once at the end for the reward, never shown to the model.
    pub verify_tool: String,
    /// How long the handshake and each request may take.
    pub timeout: Duration,
    /// Bytes of a stdio server's stderr logged per session; the rest is read and dropped.
    pub stderr_cap: usize,
    /// Where a stdio server runs: [`Sandbox::none`] unless set.
    pub sandbox: Sandbox,
}

impl McpConfig {
    /// `server` with verify tool `verify`, 30 s per request, 16 KiB of stderr per session.
    pub fn new(server: McpServer) -> McpConfig {
        McpConfig {
            server,
            verify_tool: DEFAULT_VERIFY_TOOL.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            stderr_cap: 16 * 1024,
            sandbox: Sandbox::none(),
        }
    }

    /// Sets the verify tool's name.
    #[must_use]
    pub fn verify_tool(mut self, name: impl Into<String>) -> McpConfig {
        self.verify_tool = name.into();
        self
    }

    /// Runs a stdio server in `sandbox`.
    #[must_use]
    pub fn sandbox(mut self, sandbox: Sandbox) -> McpConfig {
        self.sandbox = sandbox;
        self
    }

    /// Sets the timeout of the handshake and each request.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> McpConfig {
        self.timeout = timeout;
        self
    }
}

/// An MCP server as an environment, and the `[environment]` table of a settings file that says
/// so (unknown keys refused; the defaults those of [`McpConfig::new`] and
/// [`HarnessConfig::default`]):
///
/// ```toml
/// [environment]
/// kind = "mcp"
/// command = ["python3", "env_server.py"]   # stdio: one server process per rollout
/// # url = "http://127.0.0.1:9000/mcp"      # or streamable HTTP: one MCP session per rollout
/// verify_tool = "verify"                   # called once at the end, never shown to the model
/// timeout = "30s"                          # per request; a session's creation gets 4 of them
/// weight = 1.0                             # of the `env` column among the rewards
/// create_attempts = 3                      # tries at starting a session
/// sandbox = "bwrap"                        # a stdio server sandboxed (default "none")
/// network = false                          # with bwrap: the host's network or not (default false)
/// limits = { memory_mib = 2048 }           # process::Limits (default none; with bwrap, bwrap's)
/// ```
///
/// A stdio server is the user's own program, so it runs unsandboxed unless the table asks
/// (`sandbox = "bwrap"`); see [`McpEnvironment::sandbox_in`].
///
/// ```
/// use async_grpo_harness::mcp::{McpEnvironment, McpServer};
///
/// let table: McpEnvironment = serde_json::from_str(
///     r#"{"kind": "mcp", "url": "http://127.0.0.1:9000/mcp", "timeout": "5s"}"#,
/// )?;
/// table.validate()?;
/// assert_eq!(table.server(), McpServer::Url("http://127.0.0.1:9000/mcp".into()));
/// // Each attempt at a session may take four request timeouts.
/// assert_eq!(table.harness_config().create_timeout.as_secs(), 20);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct McpEnvironment {
    /// What serves the episodes: `mcp`.
    pub kind: EnvironmentKind,
    /// A stdio server: the program and its arguments (one process per rollout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// A streamable-HTTP server (one MCP session per rollout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The tool called once at the end, never shown to the model.
    #[serde(default = "default_verify_tool")]
    pub verify_tool: String,
    /// How long the handshake and each request may take; a session's creation gets
    /// [`CREATE_TIMEOUT_CALLS`](crate::CREATE_TIMEOUT_CALLS) of them.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub timeout: Duration,
    /// The weight of the `env` column among the rewards (for whoever builds them).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Tries at starting a session.
    #[serde(default = "default_create_attempts")]
    pub create_attempts: u32,
    /// A stdio server's `sandbox` (`"none"`, the default, or `"bwrap"`), `network` (with
    /// `sandbox = "bwrap"`; default false) and `limits`.
    #[serde(flatten)]
    pub keys: SandboxKeys,
}

/// What serves an environment's episodes (`kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EnvironmentKind {
    /// An MCP server.
    Mcp,
}

fn default_verify_tool() -> String {
    DEFAULT_VERIFY_TOOL.to_owned()
}

fn default_timeout() -> Duration {
    DEFAULT_TIMEOUT
}

fn default_weight() -> f64 {
    1.0
}

fn default_create_attempts() -> u32 {
    HarnessConfig::default().create_attempts
}

impl McpEnvironment {
    /// `server` with the defaults of every other key.
    pub fn new(server: McpServer) -> McpEnvironment {
        let (command, url) = match server {
            McpServer::Command(argv) => (Some(argv), None),
            McpServer::Url(url) => (None, Some(url)),
        };
        McpEnvironment {
            kind: EnvironmentKind::Mcp,
            command,
            url,
            verify_tool: default_verify_tool(),
            timeout: default_timeout(),
            weight: default_weight(),
            create_attempts: default_create_attempts(),
            keys: SandboxKeys::default(),
        }
    }

    /// Checks the values: one server (`command` or `url`, not both), a command line with a
    /// program, an http(s) URL, a timeout longer than zero, a finite weight, at least one
    /// create attempt, a verify tool named, and `sandbox`, `network` and `limits` only for a
    /// stdio server. Whether the program exists and the sandbox can be had here is the
    /// caller's to check.
    pub fn validate(&self) -> Result<(), SettingError> {
        let fail = |key: Option<&str>, problem: String| {
            Err(SettingError {
                key: key.map(str::to_owned),
                problem,
            })
        };
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => {
                return fail(
                    None,
                    "give command (a stdio server) or url (streamable HTTP), not both".to_owned(),
                );
            }
            (None, None) => {
                return fail(
                    None,
                    "no server: give command = [\"python3\", \"server.py\"] (stdio) or \
                     url = \"http://127.0.0.1:9000/mcp\" (streamable HTTP)"
                        .to_owned(),
                );
            }
            (Some(argv), None) => {
                if argv.is_empty() {
                    return fail(
                        Some("command"),
                        "empty; expected the program and its arguments".to_owned(),
                    );
                }
            }
            (None, Some(url)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return fail(
                        Some("url"),
                        format!("'{url}' is not an http:// or https:// URL"),
                    );
                }
            }
        }
        if self.timeout.is_zero() {
            return fail(Some("timeout"), "must be longer than zero".to_owned());
        }
        if !self.weight.is_finite() {
            return fail(
                Some("weight"),
                format!("expected a finite number, got {}", self.weight),
            );
        }
        if self.create_attempts == 0 {
            return fail(Some("create_attempts"), "must be at least 1".to_owned());
        }
        if self.verify_tool.is_empty() {
            return fail(
                Some("verify_tool"),
                "must name a tool of the server".to_owned(),
            );
        }
        if self.keys.is_set() && self.command.is_none() {
            return fail(
                None,
                "sandbox, network and limits are for a stdio server (command), not a url"
                    .to_owned(),
            );
        }
        self.keys
            .check()
            .map_err(|(key, problem)| SettingError::at(key, problem))
    }

    /// The server: the command, else the URL (empty when neither is given: see
    /// [`McpEnvironment::validate`]).
    pub fn server(&self) -> McpServer {
        match (&self.command, &self.url) {
            (Some(argv), _) => McpServer::Command(argv.clone()),
            (None, url) => McpServer::Url(url.clone().unwrap_or_default()),
        }
    }

    /// Where a stdio server runs: unsandboxed ([`Sandbox::none`]) unless the table says
    /// `sandbox = "bwrap"`, then in `base` (a run's files hidden, say); either way as the
    /// `network` and `limits` keys change it.
    pub fn sandbox_in(&self, base: &Sandbox) -> Sandbox {
        self.keys.opt_in(base)
    }

    /// The MCP sessions' settings, a stdio server in `sandbox` as the table changes it.
    pub fn mcp_config(&self, sandbox: &Sandbox) -> McpConfig {
        McpConfig::new(self.server())
            .verify_tool(self.verify_tool.clone())
            .timeout(self.timeout)
            .sandbox(self.sandbox_in(sandbox))
    }

    /// How the harness treats the sessions: `create_attempts`, `timeout` per call and
    /// [`CREATE_TIMEOUT_CALLS`](crate::CREATE_TIMEOUT_CALLS) of them per attempt at creating
    /// one (the server's start, then the handshake, tools/list and reset, each bounded by
    /// `timeout` in the MCP session itself).
    pub fn harness_config(&self) -> HarnessConfig {
        HarnessConfig::for_timeout(self.timeout).create_attempts(self.create_attempts)
    }

    /// The environment, named after its server, its sessions' tools run through `pool`, a
    /// stdio server in `sandbox` as the table changes it.
    pub fn harness(&self, pool: ToolDispatcher, sandbox: Sandbox) -> Harness {
        let factory = McpFactory::new(self.mcp_config(&sandbox));
        Harness::new(self.server().to_string(), factory, pool).config(self.harness_config())
    }
}

/// Creates one MCP session per rollout; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct McpFactory {
    config: McpConfig,
}

impl McpFactory {
    /// A factory for `config`'s server.
    pub fn new(config: McpConfig) -> McpFactory {
        McpFactory { config }
    }

    /// The server, as messages name it.
    pub fn server(&self) -> &McpServer {
        &self.config.server
    }

    async fn connect(&self, task: Task) -> Result<McpSession, SessionError> {
        let config = &self.config;
        let server = config.server.to_string();
        let fail = |what: String| SessionError::new(format!("{server}: {what}"));
        let (service, group) = match &config.server {
            McpServer::Command(argv) => {
                if argv.is_empty() {
                    return Err(fail("the command is empty".to_owned()));
                }
                let command = Program::new(argv.iter().cloned())
                    .sandbox(config.sandbox.clone())
                    .command()
                    .map_err(|e| fail(e.to_string()))?;
                let (transport, stderr) = TokioChildProcess::builder(command)
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| fail(format!("could not start it: {e}")))?;
                let group = ProcessGroup::new(transport.id());
                if let Some(stderr) = stderr {
                    tokio::spawn(log_stderr(stderr, server.clone(), config.stderr_cap));
                }
                let service = handshake(().serve(transport), config.timeout)
                    .await
                    .map_err(fail)?;
                (service, group)
            }
            McpServer::Url(url) => {
                let transport = StreamableHttpClientTransport::from_uri(url.as_str());
                let service = handshake(().serve(transport), config.timeout)
                    .await
                    .map_err(fail)?;
                (service, ProcessGroup::new(None))
            }
        };
        let mut session = McpSession {
            server: server.clone(),
            service: Mutex::new(Some(service)),
            peer_tools: Vec::new(),
            verify_tool: config.verify_tool.clone(),
            verify_takes_transcript: false,
            timeout: config.timeout,
            group: Mutex::new(group),
        };
        // From here on, a failure must close what was opened.
        match session.prepare(task).await {
            Ok(()) => Ok(session),
            Err(error) => {
                Session::close(&session).await;
                Err(error)
            }
        }
    }
}

impl SessionFactory for McpFactory {
    fn create(&self, task: Task) -> BoxFuture<'_, Result<Box<dyn Session>, SessionError>> {
        Box::pin(async move {
            let session = self.connect(task).await?;
            Ok(Box::new(session) as Box<dyn Session>)
        })
    }
}

/// The MCP handshake, bounded by `timeout`.
async fn handshake<F, E>(
    serving: F,
    timeout: Duration,
) -> Result<RunningService<RoleClient, ()>, String>
where
    F: Future<Output = Result<RunningService<RoleClient, ()>, E>>,
    E: fmt::Display,
{
    match tokio::time::timeout(timeout, serving).await {
        Ok(Ok(service)) => Ok(service),
        Ok(Err(error)) => Err(format!(
            "the MCP handshake failed (did it start, and does it speak MCP?): {error}"
        )),
        Err(_) => Err(format!("no answer to the MCP handshake within {timeout:?}")),
    }
}

/// Logs a stdio server's stderr line by line, up to `cap` bytes, then reads and drops the
/// rest (a server must never block on a full pipe).
async fn log_stderr(stderr: tokio::process::ChildStderr, server: String, cap: usize) {
    forward_capped(stderr, cap, |line| {
        tracing::info!(target: "harness::mcp", %server, "stderr: {line}");
    })
    .await;
}

/// Hands `pipe`'s lines to `log` until they add up to `cap` bytes, then one line saying the
/// rest is dropped; reads to the end either way. A line longer than `cap` is cut there (what
/// follows up to its newline is dropped): a server that never writes a newline costs no more
/// memory than one that does. Returns the bytes read.
async fn forward_capped(
    mut pipe: impl tokio::io::AsyncRead + Unpin,
    cap: usize,
    mut log: impl FnMut(&str),
) -> usize {
    let (mut logged, mut read) = (0usize, 0usize);
    let mut capped = false;
    let mut line: Vec<u8> = Vec::new();
    // Whether the line in progress was cut (and handed on) already.
    let mut cut = false;
    let mut emit = |line: &[u8], logged: &mut usize, capped: &mut bool| {
        if *logged + line.len() < cap {
            *logged += line.len() + 1;
            log(&String::from_utf8_lossy(line));
        } else if !*capped {
            *capped = true;
            log(&format!(
                "(more than {cap} bytes of stderr; the rest is not logged)"
            ));
        }
    };
    let mut buffer = [0u8; 8192];
    while let Ok(n) = pipe.read(&mut buffer).await {
        if n == 0 {
            break;
        }
        read += n;
        for &byte in &buffer[..n] {
            if byte == b'\n' {
                if !cut {
                    emit(&line, &mut logged, &mut capped);
                }
                line.clear();
                cut = false;
            } else if !cut {
                line.push(byte);
                if line.len() >= cap {
                    emit(&line, &mut logged, &mut capped);
                    line.clear();
                    cut = true;
                }
            }
        }
    }
    if !line.is_empty() && !cut {
        emit(&line, &mut logged, &mut capped);
    }
    read
}

/// One MCP session.
struct McpSession {
    server: String,
    service: Mutex<Option<RunningService<RoleClient, ()>>>,
    peer_tools: Vec<ToolSpec>,
    verify_tool: String,
    verify_takes_transcript: bool,
    timeout: Duration,
    group: Mutex<ProcessGroup>,
}

impl McpSession {
    fn peer(&self) -> Result<rmcp::Peer<RoleClient>, SessionError> {
        lock(&self.service)
            .as_ref()
            .map(|service| service.peer().clone())
            .ok_or_else(|| SessionError::fatal(format!("{}: the session is closed", self.server)))
    }

    /// Lists the tools, checks the verify tool, sends the task to `reset`.
    async fn prepare(&mut self, task: Task) -> Result<(), SessionError> {
        let server = self.server.clone();
        let fail = |what: String| Err(SessionError::new(format!("{server}: {what}")));
        let peer = self.peer()?;
        let listed = tokio::time::timeout(self.timeout, peer.list_all_tools()).await;
        let tools = match listed {
            Ok(Ok(tools)) => tools,
            Ok(Err(error)) => return fail(format!("tools/list failed: {error}")),
            Err(_) => {
                let message = format!("no answer to tools/list within {:?}", self.timeout);
                return fail(message);
            }
        };
        if tools.is_empty() {
            return fail("lists no tools".to_owned());
        }
        let Some(verify) = tools.iter().find(|t| t.name == self.verify_tool) else {
            let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
            let message = format!(
                "has no verify tool `{}` (its tools: {})",
                self.verify_tool,
                names.join(", ")
            );
            return fail(message);
        };
        self.verify_takes_transcript = declares(&verify.input_schema, "transcript");
        let reset = tools.iter().find(|t| t.name == RESET_TOOL).cloned();
        self.peer_tools = tools
            .into_iter()
            .filter(|t| t.name != self.verify_tool && t.name != RESET_TOOL)
            .map(|t| {
                ToolSpec::new(t.name.to_string(), t.description.unwrap_or_default())
                    .parameters(Value::Object((*t.input_schema).clone()))
            })
            .collect();
        if self.peer_tools.is_empty() {
            return fail("lists no tools for the model (only verify and reset)".to_owned());
        }
        if let Some(reset) = reset {
            let mut arguments = Map::new();
            for (key, value) in [
                ("task", Value::Object(task.row)),
                ("seed", json!(task.seed)),
                ("episode_id", json!(task.episode_id)),
            ] {
                if declares(&reset.input_schema, key) {
                    arguments.insert(key.to_owned(), value);
                }
            }
            match self.call(RESET_TOOL, arguments).await {
                Ok(result) if result.is_error == Some(true) => {
                    let text = text_of(&result);
                    return fail(format!("reset failed: {text}"));
                }
                Ok(_) => {}
                Err(error) => return Err(SessionError::new(error.message().to_owned())),
            }
        }
        Ok(())
    }

    /// One `tools/call`, bounded by the timeout; a broken connection is fatal.
    async fn call(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<CallToolResult, SessionError> {
        let peer = self.peer()?;
        let request =
            CallToolRequestParams::new(Cow::Owned(name.to_owned())).with_arguments(arguments);
        match tokio::time::timeout(self.timeout, peer.call_tool(request)).await {
            Ok(Ok(result)) => Ok(result),
            Ok(Err(ServiceError::McpError(error))) => Err(SessionError::new(format!(
                "{}: {name} answered an error: {}",
                self.server, error.message
            ))),
            Ok(Err(error)) => Err(SessionError::fatal(format!(
                "{}: {name}: the server is gone or broke the protocol: {error}",
                self.server
            ))),
            Err(_) => Err(SessionError::new(format!(
                "{}: {name} did not answer within {:?}",
                self.server, self.timeout
            ))),
        }
    }
}

/// Whether a JSON schema declares property `name`.
fn declares(schema: &Map<String, Value>, name: &str) -> bool {
    schema
        .get("properties")
        .and_then(Value::as_object)
        .is_some_and(|properties| properties.contains_key(name))
}

/// The text blocks of a result, one per line.
fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|block| block.as_text().map(|t| t.text.as_str()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads a verify result: a number, `{"result": number}`, `{"reward": x, "done", "metrics"}`
/// or null, as structured content or as JSON text.
fn verification(result: &CallToolResult) -> Result<Verification, String> {
    let value = match &result.structured_content {
        Some(value) => value.clone(),
        None => {
            let text = text_of(result);
            serde_json::from_str(text.trim())
                .map_err(|_| format!("verify answered {text:?}: not a number nor a JSON object"))?
        }
    };
    let value = match value {
        Value::Object(mut map) if map.len() == 1 && map.contains_key("result") => {
            map.remove("result").unwrap_or(Value::Null)
        }
        other => other,
    };
    match value {
        Value::Null => Ok(Verification::default()),
        Value::Number(number) => Ok(Verification {
            env_reward: number.as_f64(),
            done: true,
            ..Verification::default()
        }),
        Value::Object(mut map) => {
            let env_reward = match map.remove("reward") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => n.as_f64(),
                Some(other) => return Err(format!("verify's reward is {other}, not a number")),
            };
            let done = map.remove("done");
            let mut metrics = BTreeMap::new();
            let mut other_metrics = Map::new();
            if let Some(Value::Object(reported)) = map.remove("metrics") {
                for (name, value) in reported {
                    match value.as_f64() {
                        Some(number) => {
                            metrics.insert(name, number);
                        }
                        None => {
                            other_metrics.insert(name, value);
                        }
                    }
                }
            }
            // The rest is kept: OpenEnv's `artifacts` object as its entries, any other key
            // as it is, metrics that are not numbers under `metrics`.
            let mut artifacts = match map.remove("artifacts") {
                Some(Value::Object(artifacts)) => artifacts,
                Some(other) => Map::from_iter([("artifacts".to_owned(), other)]),
                None => Map::new(),
            };
            artifacts.extend(map);
            if !other_metrics.is_empty() {
                artifacts.insert("metrics".to_owned(), Value::Object(other_metrics));
            }
            Ok(Verification {
                env_reward,
                done: done.as_ref().and_then(Value::as_bool).unwrap_or(true),
                metrics,
                artifacts,
            })
        }
        other => Err(format!(
            "verify answered {other}: expected a number or {{\"reward\": ..}}"
        )),
    }
}

impl Session for McpSession {
    fn tools(&self) -> Vec<ToolSpec> {
        self.peer_tools.clone()
    }

    fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> BoxFuture<'_, Result<ToolOutput, SessionError>> {
        let name = name.to_owned();
        Box::pin(async move {
            let result = self.call(&name, arguments).await?;
            let text = text_of(&result);
            // Structured content, or a JSON object as text (what Python's SDK sends for a
            // tool returning a plain dict).
            let structured = result.structured_content.clone().or_else(|| {
                serde_json::from_str::<Value>(text.trim())
                    .ok()
                    .filter(Value::is_object)
            });
            let done = structured
                .as_ref()
                .and_then(|s| s.get("done"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let mut output = ToolOutput::new(text.clone());
            output.done = done;
            if result.is_error == Some(true) {
                output.error = Some(text);
            }
            if let Some(structured) = structured {
                output.reward = structured.as_object().and_then(step_reward);
                output.metadata.insert("structured".to_owned(), structured);
            }
            Ok(output)
        })
    }

    fn verify(&self, transcript: &[Message]) -> BoxFuture<'_, Result<Verification, SessionError>> {
        let mut arguments = Map::new();
        if self.verify_takes_transcript {
            arguments.insert(
                "transcript".to_owned(),
                Value::Array(
                    transcript
                        .iter()
                        .map(|m| Value::Object(m.as_map().clone()))
                        .collect(),
                ),
            );
        }
        Box::pin(async move {
            let result = self.call(&self.verify_tool, arguments).await?;
            if result.is_error == Some(true) {
                return Err(SessionError::new(format!(
                    "{}: verify failed: {}",
                    self.server,
                    text_of(&result)
                )));
            }
            verification(&result).map_err(|e| SessionError::new(format!("{}: {e}", self.server)))
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let service = lock(&self.service).take();
            if let Some(service) = service {
                // Ends the MCP session (an HTTP server is told with a DELETE); bounded, since
                // a stdio server's group is killed next anyway.
                let _ = tokio::time::timeout(Duration::from_secs(2), service.cancel()).await;
            }
            lock(&self.group).kill();
        })
    }
}

#[cfg(test)]
mod tests {
    use rmcp::model::ContentBlock;

    use super::*;
    use process::{Isolation, Limits};

    fn table(value: Value) -> Result<McpEnvironment, String> {
        serde_json::from_value(value).map_err(|e| e.to_string())
    }

    #[test]
    fn an_environment_table_s_defaults_are_the_library_s() {
        let read =
            table(json!({"kind": "mcp", "command": ["python3", "server.py"]})).expect("a table");
        let server = McpServer::Command(vec!["python3".into(), "server.py".into()]);
        assert_eq!(read, McpEnvironment::new(server.clone()));
        let mcp = read.mcp_config(&Sandbox::default());
        let library = McpConfig::new(server);
        assert_eq!(
            (&mcp.server, &mcp.verify_tool, mcp.timeout, mcp.stderr_cap),
            (
                &library.server,
                &library.verify_tool,
                library.timeout,
                library.stderr_cap
            )
        );
        assert_eq!(read.harness_config(), HarnessConfig::default());
        assert_eq!(read.weight, 1.0);
        assert_eq!(
            serde_json::to_value(&read).expect("written"),
            json!({
                "kind": "mcp",
                "command": ["python3", "server.py"],
                "verify_tool": "verify",
                "timeout": "30s",
                "weight": 1.0,
                "create_attempts": 3,
            })
        );
        let refused = table(json!({"kind": "mcp", "url": "http://x", "wieght": 1}))
            .expect_err("an unknown key");
        assert!(refused.contains("unknown field `wieght`"), "{refused}");
    }

    #[test]
    fn a_session_s_creation_may_take_four_request_timeouts() {
        assert_eq!(
            HarnessConfig::default().create_timeout,
            Duration::from_secs(120)
        );
        assert_eq!(HarnessConfig::default().timeout, Duration::from_secs(30));
        let read =
            table(json!({"kind": "mcp", "url": "http://x", "timeout": "5s"})).expect("a table");
        let config = read.harness_config();
        assert_eq!(config.timeout, Duration::from_secs(5));
        assert_eq!(config.create_timeout, Duration::from_secs(20));
        assert_eq!(config.create_attempts, 3);
    }

    #[test]
    fn validate_names_the_key_that_cannot_work() {
        let problem = |value: Value| {
            table(value)
                .expect("a table")
                .validate()
                .map_err(|e| e.within("environment").to_string())
                .err()
        };
        let cases = [
            (json!({"kind": "mcp", "url": "https://x/mcp"}), None),
            (
                json!({"kind": "mcp", "command": ["s"], "url": "http://x"}),
                Some(
                    "environment: give command (a stdio server) or url (streamable HTTP), not both",
                ),
            ),
            (
                json!({"kind": "mcp"}),
                Some(
                    "environment: no server: give command = [\"python3\", \"server.py\"] \
                     (stdio) or url = \"http://127.0.0.1:9000/mcp\" (streamable HTTP)",
                ),
            ),
            (
                json!({"kind": "mcp", "command": []}),
                Some("environment.command: empty; expected the program and its arguments"),
            ),
            (
                json!({"kind": "mcp", "url": "ftp://x"}),
                Some("environment.url: 'ftp://x' is not an http:// or https:// URL"),
            ),
            (
                json!({"kind": "mcp", "url": "http://x", "timeout": "0s"}),
                Some("environment.timeout: must be longer than zero"),
            ),
            (
                json!({"kind": "mcp", "url": "http://x", "create_attempts": 0}),
                Some("environment.create_attempts: must be at least 1"),
            ),
            (
                json!({"kind": "mcp", "url": "http://x", "verify_tool": ""}),
                Some("environment.verify_tool: must name a tool of the server"),
            ),
            (
                json!({"kind": "mcp", "url": "http://x", "network": true}),
                Some(
                    "environment: sandbox, network and limits are for a stdio server \
                     (command), not a url",
                ),
            ),
        ];
        for (value, expected) in cases {
            assert_eq!(problem(value.clone()).as_deref(), expected, "{value}");
        }
        let mut infinite = McpEnvironment::new(McpServer::Url("http://x".into()));
        infinite.weight = f64::INFINITY;
        assert_eq!(
            infinite.validate().map_err(|e| e.to_string()),
            Err("weight: expected a finite number, got inf".to_owned())
        );
    }

    #[test]
    fn a_stdio_server_is_unsandboxed_unless_the_table_asks_for_bwrap() {
        let base = Sandbox::default().hide("/run-files");
        let plain =
            table(json!({"kind": "mcp", "command": ["s"], "network": false})).expect("a table");
        let sandbox = plain.sandbox_in(&base);
        assert_eq!(sandbox.isolation, Isolation::None);
        assert_eq!(sandbox.limits, Limits::none());
        let bwrap = table(json!({
            "kind": "mcp",
            "command": ["s"],
            "sandbox": "bwrap",
            "network": true,
            "limits": {"memory_mib": 10},
        }))
        .expect("a table");
        let sandbox = bwrap.sandbox_in(&base);
        assert_eq!(sandbox.isolation, Isolation::Bwrap);
        assert!(sandbox.network);
        assert_eq!(sandbox.limits.memory_mib, 10);
        assert_eq!(
            sandbox.hidden(),
            base.hidden(),
            "the run's files stay hidden"
        );
    }

    fn text(text: &str) -> CallToolResult {
        CallToolResult::success(vec![ContentBlock::text(text)])
    }

    #[test]
    fn verify_results_read_as_numbers_objects_or_null() {
        let reward = |result: CallToolResult| verification(&result).map(|v| v.env_reward);
        assert_eq!(
            reward(CallToolResult::structured(json!({"result": 0.5}))),
            Ok(Some(0.5))
        );
        assert_eq!(reward(text("0.25")), Ok(Some(0.25)));
        assert_eq!(reward(text("null")), Ok(None));
        assert_eq!(
            reward(CallToolResult::structured(json!({"reward": null}))),
            Ok(None)
        );
        let full = verification(&text(
            r#"{"reward": 1.0, "done": false, "metrics": {"calls": 3, "note": "x"}}"#,
        ))
        .expect("an object");
        assert_eq!(full.env_reward, Some(1.0));
        assert!(!full.done);
        assert_eq!(full.metrics, BTreeMap::from([("calls".to_owned(), 3.0)]));
        assert_eq!(
            Value::Object(full.artifacts),
            json!({"metrics": {"note": "x"}}),
            "a metric that is not a number is kept apart"
        );
        let openenv = verification(&CallToolResult::structured(json!({
            "reward": 0.5, "artifacts": {"diff": "+1 -0"}, "trace_id": "t7"
        })))
        .expect("an object");
        assert_eq!(
            Value::Object(openenv.artifacts),
            json!({"diff": "+1 -0", "trace_id": "t7"}),
            "what verify said beyond the reward is kept"
        );
    }

    #[tokio::test]
    async fn a_stderr_line_that_never_ends_is_cut_at_the_cap() {
        // An endless line: a reader that waits for its newline never logs and keeps growing.
        let (sender, mut cut) = tokio::sync::mpsc::unbounded_channel();
        let reader = tokio::spawn(forward_capped(tokio::io::repeat(b'x'), 100, move |line| {
            let _ = sender.send(line.to_owned());
        }));
        let first = tokio::time::timeout(Duration::from_secs(10), cut.recv()).await;
        reader.abort();
        // With nothing logged before it, a line at the cap is past it: the cap's notice.
        assert_eq!(
            first.ok().flatten().as_deref(),
            Some("(more than 100 bytes of stderr; the rest is not logged)"),
            "the line was not cut at the cap"
        );
    }

    #[tokio::test]
    async fn a_server_s_stderr_is_logged_up_to_the_cap_and_drained_to_its_end() {
        // 200 KB of stderr: more than a pipe holds, so a reader that stopped early would
        // leave the writer blocked or killed by SIGPIPE.
        let mut child = tokio::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 20000 ]; do echo \"line $i\" >&2; i=$((i+1)); done",
            ])
            .stderr(Stdio::piped())
            .spawn()
            .expect("sh starts");
        let stderr = child.stderr.take().expect("piped");
        let mut logged = Vec::new();
        let read = tokio::time::timeout(
            Duration::from_secs(60),
            forward_capped(stderr, 100, |line| logged.push(line.to_owned())),
        )
        .await
        .expect("read to the end");
        let status = child.wait().await.expect("sh ends");
        assert!(status.success(), "the server wrote all of it: {status}");
        assert!(read > 150_000, "everything was read: {read}");
        let lines: Vec<&str> = logged.iter().map(String::as_str).collect();
        // Lines 0 to 12 are 94 bytes with their newlines; line 13 would pass the cap.
        assert_eq!(lines.len(), 14, "{lines:?}");
        assert_eq!(lines[0], "line 0");
        assert_eq!(lines[12], "line 12");
        assert!(lines[13].contains("more than 100 bytes"), "{lines:?}");
    }

    #[test]
    fn a_verify_result_that_is_no_reward_says_what_it_was() {
        let error = |result: CallToolResult| verification(&result).expect_err("not a reward");
        assert!(error(text("great job")).contains("\"great job\": not a number"));
        assert!(
            error(CallToolResult::structured(json!({"reward": "high"}))).contains("not a number")
        );
        assert!(error(CallToolResult::structured(json!([1, 2]))).contains("expected a number"));
    }
}
