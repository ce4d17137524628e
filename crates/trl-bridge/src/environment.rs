//! Python environments (`environment=`): an object of OpenEnv's session-factory shape, made
//! into a [`harness::SyncSessionFactory`] that the engine drives white-box.
//!
//! The factory's `create(task, seed=..., episode_id=...)` and every session method
//! (`initial_messages`, `list_tools`, `call_tool`, `verify`, `close`) run where the harness
//! runs blocking sessions: on the tool pool's threads, which take the GIL only while Python
//! runs. The `bridge` (Python's `async_grpo._callables.Bridge`) does the calling and the
//! reading of what Python returns (OpenEnv's `ToolResult` and `VerifyResult`, dicts, plain
//! values; awaitables are awaited on the worker's asyncio loop) and hands back JSON, which
//! this module turns into the harness's types.

use std::{collections::BTreeMap, sync::Arc};

use harness::{
    SessionError, SyncSession, SyncSessionFactory, Task, ToolOutput, Verification, step_reward,
};
use pyo3::{prelude::*, types::PyTuple};
use rollout_core::Message;
use serde::{Deserialize, de::DeserializeOwned};
use serde_json::{Map, Value};
use tool_dispatch::ToolSpec;

use crate::callables::Bridge;

/// The Python factory behind `environment=`, with the bridge that calls it.
#[derive(Debug)]
pub(crate) struct PyEnvironment {
    bridge: Arc<Bridge>,
    factory: Arc<Py<PyAny>>,
    /// The factory's class name, for messages.
    name: Arc<str>,
}

impl PyEnvironment {
    pub(crate) fn new(bridge: Arc<Bridge>, factory: Py<PyAny>, name: &str) -> PyEnvironment {
        PyEnvironment {
            bridge,
            factory: Arc::new(factory),
            name: Arc::from(name),
        }
    }

    /// The name it goes by in messages.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// A tool as the bridge lists it (from OpenEnv's MCP `Tool`, a dict, or OpenAI's shape).
#[derive(Deserialize)]
struct ListedTool {
    name: String,
    #[serde(default)]
    description: String,
    parameters: Value,
}

/// A tool call's result as the bridge reads it (OpenEnv's `ToolResult`, or a plain value).
#[derive(Deserialize)]
struct CallResult {
    content: Value,
    #[serde(default)]
    done: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    metadata: Map<String, Value>,
}

/// A verification as the bridge reads it (OpenEnv's `VerifyResult`, a number, or `None`).
#[derive(Deserialize)]
struct VerifyResult {
    env_reward: Option<f64>,
    #[serde(default)]
    done: bool,
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    /// `artifacts`, and metrics that are not numbers under `metrics`.
    #[serde(default)]
    artifacts: Map<String, Value>,
}

/// JSON the bridge produced, read as `T`; a mismatch is the environment's fault.
fn read<T: DeserializeOwned>(what: &str, json: &str) -> Result<T, SessionError> {
    serde_json::from_str(json).map_err(|e| SessionError::new(format!("{what}: {e}")))
}

/// Calls `bridge.<method>(*args)` holding the GIL only for the call: `Ok(text)` when Python
/// answered `(True, text)`, a session error with Python's message when it answered
/// `(False, message)`, a fatal one when the bridge itself failed.
fn call_bridge(
    bridge: &Py<PyAny>,
    name: &str,
    method: &str,
    args: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyTuple>>,
) -> Result<(bool, Py<PyAny>), SessionError> {
    Python::attach(|py| -> PyResult<(bool, Py<PyAny>)> {
        bridge.call_method1(py, method, args(py)?)?.extract(py)
    })
    .map_err(|e| SessionError::fatal(format!("{name}: the bridge failed in {method}: {e}")))
}

/// A `(False, message)` answer as the session error it is.
fn refused(answer: Py<PyAny>) -> SessionError {
    let message = Python::attach(|py| {
        answer
            .extract::<String>(py)
            .unwrap_or_else(|e| format!("(an unreadable error: {e})"))
    });
    SessionError::new(message)
}

/// A `(True, text)` answer's text.
fn text(name: &str, answer: Py<PyAny>) -> Result<String, SessionError> {
    Python::attach(|py| answer.extract::<String>(py))
        .map_err(|e| SessionError::fatal(format!("{name}: the bridge answered no text: {e}")))
}

impl SyncSessionFactory for PyEnvironment {
    fn create(&self, task: &Task) -> Result<Box<dyn SyncSession>, SessionError> {
        let row = Value::Object(task.row.clone()).to_string();
        let (ok, answer) = call_bridge(self.bridge.object(), &self.name, "create_session", |py| {
            (
                self.factory.clone_ref(py),
                self.name.as_ref(),
                row,
                task.seed,
                task.episode_id.as_str(),
            )
                .into_pyobject(py)
        })?;
        if !ok {
            return Err(refused(answer));
        }
        let (session, messages, tools) =
            Python::attach(|py| answer.extract::<(Py<PyAny>, String, String)>(py)).map_err(
                |e| {
                    SessionError::fatal(format!(
                        "{}: the bridge answered no session: {e}",
                        self.name
                    ))
                },
            )?;
        let session = PySession {
            bridge: Arc::clone(&self.bridge),
            session,
            name: Arc::clone(&self.name),
            initial: Vec::new(),
            tools: Vec::new(),
        };
        match session.described(&messages, &tools) {
            Ok(session) => Ok(Box::new(session)),
            Err((session, error)) => {
                // Created but unusable: it still holds what it holds until closed.
                session.close();
                Err(error)
            }
        }
    }
}

/// One Python session: its initial messages and tools, read once when it was created.
struct PySession {
    bridge: Arc<Bridge>,
    session: Py<PyAny>,
    name: Arc<str>,
    initial: Vec<Message>,
    tools: Vec<ToolSpec>,
}

impl PySession {
    /// The session with the initial messages and tools the bridge read from it, or the
    /// session back with why they do not make sense.
    fn described(
        mut self,
        messages: &str,
        tools: &str,
    ) -> Result<PySession, (PySession, SessionError)> {
        let name = Arc::clone(&self.name);
        let messages: Vec<Message> = match read(&format!("{name}: initial_messages()"), messages) {
            Ok(messages) => messages,
            Err(error) => return Err((self, error)),
        };
        let tools: Vec<ListedTool> = match read(&format!("{name}: list_tools()"), tools) {
            Ok(tools) => tools,
            Err(error) => return Err((self, error)),
        };
        self.initial = messages;
        self.tools = tools
            .into_iter()
            .map(|tool| ToolSpec::new(tool.name, tool.description).parameters(tool.parameters))
            .collect();
        Ok(self)
    }

