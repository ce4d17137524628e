//! The one module that names `std::sync` or `loom::sync`; everything else imports from here.
//!
//! Under `--cfg tool_dispatch_loom` the pool core runs on loom's primitives so that
//! `cargo xtask loom` can explore its interleavings. The cfg is crate-specific on purpose: a
//! global `--cfg loom` would change tokio itself and break the async layer's dependencies.
//!
//! The dispatcher's slots (a tokio [`Semaphore`]) and the channel that carries a sync call's
//! answer back to its waiter (a tokio [`oneshot`]) are swapped here too: under loom they are
//! the small models below, with the same names and the methods the crate uses, so that the
//! code moving a call's slot through the pool (`call_state.rs`) is model-checked as it is.

#[cfg(not(tool_dispatch_loom))]
pub(crate) use std::{
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering},
    },
    thread,
};
#[cfg(not(tool_dispatch_loom))]
pub(crate) use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

#[cfg(tool_dispatch_loom)]
pub(crate) use self::model::{Gate, OwnedSemaphorePermit, Semaphore, oneshot, spin_until};
#[cfg(tool_dispatch_loom)]
pub(crate) use loom::{
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering},
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

/// Loom stand-ins for tokio's semaphore and oneshot channel, and the models' liveness wait.
#[cfg(tool_dispatch_loom)]
mod model {
    use loom::sync::{Arc, Condvar, Mutex};

    use super::{lock, wait};

