//! [`Lane`]: a counting semaphore for the threads that call sync Python tools.

use std::sync::{Condvar, Mutex, PoisonError};

use crate::lock;

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
