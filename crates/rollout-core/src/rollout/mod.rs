//! The rollout loop: dataset rows in, scored groups of training samples out.
//!
//! [`Engine`] admits one group per dataset row (`num_generations` rollouts sharing a group
//! id), runs at most `max_inflight` rollouts at once, and drives each through the multi-turn
//! loop: build the prompt (in [`PromptMode::Append`], the previous prompt + the sampled ids +
//! the template's ids for what follows; in [`PromptMode::Rerender`], the conversation rendered
//! incrementally), sample a turn with the [`Generator`], parse tool calls, run them in order
//! through the [`ToolDispatcher`], append the results, and again, until the model answers without a call, `max_turns`, the token budget, the context
//! or the rollout's deadline. Each sampled turn goes to the reconciler as it arrives. When a
//! group's last rollout ends the group is scored, its advantages computed, and its samples
//! sent to the output, a bounded channel.
//!
//! - **Backpressure**: a group reserves its output slot before it is admitted. A consumer
//!   that falls behind stops admission; nothing is dropped and in-flight work is unaffected.
//! - **Failure isolation**: a rollout that fails (generation, rendering, deadline) is retried
//!   up to `retries` times, then recorded with its cause; its group is scored on the rest
//!   when at least `min_group_size` remain, else dropped and counted.
//! - **Model versions and staleness**: each turn records the version set by
//!   [`Engine::set_model_version`] when its request was sent; with `max_staleness`, a group
//!   whose first turn falls more than that many versions behind is cancelled at once (a
//!   trainer would drop its samples), so work is not generated only to be thrown away. A
//!   sample carries its group's first version and, in its metrics,
//!   the span of its own turns.
//!   With `groups_per_version` too, admission holds a group the trainer could not take
//!   within the bound (AReaL's rule; see [`RolloutConfig::groups_per_version`]).
//! - **Pause**: [`Engine::pause`] holds admission until [`Engine::resume`], letting the
//!   rollouts in flight finish ([`PauseMode::Wait`]) or cancelling them
//!   ([`PauseMode::Abort`]).
//! - **Health and metrics**: a heartbeat task, independent of rollouts, tools and rewards,
//!   measures how late the runtime wakes it ([`Engine::health`]); [`Engine::metrics`] is
//!   everything counted, the one source of every report ([`Metrics`]).
//! - **Drain**: [`Engine::shutdown`] stops admission, lets in-flight rollouts finish until a
//!   deadline, cancels the rest (dropping their requests aborts them on the server), scores
//!   every complete group, closes the output and the tool pool, and reports.

mod agent;
mod conversation;
mod episode;
mod generator;
mod group;
mod health;
mod metrics;
mod outcome;

use std::{
    fmt,
    time::{Duration, Instant},
};

use scoring::{AdvantageConfig, Scorer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tool_dispatch::{ShutdownReport, ToolDispatcher};

pub use self::{
    agent::{
        Agent, AgentError, AgentOutcome, AgentRun, SampleRefused, SampleRequest, SampleRequests,
        Sampled, Sampler,
    },
    episode::{Environment, Episode, EpisodeRequest, EpisodeStatus, OpenError, Verdict},
    generator::{
        Finish, GenerateError, GenerateRequest, Generation, Generator, GeneratorStats, Sampling,
    },
    group::ScoredGroup,
    health::{Health, LatencySnapshot, Stats},
    metrics::Metrics,
    outcome::{FailureCause, RolloutFailure},
};
use self::{
    group::GroupState,
    health::{Counters, Failures, Heartbeat, Latency},
};
use crate::{
    ChatTokenizer, DatasetError, DatasetRow, Message, NoExactDelta, ReconcilerConfig, RenderError,
    RenderOptions, RenderState, RolloutId, ToolCallParser,
    parse::{HermesParser, detect_parser},
    sync::{Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering, lock},
};

/// How a rollout builds the prompt of each turn after the first.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum PromptMode {
    /// Token-in/token-out: the previous prompt, the ids the model sampled as it sampled
    /// them, and the ids the chat template writes after that answer up to the next generation
    /// ([`IncrementalRender::delta`](crate::IncrementalRender::delta)). The model's tokens are
    /// never re-encoded: a rollout is one training row with no drift, even when the template
    /// rewrites history. A turn whose template has no exact delta is rendered as in
    /// [`PromptMode::Rerender`] and counted (`fallback_turns`). The parsed answer (content,
    /// `reasoning_content` split from a `<think>` block, tool calls) still goes to the
    /// tools and into the sample's `completion`.
    #[default]
    Append,
    /// TRL's way: the whole conversation rendered each turn (incrementally) and reconciled
    /// with the sampled ids; a template that rewrites history (Qwen3 dropping an empty think
    /// block of an earlier turn) makes the reconciler fork a new row at that turn.
    Rerender,
}

impl PromptMode {
    /// `append` or `rerender`.
    pub fn as_str(self) -> &'static str {
        match self {
            PromptMode::Append => "append",
            PromptMode::Rerender => "rerender",
        }
    }
}

