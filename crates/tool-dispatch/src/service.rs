//! [`ToolDispatcher`]: the tower `Service` that runs one assistant turn's tool calls.

use std::{
    fmt,
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use tokio::sync::OnceCell;
use tokio_util::{
    sync::{CancellationToken, PollSemaphore},
    task::TaskTracker,
};
use tower::Service;

use crate::{
    call::{Dispatch, Family},
    error::DispatchError,
    future::ResponseFuture,
    metrics::{Gauges, MetricsSnapshot, PoolSnapshot, ToolMetrics, ToolSnapshot},
    pool::{Pool, PoolConfig, PoolReport},
    registry::Registry,
    sync::{Arc, Ordering, OwnedSemaphorePermit, Semaphore, lock, oneshot},
    tool::{Tool, ToolCall, ToolResult},
};

/// How a [`ToolDispatcher`] is sized.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    max_threads: usize,
    queue_capacity: usize,
    default_timeout: Duration,
    thread_name: String,
}

impl DispatcherConfig {
    /// A pool of at most `max_threads` threads for sync tools; an engine passes its maximum
    /// number of rollouts in flight. The queue holds as many calls again, and calls time out
    /// after five minutes unless a tool sets its own timeout.
    ///
    /// # Panics
    /// If `max_threads` is zero.
    pub fn new(max_threads: usize) -> DispatcherConfig {
        assert!(
            max_threads > 0,
            "DispatcherConfig::new: max_threads must be at least 1"
        );
        DispatcherConfig {
            max_threads,
            queue_capacity: max_threads,
            default_timeout: Duration::from_secs(300),
            thread_name: "tool-dispatch".to_owned(),
        }
    }

    /// How many sync calls may wait for a thread while every thread is busy.
    pub fn queue_capacity(mut self, capacity: usize) -> DispatcherConfig {
        self.queue_capacity = capacity;
        self
    }

    /// The timeout of a call whose tool sets none.
    pub fn default_timeout(mut self, timeout: Duration) -> DispatcherConfig {
        self.default_timeout = timeout;
        self
    }

    /// The prefix of the pool threads' names (`tool-dispatch-0`, ...).
    pub fn thread_name(mut self, name: impl Into<String>) -> DispatcherConfig {
        self.thread_name = name.into();
        self
    }

    /// The most threads the pool runs.
    pub fn max_threads(&self) -> usize {
        self.max_threads
    }

    /// How many turns the dispatcher admits at once: one pool slot per turn in flight.
    pub fn max_turns_in_flight(&self) -> usize {
        self.max_threads + self.queue_capacity
    }
}

/// What [`ToolDispatcher::shutdown`] did.
///
/// Each call of the turns in flight that resolves during the shutdown is counted once, by
/// what its [`ToolResult`] says: `completed` ones with an outcome of their own, `cancelled`
/// and `still_running` ones as [`Outcome::Cancelled`](crate::Outcome::Cancelled).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Dispatch that were running when shutdown began and finished before the deadline, with any
    /// outcome but cancelled.
    pub completed: u64,
    /// Dispatch cancelled before they ran: queued for a thread, or not yet started in a turn in
    /// flight (also those after a call that was still running at the deadline).
    pub cancelled: u64,
    /// Dispatch still running at the deadline, resolved as cancelled there. A sync tool's thread
    /// cannot be killed and finishes on its own.
    pub still_running: usize,
    /// Pool threads joined.
    pub threads_joined: usize,
    /// Pool threads still running a tool at the deadline, left to exit when it returns.
    pub threads_detached: usize,
    /// How long the shutdown took.
    pub elapsed: Duration,
}

impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tool dispatcher shut down in {:?}: {} call(s) completed, {} cancelled, {} still running at the \
             deadline; {} thread(s) joined, {} detached",
            self.elapsed,
            self.completed,
            self.cancelled,
            self.still_running,
            self.threads_joined,
            self.threads_detached
        )
    }
}

