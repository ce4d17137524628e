//! The handshake between a sync call's waiter and its pool job: who gives up, who runs, where
//! the call's slot goes, and the gauge of threads stuck in calls nobody waits for any more.
//! Loom-checked in `call_state/models.rs`.
//!
//! [`handshake`] starts a call: a [`CallJob`] for the pool carrying the turn's slot, and the
//! receiver its waiter awaits, wrapped in [`Waiting`]. A waiter gives up (timeout, shutdown
//! deadline, dropped future) with [`Waiting::abandon`], or by being dropped; the job calls
//! [`CallState::start`] when a thread takes it and [`CallState::finish`] when the work
//! returns. Whatever the interleaving: a job abandoned while queued never runs; a job
//! abandoned while running is counted as a stuck thread exactly until it returns; the gauge
//! never goes below zero; and the call's slot is released exactly once, by whoever holds it
//! last (the waiter that got it back with the answer, or the job whose waiter is gone).

#[cfg(tool_dispatch_loom)]
use crate::pool::Faults;
use crate::{
    pool::Rejected,
    sync::{Arc, AtomicU8, AtomicUsize, Ordering, OwnedSemaphorePermit, oneshot},
};

#[cfg(all(test, tool_dispatch_loom))]
mod models;

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

/// The waiter's side of a sync call. Dropped while armed (the turn's future was dropped), it
/// abandons the call, so that a queued job is skipped and a running one is counted as stuck.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    state: Arc<CallState>,
    stuck: &'a AtomicUsize,
    armed: bool,
}

impl<'a> Waiting<'a> {
    pub(crate) fn new(state: Arc<CallState>, stuck: &'a AtomicUsize) -> Waiting<'a> {
        Waiting {
            state,
            stuck,
            armed: true,
        }
    }

    /// Gives up on the call; says where it was.
    pub(crate) fn abandon(&mut self) -> Abandoned {
        self.armed = false;
        self.state.abandon(self.stuck)
    }

    /// The answer arrived: nothing is left to give up.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        #[cfg(tool_dispatch_loom)]
        if self.state.faults.waiting_drop_keeps_call {
            return;
        }
        if self.armed {
            self.abandon();
        }
    }
}

/// What a sync call's job sends its waiter, with the slot the call carried.
#[derive(Debug)]
pub(crate) enum Reply<T> {
    /// The work ran; `outcome` is what it returned (a caught panic included).
    Finished {
        outcome: T,
        slot: OwnedSemaphorePermit,
    },
    /// The pool did not run the job.
    Cancelled {
        reason: Rejected,
        slot: OwnedSemaphorePermit,
    },
}

/// The pool job of a sync call, without the tool: it runs the work unless the waiter gave up
/// while the call was queued, and hands the call's slot back exactly once. The slot goes back
/// to the waiter with the answer; when the waiter is gone (or gave up while the call was
/// queued) it is released here, so a slot stays taken exactly as long as a thread is busy
/// with a call that holds it.
#[derive(Debug)]
pub(crate) struct CallJob<T> {
    state: Arc<CallState>,
    slot: OwnedSemaphorePermit,
    reply: oneshot::Sender<Reply<T>>,
}

/// How [`CallJob::run`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Run {
    /// The waiter gave up while the call was queued: the work did not run.
    Skipped,
    /// The work ran with its waiter waiting.
    Awaited,
    /// The work ran, and the waiter gave up while it did: its thread was counted as stuck
    /// until now.
    Unawaited,
}

/// Starts one sync call carrying `slot`: the job to submit to the pool, the state its waiter
/// shares (see [`Waiting::new`]), and the receiver of the job's [`Reply`].
pub(crate) fn handshake<T>(
    slot: OwnedSemaphorePermit,
) -> (CallJob<T>, Arc<CallState>, oneshot::Receiver<Reply<T>>) {
    let state = Arc::new(CallState::new());
    let (reply, replied) = oneshot::channel();
    let job = CallJob {
        state: Arc::clone(&state),
        slot,
        reply,
    };
    (job, state, replied)
}

impl<T> CallJob<T> {
    /// On a pool thread: runs `work` unless the waiter gave up while the call was queued, and
    /// sends what it returned, with the slot, to the waiter. `stuck` is the gauge of threads
    /// running calls nobody waits for.
    pub(crate) fn run(self, stuck: &AtomicUsize, work: impl FnOnce() -> T) -> Run {
        let CallJob { state, slot, reply } = self;
        if !state.start() {
            // Abandoned while queued: nobody waits for it, so it does not run, and its slot
            // is free again.
            #[cfg(tool_dispatch_loom)]
            if state.faults.skipped_job_keeps_slot {
                slot.forget();
                return Run::Skipped;
            }
            drop(slot);
            return Run::Skipped;
        }
        let outcome = work();
        let unobserved = state.finish(stuck);
        #[cfg(tool_dispatch_loom)]
        if state.faults.finished_job_releases_slot_twice {
            slot.semaphore().add_permits(1);
        }
        // A waiter that is gone dropped its receiver: the reply comes back and drops here,
        // and the slot with it.
        let _ = reply.send(Reply::Finished { outcome, slot });
        if unobserved {
            Run::Unawaited
        } else {
            Run::Awaited
        }
    }

    /// Resolves the call without running it; the slot goes back with the reason.
    pub(crate) fn cancel(self, reason: Rejected) {
        let CallJob { slot, reply, .. } = self;
        let _ = reply.send(Reply::Cancelled { reason, slot });
    }
}
