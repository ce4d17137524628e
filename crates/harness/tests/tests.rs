//! Integration tests of the harness: one test binary, one module per area.

mod lifecycle;
#[cfg(feature = "proxy")]
mod proxy;
