//! Tools, their specs and arguments, and the calls and results that flow through the service.

use std::{fmt, future::Future, time::Duration};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::sync::Arc;

/// The error type tools return: any error that can cross threads.
pub type ToolError = Box<dyn std::error::Error + Send + Sync>;

/// A tool error that is not the call's doing but its backend's (a kernel gateway that is down
/// or refuses): the call ends [`Outcome::Unavailable`], and an engine fails the rollout rather
/// than train on an error the model did not cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// What the chat template renders for a tool: its name, description and JSON-schema
/// parameters, in the OpenAI function-calling shape (see [`ToolSpec::to_openai`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The name the model calls the tool by.
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// A JSON schema of type `object` describing the arguments.
    pub parameters: Value,
}

impl ToolSpec {
    /// A spec that takes no arguments; add them with [`ToolSpec::parameters`].
    pub fn new(name: impl Into<String>, description: impl Into<String>) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters: json!({ "type": "object", "properties": {} }),
        }
    }

    /// Sets the JSON schema of the arguments (`{"type": "object", "properties": ..., "required": [...]}`).
    pub fn parameters(mut self, schema: Value) -> ToolSpec {
        self.parameters = schema;
        self
    }

    /// The spec as chat templates and OpenAI-compatible servers expect it in `tools`:
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn to_openai(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// The arguments of one call: a JSON object, already checked against the tool's schema.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Arguments(Map<String, Value>);

impl Arguments {
    /// Wraps a JSON object.
    pub fn new(map: Map<String, Value>) -> Arguments {
        Arguments(map)
    }

    /// The value of one argument.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name)
    }

    /// Deserializes the arguments into a typed struct.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&Value::Object(self.0.clone()))
    }

    /// The underlying JSON object.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.0
    }

    /// Unwraps the JSON object.
    pub fn into_inner(self) -> Map<String, Value> {
        self.0
    }
}

/// A tool that blocks: it runs on the dispatcher's dedicated thread pool, never on the async
/// runtime. Implemented for every `Fn(Arguments) -> Result<Value, ToolError>`, closures included.
///
/// Sync tools run on up to `max_threads` threads at once, so a tool that keeps shared state
/// must be thread-safe: the `Send + Sync` bounds make the compiler check that it is.
pub trait SyncTool: Send + Sync + 'static {
    /// Runs the tool. A returned string becomes the tool message as is; any other value is
    /// serialized as JSON.
    fn call(&self, args: Arguments) -> Result<Value, ToolError>;
}

impl<F> SyncTool for F
where
    F: Fn(Arguments) -> Result<Value, ToolError> + Send + Sync + 'static,
{
    fn call(&self, args: Arguments) -> Result<Value, ToolError> {
        self(args)
    }
}

/// A tool that is awaited on the async runtime. Implemented for every
/// `Fn(Arguments) -> impl Future<Output = Result<Value, ToolError>>`, async closures included.
pub trait AsyncTool: Send + Sync + 'static {
    /// Starts the tool; the dispatcher awaits the future.
    fn call(&self, args: Arguments) -> BoxFuture<'static, Result<Value, ToolError>>;
}

impl<F, Fut> AsyncTool for F
where
    F: Fn(Arguments) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ToolError>> + Send + 'static,
{
    fn call(&self, args: Arguments) -> BoxFuture<'static, Result<Value, ToolError>> {
        Box::pin(self(args))
    }
}

