//! async-grpo: the rollout side of asynchronous GRPO-style reinforcement learning.
//!
//! This umbrella crate re-exports the workspace's crates, each behind a feature of the same
//! name, so that a user can depend on one package and pick what they need; with
//! `default-features = false` a feature brings its crate and nothing else (the crates' own
//! optional parts stay off unless a feature below turns them on):
//!
//! | feature | crate | what it does |
//! |---|---|---|
//! | `tool-dispatch` | [`tool_dispatch`] | runs a model's tool calls: sync tools on a bounded pool, async tools awaited |
//! | `http` (default) | [`tool_dispatch`] | tool-dispatch's built-in `http` tool (reqwest) |
//! | `kernels` | [`kernels`] | Python sessions on the kernels of a Jupyter gateway, and `gateway` on tool-dispatch's `python` tool |
//! | `rollout-core` | [`rollout_core`] | chat templates rendered as transformers does, incremental token buffers, tool-call parsing, the turn reconciler, training rows |
//! | `rollout-api` | [`rollout_api`] | the engine's API without its loop: the `Environment`, `Agent` and `Generator` traits and the dataset row |
//! | `rollout` | [`rollout`] | the rollout engine over any `Generator` (with tool-dispatch and scoring's `Scorer`): dataset rows in, scored groups out; re-exports `rollout_api` |
//! | `files` | [`files`] | datasets and outputs as files: JSON Lines (and Parquet with `parquet`), the run's plan of passes, shards and resume |
//! | `parquet` (default) | [`files`] | Parquet datasets and outputs too |
//! | `stream` | [`stream`] | the row stream: groups held for remote trainers until acknowledged, served over Apache Arrow Flight; with `run`, a run's stream wired too (`run::rows`) |
//! | `scoring` | [`scoring`] | group advantages (GRPO, Dr. GRPO, RLOO, batch std), reward functions; `rollout` adds the scorer |
//! | `vllm-client` | [`vllm_client`] | typed client of vLLM's HTTP API: token ids in, ids and logprobs out, retries, replicas |
//! | `harness` | [`harness`] | environment sessions (sync and async), MCP servers as environments, the recording proxy and agent programs; turns on `rollout-api` |
//! | `run` (default) | [`run`] | one run specified once: the plan (passes, shuffle, shards, resume), the dataset, the output, and the engine wired with its servers, tools, rewards, environment or agent; turns on `harness` and `vllm-client` |
//! | `sim` | [`vllm_sim`] | the vLLM-compatible simulator behind `async-grpo simulate` and a rollout without `--server` |
//!
//! The `async-grpo` binary is the package async-grpo-cli: no feature of this one brings it.
//!
//! For example `async-grpo = { default-features = false, features = ["rollout-core"] }`
//! compiles rollout-core alone, without the loop, a client or the CLI. Each crate is also
//! usable on its own.
//!
//! ```
//! # #[cfg(feature = "scoring")]
//! # fn main() {
//! // With `features = ["scoring"]`: the group-advantage estimators and nothing else.
//! use async_grpo::scoring::{AdvantageConfig, CompletionReward, group_advantages};
//!
//! let rewards = [CompletionReward::scored(1.0), CompletionReward::scored(0.0)];
//! let advantages = group_advantages(&rewards, &AdvantageConfig::default()).advantages;
//! assert!(advantages[0] > 0.0 && advantages[1] < 0.0);
//! # }
//! # #[cfg(not(feature = "scoring"))]
//! # fn main() {}
//! ```

#[cfg(feature = "run")]
#[doc(inline)]
pub use async_grpo_run as run;
#[cfg(feature = "stream")]
#[doc(inline)]
pub use async_grpo_stream as stream;
#[cfg(feature = "files")]
#[doc(inline)]
pub use files;
#[cfg(feature = "harness")]
#[doc(inline)]
pub use harness;
#[cfg(feature = "kernels")]
#[doc(inline)]
pub use kernels;
#[cfg(feature = "rollout")]
#[doc(inline)]
pub use rollout;
#[cfg(feature = "rollout-api")]
#[doc(inline)]
pub use rollout_api;
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
#[cfg(feature = "sim")]
#[doc(inline)]
pub use vllm_sim;
