//! [`Harness`]: sessions as the rollout loop's [`Environment`]: creation with bounded
//! retries, the session's tools on the tool pool, `done`, `verify` and `close`, sync
//! sessions' calls on the pool's threads and async ones awaited.

use std::{
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use backoff::Backoff;
use futures::future::BoxFuture;
use rollout_api::{Environment, Episode, EpisodeRequest, EpisodeStatus, OpenError, Verdict};
use rollout_core::Message;
use serde_json::{Value, json};
use tool_dispatch::{Arguments, Registry, Tool, ToolCall, ToolDispatcher, ToolError, ToolSpec};

use crate::{
    lock,
    session::{
        Session, SessionError, SessionFactory, SyncSession, SyncSessionFactory, Task, ToolOutput,
        Verification,
    },
};

/// How many call timeouts one attempt at creating a session may take, by default: a server's
/// start, then its handshake, its tool list and its reset, each bounded by the call timeout.
/// [`HarnessConfig::for_timeout`] applies it; the `[environment]` table's `timeout` goes
/// through it.
pub const CREATE_TIMEOUT_CALLS: u32 = 4;

/// The highest ceiling of a pause between attempts at creating a session.
pub const MAX_CREATE_BACKOFF: Duration = Duration::from_secs(10);

/// How long a session call may take by default.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How a [`Harness`] treats its sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HarnessConfig {
    /// Attempts at creating a session before the rollout fails with cause `session_create`.
    pub create_attempts: u32,
    /// The ceiling of the pause after the first failed attempt; it doubles after each further
    /// one, up to [`MAX_CREATE_BACKOFF`], and each pause is drawn below it (full jitter), so
    /// that the sessions a failure hit together are not created again together.
    pub create_backoff: Duration,
    /// How long one session call may take: a tool call, verify, close.
    pub timeout: Duration,
    /// How long one attempt at creating a session may take (a server to start, a handshake,
    /// a reset).
    pub create_timeout: Duration,
}

impl Default for HarnessConfig {
    /// Three attempts, 200 ms apart at first, 30 s per call, and per creation
    /// [`CREATE_TIMEOUT_CALLS`] calls' worth: 120 s (see [`HarnessConfig::for_timeout`]).
    fn default() -> Self {
        HarnessConfig::for_timeout(DEFAULT_TIMEOUT)
    }
}

impl HarnessConfig {
    /// The defaults with `timeout` per session call, and [`CREATE_TIMEOUT_CALLS`] times it
    /// per attempt at creating a session.
    pub fn for_timeout(timeout: Duration) -> HarnessConfig {
        HarnessConfig {
            create_attempts: 3,
            create_backoff: Duration::from_millis(200),
            timeout,
            create_timeout: timeout.saturating_mul(CREATE_TIMEOUT_CALLS),
        }
    }

    /// Sets the attempts at creating a session (at least 1).
    #[must_use]
    pub fn create_attempts(mut self, attempts: u32) -> Self {
        self.create_attempts = attempts.max(1);
        self
    }

    /// Sets the ceiling of the first pause between create attempts.
    #[must_use]
    pub fn create_backoff(mut self, backoff: Duration) -> Self {
        self.create_backoff = backoff;
        self
    }

    /// Sets the timeout of each session call (the create timeout stays as it is; for both,
    /// [`HarnessConfig::for_timeout`]).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the timeout of each attempt at creating a session.
    #[must_use]
    pub fn create_timeout(mut self, timeout: Duration) -> Self {
        self.create_timeout = timeout;
        self
    }
}

enum Factory {
    Async(Arc<dyn SessionFactory>),
    Sync(Arc<dyn SyncSessionFactory>),
}

#[derive(Clone)]
enum Handle {
    Async(Arc<dyn Session>),
    Sync(Arc<dyn SyncSession>),
}

/// A session factory made into the loop's [`Environment`]: each rollout attempt gets a
/// session of its own, its tools are the rollout's tools (run through `pool`'s dispatcher:
/// same order, timeouts and error messages as any tool), a tool output with `done` ends the
/// episode, `verify` gives the `env` reward and `close` runs exactly once.
///
/// A sync session's every call (create, tools, verify, close) runs on `pool`'s threads, an
/// async one's is awaited. Each call is bounded by [`HarnessConfig::timeout`]; a sync call
/// past it keeps its thread until it returns (a session created that late is closed there).
pub struct Harness {
    name: Arc<str>,
    factory: Factory,
    pool: ToolDispatcher,
    config: HarnessConfig,
}