/// A tool whose state lives as long as one rollout: a code interpreter's variables and
/// files, a browser's page. Each rollout gets an instance of its own ([`RolloutTool::open`]),
/// awaited as an [`AsyncTool`] and dropped when the rollout's dispatcher is (the rollout
/// ended, failed or was cancelled): what it holds must be freed by its `Drop`.
///
/// A dispatcher runs such a tool per rollout when the rollout asks it for one
/// ([`ToolDispatcher::for_rollout`](crate::ToolDispatcher::for_rollout)); called through any
/// other dispatcher, each call gets an instance of its own.
pub trait RolloutTool: Send + Sync + 'static {
    /// An instance for one rollout. Called when the rollout starts, so it should be cheap:
    /// start what it needs at its first call.
    fn open(&self) -> Arc<dyn AsyncTool>;

    /// Waits for what dropped instances are still releasing in the background (a remote
    /// kernel being deleted). A dispatcher's shutdown awaits it within its deadline, so that
    /// nothing outlives the engine. By default there is nothing to wait for.
    fn settle(&self) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }

    /// How many sessions lost their state part-way so far (an interpreter or a kernel that
    /// died, or was killed at a call's timeout), for the metrics (`sessions_lost`). None by
    /// default.
    fn sessions_lost(&self) -> u64 {
        0
    }
}

/// How a tool runs.
#[derive(Clone)]
pub(crate) enum Runner {
    Sync(Arc<dyn SyncTool>),
    Async(Arc<dyn AsyncTool>),
    PerRollout(Arc<dyn RolloutTool>),
}

/// A tool ready to register: its spec, how it runs, and its own timeout if it has one.
///
/// Whether a tool is sync or async is said at construction, not guessed: a tool that is
/// registered as sync always runs on the pool and one registered as async is always awaited.
/// Closures go through [`Tool::new_sync`] / [`Tool::new_async`]; types implementing
/// [`SyncTool`] / [`AsyncTool`] themselves through [`Tool::from_sync`] / [`Tool::from_async`].
#[derive(Clone)]
pub struct Tool {
    pub(crate) spec: ToolSpec,
    pub(crate) runner: Runner,
    pub(crate) timeout: Option<Duration>,
}

impl Tool {
    /// A blocking tool from a function or closure, run on the dispatcher's thread pool.
    pub fn new_sync<F>(spec: ToolSpec, tool: F) -> Tool
    where
        F: Fn(Arguments) -> Result<Value, ToolError> + Send + Sync + 'static,
    {
        Tool::from_sync(spec, tool)
    }

    /// An async tool from a function or closure returning a future, awaited on the runtime.
    pub fn new_async<F, Fut>(spec: ToolSpec, tool: F) -> Tool
    where
        F: Fn(Arguments) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ToolError>> + Send + 'static,
    {
        Tool::from_async(spec, tool)
    }

    /// A blocking tool from any [`SyncTool`], such as a struct holding an environment.
    pub fn from_sync(spec: ToolSpec, tool: impl SyncTool) -> Tool {
        Tool {
            spec,
            runner: Runner::Sync(Arc::new(tool)),
            timeout: None,
        }
    }

    /// An async tool from any [`AsyncTool`], such as a struct holding a client.
    pub fn from_async(spec: ToolSpec, tool: impl AsyncTool) -> Tool {
        Tool {
            spec,
            runner: Runner::Async(Arc::new(tool)),
            timeout: None,
        }
    }

    /// A tool with an instance per rollout, from any [`RolloutTool`].
    pub fn per_rollout(spec: ToolSpec, tool: impl RolloutTool) -> Tool {
        Tool {
            spec,
            runner: Runner::PerRollout(Arc::new(tool)),
            timeout: None,
        }
    }

    /// Overrides the dispatcher's default per-call timeout for this tool.
    pub fn timeout(mut self, timeout: Duration) -> Tool {
        self.timeout = Some(timeout);
        self
    }

    /// The tool's spec.
    pub fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// Whether the tool runs on the thread pool.
    pub fn is_sync(&self) -> bool {
        matches!(self.runner, Runner::Sync(_))
    }

    /// Whether each rollout gets an instance of its own ([`Tool::per_rollout`]).
    pub fn is_per_rollout(&self) -> bool {
        matches!(self.runner, Runner::PerRollout(_))
    }

