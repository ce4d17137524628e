//! Integration tests of the vLLM client that need no server: every response recorded from a
//! real vLLM server decodes into the client's types. The client against a server is tested
//! in vllm-sim's suite (against the simulator, which depends on this crate's wire types, so
//! the suite lives there to keep the dependency one-way) and in `e2e` (a real vLLM server,
//! `cargo xtask e2e`).

mod wire;
