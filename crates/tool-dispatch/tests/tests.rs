//! Integration tests of the tool dispatcher: one test binary, one module per area.

mod backpressure;
mod blocking;
mod builtins;
mod order;
mod outcomes;
mod shutdown;

use std::{
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use tool_dispatch::{
    Arguments, BoxError, DispatcherConfig, Registry, Tool, ToolDispatcher, ToolSpec,
};

/// A door that sync tools wait behind until the test opens it.
#[derive(Clone, Default)]
pub(crate) struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub(crate) fn open(&self) {
        let (open, changed) = &*self.0;
        *open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        changed.notify_all();
    }

    /// Blocks the calling thread until the gate opens (or ten seconds pass, so that a broken
    /// test fails instead of hanging).
    pub(crate) fn wait(&self) {
        let (open, changed) = &*self.0;
        let guard = open.lock().unwrap_or_else(|e| e.into_inner());
        let _ = changed
            .wait_timeout_while(guard, Duration::from_secs(10), |open| !*open)
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// A sync tool that blocks until `gate` opens, then answers "opened".
pub(crate) fn gated(name: &str, gate: &Gate) -> Tool {
    let gate = gate.clone();
    Tool::new_sync(
        ToolSpec::new(name, "Waits for the test"),
        move |_: Arguments| {
            gate.wait();
            Ok(json!("opened"))
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

pub(crate) fn ok_value(value: Value) -> Result<Value, BoxError> {
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

/// Polls `condition` every 5 ms for up to ten seconds; returns whether it became true.
pub(crate) async fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    condition()
}
