//! Reward functions: the traits, and [`Reward`], a function with its name, weight and timeout.

use std::{fmt, future::Future, time::Duration};

use futures::future::BoxFuture;

use std::sync::Arc;

use crate::group::Group;

/// The error type reward functions return.
pub type RewardError = Box<dyn std::error::Error + Send + Sync>;

/// One optional score per completion of the group, in order; `None` means "cannot score this
/// one" (the completion is then unscorable for this column).
pub type Scores = Vec<Option<f64>>;

/// One optional note per completion of the group, in order, beside its score (a judge's
/// answer); empty when the function keeps none.
pub type Notes = Vec<Option<String>>;

/// A reward function that blocks or computes: it runs on the scorer's own thread pool, never
/// on the async runtime. Implemented for every `Fn(&Group) -> Result<Scores, RewardError>`.
pub trait SyncReward: Send + Sync + 'static {
    /// Scores every completion of `group`.
    fn score(&self, group: &Group) -> Result<Scores, RewardError>;
}

impl<F> SyncReward for F
where
    F: Fn(&Group) -> Result<Scores, RewardError> + Send + Sync + 'static,
{
    fn score(&self, group: &Group) -> Result<Scores, RewardError> {
        self(group)
    }
}

/// A reward function that waits on I/O (a judge model, a sandbox): awaited on the runtime.
/// Implemented for every `Fn(Arc<Group>) -> impl Future<Output = Result<Scores, RewardError>>`.
pub trait AsyncReward: Send + Sync + 'static {
    /// Scores every completion of `group`.
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>>;

    /// Scores every completion of `group`, with a note on each when the function keeps one
    /// (a judge asked to keep its answers): what the rows' `reward_notes` hold. By default,
    /// [`score`](AsyncReward::score)'s scores and no note.
    fn score_with_notes(
        &self,
        group: Arc<Group>,
    ) -> BoxFuture<'static, Result<(Scores, Notes), RewardError>> {
        let scores = self.score(group);
        Box::pin(async move { Ok((scores.await?, Notes::new())) })
    }

    /// What the function's calls to a service did so far, for a function that makes them (a
    /// judge, a reward service); the scorer reports it with its own counts of the function
    /// ([`RewardStats::calls`](crate::RewardStats::calls)). `None` (the default) for others.
    fn calls(&self) -> Option<CallStats> {
        None
    }
}

/// What a reward function's calls to a service did. A call is one request with its retries,
/// for one completion or for one group as the function asks; a call that fails leaves what it
/// scores unscorable, counted here by cause.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CallStats {
    /// Calls made (each counted once, its retries apart); answers from a cache are not.
    pub calls: u64,
    /// Attempts made again after one failed.
    pub retries: u64,
    /// Answers taken from the function's cache instead of a call.
    pub cache_hits: u64,
    /// Calls given up because the connection failed, broke or timed out.
    pub transport: u64,
    /// Calls given up because the service answered an error status.
    pub status: u64,
    /// Calls whose answer held no score in the form expected.
    pub unreadable: u64,
    /// What the last failed call said.
    pub last_failure: Option<String>,
}

impl CallStats {
    /// Calls that gave no score, whatever the cause.
    pub fn failed(&self) -> u64 {
        self.transport + self.status + self.unreadable
    }

    /// The failures under their names: `transport`, `status`, `unreadable`.
    pub fn failures(&self) -> [(&'static str, u64); 3] {
        [
            ("transport", self.transport),
            ("status", self.status),
            ("unreadable", self.unreadable),
        ]
    }
}

impl<F, Fut> AsyncReward for F
where
    F: Fn(Arc<Group>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Scores, RewardError>> + Send + 'static,
{
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        Box::pin(self(group))
    }
}

#[derive(Clone)]
#[cfg_attr(
    not(feature = "scorer"),
    expect(
        dead_code,
        reason = "the functions are run by the scorer (feature `scorer`)"
    )
)]
pub(crate) enum Runner {
    Sync(Arc<dyn SyncReward>),
    /// A sync function cheap and bounded by construction, run where the group is scored.
    Inline(Arc<dyn SyncReward>),
    Async(Arc<dyn AsyncReward>),
}

