//! `NativeEngine` (Python's `async_grpo._native.Engine`): the rollout loop on a tokio runtime
//! of its own, as the Python worker drives it.
//!
//! Construction checks everything that can be checked without a server (the tokenizer and
//! its chat template, the settings, every dataset row, the output to resume, the tools and
//! rewards) and raises `ValueError` naming the argument or setting; the run itself is an
//! [`async_grpo_run::RunSpec`], as the binary's is. [`NativeEngine::start`] opens
//! the output and starts the runtime and a driver task: it waits for the servers, starts the
//! loop on the run's [`Plan`](files::data::Plan), and forwards scored groups to a channel
//! of one group that the worker's pump thread reads with [`NativeEngine::next_group`], never
//! holding the GIL while it waits. Once the pump has handed a group to the trainer,
//! [`NativeEngine::delivered`] writes it to the output (on the pump's thread, without the
//! GIL: never on the runtime's). [`NativeEngine::shutdown`] drains the loop;
//! [`NativeEngine::close`] joins the runtime's threads; [`NativeEngine::finish_output`]
//! closes the output.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_grpo_run::{
    DatasetSource, Destination, RunSpec, Running, Servers, SpecError, ToolPool,
    rows::{Backlog, Pusher, RowStream, ServeRows},
};
use files::{data::Plan, output::Output};
use harness::{Harness, HarnessConfig};
use numpy::{PyArray1, PyArrayMethods};
use process::Sandbox;
use pyo3::{
    exceptions::{PyOSError, PyRuntimeError, PyValueError},
    prelude::*,
    types::{PyDict, PyList},
};
use rollout::{DrainReport, Engine, ScoredGroup};
use rollout_core::{ExpertDtype, TrainingSample};
use scoring::{Reward, ScorerConfig};
use serde_json::Value;
use tokio::{runtime::Runtime, sync::mpsc, task::JoinHandle};
use tool_dispatch::{Registry, Tool, ToolSpec, builtin::ToolConfig};
use vllm_client::Client;

use crate::{
    agent::AgentSource,
    callables::{AsyncPyReward, AsyncPyTool, Bridge, Place, PyFunction, SyncPyReward, SyncPyTool},
    data,
    environment::PyEnvironment,
    lane::Lane,
    lock,
    pool::{Pool, PoolSpec},
    settings::Settings,
};

/// A `ValueError` naming the argument at fault.
fn bad(argument: &str, message: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{argument}: {message}"))
}

/// Everything the loop needs, checked at construction and consumed by [`NativeEngine::start`].
struct Prepared {
    /// The run: its settings, tokenizer, servers, tools, rewards, environment or agent.
    spec: RunSpec,
    dataset: DatasetSource,
    /// The run's passes over `dataset`, less the groups a resumed output holds.
    plan: Plan,
    /// Where delivered groups are written, if anywhere.
    destination: Option<Destination>,
    runtime_threads: usize,
    /// How much lower than the trainer's the engine's threads and processes run.
    nice: i32,
    /// The worker processes, started by the driver (so that they inherit its priority).
    pool: Option<Arc<Pool>>,
    /// The row stream to serve instead of handing groups to Python.
    rows: Option<ServeRows>,
}

/// What the driver task and the Python side share.
#[derive(Default)]
struct State {
    /// The loop, once the servers answered and it started.
    engine: Mutex<Option<Arc<Engine<Client>>>>,
    /// The client, for its retry counters.
    client: Mutex<Option<Client>>,
    /// The latest model version set, applied when the loop starts.
    version: AtomicU64,
    /// Why the loop failed or stopped early.
    error: Mutex<Option<String>>,
    /// Whether a shutdown was asked for: the loop ending is then expected.
    stopping: AtomicBool,
    /// The drain's report: the first shutdown runs it, later calls read it.
    report: tokio::sync::Mutex<Option<DrainReport>>,
    /// The row stream, once [`NativeEngine::start`] served it.
    rows: OnceLock<RowStream>,
}

impl State {
    fn engine(&self) -> Option<Arc<Engine<Client>>> {
        lock(&self.engine).clone()
    }

    fn fail(&self, message: String) {
        let mut error = lock(&self.error);
        if error.is_none() {
            tracing::error!(%message, "the rollout engine failed");
            *error = Some(message);
        }
    }

    /// Drains the loop once; later calls get the same report.
    async fn shutdown(&self, engine: &Engine<Client>, deadline: Duration) -> DrainReport {
        let mut report = self.report.lock().await;
        match report.as_ref() {
            Some(done) => done.clone(),
            None => {
                let done = engine.shutdown(deadline).await;
                *report = Some(done.clone());
                done
            }
        }
    }
}

