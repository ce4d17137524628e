//! The state the driver, the rollouts and the heartbeat share, and the rules they apply to it:
//! prompt rendering and size, the failure rate, staleness.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, AtomicU64, AtomicUsize},
};

use rollout_core::{
    ChatTokenizer, Message, NoExactDelta, RenderError, RenderOptions, RenderState, ToolCallParser,
};
use scoring::Scorer;
use tokio::sync::{Notify, OwnedRwLockWriteGuard, RwLock, Semaphore, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tool_dispatch::ToolDispatcher;

use crate::{
    Agent, DatasetError, DatasetRow, Environment, FailureCause, RolloutFailure,
    config::RolloutConfig,
    health::{Counters, Failures, Heartbeat, Latency},
    lock,
};

/// Rollouts that must have ended before [`RolloutConfig::max_failure_rate`] is judged during
/// a run (at the end it is judged on however many there were).
pub const FAILURE_RATE_MIN_ROLLOUTS: u64 = 16;

/// A dataset row read ahead, its prompt rendered (or refused) on the reader thread.
pub(crate) type ReadRow = Result<ReadOk, DatasetError>;
/// A row that parsed with its group id, and its prompt rendered or why it could not be.
pub(crate) type ReadOk = (u64, DatasetRow, Result<RenderState, RenderError>);

/// State shared by the driver, the rollouts and the heartbeat, in three parts: what a rollout
/// runs with ([`Wiring`]), what starts, pauses and stops work ([`Control`]) and what is
/// counted of it ([`Tallies`]).
pub(crate) struct Shared<G> {
    pub(crate) config: RolloutConfig,
    pub(crate) wiring: Wiring<G>,
    pub(crate) control: Control,
    pub(crate) tallies: Tallies,
}

/// What a rollout runs with, fixed for the run.
pub(crate) struct Wiring<G> {
    pub(crate) generator: G,
    pub(crate) tokenizer: ChatTokenizer,
    pub(crate) options: RenderOptions,
    pub(crate) parser: Box<dyn ToolCallParser>,
    pub(crate) tools: Option<ToolDispatcher>,
    /// Where each rollout opens its episode, when it runs in an environment.
    pub(crate) environment: Option<Arc<dyn Environment>>,
    /// What runs each rollout's conversation, when a loop-owning agent does.
    pub(crate) agent: Option<Arc<dyn Agent>>,
    pub(crate) scorer: Scorer,
    pub(crate) max_model_len: Option<u32>,
    /// The conversation with no message (the tools' system block, for most templates),
    /// rendered once: every group's prompt starts from it and tokenizes only what it adds.
    pub(crate) base: Option<RenderState>,
    /// Bytes of the vocabulary's longest token: a text of `n` bytes is at least
    /// `n / max_token_bytes` tokens.
    pub(crate) max_token_bytes: usize,
    /// The chat template's name, for messages about it.
    pub(crate) template_name: String,
}

/// What starts, pauses and stops work: the tokens, switches and permits the driver, the
/// rollouts and the engine's methods act through.
pub(crate) struct Control {
    pub(crate) cancel: CancellationToken,
    /// Whether admission is paused ([`Engine::pause`](crate::Engine::pause)).
    pub(crate) paused: watch::Sender<bool>,
    /// Cancelled by a pause in [`InFlight::Abort`](crate::InFlight::Abort) (then
    /// replaced): every rollout attempt watches the token current when it started.
    pub(crate) abort: Mutex<CancellationToken>,
    /// The model version; rollouts waiting on staleness subscribe to it.
    pub(crate) versions: watch::Sender<u64>,
    /// Every generation request holds it for reading from before its version is read until
    /// its answer is back; a pause in [`InFlight::Continue`](crate::InFlight::Continue)
    /// holds it for writing until the resume (`held`): no request is on the wire while the
    /// weights change, so each request's tokens are one version's.
    pub(crate) requests: Arc<RwLock<()>>,
    pub(crate) held: Mutex<Option<OwnedRwLockWriteGuard<()>>>,
    /// One pause at a time.
    pub(crate) pausing: tokio::sync::Mutex<()>,
    pub(crate) admission: CancellationToken,
    pub(crate) admission_closed: AtomicBool,
    pub(crate) stop_heartbeat: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) in_flight: Arc<Semaphore>,
    /// Notified each time a rollout gives back its `in_flight` slot, and each time a group
    /// waiting for slots gives up those it was handed meanwhile: what
    /// [`Engine::pause`](crate::Engine::pause) waits on.
    pub(crate) slot_freed: Notify,
    /// Blocking threads that may render an episode's first prompt at once (the machine's
    /// cores): a burst of episodes opening does not start a thread each.
    pub(crate) render_threads: Semaphore,
    /// Why the run stopped, the first reason given.
    pub(crate) error: Mutex<Option<String>>,
}

