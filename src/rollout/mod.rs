//! `async-grpo rollout`: dataset rows to multi-turn conversations, tool calls, rewards and
//! JSONL training rows. [`config`] holds its settings, [`preflight`] checks them
//! (and the dataset) before anything is touched, [`run`] wires the engine, and [`progress`]
//! shows how it goes.

pub(crate) mod agent;
pub(crate) mod config;
pub(crate) mod environment;
pub(crate) mod preflight;
pub(crate) mod progress;
pub(crate) mod run;
