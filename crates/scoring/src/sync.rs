//! The one module that names `std::sync`; everything else imports from here, so that a
//! model checker can be swapped in the way tool-dispatch does, should the crate grow a
//! concurrency core of its own.

pub(crate) use std::sync::{
    Arc, LazyLock, Mutex,
    atomic::{AtomicU64, Ordering},
};