    /// What a per-rollout tool still releases in the background ([`RolloutTool::settle`]).
    pub(crate) fn settle(&self) -> Option<BoxFuture<'static, ()>> {
        match &self.runner {
            Runner::PerRollout(tool) => Some(tool.settle()),
            Runner::Sync(_) | Runner::Async(_) => None,
        }
    }

    /// Sessions a per-rollout tool lost part-way ([`RolloutTool::sessions_lost`]); 0 for
    /// other tools.
    pub(crate) fn sessions_lost(&self) -> u64 {
        match &self.runner {
            Runner::PerRollout(tool) => tool.sessions_lost(),
            Runner::Sync(_) | Runner::Async(_) => 0,
        }
    }

    /// This tool as one rollout runs it: its own instance when it is per rollout, else
    /// itself.
    pub(crate) fn for_rollout(&self) -> Tool {
        match &self.runner {
            Runner::PerRollout(tool) => Tool {
                runner: Runner::Async(tool.open()),
                ..self.clone()
            },
            Runner::Sync(_) | Runner::Async(_) => self.clone(),
        }
    }
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.spec.name)
            .field(
                "kind",
                &match self.runner {
                    Runner::Sync(_) => "sync",
                    Runner::Async(_) => "async",
                    Runner::PerRollout(_) => "per rollout",
                },
            )
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// One tool call as the model emitted it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id, echoed in the tool message (`tool_call_id`), when the format has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// A JSON object, or a string holding one (the OpenAI wire format sends a string).
    #[serde(default)]
    pub arguments: Value,
}

impl ToolCall {
    /// A call without an id.
    pub fn new(name: impl Into<String>, arguments: Value) -> ToolCall {
        ToolCall {
            id: None,
            name: name.into(),
            arguments,
        }
    }

    /// Sets the call id.
    pub fn with_id(mut self, id: impl Into<String>) -> ToolCall {
        self.id = Some(id.into());
        self
    }
}

/// How a call ended. Every outcome still yields a message the model can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// The tool returned a value.
    Ok,
    /// No tool has that name.
    UnknownTool,
    /// The arguments were not a JSON object or did not fit the tool's schema.
    InvalidArguments,
    /// The tool returned an error.
    Failed,
    /// The tool panicked; the panic was caught.
    Panicked,
    /// The call took longer than its timeout; a sync tool's thread may still be running it.
    TimedOut,
    /// The dispatcher shut down before the call ran (or before it finished, past the deadline).
    Cancelled,
    /// The tool's backend could not serve the call ([`Unavailable`]).
    Unavailable,
}

impl Outcome {
    /// The outcome's name as used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::UnknownTool => "unknown_tool",
            Outcome::InvalidArguments => "invalid_arguments",
            Outcome::Failed => "failed",
            Outcome::Panicked => "panicked",
            Outcome::TimedOut => "timed_out",
            Outcome::Cancelled => "cancelled",
            Outcome::Unavailable => "unavailable",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The result of one call: the content of the tool message, and how the call went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The id of the call this answers.
    pub call_id: Option<String>,
    /// The tool's name, as called.
    pub name: String,
    /// The tool message content: the tool's output, or `{"error": "..."}`.
    pub content: String,
    /// How the call ended.
    pub outcome: Outcome,
    /// From the start of the call to its result.
    #[serde(with = "duration_micros")]
    pub latency: Duration,
    /// Time a sync call waited for a pool thread (zero for async tools).
    #[serde(with = "duration_micros")]
    pub queue_wait: Duration,
}

impl ToolResult {
    /// Whether the tool returned a value.
    pub fn is_ok(&self) -> bool {
        self.outcome == Outcome::Ok
    }

    /// The chat message for this result: `{"role": "tool", "tool_call_id", "name", "content"}`.
    pub fn to_message(&self) -> Value {
        let mut message = json!({ "role": "tool", "name": self.name, "content": self.content });
        if let Some(id) = &self.call_id {
            message["tool_call_id"] = Value::String(id.clone());
        }
        message
    }
}

/// The tool message content of an error: `{"error": "..."}`.
pub(crate) fn error_content(message: &str) -> String {
    json!({ "error": message }).to_string()
}

/// The tool message content of a value: strings as they are, anything else as JSON.
pub(crate) fn value_content(value: Value) -> String {
    match value {
        Value::String(text) => text,
        other => other.to_string(),
    }
}

mod duration_micros {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}
