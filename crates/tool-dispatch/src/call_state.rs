//! The handshake between a sync call's waiter and its pool job: who gives up, who runs, and
//! the gauge of threads stuck in calls nobody waits for any more. Loom-checked below.
//!
//! A waiter gives up (timeout, shutdown deadline, dropped future) with [`CallState::abandon`];
//! the job calls [`CallState::start`] when a thread takes it and [`CallState::finish`] when
//! the tool returns. Whatever the interleaving: a job abandoned while queued never runs; a job
//! abandoned while running is counted as a stuck thread exactly until it returns; the gauge
//! never goes below zero.

#[cfg(tool_dispatch_loom)]
use crate::pool::Faults;
use crate::sync::{AtomicU8, AtomicUsize, Ordering};

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const DONE: u8 = 2;
const ABANDONED: u8 = 3;

/// Where a call was when its waiter gave up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abandoned {
    /// Still queued: the pool thread that takes it skips it.
    Queued,
    /// Running: its thread is counted as stuck until the tool returns.
    Running,
    /// It had just finished: the reply is on its way.
    AlreadyDone,
}

/// Where a sync call is, shared by its waiter and its pool job.
#[derive(Debug)]
pub(crate) struct CallState {
    state: AtomicU8,
    #[cfg(tool_dispatch_loom)]
    faults: Faults,
}

impl CallState {
    pub(crate) fn new() -> CallState {
        CallState {
            state: AtomicU8::new(QUEUED),
            #[cfg(tool_dispatch_loom)]
            faults: Faults::from_env(),
        }
    }

    /// The job's side, when a thread takes it: `false` when the waiter already gave up (skip).
    pub(crate) fn start(&self) -> bool {
        #[cfg(tool_dispatch_loom)]
        if self.faults.run_abandoned_job {
            self.state.store(RUNNING, Ordering::Release);
            return true;
        }
        self.state
            .compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The job's side, when the tool returned: `true` when the waiter gave up while it ran, in
    /// which case its thread leaves the `stuck` gauge here.
    pub(crate) fn finish(&self, stuck: &AtomicUsize) -> bool {
        if self.state.swap(DONE, Ordering::AcqRel) != ABANDONED {
            return false;
        }
        let before = stuck.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "the stuck-thread gauge went below zero");
        true
    }

    /// The waiter's side, when it stops waiting.
    pub(crate) fn abandon(&self, stuck: &AtomicUsize) -> Abandoned {
        if self
            .state
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Abandoned::Queued;
        }
        #[cfg(tool_dispatch_loom)]
        if self.faults.count_stuck_after_cas {
            if self
                .state
                .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                stuck.fetch_add(1, Ordering::AcqRel);
                return Abandoned::Running;
            }
            return Abandoned::AlreadyDone;
        }
        // Count the thread as stuck before the job can see ABANDONED and uncount it.
        stuck.fetch_add(1, Ordering::AcqRel);
        if self
            .state
            .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return Abandoned::Running;
        }
        stuck.fetch_sub(1, Ordering::AcqRel);
        Abandoned::AlreadyDone
    }
}

#[cfg(all(test, tool_dispatch_loom))]
mod models {
    //! Loom models of the handshake; `cargo xtask loom` also runs each with a planted bug.

    use super::{Abandoned, CallState};
    use crate::sync::{Arc, AtomicBool, AtomicUsize, Ordering::SeqCst, thread};

    /// A waiter giving up races the job starting and finishing: a job abandoned while queued
    /// never runs, any other job does, and the stuck gauge ends at zero without ever going
    /// below it.
    ///
    /// Breaking it (`cargo xtask loom` does): with `run_abandoned_job` a job given up while
    /// queued runs anyway, and on finishing uncounts a stuck thread nobody counted (the gauge
    /// underflows); with `count_stuck_after_cas` the waiter counts the stuck thread after
    /// marking it abandoned, so the job can uncount it first, with the same underflow.
    #[test]
    fn loom_waiter_and_job_agree() {
        loom::model(|| {
            let state = Arc::new(CallState::new());
            let stuck = Arc::new(AtomicUsize::new(0));
            let ran = Arc::new(AtomicBool::new(false));
            let job = {
                let (state, stuck, ran) =
                    (Arc::clone(&state), Arc::clone(&stuck), Arc::clone(&ran));
                thread::spawn(move || {
                    if state.start() {
                        ran.store(true, SeqCst);
                        thread::yield_now();
                        state.finish(&stuck);
                    }
                })
            };
            let outcome = state.abandon(&stuck);
            job.join().expect("the job thread does not panic");

            assert_eq!(
                stuck.load(SeqCst),
                0,
                "every stuck thread was uncounted once"
            );
            assert_eq!(
                ran.load(SeqCst),
                outcome != Abandoned::Queued,
                "ran iff not given up while queued"
            );
        });
    }
}