impl fmt::Display for PromptMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PromptMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "append" => Ok(PromptMode::Append),
            "rerender" => Ok(PromptMode::Rerender),
            other => Err(format!(
                "unknown prompt mode '{other}'; expected append (token-in/token-out) or rerender (render the whole conversation each turn)"
            )),
        }
    }
}

/// What [`Engine::pause`] does with the rollouts in flight (vLLM's own pause modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// They run to their end.
    #[default]
    Wait,
    /// They are cancelled; their groups are dropped (counted as cancelled).
    Abort,
}

/// How the loop runs.
///
/// Its serde form is the settings file's (flat keys, durations as `10m`, `500ms`), and with
/// the `clap` feature it is also a set of flags (`--max-inflight N`, ...), each documented
/// here once. `sampling` and `reconciler` are settings of their own, read from the same
/// table (their keys sit beside these), and the fields marked *not a setting* are the
/// embedding program's to set.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct RolloutConfig {
    /// Completions per prompt: the group size
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub num_generations: usize,
    /// Rollouts in flight at once
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_inflight: usize,
    /// Assistant turns (generation calls) per rollout
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_turns: usize,
    /// Tokens sampled per assistant turn (clipped further to the context left)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_tokens: u32,
    /// Completion tokens per rollout, every turn together (default: no limit but the context)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u32>,
    /// The context length, instead of what the server reports
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// How long one attempt at a rollout may take, every turn and tool call together
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    pub rollout_timeout: Duration,
    /// Completions a group needs to be scored and kept
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub min_group_size: usize,
    /// Times a failed rollout is tried again on the same prompt (fresh sampling)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub retries: usize,
    /// Set malformed dataset rows aside (counted, reported at the end) instead of stopping
    #[cfg_attr(feature = "clap", arg(long))]
    pub skip_bad_rows: bool,
    /// Stop after N groups (default: one pass over the dataset)
    #[cfg_attr(feature = "clap", arg(long = "groups", value_name = "N"))]
    #[serde(rename = "groups", skip_serializing_if = "Option::is_none")]
    pub max_groups: Option<u64>,
    /// Cancel a group whose first turn was sampled more than this many model versions before
    /// the current one (versions come from the program or the control endpoint's
    /// /model_version); match the trainer's own bound (TRL's max_staleness), past which it
    /// drops samples anyway (default: never)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
    /// With max_staleness: the groups the trainer takes per model version (its batch, in
    /// groups). Admission then holds a group that could not be trained on within the
    /// staleness bound (AReaL's rule: the k-th group admitted, from 0, waits until k <
    /// (versions since the start + max_staleness + 1) x groups_per_version)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups_per_version: Option<u64>,
    /// Stop the run (drain, exit 1) once more than this fraction of the rollouts that ended
    /// failed, judged from 16 rollouts on and at the end; failures because no server could
    /// be reached do not count (see --server-wait)
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_failure_rate: Option<f64>,
    /// How long to wait for the servers: at start, and whenever every server is down mid-run
    /// (admission pauses meanwhile); past it the run drains and stops with an error
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    pub server_wait: Duration,
    /// Sampling.
    #[cfg_attr(feature = "clap", command(flatten))]
    #[serde(skip)]
    pub sampling: Sampling,
    /// How the prompts of later turns are built: append (the previous prompt, the ids the
    /// model sampled, and the chat template's ids for what follows: one exact row per
    /// rollout) or rerender (the whole conversation rendered each turn, as TRL does)
    #[cfg_attr(feature = "clap", arg(long, value_name = "MODE"))]
    pub prompt_mode: PromptMode,
    /// How turns become training rows.
    #[cfg_attr(feature = "clap", command(flatten))]
    #[serde(skip)]
    pub reconciler: ReconcilerConfig,
    /// How rewards become advantages. *Not a setting*: a program picks a preset
    /// ([`AdvantageConfig::preset`]) or builds one.
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub advantages: AdvantageConfig,
    /// Scored groups the output holds for a slow consumer before admission waits. *Not a
    /// setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub output_buffer: usize,
    /// The heartbeat's period. *Not a setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub heartbeat: Duration,
    /// A heartbeat later than this is logged as a warning. *Not a setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub lag_warning: Duration,
}

impl Default for RolloutConfig {
    /// 8 generations, 64 in flight, 8 turns of at most 512 tokens, append mode, 10 minutes
    /// per rollout, groups of at least 2, one retry, a run that stops past 50% failed
    /// rollouts or 10 minutes without a server, TRL's advantages, a 100 ms heartbeat.
    fn default() -> Self {
        Self {
            num_generations: 8,
            max_inflight: 64,
            max_turns: 8,
            max_tokens: 512,
            max_total_tokens: None,
            max_model_len: None,
            rollout_timeout: Duration::from_secs(600),
            min_group_size: 2,
            retries: 1,
            skip_bad_rows: false,
            max_groups: None,
            max_staleness: None,
            groups_per_version: None,
            max_failure_rate: Some(0.5),
            server_wait: Duration::from_secs(600),
            sampling: Sampling::default(),
            prompt_mode: PromptMode::Append,
            reconciler: ReconcilerConfig::default(),
            advantages: AdvantageConfig::default(),
            output_buffer: 16,
            heartbeat: Duration::from_millis(100),
            lag_warning: Duration::from_millis(50),
        }
    }
}

