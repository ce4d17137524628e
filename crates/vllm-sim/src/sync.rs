//! The one module that names `std::sync`; everything else imports from here.

pub(crate) use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

/// Locks `mutex`, recovering the guard if a holder panicked (no critical section here can
/// leave the data half-updated).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
