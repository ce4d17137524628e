//! The one module that names `std::sync`; everything else imports from here.

pub(crate) use std::sync::Arc;
#[cfg(feature = "rollout")]
pub(crate) use std::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};

/// Locks `mutex`, going on when a panicking holder poisoned it: every value guarded in this
/// crate is left consistent between statements.
#[cfg(feature = "rollout")]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