    /// A door that a model's jobs wait behind until the model opens it.
    #[derive(Default)]
    pub(crate) struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
    }

    impl Gate {
        pub(crate) fn open(&self) {
            *lock(&self.open) = true;
            self.opened.notify_all();
        }

        pub(crate) fn wait(&self) {
            let mut open = lock(&self.open);
            while !*open {
                open = wait(&self.opened, open);
            }
        }
    }

    /// How many times [`spin_until`] yields before it concludes that nothing can happen.
    ///
    /// Far more than a fair schedule needs: `cargo xtask loom` bounds preemptions at 2 or 3.
    const SPINS: usize = 24;

    /// Waits until `done()` holds, yielding to the other threads; panics with "never came
    /// true: `what`" if it still does not hold after [`SPINS`] yields.
    ///
    /// Loom has no clock, so this is how a model checks liveness (a job submitted to an idle
    /// pool runs, two jobs run at once) with an assertion instead of a hang. A loom
    /// `yield_now` lets another runnable thread take a step before this one runs again, and
    /// with preemptions bounded loom can only come back here a few times while some other
    /// thread is still runnable. After `SPINS` yields with `done()` still false, every other
    /// thread is blocked or finished: what the model waits for can no longer happen (a
    /// wake-up was lost, a thread was never started).
    pub(crate) fn spin_until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..SPINS {
            if done() {
                return;
            }
            loom::thread::yield_now();
        }
        assert!(
            done(),
            "never came true: {what} (every other thread is blocked or finished)"
        );
    }

    /// A model of [`tokio::sync::Semaphore`]: the methods the crate and its models use, and a
    /// ledger of the permits it was built with, so that a model can check that every permit
    /// came back exactly once.
    #[derive(Debug)]
    pub(crate) struct Semaphore {
        state: Mutex<Permits>,
        released: Condvar,
        capacity: usize,
    }

    #[derive(Debug)]
    struct Permits {
        available: usize,
        /// Permits handed out and not yet released.
        held: usize,
        /// Set once `available + held` went above `capacity`: a permit was released twice.
        overflowed: bool,
    }

    /// A model of [`tokio::sync::OwnedSemaphorePermit`]: releases its permit when dropped.
    #[derive(Debug)]
    pub(crate) struct OwnedSemaphorePermit {
        semaphore: Arc<Semaphore>,
        /// `false` once forgotten: a forgotten permit never comes back.
        live: bool,
    }

    impl Semaphore {
        pub(crate) fn new(permits: usize) -> Semaphore {
            Semaphore {
                state: Mutex::new(Permits {
                    available: permits,
                    held: 0,
                    overflowed: false,
                }),
                released: Condvar::new(),
                capacity: permits,
            }
        }

        /// Takes a permit, waiting for one to be released (tokio's `blocking_acquire_owned`;
        /// loom's `Arc` cannot be a method receiver).
        pub(crate) fn blocking_acquire_owned(semaphore: &Arc<Semaphore>) -> OwnedSemaphorePermit {
            let mut permits = lock(&semaphore.state);
            while permits.available == 0 {
                permits = wait(&semaphore.released, permits);
            }
            permits.available -= 1;
            permits.held += 1;
            drop(permits);
            OwnedSemaphorePermit {
                semaphore: Arc::clone(semaphore),
                live: true,
            }
        }

        /// Adds `n` permits (what tokio's does; here also noted if it exceeds the capacity).
        pub(crate) fn add_permits(&self, n: usize) {
            let mut permits = lock(&self.state);
            permits.available += n;
            if permits.available + permits.held > self.capacity {
                permits.overflowed = true;
            }
            drop(permits);
            self.released.notify_all();
        }

        /// Panics unless every permit was released exactly once: none is still held, none
        /// was forgotten, none came back twice (the bound `capacity` always held).
        pub(crate) fn assert_every_permit_returned_once(&self) {
            let permits = lock(&self.state);
            let (available, held, capacity) = (permits.available, permits.held, self.capacity);
            assert!(
                !permits.overflowed && available <= capacity,
                "a slot was released twice: {available} free and {held} held of {capacity}"
            );
            assert!(
                held == 0 && available == capacity,
                "a slot was never returned: {available} free and {held} held of {capacity}"
            );
        }

        fn release(&self) {
            let mut permits = lock(&self.state);
            permits.held -= 1;
            permits.available += 1;
            if permits.available + permits.held > self.capacity {
                permits.overflowed = true;
            }
            drop(permits);
            self.released.notify_all();
        }
    }

    impl OwnedSemaphorePermit {
        pub(crate) fn semaphore(&self) -> &Arc<Semaphore> {
            &self.semaphore
        }

        /// Never releases this permit (tokio's `forget`).
        pub(crate) fn forget(mut self) {
            self.live = false;
            lock(&self.semaphore.state).held -= 1;
        }
    }

    impl Drop for OwnedSemaphorePermit {
        fn drop(&mut self) {
            if self.live {
                self.semaphore.release();
            }
        }
    }

    /// A model of [`tokio::sync::oneshot`]: a value sent once, received once; a value that
    /// nobody receives is dropped with the channel, as tokio's is.
    pub(crate) mod oneshot {
        use loom::sync::{Arc, Condvar, Mutex};

        use super::{lock, wait};

        pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
            let shared = Arc::new(Shared {
                state: Mutex::new(State {
                    value: None,
                    sender_gone: false,
                    receiver_gone: false,
                }),
                changed: Condvar::new(),
            });
            (
                Sender {
                    shared: Arc::clone(&shared),
                },
                Receiver { shared },
            )
        }

        #[derive(Debug)]
        struct Shared<T> {
            state: Mutex<State<T>>,
            changed: Condvar,
        }

        #[derive(Debug)]
        struct State<T> {
            value: Option<T>,
            sender_gone: bool,
            receiver_gone: bool,
        }

        #[derive(Debug)]
        pub(crate) struct Sender<T> {
            shared: Arc<Shared<T>>,
        }

        #[derive(Debug)]
        pub(crate) struct Receiver<T> {
            shared: Arc<Shared<T>>,
        }

        /// The sender went away without sending.
        #[derive(Debug)]
        pub(crate) struct RecvError;

        impl<T> Sender<T> {
            /// Sends `value`, or gives it back when the receiver is gone.
            pub(crate) fn send(self, value: T) -> Result<(), T> {
                let mut state = lock(&self.shared.state);
                if state.receiver_gone {
                    return Err(value);
                }
                state.value = Some(value);
                Ok(())
                // `self` drops here: `sender_gone` is set and the receiver woken.
            }
        }

        impl<T> Drop for Sender<T> {
            fn drop(&mut self) {
                lock(&self.shared.state).sender_gone = true;
                self.shared.changed.notify_all();
            }
        }

        impl<T> Receiver<T> {
            /// Waits for the value; `Err` if the sender went away without sending one.
            pub(crate) fn blocking_recv(self) -> Result<T, RecvError> {
                let mut state = lock(&self.shared.state);
                loop {
                    if let Some(value) = state.value.take() {
                        return Ok(value);
                    }
                    if state.sender_gone {
                        return Err(RecvError);
                    }
                    state = wait(&self.shared.changed, state);
                }
            }
        }

        impl<T> Drop for Receiver<T> {
            fn drop(&mut self) {
                let mut state = lock(&self.shared.state);
                state.receiver_gone = true;
                let unreceived = state.value.take();
                drop(state);
                // Outside the lock: the value may hold a permit, whose release locks its
                // semaphore.
                drop(unreceived);
            }
        }
    }
}
