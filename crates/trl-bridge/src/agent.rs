//! Loop-owning agents (`agent=`): every rollout is run by an agent that owns its loop and
//! talks to the worker's recording proxy as if it were an OpenAI server, while the engine
//! samples each of its turns (harness's proxy: one listener per worker, a key per rollout,
//! lossless capture, the same limits and model versions as any turn).
//!
//! Two forms, as the Python side hands them over ([`AgentSource`]):
//!
//! - a **program**: the binary's `[agent]` table as a mapping (harness's
//!   [`ProgramConfig`], its keys and checks), run per rollout attempt in a fresh private
//!   directory inside the sandbox, reaching only its proxy through the bridge's own
//!   forwarder ([`forward`], run as `python -c ...` inside the sandbox);
//! - a **Python callable** ([`PyAgent`]), sync or `async def`, called once per rollout
//!   attempt with the task (the dataset row), the proxy's `base_url`, the rollout's `api_key`
//!   and a fresh working directory (`async_grpo._agent`). An `async def` one runs on the
//!   worker's asyncio loop and is cancelled when the attempt is dropped (its deadline, a
//!   drain); a sync one runs on a blocking thread of the engine's runtime, holding the GIL
//!   only while Python runs, and its key is revoked when the attempt is dropped, so that its
//!   next request fails and it ends. A number it returns is its reward (the `env` column
//!   unless an environment's verify judges the rollout), also kept as the row's
//!   `agent_reward` metric; what it raises fails that attempt only.

use std::{path::PathBuf, sync::Arc};

use futures::future::BoxFuture;
use harness::{agent::ProgramConfig, proxy::Proxy};
use process::Sandbox;
use pyo3::prelude::*;
use rollout::{Agent, AgentError, AgentOutcome, AgentRun, Verdict};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::callables::PyFunction;

/// The agent as the Python side described it, checked at construction.
pub(crate) enum AgentSource {
    /// The `[agent]` table of the binary, its programs found and its sandbox checked.
    Program(Box<ProgramConfig>),
    /// A Python callable.
    Python {
        function: PyFunction,
        /// Whether it returns an awaitable.
        is_async: bool,
        /// The weight of the `env` column its return value gives.
        weight: f64,
    },
}

impl AgentSource {
    /// A program from the `[agent]` table as JSON text: its keys read as the binary reads
    /// them (an unknown one refused), its values checked, its programs found (a relative
    /// path from `base`, the current directory), its sandbox available here; it reaches its
    /// proxy through `forwarder`. The error is the message, naming the key.
    pub(crate) fn program(
        json: &str,
        base: &std::path::Path,
        forwarder: Vec<String>,
        sandbox: &Sandbox,
    ) -> Result<AgentSource, String> {
        let deserializer = &mut serde_json::Deserializer::from_str(json);
        let mut config: ProgramConfig =
            serde_path_to_error::deserialize(deserializer).map_err(|e| {
                // Where in the JSON text is no help to whoever wrote a mapping.
                let problem = e.inner().to_string();
                let problem = problem
                    .split_once(" at line ")
                    .map_or(problem.as_str(), |(problem, _)| problem);
                match e.path().to_string().as_str() {
                    "." => problem.to_owned(),
                    _ if problem.starts_with("unknown field") => problem.to_owned(),
                    path => format!("{path}: {problem}"),
                }
            })?;
        config.validate().map_err(|e| e.to_string())?;
        for (key, argv) in config.command_lines_mut() {
            process::resolve_command(base, argv).map_err(|e| format!("{key}: {e}"))?;
        }
        config
            .sandbox_in(sandbox)
            .check()
            .map_err(|e| e.to_string())?;
        config.forwarder = Some(forwarder);
        Ok(AgentSource::Program(Box::new(config)))
    }

    /// The weight of the `env` column this agent gives when no environment judges it (the
    /// program's `weight` when it verifies), if it gives one.
    pub(crate) fn env_weight(&self) -> Option<f64> {
        match self {
            AgentSource::Program(config) => config.verifies().then_some(config.weight),
            AgentSource::Python { weight, .. } => Some(*weight),
        }
    }

