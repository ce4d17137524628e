//! The dedicated, bounded thread pool that runs sync tools: the part proven with loom.
//!
//! Threads are spawned on demand up to `max_threads` and live until the pool shuts down. The
//! pool does not bound its queue: its user does, before submitting (the dispatcher admits at
//! most `max_threads + queue_capacity` calls through its slots). A bound here as well would
//! race with that one: a job hands its slot back as it finishes, a moment before its thread
//! re-locks the pool to count it done. A job submitted after shutdown began is cancelled at
//! once. Every job handed to
//! [`Pool::submit`] is resolved exactly once: either [`Job::run`] on a pool thread or
//! [`Job::cancel`] with the reason. That is the property the loom models in `pool/models.rs`
//! check, together with the thread bound, liveness (a job submitted to an idle pool runs, the
//! pool grows to run blocked jobs side by side, closing wakes every idle thread) and real
//! joins at shutdown.
//!
//! This pool is deliberately not tokio's blocking pool: that one is shared with everything
//! else in the process that calls `spawn_blocking` (reward scoring among them) and caps out
//! below the number of rollouts an engine keeps in flight, so a burst of slow tools would
//! queue behind unrelated work and vice versa.

use std::{collections::VecDeque, fmt, io, panic::AssertUnwindSafe};

use crate::sync::{self, Arc, Condvar, Mutex, thread};

#[cfg(all(test, tool_dispatch_loom))]
mod models;

/// Work the pool runs on one of its threads.
pub(crate) trait Job: Send + 'static {
    /// Runs the job on a pool thread.
    fn run(self: Box<Self>);
    /// Resolves the job without running it.
    fn cancel(self: Box<Self>, reason: Rejected);
}

/// Why the pool did not run a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rejected {
    /// Shutdown had begun: the job was refused or taken off the queue.
    ShuttingDown,
    /// No pool thread exists and the operating system refused to start one.
    NoThread,
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rejected::ShuttingDown => "cancelled: shutting down",
            Rejected::NoThread => "the tool pool could not start a thread",
        })
    }
}

/// Sizing of a [`Pool`].
#[derive(Debug, Clone)]
pub(crate) struct PoolConfig {
    /// Most threads the pool ever runs at once.
    pub(crate) max_threads: usize,
    /// Prefix of the pool threads' names.
    pub(crate) thread_name: String,
    /// Deliberate bugs that the loom models must catch (see `pool/models.rs`).
    #[cfg(tool_dispatch_loom)]
    pub(crate) faults: Faults,
}

/// Deliberate bugs, compiled only for the loom models, to show that each model can fail.
///
/// `cargo xtask loom` plants each one alone (`TOOL_DISPATCH_LOOM_FAULTS=name`) and checks that
/// the model it names fails with the assertion it names.
#[cfg(tool_dispatch_loom)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Faults {
    /// `submit` starts a new thread even when `max_threads` already run.
    pub(crate) spawn_past_max: bool,
    /// `submit` never starts a second thread: the pool stays at one.
    pub(crate) pool_never_grows: bool,
    /// `submit` hands a job to an idle thread without waking it (a lost wake-up).
    pub(crate) submit_skips_wakeup: bool,
    /// `submit` queues a job without checking that shutdown has begun.
    pub(crate) submit_ignores_shutdown: bool,
    /// A pool thread runs a job without counting it in `running`.
    pub(crate) running_not_counted: bool,
    /// `close` empties the queue without cancelling the jobs it held.
    pub(crate) close_drops_queued: bool,
    /// `close` does not wake idle threads.
    pub(crate) close_skips_wakeup: bool,
    /// `shutdown` counts its threads as joined without joining them.
    pub(crate) shutdown_skips_join: bool,
    /// A call's job runs although its waiter gave up while it was queued (`call_state.rs`).
    pub(crate) run_abandoned_job: bool,
    /// A waiter counts a stuck thread after marking the call abandoned (`call_state.rs`).
    pub(crate) count_stuck_after_cas: bool,
    /// A dropped waiter leaves its call as it was instead of abandoning it (`call_state.rs`).
    pub(crate) waiting_drop_keeps_call: bool,
    /// A job skipped because its waiter gave up never releases its slot (`call_state.rs`).
    pub(crate) skipped_job_keeps_slot: bool,
    /// A job that ran releases its slot, then sends it back to be released again
    /// (`call_state.rs`).
    pub(crate) finished_job_releases_slot_twice: bool,
}

