//! The wire types: what RL sends to vLLM and reads back, field for field.
//!
//! Requests are typed structs, never free-form maps: vLLM silently ignores fields it does not
//! know, so a misspelt name would change sampling without a word. Responses tolerate fields
//! they do not name (vLLM adds fields between versions).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A completion prompt: token ids (what RL sends: the renderer already built them) or text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Token ids, sent as a JSON array of integers.
    Tokens(Vec<u32>),
    /// Text, tokenized by the server.
    Text(String),
}

/// Sampling parameters shared by completions and chat completions. Unset fields keep vLLM's
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k sampling (`-1` disables it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    /// Min-p sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Repetition penalty (1.0 disables it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Presence penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// The request's seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Strings that end generation.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub stop: Vec<String>,
    /// Token ids that end generation.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub stop_token_ids: Vec<u32>,
    /// Generate at least this many tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<u32>,
    /// Keep generating past the EOS token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
}

/// Constrained decoding, as vLLM 0.32 reads it under `structured_outputs`
/// (`guided_regex` and friends are silently ignored there).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutputs {
    /// The output matches a regular expression.
    Regex(String),
    /// The output is JSON valid against a schema.
    Json(Value),
    /// The output follows a grammar (EBNF / Lark, as the backend accepts).
    Grammar(String),
    /// The output is one of these strings.
    Choice(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The served model's name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Choices to return; RL sends one request per rollout, so 1.
    pub n: u32,
    /// Sampling parameters.
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Logprobs of the sampled tokens (and this many alternatives): `Some(0)` for RL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Logprobs of the prompt tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<u32>,
    /// Return the sampled token ids (`choices[].token_ids`) and the prompt's.
    pub return_token_ids: bool,
    /// Spell logprob tokens as `token_id:N`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_tokens_as_token_ids: Option<bool>,
    /// Whether the server adds special tokens to the prompt; `false` for token prompts the
    /// renderer built (vLLM defaults it to true for completions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
    /// Echo the prompt back in the text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// Constrained decoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
    /// With a server started with `--enable-return-routed-experts`: report the routed
    /// experts of the positions from this one of the prompt on (vLLM 0.32's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts_prompt_start: Option<usize>,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS token or a stop string/token.
    Stop,
    /// `max_tokens` or the context ran out.
    Length,
    /// The request was aborted (e.g. `/pause?mode=abort`); the ids so far are a partial turn.
    Abort,
    /// The model called tools (chat).
    ToolCalls,
    /// Any other reason a newer server gives.
    #[serde(other)]
    Other,
}

/// Logprobs of a completion choice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// The tokens as text (or `token_id:N`).
    #[serde(default)]
    pub tokens: Vec<String>,
    /// The logprob of each sampled token; `-inf` arrives clamped to `-9999.0`.
    #[serde(default)]
    pub token_logprobs: Vec<Option<f64>>,
    /// Character offsets of the tokens in the text.
    #[serde(default)]
    pub text_offset: Vec<u32>,
}

/// One choice of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// The choice's index.
    #[serde(default)]
    pub index: u32,
    /// The generated text.
    #[serde(default)]
    pub text: String,
    /// The sampled token ids (with `return_token_ids`).
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's token ids (with `return_token_ids`).
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Logprobs (with `logprobs`).
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Why generation stopped.
    pub finish_reason: Option<FinishReason>,
    /// The stop string or token id that ended generation, if one did.
    #[serde(default)]
    pub stop_reason: Option<Value>,
    /// With `--enable-return-routed-experts`: base64 of a `.npy` array of the routed experts
    /// ([`RoutedExperts::from_base64_npy`](crate::RoutedExperts::from_base64_npy)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u32,
    /// Both.
    #[serde(default)]
    pub total_tokens: u32,
}

/// The response of `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// The request id.
    #[serde(default)]
    pub id: String,
    /// The model.
    #[serde(default)]
    pub model: String,
    /// The choices.
    pub choices: Vec<CompletionChoice>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// `POST /v1/chat/completions`. Messages and tools are chat-format JSON (their content varies
