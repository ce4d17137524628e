//! End-to-end tests of the `async-grpo` binary and of the crates together: one test binary.

mod agent;
mod agent_forgery;
mod cli;
mod control_security;
mod docs;
mod environment;
mod judge;
mod kernels;
mod operate;
mod quickstart;
mod reference;
mod reliability;
mod render;
mod reward_model;
mod rewards;
mod rollout;
mod rollout_config;
mod row_stream;
mod untrusted;

/// The repository's root, where `examples/` is (the binary's own fixtures are in this
/// package's `tests/fixtures/`).
pub(crate) fn repository() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository's root")
}