#[cfg(tool_dispatch_loom)]
impl Faults {
    /// Every fault's name, as `TOOL_DISPATCH_LOOM_FAULTS` spells it.
    pub(crate) const NAMES: [&'static str; 13] = [
        "spawn_past_max",
        "pool_never_grows",
        "submit_skips_wakeup",
        "submit_ignores_shutdown",
        "running_not_counted",
        "close_drops_queued",
        "close_skips_wakeup",
        "shutdown_skips_join",
        "run_abandoned_job",
        "count_stuck_after_cas",
        "waiting_drop_keeps_call",
        "skipped_job_keeps_slot",
        "finished_job_releases_slot_twice",
    ];

    /// The faults named, comma-separated, in `TOOL_DISPATCH_LOOM_FAULTS` (none when unset).
    ///
    /// # Panics
    /// On a name that is not in [`Faults::NAMES`], with a message that lists them: a check
    /// that plants a fault the crate does not know must fail as such, never pass as "caught".
    pub(crate) fn from_env() -> Faults {
        let mut faults = Faults::default();
        let names = std::env::var("TOOL_DISPATCH_LOOM_FAULTS").unwrap_or_default();
        for name in names
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
        {
            let flag = match name {
                "spawn_past_max" => &mut faults.spawn_past_max,
                "pool_never_grows" => &mut faults.pool_never_grows,
                "submit_skips_wakeup" => &mut faults.submit_skips_wakeup,
                "submit_ignores_shutdown" => &mut faults.submit_ignores_shutdown,
                "running_not_counted" => &mut faults.running_not_counted,
                "close_drops_queued" => &mut faults.close_drops_queued,
                "close_skips_wakeup" => &mut faults.close_skips_wakeup,
                "shutdown_skips_join" => &mut faults.shutdown_skips_join,
                "run_abandoned_job" => &mut faults.run_abandoned_job,
                "count_stuck_after_cas" => &mut faults.count_stuck_after_cas,
                "waiting_drop_keeps_call" => &mut faults.waiting_drop_keeps_call,
                "skipped_job_keeps_slot" => &mut faults.skipped_job_keeps_slot,
                "finished_job_releases_slot_twice" => &mut faults.finished_job_releases_slot_twice,
                other => panic!(
                    "unknown fault {other:?} in TOOL_DISPATCH_LOOM_FAULTS; known faults: {}",
                    Faults::NAMES.join(", ")
                ),
            };
            *flag = true;
        }
        faults
    }
}

/// Reads a fault flag; always `false` outside the loom build.
macro_rules! fault {
    ($shared:expr, $name:ident) => {{
        #[cfg(tool_dispatch_loom)]
        let on = $shared.config.faults.$name;
        #[cfg(not(tool_dispatch_loom))]
        let on = false;
        on
    }};
}

/// What [`Pool::shutdown`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PoolReport {
    /// Queued jobs cancelled.
    pub(crate) cancelled: usize,
    /// Jobs that were running when shutdown began and finished before the deadline.
    pub(crate) completed: usize,
    /// Jobs still running at the deadline (their threads are detached, not killed).
    pub(crate) still_running: usize,
    /// Threads joined.
    pub(crate) threads_joined: usize,
    /// Threads left running past the deadline; each exits when its job returns.
    pub(crate) threads_detached: usize,
}

/// A point-in-time view of the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PoolState {
    pub(crate) threads: usize,
    pub(crate) running: usize,
    pub(crate) queued: usize,
    pub(crate) completed: u64,
}