/// by model); the request's own fields are typed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The served model's name.
    pub model: String,
    /// The conversation, OpenAI chat format.
    pub messages: Vec<Value>,
    /// Tool schemas (`{"type": "function", "function": {...}}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or a named function.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// Most tokens to generate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Choices to return.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// Sampling parameters.
    #[serde(flatten)]
    pub sampling: SamplingParams,
    /// Return logprobs of the sampled tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// Alternatives per position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    /// Return `choices[].token_ids` and the top-level `prompt_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
    /// Spell logprob tokens as `token_id:N`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_tokens_as_token_ids: Option<bool>,
    /// Extra keyword arguments for the chat template (e.g. `enable_thinking`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<Value>,
    /// Constrained decoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
}

/// A chat message as the server returns it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `assistant`.
    #[serde(default)]
    pub role: String,
    /// The text, if any.
    #[serde(default)]
    pub content: Option<String>,
    /// Parsed tool calls, if the server's tool parser found any.
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// Reasoning text, with a reasoning parser.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// One sampled token's logprob in a chat response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// The token as text, or `token_id:N`.
    pub token: String,
    /// Its logprob.
    pub logprob: f64,
    /// Its UTF-8 bytes.
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
}

/// Chat logprobs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// One entry per sampled token.
    #[serde(default)]
    pub content: Option<Vec<ChatTokenLogprob>>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// The choice's index.
    #[serde(default)]
    pub index: u32,
    /// The message.
    pub message: ChatMessage,
    /// Logprobs.
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    /// Why generation stopped.
    pub finish_reason: Option<FinishReason>,
    /// The stop string or token id, if one ended generation.
    #[serde(default)]
    pub stop_reason: Option<Value>,
    /// The sampled token ids (with `return_token_ids`).
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
}

/// The response of `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// The request id.
    #[serde(default)]
    pub id: String,
    /// The model.
    #[serde(default)]
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// The prompt's token ids (with `return_token_ids`).
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Token counts.
    #[serde(default)]
    pub usage: Option<Usage>,
}

/// `POST /tokenize` with a text prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeRequest {
    /// The served model's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The text.
    pub prompt: String,
    /// Whether to add special tokens (BOS).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_special_tokens: Option<bool>,
}

/// The response of `POST /tokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    /// How many tokens.
    #[serde(default)]
    pub count: u32,
    /// The context length.
    #[serde(default)]
    pub max_model_len: u32,
    /// The ids.
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeRequest {
    /// The served model's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The ids.
    pub tokens: Vec<u32>,
}

/// The response of `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    /// The text.
    pub prompt: String,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name, as requests give it.
    pub id: String,
    /// Its context length.
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// The model it was loaded from.
    #[serde(default)]
    pub root: Option<String>,
}

/// The response of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// The models.
    pub data: Vec<ModelCard>,
}

/// How `/pause` treats requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Freeze them; they complete normally after `/resume`.
    Keep,
    /// End them now with `finish_reason: "abort"` and their partial ids (vLLM's default).
    Abort,
    /// Let them finish, take no new ones.
    Wait,
}

impl PauseMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PauseMode::Keep => "keep",
            PauseMode::Abort => "abort",
            PauseMode::Wait => "wait",
        }
    }
}

/// vLLM's error body: `{"error": {"message", "type", "param", "code"}}`, or the older flat
/// `{"object": "error", "message", ...}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerError {
    /// What went wrong, in vLLM's words.
    #[serde(default)]
    pub message: String,
    /// The error type, e.g. `BadRequestError`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The offending parameter, e.g. `input_tokens`.
    #[serde(default)]
    pub param: Option<String>,
}

impl ServerError {
    /// Reads either shape; `None` when the body is neither.
    pub(crate) fn parse(body: &[u8]) -> Option<ServerError> {
        #[derive(Deserialize)]
        struct Nested {
            error: ServerError,
        }
        if let Ok(nested) = serde_json::from_slice::<Nested>(body) {
            return Some(nested.error);
        }
        serde_json::from_slice::<ServerError>(body)
            .ok()
            .filter(|flat| !flat.message.is_empty())
    }
}
