//! The recording proxy: an OpenAI-compatible server on 127.0.0.1 that loop-owning agents
//! talk to as if it were "an OpenAI server", while every turn is sampled token-in/token-out
//! by the engine.
//!
//! One listener serves every rollout; each rollout has a key of its own
//! ([`Proxy::session`]), sent by its agent as `Authorization: Bearer KEY`, and a request with
//! no key or a key of no running rollout is refused with 401, so rollouts never mix. It
//! serves `POST /v1/chat/completions` (`stream` false or true: SSE chunks with tool-call
//! deltas, `usage` with `stream_options.include_usage`, `[DONE]`), `POST /v1/completions` and
//! `GET /v1/models`; unknown request fields are ignored and `n > 1` is a 400, as OpenAI does.
//!
//! A chat request is not forwarded as chat: its messages and tools are rendered with the
//! model's own chat template (rollout-core's renderer), the ids are sampled through the
//! rollout's [`Sampler`] (the engine: limits, model versions, the reconciler), the answer is
//! decoded, its tool calls parsed with the engine's parser, and answered in OpenAI's shape.
//! How a request's history maps onto what was sampled is the `capture` module's job. A turn
//! past a rollout limit (`max_turns`, `max_total_tokens`, the context) is answered as an
//! OpenAI server that hit one: no content, `finish_reason: "length"`.
//!
//! The sampling fields of a request (`temperature`, `top_p`, ...) are accepted and ignored:
//! the run's sampling settings are the policy's, which the trainer's log-probs must match.
//!
//! What the agent sends is untrusted. A request the proxy refuses (no or a wrong key, a bad
//! body, `n > 1`, a rollout limit) keeps nothing in the rollout's capture; a rollout holds at
//! most [`ProxyConfig::max_conversations`] conversations (a request starting one more is a
//! 400); token ids in a `/v1/completions` prompt must be in the model's vocabulary (else a
//! 400). Keys come from the operating system's random source, and the proxy does not start
//! (nor a session open) without one.

mod capture;
mod openai;

use std::{
    collections::HashMap,
    fmt,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use rollout_api::Sampler;
use rollout_core::{
    ChatTokenizer, Message, RenderOptions,
    parse::{HermesParser, detect_parser},
};
use serde_json::{Value, json};
use tokio::{net::TcpListener, task::JoinHandle};

pub use self::capture::CaptureStats;
use self::{
    capture::{Capture, Model},
    openai::{Answer, ApiError, ChatRequest, CompletionRequest, Turn, check_n},
};
use crate::lock;

/// What the proxy serves as.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProxyConfig {
    /// The model name `/v1/models` lists and answers carry.
    pub model: String,
    /// Render options of the run (chat template name, template kwargs such as
    /// `enable_thinking`); the tools come from each request.
    pub options: RenderOptions,
    /// The most conversations (distinct histories: forks, side requests) one rollout keeps;
    /// a request that would start one more is refused with a 400 (default
    /// [`ProxyConfig::DEFAULT_MAX_CONVERSATIONS`]).
    pub max_conversations: usize,
}

impl ProxyConfig {
    /// The default of [`ProxyConfig::max_conversations`]: 64, well above what agents hold (a
    /// main conversation, a few side requests such as a title, summaries after compaction).
    pub const DEFAULT_MAX_CONVERSATIONS: usize = 64;

    /// A proxy serving as `model`.
    pub fn new(model: impl Into<String>) -> ProxyConfig {
        ProxyConfig {
            model: model.into(),
            options: RenderOptions::generation(),
            max_conversations: ProxyConfig::DEFAULT_MAX_CONVERSATIONS,
        }
    }

    /// Sets the most conversations one rollout keeps.
    #[must_use]
    pub fn max_conversations(mut self, max: usize) -> ProxyConfig {
        self.max_conversations = max;
        self
    }

    /// Sets the render options.
    #[must_use]
    pub fn options(mut self, options: RenderOptions) -> ProxyConfig {
        self.options = options;
        self
    }
}

/// The captures of the rollouts running, by key.
type Captures = Mutex<HashMap<String, Arc<tokio::sync::Mutex<Capture>>>>;

struct Inner {
    model: Model,
    captures: Captures,
    max_conversations: usize,
}

