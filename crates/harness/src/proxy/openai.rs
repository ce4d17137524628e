//! The OpenAI wire format the proxy speaks: requests as agents send them, messages made
//! comparable, answers and SSE chunks as OpenAI clients read them, errors in OpenAI's shape.

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use rollout_core::{Message, ParsedCall};
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// `POST /v1/chat/completions`. Fields the proxy does not read (`temperature`, `top_p`,
/// `tool_choice`, `user`, ...) are accepted and ignored, as OpenAI servers ignore unknown
/// ones: the run's sampling settings are the policy's.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    pub(crate) messages: Vec<Value>,
    #[serde(default)]
    pub(crate) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(crate) max_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) stream: bool,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(crate) n: Option<u32>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: bool,
}

/// `POST /v1/completions`: a prompt as text or token ids.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub(crate) prompt: Value,
    #[serde(default)]
    pub(crate) max_tokens: Option<u32>,
    #[serde(default)]
    pub(crate) stream: bool,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(crate) n: Option<u32>,
}

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    /// A request the proxy cannot serve as asked (400).
    pub(crate) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
        }
    }

    /// No key, or a key of no rollout running here (401).
    pub(crate) fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: "no rollout of this proxy has this API key".to_owned(),
            param: None,
        }
    }

    /// The rollout could not sample the turn (500).
    pub(crate) fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": null,
            }
        });
        (self.status, axum::Json(body)).into_response()
    }
}

/// `n` other than 1 is refused: a rollout is one conversation.
pub(crate) fn check_n(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::invalid(
            format!(
                "n = {n} is not supported: each rollout samples one choice; run more rollouts instead"
            ),
            Some("n"),
        )),
    }
}

/// A message as the chat template reads it, whatever way the agent wrote it: text content
/// parts joined into a string, `null` content as empty text, tool-call arguments given as
/// JSON text parsed into their value, keys set to `null` left out.
pub(crate) fn message(index: usize, value: Value) -> Result<Message, ApiError> {
    let Value::Object(map) = value else {
        return Err(ApiError::invalid(
            format!("messages[{index}] is not an object"),
            Some("messages"),
        ));
    };
    let mut normal = Map::new();
    for (key, value) in map {
        match (key.as_str(), value) {
            ("content", Value::Null) => {
                normal.insert(key, Value::String(String::new()));
            }
            ("content", Value::Array(parts)) => {
                normal.insert(key, Value::String(text_parts(index, parts)?));
            }
            ("tool_calls", Value::Array(calls)) => {
                normal.insert(
                    key,
                    Value::Array(calls.into_iter().map(tool_call).collect()),
                );
            }
            (_, Value::Null) => {}
            (_, value) => {
                normal.insert(key, value);
            }
        }
    }
    if !normal.contains_key("content") {
        normal.insert("content".to_owned(), Value::String(String::new()));
    }
    serde_json::from_value(Value::Object(normal))
        .map_err(|e| ApiError::invalid(format!("messages[{index}]: {e}"), Some("messages")))
}

/// Content parts: only text is supported.
fn text_parts(index: usize, parts: Vec<Value>) -> Result<String, ApiError> {
    let mut text = String::new();
    for part in parts {
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(piece))) => text.push_str(piece),
            (kind, _) => {
                return Err(ApiError::invalid(
                    format!(
                        "messages[{index}]: content parts of type {} are not supported, only text",
                        kind.unwrap_or("(none)")
                    ),
                    Some("messages"),
                ));
            }
        }
    }
    Ok(text)
}

/// A tool call with its arguments as a value (OpenAI sends them as JSON text).
fn tool_call(mut call: Value) -> Value {
    if let Some(arguments) = call.pointer_mut("/function/arguments")
        && let Value::String(text) = arguments
        && let Ok(parsed) = serde_json::from_str::<Value>(text)
    {
        *arguments = parsed;
    }
    call
}

/// Whether the agent's `sent` message is the proxy's own `produced` answer, as the agent
/// wrote it back: the same content (ends trimmed) and the same calls (names and argument
/// values; JSON formatting, key order and call ids aside). Reasoning the agent dropped does
/// not matter.
pub(crate) fn same_answer(sent: &Message, produced: &Message) -> bool {
    sent.role() == "assistant"
        && sent.content().unwrap_or_default().trim()
            == produced.content().unwrap_or_default().trim()
        && calls(sent) == calls(produced)
}

/// `(name, arguments)` of a message's tool calls.
fn calls(message: &Message) -> Vec<(&Value, &Value)> {
    message
        .as_map()
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|call| {
                    let function = call.get("function").unwrap_or(&Value::Null);
                    (
                        function.get("name").unwrap_or(&Value::Null),
                        function.get("arguments").unwrap_or(&Value::Null),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether two messages other than the proxy's answers say the same: role, content and the
/// call they answer.
pub(crate) fn same_message(sent: &Message, known: &Message) -> bool {
    let field = |m: &Message, key: &str| m.as_map().get(key).cloned();
    sent.role() == known.role()
        && sent.content().unwrap_or_default() == known.content().unwrap_or_default()
        && field(sent, "tool_call_id") == field(known, "tool_call_id")
        && calls(sent) == calls(known)
}

/// Why an answer ended, as OpenAI says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FinishReason {
    Stop,
    ToolCalls,
    Length,
}

impl FinishReason {
    fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Length => "length",
        }
    }
}

