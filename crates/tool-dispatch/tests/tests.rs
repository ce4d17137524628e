//! Integration tests of the tool dispatcher: one test binary, one module per area.

mod backpressure;
mod blocking;
mod builtins;
mod order;
mod outcomes;
mod sessions;
mod shutdown;

use std::{
    future::Future,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use async_grpo_tool_dispatch::{
    Arguments, DispatcherConfig, Registry, Tool, ToolDispatcher, ToolError, ToolSpec,
};
use serde_json::{Value, json};

/// How long a test waits for anything before it fails, in real time. Nothing here takes
/// more than a fraction of it; it only turns a hang into a failure that says what hung.
pub(crate) const PATIENCE: Duration = Duration::from_secs(10);

/// Blocks the calling thread until `condition` holds on the value behind `mutex`, or
/// `patience` passes; returns whether it holds.
fn wait_on<T>(
    mutex: &Mutex<T>,
    changed: &Condvar,
    patience: Duration,
    condition: impl Fn(&T) -> bool,
) -> bool {
    let guard = mutex.lock().unwrap_or_else(|e| e.into_inner());
    let (guard, _) = changed
        .wait_timeout_while(guard, patience, |value| !condition(value))
        .unwrap_or_else(|e| e.into_inner());
    condition(&guard)
}

/// A door that sync tools wait behind until the test opens it.
#[derive(Clone, Default)]
pub(crate) struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub(crate) fn open(&self) {
        let (open, changed) = &*self.0;
        *open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        changed.notify_all();
    }

    /// Blocks the calling thread until the gate opens; `false` if it was still closed after
    /// [`PATIENCE`] (a broken test, which then fails instead of hanging).
    pub(crate) fn wait(&self) -> bool {
        let (open, changed) = &*self.0;
        wait_on(open, changed, PATIENCE, |open| *open)
    }
}

/// A meeting point: each arrival blocks until `expected` calls are there at once.
#[derive(Clone)]
pub(crate) struct Rendezvous(Arc<(Mutex<usize>, Condvar)>, usize);

impl Rendezvous {
    pub(crate) fn new(expected: usize) -> Rendezvous {
        Rendezvous(Arc::default(), expected)
    }

    /// Arrives and waits for the others; `false` if they were not all there within half of
    /// [`PATIENCE`] (so that the call can still fail, saying so, before the test stops
    /// waiting for it).
    pub(crate) fn meet(&self) -> bool {
        let (arrived, changed) = &*self.0;
        *arrived.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        changed.notify_all();
        wait_on(arrived, changed, PATIENCE / 2, |arrived| *arrived >= self.1)
    }
}

/// A sync tool that blocks until `gate` opens, then answers "opened" (or fails, saying so,
/// if the test never opens it).
pub(crate) fn gated(name: &str, gate: &Gate) -> Tool {
    let gate = gate.clone();
    Tool::new_sync(
        ToolSpec::new(name, "Waits for the test"),
        move |_: Arguments| {
            if gate.wait() {
                Ok(json!("opened"))
            } else {
                Err("the test never opened the gate".into())
            }
        },
    )
}

/// A sync tool that answers its own name at once.
pub(crate) fn quick(name: &str) -> Tool {
    let answer = name.to_owned();
    Tool::new_sync(
        ToolSpec::new(name, "Answers at once"),
        move |_: Arguments| Ok(json!(answer.clone())),
    )
}

pub(crate) fn dispatcher(tools: Vec<Tool>, config: DispatcherConfig) -> ToolDispatcher {
    let mut registry = Registry::new();
    for tool in tools {
        registry.add(tool).expect("test tools have unique names");
    }
    ToolDispatcher::new(registry, config)
}

/// The message of an `{"error": ...}` tool result.
pub(crate) fn error_of(content: &str) -> String {
    let value: Value = serde_json::from_str(content).expect("error contents are JSON");
    value["error"]
        .as_str()
        .expect("an \"error\" string")
        .to_owned()
}

pub(crate) fn ok_value(value: Value) -> Result<Value, ToolError> {
    Ok(value)
}

/// Live threads of this process whose name starts with `prefix` (Linux: /proc/self/task).
pub(crate) fn threads_named(prefix: &str) -> usize {
    // A missing /proc must fail the test, not read as "no threads left".
    let tasks =
        std::fs::read_dir("/proc/self/task").expect("these tests count threads in /proc (Linux)");
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

/// Awaits `future`; fails the test, naming `what`, if it is not done within [`PATIENCE`] of
/// real time (sync tools run on real threads: a paused test clock must not end the wait).
pub(crate) async fn within<F: Future>(what: &str, future: F) -> F::Output {
    test_support::within(PATIENCE, what, future).await
}

/// Waits until `condition` holds, in real time; fails the test, naming `what`, after
/// [`PATIENCE`].
pub(crate) async fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    test_support::wait_until(PATIENCE, what, condition).await
}