/// A bounded pool of dedicated threads. Dropping it stops it without waiting (see `Drop`).
pub(crate) struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued for an idle thread, and when the pool closes.
    work: Condvar,
    /// Signalled when a thread exits.
    exited: Condvar,
    config: PoolConfig,
}

struct State {
    queue: VecDeque<Box<dyn Job>>,
    open: bool,
    /// Live threads.
    threads: usize,
    /// Threads waiting for work that no submitter has claimed yet.
    idle: usize,
    /// Wake-ups handed to idle threads and not yet taken.
    notified: usize,
    running: usize,
    completed: u64,
    handles: Vec<thread::JoinHandle<()>>,
    next_thread_id: usize,
}

impl Pool {
    /// Creates a pool; no thread starts until the first job arrives.
    pub(crate) fn new(config: PoolConfig) -> Pool {
        assert!(
            config.max_threads > 0,
            "a tool pool needs at least one thread"
        );
        Pool {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    open: true,
                    threads: 0,
                    idle: 0,
                    notified: 0,
                    running: 0,
                    completed: 0,
                    handles: Vec::new(),
                    next_thread_id: 0,
                }),
                work: Condvar::new(),
                exited: Condvar::new(),
                config,
            }),
        }
    }

    #[cfg_attr(tool_dispatch_loom, allow(dead_code))]
    pub(crate) fn max_threads(&self) -> usize {
        self.shared.config.max_threads
    }

    /// Hands `job` to the pool. On `Err` the job has already been cancelled with the reason.
    pub(crate) fn submit(&self, job: Box<dyn Job>) -> Result<(), Rejected> {
        let shared = &self.shared;
        let mut state = sync::lock(&shared.state);
        if !state.open && !fault!(shared, submit_ignores_shutdown) {
            drop(state);
            job.cancel(Rejected::ShuttingDown);
            return Err(Rejected::ShuttingDown);
        }

        state.queue.push_back(job);
        let max_threads = if fault!(shared, pool_never_grows) {
            1
        } else {
            shared.config.max_threads
        };
        let can_grow = state.threads < max_threads || fault!(shared, spawn_past_max);
        if state.idle > 0 {
            state.idle -= 1;
            state.notified += 1;
            if !fault!(shared, submit_skips_wakeup) {
                shared.work.notify_one();
            }
        } else if can_grow && let Err(error) = spawn_thread(shared, &mut state) {
            if state.threads == 0 {
                let job = state.queue.pop_back();
                drop(state);
                tracing::error!(%error, "tool pool could not start its first thread");
                if let Some(job) = job {
                    job.cancel(Rejected::NoThread);
                }
                return Err(Rejected::NoThread);
            }
            // The job stays queued for the threads that exist.
            tracing::warn!(%error, threads = state.threads, "tool pool could not grow");
        }
        Ok(())
    }

    /// Stops accepting jobs, cancels the queued ones and wakes idle threads so they exit.
    /// Returns how many jobs were cancelled and how many were running.
    pub(crate) fn close(&self) -> (usize, usize) {
        let shared = &self.shared;
        let mut state = sync::lock(&shared.state);
        state.open = false;
        let queued = std::mem::take(&mut state.queue);
        let running = state.running;
        if !fault!(shared, close_skips_wakeup) {
            shared.work.notify_all();
        }
        drop(state);

        let cancelled = queued.len();
        if fault!(shared, close_drops_queued) {
            drop(queued);
        } else {
            for job in queued {
                job.cancel(Rejected::ShuttingDown);
            }
        }
        (cancelled, running)
    }

    /// Closes the pool, then waits for its threads to exit, for at most `timeout` when one is
    /// given (loom has no clock, so its models always wait). Threads still running a job at
    /// the deadline are detached: a thread cannot be killed, it exits when its job returns.
    pub(crate) fn shutdown(&self, timeout: Option<std::time::Duration>) -> PoolReport {
        let (cancelled, running_at_close) = self.close();
        #[cfg(not(tool_dispatch_loom))]
        let deadline = timeout.and_then(|timeout| std::time::Instant::now().checked_add(timeout));
        #[cfg(tool_dispatch_loom)]
        assert!(timeout.is_none(), "loom models have no clock");

        let mut state = sync::lock(&self.shared.state);
        while state.threads > 0 {
            #[cfg(not(tool_dispatch_loom))]
            if let Some(deadline) = deadline {
                let now = std::time::Instant::now();
                if now >= deadline {
                    break;
                }
                state = sync::wait_timeout(&self.shared.exited, state, deadline - now);
                continue;
            }
            state = sync::wait(&self.shared.exited, state);
        }
        let still_running = state.running;
        let all_exited = state.threads == 0;
        let handles = std::mem::take(&mut state.handles);
        drop(state);

        let mut report = PoolReport {
            cancelled,
            completed: running_at_close.saturating_sub(still_running),
            still_running,
            ..PoolReport::default()
        };
        for handle in handles {
            if all_exited || is_finished(&handle) {
                // A thread's job cannot unwind into it (the worker catches panics), so a join
                // error would only repeat a panic that was already reported.
                if !fault!(self.shared, shutdown_skips_join) {
                    let _ = handle.join();
                }
                report.threads_joined += 1;
            } else {
                report.threads_detached += 1;
            }
        }
        report
    }

    pub(crate) fn state(&self) -> PoolState {
        let state = sync::lock(&self.shared.state);
        PoolState {
            threads: state.threads,
            running: state.running,
            queued: state.queue.len(),
            completed: state.completed,
        }
    }
}