/// The rollout engine behind `async_grpo.RolloutWorker` (`async_grpo._native.Engine`, in Python).
#[pyclass(frozen, name = "Engine", module = "async_grpo._native")]
pub(crate) struct NativeEngine {
    prepared: Mutex<Option<Prepared>>,
    runtime: Mutex<Option<Runtime>>,
    handle: OnceLock<tokio::runtime::Handle>,
    state: Arc<State>,
    groups: Mutex<Option<mpsc::Receiver<ScoredGroup>>>,
    driver: Mutex<Option<JoinHandle<()>>>,
    /// The output, from [`NativeEngine::start`] to [`NativeEngine::finish_output`].
    output: Mutex<Option<Output>>,
    /// The last group [`NativeEngine::next_group`] handed out, written once
    /// [`NativeEngine::delivered`].
    handed: Mutex<Option<ScoredGroup>>,
    /// The worker processes of sync tools and rewards, if any: started by [`NativeEngine::start`],
    /// killed by [`NativeEngine::close`].
    pool: Option<Arc<Pool>>,
    /// The names of `reward_funcs`' functions, in order.
    reward_names: Vec<String>,
    /// The row stream's end [`NativeEngine::forward`] pushes through, once started.
    pusher: OnceLock<Pusher>,
    /// A resumed output's groups no trainer acknowledged, served again by the first
    /// [`NativeEngine::forward`].
    backlog: Mutex<Option<Backlog>>,
}

/// How a refusal of the row stream says to set its token.
const SET_ROWS_TOKEN: &str = "serve_rows_token= (or ASYNC_GRPO_ROWS_TOKEN)";

/// A tool as the Python side describes it: name, description, JSON schema of the
/// parameters (text), the callable, whether it is async, and, for a sync one the worker
/// processes run, its place in their init frame.
type ToolSpecTuple = (String, String, String, Py<PyAny>, bool, Option<usize>);
/// A reward function: name, the callable, whether it is async, its weight, and its place in
/// the worker processes' init frame when they run it.
type RewardTuple = (String, Py<PyAny>, bool, f64, Option<usize>);
/// The worker processes for sync tools and rewards: the Python interpreter, the frame each
/// process starts from, how many processes.
type PoolTuple = (PathBuf, Vec<u8>, usize);
/// An environment: its name (for messages), the session factory, the weight of its reward.
type EnvironmentTuple = (String, Py<PyAny>, f64);
/// A loop-owning agent: a program (the `[agent]` table as JSON text, the directory its
/// relative paths are from, the forwarder's command line), or a Python callable (its name,
/// the callable, whether it is async, the weight of the `env` column its return gives).
type AgentProgramTuple = (String, PathBuf, Vec<String>);
type AgentFunctionTuple = (String, Py<PyAny>, bool, f64);
/// A reward given as a table (`{"kind": "judge", ...}`, or `{"spec": "numeric:answer"}` for
/// a string): its place among `reward_funcs`, its settings as JSON, and `reward_weights`'
/// weight for it if that was given.
type RewardTableTuple = (usize, String, Option<f64>);

/// A built-in tool given as a table among `tools=` (a dict with a `kind`): its place among
/// them, and its settings as JSON (the keys of a `[[tools]]` table).
type ToolTableTuple = (usize, String);

