//! Environments for RL rollouts: one stateful session per rollout (a sandbox, a game, a
//! repository) that offers tools, can end the episode, and verifies the outcome into a reward.
//!
//! The shape is OpenEnv's harness, the one TRL's harness worker consumes: a factory creates
//! a session per rollout with a [`Task`] (the dataset row, a seed, an episode id); a session
//! has initial messages, tools, `call_tool` (a [`ToolOutput`] with `done`, `error`,
//! `metadata`), `verify` (a [`Verification`] with `env_reward`, `done`, `metrics`) and
//! `close`. Sessions are async ([`Session`], awaited) or blocking ([`SyncSession`], every call
//! on the tool pool's threads, never on the runtime); both are first-class.
//!
//! [`Harness`] turns a factory into the rollout loop's
//! [`Environment`](rollout_api::Environment) (white-box rollouts: the engine drives
//! the turns): creation is retried with backoff (a rollout whose session cannot be created
//! fails with cause `session_create`), the session's tools are the rollout's tools (rendered
//! into its prompt, run through tool-dispatch with the same order, timeouts and error
//! messages as any tool), `done` ends the episode, `verify` runs once at the end and its
//! reward is the `env` reward column, and every session is closed exactly once, on every path.
//!
//! [`proxy`] (feature `proxy`, on by default): for agents that own their loop, a recording
//! OpenAI-compatible server; every request is rendered with the model's template and sampled
//! token-in/token-out as a turn of the rollout, so the rows stay exact whatever the agent
//! does with the text. [`agent`] (feature `agent`, on by default): an agent program run per
//! rollout behind it, as the loop's [`Agent`](rollout_api::Agent).
//!
//! [`mcp`] (feature `mcp`, on by default): any MCP server (a process speaking stdio, or a streamable-HTTP endpoint) is an
//! environment, through the official Rust SDK `rmcp`, so an environment needs no Rust.
//!
//! The settings of an agent (`agent::ProgramConfig`, a settings file's `[agent]`) and of an
//! MCP environment (`mcp::McpEnvironment`, its `[environment]`) are serde tables declared
//! here, with their defaults; each checks its own values (`validate`, a [`SettingError`]
//! naming the key).
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `mcp` | yes | [`mcp`]: MCP servers as environments | rmcp, tokio `process` |
//! | `proxy` | no (`agent` turns it on) | [`proxy`]: the recording OpenAI-compatible proxy | axum, getrandom |
//! | `agent` | yes | [`agent`]: agent programs run per rollout behind the proxy | `proxy`, tokio `process` |
//! | `schema` | no | `schemars::JsonSchema` for the `[environment]` and `[agent]` tables, from which the binary writes its settings reference | schemars |
//!
//! This crate alone, with a blocking environment whose episode ends when the model says the
//! magic word (the engine's loop drives the same calls):
//!
//! ```
//! use async_grpo_harness::{
//!     Harness, SessionError, SyncSession, SyncSessionFactory, Task, ToolOutput, Verification,
//! };
//! use rollout_api::{DatasetRow, Environment, EpisodeRequest, EpisodeStatus};
//! use rollout_core::Message;
//! use serde_json::{Map, Value, json};
//! use tool_dispatch::{DispatcherConfig, Registry, ToolCall, ToolDispatcher, ToolSpec};
//!
//! struct Word;
//!
//! impl SyncSession for Word {
//!     fn tools(&self) -> Vec<ToolSpec> {
//!         vec![ToolSpec::new("say", "Say a word")]
//!     }
//!     fn call_tool(&self, _: &str, args: Map<String, Value>) -> Result<ToolOutput, SessionError> {
//!         let word = args.get("word").and_then(Value::as_str).unwrap_or_default();
//!         let output = ToolOutput::new(format!("you said {word}"));
//!         Ok(if word == "please" { output.done() } else { output })
//!     }
//!     fn verify(&self, transcript: &[Message]) -> Result<Verification, SessionError> {
//!         Ok(Verification::reward(transcript.len() as f64))
//!     }
//!     fn close(&self) {}
//! }
//!
//! struct Words;
//!
//! impl SyncSessionFactory for Words {
//!     fn create(&self, _: &Task) -> Result<Box<dyn SyncSession>, SessionError> {
//!         Ok(Box::new(Word))
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! // Its calls run on the tool pool's threads, never on the runtime.
//! let pool = ToolDispatcher::new(Registry::new(), DispatcherConfig::new(2));
//! let environment = Harness::new_sync("words", Words, pool);
//! let row = DatasetRow {
//!     source: "tasks.jsonl".into(),
//!     line: 1,
//!     prompt: vec![Message::user("Ask nicely.")],
//!     columns: Map::new(),
//! };
//! let mut episode = environment
//!     .open(EpisodeRequest::new(&row, 7, "r0-a1"))
//!     .await?;
//! let said = episode
//!     .tools()
//!     .run(vec![ToolCall::new("say", json!({"word": "please"}))])
//!     .await?;
//! assert_eq!(said[0].content, "you said please");
//! assert_eq!(episode.status(), EpisodeStatus::Done);
//! let verdict = episode.verify(vec![Message::user("Ask nicely.")]).await;
//! assert_eq!(verdict.reward, Some(1.0));
//! episode.close().await;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(feature = "agent")]
pub mod agent;
mod environment;
#[cfg(feature = "mcp")]
pub mod mcp;
#[cfg(feature = "proxy")]
pub mod proxy;
mod session;

pub use crate::{
    environment::{CREATE_TIMEOUT_CALLS, Harness, HarnessConfig, MAX_CREATE_BACKOFF},
    session::{
        Session, SessionError, SessionFactory, SyncSession, SyncSessionFactory, Task, ToolOutput,
        Verification, step_reward,
    },
};

/// A value of a settings table (`agent::ProgramConfig`, `mcp::McpEnvironment`) that cannot
/// work: the key it is under (none: the table as a whole, two keys that exclude each other,
/// say) and what is wrong (async-grpo-settings' one setting error).
pub use settings::SettingError;

/// Locks `mutex`, going on when a panicking holder poisoned it: every value guarded in this
/// crate is left consistent between statements.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