impl fmt::Debug for Harness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Harness")
            .field("name", &self.name)
            .field("sync", &matches!(self.factory, Factory::Sync(_)))
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Harness {
    /// An environment of async sessions named `name` (for messages), their tools run
    /// through `pool` (the engine's tool dispatcher: its pool, slots and shutdown).
    pub fn new(
        name: impl Into<String>,
        factory: impl SessionFactory,
        pool: ToolDispatcher,
    ) -> Harness {
        Harness::with_factory(name, Factory::Async(Arc::new(factory)), pool)
    }

    /// An environment of blocking sessions, every call of which runs on `pool`'s threads.
    pub fn new_sync(
        name: impl Into<String>,
        factory: impl SyncSessionFactory,
        pool: ToolDispatcher,
    ) -> Harness {
        Harness::with_factory(name, Factory::Sync(Arc::new(factory)), pool)
    }

    fn with_factory(name: impl Into<String>, factory: Factory, pool: ToolDispatcher) -> Harness {
        Harness {
            name: Arc::from(name.into()),
            factory,
            pool,
            config: HarnessConfig::default(),
        }
    }

    /// Sets how sessions are treated.
    #[must_use]
    pub fn config(mut self, config: HarnessConfig) -> Self {
        self.config = config;
        self
    }

    /// One attempt at a session with its tools and initial messages.
    async fn create(&self, task: &Task) -> Result<Created, String> {
        let timeout = self.config.create_timeout;
        match &self.factory {
            Factory::Async(factory) => {
                let session = tokio::time::timeout(timeout, factory.create(task.clone()))
                    .await
                    .map_err(|_| format!("no session after {timeout:?}"))?
                    .map_err(|e| e.to_string())?;
                let session: Arc<dyn Session> = Arc::from(session);
                Ok(Created {
                    tools: session.tools(),
                    initial: session.initial_messages(),
                    handle: Handle::Async(session),
                })
            }
            Factory::Sync(factory) => {
                let factory = Arc::clone(factory);
                let task = task.clone();
                let created = on_pool(
                    &self.pool,
                    "session_create",
                    timeout,
                    move || {
                        factory.create(&task).map(|session| {
                            let session: Arc<dyn SyncSession> = Arc::from(session);
                            (session.tools(), session.initial_messages(), session)
                        })
                    },
                    // Created after the caller gave up: nobody else will close it.
                    |late| {
                        if let Ok((_, _, session)) = late {
                            session.close();
                        }
                    },
                )
                .await?;
                let (tools, initial, session) = created.map_err(|e| e.to_string())?;
                Ok(Created {
                    tools,
                    initial,
                    handle: Handle::Sync(session),
                })
            }
        }
    }

    /// The episode of a created session; on a bad tool list the session is closed.
    async fn episode(&self, created: Created) -> Result<HarnessEpisode, String> {
        let status = Arc::new(Mutex::new(EpisodeStatus::Running));
        let notes = Arc::new(Mutex::new(Vec::new()));
        let step = Arc::new(Mutex::new(None));
        let mut registry = Registry::new();
        let mut problem = None;
        for spec in created.tools {
            let tool = session_tool(
                spec,
                &created.handle,
                Said {
                    status: Arc::clone(&status),
                    notes: Arc::clone(&notes),
                    step: Arc::clone(&step),
                    environment: Arc::clone(&self.name),
                },
                self.config.timeout,
            );
            if let Err(error) = registry.add(tool) {
                problem = Some(format!("the session's tools: {error}"));
                break;
            }
        }
        let episode = HarnessEpisode {
            name: Arc::clone(&self.name),
            handle: created.handle,
            tools: self.pool.with_tools(registry),
            pool: self.pool.clone(),
            status,
            notes,
            step,
            initial: created.initial,
            timeout: self.config.timeout,
        };
        match problem {
            None => Ok(episode),
            Some(problem) => {
                Box::new(episode).close().await;
                Err(problem)
            }
        }
    }
}

struct Created {
    tools: Vec<ToolSpec>,
    initial: Vec<Message>,
    handle: Handle,
}

impl Environment for Harness {
    fn open(&self, request: EpisodeRequest) -> BoxFuture<'_, Result<Box<dyn Episode>, OpenError>> {
        Box::pin(async move {
            let task = Task {
                row: request.task,
                seed: request.seed,
                episode_id: request.episode_id,
            };
            let attempts = self.config.create_attempts.max(1);
            let backoff = Backoff::new(self.config.create_backoff, MAX_CREATE_BACKOFF);
            let mut last = String::new();
            for attempt in 1..=attempts {
                match self.create(&task).await {
                    Ok(created) => {
                        let episode = self
                            .episode(created)
                            .await
                            .map_err(|e| OpenError(format!("{}: {e}", self.name)))?;
                        return Ok(Box::new(episode) as Box<dyn Episode>);
                    }
                    Err(error) => {
                        tracing::debug!(environment = %self.name, attempt, %error, "session creation failed");
                        last = error;
                    }
                }
                if attempt < attempts {
                    tokio::time::sleep(backoff.delay(attempt - 1)).await;
                }
            }
            Err(OpenError(format!(
                "{}: no session after {attempts} attempt(s): {last}",
                self.name
            )))
        })
    }
}

