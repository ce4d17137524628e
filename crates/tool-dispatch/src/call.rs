//! One call's journey: lookup, argument check, the sync job on the pool or the awaited async
//! future, the timeout, and the result the model reads.

use std::{
    any::Any,
    panic::AssertUnwindSafe,
    time::{Duration, Instant},
};

use futures::FutureExt;
use process::panic_message;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::{
    call_state::{Abandoned, CallJob, Reply, Run, Waiting, handshake},
    metrics::{Gauges, ToolMetrics},
    pool::{Job, Pool, Rejected},
    registry::{Registry, validate_arguments},
    sync::{Arc, Mutex, Ordering, OwnedSemaphorePermit, Semaphore},
    tool::{
        Arguments, AsyncTool, Outcome, Runner, SyncTool, ToolCall, ToolError, ToolResult,
        Unavailable, error_content, value_content,
    },
};

/// Everything a turn needs to run its calls; shared by the service, its clones and every
/// response future.
pub(crate) struct Dispatch {
    pub(crate) registry: Registry,
    /// One per tool of `registry`, in its order; shared by name with the dispatcher this one
    /// was made from ([`ToolDispatcher::with_tools`](crate::ToolDispatcher::with_tools)).
    pub(crate) metrics: Vec<Arc<ToolMetrics>>,
    /// The tools counted in this dispatcher's metrics beyond its own registry: those of the
    /// dispatchers made from it, by name, in the order they first appeared.
    pub(crate) family: Arc<Mutex<Family>>,
    pub(crate) gauges: Arc<Gauges>,
    pub(crate) pool: Arc<Pool>,
    /// One permit per job the pool can hold; a turn holds one while it runs.
    pub(crate) slots: Arc<Semaphore>,
    /// Cancelled when shutdown begins: calls not yet started are cancelled.
    pub(crate) closing: CancellationToken,
    /// Cancelled when the shutdown deadline passes: running calls are abandoned.
    pub(crate) abort: CancellationToken,
    pub(crate) default_timeout: Duration,
}

/// Tools counted by name beyond a dispatcher's own registry ([`Dispatch::family`]).
pub(crate) type Family = Vec<(String, Arc<ToolMetrics>)>;

/// How a call ended, before it becomes a [`ToolResult`].
struct Ended {
    outcome: Outcome,
    content: String,
    queue_wait: Option<Duration>,
    /// Cancelled while running, by the shutdown deadline (counted apart in the report).
    aborted: bool,
}

impl Ended {
    fn new(outcome: Outcome, content: String) -> Ended {
        Ended {
            outcome,
            content,
            queue_wait: None,
            aborted: false,
        }
    }

    fn error(outcome: Outcome, message: &str) -> Ended {
        Ended::new(outcome, error_content(message))
    }

    /// Cancelled while running because the shutdown deadline passed.
    fn aborted(message: &str) -> Ended {
        Ended {
            aborted: true,
            ..Ended::error(Outcome::Cancelled, message)
        }
    }
}

impl Dispatch {
    /// Runs a turn's calls one after another, in the model's order.
    pub(crate) async fn run_turn(
        &self,
        calls: Vec<ToolCall>,
        permit: OwnedSemaphorePermit,
    ) -> Vec<ToolResult> {
        let mut slot = Some(permit);
        let mut results = Vec::with_capacity(calls.len());
        for call in calls {
            let started = Instant::now();
            let index = self.registry.index_of(&call.name);
            let ended = if self.closing.is_cancelled() {
                Ended::error(Outcome::Cancelled, &Rejected::ShuttingDown.to_string())
            } else {
                self.run_call(&call, index, &mut slot).await
            };
            results.push(self.finish(call, index, ended, started));
        }
        results
    }

    async fn run_call(
        &self,
        call: &ToolCall,
        index: Option<usize>,
        slot: &mut Option<OwnedSemaphorePermit>,
    ) -> Ended {
        let Some(index) = index else {
            self.gauges.unknown_tool.fetch_add(1, Ordering::Relaxed);
            let known: Vec<&str> = self.registry.names().collect();
            let message = if known.is_empty() {
                format!("unknown tool '{}': no tools are available", call.name)
            } else {
                format!(
                    "unknown tool '{}'; available tools: {}",
                    call.name,
                    known.join(", ")
                )
            };
            return Ended::error(Outcome::UnknownTool, &message);
        };
        let tool = &self.registry.tools()[index];
        let args = match validate_arguments(&tool.spec, &call.arguments) {
            Ok(args) => args,
            Err(reason) => {
                let message = format!("invalid arguments for tool '{}': {reason}", call.name);
                return Ended::error(Outcome::InvalidArguments, &message);
            }
        };
        let timeout = tool.timeout.unwrap_or(self.default_timeout);
        let _running = Running::start(&self.gauges);
        match &tool.runner {
            Runner::Sync(tool) => self.run_sync(tool, args, &call.name, timeout, slot).await,
            Runner::Async(tool) => {
                self.run_async(tool.as_ref(), args, &call.name, timeout)
                    .await
            }
            // Not a rollout's own dispatcher: an instance for this call alone.
            Runner::PerRollout(tool) => {
                let instance = tool.open();
                self.run_async(instance.as_ref(), args, &call.name, timeout)
                    .await
            }
        }
    }

