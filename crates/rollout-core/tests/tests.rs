//! Integration tests of rollout-core: one test binary, one module per area.
//!
//! The rendering tests use real tokenizers and templates that `cargo xtask fixtures`
//! fetches into the fixture cache (`test_support::cache_dir`); the plain `cargo nextest run`
//! leaves them out, the `fixtures` and `ci` profiles run them.

mod append;
mod parity;
mod parse;
mod reconcile;
mod render;

pub(crate) use test_support::fixture;

pub(crate) use test_support::tokenizers::{
    llama31, llama31_with_its_template, quickstart, qwen3, qwen3_as_mistral, qwen3_with_template,
    qwen25,
};
