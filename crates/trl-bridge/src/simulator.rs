//! `Simulator`: vllm-client's vLLM-compatible simulator, served from Python (tests, demos,
//! benchmarks: a GPU-free stand-in for a vLLM server, recording what it sampled).

use std::{path::PathBuf, time::Duration};

use pyo3::{
    exceptions::{PyRuntimeError, PyValueError},
    prelude::*,
};
use tokio::runtime::Runtime;
use vllm_client::sim::{SimConfig, Simulator as Server};

use crate::sync::{Mutex, lock};

/// A vLLM-compatible simulator on a runtime of its own (`async_grpo.Simulator`).
#[pyclass(frozen, module = "async_grpo._native")]
pub(crate) struct Simulator {
    url: String,
    inner: Mutex<Option<(Runtime, Server)>>,
}

#[pymethods]
impl Simulator {
    #[new]
    #[pyo3(signature = (
        tokenizer, *, tool_rounds = 0, tool_name = "calculator".to_owned(), answer_tokens = 32,
        max_model_len = 4096, eos_token = "<|im_end|>".to_owned(), latency_ms = 0.0,
        per_token_ms = 0.0, correct_rate = 0.5, fail_503 = 0.0, model = "sim".to_owned()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tokenizer: PathBuf,
        tool_rounds: usize,
        tool_name: String,
        answer_tokens: usize,
        max_model_len: u32,
        eos_token: String,
        latency_ms: f64,
        per_token_ms: f64,
        correct_rate: f64,
        fail_503: f64,
        model: String,
    ) -> PyResult<Simulator> {
        let file = if tokenizer.is_dir() {
            tokenizer.join("tokenizer.json")
        } else {
            tokenizer
        };
        let mut config = SimConfig::from_tokenizer_file(&file).map_err(PyValueError::new_err)?;
        for (name, value) in [("latency_ms", latency_ms), ("per_token_ms", per_token_ms)] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PyValueError::new_err(format!(
                    "{name} must be a number of milliseconds >= 0, got {value}"
                )));
            }
        }
        for (name, value) in [("correct_rate", correct_rate), ("fail_503", fail_503)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(PyValueError::new_err(format!(
                    "{name} must be a fraction between 0 and 1, got {value}"
                )));
            }
        }
        config.model = model;
        config.tool_rounds = tool_rounds;
        config.tool_name = tool_name;
        config.answer_tokens = answer_tokens;
        config.max_model_len = max_model_len;
        config.eos_token = eos_token;
        config.latency = Duration::from_secs_f64(latency_ms / 1e3);
        config.per_token = Duration::from_secs_f64(per_token_ms / 1e3);
        config.correct_rate = correct_rate;
        config.faults.error_503 = fail_503;
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