/// Where a session tool's outputs land beside the model's reading of them.
#[derive(Clone)]
struct Said {
    /// `done` and fatal errors.
    status: Arc<Mutex<EpisodeStatus>>,
    /// `{"name", "metadata"}` per call whose output carried metadata, in call order.
    notes: Arc<Mutex<Vec<Value>>>,
    /// The sum of the step rewards of the calls since the episode last gave it.
    step: Arc<Mutex<Option<f64>>>,
    /// The environment's name, for messages.
    environment: Arc<str>,
}

/// A session tool as a tool-dispatch [`Tool`]: sync sessions' calls on the pool, async ones
/// awaited; what they say beside their content lands in `said`.
fn session_tool(spec: ToolSpec, handle: &Handle, said: Said, timeout: Duration) -> Tool {
    let name = spec.name.clone();
    let tool = match handle {
        Handle::Async(session) => {
            let session = Arc::clone(session);
            Tool::new_async(spec, move |args: Arguments| {
                let session = Arc::clone(&session);
                let said = said.clone();
                let name = name.clone();
                async move {
                    let output = session.call_tool(&name, args.into_inner()).await;
                    said.settle(&name, output)
                }
            })
        }
        Handle::Sync(session) => {
            let session = Arc::clone(session);
            Tool::new_sync(spec, move |args: Arguments| {
                let output = session.call_tool(&name, args.into_inner());
                said.settle(&name, output)
            })
        }
    };
    tool.timeout(timeout)
}

impl Said {
    /// What a session tool's output means for the model and for the episode.
    fn settle(
        &self,
        tool: &str,
        output: Result<ToolOutput, SessionError>,
    ) -> Result<Value, ToolError> {
        match output {
            Ok(output) => {
                if output.done {
                    let mut status = lock(&self.status);
                    if *status == EpisodeStatus::Running {
                        *status = EpisodeStatus::Done;
                    }
                }
                if let Some(reward) = output.reward {
                    let mut step = lock(&self.step);
                    *step = Some(step.unwrap_or(0.0) + reward);
                }
                if !output.metadata.is_empty() {
                    lock(&self.notes).push(json!({"name": tool, "metadata": output.metadata}));
                }
                match output.error {
                    Some(error) => Err(error.into()),
                    None => Ok(output.content),
                }
            }
            Err(error) => {
                if error.is_fatal() {
                    *lock(&self.status) =
                        EpisodeStatus::Failed(format!("{}: {error}", self.environment));
                }
                Err(error.message().to_owned().into())
            }
        }
    }
}

/// One rollout's session.
struct HarnessEpisode {
    name: Arc<str>,
    handle: Handle,
    tools: ToolDispatcher,
    pool: ToolDispatcher,
    status: Arc<Mutex<EpisodeStatus>>,
    /// What its tool calls said beside their content ([`Said::notes`]).
    notes: Arc<Mutex<Vec<Value>>>,
    /// Their step rewards since the loop last took them ([`Said::step`]).
    step: Arc<Mutex<Option<f64>>>,
    initial: Vec<Message>,
    timeout: Duration,
}

impl Episode for HarnessEpisode {
    fn initial_messages(&self) -> Vec<Message> {
        self.initial.clone()
    }

    fn tools(&self) -> &ToolDispatcher {
        &self.tools
    }

    fn status(&self) -> EpisodeStatus {
        lock(&self.status).clone()
    }

    fn take_step_reward(&mut self) -> Option<f64> {
        lock(&self.step).take()
    }

