//! The one module that names `std::sync`; everything else imports from here (the
//! workspace's rule), with [`lock`], which goes on past a poisoned mutex.

pub(crate) use std::sync::{
    Arc, Mutex, MutexGuard, OnceLock, PoisonError,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

/// Locks a mutex, going on past a panic elsewhere: every mutex of the crate guards one value
/// that is set or taken whole, so a panic cannot leave it half-changed.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
