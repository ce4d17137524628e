//! Loom models of the pool core, run by `cargo xtask loom`.
//!
//! A model that cannot fail proves nothing, so each one names the deliberate bug
//! ([`Faults`]) that breaks it. `cargo xtask loom` first runs every model on the real pool,
//! then runs each model again with its bug planted (`TOOL_DISPATCH_LOOM_FAULTS=name`, read
//! by [`Faults::from_env`]) in a process of its own, and fails unless that run fails too. A
//! process of its own because loom reports a deadlock by panicking out of its scheduler,
//! which aborts rather than unwinds.

use super::{Faults, Job, Pool, PoolConfig, Rejected};
use crate::sync::{Arc, AtomicUsize, Ordering::SeqCst, thread};

/// Counts what happened to the jobs of one model run.
#[derive(Default)]
struct Probe {
    running: AtomicUsize,
    peak: AtomicUsize,
    ran: AtomicUsize,
    cancelled: AtomicUsize,
}

impl Probe {
    /// Jobs resolved so far, by running or by cancellation.
    fn resolved(&self) -> usize {
        self.ran.load(SeqCst) + self.cancelled.load(SeqCst)
    }
}

struct ProbeJob(Arc<Probe>);

impl Job for ProbeJob {
    fn run(self: Box<Self>) {
        let now = self.0.running.fetch_add(1, SeqCst) + 1;
        self.0.peak.fetch_max(now, SeqCst);
        thread::yield_now();
        self.0.running.fetch_sub(1, SeqCst);
        self.0.ran.fetch_add(1, SeqCst);
    }

    fn cancel(self: Box<Self>, _: Rejected) {
        self.0.cancelled.fetch_add(1, SeqCst);
    }
}

fn pool(max_threads: usize, faults: Faults) -> Pool {
    Pool::new(PoolConfig {
        max_threads,
        thread_name: "loom-tool".into(),
        faults,
    })
}

fn job(probe: &Arc<Probe>) -> Box<dyn Job> {
    Box::new(ProbeJob(Arc::clone(probe)))
}

/// The bound on concurrently running jobs is never exceeded, and every job is resolved.
///
/// Breaking it (`cargo xtask loom` does): with `spawn_past_max`, the second job starts a second thread while the first
/// still runs, so in some interleaving two jobs run at once and the peak assertion fails.
fn running_jobs_never_exceed_max_threads(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = pool(1, faults);
    let _ = pool.submit(job(&probe));
    let _ = pool.submit(job(&probe));
    let report = pool.shutdown(None);
    assert!(
        probe.peak.load(SeqCst) <= 1,
        "more jobs ran at once than the pool has threads"
    );
    assert_eq!(probe.resolved(), 2, "a job was neither run nor cancelled");
    assert_eq!(report.cancelled, probe.cancelled.load(SeqCst));
}

#[test]
fn loom_running_jobs_never_exceed_max_threads() {
    let faults = Faults::from_env();
    loom::model(move || running_jobs_never_exceed_max_threads(faults));
}

/// A job submitted concurrently with shutdown is either run or cancelled, never lost: once
/// both the submitter and `shutdown` have returned, its waiter has been resolved.
///
/// Breaking it (`cargo xtask loom` does): with `submit_ignores_shutdown`, a job that arrives after `close` drained the
/// queue is queued anyway and picked up by a thread started after shutdown returned, so the
/// job is still unresolved when the model checks.
fn job_racing_shutdown_is_run_or_cancelled(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = Arc::new(pool(1, faults));
    let _ = pool.submit(job(&probe));
    let submitter = {
        let (pool, probe) = (Arc::clone(&pool), Arc::clone(&probe));
        thread::spawn(move || {
            let _ = pool.submit(job(&probe));
        })
    };
    pool.shutdown(None);
    submitter
        .join()
        .expect("the submitter thread does not panic");
    assert_eq!(probe.resolved(), 2, "a job racing shutdown was lost");
}

#[test]
fn loom_job_racing_shutdown_is_run_or_cancelled() {
    let faults = Faults::from_env();
    loom::model(move || job_racing_shutdown_is_run_or_cancelled(faults));
}

/// Shutdown drains the queue: every queued job is cancelled (or was already taken by a
/// thread and run), and the report counts the cancelled ones.
///
/// Breaking it (`cargo xtask loom` does): with `close_drops_queued`, `close` empties the queue without cancelling, so
/// in interleavings where a job is still queued at shutdown its waiter never resolves.
fn shutdown_cancels_or_runs_every_queued_job(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = pool(1, faults);
    for _ in 0..3 {
        let _ = pool.submit(job(&probe));
    }
    let report = pool.shutdown(None);
    assert_eq!(probe.resolved(), 3, "a queued job was lost at shutdown");
    assert_eq!(report.cancelled, probe.cancelled.load(SeqCst));
    assert_eq!(report.threads_joined, 1);
    assert_eq!(report.still_running, 0);
}

#[test]
fn loom_shutdown_cancels_or_runs_every_queued_job() {
    let faults = Faults::from_env();
    loom::model(move || shutdown_cancels_or_runs_every_queued_job(faults));
}

/// Idle threads wake up and exit when the pool closes, so shutdown never deadlocks, whether
/// the close races the jobs or comes after every thread went idle.
///
/// Breaking it (`cargo xtask loom` does): with `close_skips_wakeup`, a thread parked for work is never woken, shutdown
/// waits for it forever, and loom reports the deadlock.
fn shutdown_wakes_idle_threads(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = Arc::new(pool(2, faults));
    let _ = pool.submit(job(&probe));
    let submitter = {
        let (pool, probe) = (Arc::clone(&pool), Arc::clone(&probe));
        thread::spawn(move || {
            let _ = pool.submit(job(&probe));
        })
    };
    submitter
        .join()
        .expect("the submitter thread does not panic");
    let report = pool.shutdown(None);
    assert_eq!(probe.resolved(), 2);
    assert_eq!(report.threads_detached, 0);
}

#[test]
fn loom_shutdown_wakes_idle_threads() {
    let faults = Faults::from_env();
    loom::model(move || shutdown_wakes_idle_threads(faults));
}