#[pymethods]
impl NativeEngine {
    #[new]
    #[pyo3(signature = (
        *, bridge, tokenizer, servers, model, dataset_rows, dataset_path, tools, rewards,
        environment, settings, pool = None, agent_program = None, agent_function = None,
        reward_tables = Vec::new(), tool_tables = Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bridge: Py<PyAny>,
        tokenizer: crate::tokenizer::TokenizerSource,
        servers: Vec<String>,
        model: Option<String>,
        dataset_rows: Option<Vec<String>>,
        dataset_path: Option<PathBuf>,
        tools: Vec<ToolSpecTuple>,
        rewards: Vec<RewardTuple>,
        environment: Option<EnvironmentTuple>,
        settings: &Bound<'_, PyDict>,
        pool: Option<PoolTuple>,
        agent_program: Option<AgentProgramTuple>,
        agent_function: Option<AgentFunctionTuple>,
        reward_tables: Vec<RewardTableTuple>,
        tool_tables: Vec<ToolTableTuple>,
    ) -> PyResult<NativeEngine> {
        if servers.is_empty() {
            return Err(bad("vllm_server_url", "give at least one server URL"));
        }
        let Settings {
            engine: mut config,
            bridge: settings,
        } = read_settings(py, settings)?;
        let chat_tokenizer = py
            .detach(|| tokenizer.load())
            .map_err(|e| bad("processing_class", e))?;
        let hidden_dataset = dataset_path.clone();
        let (dataset, scanned) = py
            .detach(|| data::read_dataset(dataset_rows, dataset_path))
            .map_err(|e| bad("dataset", e))?;
        let destination = match settings.output.clone() {
            Some(path) => Some(
                py.detach(|| data::destination(path, settings.resume))
                    .map_err(|e| bad("output", e))?,
            ),
            None => None,
        };
        // Like the binary's `--groups`, `groups` counts the whole run's groups: those a
        // resumed output holds are of them.
        let rows = settings
            .rows_spec()
            .map(|spec| py.detach(|| spec.resolve(SET_ROWS_TOKEN)))
            .transpose()
            .map_err(|e| bad(e.key, e.message))?;
        if rows.is_some() {
            // The stream's capacity is the run's buffer, as the binary's: groups waiting in
            // the engine's own would be invisible to the trainer, and older when it reads them.
            config.output_buffer = 1;
        }
        let plan_spec = data::plan_spec(&settings, config.sampling.seed, config.max_groups);
        let run_plan = data::plan(&plan_spec, scanned.rows, destination.as_ref())
            .map_err(PyValueError::new_err)?;
        config.max_groups = run_plan.max_groups;

        let bridge = Arc::new(Bridge::new(py, bridge)?);
        let lane = settings
            .python_tool_threads
            .map(|permits| Arc::new(Lane::new(permits)));
        let pool = pool.map(|(python, init, processes)| {
            Arc::new(Pool::new(PoolSpec {
                python,
                init,
                processes,
            }))
        });
        let places = Places {
            pool: pool.as_ref(),
            lane: lane.as_ref(),
        };
        // What an agent's programs, a built-in tool's (and a sandboxed `command` reward) must
        // not read: the worker's dataset (its answers) and output.
        let sandbox = hidden_dataset
            .into_iter()
            .chain(destination.iter().flat_map(Destination::files))
            .fold(Sandbox::default(), Sandbox::hide);
        let registry = tool_registry(
            &bridge,
            tools,
            tool_tables,
            &places,
            &sandbox,
            config.max_inflight,
        )?;
        let callables = reward_functions(&bridge, rewards, &places, settings.reward_timeout)?;
        let mut scored = with_tables(callables, reward_tables, &sandbox, settings.reward_timeout)?;
        data::check_columns(&scanned, &scored).map_err(PyValueError::new_err)?;
        let reward_names = scored.iter().map(|r| r.name().to_owned()).collect();
        let environment = python_environment(&bridge, environment, &registry, &mut scored)?;
        let agent = match (agent_program, agent_function) {
            (None, None) => None,
            (Some(_), Some(_)) => return Err(bad("agent", "a program or a callable, not both")),
            (Some((json, base, forwarder)), None) => Some(
                py.detach(|| AgentSource::program(&json, &base, forwarder, &sandbox))
                    .map_err(|e| bad("agent", e))?,
            ),
            (None, Some((name, function, is_async, weight))) => Some(AgentSource::Python {
                function: PyFunction::new(Arc::clone(&bridge), function, &name),
                is_async,
                weight,
            }),
        };
        if let Some(agent) = &agent {
            if !registry.is_empty() {
                return Err(bad(
                    "agent",
                    "an agent runs its own tools: give tools= or agent=, not both",
                ));
            }
            // The `env` column: an environment's verify when there is one (added above),
            // else what the agent's own verify or return value gives.
            if environment.is_none()
                && let Some(weight) = agent.env_weight()
            {
                if !weight.is_finite() {
                    return Err(bad(
                        "agent",
                        format!("weight: expected a finite number, got {weight}"),
                    ));
                }
                scored.push(scoring::builtin::environment().weight(weight));
            }
        }

        let tool_timeout = settings.tool_timeout;
        let mut spec = RunSpec::new(
            config,
            chat_tokenizer,
            Servers {
                urls: servers,
                model,
                root_certificates_pem: None,
            },
        )
        .tools(registry)
        .tool_pool(ToolPool {
            threads: settings.tool_threads,
            timeout: Some(tool_timeout),
            thread_name: Some("async-grpo-tool".to_owned()),
        })
        .rewards(scored)
        .scorer(
            ScorerConfig::default()
                .threads(2)
                .thread_name("async-grpo-reward"),
        );
        if let Some(environment) = environment {
            spec = spec.environment(Box::new(move |tools| {
                // Every session call runs on the tool pool's threads, bounded like a tool
                // call.
                let name = environment.name().to_owned();
                Arc::new(
                    Harness::new_sync(name, environment, tools)
                        .config(HarnessConfig::default().timeout(tool_timeout)),
                )
            }));
        }
        if let Some(agent) = agent {
            spec = spec.agent(Box::new(move |proxy| agent.build(proxy, sandbox)));
        }
        // Checked now, so that two rewards of one name fail here and not in a thread.
        spec.check().map_err(|e| match e {
            SpecError::Rewards(e) => bad("reward_funcs", e),
            e => PyValueError::new_err(e.to_string()),
        })?;
        Ok(NativeEngine {
            prepared: Mutex::new(Some(Prepared {
                spec,
                dataset,
                plan: run_plan.plan,
                destination,
                runtime_threads: settings.runtime_threads,
                nice: settings.nice,
                pool: pool.clone(),
                rows,
            })),
            runtime: Mutex::new(None),
            handle: OnceLock::new(),
            state: Arc::new(State::default()),
            groups: Mutex::new(None),
            driver: Mutex::new(None),
            output: Mutex::new(None),
            handed: Mutex::new(None),
            pool,
            reward_names,
            pusher: OnceLock::new(),
            backlog: Mutex::new(None),
        })
    }

    /// The names of `reward_funcs`' functions, in order: a callable's, or the one a reward
    /// table's kind gives (`numeric_answer`, `judge`, ...) unless it names its own.
    #[getter]
    fn reward_names(&self) -> Vec<String> {
        self.reward_names.clone()
    }

    /// Opens the output (created, or continued after its whole groups), starts the runtime,
    /// the row stream if one was asked for, and the loop (it waits for the servers in the
    /// background).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let mut slot = lock(&self.prepared);
        let Some(mut prepared) = slot.take() else {
            return Err(PyRuntimeError::new_err(
                "the engine was already started; a worker starts once",
            ));
        };
        if let Some(destination) = &prepared.destination {
            match py.detach(|| destination.open()) {
                Ok(output) => *lock(&self.output) = Some(output),
                Err(error) => {
                    *slot = Some(prepared);
                    return Err(PyOSError::new_err(format!("output: {error}")));
                }
            }
        }
        drop(slot);
        // Every thread of the runtime, and what they start (the tool and reward pools, the
        // worker processes), yields the CPU to the trainer's threads.
        let priority = below_this_thread(prepared.nice);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(prepared.runtime_threads)
            .thread_name("async-grpo-rt")
            .on_thread_start(move || set_thread_priority(priority))
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))?;
        if let Some(rows) = prepared.rows.take() {
            self.start_rows(&runtime, rows, prepared.destination.as_ref())?;
        }
        let (sender, receiver) = mpsc::channel(1);
        let state = Arc::clone(&self.state);
        let driver = py.detach(|| runtime.spawn(drive(prepared, state, sender)));
        let _ = self.handle.set(runtime.handle().clone());
        *lock(&self.groups) = Some(receiver);
        *lock(&self.driver) = Some(driver);
        *lock(&self.runtime) = Some(runtime);
        Ok(())
    }

    /// The next scored group, waiting up to `timeout` seconds without the GIL: `(False,
    /// group)`, `(False, None)` on a timeout, `(True, None)` once the loop has ended and
    /// every group was read. A group is `(samples, metrics, failure causes)`.
    fn next_group<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<(bool, Option<Bound<'py, PyAny>>)> {
        let Some(handle) = self.handle.get() else {
            return Err(PyRuntimeError::new_err("the engine was not started"));
        };
        match py.detach(|| self.receive(handle, timeout)) {
            Next::Timeout => Ok((false, None)),
            Next::Ended => Ok((true, None)),
            Next::Group(group) => {
                let python = group_to_python(py, &group)?;
                // Written once the pump says the trainer has it (`delivered`).
                *lock(&self.handed) = Some(group);
                Ok((false, Some(python)))
            }
        }
    }

    /// The group [`NativeEngine::next_group`] last returned reached the trainer: it is written
    /// to the output (one write and a flush), without the GIL, on the caller's thread (the
    /// pump's, never the runtime's). A group never said delivered (dropped by a stop with the
    /// buffer full) is not written, so a resumed run rolls it out again.
    fn delivered(&self, py: Python<'_>) -> PyResult<()> {
        let Some(group) = lock(&self.handed).take() else {
            return Ok(());
        };
        py.detach(|| self.write(&group))
    }

    /// With a row stream: the next scored group, waiting up to `timeout` seconds, written to
    /// the output and pushed to the stream (waiting while it holds its capacity
    /// unacknowledged), all without the GIL on the caller's thread (the pump's). `(False,
    /// (samples, pushed))`, `(False, None)` on a timeout, `(True, None)` once the loop has
    /// ended and every group was forwarded (the stream then closes: its readers' iterations
    /// end once they acknowledged every group); `pushed` is false once the stream no longer takes
    /// groups (a stop: the group is then in the output only). The first call serves again a
    /// resumed output's groups no trainer acknowledged.
    fn forward(&self, py: Python<'_>, timeout: f64) -> PyResult<(bool, Option<(usize, bool)>)> {
        let (Some(handle), Some(pusher)) = (self.handle.get(), self.pusher.get()) else {
            return Err(PyRuntimeError::new_err(
                "the engine serves no rows (serve_rows) or was not started",
            ));
        };
        py.detach(|| {
            let backlog = lock(&self.backlog).take();
            if let Some(backlog) = backlog {
                let restored = pusher
                    .restore(&backlog)
                    .map_err(|e| PyOSError::new_err(e.to_string()))?;
                if restored > 0 {
                    tracing::warn!(
                        restored,
                        "serving again the output's groups no trainer acknowledged"
                    );
                }
            }
            let group = match self.receive(handle, timeout) {
                Next::Timeout => return Ok((false, None)),
                Next::Ended => {
                    // No group comes any more: the readers' streams end once they have
                    // acknowledged what is left.
                    if let Some(rows) = self.state.rows.get() {
                        rows.close();
                    }
                    return Ok((true, None));
                }
                Next::Group(group) => group,
            };
            // Written first: a group the stream holds is in the file, for a resume.
            self.write(&group)?;
            let pushed = pusher
                .push(&group.samples)
                .map_err(|e| PyOSError::new_err(e.to_string()))?;
            Ok((false, Some((group.samples.len(), pushed))))
        })
    }

    /// Where the row stream listens (`HOST:PORT`), once started; `None` without one.
    #[getter]
    fn rows_address(&self) -> Option<String> {
        self.state.rows.get().map(|rows| rows.address().to_string())
    }

    /// Waits up to `timeout` seconds, without the GIL, for the trainer to acknowledge every
    /// group the row stream holds: whether it did (true without a stream).
    fn wait_rows(&self, py: Python<'_>, timeout: f64) -> bool {
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        let (Some(handle), Some(rows)) = (self.handle.get(), self.state.rows.get()) else {
            return true;
        };
        py.detach(|| {
            handle
                .block_on(async { tokio::time::timeout(wait, rows.settled()).await })
                .is_ok()
        })
    }

    /// Ends the row stream once the trainer acknowledged every group, or after `timeout`
    /// seconds: how many groups were left unacknowledged (in the output, served again by a
    /// resumed worker). Call after [`NativeEngine::shutdown`] and after the pump has stopped,
    /// before [`NativeEngine::close`].
    fn finish_rows(&self, py: Python<'_>, timeout: f64) -> usize {
        let (Some(handle), Some(rows)) = (self.handle.get(), self.state.rows.get()) else {
            return 0;
        };
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        py.detach(|| handle.block_on(rows.finish(wait)))
    }

    /// Closes the output (a Parquet output is written now, from its journal); returns the
    /// groups and samples this worker wrote to it (`(0, 0)` without one). Call once the pump
    /// has stopped. Idempotent.
    fn finish_output(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let Some(output) = lock(&self.output).take() else {
            return Ok((0, 0));
        };
        py.detach(|| output.finish())
            .map_err(|e| PyOSError::new_err(format!("output: {e}")))
    }

    /// Turns sampled from now on record `version`; with `max_staleness`, groups left too far
    /// behind are cancelled.
    fn set_model_version(&self, version: u64) {
        self.state.version.fetch_max(version, Ordering::AcqRel);
        if let Some(engine) = self.state.engine() {
            // A lower version is ignored, as TRL expects of a worker.
            let _ = engine.set_model_version(version);
        }
    }

    /// Pauses the loop for a weight update ([`Engine::pause`]): `mode` is `wait`, `abort` or
    /// `continue`; returns once the weights may change (no rollout in flight, or with
    /// `continue` no request on the wire). Whether the loop was running to pause.
    fn pause(&self, py: Python<'_>, mode: &str) -> PyResult<bool> {
        let mode: rollout::InFlight = mode.parse().map_err(PyValueError::new_err)?;
        let (Some(handle), Some(engine)) = (self.handle.get(), self.state.engine()) else {
            return Ok(false);
        };
        py.detach(|| handle.block_on(engine.pause(mode)));
        Ok(true)
    }

    /// Resumes the loop after [`NativeEngine::pause`]: the requests held are sent under the
    /// version current now.
    fn resume(&self) {
        if let Some(engine) = self.state.engine() {
            engine.resume();
        }
    }

    /// Why the engine failed or stopped early, if it did.
    fn error(&self) -> Option<String> {
        lock(&self.state.error).clone()
    }

    /// Whether the loop is running (the servers answered and it started).
    fn running(&self) -> bool {
        self.state.engine().is_some()
    }

    /// Counters and gauges, as the loop's [`Metrics::values`](rollout::Metrics)
    /// names them (the same numbers the binary's Prometheus endpoint serves): the loop's
    /// counters, failures by cause, the heartbeat's age and lag, rollouts in flight and queued,
    /// the client's retries, the tools'. Empty before the loop runs.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = PyDict::new(py);
        if let Some(engine) = self.state.engine() {
            for (key, value) in engine.metrics().values() {
                stats.set_item(key, value)?;
            }
        }
        Ok(stats)
    }

    /// Stops admission, lets rollouts in flight finish for up to `drain_timeout` seconds,
    /// cancels the rest, closes the tool pool; returns what the drain did. Idempotent.
    fn shutdown<'py>(&self, py: Python<'py>, drain_timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let deadline = Duration::from_secs_f64(drain_timeout.max(0.0));
        let report = PyDict::new(py);
        self.state.stopping.store(true, Ordering::Release);
        if let Some(rows) = self.state.rows.get() {
            // As after the binary's signal: a pump waiting for the trainer must not hold the
            // drain; what the stream does not take is in the output only.
            rows.close();
        }
        let Some(handle) = self.handle.get() else {
            return Ok(report);
        };
        let state = Arc::clone(&self.state);
        let driver = lock(&self.driver).take();
        let drained = py.detach(|| {
            handle.block_on(async move {
                let drained = match state.engine() {
                    Some(engine) => Some(state.shutdown(&engine, deadline).await),
                    None => None,
                };
                if let Some(driver) = driver {
                    if drained.is_none() {
                        // Still waiting for the servers: nothing to drain.
                        driver.abort();
                    }
                    let _ = driver.await;
                }
                drained
            })
        });
        if let Some(drained) = drained {
            report.set_item("clean", drained.clean)?;
            report.set_item("elapsed_s", drained.elapsed.as_secs_f64())?;
            report.set_item("cancelled_at_deadline", drained.cancelled_at_deadline)?;
            report.set_item("error", drained.error.clone())?;
            if let Some(tools) = &drained.tools {
                report.set_item("tool_calls_cancelled", tools.cancelled)?;
                report.set_item("tool_calls_still_running", tools.still_running)?;
                report.set_item("tool_threads_joined", tools.threads_joined)?;
                report.set_item("tool_threads_left_running", tools.threads_detached)?;
            }
        }
        Ok(report)
    }

    /// Cancels every rollout in flight at once (a drain under way then ends).
    fn cancel(&self) {
        if let Some(engine) = self.state.engine() {
            engine.cancel();
        }
    }

    /// Shuts the runtime down, waiting up to `timeout` seconds for its threads, and kills the
    /// worker processes. Call after [`NativeEngine::shutdown`] and after the pump thread has
    /// stopped reading.
    fn close(&self, py: Python<'_>, timeout: f64) {
        *lock(&self.groups) = None;
        let runtime = lock(&self.runtime).take();
        let engine = lock(&self.state.engine).take();
        let client = lock(&self.state.client).take();
        py.detach(|| {
            if let Some(runtime) = runtime {
                runtime.shutdown_timeout(Duration::from_secs_f64(timeout.max(0.0)));
            }
            // The last handles on the loop: its reward pool and tool pool go with it (a tool
            // thread still inside a call exits when the call returns).
            drop(engine);
            drop(client);
            // A tool thread still waiting on a worker process gets its error now.
            if let Some(pool) = &self.pool {
                pool.close();
            }
        });
    }
}

