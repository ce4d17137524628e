//! End-to-end tests of the `async-grpo` binary and of the crates together: one test binary.

mod cli;
#[cfg(feature = "rollout-core")]
mod render;