    fn verify(&mut self, transcript: Vec<Message>) -> BoxFuture<'_, Verdict> {
        Box::pin(async move {
            let timeout = self.timeout;
            let verified = match &self.handle {
                Handle::Async(session) => {
                    match tokio::time::timeout(timeout, session.verify(&transcript)).await {
                        Ok(verified) => verified.map_err(|e| e.to_string()),
                        Err(_) => Err(format!("verify took longer than {timeout:?}")),
                    }
                }
                Handle::Sync(session) => {
                    let session = Arc::clone(session);
                    on_pool(
                        &self.pool,
                        "session_verify",
                        timeout,
                        move || session.verify(&transcript),
                        drop,
                    )
                    .await
                    .and_then(|verified| verified.map_err(|e| e.to_string()))
                }
            };
            let mut verdict = verdict(&self.name, verified);
            let notes = std::mem::take(&mut *lock(&self.notes));
            if !notes.is_empty() {
                verdict
                    .details
                    .insert("tools".to_owned(), Value::Array(notes));
            }
            verdict
        })
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let timeout = self.timeout;
            match &self.handle {
                Handle::Async(session) => {
                    if tokio::time::timeout(timeout, session.close())
                        .await
                        .is_err()
                    {
                        tracing::warn!(environment = %self.name, ?timeout, "closing a session took too long; left to its drop");
                    }
                }
                Handle::Sync(session) => {
                    let closing = Arc::clone(session);
                    let closed = on_pool(
                        &self.pool,
                        "session_close",
                        timeout,
                        move || closing.close(),
                        drop,
                    )
                    .await;
                    if let Err(error) = closed {
                        if self.pool.is_closed() {
                            // The pool is shutting down: close on a thread of its own.
                            let session = Arc::clone(session);
                            let spawned = std::thread::Builder::new()
                                .name("harness-close".to_owned())
                                .spawn(move || session.close());
                            if let Err(error) = spawned {
                                tracing::warn!(environment = %self.name, %error, "could not close a session");
                            }
                        } else {
                            tracing::warn!(environment = %self.name, %error, "closing a session failed");
                        }
                    }
                }
            }
        })
    }
}

/// A verification as the loop's [`Verdict`]: a non-finite reward is no reward.
fn verdict(environment: &str, verified: Result<Verification, String>) -> Verdict {
    match verified {
        Ok(verification) => {
            let mut verdict = Verdict {
                done: Some(verification.done),
                metrics: verification.metrics,
                ..Verdict::default()
            };
            if !verification.artifacts.is_empty() {
                verdict.details.insert(
                    "artifacts".to_owned(),
                    Value::Object(verification.artifacts),
                );
            }
            match verification.env_reward {
                Some(reward) if !reward.is_finite() => {
                    verdict.error = Some(format!(
                        "{environment}: verify gave a non-finite reward {reward}"
                    ));
                }
                reward => verdict.reward = reward,
            }
            verdict
        }
        Err(error) => {
            tracing::warn!(environment, %error, "verify failed: the episode is unscorable");
            Verdict {
                error: Some(format!("{environment}: verify failed: {error}")),
                ..Verdict::default()
            }
        }
    }
}

/// Where a blocking call's result meets its caller, who may have stopped waiting.
struct Handoff<T> {
    value: Option<T>,
    gave_up: bool,
}

/// Runs `work` on `pool`'s threads (as a one-off tool of its own, so it is bounded by the
/// pool's slots, `timeout` and shutdown like any tool call, but not counted as one) and
/// returns what it returned. A
/// result that arrives after the caller gave up goes to `late` on that thread.
async fn on_pool<T, W, L>(
    pool: &ToolDispatcher,
    what: &'static str,
    timeout: Duration,
    work: W,
    late: L,
) -> Result<T, String>
where
    T: Send + 'static,
    W: FnOnce() -> T + Send + 'static,
    L: FnOnce(T) + Send + 'static,
{
    let handoff = Arc::new(Mutex::new(Handoff {
        value: None,
        gave_up: false,
    }));
    let job = Mutex::new(Some((work, late)));
    let returned = Arc::clone(&handoff);
    let tool = Tool::new_sync(ToolSpec::new(what, what), move |_: Arguments| {
        let Some((work, late)) = lock(&job).take() else {
            return Err("already ran".into());
        };
        let value = work();
        let mut handoff = lock(&returned);
        if handoff.gave_up {
            drop(handoff);
            late(value);
        } else {
            handoff.value = Some(value);
        }
        Ok(Value::Null)
    })
    .timeout(timeout);
    let registry = Registry::new()
        .with(tool)
        .map_err(|e| format!("{what}: {e}"))?;
    let results = pool
        .with_uncounted_tools(registry)
        .run(vec![ToolCall::new(what, json!({}))])
        .await;
    let mut handoff = lock(&handoff);
    if let Some(value) = handoff.value.take() {
        return Ok(value);
    }
    handoff.gave_up = true;
    drop(handoff);
    match results {
        Ok(results) => Err(results
            .first()
            .map(|result| error_text(&result.content))
            .unwrap_or_else(|| format!("{what}: no result"))),
        Err(error) => Err(format!("{what}: {error}")),
    }
}

/// The message inside a tool error's `{"error": ...}` content.
fn error_text(content: &str) -> String {
    serde_json::from_str::<Value>(content)
        .ok()
        .and_then(|value| value.get("error")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| content.to_owned())
}
