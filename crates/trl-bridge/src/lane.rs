//! The one module that names `std::sync`; everything else imports from here (the
//! workspace's rule), with [`lock`], which goes on past a poisoned mutex.

pub(crate) use std::sync::{
    Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

/// Locks a mutex, going on past a panic elsewhere: every mutex of the crate guards one value
/// that is set or taken whole, so a panic cannot leave it half-changed.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A counting semaphore for threads (std has none): at most `permits` holders at once; the
/// others block on a condition variable, holding nothing else.
#[derive(Debug)]
pub(crate) struct Lane {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Lane {
    pub(crate) fn new(permits: usize) -> Lane {
        Lane {
            free: Mutex::new(permits.max(1)),
            freed: Condvar::new(),
        }
    }

    /// Blocks until a permit is free and holds it until the guard drops.
    pub(crate) fn enter(&self) -> LaneGuard<'_> {
        let mut free = lock(&self.free);
        while *free == 0 {
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *free -= 1;
        LaneGuard { lane: self }
    }
}

/// A permit of a [`Lane`], given back on drop.
#[derive(Debug)]
pub(crate) struct LaneGuard<'a> {
    lane: &'a Lane,
}

impl Drop for LaneGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.lane.free) += 1;
        self.lane.freed.notify_one();
    }
}
