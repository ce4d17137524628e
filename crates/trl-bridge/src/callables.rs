//! Python tools and reward functions as tool-dispatch tools and scoring rewards.
//!
//! Python does the calling, Rust does the scheduling. The `bridge` object (the Python class
//! `async_grpo._callables.Bridge`) knows how to call a user's function and turn what it
//! returns or raises into `(ok, text)`; this module decides *where* that happens:
//!
//! - a **sync** function runs where tool-dispatch runs sync tools (its own thread pool) or
//!   where scoring runs sync rewards (its own pool): the thread takes the GIL only for the
//!   call itself, so a tool sleeping in `time.sleep` (which releases the GIL) holds nothing;
//! - an **async** function is submitted to the worker's own asyncio loop thread (a blocking
//!   task does the submission, so no runtime worker ever waits for the GIL), and its future
//!   waits on a oneshot channel the loop completes. Dropping the future (the call timed out,
//!   the rollout was cancelled) cancels the coroutine on the loop.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use pyo3::prelude::*;
use scoring::{Group, Scores, SyncReward};
use serde_json::Value;
use tokio::sync::oneshot;
use tool_dispatch::{Arguments, AsyncTool, SyncTool};

use crate::{lane::Lane, lock};

/// What tools and rewards return when they fail: any error that can cross threads.
type ToolError = Box<dyn std::error::Error + Send + Sync>;

/// A user's function and what the bridge needs to call it.
#[derive(Debug, Clone)]
pub(crate) struct PyFunction {
    /// The `Bridge` object that calls it.
    bridge: Arc<Py<PyAny>>,
    /// The function (any callable).
    function: Arc<Py<PyAny>>,
    /// Its name, for messages.
    name: Arc<str>,
}

impl PyFunction {
    /// `function`, called through `bridge`.
    pub(crate) fn new(bridge: Arc<Py<PyAny>>, function: Py<PyAny>, name: &str) -> PyFunction {
        PyFunction {
            bridge,
            function: Arc::new(function),
            name: Arc::from(name),
        }
    }

    /// Calls `bridge.<method>(function, name, payload)` on this thread, holding the GIL only
    /// for the call, and reads its `(ok, text)`.
    fn call_here(&self, method: &str, payload: String) -> Result<String, ToolError> {
        let answer = Python::attach(|py| -> PyResult<(bool, String)> {
            self.bridge
                .call_method1(
                    py,
                    method,
                    (self.function.as_ref(), self.name.as_ref(), payload),
                )?
                .extract(py)
        });
        match answer {
            Ok((true, text)) => Ok(text),
            Ok((false, error)) => Err(error.into()),
            Err(error) => Err(format!("{}: the bridge failed: {error}", self.name).into()),
        }
    }

    /// Submits `bridge.<method>(function, name, payload, done)` to the asyncio loop from a
    /// blocking thread and waits for `done` to be called.
    async fn call_on_loop(
        &self,
        method: &'static str,
        payload: String,
    ) -> Result<String, ToolError> {
        let (sender, receiver) = oneshot::channel();
        let done = Done {
            sender: Mutex::new(Some(sender)),
        };
        let this = self.clone();
        let submitted = tokio::task::spawn_blocking(move || {
            Python::attach(|py| {
                this.bridge.call_method1(
                    py,
                    method,
                    (this.function.as_ref(), this.name.as_ref(), payload, done),
                )
            })
        })
        .await
        .map_err(|e| format!("{}: could not submit to the asyncio loop: {e}", self.name))?
        .map_err(|e| format!("{}: could not submit to the asyncio loop: {e}", self.name))?;
        let mut pending = CancelOnDrop(Some(submitted));
        let answer = receiver.await;
        pending.0 = None;
        match answer {
            Ok((true, text)) => Ok(text),
            Ok((false, error)) => Err(error.into()),
            Err(_) => Err(format!(
                "{}: the worker's asyncio loop stopped before the call finished",
                self.name
            )
            .into()),
        }
    }
}

/// Cancels a submitted coroutine (its `concurrent.futures.Future`) unless disarmed.
struct CancelOnDrop(Option<Py<PyAny>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(future) = self.0.take() else {
            return;
        };
        let cancel = move || {
            Python::attach(|py| {
                // A future that already finished cannot be cancelled: nothing to do then.
                let _ = future.call_method0(py, "cancel");
            });
        };
        // Not on a runtime worker: taking the GIL may wait.
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => drop(handle.spawn_blocking(cancel)),
            Err(_) => cancel(),
        }
    }
}

/// The callback the asyncio loop calls with `(ok, text)` when a submitted call ends.
#[pyclass(frozen, module = "async_grpo._native")]
struct Done {
    sender: Mutex<Option<oneshot::Sender<(bool, String)>>>,
}

#[pymethods]
impl Done {
    fn __call__(&self, ok: bool, text: String) {
        let sender = lock(&self.sender).take();
        if let Some(sender) = sender {
            // The waiter may have given up (a timeout): then nobody needs the answer.
            let _ = sender.send((ok, text));
        }
    }
}

/// A sync Python tool: runs on tool-dispatch's pool; with a lane (`python_tool_threads`), at
/// most the lane's permits of such calls run Python at once, the others waiting without the
/// GIL, so that fewer threads contend for it with the trainer's.
#[derive(Debug)]
pub(crate) struct SyncPyTool(pub(crate) PyFunction, pub(crate) Option<Arc<Lane>>);

impl SyncTool for SyncPyTool {
    fn call(&self, args: Arguments) -> Result<Value, ToolError> {
        let kwargs = Value::Object(args.into_inner()).to_string();
        let _permit = self.1.as_ref().map(|lane| lane.enter());
        self.0.call_here("call_tool", kwargs).map(Value::String)
    }
}

/// An `async def` Python tool: runs on the worker's asyncio loop.
#[derive(Debug)]
pub(crate) struct AsyncPyTool(pub(crate) PyFunction);

impl AsyncTool for AsyncPyTool {
    fn call(&self, args: Arguments) -> BoxFuture<'static, Result<Value, ToolError>> {
        let function = self.0.clone();
        Box::pin(async move {
            let kwargs = Value::Object(args.into_inner()).to_string();
            function
                .call_on_loop("submit_tool", kwargs)
                .await
                .map(Value::String)
        })
    }
}

/// Reads a reward function's answer: a JSON list of numbers or nulls, one per completion.
fn scores(function: &PyFunction, text: &str) -> Result<Scores, ToolError> {
    serde_json::from_str(text).map_err(|e| {
        format!(
            "{}: the bridge returned scores that are not a list of numbers or None: {e}",
            function.name
        )
        .into()
    })
}

/// A sync Python reward function: runs on scoring's pool.
#[derive(Debug)]
pub(crate) struct SyncPyReward(pub(crate) PyFunction);

impl SyncReward for SyncPyReward {
    fn score(&self, group: &Group) -> Result<Scores, ToolError> {
        let payload = serde_json::to_string(group)?;
        let text = self.0.call_here("call_reward", payload)?;
        scores(&self.0, &text)
    }
}

/// An `async def` Python reward function: runs on the worker's asyncio loop.
#[derive(Debug)]
pub(crate) struct AsyncPyReward(pub(crate) PyFunction);

impl scoring::AsyncReward for AsyncPyReward {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, ToolError>> {
        let function = self.0.clone();
        Box::pin(async move {
            let payload = serde_json::to_string(group.as_ref())?;
            let text = function.call_on_loop("submit_reward", payload).await?;
            scores(&function, &text)
        })
    }
}
