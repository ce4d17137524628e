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
//! A vLLM-compatible simulator server to test against, without a GPU, is the `vllm-sim`
//! crate (whose docs run this example against it, and whose tests are this client's suite).
//! This crate has no feature (`e2e` only builds its suite against a real server).
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use async_grpo_vllm_client::{Client, ClientConfig, FinishReason, GenerateParams};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "http://127.0.0.1:8000"; // a vLLM server
//! let client = Client::new(ClientConfig::new(url))?;
//! let model = client.wait_until_ready(Duration::from_secs(60)).await?;
//! assert!(model.max_model_len.is_some());
//!
//! let prompt_ids = [1, 2, 3]; // what the model's chat template rendered, as token ids
//! let params = GenerateParams { max_tokens: 8, ..GenerateParams::default() };
//! let turn = client.generate(&prompt_ids, &params).await?;
//! assert_eq!(turn.token_ids.len(), turn.logprobs.len()); // one logprob per sampled id
//! assert!(turn.token_ids.len() <= 8 && turn.finish_reason != FinishReason::Abort);
//! # Ok(())
//! # }
//! ```

mod client;
mod error;
mod http;
mod retry;
mod routing;
pub mod types;

pub use crate::{
    client::{Client, ClientConfig, ClientStats, GenerateOutput, GenerateParams},
    error::Error,
    retry::RetryPolicy,
    routing::RoutedExperts,
    types::{FinishReason, PauseMode, SamplingParams, StructuredOutputs},
};
