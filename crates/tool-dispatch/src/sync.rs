//! The one module that names `std::sync` or `loom::sync`; everything else imports from here.
//!
//! Under `--cfg tool_dispatch_loom` the pool core runs on loom's primitives so that
//! `cargo xtask loom` can explore its interleavings. The cfg is crate-specific on purpose: a
//! global `--cfg loom` would change tokio itself and break the async layer's dependencies.

#[cfg(not(tool_dispatch_loom))]
pub(crate) use std::{
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering},
    },
    thread,
};

#[cfg(tool_dispatch_loom)]
pub(crate) use loom::{
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering},
    },
    thread,
};

/// Locks `mutex`, recovering the guard if a previous holder panicked.
///
/// Every critical section in this crate leaves the protected state consistent before any
/// code that can panic runs (jobs and tools run outside the lock), so a poisoned lock carries
/// no broken invariant and refusing it would only turn one failure into many.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar`, recovering from poisoning like [`lock`].
pub(crate) fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar
        .wait(guard)
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar` for at most `timeout`, recovering from poisoning like [`lock`].
#[cfg(not(tool_dispatch_loom))]
pub(crate) fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: std::time::Duration,
) -> MutexGuard<'a, T> {
    match condvar.wait_timeout(guard, timeout) {
        Ok((guard, _)) => guard,
        Err(poisoned) => poisoned.into_inner().0,
    }
}
