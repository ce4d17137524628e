//! The one module that names `std::sync`; everything else imports from here.

pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Locks `mutex`, going on when a panicking holder poisoned it: every value guarded in this
/// crate is left consistent between statements.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
