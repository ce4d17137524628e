//! Python tools and reward functions as tool-dispatch tools and scoring rewards.
//!
//! Python does the calling, Rust does the scheduling. The `bridge` object (the Python class
//! `async_grpo._callables.Bridge`) knows how to call a user's function and turn what it
//! returns or raises into `(ok, text)`; this module decides *where* that happens:
//!
//! - a **sync** function is called from where tool-dispatch runs sync tools (its own thread
//!   pool) or scoring runs sync rewards (its own pool). By default it runs in a worker process
//!   of the [`Pool`] (it was pickled at construction), so that Python burning CPU holds a GIL
//!   of its own, not the trainer's; one that cannot be pickled runs on the calling thread,
//!   which takes the GIL only for the call itself (a tool sleeping in `time.sleep`, which
//!   releases the GIL, holds nothing) ([`Place`]);
//! - an **async** function runs on the worker's own asyncio loop thread, handed over through
//!   the loop's [`Inbox`] (no runtime worker or thread waits for the GIL to submit it), and its
//!   future waits for the loop's answer. Dropping the future (the call timed out, the rollout
//!   was cancelled) cancels the coroutine on the loop.

use std::sync::Arc;

use futures::future::BoxFuture;
use pyo3::prelude::*;
use scoring::{Group, Scores, SyncReward};
use serde_json::Value;
use tool_dispatch::{Arguments, AsyncTool, SyncTool};

use crate::{inbox::Inbox, lane::Lane, pool::Pool};

/// What tools and rewards return when they fail: any error that can cross threads.
type ToolError = Box<dyn std::error::Error + Send + Sync>;

/// The Python `Bridge` object (`async_grpo._callables.Bridge`) and its asyncio loop's inbox.
pub(crate) struct Bridge {
    object: Py<PyAny>,
    inbox: Py<Inbox>,
}

impl Bridge {
    /// `object` and the inbox it holds (its `inbox` attribute).
    pub(crate) fn new(py: Python<'_>, object: Py<PyAny>) -> PyResult<Bridge> {
        let inbox = object.getattr(py, "inbox")?.extract(py)?;
        Ok(Bridge { object, inbox })
    }

    /// The Python object.
    pub(crate) fn object(&self) -> &Py<PyAny> {
        &self.object
    }
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge").finish_non_exhaustive()
    }
}

/// A user's function and what the bridge needs to call it.
#[derive(Debug, Clone)]
pub(crate) struct PyFunction {
    /// The `Bridge` that calls it.
    bridge: Arc<Bridge>,
    /// The function (any callable).
    function: Arc<Py<PyAny>>,
    /// Its name, for messages.
    name: Arc<str>,
}

impl PyFunction {
    /// `function`, called through `bridge`.
    pub(crate) fn new(bridge: Arc<Bridge>, function: Py<PyAny>, name: &str) -> PyFunction {
        PyFunction {
            bridge,
            function: Arc::new(function),
            name: Arc::from(name),
        }
    }

    /// Calls `bridge.<method>(function, name, payload)` on this thread, holding the GIL only
    /// for the call, and reads its `(ok, text)`.
    pub(crate) fn call_here(&self, method: &str, payload: String) -> Result<String, ToolError> {
        let answer = Python::attach(|py| -> PyResult<(bool, String)> {
            self.bridge
                .object
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

    /// Runs the bridge's `kind` coroutine (`tool`, `reward` or `agent`) of the function on
    /// the worker's asyncio loop ([`Inbox`]) and waits for its answer; dropping the future
    /// (a timeout, a cancelled rollout) cancels the coroutine.
    pub(crate) async fn call_on_loop(
        &self,
        kind: &'static str,
        payload: String,
    ) -> Result<String, ToolError> {
        let pending = self
            .bridge
            .inbox
            .get()
            .submit(
                kind,
                Arc::clone(&self.function),
                Arc::clone(&self.name),
                payload,
            )
            .map_err(|e| format!("{}: could not submit to the asyncio loop: {e}", self.name))?;
        match pending.answer().await {
            Some((true, text)) => Ok(text),
            Some((false, error)) => Err(error.into()),
            None => Err(format!(
                "{}: the worker's asyncio loop stopped before the call finished",
                self.name
            )
            .into()),
        }
    }
}

/// Where a sync Python function runs.
#[derive(Debug, Clone)]
pub(crate) enum Place {
    /// In a worker process of the pool, as its callable number `.1` (of the init frame):
    /// the trainer's GIL is never taken.
    Pool(Arc<Pool>, usize),
    /// In the trainer's process, on the calling thread, holding the GIL while Python runs;
    /// with a lane (`python_tool_threads`), at most the lane's permits of such calls run
    /// Python at once, the others waiting without the GIL, so that fewer threads contend
    /// for it with the trainer's.
    Here(Option<Arc<Lane>>),
}

impl Place {
    /// Runs `function` with `args` (JSON) by `method` of the bridge (here) or in the pool.
    fn call(&self, function: &PyFunction, method: &str, args: Value) -> Result<String, ToolError> {
        match self {
            Place::Pool(pool, index) => pool
                .call(*index, args)
                .map_err(|error| format!("{}: {error}", function.name).into()),
            Place::Here(lane) => {
                let _permit = lane.as_ref().map(|lane| lane.enter());
                function.call_here(method, args.to_string())
            }
        }
    }
}

/// A sync Python tool: runs on tool-dispatch's pool of threads, which call it where its
/// [`Place`] says.
#[derive(Debug)]
pub(crate) struct SyncPyTool(pub(crate) PyFunction, pub(crate) Place);

impl SyncTool for SyncPyTool {
    fn call(&self, args: Arguments) -> Result<Value, ToolError> {
        self.1
            .call(&self.0, "call_tool", Value::Object(args.into_inner()))
            .map(Value::String)
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
                .call_on_loop("tool", kwargs)
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

/// A sync Python reward function: runs on scoring's pool of threads, which call it where its
/// [`Place`] says.
#[derive(Debug)]
pub(crate) struct SyncPyReward(pub(crate) PyFunction, pub(crate) Place);

impl SyncReward for SyncPyReward {
    fn score(&self, group: &Group) -> Result<Scores, ToolError> {
        let text = self
            .1
            .call(&self.0, "call_reward", serde_json::to_value(group)?)?;
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
            let text = function.call_on_loop("reward", payload).await?;
            scores(&function, &text)
        })
    }
}