    async fn run_async(
        &self,
        tool: &dyn AsyncTool,
        args: Arguments,
        name: &str,
        timeout: Duration,
    ) -> Ended {
        let future = match std::panic::catch_unwind(AssertUnwindSafe(|| tool.call(args))) {
            Ok(future) => AssertUnwindSafe(future).catch_unwind(),
            Err(panic) => return panicked(name, panic.as_ref()),
        };
        tokio::select! {
            biased;
            done = tokio::time::timeout(timeout, future) => match done {
                Ok(Ok(result)) => returned(name, result),
                Ok(Err(panic)) => panicked(name, panic.as_ref()),
                Err(_) => Ended::error(
                    Outcome::TimedOut,
                    &format!("tool '{name}' timed out after {}", human(timeout)),
                ),
            },
            () = self.abort.cancelled() => Ended::aborted(
                "cancelled: the tool dispatcher shut down while the tool was running",
            ),
        }
    }

    async fn run_sync(
        &self,
        tool: &Arc<dyn SyncTool>,
        args: Arguments,
        name: &str,
        timeout: Duration,
        slot: &mut Option<OwnedSemaphorePermit>,
    ) -> Ended {
        let deadline = far(tokio::time::Instant::now(), timeout);
        let permit = match self.slot_for(slot.take(), deadline, name, timeout).await {
            Ok(permit) => permit,
            Err(ended) => return ended,
        };
        let (call, state, mut replied) = handshake(permit);
        let job = SyncJob {
            tool: Arc::clone(tool),
            args,
            call,
            enqueued: Instant::now(),
            gauges: Arc::clone(&self.gauges),
        };
        // On rejection the job has already replied `Cancelled` with the reason.
        let _ = self.pool.submit(Box::new(job));
        // Dropped with this future while still armed, it abandons the call.
        let mut waiting = Waiting::new(state, &self.gauges.stuck_threads);

        let reply = tokio::select! {
            biased;
            reply = &mut replied => reply,
            () = self.abort.cancelled() => match waiting.abandon() {
                Abandoned::AlreadyDone => replied.await,
                // Shutdown cancels queued jobs as it begins; one still queued never ran.
                Abandoned::Queued => {
                    return Ended::error(Outcome::Cancelled, &Rejected::ShuttingDown.to_string());
                }
                Abandoned::Running => return Ended::aborted(
                    "cancelled: the tool dispatcher shut down while the tool was running \
                     (its thread finishes on its own)",
                ),
            },
            () = tokio::time::sleep_until(deadline) => match waiting.abandon() {
                Abandoned::AlreadyDone => replied.await,
                Abandoned::Queued => return Ended::error(
                    Outcome::TimedOut,
                    &format!("tool '{name}' timed out after {} waiting for a pool thread", human(timeout)),
                ),
                Abandoned::Running => return Ended::error(
                    Outcome::TimedOut,
                    &format!("tool '{name}' timed out after {}", human(timeout)),
                ),
            },
        };
        waiting.disarm();
        finished(reply.ok(), slot, name)
    }

    /// The turn's slot for a sync call: the one it holds, or, when an earlier call of this
    /// turn timed out and its thread still holds the slot, another (so the pool never holds
    /// more jobs than it has room for), waited for until the call's deadline.
    async fn slot_for(
        &self,
        held: Option<OwnedSemaphorePermit>,
        deadline: tokio::time::Instant,
        name: &str,
        timeout: Duration,
    ) -> Result<OwnedSemaphorePermit, Ended> {
        if let Some(permit) = held {
            return Ok(permit);
        }
        tokio::select! {
            biased;
            () = self.closing.cancelled() => {
                Err(Ended::error(Outcome::Cancelled, &Rejected::ShuttingDown.to_string()))
            }
            acquired = tokio::time::timeout_at(deadline, Arc::clone(&self.slots).acquire_owned()) => {
                match acquired {
                    Ok(Ok(permit)) => Ok(permit),
                    Ok(Err(_closed)) => {
                        Err(Ended::error(Outcome::Cancelled, &Rejected::ShuttingDown.to_string()))
                    }
                    Err(_elapsed) => Err(Ended::error(
                        Outcome::TimedOut,
                        &format!(
                            "tool '{name}' timed out after {} waiting for a pool thread",
                            human(timeout)
                        ),
                    )),
                }
            }
        }
    }

