//! `async-grpo rollout`: dataset rows to multi-turn conversations, tool calls, rewards and
//! JSONL training rows. [`config`] holds its settings.

pub(crate) mod config;
