//! `async-grpo rollout`: dataset rows to multi-turn conversations, tool calls, rewards and
//! training rows. [`config`] holds its settings, [`preflight`] checks them (and the dataset)
//! before anything is touched, [`run`] hands them to `async_grpo_run` (the plan, the output,
//! the engine wired, the row stream) and writes the rows, [`control`] serves the control
//! endpoint, and [`progress`] shows how it goes.

pub(crate) mod agent;
pub(crate) mod config;
pub(crate) mod control;
pub(crate) mod environment;
pub(crate) mod preflight;
pub(crate) mod programs;
pub(crate) mod progress;
pub(crate) mod run;