/// What [`NativeEngine::receive`] got.
enum Next {
    Group(ScoredGroup),
    Timeout,
    /// The loop has ended and every group was taken.
    Ended,
}

impl NativeEngine {
    /// The next scored group, waiting up to `timeout` seconds on the caller's thread (call it
    /// without the GIL).
    fn receive(&self, handle: &tokio::runtime::Handle, timeout: f64) -> Next {
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        let mut guard = lock(&self.groups);
        let Some(receiver) = guard.as_mut() else {
            return Next::Ended;
        };
        match handle.block_on(async { tokio::time::timeout(wait, receiver.recv()).await }) {
            Err(_) => Next::Timeout,
            Ok(Some(group)) => Next::Group(group),
            Ok(None) => {
                *guard = None;
                Next::Ended
            }
        }
    }

    /// Writes `group` to the output, if there is one (call it without the GIL).
    fn write(&self, group: &ScoredGroup) -> PyResult<()> {
        match lock(&self.output).as_mut() {
            Some(output) => output
                .write_group(&group.samples)
                .map_err(|e| PyOSError::new_err(format!("output: cannot write a group: {e}"))),
            None => Ok(()),
        }
    }

    /// Serves the row stream on `runtime`; its positions go on after the groups a resumed
    /// `destination` holds, and the acknowledgements are recorded beside it.
    fn start_rows(
        &self,
        runtime: &Runtime,
        rows: ServeRows,
        destination: Option<&Destination>,
    ) -> PyResult<()> {
        let _inside = runtime.enter();
        let first = destination.map_or(0, |d| d.resumed().done.len() as u64);
        let stream = RowStream::start(rows, first)
            .map_err(|e| PyOSError::new_err(format!("serve_rows: {e}")))?;
        if let Some(destination) = destination {
            let backlog = stream
                .record_to(destination.path(), destination.resumes())
                .map_err(|e| PyOSError::new_err(format!("output: {e}")))?;
            *lock(&self.backlog) = Some(backlog);
        }
        let _ = self.pusher.set(stream.pusher());
        let _ = self.state.rows.set(stream);
        Ok(())
    }
}

