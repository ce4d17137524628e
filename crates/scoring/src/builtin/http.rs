//! `kind = "http"`: a reward service of the user's own, over HTTP.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::{
    group::Group,
    reward::{AsyncReward, RewardError, Scores},
};

/// Bytes read of a service's answer: more fails the column for that group.
const MAX_ANSWER: usize = 16 * 1024 * 1024;

/// How an [`HttpReward`] calls its service.
#[derive(Debug, Clone)]
pub struct HttpRewardConfig {
    url: String,
    concurrency: usize,
    attempts: u32,
    request_timeout: Duration,
    base_backoff: Duration,
}

impl HttpRewardConfig {
    /// The service at `url` (`http://` or `https://`, verified against the system's roots);
    /// at most 8 requests at once, 3 attempts, 60 s per attempt.
    pub fn new(url: impl Into<String>) -> HttpRewardConfig {
        HttpRewardConfig {
            url: url.into(),
            concurrency: 8,
            attempts: 3,
            request_timeout: Duration::from_secs(60),
            base_backoff: Duration::from_millis(100),
        }
    }

    /// The most requests in flight at once, over every group (at least 1); the others wait.
    pub fn concurrency(mut self, requests: usize) -> HttpRewardConfig {
        self.concurrency = requests.max(1);
        self
    }

    /// Attempts per group, the first included (at least 1). Only a connection that failed or
    /// broke, a timeout and a 5xx are tried again; a 4xx or an answer that cannot be read is
    /// not.
    pub fn attempts(mut self, attempts: u32) -> HttpRewardConfig {
        self.attempts = attempts.max(1);
        self
    }

    /// How long one attempt may take. The scorer's timeout of the reward bounds the whole
    /// call: the wait for a turn under the concurrency bound and the retries included.
    pub fn request_timeout(mut self, timeout: Duration) -> HttpRewardConfig {
        self.request_timeout = timeout;
        self
    }

    /// The pause after the first failed attempt; it doubles after each (default 100 ms).
    pub fn base_backoff(mut self, backoff: Duration) -> HttpRewardConfig {
        self.base_backoff = backoff;
        self
    }
}

/// Why an [`HttpReward`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reward service URL '{url}': {reason}")]
pub struct HttpRewardError {
    url: String,
    reason: String,
}

/// What an [`HttpReward`] did so far, by cause. A group whose call failed is also counted by
/// the scorer, as an error of the column ([`RewardStats`](crate::RewardStats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HttpRewardStats {
    /// Attempts sent.
    pub requests: u64,
    /// Attempts after a failed one.
    pub retries: u64,
    /// Groups given up on because the connection failed, broke or timed out.
    pub transport: u64,
    /// Groups given up on because the service answered an error status.
    pub status: u64,
    /// Groups whose answer was not one number or `null` per completion.
    pub unreadable: u64,
}

/// Posts each group to a reward service and reads one score or `null` per completion.
///
/// The request is the group as JSON, as a `command` reward gets it on stdin: `{"prompt",
/// "completions": [{"text", "messages", "token_ids", "has_training_row"}], "row"}`. The
/// answer is a JSON array with one number or `null` per completion, or an object whose
/// `scores` field is that array. A `null` leaves that completion unscorable for this column.
/// A call that fails (connection, timeout, an error status after the retries, an answer of
/// another shape) fails the column for that group, with the cause in its message; the run
/// goes on. Cheap to clone; clones share the connection pool, the concurrency bound and the
/// counters.
#[derive(Clone)]
pub struct HttpReward {
    inner: Arc<Inner>,
}

struct Inner {
    url: String,
    client: reqwest::Client,
    permits: Semaphore,
    attempts: u32,
    request_timeout: Duration,
    base_backoff: Duration,
    requests: AtomicU64,
    retries: AtomicU64,
    transport: AtomicU64,
    status: AtomicU64,
    unreadable: AtomicU64,
}

impl std::fmt::Debug for HttpReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpReward")
            .field("url", &self.inner.url)
            .field("attempts", &self.inner.attempts)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Why one attempt failed, and whether another may help.
enum Failure {
    Transport(String),
    Status(u16, String),
    Unreadable(String),
}

impl Failure {
    fn is_retryable(&self) -> bool {
        match self {
            Failure::Transport(_) => true,
            Failure::Status(status, _) => *status >= 500,
            Failure::Unreadable(_) => false,
        }
    }
}

