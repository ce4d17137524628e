//! The one module that names `std::sync`; everything else imports from here, so that a
//! model checker can be swapped in the way tool-dispatch does, should the crate grow a
//! concurrency core of its own.

pub(crate) use std::sync::Arc;
#[cfg(feature = "regex")]
pub(crate) use std::sync::LazyLock;
#[cfg(feature = "scorer")]
pub(crate) use std::sync::{
    Mutex,
    atomic::{AtomicU64, Ordering},
};
