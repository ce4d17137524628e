//! Loom models of the pool core, run by `cargo xtask loom`.
//!
//! A model that cannot fail proves nothing, so each one names the deliberate bug
//! ([`Faults`]) that breaks it and the assertion that then fails. `cargo xtask loom` first
//! runs every model on the real pool, then runs each model again with its bug planted
//! (`TOOL_DISPATCH_LOOM_FAULTS=name`, read by [`Faults::from_env`]) in a process of its own,
//! and fails unless that run fails with that assertion's message.
//!
//! Liveness ("a job submitted to an idle pool runs", "two jobs run at once") is checked with
//! [`spin_until`], which turns "this never happens" into a failed assertion instead of a
//! hang or a loom deadlock report. Every model ends with [`assert_threads_joined`]: the
//! threads that `shutdown` counts as joined have exited.

use super::{Faults, Job, Pool, PoolConfig, PoolReport, Rejected};
use crate::sync::{self, Arc, AtomicUsize, Gate, Ordering::SeqCst, spin_until, thread};

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

/// A job that counts itself running, waits behind its gate (if any), and counts itself run.
struct ProbeJob {
    probe: Arc<Probe>,
    gate: Option<Arc<Gate>>,
}

impl Job for ProbeJob {
    fn run(self: Box<Self>) {
        let now = self.probe.running.fetch_add(1, SeqCst) + 1;
        self.probe.peak.fetch_max(now, SeqCst);
        match &self.gate {
            Some(gate) => gate.wait(),
            None => thread::yield_now(),
        }
        self.probe.running.fetch_sub(1, SeqCst);
        self.probe.ran.fetch_add(1, SeqCst);
    }

    fn cancel(self: Box<Self>, _: Rejected) {
        self.probe.cancelled.fetch_add(1, SeqCst);
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
    Box::new(ProbeJob {
        probe: Arc::clone(probe),
        gate: None,
    })
}

fn gated_job(probe: &Arc<Probe>, gate: &Arc<Gate>) -> Box<dyn Job> {
    Box::new(ProbeJob {
        probe: Arc::clone(probe),
        gate: Some(Arc::clone(gate)),
    })
}

/// After `shutdown(None)`: every thread the pool started was counted as joined, and each of
/// them has really exited, since none still holds the pool's shared state (a thread drops
/// its handle on it as it exits; only a join guarantees that it did).
fn assert_threads_joined(pool: &Pool, report: &PoolReport) {
    let started = sync::lock(&pool.shared.state).next_thread_id;
    assert_eq!(
        (report.threads_joined, report.threads_detached),
        (started, 0),
        "every thread the pool started is joined"
    );
    assert_eq!(
        Arc::strong_count(&pool.shared),
        1,
        "a thread counted as joined had not exited"
    );
}

/// The bound on concurrently running jobs is never exceeded, and every job is resolved.
///
/// Breaking it (`cargo xtask loom` does): with `spawn_past_max`, the second job starts a
/// second thread while the first still runs, so in some interleaving two jobs run at once
/// and the peak assertion fails.
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
    assert_threads_joined(&pool, &report);
}

#[test]
fn loom_running_jobs_never_exceed_max_threads() {
    let faults = Faults::from_env();
    loom::model(move || running_jobs_never_exceed_max_threads(faults));
}

/// With `max_threads = 2`, two jobs that block run at once: the pool grows to a second
/// thread for the second job, and counts both as running.
///
/// Breaking it (`cargo xtask loom` does): with `pool_never_grows` the second job waits in
/// the queue behind the first, which waits for the model, and "two blocked jobs ran at
/// once" never comes true; with `running_not_counted` the pool's `running` gauge reads 0
/// while both run.
fn two_blocked_jobs_run_at_once_on_two_threads(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let gate = Arc::new(Gate::default());
    let pool = pool(2, faults);
    let _ = pool.submit(gated_job(&probe, &gate));
    let _ = pool.submit(gated_job(&probe, &gate));
    spin_until("two blocked jobs ran at once", || {
        probe.running.load(SeqCst) == 2
    });
    assert_eq!(pool.state().running, 2, "the pool counts every running job");

    gate.open();
    let report = pool.shutdown(None);
    assert_eq!(probe.ran.load(SeqCst), 2);
    assert_eq!(report.cancelled, 0);
    assert_threads_joined(&pool, &report);
}