/// The driver: waits for the servers, starts the loop, forwards its groups; records why it
/// ended when it ended on its own.
async fn drive(prepared: Prepared, state: Arc<State>, groups_out: mpsc::Sender<ScoredGroup>) {
    if let Err(message) = run(prepared, &state, groups_out).await {
        state.fail(message);
    }
}

async fn run(
    prepared: Prepared,
    state: &State,
    groups_out: mpsc::Sender<ScoredGroup>,
) -> Result<(), String> {
    let Prepared {
        spec,
        dataset,
        plan,
        destination: _,
        runtime_threads: _,
        nice: _,
        pool,
        rows: _,
    } = prepared;
    if let Some(pool) = pool {
        // On a thread of the runtime's, whose priority the processes inherit.
        tokio::task::spawn_blocking(move || pool.start())
            .await
            .map_err(|e| format!("cannot start the Python worker processes: {e}"))?
            .map_err(|e| format!("cannot start the Python worker processes: {e}"))?;
    }
    let connected = spec.connect().await.map_err(|e| match e {
        SpecError::Client(e) => format!("vllm_server_url: {e}"),
        SpecError::NotReady { .. } => format!("the vLLM {e}"),
        e => e.to_string(),
    })?;
    *lock(&state.client) = Some(connected.client().clone());
    // A file is opened (a shuffled one read whole) off the runtime's threads.
    let items = tokio::task::spawn_blocking(move || dataset.items(plan))
        .await
        .map_err(|e| format!("the dataset's reader was lost: {e}"))?
        .map_err(|e| format!("dataset: {e}"))?;
    let Running {
        engine,
        mut groups,
        health_checks,
        ..
    } = connected.start(items).await.map_err(|e| e.to_string())?;
    // Published first, then the version applied: a version set in between reaches the loop
    // either way (versions only grow, so applying one twice is harmless).
    *lock(&state.engine) = Some(Arc::clone(&engine));
    let _ = engine.set_model_version(state.version.load(Ordering::Acquire));
    if let Some(rows) = state.rows.get() {
        // The trainer's versions, pauses and resumes over the stream reach the loop.
        rows.attach(Arc::clone(&engine));
    }
    while let Some(group) = groups.recv().await {
        if groups_out.send(group).await.is_err() {
            break;
        }
    }
    drop(health_checks);
    if state.stopping.load(Ordering::Acquire) {
        return Ok(());
    }
    // The loop ended on its own: the dataset is done, or the run stopped early.
    let report = state.shutdown(&engine, Duration::from_secs(5)).await;
    match report.error {
        Some(error) => Err(format!("the rollout loop stopped: {error}")),
        None => Ok(()),
    }
}