impl RolloutConfig {
    /// Checks that the settings can run, saying which one cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let at_least_one = [
            ("num_generations", self.num_generations),
            ("max_inflight", self.max_inflight),
            ("max_turns", self.max_turns),
            ("max_tokens", self.max_tokens as usize),
            ("min_group_size", self.min_group_size),
        ];
        for (setting, value) in at_least_one {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
        if self.min_group_size > self.num_generations {
            return Err(ConfigError::new(
                "min_group_size",
                format!(
                    "({}) is more than num_generations ({}): no group could ever be kept",
                    self.min_group_size, self.num_generations
                ),
            ));
        }
        if self.groups_per_version == Some(0) {
            return Err(ConfigError::new("groups_per_version", "must be at least 1"));
        }
        if self.groups_per_version.is_some() && self.max_staleness.is_none() {
            return Err(ConfigError::new(
                "groups_per_version",
                "needs max_staleness: it bounds admission by how stale a group may get",
            ));
        }
        for (setting, value) in [
            ("rollout_timeout", self.rollout_timeout),
            ("server_wait", self.server_wait),
            ("heartbeat", self.heartbeat),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(setting, "must be longer than 0s"));
            }
        }
        if let Some(rate) = self.max_failure_rate
            && !(0.0..=1.0).contains(&rate)
        {
            return Err(ConfigError::new(
                "max_failure_rate",
                format!("must be a fraction between 0 and 1, got {rate}"),
            ));
        }
        self.sampling.validate()?;
        self.advantages
            .validate()
            .map_err(|e| ConfigError::new("advantages", e.to_string()))
    }
}

/// A setting of [`RolloutConfig`] that cannot work: which one (its field name, which is also
/// its settings-file key) and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{setting} {problem}")]
pub struct ConfigError {
    /// The setting's name.
    pub setting: &'static str,
    /// What is wrong with its value, a phrase that follows the name.
    pub problem: String,
}

impl ConfigError {
    fn new(setting: &'static str, problem: impl Into<String>) -> ConfigError {
        ConfigError {
            setting,
            problem: problem.into(),
        }
    }
}

/// The loop could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A setting cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
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

/// Rollouts that must have ended before [`RolloutConfig::max_failure_rate`] is judged during
/// a run (at the end it is judged on however many there were).
pub const FAILURE_RATE_MIN_ROLLOUTS: u64 = 16;

/// A dataset row read ahead, its prompt rendered (or refused) on the reader thread.
type ReadRow = Result<ReadOk, DatasetError>;
/// A row that parsed with its group id, and its prompt rendered or why it could not be.
type ReadOk = (u64, DatasetRow, Result<RenderState, RenderError>);

/// State shared by the driver, the rollouts and the heartbeat.
pub(crate) struct Shared<G> {
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
    pub(crate) config: RolloutConfig,
    pub(crate) max_model_len: Option<u32>,
    /// The conversation with no message (the tools' system block, for most templates),
    /// rendered once: every group's prompt starts from it and tokenizes only what it adds.
    base: Option<RenderState>,
    /// Bytes of the vocabulary's longest token: a text of `n` bytes is at least
    /// `n / max_token_bytes` tokens.
    max_token_bytes: usize,
    pub(crate) counters: Counters,
    /// Rollouts that failed, by cause.
    failures_by_cause: Failures,
    /// How long generation requests take.
    pub(crate) generation_latency: Latency,
    pub(crate) cancel: CancellationToken,
    /// Whether admission is paused ([`Engine::pause`]).
    paused: watch::Sender<bool>,
    /// Cancelled by a pause in [`PauseMode::Abort`] (then replaced): every rollout attempt
    /// watches the token current when it started.
    pub(crate) abort: Mutex<CancellationToken>,
    /// Rollouts in flight when [`Engine::cancel`] ended them: a drain they did not finish.
    cancelled_in_flight: AtomicU64,
    /// The chat template's name, for messages about it.
    template_name: String,
    /// Why append mode fell back to re-rendering, by reason: each is warned about once.
    fallbacks_warned: Mutex<Vec<&'static str>>,
    /// The model version; rollouts waiting on staleness subscribe to it.
    versions: watch::Sender<u64>,
    admission: CancellationToken,
    admission_closed: AtomicBool,
    heartbeat: Heartbeat,
    stop_heartbeat: CancellationToken,
    tracker: TaskTracker,
    in_flight: Arc<Semaphore>,
    queued: AtomicUsize,
    error: Mutex<Option<String>>,
    bad_rows: Mutex<Vec<String>>,
    failures: Mutex<Vec<RolloutFailure>>,
}