/// The proxy: one listener on 127.0.0.1 for every rollout. Dropping it stops the server.
pub struct Proxy {
    inner: Arc<Inner>,
    addr: SocketAddr,
    server: JoinHandle<()>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("model", &self.inner.model.name)
            .finish_non_exhaustive()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Proxy {
    /// Starts the proxy on a free port of 127.0.0.1, rendering with `tokenizer`'s chat
    /// template and parsing with the parser its template suggests (else hermes).
    ///
    /// # Errors
    /// When the template cannot be loaded, no port can be bound or the operating system has
    /// no random source for the keys.
    pub async fn start(tokenizer: ChatTokenizer, config: ProxyConfig) -> Result<Proxy, ProxyError> {
        // A proxy that could not make a key for its first rollout must not start.
        new_key()?;
        let template = tokenizer
            .template(&config.options)
            .map_err(|e| ProxyError(format!("the chat template: {}", e.chain())))?;
        let parser = detect_parser(template.source()).unwrap_or_else(|| Box::new(HermesParser));
        let vocab_size = u32::try_from(tokenizer.tokenizer().get_vocab_size(true))
            .map_err(|_| ProxyError("the tokenizer's vocabulary is over 2^32 ids".to_owned()))?;
        let model = Model {
            name: config.model,
            vocab_size,
            tokenizer,
            options: config.options,
            parser,
        };
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| ProxyError(format!("cannot listen on 127.0.0.1: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ProxyError(format!("cannot read the proxy's address: {e}")))?;
        let inner = Arc::new(Inner {
            model,
            captures: Mutex::new(HashMap::new()),
            max_conversations: config.max_conversations,
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .with_state(Arc::clone(&inner));
        let server = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(%error, "the agent proxy stopped");
            }
        });
        Ok(Proxy {
            inner,
            addr,
            server,
        })
    }

    /// Where the proxy listens (on 127.0.0.1).
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The base URL agents are given: `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// A rollout's session: a key of its own, its turns sampled with `sampler`.
    ///
    /// # Errors
    /// When the operating system's random source fails (no key is made any other way).
    pub fn try_session(&self, sampler: Sampler) -> Result<ProxySession, ProxyError> {
        let key = new_key()?;
        let capture = Arc::new(tokio::sync::Mutex::new(Capture::new(
            sampler,
            self.inner.max_conversations,
        )));
        lock(&self.inner.captures).insert(key.clone(), Arc::clone(&capture));
        Ok(ProxySession {
            key,
            base_url: self.base_url(),
            capture,
            inner: Arc::clone(&self.inner),
        })
    }

    /// [`Proxy::try_session`] for callers that cannot handle its error.
    ///
    /// # Panics
    /// When the operating system's random source fails, which [`Proxy::start`] checked
    /// worked: a rollout is never given a key that is not random.
    pub fn session(&self, sampler: Sampler) -> ProxySession {
        match self.try_session(sampler) {
            Ok(session) => session,
            Err(error) => panic!("{error}"),
        }
    }
}

/// The proxy could not start.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the agent proxy: {0}")]
pub struct ProxyError(String);

/// One rollout's access to the proxy. Dropping it (or [`ProxySession::finish`]) revokes the
/// key: later requests with it are refused.
pub struct ProxySession {
    key: String,
    base_url: String,
    capture: Arc<tokio::sync::Mutex<Capture>>,
    inner: Arc<Inner>,
}

impl fmt::Debug for ProxySession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxySession")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

impl Drop for ProxySession {
    fn drop(&mut self) {
        lock(&self.inner.captures).remove(&self.key);
    }
}

/// What a rollout's agent said and was answered, at the end.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Transcript {
    /// What the agent sent first in its main conversation, before the first answer.
    pub prompt: Vec<Message>,
    /// The rest of it: every answer (the last one's tool calls included) and what followed.
    pub completion: Vec<Message>,
    /// What the capture counted.
    pub stats: CaptureStats,
    /// The main conversation (the one with the most answers, the latest of equals: the
    /// prompt and completion above), as [`Sampler::sample_in`](rollout_api::Sampler::sample_in)
    /// numbered it; `None` when no request was answered.
    pub main_conversation: Option<usize>,
}

impl ProxySession {
    /// The API key the agent sends (`OPENAI_API_KEY`).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The base URL the agent talks to (`OPENAI_BASE_URL`).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Revokes the key and returns the transcript (waiting for a request in progress).
    pub async fn finish(self) -> Transcript {
        lock(&self.inner.captures).remove(&self.key);
        let capture = self.capture.lock().await;
        let (prompt, completion) = capture.transcript();
        Transcript {
            prompt,
            completion,
            stats: capture.stats,
            main_conversation: capture.main(),
        }
    }
}

/// 32 hex digits from the operating system's random source.
fn new_key() -> Result<String, ProxyError> {
    key_from(getrandom::fill)
}

/// A key of 32 hex digits from `fill`; its failure is the key's (a key another rollout could
/// guess would let agents read and steer each other's turns).
fn key_from(
    fill: impl FnOnce(&mut [u8]) -> Result<(), getrandom::Error>,
) -> Result<String, ProxyError> {
    let mut bytes = [0u8; 16];
    fill(&mut bytes).map_err(|e| {
        ProxyError(format!(
            "cannot make a rollout key: the operating system's random source failed ({e})"
        ))
    })?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sk-rollout-{hex}"))
}

/// The capture of the rollout whose key the request carries.
fn capture_for(
    inner: &Inner,
    headers: &HeaderMap,
) -> Result<Arc<tokio::sync::Mutex<Capture>>, ApiError> {
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or_else(ApiError::unauthorized)?;
    lock(&inner.captures)
        .get(key)
        .cloned()
        .ok_or_else(ApiError::unauthorized)
}

/// A JSON body, or OpenAI's 400 saying what is wrong with it.
fn body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body: {e}"), None))
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn answer(model: &Model, kind: &str, requests: u64, turn: Turn) -> Answer {
    Answer {
        id: format!("{kind}-{requests}"),
        model: model.name.clone(),
        created: created(),
        turn,
    }
}

async fn chat(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    raw: axum::body::Bytes,
) -> Response {
    match chat_answer(&inner, &headers, &raw).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn chat_answer(inner: &Inner, headers: &HeaderMap, raw: &[u8]) -> Result<Response, ApiError> {
    let capture = capture_for(inner, headers)?;
    let request: ChatRequest = body(raw)?;
    check_n(request.n)?;
    let messages = request
        .messages
        .into_iter()
        .enumerate()
        .map(|(index, message)| openai::message(index, message))
        .collect::<Result<Vec<Message>, ApiError>>()?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages is empty", Some("messages")));
    }
    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    let model = &inner.model;
    let mut capture = capture.lock().await;
    let prompt = capture.prompt(model, messages, request.tools)?;
    let turn = capture.answer(model, prompt, max_tokens).await?;
    let answer = answer(model, "chatcmpl", capture.stats.requests, turn);
    Ok(if request.stream {
        let usage = request.stream_options.is_some_and(|o| o.include_usage);
        answer.chat_stream(usage)
    } else {
        answer.chat()
    })
}

async fn completions(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    raw: axum::body::Bytes,
) -> Response {
    match completion_answer(&inner, &headers, &raw).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn completion_answer(
    inner: &Inner,
    headers: &HeaderMap,
    raw: &[u8],
) -> Result<Response, ApiError> {
    let capture = capture_for(inner, headers)?;
    let request: CompletionRequest = body(raw)?;
    check_n(request.n)?;
    let model = &inner.model;
    let ids = prompt_ids(model, request.prompt)?;
    let mut capture = capture.lock().await;
    let turn = capture.complete(model, ids, request.max_tokens).await?;
    let answer = answer(model, "cmpl", capture.stats.requests, turn);
    Ok(if request.stream {
        let usage = request.stream_options.is_some_and(|o| o.include_usage);
        answer.completion_stream(usage)
    } else {
        answer.completion()
    })
}

/// A completion prompt's ids: text tokenized as vLLM does (special tokens added), or ids,
/// each an integer below the vocabulary's size.
fn prompt_ids(model: &Model, prompt: Value) -> Result<Vec<u32>, ApiError> {
    let one = |value: Value| -> Result<Vec<u32>, ApiError> {
        match value {
            Value::String(text) => model
                .tokenizer
                .tokenizer()
                .encode(text, true)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| {
                    ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt"))
                }),
            Value::Array(ids) if ids.iter().all(Value::is_number) => token_ids(model, &ids),
            _ => Err(ApiError::invalid(
                "prompt must be a string or a list of token ids",
                Some("prompt"),
            )),
        }
    };
    match prompt {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => {
            one(items.into_iter().next().unwrap_or_default())
        }
        Value::Array(items) if items.iter().any(|item| !item.is_number()) => {
            Err(ApiError::invalid(
                "one prompt per request: each rollout samples one choice",
                Some("prompt"),
            ))
        }
        other => one(other),
    }
}

/// Token ids as the model knows them: integers from 0 to below its vocabulary's size, never
/// wrapped into range.
fn token_ids(model: &Model, ids: &[Value]) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .enumerate()
        .map(|(index, value)| {
            value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|&id| id < model.vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!(
                            "prompt[{index}] = {value} is not a token id of this model: ids are \
                             integers from 0 to {} (its vocabulary's size minus one)",
                            model.vocab_size.saturating_sub(1)
                        ),
                        Some("prompt"),
                    )
                })
        })
        .collect()
}

async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    if let Err(error) = capture_for(&inner, &headers) {
        return error.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{"id": inner.model.name, "object": "model", "created": 0, "owned_by": "async-grpo"}],
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_random_source_is_an_error_not_a_weaker_key() {
        let error = key_from(|_| Err(getrandom::Error::UNSUPPORTED))
            .expect_err("no key without randomness");
        assert!(
            error.to_string().contains("random source failed"),
            "{error}"
        );
        let key = key_from(|bytes| {
            bytes.fill(0xab);
            Ok(())
        })
        .expect("a key");
        assert_eq!(key, format!("sk-rollout-{}", "ab".repeat(16)));
    }
}
