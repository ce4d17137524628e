//! Integration tests of rollout-core: one test binary, one module per area.

mod parse;
mod reconcile;