/// What is counted and kept of the work for the report and the metrics.
#[derive(Default)]
pub(crate) struct Tallies {
    pub(crate) counters: Counters,
    /// Rollouts that failed, by cause.
    pub(crate) failures_by_cause: Failures,
    /// How long generation requests take.
    pub(crate) generation_latency: Latency,
    /// How late the runtime wakes the heartbeat.
    pub(crate) heartbeat: Heartbeat,
    /// Rollouts in flight when [`Engine::cancel`](crate::Engine::cancel) ended them: a drain
    /// they did not finish.
    pub(crate) cancelled_in_flight: AtomicU64,
    /// Why append mode fell back to re-rendering, by reason: each is warned about once.
    pub(crate) fallbacks_warned: Mutex<Vec<&'static str>>,
    /// Groups read and waiting for admission.
    pub(crate) queued: AtomicUsize,
    pub(crate) bad_rows: Mutex<Vec<String>>,
    /// The first failures, for the report (at most 100).
    pub(crate) failures: Mutex<Vec<RolloutFailure>>,
}

impl Control {
    /// Nothing started, paused or stopped yet; `max_inflight` rollouts may run at once.
    pub(crate) fn new(max_inflight: usize) -> Control {
        Control {
            cancel: CancellationToken::new(),
            paused: watch::Sender::new(false),
            abort: Mutex::new(CancellationToken::new()),
            versions: watch::Sender::new(0),
            requests: Arc::new(RwLock::new(())),
            held: Mutex::new(None),
            pausing: tokio::sync::Mutex::new(()),
            admission: CancellationToken::new(),
            admission_closed: AtomicBool::new(false),
            stop_heartbeat: CancellationToken::new(),
            tracker: TaskTracker::new(),
            in_flight: Arc::new(Semaphore::new(max_inflight)),
            slot_freed: Notify::new(),
            render_threads: Semaphore::new(
                std::thread::available_parallelism().map_or(2, std::num::NonZero::get),
            ),
            error: Mutex::new(None),
        }
    }

    /// Records why the run stops (the first reason wins) and stops admission.
    pub(crate) fn stop_run(&self, reason: String) {
        let mut error = lock(&self.error);
        if error.is_none() {
            tracing::error!(%reason, "stopping the run");
            *error = Some(reason);
        }
        self.admission.cancel();
    }

    pub(crate) fn model_version(&self) -> u64 {
        *self.versions.borrow()
    }
}

impl<G> Wiring<G> {
    /// A group's prompt, rendered once for all its rollouts.
    pub(crate) fn render_prompt(&self, row: &DatasetRow) -> Result<RenderState, RenderError> {
        let mut render = match &self.base {
            Some(base) => self.tokenizer.resume(base.clone())?,
            None => self.tokenizer.incremental(self.options.clone())?,
        };
        render.push(&row.prompt);
        render.prompt()?;
        Ok(render.state())
    }

    /// Refuses a row whose prompt could not fit in the context whatever the tokenization:
    /// its text alone needs more tokens than `max_model_len` at the longest token of the
    /// vocabulary. Checked before tokenizing, which for a huge prompt costs gigabytes.
    pub(crate) fn check_prompt_size(&self, row: &DatasetRow) -> Result<(), String> {
        let Some(max_model_len) = self.max_model_len else {
            return Ok(());
        };
        let bytes: usize = row.prompt.iter().map(Message::text_len).sum();
        let fits = (max_model_len as usize).saturating_mul(self.max_token_bytes.max(1));
        if bytes > fits {
            return Err(format!(
                "the prompt is {bytes} bytes of text: at least {} tokens, more than \
                 max_model_len {max_model_len} (no token of this tokenizer is longer than {} \
                 bytes)",
                bytes.div_ceil(self.max_token_bytes.max(1)),
                self.max_token_bytes
            ));
        }
        Ok(())
    }
}

