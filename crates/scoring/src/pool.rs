//! The scorer's own thread pool for sync reward functions.
//!
//! A dedicated rayon pool: not the runtime's workers (a slow reward would stall every rollout)
//! and not tokio's shared blocking pool, nor the tool pool (scoring and tools must not queue
//! behind each other). A function that outlives its timeout keeps its thread until it returns.

use std::{any::Any, fmt, panic::AssertUnwindSafe};

use tokio::sync::oneshot;

/// A job's result, or the payload of its panic.
pub(crate) type JobResult<R> = Result<R, Box<dyn Any + Send>>;

/// The pool; dropping it lets its threads exit once their current job returns.
pub(crate) struct RewardPool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl RewardPool {
    pub(crate) fn new(
        threads: usize,
        name: &str,
    ) -> Result<RewardPool, rayon::ThreadPoolBuildError> {
        let prefix = name.to_owned();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("{prefix}-{i}"))
            // Jobs catch their own panics; without a handler rayon would abort the process.
            .panic_handler(|_| tracing::error!("a reward job panicked outside its own guard"))
            .build()?;
        Ok(RewardPool { pool, threads })
    }

    /// Runs `job` on a pool thread. The first receiver fires when the job starts, the second
    /// gets its result (or its panic payload). A job whose result receiver is gone by the time
    /// a thread takes it is skipped: nobody waits for it.
    pub(crate) fn run<R, F>(
        &self,
        job: F,
    ) -> (oneshot::Receiver<()>, oneshot::Receiver<JobResult<R>>)
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let (started, has_started) = oneshot::channel();
        let (done, result) = oneshot::channel();
        self.pool.spawn(move || {
            if done.is_closed() {
                return;
            }
            let _ = started.send(());
            let _ = done.send(std::panic::catch_unwind(AssertUnwindSafe(job)));
        });
        (has_started, result)
    }
}

impl fmt::Debug for RewardPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RewardPool")
            .field("threads", &self.threads)
            .finish()
    }
}