/// Runs the tool calls of one assistant turn: `Service<Vec<ToolCall>>` answering with one
/// [`ToolResult`] per call, in the same order.
///
/// - Sync tools run on the dispatcher's own pool of at most `max_threads` threads, never on
///   the runtime's workers and never on tokio's shared blocking pool. Async tools are awaited
///   on the runtime.
/// - A turn's calls run one after another, in the model's order; different turns run
///   concurrently.
/// - `poll_ready` reserves one of `max_threads + queue_capacity` slots: that is the
///   backpressure. A turn holds its slot for its whole life (async calls included), and a sync
///   call carries it into the pool, so the pool never holds more jobs than slots. The slot
///   lives in the response future; dropping the future releases it, except that a sync call
///   in progress keeps it until its job leaves the pool (skipped if still queued, or when the
///   tool returns).
/// - Every outcome is a [`ToolResult`] the model can read; a turn never fails because of a
///   tool. The service's error means only that the dispatcher is shutting down.
///
/// Clones share the pool, the tools and the metrics. Requires a tokio runtime with the time
/// driver enabled. Call [`ToolDispatcher::shutdown`] to drain; dropping the last clone
/// without it cancels queued calls and lets each pool thread exit after its current call,
/// without waiting.
pub struct ToolDispatcher {
    dispatch: Arc<Dispatch>,
    shared: Arc<Shared>,
    slots: PollSemaphore,
    permit: Option<OwnedSemaphorePermit>,
}

/// State shared by clones but not needed by running turns.
struct Shared {
    tracker: TaskTracker,
    report: OnceCell<ShutdownReport>,
}

impl ToolDispatcher {
    /// A dispatcher for `registry`'s tools, sized by `config`. No thread starts until the
    /// first sync call.
    pub fn new(registry: Registry, config: DispatcherConfig) -> ToolDispatcher {
        let pool = Pool::new(PoolConfig {
            max_threads: config.max_threads,
            thread_name: config.thread_name,
        });
        let slots = Arc::new(Semaphore::new(config.max_threads + config.queue_capacity));
        let metrics = registry
            .tools()
            .iter()
            .map(|_| Arc::new(ToolMetrics::new()))
            .collect();
        let dispatch = Dispatch {
            registry,
            metrics,
            family: Arc::default(),
            gauges: Arc::new(Gauges::default()),
            pool: Arc::new(pool),
            slots: Arc::clone(&slots),
            closing: CancellationToken::new(),
            abort: CancellationToken::new(),
            default_timeout: config.default_timeout,
        };
        ToolDispatcher {
            dispatch: Arc::new(dispatch),
            shared: Arc::new(Shared {
                tracker: TaskTracker::new(),
                report: OnceCell::new(),
            }),
            slots: PollSemaphore::new(slots),
            permit: None,
        }
    }

    /// A dispatcher for other tools on this one's pool: it shares the threads, the slots
    /// (backpressure), the default timeout and the shutdown (this one's shutdown cancels and
    /// waits for its turns too). For tools that exist per rollout, such as an environment
    /// session's: their calls are counted in this dispatcher's [`metrics`](Self::metrics),
    /// as its own tools' are, one entry per name however many dispatchers share it (a name
    /// this one's registry has adds to that tool's counts).
    pub fn with_tools(&self, registry: Registry) -> ToolDispatcher {
        let metrics = {
            let mut family = lock(&self.dispatch.family);
            registry
                .names()
                .map(|name| self.counted(&mut family, name))
                .collect()
        };
        self.with_metrics(registry, metrics)
    }

    /// The dispatcher of one rollout, when a tool has an instance per rollout
    /// ([`Tool::per_rollout`](crate::Tool::per_rollout)): the same tools, each per-rollout
    /// one with an instance of its own, dropped with this dispatcher (hold it for the
    /// rollout's life and drop it when the rollout ends in any way). On this one's pool,
    /// counted in this one's metrics. `None` when no tool is per rollout: use this one.
    pub fn for_rollout(&self) -> Option<ToolDispatcher> {
        let registry = self.dispatch.registry.for_rollout()?;
        Some(self.with_metrics(registry, self.dispatch.metrics.clone()))
    }

    /// Like [`with_tools`](Self::with_tools), but its tools' calls are counted apart, in
    /// this new dispatcher's metrics only: for one-off work on the pool that is not a tool
    /// anyone called (a session's creation, say).
    pub fn with_uncounted_tools(&self, registry: Registry) -> ToolDispatcher {
        let metrics = registry
            .tools()
            .iter()
            .map(|_| Arc::new(ToolMetrics::new()))
            .collect();
        self.with_metrics(registry, metrics)
    }

    /// The metrics `name` is counted in: this dispatcher's own tool of that name, or the
    /// family's entry for it (created on first use).
    fn counted(&self, family: &mut Family, name: &str) -> Arc<ToolMetrics> {
        let dispatch = &self.dispatch;
        if let Some(index) = dispatch.registry.names().position(|own| own == name) {
            return Arc::clone(&dispatch.metrics[index]);
        }
        if let Some((_, metrics)) = family.iter().find(|(known, _)| known == name) {
            return Arc::clone(metrics);
        }
        let metrics = Arc::new(ToolMetrics::new());
        family.push((name.to_owned(), Arc::clone(&metrics)));
        metrics
    }

