//! [`Engine`]: the running loop's handle (versions, pause, metrics, drain) and its output.

use std::{
    fmt,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use rollout_core::RenderError;
use scoring::Scorer;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tool_dispatch::{ShutdownReport, ToolDispatcher};

use crate::{
    Generator, Health, Metrics, RolloutConfig, RolloutFailure, ScoredGroup, SettingError, Stats,
    config::InFlight, lock, shared::Shared,
};

/// How long a pause in [`InFlight::Continue`] waits for the interrupted requests to answer
/// before it interrupts again (one that reached the server after the interrupt runs on).
const INTERRUPT_AGAIN: Duration = Duration::from_secs(2);

/// The loop could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A setting cannot work.
    #[error(transparent)]
    Config(#[from] SettingError),
    /// The chat template could not be found or compiled.
    #[error(transparent)]
    Render(#[from] RenderError),
    /// No thread could be started to read the dataset.
    #[error("could not start the dataset reader: {0}")]
    Thread(std::io::Error),
}

/// What [`Engine::shutdown`] did.
#[derive(Debug, Clone)]
pub struct DrainReport {
    /// How long the drain took.
    pub elapsed: Duration,
    /// Whether every rollout in flight finished before the deadline (and none was ended by
    /// [`Engine::cancel`]) and every tool thread was joined.
    pub clean: bool,
    /// Rollouts still running at the deadline, or when [`Engine::cancel`] was called,
    /// cancelled.
    pub cancelled_at_deadline: u64,
    /// Counters at the end.
    pub stats: Stats,
    /// What the tool pool's shutdown did.
    pub tools: Option<ShutdownReport>,
    /// Why the run stopped early or failed, if it did: a bad dataset row, an unreadable
    /// file, no server past `server_wait`, or more failed rollouts than `max_failure_rate`.
    pub error: Option<String>,
    /// The bad rows skipped (with `skip_bad_rows`), each with its file, line and reason;
    /// the first 100.
    pub bad_rows: Vec<String>,
    /// Rollouts that failed after their retries, with their causes; the first 100 (those of
    /// dropped groups included, which no [`ScoredGroup`] carries).
    pub failures: Vec<RolloutFailure>,
}

/// The loop's output: scored groups, in the order they complete. It ends when the dataset
/// is done (or the group limit reached) and every group is out, or after a drain.
#[derive(Debug)]
pub struct Groups {
    pub(crate) receiver: mpsc::Receiver<ScoredGroup>,
}

impl Groups {
    /// The next scored group; `None` once the loop has ended and every group was received.
    pub async fn recv(&mut self) -> Option<ScoredGroup> {
        self.receiver.recv().await
    }

    /// The next scored group, blocking the thread (for a writer thread of its own); do not
    /// call it on the runtime.
    pub fn blocking_recv(&mut self) -> Option<ScoredGroup> {
        self.receiver.blocking_recv()
    }
}

/// A running rollout loop; see the [crate docs](crate).
///
/// Dropping it cancels what runs; [`Engine::shutdown`] drains instead.
pub struct Engine<G: Generator> {
    pub(crate) shared: Arc<Shared<G>>,
}

impl<G: Generator> fmt::Debug for Engine<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<G: Generator> Engine<G> {
    /// Turns sampled from now on record `version` (call it when the server's weights
    /// change); with `max_staleness`, groups left too far behind are cancelled. Versions only
    /// grow: a lower one than the current is refused with the current one
    /// (`Err(current)`); the current one again is a no-op.
    pub fn set_model_version(&self, version: u64) -> Result<(), u64> {
        let mut refused = None;
        self.shared.control.versions.send_if_modified(|current| {
            if version < *current {
                refused = Some(*current);
            }
            let newer = version > *current;
            if newer {
                *current = version;
            }
            newer
        });
        refused.map_or(Ok(()), Err)
    }

    /// The settings the loop runs with.
    pub fn config(&self) -> &RolloutConfig {
        &self.shared.config
    }

    /// The model version turns are sampled under now.
    pub fn model_version(&self) -> u64 {
        self.shared.control.model_version()
    }

    /// The context length the loop clips turns to, if known.
    pub fn max_model_len(&self) -> Option<u32> {
        self.shared.wiring.max_model_len
    }

    /// How the loop is doing. Cheap; call it as often as needed.
    pub fn health(&self) -> Health {
        let shared = &self.shared;
        let (scheduler_lag_p99, scheduler_lag_max) = shared.tallies.heartbeat.lag();
        Health {
            heartbeat_age: shared.tallies.heartbeat.age(),
            scheduler_lag_p99,
            scheduler_lag_max,
            in_flight: shared.rollouts_in_flight(),
            queued: shared.tallies.queued.load(Ordering::Relaxed),
            model_version: shared.control.model_version(),
            admission_closed: shared.control.admission_closed.load(Ordering::Acquire),
            paused: *shared.control.paused.borrow(),
            servers_unavailable: shared.wiring.generator.unavailable(),
            stats: shared.tallies.counters.snapshot(),
        }
    }

    /// Everything the loop counts, at this moment: what metrics and reports read.
    pub fn metrics(&self) -> Metrics {
        let shared = &self.shared;
        Metrics {
            health: self.health(),
            failures: shared.tallies.failures_by_cause.snapshot(),
            generation_latency: shared.tallies.generation_latency.snapshot(),
            generator: shared.wiring.generator.stats(),
            tools: shared.wiring.tools.as_ref().map(ToolDispatcher::metrics),
            rewards: shared.wiring.scorer.stats(),
        }
    }

    /// Pauses admission: no group is admitted and no admitted group starts until
    /// [`Engine::resume`]. With [`InFlight::Wait`] the rollouts in flight run to their end;
    /// with [`InFlight::Abort`] they are cancelled (their groups dropped, counted as
    /// cancelled); either way it returns once no rollout is in flight. With
    /// [`InFlight::Continue`] the rollouts stay, their requests are interrupted (the
    /// generator's [`Generator::interrupt`]: each answers with the tokens it has) and none
    /// is sent until the resume; it returns once no request is on the wire, which is when
    /// the weights may change: set the new version, then resume. Pausing a paused loop is
    /// harmless.
    pub async fn pause(&self, mode: InFlight) {
        let shared = &self.shared;
        let _one_at_a_time = shared.control.pausing.lock().await;
        shared.control.paused.send_replace(true);
        match mode {
            InFlight::Abort => {
                let mut abort = lock(&shared.control.abort);
                abort.cancel();
                *abort = CancellationToken::new();
            }
            InFlight::Continue => return self.hold_requests().await,
            InFlight::Wait => {}
        }
        loop {
            let mut freed = std::pin::pin!(shared.control.slot_freed.notified());
            // Waiting before the count is read: a slot freed in between still wakes this.
            freed.as_mut().enable();
            if shared.rollouts_in_flight() == 0 {
                return;
            }
            freed.await;
        }
    }

    /// Holds every generation request from now on, and interrupts those on the wire until
    /// none is: the write half of `requests`, queued before the interrupt so that an answer
    /// continued after it waits behind, kept until [`Engine::resume`].
    async fn hold_requests(&self) {
        let control = &self.shared.control;
        if lock(&control.held).is_some() {
            return;
        }
        let mut write = std::pin::pin!(Arc::clone(&control.requests).write_owned());
        // Polled once here, the write is queued: readers that come after wait behind it.
        let ready = tokio::select! {
            biased;
            guard = write.as_mut() => Some(guard),
            () = std::future::ready(()) => None,
        };
        let guard = match ready {
            Some(guard) => guard,
            None => loop {
                match self.shared.wiring.generator.interrupt().await {
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(
                        "the generator cannot interrupt requests: the pause waits for them to end"
                    ),
                    Err(error) => tracing::warn!(
                        %error,
                        "could not interrupt the requests in flight (vLLM needs VLLM_SERVER_DEV_MODE=1 for /pause); the pause waits for them to end"
                    ),
                }
                // A request that reached the server after the interrupt runs on: interrupt
                // again until none is left.
                match tokio::time::timeout(INTERRUPT_AGAIN, write.as_mut()).await {
                    Ok(guard) => break guard,
                    Err(_) => continue,
                }
            },
        };
        *lock(&control.held) = Some(guard);
    }

    /// Resumes admission after [`Engine::pause`], and the requests a pause in
    /// [`InFlight::Continue`] held: they are sent under the version current now.
    pub fn resume(&self) {
        drop(lock(&self.shared.control.held).take());
        self.shared.control.paused.send_replace(false);
    }

    /// The tool dispatcher, for its metrics.
    pub fn tools(&self) -> Option<&ToolDispatcher> {
        self.shared.wiring.tools.as_ref()
    }

    /// The scorer, for its statistics.
    pub fn scorer(&self) -> &Scorer {
        &self.shared.wiring.scorer
    }

    /// Stops admission and cancels every rollout in flight at once (their requests are
    /// dropped); a drain under way then ends without waiting for its deadline. Groups
    /// already complete are still scored and sent.
    pub fn cancel(&self) {
        let shared = &self.shared;
        shared.control.admission.cancel();
        if !shared.control.cancel.is_cancelled() {
            let in_flight = shared.rollouts_in_flight();
            shared
                .tallies
                .cancelled_in_flight
                .fetch_add(in_flight as u64, Ordering::Relaxed);
        }
        shared.control.cancel.cancel();
    }

    /// Drains: stops admission, lets rollouts in flight finish until `deadline`, then
    /// cancels the rest (their requests are dropped, which aborts them on the server);
    /// scores and sends every complete group; closes the output and the tool pool. Also the
    /// way to close a loop that ended by itself. Calling it again reports again.
    pub async fn shutdown(&self, deadline: Duration) -> DrainReport {
        let shared = &self.shared;
        let start = Instant::now();
        shared.control.admission.cancel();
        shared.control.tracker.close();
        let in_time = tokio::time::timeout(deadline, shared.control.tracker.wait())
            .await
            .is_ok();
        let mut cancelled_at_deadline = 0;
        if !in_time {
            cancelled_at_deadline = shared.rollouts_in_flight() as u64;
            tracing::warn!(
                rollouts = cancelled_at_deadline,
                "drain deadline reached: cancelling the rollouts still running"
            );
            shared.control.cancel.cancel();
            shared.control.tracker.wait().await;
        }
        shared.control.stop_heartbeat.cancel();
        let tools = match &shared.wiring.tools {
            Some(tools) => {
                let left = deadline
                    .saturating_sub(start.elapsed())
                    .max(Duration::from_millis(100));
                Some(tools.shutdown(left).await)
            }
            None => None,
        };
        if let Some(reason) = shared.failure_rate_exceeded(true) {
            shared.control.stop_run(reason);
        }
        let threads_clean = tools.as_ref().is_none_or(|t| t.threads_detached == 0);
        // Rollouts that `cancel` ended did not finish either, however soon the wait was over.
        let cancelled_early = shared.tallies.cancelled_in_flight.load(Ordering::Relaxed);
        DrainReport {
            elapsed: start.elapsed(),
            clean: in_time && cancelled_early == 0 && threads_clean,
            cancelled_at_deadline: cancelled_at_deadline + cancelled_early,
            stats: shared.tallies.counters.snapshot(),
            tools,
            error: lock(&shared.control.error).clone(),
            bad_rows: lock(&shared.tallies.bad_rows).clone(),
            failures: lock(&shared.tallies.failures).clone(),
        }
    }
}

impl<G: Generator> Drop for Engine<G> {
    fn drop(&mut self) {
        self.shared.control.admission.cancel();
        self.shared.control.cancel.cancel();
        self.shared.control.stop_heartbeat.cancel();
    }
}