impl Drop for Pool {
    /// Dropping the pool without [`Pool::shutdown`] cancels the queue and lets each thread
    /// exit after its current job, without waiting for it: a drop must never hang.
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.shared.config)
            .field("state", &self.state())
            .finish()
    }
}

#[cfg(not(tool_dispatch_loom))]
fn is_finished(handle: &thread::JoinHandle<()>) -> bool {
    handle.is_finished()
}

#[cfg(tool_dispatch_loom)]
fn is_finished(_: &thread::JoinHandle<()>) -> bool {
    false
}

/// Starts one more pool thread; called with the state locked.
fn spawn_thread(shared: &Arc<Shared>, state: &mut State) -> io::Result<()> {
    let id = state.next_thread_id;
    let worker = {
        let shared = Arc::clone(shared);
        move || run_thread(&shared)
    };
    let builder = thread::Builder::new().name(format!("{}-{id}", shared.config.thread_name));
    let handle = builder.spawn(worker)?;
    state.next_thread_id += 1;
    state.threads += 1;
    state.handles.push(handle);
    Ok(())
}

/// The loop of one pool thread: run queued jobs, park while there are none, exit on close.
fn run_thread(shared: &Shared) {
    let mut state = sync::lock(&shared.state);
    loop {
        while let Some(job) = state.queue.pop_front() {
            if !fault!(shared, running_not_counted) {
                state.running += 1;
            }
            drop(state);
            // A job catches its own panics; this guard keeps the thread alive if one does not.
            if std::panic::catch_unwind(AssertUnwindSafe(|| job.run())).is_err() {
                tracing::error!("a tool pool job panicked outside its own guard");
            }
            state = sync::lock(&shared.state);
            state.running -= 1;
            state.completed += 1;
        }
        if !state.open {
            break;
        }
        state.idle += 1;
        loop {
            state = sync::wait(&shared.work, state);
            if state.notified > 0 {
                // A submitter claimed this idle thread (or another one, which then finds the
                // wake-up taken and keeps waiting: `idle` still counts it).
                state.notified -= 1;
                break;
            }
            if !state.open {
                state.idle -= 1;
                break;
            }
            // A spurious wake-up: keep waiting.
        }
    }
    state.threads -= 1;
    shared.exited.notify_all();
}
