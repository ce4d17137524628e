//! End-to-end tests of the `async-grpo` binary and of the crates together: one test binary,
//! built with the `cli` feature (the binary's); what needs the simulator is gated on `sim`.

#[cfg(feature = "sim")]
mod agent;
#[cfg(feature = "sim")]
mod agent_forgery;
mod cli;
mod control_security;
#[cfg(feature = "sim")]
mod environment;
#[cfg(feature = "sim")]
mod operate;
#[cfg(feature = "sim")]
mod quickstart;
#[cfg(feature = "sim")]
mod reliability;
mod render;
#[cfg(feature = "sim")]
mod rollout;
#[cfg(feature = "sim")]
mod rollout_config;
#[cfg(feature = "sim")]
mod untrusted;