    fn finish(
        &self,
        call: ToolCall,
        index: Option<usize>,
        ended: Ended,
        started: Instant,
    ) -> ToolResult {
        let latency = started.elapsed();
        if let Some(index) = index {
            self.metrics[index].record(ended.outcome, latency, ended.queue_wait);
        }
        let counter = if ended.aborted {
            &self.gauges.aborted
        } else if ended.outcome == Outcome::Cancelled {
            &self.gauges.cancelled
        } else {
            &self.gauges.finished
        };
        counter.fetch_add(1, Ordering::Relaxed);

        let queue_wait = ended.queue_wait.unwrap_or_default();
        let latency_us = latency.as_micros() as u64;
        match ended.outcome {
            Outcome::Panicked | Outcome::TimedOut => tracing::warn!(
                target: "tool_dispatch",
                tool = %call.name, outcome = %ended.outcome, latency_us, content = %ended.content,
                "tool call failed"
            ),
            _ => tracing::debug!(
                target: "tool_dispatch",
                tool = %call.name, outcome = %ended.outcome, latency_us,
                queue_wait_us = queue_wait.as_micros() as u64,
                "tool call finished"
            ),
        }
        ToolResult {
            call_id: call.id,
            name: call.name,
            content: ended.content,
            outcome: ended.outcome,
            latency,
            queue_wait,
        }
    }
}

/// What a sync call's reply from its pool job says, the turn's slot handed back.
fn finished(
    reply: Option<Reply<Finished>>,
    slot: &mut Option<OwnedSemaphorePermit>,
    name: &str,
) -> Ended {
    match reply {
        Some(Reply::Finished {
            outcome: Finished { result, queue_wait },
            slot: permit,
        }) => {
            *slot = Some(permit);
            let mut ended = match result {
                Ok(result) => returned(name, result),
                Err(panic) => Ended::error(
                    Outcome::Panicked,
                    &format!("tool '{name}' panicked: {panic}"),
                ),
            };
            ended.queue_wait = Some(queue_wait);
            ended
        }
        Some(Reply::Cancelled {
            reason,
            slot: permit,
        }) => {
            *slot = Some(permit);
            match reason {
                Rejected::ShuttingDown => Ended::error(Outcome::Cancelled, &reason.to_string()),
                // The dispatcher is open; the operating system refused a thread.
                Rejected::NoThread => Ended::error(
                    Outcome::Failed,
                    &format!("tool '{name}' could not run: {reason}"),
                ),
            }
        }
        // Unreachable by the pool's contract (every job is run or cancelled, loom-checked);
        // still a message, never a panic.
        None => Ended::error(
            Outcome::Failed,
            "internal error: the tool pool dropped the call",
        ),
    }
}

fn returned(name: &str, result: Result<Value, ToolError>) -> Ended {
    match result {
        Ok(value) => Ended::new(Outcome::Ok, value_content(value)),
        Err(error) if error.is::<Unavailable>() => Ended::error(
            Outcome::Unavailable,
            &format!("tool '{name}' is unavailable: {error}"),
        ),
        Err(error) => Ended::error(Outcome::Failed, &format!("tool '{name}' failed: {error}")),
    }
}

fn panicked(name: &str, panic: &(dyn Any + Send)) -> Ended {
    Ended::error(
        Outcome::Panicked,
        &format!("tool '{name}' panicked: {}", panic_message(panic)),
    )
}

/// `now + duration`, or a year from now when that overflows (`Duration::MAX` = no limit).
pub(crate) fn far(now: tokio::time::Instant, duration: Duration) -> tokio::time::Instant {
    now.checked_add(duration)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// A duration as people write it: `200ms`, `1.5s`.
pub(crate) fn human(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", (d.as_millis() as f64 / 1000.0))
    }
}

/// Counts a call in `running_calls` while it runs.
struct Running<'a>(&'a Gauges);

impl<'a> Running<'a> {
    fn start(gauges: &'a Gauges) -> Running<'a> {
        gauges.running_calls.fetch_add(1, Ordering::Relaxed);
        Running(gauges)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running_calls.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a sync tool's pool job sends back, besides the slot.
struct Finished {
    /// The tool's result, or the message of its panic.
    result: Result<Result<Value, ToolError>, String>,
    queue_wait: Duration,
}

/// A sync tool call on its way through the pool. Its [`CallJob`] owns the turn's slot until it
/// replies: a call whose waiter gave up keeps the slot until its thread is free again.
struct SyncJob {
    tool: Arc<dyn SyncTool>,
    args: Arguments,
    call: CallJob<Finished>,
    enqueued: Instant,
    gauges: Arc<Gauges>,
}

impl Job for SyncJob {
    fn run(self: Box<Self>) {
        let SyncJob {
            tool,
            args,
            call,
            enqueued,
            gauges,
        } = *self;
        let mut began = None;
        let ran = call.run(&gauges.stuck_threads, || {
            began = Some(Instant::now());
            let queue_wait = enqueued.elapsed();
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| tool.call(args)))
                .map_err(|panic| panic_message(panic.as_ref()));
            Finished { result, queue_wait }
        });
        if let (Run::Unawaited, Some(began)) = (ran, began) {
            tracing::info!(
                target: "tool_dispatch",
                ran_for_ms = began.elapsed().as_millis() as u64,
                "a sync tool returned after its caller stopped waiting; its thread is free again"
            );
        }
    }

    fn cancel(self: Box<Self>, reason: Rejected) {
        self.call.cancel(reason);
    }
}