    /// The loop's agent, run against `proxy`, its programs in `sandbox`.
    pub(crate) fn build(
        self,
        proxy: Arc<Proxy>,
        sandbox: Sandbox,
    ) -> Result<Arc<dyn Agent>, String> {
        Ok(match self {
            AgentSource::Program(config) => Arc::new(
                config
                    .agent(proxy, sandbox)
                    .map_err(|e| format!("agent: {e}"))?,
            ),
            AgentSource::Python {
                function, is_async, ..
            } => Arc::new(PyAgent {
                function,
                is_async,
                proxy,
            }),
        })
    }
}

/// A Python callable as the loop's agent; see the [module docs](self).
#[derive(Clone)]
struct PyAgent {
    function: PyFunction,
    is_async: bool,
    proxy: Arc<Proxy>,
}

/// What `async_grpo._agent` read from the callable's return value.
#[derive(Deserialize)]
struct Returned {
    reward: Option<f64>,
}

impl Agent for PyAgent {
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>> {
        let this = self.clone();
        Box::pin(async move { this.attempt(run).await })
    }
}

impl PyAgent {
    async fn attempt(self, run: AgentRun) -> Result<AgentOutcome, AgentError> {
        // Dropped with this future (the attempt's deadline, a drain): the key is revoked then.
        let session = self
            .proxy
            .try_session(run.sampler)
            .map_err(|e| AgentError(e.to_string()))?;
        let payload = json!({
            "task": Value::Object(run.row.to_json()),
            "base_url": session.base_url(),
            "api_key": session.key(),
            "episode_id": run.episode_id,
        })
        .to_string();
        let answered = if self.is_async {
            self.function.call_on_loop("agent", payload).await
        } else {
            let function = self.function.clone();
            tokio::task::spawn_blocking(move || function.call_here("call_agent", payload))
                .await
                .map_err(|e| AgentError(format!("the agent's thread was lost: {e}")))?
        };
        let transcript = session.finish().await;
        let text = answered.map_err(|e| AgentError(e.to_string()))?;
        let returned: Returned = serde_json::from_str(&text)
            .map_err(|e| AgentError(format!("the bridge answered no result: {e}")))?;
        let stats = transcript.stats;
        let mut outcome = AgentOutcome::new(transcript.prompt, transcript.completion)
            .tool_calls(stats.tool_calls);
        let metrics = &mut outcome.metrics;
        metrics.insert("capture_reused_turns".into(), stats.reused_turns as f64);
        metrics.insert("capture_rendered_turns".into(), stats.rendered_turns as f64);
        metrics.insert("capture_limited_turns".into(), stats.limited as f64);
        if let Some(reward) = returned.reward {
            metrics.insert("agent_reward".into(), reward);
        }
        Ok(outcome.verdict(Verdict {
            reward: returned.reward,
            ..Verdict::default()
        }))
    }
}

/// `async_grpo._native.agent_forward(argv)`: the forwarder a sandboxed program agent runs
/// under, `--port P --socket S -- COMMAND...` (see `harness::agent::forward`); returns the
/// agent's exit code (128 + the signal that killed it).
#[pyfunction]
pub(crate) fn agent_forward(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    let usage = || {
        pyo3::exceptions::PyValueError::new_err(
            "agent_forward: expected --port PORT --socket PATH -- COMMAND...",
        )
    };
    let (port, socket, command) = match argv.as_slice() {
        [flag_port, port, flag_socket, socket, dashes, command @ ..]
            if flag_port == "--port"
                && flag_socket == "--socket"
                && dashes == "--"
                && !command.is_empty() =>
        {
            (
                port.parse::<u16>().map_err(|_| usage())?,
                PathBuf::from(socket),
                command.to_vec(),
            )
        }
        _ => return Err(usage()),
    };
    py.detach(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let status = runtime.block_on(harness::agent::forward(port, socket, &command))?;
        Ok(status.code().unwrap_or_else(|| {
            128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0)
        }))
    })
    .map_err(|e: std::io::Error| {
        pyo3::exceptions::PyOSError::new_err(format!("agent_forward: {e}"))
    })
}