/// The nice value `nice` steps below the calling thread's (at most 19, the lowest).
fn below_this_thread(nice: i32) -> i32 {
    #[cfg(target_os = "linux")]
    {
        let now = rustix::process::getpriority_process(None).unwrap_or(0);
        now.saturating_add(nice).min(19)
    }
    #[cfg(not(target_os = "linux"))]
    nice
}

/// Sets the calling thread's nice value; threads and processes it starts inherit it. On
/// Linux a thread's nice value is its own (`setpriority(PRIO_PROCESS, 0)` changes the
/// calling thread only); elsewhere, where it would change the whole process, nothing.
fn set_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    if let Err(error) = rustix::process::setpriority_process(None, nice) {
        tracing::warn!(%error, nice, "cannot lower the engine's threads' priority");
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// The Python session factory as the engine's environment (its `env` column added to
/// `scored`); refused beside tools of `registry`, whose rollouts' tools are the sessions'.
fn python_environment(
    bridge: &Arc<Bridge>,
    environment: Option<EnvironmentTuple>,
    registry: &Registry,
    scored: &mut Vec<Reward>,
) -> PyResult<Option<PyEnvironment>> {
    Ok(match environment {
        None => None,
        Some(_) if !registry.is_empty() => {
            return Err(bad(
                "environment",
                "the rollouts' tools are the sessions' (list_tools()): give tools= or \
                 environment=, not both",
            ));
        }
        Some((name, factory, weight)) => {
            if !weight.is_finite() {
                return Err(bad(
                    "environment_weight",
                    format!("the weight must be finite, got {weight}"),
                ));
            }
            // What verify() found is the `env` column.
            scored.push(scoring::builtin::environment().weight(weight));
            Some(PyEnvironment::new(Arc::clone(bridge), factory, &name))
        }
    })
}

/// The settings mapping as JSON (what the simulator's settings go through too), read into
/// the engine's own types.
fn read_settings(py: Python<'_>, settings: &Bound<'_, PyDict>) -> PyResult<Settings> {
    let json: String = py
        .import("json")?
        .call_method1("dumps", (settings,))
        .and_then(|text| text.extract())
        .map_err(|e| bad("settings", format!("not JSON-like: {e}")))?;
    let value: Value = serde_json::from_str(&json).map_err(|e| bad("settings", e))?;
    Settings::read(&value).map_err(PyValueError::new_err)
}

/// Where sync Python functions can run: the worker processes, or here (through the lane
/// when there is one).
struct Places<'a> {
    pool: Option<&'a Arc<Pool>>,
    lane: Option<&'a Arc<Lane>>,
}