    fn with_metrics(&self, registry: Registry, metrics: Vec<Arc<ToolMetrics>>) -> ToolDispatcher {
        let dispatch = Dispatch {
            registry,
            metrics,
            // Its own tools are counted here already; what is made from it, in it.
            family: Arc::default(),
            gauges: Arc::clone(&self.dispatch.gauges),
            pool: Arc::clone(&self.dispatch.pool),
            slots: Arc::clone(&self.dispatch.slots),
            closing: self.dispatch.closing.clone(),
            abort: self.dispatch.abort.clone(),
            default_timeout: self.dispatch.default_timeout,
        };
        ToolDispatcher {
            dispatch: Arc::new(dispatch),
            shared: Arc::clone(&self.shared),
            slots: self.slots.clone(),
            permit: None,
        }
    }

    /// The tools this dispatcher runs.
    pub fn registry(&self) -> &Registry {
        &self.dispatch.registry
    }

    /// Runs one turn: waits for a slot, then runs the calls. A shorthand for
    /// `ServiceExt::oneshot` on a clone.
    pub async fn run(&self, calls: Vec<ToolCall>) -> Result<Vec<ToolResult>, DispatchError> {
        let mut service = self.clone();
        std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
        service.call(calls).await
    }

    /// Whether shutdown has begun.
    pub fn is_closed(&self) -> bool {
        self.dispatch.closing.is_cancelled()
    }

    /// The metrics so far: this dispatcher's tools, then those of the dispatchers made from
    /// it by [`with_tools`](Self::with_tools) (by name, in the order they first appeared).
    pub fn metrics(&self) -> MetricsSnapshot {
        let dispatch = &self.dispatch;
        let pool = dispatch.pool.state();
        MetricsSnapshot {
            tools: dispatch
                .registry
                .tools()
                .iter()
                .zip(&dispatch.metrics)
                .map(|(tool, metrics)| ToolSnapshot {
                    sessions_lost: tool.sessions_lost(),
                    ..metrics.snapshot(&tool.spec().name)
                })
                .chain(
                    lock(&dispatch.family)
                        .iter()
                        .map(|(name, metrics)| metrics.snapshot(name)),
                )
                .collect(),
            unknown_tool: dispatch.gauges.unknown_tool.load(Ordering::Relaxed),
            running_calls: dispatch.gauges.running_calls.load(Ordering::Relaxed),
            pool: PoolSnapshot {
                max_threads: dispatch.pool.max_threads(),
                threads: pool.threads,
                busy: pool.running,
                queued: pool.queued,
                stuck: dispatch.gauges.stuck_threads.load(Ordering::Relaxed),
                completed: pool.completed,
            },
        }
    }

    /// Drains the dispatcher: stops admitting turns, cancels every call that has not started
    /// (queued for a thread, or later in a turn in flight), awaits the running calls until
    /// `timeout`, then abandons the rest and joins every pool thread that is free by then.
    /// Concurrent and repeated calls all get the first shutdown's report.
    ///
    /// After the deadline it waits for the turns to resolve the calls it abandoned, so that
    /// the report counts what they resolved to; they do so at once, unless a turn's future is
    /// not being polled, which it waits for 100 ms at most.
    pub async fn shutdown(&self, timeout: Duration) -> ShutdownReport {
        let dispatch = Arc::clone(&self.dispatch);
        let shared = Arc::clone(&self.shared);
        *self
            .shared
            .report
            .get_or_init(|| drain(dispatch, shared, timeout))
            .await
    }
}

/// How long a shutdown waits past its deadline for the turns to resolve the calls it
/// abandoned. They resolve as soon as they are polled; this bounds only a turn whose future
/// nobody polls, whose calls the report then counts as far as they got.
const ABORT_GRACE: Duration = Duration::from_millis(100);

/// The dispatcher's call counters at one moment.
#[derive(Clone, Copy)]
struct Counts {
    finished: u64,
    cancelled: u64,
    aborted: u64,
}

impl Counts {
    fn read(gauges: &Gauges) -> Counts {
        Counts {
            finished: gauges.finished.load(Ordering::Relaxed),
            cancelled: gauges.cancelled.load(Ordering::Relaxed),
            aborted: gauges.aborted.load(Ordering::Relaxed),
        }
    }
}