impl<G> Shared<G> {
    /// A group's prompt, rendered once for all its rollouts.
    fn render_prompt(&self, row: &DatasetRow) -> Result<RenderState, RenderError> {
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
    fn check_prompt_size(&self, row: &DatasetRow) -> Result<(), String> {
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

    /// Why the run must stop for its failure rate, if it must. `at_end`: judge however few
    /// rollouts ended.
    fn failure_rate_exceeded(&self, at_end: bool) -> Option<String> {
        let max = self.config.max_failure_rate?;
        let stats = self.counters.snapshot();
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
        let last = lock(&self.failures)
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

    /// Records why the run stops (the first reason wins) and stops admission.
    fn stop_run(&self, reason: String) {
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

    /// AReaL's rule: whether the `admitted`-th group may start `versions` versions after the
    /// start. Always with no bound set.
    fn fresh_enough(&self, admitted: u64, versions: u64) -> bool {
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

    /// Resolves once `group`'s first turn is more than `max_staleness` versions behind.
    pub(crate) async fn stale(&self, group: &GroupState, max_staleness: u64) {
        let mut versions = self.versions.subscribe();
        loop {
            let first = group.first_version();
            if first.is_some_and(|first| {
                *versions.borrow_and_update() > first.saturating_add(max_staleness)
            }) {
                return;
            }
            if versions.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Notes a turn whose next prompt append mode could not build (counted by the caller),
    /// warning once per reason.
    pub(crate) fn fell_back(&self, reason: &NoExactDelta) {
        Counters::add(&self.counters.append_fallbacks, 1);
        let mut warned = lock(&self.fallbacks_warned);
        if !warned.contains(&reason.kind()) {
            warned.push(reason.kind());
            tracing::warn!(
                template = %self.template_name,
                reason = %reason,
                "append mode: no exact token delta after an assistant turn; such turns are re-rendered whole (counted in fallback_turns); warned once per reason"
            );
        }
    }
}

/// Builds an [`Engine`]; see [`Engine::builder`].
pub struct EngineBuilder<G> {
    generator: G,
    tokenizer: ChatTokenizer,
    scorer: Scorer,
    tools: Option<ToolDispatcher>,
    environment: Option<Arc<dyn Environment>>,
    agent: Option<Arc<dyn Agent>>,
    parser: Option<Box<dyn ToolCallParser>>,
    options: RenderOptions,
    config: RolloutConfig,
}

impl<G> fmt::Debug for EngineBuilder<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<G: Generator> EngineBuilder<G> {
    /// Runs the model's tool calls with `tools`; their specs are rendered into the prompt.
    #[must_use]
    pub fn tools(mut self, tools: ToolDispatcher) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Runs each rollout in an episode of `environment`: the episode's tools are the
    /// rollout's (instead of those of [`EngineBuilder::tools`]), a tool may end it, and its
    /// verdict is the completion's `rollout_reward` (add `scoring::builtin::environment()`
    /// to the scorer for the `env` column). See [`Environment`].
    #[must_use]
    pub fn environment(mut self, environment: Arc<dyn Environment>) -> Self {
        self.environment = Some(environment);
        self
    }

    /// Runs each rollout's conversation with `agent`, a loop-owning agent that samples every
    /// turn through the engine (see [`Agent`]); the engine's tools are then not used by the
    /// loop. With an [`EngineBuilder::environment`] too, each attempt's episode is opened
    /// before the agent runs (its tools are not the agent's) and its verify judges the
    /// agent's transcript.
    #[must_use]
    pub fn agent(mut self, agent: Arc<dyn Agent>) -> Self {
        self.agent = Some(agent);
        self
    }

    /// Parses tool calls with `parser` (default: the one the chat template's format
    /// suggests, else hermes).
    #[must_use]
    pub fn parser(mut self, parser: Box<dyn ToolCallParser>) -> Self {
        self.parser = Some(parser);
        self
    }

    /// Renders with `options` (chat template name, template kwargs); the tools' specs are
    /// added to them.
    #[must_use]
    pub fn render_options(mut self, options: RenderOptions) -> Self {
        self.options = options;
        self
    }

    /// The loop's settings.
    #[must_use]
    pub fn config(mut self, config: RolloutConfig) -> Self {
        self.config = config;
        self
    }

    /// Starts the loop on the current tokio runtime, reading groups from `rows` on a thread
    /// of its own, and returns it with its output.
    ///
    /// # Panics
    /// Outside a tokio runtime (it spawns its tasks there).
    pub fn start<I>(self, rows: I) -> Result<(Engine<G>, Groups), EngineError>
    where
        I: IntoIterator<Item = Result<DatasetRow, DatasetError>>,
        I::IntoIter: Send + 'static,
    {
        let mut next_id = 0u64;
        self.start_with_ids(rows.into_iter().map(move |row| {
            let id = next_id;
            next_id += 1;
            row.map(|row| (id, row))
        }))
    }

    /// As [`EngineBuilder::start`], each row with the id its group takes (its rollouts are
    /// `id * num_generations + i`, and request seeds derive from those): a program that skips
    /// rows (a resumed run, one shard of a dataset) keeps every group's id, and seeds, as in a
    /// run over every row. Ids must be distinct.
    ///
    /// # Panics
    /// Outside a tokio runtime (it spawns its tasks there).
    pub fn start_with_ids<I>(self, rows: I) -> Result<(Engine<G>, Groups), EngineError>
    where
        I: IntoIterator<Item = Result<(u64, DatasetRow), DatasetError>>,
        I::IntoIter: Send + 'static,
    {
        let config = self.config;
        config.validate()?;
        let mut options = self.options;
        options.add_generation_prompt = true;
        if let Some(tools) = &self.tools
            && !tools.registry().is_empty()
        {
            options.tools = Some(tools.registry().to_openai());
        }
        let template = self.tokenizer.template(&options)?;
        let template_name = template.name().to_owned();
        let parser = self.parser.unwrap_or_else(|| {
            detect_parser(template.source()).unwrap_or_else(|| Box::new(HermesParser))
        });
        let max_model_len = config.max_model_len.or(self.generator.max_model_len());
        // A template may refuse an empty conversation; groups then render from nothing.
        let base = self
            .tokenizer
            .incremental(options.clone())
            .ok()
            .and_then(|mut render| {
                render.conversation().ok()?;
                Some(render.state())
            });
        let max_token_bytes = self
            .tokenizer
            .tokenizer()
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        let groups_in_flight = config.max_inflight.div_ceil(config.num_generations) + 1;
        let (output, groups) = mpsc::channel(groups_in_flight + config.output_buffer.max(1));
        let shared = Arc::new(Shared {
            template_name,
            fallbacks_warned: Mutex::new(Vec::new()),
            generator: self.generator,
            tokenizer: self.tokenizer,
            options,
            parser,
            tools: self.tools,
            environment: self.environment,
            agent: self.agent,
            scorer: self.scorer,
            max_model_len,
            base,
            max_token_bytes,
            counters: Counters::default(),
            failures_by_cause: Failures::default(),
            generation_latency: Latency::default(),
            cancel: CancellationToken::new(),
            paused: watch::Sender::new(false),
            abort: Mutex::new(CancellationToken::new()),
            cancelled_in_flight: AtomicU64::new(0),
            versions: watch::Sender::new(0),
            admission: CancellationToken::new(),
            admission_closed: AtomicBool::new(false),
            heartbeat: Heartbeat::new(),
            stop_heartbeat: CancellationToken::new(),
            tracker: TaskTracker::new(),
            in_flight: Arc::new(Semaphore::new(config.max_inflight)),
            queued: AtomicUsize::new(0),
            error: Mutex::new(None),
            bad_rows: Mutex::new(Vec::new()),
            failures: Mutex::new(Vec::new()),
            config,
        });
        let rows =
            spawn_reader(rows.into_iter(), Arc::clone(&shared)).map_err(EngineError::Thread)?;
        let heartbeat = Arc::clone(&shared);
        tokio::spawn(async move {
            let stop = heartbeat.stop_heartbeat.clone();
            let config = &heartbeat.config;
            heartbeat
                .heartbeat
                .run(config.heartbeat, config.lag_warning, stop)
                .await;
        });
        shared
            .tracker
            .spawn(admit(Arc::clone(&shared), rows, output));
        Ok((Engine { shared }, Groups { receiver: groups }))
    }
}

/// Reads rows on a thread of its own (files block), a few rows ahead of admission, and
/// renders each prompt there: tokenizing is CPU work that must not hold a runtime thread.
fn spawn_reader<I, G>(rows: I, shared: Arc<Shared<G>>) -> std::io::Result<mpsc::Receiver<ReadRow>>
where
    I: Iterator<Item = Result<(u64, DatasetRow), DatasetError>> + Send + 'static,
    G: Generator,
{
    let (sender, receiver) = mpsc::channel(64);
    std::thread::Builder::new()
        .name("rollout-dataset".to_owned())
        .spawn(move || {
            for row in rows {
                let read = row.and_then(|(id, row)| {
                    shared
                        .check_prompt_size(&row)
                        .map_err(|reason| DatasetError::Row {
                            path: row.source.to_string(),
                            line: row.line,
                            reason,
                        })?;
                    let prompt = shared.render_prompt(&row);
                    Ok((id, row, prompt))
                });
                if sender.blocking_send(read).is_err() {
                    break;
                }
            }
        })?;
    Ok(receiver)
}

/// Waits while the generator says no server can take requests, saying so every few seconds.
/// False when the run must stop: admission was cancelled, or the wait passed `server_wait`.
async fn wait_for_generator<G: Generator>(shared: &Shared<G>) -> bool {
    let Some(mut reason) = shared.generator.unavailable() else {
        return true;
    };
    let wait = shared.config.server_wait;
    let started = Instant::now();
    let mut said = started;
    tracing::warn!(%reason, ?wait, "no server can take requests: admission paused until one answers");
    loop {
        tokio::select! {
            biased;
            () = shared.admission.cancelled() => return false,
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        match shared.generator.unavailable() {
            None => {
                tracing::info!(waited = ?started.elapsed(), "a server answers again: admission resumes");
                return true;
            }
            Some(now) => reason = now,
        }
        if started.elapsed() >= wait {
            shared.stop_run(format!(
                "no server could take requests for {wait:?} (--server-wait); the last error: {reason}"
            ));
            return false;
        }
        if said.elapsed() >= Duration::from_secs(5) {
            said = Instant::now();
            tracing::warn!(%reason, waited = ?started.elapsed(), ?wait, "still no server: admission paused");
        }
    }
}

/// The loop's output: scored groups, in the order they complete. It ends when the dataset
/// is done (or the group limit reached) and every group is out, or after a drain.
#[derive(Debug)]
pub struct Groups {
    receiver: mpsc::Receiver<ScoredGroup>,
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

/// A running rollout loop; see the [module docs](self).
///
/// Dropping it cancels what runs; [`Engine::shutdown`] drains instead.
pub struct Engine<G: Generator> {
    shared: Arc<Shared<G>>,
}

impl<G: Generator> fmt::Debug for Engine<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<G: Generator> Engine<G> {
    /// An engine sampling with `generator`, rendering with `tokenizer`'s chat template and
    /// scoring with `scorer`.
    pub fn builder(generator: G, tokenizer: ChatTokenizer, scorer: Scorer) -> EngineBuilder<G> {
        EngineBuilder {
            generator,
            tokenizer,
            scorer,
            tools: None,
            environment: None,
            agent: None,
            parser: None,
            options: RenderOptions::generation(),
            config: RolloutConfig::default(),
        }
    }

    /// Turns sampled from now on record `version` (call it when the server's weights
    /// change); with `max_staleness`, groups left too far behind are cancelled. Versions only
    /// grow: a lower one than the current is refused with the current one
    /// (`Err(current)`); the current one again is a no-op.
    pub fn set_model_version(&self, version: u64) -> Result<(), u64> {
        let mut refused = None;
        self.shared.versions.send_if_modified(|current| {
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

    /// The model version turns are sampled under now.
    pub fn model_version(&self) -> u64 {
        self.shared.model_version()
    }

    /// The context length the loop clips turns to, if known.
    pub fn max_model_len(&self) -> Option<u32> {
        self.shared.max_model_len
    }

    /// How the loop is doing. Cheap; call it as often as needed.
    pub fn health(&self) -> Health {
        let shared = &self.shared;
        let (scheduler_lag_p99, scheduler_lag_max) = shared.heartbeat.lag();
        Health {
            heartbeat_age: shared.heartbeat.age(),
            scheduler_lag_p99,
            scheduler_lag_max,
            in_flight: shared.config.max_inflight - shared.in_flight.available_permits(),
            queued: shared.queued.load(Ordering::Relaxed),
            model_version: shared.model_version(),
            admission_closed: shared.admission_closed.load(Ordering::Acquire),
            paused: *shared.paused.borrow(),
            servers_unavailable: shared.generator.unavailable(),
            stats: shared.counters.snapshot(),
        }
    }

    /// Everything the loop counts, at this moment: what metrics and reports read.
    pub fn metrics(&self) -> Metrics {
        let shared = &self.shared;
        Metrics {
            health: self.health(),
            failures: shared.failures_by_cause.snapshot(),
            generation_latency: shared.generation_latency.snapshot(),
            generator: shared.generator.stats(),
            tools: shared.tools.as_ref().map(ToolDispatcher::metrics),
        }
    }

    /// Pauses admission: no group is admitted and no admitted group starts until
    /// [`Engine::resume`]. With [`PauseMode::Wait`] the rollouts in flight run to their end;
    /// with [`PauseMode::Abort`] they are cancelled (their groups dropped, counted as
    /// cancelled). Returns once no rollout is in flight. Pausing a paused loop is harmless.
    pub async fn pause(&self, mode: PauseMode) {
        let shared = &self.shared;
        shared.paused.send_replace(true);
        if mode == PauseMode::Abort {
            let mut abort = lock(&shared.abort);
            abort.cancel();
            *abort = CancellationToken::new();
        }
        while shared.in_flight.available_permits() < shared.config.max_inflight {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Resumes admission after [`Engine::pause`].
    pub fn resume(&self) {
        self.shared.paused.send_replace(false);
    }

    /// The tool dispatcher, for its metrics.
    pub fn tools(&self) -> Option<&ToolDispatcher> {
        self.shared.tools.as_ref()
    }

    /// The scorer, for its statistics.
    pub fn scorer(&self) -> &Scorer {
        &self.shared.scorer
    }

    /// Stops admission and cancels every rollout in flight at once (their requests are
    /// dropped); a drain under way then ends without waiting for its deadline. Groups
    /// already complete are still scored and sent.
    pub fn cancel(&self) {
        let shared = &self.shared;
        shared.admission.cancel();
        if !shared.cancel.is_cancelled() {
            let in_flight = shared.config.max_inflight - shared.in_flight.available_permits();
            shared
                .cancelled_in_flight
                .fetch_add(in_flight as u64, Ordering::Relaxed);
        }
        shared.cancel.cancel();
    }

    /// Drains: stops admission, lets rollouts in flight finish until `deadline`, then
    /// cancels the rest (their requests are dropped, which aborts them on the server);
    /// scores and sends every complete group; closes the output and the tool pool. Also the
    /// way to close a loop that ended by itself. Calling it again reports again.
    pub async fn shutdown(&self, deadline: Duration) -> DrainReport {
        let shared = &self.shared;
        let start = Instant::now();
        shared.admission.cancel();
        shared.tracker.close();
        let in_time = tokio::time::timeout(deadline, shared.tracker.wait())
            .await
            .is_ok();
        let mut cancelled_at_deadline = 0;
        if !in_time {
            cancelled_at_deadline =
                (shared.config.max_inflight - shared.in_flight.available_permits()) as u64;
            tracing::warn!(
                rollouts = cancelled_at_deadline,
                "drain deadline reached: cancelling the rollouts still running"
            );
            shared.cancel.cancel();
            shared.tracker.wait().await;
        }
        shared.stop_heartbeat.cancel();
        let tools = match &shared.tools {
            Some(tools) => {
                let left = deadline
                    .saturating_sub(start.elapsed())
                    .max(Duration::from_millis(100));
                Some(tools.shutdown(left).await)
            }
            None => None,
        };
        if let Some(reason) = shared.failure_rate_exceeded(true) {
            shared.stop_run(reason);
        }
        let threads_clean = tools.as_ref().is_none_or(|t| t.threads_detached == 0);
        // Rollouts that `cancel` ended did not finish either, however soon the wait was over.
        let cancelled_early = shared.cancelled_in_flight.load(Ordering::Relaxed);
        DrainReport {
            elapsed: start.elapsed(),
            clean: in_time && cancelled_early == 0 && threads_clean,
            cancelled_at_deadline: cancelled_at_deadline + cancelled_early,
            stats: shared.counters.snapshot(),
            tools,
            error: lock(&shared.error).clone(),
            bad_rows: lock(&shared.bad_rows).clone(),
            failures: lock(&shared.failures).clone(),
        }
    }
}

impl<G: Generator> Drop for Engine<G> {
    fn drop(&mut self) {
        self.shared.admission.cancel();
        self.shared.cancel.cancel();
        self.shared.stop_heartbeat.cancel();
    }
}

/// Admission: one group per row while output slots, in-flight slots and rows last.
async fn admit<G: Generator>(
    shared: Arc<Shared<G>>,
    mut rows: mpsc::Receiver<ReadRow>,
    output: mpsc::Sender<ScoredGroup>,
) {
    let config = &shared.config;
    let n = config.num_generations;
    let first_version = shared.model_version();
    let mut admitted = 0u64;
    loop {
        if config.max_groups.is_some_and(|max| admitted >= max) {
            break;
        }
        if !admission_open(&shared, admitted, first_version).await {
            break;
        }
        if !wait_for_generator(&shared).await {
            break;
        }
        // The group's output slot first: a consumer that falls behind holds admission here.
        let slot = tokio::select! {
            biased;
            () = shared.admission.cancelled() => break,
            slot = output.clone().reserve_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let Some((group_id, row, first)) = next_row(&shared, &mut rows).await else {
            break;
        };
        Counters::add(&shared.counters.groups_admitted, 1);
        let group = Arc::new(GroupState::new(group_id, row, first, n, slot));
        if !start_group(&shared, group).await {
            break;
        }
        admitted += 1;
    }
    shared.admission_closed.store(true, Ordering::Release);
}

/// Waits until a group may be admitted: admission not paused, and with `max_staleness` and
/// `groups_per_version`, AReaL's rule (the `admitted`-th group, from 0, could still be
/// trained on within the staleness bound: `admitted < (versions since the start +
/// max_staleness + 1) * groups_per_version`). False when admission closes meanwhile.
async fn admission_open<G>(shared: &Shared<G>, admitted: u64, first_version: u64) -> bool {
    let mut paused = shared.paused.subscribe();
    let mut versions = shared.versions.subscribe();
    loop {
        let held = *paused.borrow_and_update();
        let version = *versions.borrow_and_update();
        if !held && shared.fresh_enough(admitted, version.saturating_sub(first_version)) {
            return true;
        }
        // The senders live in `shared`: neither channel closes while this runs.
        tokio::select! {
            biased;
            () = shared.admission.cancelled() => return false,
            _ = paused.changed() => {}
            _ = versions.changed() => {}
        }
    }
}

/// `permits` in-flight slots, once admission is not paused; `None` when admission closes.
/// A pause that comes while it waits holds it again.
async fn acquire<G>(shared: &Shared<G>, permits: u32) -> Option<OwnedSemaphorePermit> {
    let mut paused = shared.paused.subscribe();
    loop {
        if *paused.borrow_and_update() {
            tokio::select! {
                biased;
                () = shared.admission.cancelled() => return None,
                _ = paused.changed() => continue,
            }
        }
        tokio::select! {
            biased;
            () = shared.admission.cancelled() => return None,
            _ = paused.changed() => {}
            acquired = Arc::clone(&shared.in_flight).acquire_many_owned(permits) => return acquired.ok(),
        }
    }
}

/// The next dataset row to admit, its prompt rendered; bad rows skipped with
/// `skip_bad_rows`. `None` at the end of the dataset, on an error (recorded) or when
/// admission closes.
async fn next_row<G>(shared: &Shared<G>, rows: &mut mpsc::Receiver<ReadRow>) -> Option<ReadOk> {
    loop {
        let next = tokio::select! {
            biased;
            () = shared.admission.cancelled() => return None,
            next = rows.recv() => next?,
        };
        match next {
            Ok(read) => return Some(read),
            Err(error)
                if shared.config.skip_bad_rows && matches!(error, DatasetError::Row { .. }) =>
            {
                Counters::add(&shared.counters.bad_rows, 1);
                tracing::warn!(%error, "skipping a bad dataset row");
                let mut bad = lock(&shared.bad_rows);
                if bad.len() < 100 {
                    bad.push(error.to_string());
                }
            }
            Err(error) => {
                tracing::error!(%error, "stopping admission");
                *lock(&shared.error) = Some(error.to_string());
                return None;
            }
        }
    }
}

/// Starts a group's rollouts as slots in flight free up. `false` when admission closed
/// before every rollout started (the rest are cancelled, and the group finished if none
/// runs).
async fn start_group<G: Generator>(shared: &Arc<Shared<G>>, group: Arc<GroupState>) -> bool {
    let n = shared.config.num_generations;
    let base = group.group_id * n as u64;
    shared.queued.fetch_add(n, Ordering::Relaxed);
    // A group that fits takes its slots all at once, so that a drain never finds it half
    // started (its started rollouts would be thrown away with it); a group larger than
    // `max_inflight` can only start rollout by rollout.
    let mut whole = None;
    if let Ok(count) = u32::try_from(n)
        && n <= shared.config.max_inflight
    {
        whole = acquire(shared, count).await;
    }
    for index in 0..n {
        let permit = match whole.as_mut() {
            Some(permits) if index + 1 < n => permits.split(1),
            Some(_) => whole.take(),
            None => acquire(shared, 1).await,
        };
        let Some(permit) = permit else {
            shared.queued.fetch_sub(n - index, Ordering::Relaxed);
            Counters::add(&shared.counters.rollouts_cancelled, (n - index) as u64);
            // Even with no rollout started the group must be finished: that counts it as
            // cancelled, so admitted groups always add up.
            if group.abandon_from(index, base) {
                group::finish(shared, &group).await;
            }
            return false;
        };
        shared.queued.fetch_sub(1, Ordering::Relaxed);
        let rollout_shared = Arc::clone(shared);
        let group = Arc::clone(&group);
        shared.tracker.spawn(async move {
            let shared = rollout_shared;
            let rollout_id = RolloutId(base + index as u64);
            let outcome = conversation::run(&shared, &group, rollout_id).await;
            drop(permit);
            shared.generator.release(rollout_id);
            shared.rollout_ended(&outcome);
            if group.complete(index, outcome) {
                group::finish(&shared, &group).await;
            }
        });
    }
    true
}

impl<G> Shared<G> {
    /// Counts a rollout that ended, keeps its failure for the report, and stops the run
    /// when failures pass `max_failure_rate`.
    fn rollout_ended(&self, outcome: &Result<outcome::Finished, RolloutFailure>) {
        match outcome {
            Ok(_) => Counters::add(&self.counters.rollouts_completed, 1),
            Err(failure) if failure.cause == FailureCause::Cancelled => {
                Counters::add(&self.counters.rollouts_cancelled, 1);
            }
            Err(failure) => {
                Counters::add(&self.counters.rollouts_failed, 1);
                self.failures_by_cause.add(failure.cause);
                if failure.cause == FailureCause::Unavailable {
                    Counters::add(&self.counters.rollouts_unavailable, 1);
                }
                tracing::warn!(%failure, "rollout failed");
                {
                    let mut failures = lock(&self.failures);
                    if failures.len() < 100 {
                        failures.push(failure.clone());
                    }
                }
                if let Some(reason) = self.failure_rate_exceeded(false) {
                    self.stop_run(reason);
                }
            }
        }
    }
}