impl Places<'_> {
    /// The place of a function the Python side put at `index` of the pool's frame, or not.
    fn of(&self, name: &str, index: Option<usize>) -> PyResult<Place> {
        match (index, self.pool) {
            (Some(index), Some(pool)) => Ok(Place::Pool(Arc::clone(pool), index)),
            (Some(_), None) => Err(bad(name, "placed in worker processes, but there are none")),
            (None, _) => Ok(Place::Here(self.lane.cloned())),
        }
    }
}

/// The tools as the dispatcher's, in `tools=`' order: the Python callables, and the tables
/// (`{"kind": "python", "session": "rollout"}`) at their places among them, each built as
/// the binary builds a `[[tools]]` table, its programs in `sandbox`, a session-backed one
/// sized for `rollouts` in flight.
fn tool_registry(
    bridge: &Arc<Bridge>,
    tools: Vec<ToolSpecTuple>,
    tables: Vec<ToolTableTuple>,
    places: &Places<'_>,
    sandbox: &Sandbox,
    rollouts: usize,
) -> PyResult<Registry> {
    let mut callables = Vec::with_capacity(tools.len());
    for (name, description, parameters, function, is_async, index) in tools {
        let parameters: Value = serde_json::from_str(&parameters)
            .map_err(|e| bad("tools", format!("{name}: the JSON schema is not JSON: {e}")))?;
        let spec = ToolSpec::new(name.clone(), description).parameters(parameters);
        let function = PyFunction::new(Arc::clone(bridge), function, &name);
        callables.push(if is_async {
            Tool::from_async(spec, AsyncPyTool(function))
        } else {
            Tool::from_sync(spec, SyncPyTool(function, places.of(&name, index)?))
        });
    }
    let mut built = std::collections::BTreeMap::new();
    for (index, json) in tables {
        let place = format!("tools[{index}]");
        let config: ToolConfig =
            serde_json::from_str(&json).map_err(|e| bad(&place, e.to_string()))?;
        let tool = config
            .build_for(sandbox, rollouts)
            .map_err(|e| bad(&place, e.to_string()))?;
        if let Some(program) = config.sandbox_in(sandbox) {
            program.check().map_err(|e| bad(&place, e.to_string()))?;
        }
        built.insert(index, tool);
    }
    let mut callables = callables.into_iter();
    let mut registry = Registry::new();
    for position in 0..callables.len() + built.len() {
        let tool = match built.remove(&position) {
            Some(table) => table,
            None => match callables.next() {
                Some(callable) => callable,
                None => break,
            },
        };
        registry.add(tool).map_err(|e| bad("tools", e))?;
    }
    // A table placed past the end (not from the Python side): after the rest.
    for tool in built.into_values().chain(callables) {
        registry.add(tool).map_err(|e| bad("tools", e))?;
    }
    Ok(registry)
}