#[test]
fn loom_two_blocked_jobs_run_at_once_on_two_threads() {
    let faults = Faults::from_env();
    loom::model(move || two_blocked_jobs_run_at_once_on_two_threads(faults));
}

/// A submitted job runs before shutdown is asked for: the first one on the thread it starts,
/// and a later one on that thread once it went idle, which `submit` must wake.
///
/// Breaking it (`cargo xtask loom` does): with `submit_skips_wakeup` the idle thread sleeps
/// on with the job queued, and "a job submitted to an idle pool ran" never comes true.
fn a_submitted_job_runs_before_shutdown_is_asked_for(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = pool(1, faults);
    let _ = pool.submit(job(&probe));
    spin_until("the first job ran", || probe.ran.load(SeqCst) == 1);
    spin_until("the pool's thread went idle", || {
        sync::lock(&pool.shared.state).idle == 1
    });

    let _ = pool.submit(job(&probe));
    spin_until("a job submitted to an idle pool ran", || {
        probe.ran.load(SeqCst) == 2
    });

    let report = pool.shutdown(None);
    assert_eq!(report.cancelled, 0);
    assert_eq!(probe.cancelled.load(SeqCst), 0);
    assert_threads_joined(&pool, &report);
}

#[test]
fn loom_a_submitted_job_runs_before_shutdown_is_asked_for() {
    let faults = Faults::from_env();
    loom::model(move || a_submitted_job_runs_before_shutdown_is_asked_for(faults));
}

/// A job submitted concurrently with shutdown is either run or cancelled, never lost: once
/// both the submitter and `shutdown` have returned, its waiter has been resolved.
///
/// Breaking it (`cargo xtask loom` does): with `submit_ignores_shutdown`, a job that arrives
/// after `close` drained the queue is queued anyway and picked up by a thread started after
/// shutdown returned, so the job is still unresolved when the model checks.
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
/// thread and run), the report counts the cancelled ones, and the thread is joined.
///
/// Breaking it (`cargo xtask loom` does): with `close_drops_queued`, `close` empties the
/// queue without cancelling, so in interleavings where a job is still queued at shutdown
/// its waiter never resolves; with `shutdown_skips_join` the report counts the thread as
/// joined while, in some interleaving, it is still on its way out.
fn shutdown_cancels_or_runs_every_queued_job(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = pool(1, faults);
    for _ in 0..3 {
        let _ = pool.submit(job(&probe));
    }
    let report = pool.shutdown(None);
    assert_eq!(probe.resolved(), 3, "a queued job was lost at shutdown");
    assert_eq!(report.cancelled, probe.cancelled.load(SeqCst));
    assert_eq!(report.still_running, 0);
    assert_threads_joined(&pool, &report);
}

#[test]
fn loom_shutdown_cancels_or_runs_every_queued_job() {
    let faults = Faults::from_env();
    loom::model(move || shutdown_cancels_or_runs_every_queued_job(faults));
}

/// Idle threads wake up and exit when the pool closes, so shutdown returns, whether the
/// close races the jobs or comes after every thread went idle (two of them: one wake-up
/// would not do).
///
/// Breaking it (`cargo xtask loom` does): with `close_skips_wakeup`, a thread parked for
/// work is never woken and never exits, and "every pool thread exited" never comes true
/// (where `shutdown` would wait for it forever).
fn shutdown_wakes_idle_threads(faults: Faults) {
    let probe = Arc::new(Probe::default());
    let pool = pool(2, faults);
    let _ = pool.submit(job(&probe));
    let _ = pool.submit(job(&probe));
    // `shutdown` is `close`, then a wait for every thread to exit: the model does the wait
    // itself, so that a thread that never exits fails an assertion instead of hanging.
    pool.close();
    spin_until("every pool thread exited", || pool.state().threads == 0);
    let report = pool.shutdown(None);
    assert_eq!(probe.resolved(), 2);
    assert_threads_joined(&pool, &report);
}

#[test]
fn loom_shutdown_wakes_idle_threads() {
    let faults = Faults::from_env();
    loom::model(move || shutdown_wakes_idle_threads(faults));
}