/// The answer's two shapes.
#[derive(Deserialize)]
#[serde(untagged)]
enum Answer {
    Scores(Scores),
    Object { scores: Scores },
}

impl HttpReward {
    /// A reward calling the service `config` names; fails on a URL that is not `http://` or
    /// `https://` with a host.
    pub fn new(config: HttpRewardConfig) -> Result<HttpReward, HttpRewardError> {
        let error = |reason: String| HttpRewardError {
            url: config.url.clone(),
            reason,
        };
        let url = reqwest::Url::parse(&config.url).map_err(|e| error(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(error(
                "expected http://HOST[:PORT]/PATH or https://...".to_owned(),
            ));
        }
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| error(format!("the HTTP client cannot start: {e}")))?;
        Ok(HttpReward {
            inner: Arc::new(Inner {
                url: config.url,
                client,
                permits: Semaphore::new(config.concurrency),
                attempts: config.attempts,
                request_timeout: config.request_timeout,
                base_backoff: config.base_backoff,
                requests: AtomicU64::new(0),
                retries: AtomicU64::new(0),
                transport: AtomicU64::new(0),
                status: AtomicU64::new(0),
                unreadable: AtomicU64::new(0),
            }),
        })
    }

    /// The URL it posts to.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The counts so far.
    pub fn stats(&self) -> HttpRewardStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let inner = &self.inner;
        HttpRewardStats {
            requests: get(&inner.requests),
            retries: get(&inner.retries),
            transport: get(&inner.transport),
            status: get(&inner.status),
            unreadable: get(&inner.unreadable),
        }
    }
}

impl Inner {
    async fn call(&self, group: &Group) -> Result<Scores, RewardError> {
        let body = serde_json::to_vec(group)?;
        // Held across the retries: the bound is on the service's load, not on attempts.
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| "the reward service's concurrency bound was closed")?;
        let mut attempt = 0u32;
        loop {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let failure = match self.attempt(body.clone()).await {
                Ok(scores) => return Ok(scores),
                Err(failure) => failure,
            };
            attempt += 1;
            if !failure.is_retryable() || attempt >= self.attempts {
                return Err(self.give_up(failure, attempt).into());
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            let backoff = self
                .base_backoff
                .saturating_mul(1 << (attempt - 1).min(6))
                .min(Duration::from_secs(5));
            tokio::time::sleep(backoff).await;
        }
    }

    async fn attempt(&self, body: Vec<u8>) -> Result<Scores, Failure> {
        let transport = |e: reqwest::Error| {
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            Failure::Transport(message)
        };
        let mut response = self
            .client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status();
        let mut answer = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(transport)? {
            if answer.len() + chunk.len() > MAX_ANSWER {
                return Err(Failure::Unreadable(format!(
                    "the answer is longer than {MAX_ANSWER} bytes"
                )));
            }
            answer.extend_from_slice(&chunk);
        }
        let head = || String::from_utf8_lossy(&answer[..answer.len().min(200)]).into_owned();
        if !status.is_success() {
            return Err(Failure::Status(status.as_u16(), head()));
        }
        match serde_json::from_slice::<Answer>(&answer) {
            Ok(Answer::Scores(scores) | Answer::Object { scores }) => Ok(scores),
            Err(_) => Err(Failure::Unreadable(format!(
                "expected a JSON array with one number or null per completion, or \
                 {{\"scores\": [...]}}; it answered: {:?}",
                head()
            ))),
        }
    }

    /// Counts the failure that ends a group's call and says what it was.
    fn give_up(&self, failure: Failure, attempts: u32) -> String {
        let url = &self.url;
        let tries = if attempts == 1 {
            String::new()
        } else {
            format!(" (after {attempts} attempts)")
        };
        match failure {
            Failure::Transport(message) => {
                self.transport.fetch_add(1, Ordering::Relaxed);
                let timeout = self.request_timeout;
                format!(
                    "reward service {url}: connection failed{tries}: {message} (each attempt \
                     may take {timeout:?})"
                )
            }
            Failure::Status(status, body) => {
                self.status.fetch_add(1, Ordering::Relaxed);
                format!("reward service {url} answered {status}{tries}: {body:?}")
            }
            Failure::Unreadable(message) => {
                self.unreadable.fetch_add(1, Ordering::Relaxed);
                format!("reward service {url}: {message}")
            }
        }
    }
}

impl AsyncReward for HttpReward {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { inner.call(&group).await })
    }
}