async fn drain(dispatch: Arc<Dispatch>, shared: Arc<Shared>, timeout: Duration) -> ShutdownReport {
    let started = Instant::now();
    let deadline = crate::call::far(tokio::time::Instant::now(), timeout);
    let gauges = &dispatch.gauges;
    let before = Counts::read(gauges);

    dispatch.slots.close();
    dispatch.closing.cancel();
    shared.tracker.close();
    dispatch.pool.close();

    let drained = tokio::time::timeout_at(deadline, shared.tracker.wait())
        .await
        .is_ok();
    // Dispatch still running are abandoned: each resolves as cancelled at once, and so does
    // every call after it in its turn (`closing`). Counting before they do would miss them.
    dispatch.abort.cancel();
    let resolved = drained
        || tokio::time::timeout(ABORT_GRACE, shared.tracker.wait())
            .await
            .is_ok();
    let after = Counts::read(gauges);
    // Dispatch of turns nobody polls are still running, as far as anyone can tell.
    let unresolved = if resolved {
        0
    } else {
        gauges.running_calls.load(Ordering::Relaxed)
    };

    // What per-rollout tools release in the background (remote kernels being deleted).
    let settled =
        futures::future::join_all(dispatch.registry.tools().iter().filter_map(Tool::settle));
    if tokio::time::timeout_at(deadline, settled).await.is_err() {
        tracing::warn!(
            target: "tool_dispatch",
            "per-rollout tools were still releasing what their rollouts held at the deadline"
        );
    }
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    let pool = join_pool(Arc::clone(&dispatch.pool), remaining).await;
    let report = ShutdownReport {
        completed: after.finished - before.finished,
        cancelled: after.cancelled - before.cancelled,
        still_running: (after.aborted - before.aborted) as usize + unresolved,
        threads_joined: pool.threads_joined,
        threads_detached: pool.threads_detached,
        elapsed: started.elapsed(),
    };
    tracing::info!(target: "tool_dispatch", "{report}");
    report
}

/// Joins the pool's threads for at most `timeout` on a thread of its own, so that the runtime
/// never blocks on them.
async fn join_pool(pool: Arc<Pool>, timeout: Duration) -> PoolReport {
    let (done, joined) = oneshot::channel();
    let threads = pool.state().threads;
    let spawned = std::thread::Builder::new()
        .name("tool-dispatch-shutdown".to_owned())
        .spawn(move || {
            let _ = done.send(pool.shutdown(Some(timeout)));
        });
    match spawned {
        Ok(_) => joined.await.unwrap_or_default(),
        Err(error) => {
            tracing::warn!(%error, "could not start a thread to join the tool pool; leaving its threads to exit");
            PoolReport {
                threads_detached: threads,
                ..PoolReport::default()
            }
        }
    }
}

impl Clone for ToolDispatcher {
    /// A clone shares everything but a slot reserved by `poll_ready`, which stays with `self`.
    fn clone(&self) -> ToolDispatcher {
        ToolDispatcher {
            dispatch: Arc::clone(&self.dispatch),
            shared: Arc::clone(&self.shared),
            slots: self.slots.clone(),
            permit: None,
        }
    }
}

impl fmt::Debug for ToolDispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolDispatcher")
            .field("tools", &self.dispatch.registry.names().collect::<Vec<_>>())
            .field("pool", &self.dispatch.pool)
            .field("closed", &self.is_closed())
            .field("reserved", &self.permit.is_some())
            .finish()
    }
}

impl Service<Vec<ToolCall>> for ToolDispatcher {
    type Response = Vec<ToolResult>;
    type Error = DispatchError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), DispatchError>> {
        if self.dispatch.closing.is_cancelled() {
            self.permit = None;
            return Poll::Ready(Err(DispatchError::closed()));
        }
        if self.permit.is_none() {
            match ready!(self.slots.poll_acquire(cx)) {
                Some(permit) => self.permit = Some(permit),
                None => return Poll::Ready(Err(DispatchError::closed())),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, calls: Vec<ToolCall>) -> ResponseFuture {
        let permit = self.permit.take().expect("poll_ready must be called first");
        let dispatch = Arc::clone(&self.dispatch);
        // Taken now, not when first polled, so that shutdown waits for this turn.
        let tracked = self.shared.tracker.token();
        ResponseFuture::new(async move {
            let results = dispatch.run_turn(calls, permit).await;
            drop(tracked);
            Ok(results)
        })
    }
}
