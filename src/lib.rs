//! async-grpo: the rollout side of asynchronous GRPO-style reinforcement learning.
//!
//! This umbrella crate re-exports the workspace's crates, each behind a feature of the same
//! name, so that a user can depend on one package and pick what they need:
//!
//! | feature | crate | what it does |
//! |---|---|---|
//! | `tool-dispatch` (default) | [`tool_dispatch`] | runs a model's tool calls: sync tools on a bounded pool, async tools awaited |
//! | `rollout-core` (default) | [`rollout_core`] | chat templates rendered as transformers does, incremental token buffers, tool-call parsing, the turn reconciler |
//! | `scoring` (default) | [`scoring`] | reward functions over groups, and group advantages (GRPO, Dr. GRPO, RLOO, batch std) |
//! | `vllm-client` (default) | [`vllm_client`] | typed client of vLLM's HTTP API: token ids in, ids and logprobs out, retries, replicas |
//! | `harness` (default) | [`harness`] | environment sessions (sync and async), MCP servers as environments, white-box rollouts |
//! | `sim` (default) | [`vllm_client::sim`] | the vLLM-compatible simulator behind `async-grpo simulate` |
//!
//! Each crate is also usable on its own.

#[cfg(feature = "harness")]
#[doc(inline)]
pub use harness;
#[cfg(feature = "rollout-core")]
#[doc(inline)]
pub use rollout_core;
#[cfg(feature = "scoring")]
#[doc(inline)]
pub use scoring;
#[cfg(feature = "tool-dispatch")]
#[doc(inline)]
pub use tool_dispatch;
#[cfg(feature = "vllm-client")]
#[doc(inline)]
pub use vllm_client;
