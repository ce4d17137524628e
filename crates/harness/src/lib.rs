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
//! [`Environment`](rollout_core::rollout::Environment) (white-box rollouts: the engine drives
//! the turns): creation is retried with backoff (a rollout whose session cannot be created
//! fails with cause `session_create`), the session's tools are the rollout's tools (rendered
//! into its prompt, run through tool-dispatch with the same order, timeouts and error
//! messages as any tool), `done` ends the episode, `verify` runs once at the end and its
//! reward is the `env` reward column, and every session is closed exactly once, on every path.
//!
//! [`mcp`]: any MCP server (a process speaking stdio, or a streamable-HTTP endpoint) is an
//! environment, through the official Rust SDK `rmcp`, so an environment needs no Rust.

mod environment;
pub mod mcp;
mod session;
mod sync;

pub use crate::{
    environment::{Harness, HarnessConfig},
    session::{
        Session, SessionError, SessionFactory, SyncSession, SyncSessionFactory, Task, ToolOutput,
        Verification,
    },
};
