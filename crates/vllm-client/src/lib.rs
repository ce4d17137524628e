//! A typed async client for vLLM's HTTP API, as reinforcement learning needs it.
//!
//! - **Token ids in, ids and logprobs out**: [`Client::generate`] sends a token-id prompt to
//!   `/v1/completions` with `return_token_ids`, `logprobs: 0`, `add_special_tokens: false` and a
//!   unique seed, and checks that every sampled id has its logprob.
//! - **Typed requests** ([`types`]): vLLM ignores unknown fields silently, so nothing is sent
//!   from a free-form map.
//! - **Failures**: transport errors and 5xx are retried with jittered exponential backoff,
//!   bounded in attempts and by a deadline ([`RetryPolicy`]); a 4xx comes back at once with
//!   vLLM's own message ([`Error`]).
//! - **Cancellation**: dropping a call's future closes its connection, and vLLM aborts the
//!   request.
//! - **Replicas**: several base URLs; a sticky key keeps a rollout on its server while it is
//!   healthy, otherwise the least busy server is used; a failing server is ejected for a while.
//!
//! With the `sim` feature, [`sim`] is a vLLM-compatible simulator server for tests,
//! benchmarks and GPU-free demos.

mod client;
mod error;
mod retry;
#[cfg(feature = "sim")]
pub mod sim;
mod sync;
pub mod types;

pub use crate::{
    client::{Client, ClientConfig, ClientStats, GenerateOutput, GenerateParams},
    error::Error,
    retry::RetryPolicy,
    types::{FinishReason, PauseMode, SamplingParams, StructuredOutputs},
};