/// A reward function with its name (metrics read `rewards/<name>`), weight (default 1.0) and
/// optional timeout (else the scorer's default).
#[derive(Clone)]
pub struct Reward {
    pub(crate) name: String,
    pub(crate) weight: f64,
    pub(crate) timeout: Option<Duration>,
    pub(crate) column: Option<String>,
    pub(crate) runner: Runner,
}

impl Reward {
    /// A sync reward from a function or closure.
    pub fn new_sync<F>(name: impl Into<String>, function: F) -> Reward
    where
        F: Fn(&Group) -> Result<Scores, RewardError> + Send + Sync + 'static,
    {
        Reward::from_sync(name, function)
    }

    /// An async reward from a function or closure returning a future.
    pub fn new_async<F, Fut>(name: impl Into<String>, function: F) -> Reward
    where
        F: Fn(Arc<Group>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Scores, RewardError>> + Send + 'static,
    {
        Reward::from_async(name, function)
    }

    /// A sync reward from any [`SyncReward`].
    pub fn from_sync(name: impl Into<String>, reward: impl SyncReward) -> Reward {
        Reward {
            name: name.into(),
            weight: 1.0,
            timeout: None,
            column: None,
            runner: Runner::Sync(Arc::new(reward)),
        }
    }

    /// A sync reward run on the task that scores the group, not on the scorer's pool: for
    /// functions whose cost is a few microseconds a group and bounded by construction, no
    /// I/O, no loop the input can lengthen beyond its size (the built-in `exact`, `numeric`,
    /// `regex` and `length`). Handing such a function to a pool thread and back costs more
    /// than the function: two thread wake-ups a group. It has no timeout (nothing can
    /// interrupt it) and a slow one stalls the runtime's thread: anything else is
    /// [`Reward::from_sync`]. A panic is caught as on the pool.
    pub fn from_inline(name: impl Into<String>, reward: impl SyncReward) -> Reward {
        Reward {
            name: name.into(),
            weight: 1.0,
            timeout: None,
            column: None,
            runner: Runner::Inline(Arc::new(reward)),
        }
    }

    /// An async reward from any [`AsyncReward`].
    pub fn from_async(name: impl Into<String>, reward: impl AsyncReward) -> Reward {
        Reward {
            name: name.into(),
            weight: 1.0,
            timeout: None,
            column: None,
            runner: Runner::Async(Arc::new(reward)),
        }
    }

    /// Sets the weight of this column in the combined reward.
    pub fn weight(mut self, weight: f64) -> Reward {
        self.weight = weight;
        self
    }

    /// Sets this function's timeout.
    pub fn timeout(mut self, timeout: Duration) -> Reward {
        self.timeout = Some(timeout);
        self
    }

    /// Renames the function (its metrics name).
    pub fn named(mut self, name: impl Into<String>) -> Reward {
        self.name = name.into();
        self
    }

    /// Declares the dataset column the function reads (the expected answer), so that a
    /// caller can check the dataset has it before a run.
    pub fn reads_column(mut self, column: impl Into<String>) -> Reward {
        self.column = Some(column.into());
        self
    }

    /// The dataset column the function reads, when it declared one.
    pub fn column(&self) -> Option<&str> {
        self.column.as_deref()
    }

    /// The name used in metrics.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The weight in the combined reward.
    pub fn get_weight(&self) -> f64 {
        self.weight
    }

    /// Whether the function is sync (on the thread pool, or inline: [`Reward::from_inline`]).
    pub fn is_sync(&self) -> bool {
        matches!(self.runner, Runner::Sync(_) | Runner::Inline(_))
    }
}

impl fmt::Debug for Reward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reward")
            .field("name", &self.name)
            .field("weight", &self.weight)
            .field(
                "kind",
                &match self.runner {
                    Runner::Sync(_) => "sync",
                    Runner::Inline(_) => "inline",
                    Runner::Async(_) => "async",
                },
            )
            .field("timeout", &self.timeout)
            .finish()
    }
}
