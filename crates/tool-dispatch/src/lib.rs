//! Run a language model's tool calls without ever blocking the async runtime.
//!
//! [`ToolDispatcher`] is a [`tower::Service`] that takes the tool calls of one assistant turn
//! and answers with one [`ToolResult`] per call, in the same order:
//!
//! - **Sync tools** (`Fn(Arguments) -> Result<Value, ToolError>`) run on a dedicated, bounded
//!   pool of threads sized by the caller (an RL engine passes its maximum rollouts in flight).
//!   Not on the runtime's workers, where one slow tool would freeze every other rollout and
//!   the heartbeat; not on tokio's shared blocking pool, where tools and reward scoring would
//!   queue behind each other.
//! - **Async tools** are awaited on the runtime. Whether a tool is sync or async is declared
//!   when it is registered ([`Tool::new_sync`], [`Tool::new_async`], or [`Tool::from_sync`]
//!   and [`Tool::from_async`] for types implementing [`SyncTool`] / [`AsyncTool`]), never
//!   guessed.
//! - **Order**: the calls of one turn run one after another in the model's order, since tools
//!   with an environment behind them are stateful. Turns of different rollouts run
//!   concurrently.
//! - **Backpressure**: `poll_ready` reserves one of `max_threads + queue_capacity` slots, held
//!   by the turn for its whole life; it is pending while every slot is taken, so the pool
//!   never holds more calls than it has room for.
//! - **Nothing a tool does crashes the caller**: an unknown name, bad arguments, an error, a
//!   panic and a timeout each become a `{"error": ...}` message the model can read, counted
//!   apart in [`MetricsSnapshot`].
//! - **Shutdown** ([`ToolDispatcher::shutdown`]) cancels what has not started, awaits what
//!   runs up to a deadline, joins the pool's threads and reports what happened. The pool core,
//!   the handshake between a sync call and its waiter, and the way a call's slot moves
//!   through the pool are model-checked with loom (`cargo xtask loom`); the async layer above
//!   them is tested with tokio and tower-test. [`proofs`] lists the bugs each model and test
//!   was shown to catch.
//!
//! Built-in tools (`calculator`, `python`, `command`, and `http` with the feature of that
//! name) and [`builtin::ToolConfig`], a tool described in a configuration file, are in
//! [`builtin`].
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `http` | no | the built-in `http` tool, which POSTs a call's arguments to a URL | reqwest |
//! | `kernels` | no | `gateway` on a `python` tool: each rollout's session on a kernel of a Jupyter gateway | async-grpo-kernels |
//! | `schema` | no | `schemars::JsonSchema` for [`builtin::ToolConfig`], from which the binary writes its settings reference | schemars |
//!
//! # Use
//!
//! A registry with a sync tool and an async one, and a dispatcher running one turn's calls
//! (an unknown tool is an answer the model can read, not an error):
//!
//! ```
//! use std::time::Duration;
//!
//! use serde_json::json;
//! use async_grpo_tool_dispatch::{
//!     DispatcherConfig, Outcome, Registry, Tool, ToolCall, ToolDispatcher, ToolSpec,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let add = ToolSpec::new("add", "Add two integers").parameters(json!({
//!     "type": "object",
//!     "properties": { "a": { "type": "integer" }, "b": { "type": "integer" } },
//!     "required": ["a", "b"]
//! }));
//! let wait = ToolSpec::new("wait", "Wait a little, without blocking anyone");
//!
//! #[derive(serde::Deserialize)]
//! struct AddArgs { a: i64, b: i64 }
//!
//! let tools = Registry::new()
//!     .with(Tool::new_sync(add, |args| {
//!         let AddArgs { a, b } = args.parse()?;
//!         Ok(json!(a + b))
//!     }))?
//!     .with(Tool::new_async(wait, |_args| async {
//!         tokio::time::sleep(Duration::from_millis(1)).await;
//!         Ok(json!("done"))
//!     }))?;
//!
//! let dispatcher = ToolDispatcher::new(tools, DispatcherConfig::new(8));
//! let results = dispatcher
//!     .run(vec![
//!         ToolCall::new("add", json!({ "a": 2, "b": 3 })).with_id("call_0"),
//!         ToolCall::new("wait", json!({})),
//!         ToolCall::new("search", json!({ "q": "rust" })),
//!     ])
//!     .await?;
//!
//! assert_eq!(results[0].content, "5");
//! assert_eq!(results[1].content, "done");
//! assert_eq!(results[2].outcome, Outcome::UnknownTool);
//! assert_eq!(results[2].content, r#"{"error":"unknown tool 'search'; available tools: add, wait"}"#);
//!
//! let report = dispatcher.shutdown(Duration::from_secs(5)).await;
//! assert_eq!(report.threads_detached, 0);
//! # Ok(())
//! # }
//! ```

#[cfg(not(tool_dispatch_loom))]
pub mod builtin;
#[cfg(not(tool_dispatch_loom))]
mod call;
mod call_state;
#[cfg(not(tool_dispatch_loom))]
mod error;
#[cfg(not(tool_dispatch_loom))]
mod future;
#[cfg(not(tool_dispatch_loom))]
mod metrics;
mod pool;
#[doc = include_str!("proofs.md")]
pub mod proofs {}
#[cfg(not(tool_dispatch_loom))]
mod registry;
#[cfg(not(tool_dispatch_loom))]
mod service;
mod sync;
#[cfg(not(tool_dispatch_loom))]
mod tool;

#[cfg(not(tool_dispatch_loom))]
pub use crate::{
    error::{DispatchError, RegistryError},
    future::ResponseFuture,
    metrics::{LATENCY_BUCKETS, MetricsSnapshot, Percentiles, PoolSnapshot, ToolSnapshot},
    registry::Registry,
    service::{DispatcherConfig, ShutdownReport, ToolDispatcher},
    tool::{
        Arguments, AsyncTool, Outcome, RolloutTool, SyncTool, Tool, ToolCall, ToolError,
        ToolResult, ToolSpec, Unavailable,
    },
};