/// `callables` with the rewards given as tables put at their places among `reward_funcs`,
/// each built as the binary builds a `[[rewards]]` table (relative paths from the working
/// directory, a sandboxed `command` from the worker's `sandbox`), bounded by `timeout`.
fn with_tables(
    callables: Vec<Reward>,
    tables: Vec<RewardTableTuple>,
    sandbox: &Sandbox,
    timeout: Duration,
) -> PyResult<Vec<Reward>> {
    let base = std::env::current_dir().map_err(|e| bad("reward_funcs", e))?;
    let mut built = Vec::with_capacity(tables.len());
    for (index, json, weight) in tables {
        let place = format!("reward_funcs[{index}]");
        let table: scoring::RewardTable =
            serde_json::from_str(&json).map_err(|e| bad(&place, e))?;
        let mut reward = table
            .build(&base, sandbox, None)
            .map_err(|e| bad(&place, e))?
            .timeout(timeout);
        if let Some(weight) = weight {
            reward = reward.weight(weight);
        }
        built.push((index, reward));
    }
    let total = callables.len() + built.len();
    let mut callables = callables.into_iter();
    let mut built = built.into_iter().peekable();
    let mut scored = Vec::with_capacity(total);
    for index in 0..total {
        match built.next_if(|(at, _)| *at == index) {
            Some((_, reward)) => scored.push(reward),
            None => scored.extend(callables.next()),
        }
    }
    Ok(scored)
}

/// The Python reward functions, weighted, each bounded by `timeout`.
fn reward_functions(
    bridge: &Arc<Bridge>,
    rewards: Vec<RewardTuple>,
    places: &Places<'_>,
    timeout: Duration,
) -> PyResult<Vec<Reward>> {
    let mut scored = Vec::new();
    for (name, function, is_async, weight, index) in rewards {
        if !weight.is_finite() {
            return Err(bad(
                "reward_weights",
                format!("{name}: the weight must be finite, got {weight}"),
            ));
        }
        let function = PyFunction::new(Arc::clone(bridge), function, &name);
        let reward = if is_async {
            Reward::from_async(name, AsyncPyReward(function))
        } else {
            Reward::from_sync(
                name.clone(),
                SyncPyReward(function, places.of(&name, index)?),
            )
        };
        scored.push(reward.weight(weight).timeout(timeout));
    }
    Ok(scored)
}

/// A group as Python reads it: `(samples, metrics, failure causes)`, each sample a dict.
fn group_to_python<'py>(py: Python<'py>, group: &ScoredGroup) -> PyResult<Bound<'py, PyAny>> {
    let samples = PyList::empty(py);
    for sample in &group.samples {
        samples.append(sample_to_python(py, sample)?)?;
    }
    let metrics: BTreeMap<&str, f64> = group
        .metrics
        .iter()
        .map(|(key, value)| (key.as_str(), *value))
        .collect();
    let causes: Vec<&str> = group.failures.iter().map(|f| f.cause.as_str()).collect();
    Ok((samples, metrics, causes).into_pyobject(py)?.into_any())
}

fn sample_to_python<'py>(py: Python<'py>, sample: &TrainingSample) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("prompt", json_text(&sample.prompt)?)?;
    dict.set_item("completion", json_text(&sample.completion)?)?;
    let ids: Vec<i64> = sample.input_ids.iter().map(|&id| i64::from(id)).collect();
    let mask: Vec<i64> = sample
        .completion_mask
        .iter()
        .map(|&m| i64::from(m))
        .collect();
    dict.set_item("input_ids", PyArray1::from_vec(py, ids))?;
    dict.set_item("completion_mask", PyArray1::from_vec(py, mask))?;
    dict.set_item(
        "old_log_probs",
        PyArray1::from_slice(py, &sample.old_log_probs),
    )?;
    dict.set_item("advantage", sample.advantage)?;
    dict.set_item("reward", sample.reward)?;
    dict.set_item("rewards", json_text(&sample.rewards)?)?;
    dict.set_item("model_version", sample.model_version)?;
    // One `[start, end, version]` row per span, as JSON Lines' `token_versions` objects.
    let spans: Vec<i64> = sample
        .token_versions
        .iter()
        .flat_map(|s| [s.start as i64, s.end as i64, s.version as i64])
        .collect();
    let spans = PyArray1::from_vec(py, spans).reshape([sample.token_versions.len(), 3])?;
    dict.set_item("token_versions", spans)?;
    if let Some(routing) = &sample.routed_experts {
        let shape = [routing.tokens(), routing.layers, routing.top_k];
        let experts = match routing.dtype {
            ExpertDtype::Uint8 => PyArray1::from_slice(py, &routing.data)
                .reshape(shape)?
                .into_any(),
            ExpertDtype::Uint16 => {
                let ids: Vec<u16> = routing
                    .data
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                PyArray1::from_vec(py, ids).reshape(shape)?.into_any()
            }
        };
        dict.set_item("routed_experts", experts)?;
        let missing: Vec<i64> = routing
            .missing
            .iter()
            .flat_map(|m| [m.start as i64, m.end as i64])
            .collect();
        let missing = PyArray1::from_vec(py, missing).reshape([routing.missing.len(), 2])?;
        dict.set_item("routed_experts_missing", missing)?;
    }
    dict.set_item("group_id", sample.group_id)?;
    dict.set_item("rollout_id", sample.rollout_id.0)?;
    let metrics = PyDict::new(py);
    for (key, value) in sample.metrics.iter() {
        metrics.set_item(key, value)?;
    }
    dict.set_item("metrics", metrics)?;
    Ok(dict)
}

/// JSON text of the message lists and maps a sample carries.
fn json_text<T: serde::Serialize>(value: &T) -> PyResult<String> {
    serde_json::to_string(value).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}