/// What one answer says: its text, reasoning and calls, why it ended, its token counts.
#[derive(Debug)]
pub(crate) struct Turn {
    pub(crate) content: String,
    pub(crate) reasoning: Option<String>,
    pub(crate) calls: Vec<ParsedCall>,
    pub(crate) finish: FinishReason,
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
}

impl Turn {
    /// The answer of an OpenAI server that hit a limit: nothing, cut by length.
    pub(crate) fn limited(prompt_tokens: usize) -> Turn {
        Turn {
            content: String::new(),
            reasoning: None,
            calls: Vec::new(),
            finish: FinishReason::Length,
            prompt_tokens,
            completion_tokens: 0,
        }
    }
}

/// An answer ready to be sent: a turn with the response's id, model and time.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) turn: Turn,
}

impl Answer {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.turn.prompt_tokens,
            "completion_tokens": self.turn.completion_tokens,
            "total_tokens": self.turn.prompt_tokens + self.turn.completion_tokens,
        })
    }

    /// Tool calls as OpenAI writes them: arguments as JSON text.
    fn wire_calls(&self) -> Vec<Value> {
        self.turn
            .calls
            .iter()
            .map(|call| {
                json!({
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments_text(&call.arguments)},
                })
            })
            .collect()
    }

    /// `chat.completion`.
    pub(crate) fn chat(&self) -> Response {
        let mut message = json!({"role": "assistant", "content": self.turn.content});
        if self.turn.content.is_empty() && !self.turn.calls.is_empty() {
            message["content"] = Value::Null;
        }
        if let Some(reasoning) = &self.turn.reasoning {
            message["reasoning_content"] = json!(reasoning);
        }
        if !self.turn.calls.is_empty() {
            message["tool_calls"] = Value::Array(self.wire_calls());
        }
        axum::Json(json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": self.turn.finish.as_str(),
            }],
            "usage": self.usage(),
        }))
        .into_response()
    }

    /// `chat.completion.chunk`s as server-sent events: the role, the reasoning, the content,
    /// each call (its id and name, then its arguments), the finish reason, the usage when
    /// asked for, and `[DONE]`.
    pub(crate) fn chat_stream(&self, include_usage: bool) -> Response {
        let chunk = |delta: Value, finish: Option<&str>| {
            json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        };
        let mut events = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
        if let Some(reasoning) = &self.turn.reasoning {
            events.push(chunk(json!({"reasoning_content": reasoning}), None));
        }
        if !self.turn.content.is_empty() {
            events.push(chunk(json!({"content": self.turn.content}), None));
        }
        for (index, call) in self.wire_calls().into_iter().enumerate() {
            let head = json!({
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            });
            events.push(chunk(json!({"tool_calls": [head]}), None));
            let arguments =
                json!({"index": index, "function": {"arguments": call["function"]["arguments"]}});
            events.push(chunk(json!({"tool_calls": [arguments]}), None));
        }
        events.push(chunk(json!({}), Some(self.turn.finish.as_str())));
        if include_usage {
            let mut usage = chunk(json!({}), None);
            usage["choices"] = json!([]);
            usage["usage"] = self.usage();
            events.push(usage);
        }
        sse(events)
    }

    /// `text_completion`.
    pub(crate) fn completion(&self) -> Response {
        axum::Json(json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": self.turn.content, "logprobs": null, "finish_reason": self.turn.finish.as_str()}],
            "usage": self.usage(),
        }))
        .into_response()
    }

    /// `text_completion` chunks as server-sent events.
    pub(crate) fn completion_stream(&self, include_usage: bool) -> Response {
        let chunk = |text: &str, finish: Option<&str>| {
            json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            })
        };
        let mut events = vec![
            chunk(&self.turn.content, None),
            chunk("", Some(self.turn.finish.as_str())),
        ];
        if include_usage {
            let mut usage = chunk("", None);
            usage["choices"] = json!([]);
            usage["usage"] = self.usage();
            events.push(usage);
        }
        sse(events)
    }
}

/// Arguments as OpenAI sends them: JSON text (a string the model wrote stays as written).
fn arguments_text(arguments: &Value) -> String {
    match arguments {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// A complete `text/event-stream` body: one `data:` event per chunk, then `[DONE]`.
fn sse(events: Vec<Value>) -> Response {
    let mut body = String::new();
    for event in events {
        body.push_str("data: ");
        body.push_str(&event.to_string());
        body.push_str("\n\n");
    }
    body.push_str("data: [DONE]\n\n");
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
