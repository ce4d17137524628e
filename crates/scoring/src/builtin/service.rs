//! What the rewards that call a service over HTTP share (`kind = "http"`, `kind = "judge"`):
//! the client, the concurrency bound, retries of what another attempt may mend, and the
//! counts of calls by outcome.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use backoff::Backoff;
use bytes::Bytes;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use tokio::sync::Semaphore;

use crate::reward::CallStats;

/// The highest ceiling of a pause between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Bytes read of a service's answer: more fails the call.
const MAX_ANSWER: usize = 16 * 1024 * 1024;

/// Where a reward's service is and how to call it.
#[derive(Clone)]
pub struct ServiceConfig {
    pub(crate) url: String,
    concurrency: usize,
    attempts: u32,
    request_timeout: Duration,
    base_backoff: Duration,
    api_key: Option<String>,
    roots_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("url", &self.url)
            .field("concurrency", &self.concurrency)
            .field("attempts", &self.attempts)
            .field("request_timeout", &self.request_timeout)
            .field("api_key", &self.api_key.as_ref().map(|_| "(hidden)"))
            .finish_non_exhaustive()
    }
}

impl ServiceConfig {
    /// The service at `url` (`http://` or `https://`, verified against the system's roots);
    /// at most 8 calls at once, 3 attempts, 60 s per attempt.
    pub fn new(url: impl Into<String>) -> ServiceConfig {
        ServiceConfig {
            url: url.into(),
            concurrency: 8,
            attempts: 3,
            request_timeout: Duration::from_secs(60),
            base_backoff: Duration::from_millis(100),
            api_key: None,
            roots_pem: None,
        }
    }

    /// The most calls in flight at once, over every group (at least 1); the others wait.
    pub fn concurrency(mut self, calls: usize) -> ServiceConfig {
        self.concurrency = calls.max(1);
        self
    }

    /// Attempts per call, the first included (at least 1). Only a connection that failed or
    /// broke, a timeout and a 5xx are tried again; a 4xx or an answer that cannot be read is
    /// not.
    pub fn attempts(mut self, attempts: u32) -> ServiceConfig {
        self.attempts = attempts.max(1);
        self
    }

    /// How long one attempt may take. The scorer's timeout of the reward bounds the whole
    /// group: the wait for a turn under the concurrency bound and the retries included.
    pub fn request_timeout(mut self, timeout: Duration) -> ServiceConfig {
        self.request_timeout = timeout;
        self
    }

    /// The most the pause after the first failed attempt may be; the ceiling doubles after
    /// each, up to 5 s, and each pause is drawn below it (default 100 ms).
    pub fn base_backoff(mut self, backoff: Duration) -> ServiceConfig {
        self.base_backoff = backoff;
        self
    }

    /// Sends `Authorization: Bearer KEY` with each request.
    pub fn api_key(mut self, key: impl Into<String>) -> ServiceConfig {
        self.api_key = Some(key.into());
        self
    }

    /// Trusts the PEM certificates in `pem` too, beside the system's roots (a service with a
    /// certificate of its own authority).
    pub fn root_certificates_pem(mut self, pem: impl Into<Vec<u8>>) -> ServiceConfig {
        self.roots_pem = Some(pem.into());
        self
    }
}

/// Why a reward's service cannot be called.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reward service URL '{url}': {reason}")]
pub struct ServiceError {
    url: String,
    reason: String,
}

