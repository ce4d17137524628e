//! Integration tests of the rollout engine: one test binary, one module per area.
//!
//! `rollout` runs the loop against scripted in-process generators and the simulator;
//! `prompt_modes` compares the two prompt modes on the real tokenizers that `cargo xtask
//! fixtures` fetches into the cache (it runs in the `fixtures` and `ci` nextest profiles),
//! through vllm-client's generator (feature `vllm-client`).

#[cfg(feature = "vllm-client")]
mod offpolicy;
#[cfg(feature = "vllm-client")]
mod prompt_modes;
mod rollout;

#[cfg(feature = "vllm-client")]
pub(crate) use test_support::fixture;

#[cfg(feature = "vllm-client")]
pub(crate) use test_support::tokenizers::{
    llama31, quickstart, qwen3, qwen3_as_mistral, qwen3_with_template,
};
