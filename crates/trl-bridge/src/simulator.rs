//! `Simulator`: vllm-sim's vLLM-compatible simulator, served from Python (tests, demos,
//! benchmarks: a GPU-free stand-in for a vLLM server, recording what it sampled).

use std::{path::PathBuf, sync::Mutex, time::Duration};

use pyo3::{
    exceptions::{PyRuntimeError, PyValueError},
    prelude::*,
    types::PyDict,
};
use tokio::runtime::Runtime;
use vllm_sim::{SimConfig, SimSettings, Simulator as Server};

use crate::lock;

/// A vLLM-compatible simulator on a runtime of its own (`async_grpo.Simulator`).
#[pyclass(frozen, module = "async_grpo._native")]
pub(crate) struct Simulator {
    url: String,
    inner: Mutex<Option<(Runtime, Server)>>,
}

#[pymethods]
impl Simulator {
    /// `Simulator(tokenizer, **settings)`: `settings` are those of a run's `[simulator]`
    /// table (vllm-sim's `SimSettings`, the same names: `tool_rounds`, `answer_tokens`,
    /// `latency="5ms"`, `error_503`, ...); an unknown one is a `ValueError` naming it.
    #[new]
    #[pyo3(signature = (tokenizer, **settings))]
    fn new(
        py: Python<'_>,
        tokenizer: PathBuf,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Simulator> {
        let file = if tokenizer.is_dir() {
            tokenizer.join("tokenizer.json")
        } else {
            tokenizer
        };
        let settings: SimSettings = match settings {
            Some(settings) => {
                let json: String = py
                    .import("json")?
                    .call_method1("dumps", (settings,))?
                    .extract()?;
                serde_json::from_str(&json)
                    .map_err(|e| PyValueError::new_err(format!("Simulator: {e}")))?
            }
            None => SimSettings::default(),
        };
        settings
            .validate()
            .map_err(|e| PyValueError::new_err(format!("Simulator: {e}")))?;
        let mut config = SimConfig::from_tokenizer_file(&file)
            .map_err(|e| PyValueError::new_err(format!("{e}: {}", e.source)))?;
        settings.apply_to(&mut config);
        config.record = true;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("async-grpo-sim")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start a runtime: {e}")))?;
        let server = py
            .detach(|| runtime.block_on(Server::start(config, ([127, 0, 0, 1], 0).into())))
            .map_err(|e| PyRuntimeError::new_err(format!("cannot listen: {e}")))?;
        Ok(Simulator {
            url: server.url(),
            inner: Mutex::new(Some((runtime, server))),
        })
    }

    /// The server's base URL (`http://127.0.0.1:PORT`).
    #[getter]
    fn url(&self) -> String {
        self.url.clone()
    }

    /// Every `/v1/completions` answer so far, in order: `(prompt_ids, token_ids, logprobs,
    /// finish_reason)`.
    #[allow(clippy::type_complexity)]
    fn transcript(&self) -> Vec<(Vec<u32>, Vec<u32>, Vec<f64>, &'static str)> {
        let inner = lock(&self.inner);
        inner.as_ref().map_or_else(Vec::new, |(_, server)| {
            server
                .transcript()
                .into_iter()
                .map(|s| (s.prompt_ids, s.token_ids, s.logprobs, s.finish_reason))
                .collect()
        })
    }

    /// Loads weights of `version` (0: the start's): from now on answers, their logprobs and
    /// their routing are those of these weights, as a trainer's weight update does to a server.
    fn set_weights(&self, version: u64) {
        if let Some((_, server)) = lock(&self.inner).as_ref() {
            server.set_weights(version);
        }
    }

    /// For each `/v1/completions` answer so far, in order: the version of the weights that
    /// sampled it, and whether they changed while it ran.
    fn weights(&self) -> Vec<(u64, bool)> {
        let inner = lock(&self.inner);
        inner.as_ref().map_or_else(Vec::new, |(_, server)| {
            server
                .transcript()
                .into_iter()
                .map(|s| (s.weights, s.weights_changed))
                .collect()
        })
    }

    /// Generation requests answered so far.
    fn completions(&self) -> u64 {
        let inner = lock(&self.inner);
        inner
            .as_ref()
            .map_or(0, |(_, server)| server.counters().completions)
    }

    /// Stops serving and joins the simulator's threads. Idempotent.
    fn stop(&self, py: Python<'_>) {
        let inner = lock(&self.inner).take();
        if let Some((runtime, server)) = inner {
            py.detach(|| {
                runtime.block_on(server.stop());
                runtime.shutdown_timeout(Duration::from_secs(5));
            });
        }
    }
}