    fn call(
        &self,
        method: &str,
        args: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyTuple>>,
    ) -> Result<String, SessionError> {
        let (ok, answer) = call_bridge(self.bridge.object(), &self.name, method, args)?;
        if ok {
            text(&self.name, answer)
        } else {
            Err(refused(answer))
        }
    }
}

impl SyncSession for PySession {
    fn initial_messages(&self) -> Vec<Message> {
        self.initial.clone()
    }

    fn tools(&self) -> Vec<ToolSpec> {
        self.tools.clone()
    }

    fn call_tool(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
    ) -> Result<ToolOutput, SessionError> {
        let arguments = Value::Object(arguments).to_string();
        let json = self.call("session_call_tool", |py| {
            (
                self.session.clone_ref(py),
                self.name.as_ref(),
                tool,
                arguments,
            )
                .into_pyobject(py)
        })?;
        let result: CallResult = read(&format!("{}: call_tool({tool})", self.name), &json)?;
        // OpenEnv keeps a step's reward in the result's metadata or in its data.
        let reward = step_reward(&result.metadata)
            .or_else(|| result.content.as_object().and_then(step_reward));
        Ok(ToolOutput {
            content: result.content,
            done: result.done,
            error: result.error,
            metadata: result.metadata,
            reward,
        })
    }

    fn verify(&self, transcript: &[Message]) -> Result<Verification, SessionError> {
        let transcript = serde_json::to_string(transcript)
            .map_err(|e| SessionError::new(format!("{}: the transcript: {e}", self.name)))?;
        let json = self.call("session_verify", |py| {
            (self.session.clone_ref(py), self.name.as_ref(), transcript).into_pyobject(py)
        })?;
        let result: VerifyResult = read(&format!("{}: verify()", self.name), &json)?;
        Ok(Verification {
            env_reward: result.env_reward,
            done: result.done,
            metrics: result.metrics,
            artifacts: result.artifacts,
        })
    }

    fn close(&self) {
        // The bridge logs what `close()` raised; there is nothing else to do with it here.
        if let Err(error) = self.call("session_close", |py| {
            (self.session.clone_ref(py), self.name.as_ref()).into_pyobject(py)
        }) {
            tracing::warn!(environment = %self.name, %error, "closing a session failed");
        }
    }
}
