//! `async-grpo rollout`: dataset rows to multi-turn conversations, tool calls, rewards and
//! training rows. [`config`] holds its settings, [`preflight`] checks them (and the dataset)
//! before anything is touched, [`data`] orders the rows (epochs, shuffle, shard, resume),
//! [`run`] wires the engine, [`output`] writes the rows (JSON Lines, stdout, Parquet) and
//! reads them back to resume, [`control`] serves the control endpoint, and [`progress`]
//! shows how it goes.

pub(crate) mod agent;
pub(crate) mod config;
pub(crate) mod control;
pub(crate) mod environment;
pub(crate) mod preflight;
pub(crate) mod programs;
pub(crate) mod progress;
pub(crate) mod rows;
pub(crate) mod run;