/// Why one attempt failed.
pub(crate) enum Failure {
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

/// A service called under a bound, with retries, its calls counted by outcome.
pub(crate) struct Service {
    url: String,
    client: reqwest::Client,
    permits: Semaphore,
    attempts: u32,
    request_timeout: Duration,
    base_backoff: Duration,
    authorization: Option<HeaderValue>,
    calls: AtomicU64,
    retries: AtomicU64,
    cache_hits: AtomicU64,
    transport: AtomicU64,
    status: AtomicU64,
    unreadable: AtomicU64,
    last_failure: Mutex<Option<String>>,
}

impl Service {
    /// Fails on a URL that is not `http://` or `https://` with a host, a key that cannot be a
    /// header, or certificates that cannot be read.
    pub(crate) fn new(config: ServiceConfig) -> Result<Service, ServiceError> {
        let error = |reason: String| ServiceError {
            url: config.url.clone(),
            reason,
        };
        let url = reqwest::Url::parse(&config.url).map_err(|e| error(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(error(
                "expected http://HOST[:PORT]/PATH or https://...".to_owned(),
            ));
        }
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            .timeout(config.request_timeout);
        if let Some(pem) = &config.roots_pem {
            let roots = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| error(format!("the certificates cannot be read: {e}")))?;
            if roots.is_empty() {
                return Err(error("no PEM certificate in the roots given".to_owned()));
            }
            for root in roots {
                builder = builder.add_root_certificate(root);
            }
        }
        let client = builder
            .build()
            .map_err(|e| error(format!("the HTTP client cannot start: {e}")))?;
        let authorization = match &config.api_key {
            None => None,
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    error("the API key holds a character a header cannot".to_owned())
                })?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(Service {
            url: config.url,
            client,
            permits: Semaphore::new(config.concurrency),
            attempts: config.attempts,
            request_timeout: config.request_timeout,
            base_backoff: config.base_backoff,
            authorization,
            calls: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            transport: AtomicU64::new(0),
            status: AtomicU64::new(0),
            unreadable: AtomicU64::new(0),
            last_failure: Mutex::new(None),
        })
    }

    /// The URL it posts to.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// One call: posts `body` (JSON) and reads a success's answer with `read`, trying again
    /// after a transport failure or a 5xx, at most `attempts` times in all, under the
    /// concurrency bound. A call that fails is counted by cause and says what happened.
    pub(crate) async fn call<T>(
        &self,
        body: Bytes,
        read: impl Fn(&[u8]) -> Result<T, String>,
    ) -> Result<T, String> {
        // Held across the retries: the bound is on the service's load, not on attempts.
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| "the reward service's concurrency bound was closed".to_owned())?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut attempt = 0u32;
        loop {
            let failure = match self.attempt(body.clone()).await {
                Ok(answer) => match read(&answer) {
                    Ok(value) => return Ok(value),
                    Err(message) => Failure::Unreadable(message),
                },
                Err(failure) => failure,
            };
            attempt += 1;
            if !failure.is_retryable() || attempt >= self.attempts {
                return Err(self.give_up(failure, attempt));
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(self.backoff(attempt)).await;
        }
    }

    /// A pause drawn below a ceiling that doubles with each failed attempt (from the base, up
    /// to 5 s): calls that failed together do not come back together.
    fn backoff(&self, failed: u32) -> Duration {
        Backoff::new(self.base_backoff, MAX_BACKOFF).delay(failed.saturating_sub(1))
    }

    async fn attempt(&self, body: Bytes) -> Result<Vec<u8>, Failure> {
        let transport = |e: reqwest::Error| {
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            Failure::Transport(message)
        };
        let mut request = self
            .client
            .post(&self.url)
            .header(CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        let mut response = request.send().await.map_err(transport)?;
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
        if !status.is_success() {
            return Err(Failure::Status(status.as_u16(), head(&answer)));
        }
        Ok(answer)
    }

    /// Counts the failure that ends a call and says what it was.
    fn give_up(&self, failure: Failure, attempts: u32) -> String {
        let url = &self.url;
        let tries = if attempts == 1 {
            String::new()
        } else {
            format!(" (after {attempts} attempts)")
        };
        let (counter, message) = match failure {
            Failure::Transport(message) => {
                let timeout = self.request_timeout;
                (
                    &self.transport,
                    format!(
                        "{url}: connection failed{tries}: {message} (each attempt may take \
                         {timeout:?})"
                    ),
                )
            }
            Failure::Status(status, body) => (
                &self.status,
                format!("{url} answered {status}{tries}: {body:?}"),
            ),
            Failure::Unreadable(message) => (&self.unreadable, format!("{url}: {message}")),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.clone());
        message
    }

    /// Counts an answer taken from a cache instead of a call.
    pub(crate) fn count_cache_hit(&self) {
        self.cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub(crate) fn stats(&self) -> CallStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CallStats {
            calls: get(&self.calls),
            retries: get(&self.retries),
            cache_hits: get(&self.cache_hits),
            transport: get(&self.transport),
            status: get(&self.status),
            unreadable: get(&self.unreadable),
            last_failure: self
                .last_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// The start of an answer, for a message.
pub(crate) fn head(answer: &[u8]) -> String {
    String::from_utf8_lossy(&answer[..answer.len().min(200)]).into_owned()
}