impl<G> Shared<G> {
    /// Rollouts holding an `in_flight` permit now: running, or admitted and about to.
    pub(crate) fn rollouts_in_flight(&self) -> usize {
        self.config
            .max_inflight
            .saturating_sub(self.control.in_flight.available_permits())
    }

    /// Why the run must stop for its failure rate, if it must. `at_end`: judge however few
    /// rollouts ended.
    pub(crate) fn failure_rate_exceeded(&self, at_end: bool) -> Option<String> {
        let max = self.config.max_failure_rate?;
        let stats = self.tallies.counters.snapshot();
        let failed = stats
            .rollouts_failed
            .saturating_sub(stats.rollouts_unavailable);
        let ended = failed + stats.rollouts_completed;
        if ended == 0 || (!at_end && ended < FAILURE_RATE_MIN_ROLLOUTS) {
            return None;
        }
        let rate = failed as f64 / ended as f64;
        if rate <= max {
            return None;
        }
        let last = lock(&self.tallies.failures)
            .iter()
            .rev()
            .find(|f| f.cause != FailureCause::Unavailable)
            .map_or_else(String::new, |f| format!("; one of them: {f}"));
        Some(format!(
            "{failed} of {ended} rollouts failed ({:.0}%, more than max_failure_rate {:.0}%){last}",
            rate * 100.0,
            max * 100.0
        ))
    }

    /// AReaL's rule: whether the `admitted`-th group may start `versions` versions after the
    /// start. Always with no bound set.
    pub(crate) fn fresh_enough(&self, admitted: u64, versions: u64) -> bool {
        match (self.config.max_staleness, self.config.groups_per_version) {
            (Some(staleness), Some(per_version)) => {
                let allowed = versions
                    .saturating_add(staleness)
                    .saturating_add(1)
                    .saturating_mul(per_version);
                admitted < allowed
            }
            _ => true,
        }
    }

    /// Notes a turn whose next prompt append mode could not build (counted by the caller),
    /// warning once per reason.
    pub(crate) fn fell_back(&self, reason: &NoExactDelta) {
        Counters::add(&self.tallies.counters.append_fallbacks, 1);
        let mut warned = lock(&self.tallies.fallbacks_warned);
        if !warned.contains(&reason.kind()) {
            warned.push(reason.kind());
            tracing::warn!(
                template = %self.wiring.template_name,
                reason = %reason,
                "append mode: no exact token delta after an assistant turn; such turns are re-rendered whole (counted in fallback_turns); warned once per reason"
            );
        }
    }
}

impl<G> Shared<G> {
    /// Counts a rollout that ended, keeps its failure for the report, and stops the run
    /// when failures pass `max_failure_rate`.
    pub(crate) fn rollout_ended(&self, outcome: &Result<crate::outcome::Finished, RolloutFailure>) {
        match outcome {
            Ok(_) => Counters::add(&self.tallies.counters.rollouts_completed, 1),
            Err(failure) if failure.cause == FailureCause::Cancelled => {
                Counters::add(&self.tallies.counters.rollouts_cancelled, 1);
            }
            Err(failure) => {
                Counters::add(&self.tallies.counters.rollouts_failed, 1);
                self.tallies.failures_by_cause.add(failure.cause);
                if failure.cause == FailureCause::Unavailable {
                    Counters::add(&self.tallies.counters.rollouts_unavailable, 1);
                }
                tracing::warn!(%failure, "rollout failed");
                {
                    let mut failures = lock(&self.tallies.failures);
                    if failures.len() < 100 {
                        failures.push(failure.clone());
                    }
                }
                if let Some(reason) = self.failure_rate_exceeded(false) {
                    self.control.stop_run(reason);
                }
            }
        }
    }
}
