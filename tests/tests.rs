//! End-to-end tests of the `async-grpo` binary and of the crates together: one test binary.

#[cfg(feature = "rollout-core")]
#[path = "../crates/rollout-core/tests/cache.rs"]
mod cache;
mod cli;
#[cfg(all(
    feature = "rollout-core",
    feature = "scoring",
    feature = "tool-dispatch",
    feature = "sim",
    feature = "harness"
))]
mod environment;
#[cfg(all(feature = "rollout-core", feature = "sim", feature = "tool-dispatch"))]
mod quickstart;
#[cfg(all(
    feature = "rollout-core",
    feature = "scoring",
    feature = "tool-dispatch",
    feature = "sim"
))]
mod reliability;
#[cfg(feature = "rollout-core")]
mod render;
#[cfg(all(
    feature = "rollout-core",
    feature = "scoring",
    feature = "tool-dispatch",
    feature = "sim"
))]
mod rollout;
#[cfg(all(
    feature = "rollout-core",
    feature = "scoring",
    feature = "tool-dispatch",
    feature = "sim"
))]
mod rollout_config;
