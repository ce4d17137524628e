//! End-to-end tests of the `async-grpo` binary and of the crates together: one test binary,
//! built with the `cli` feature (the binary's, which has the simulator and Parquet).

mod agent;
mod agent_forgery;
mod cli;
mod control_security;
mod environment;
mod judge;
mod operate;
mod quickstart;
mod reliability;
mod render;
mod reward_model;
mod rewards;
mod rollout;
mod rollout_config;
mod untrusted;
