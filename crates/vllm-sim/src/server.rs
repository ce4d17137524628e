//! The simulator's HTTP handlers and its scripted policy.

use std::time::Instant;

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::{Query, State as Extract},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{CallFormat, Counters, Pause, SimConfig, pause_channel};
use vllm_client::types::{
    ChatRequest, CompletionRequest, DetokenizeRequest, Prompt, TokenizeRequest,
};

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

use crate::lock;

/// Words the final answers are made of (and the test tokenizer is trained on).
pub(super) const WORDS: &[&str] = &[
    "the", "answer", "is", "simple", "model", "thinks", "about", "numbers", "and", "tools",
    "result", "value", "step", "check", "then", "so", "we", "get", "first", "next", "finally",
    "because", "sum", "product", "The",
];

pub(crate) struct State {
    config: SimConfig,
    pub(super) counters: Counters,
    pause: watch::Sender<Pause>,
    sequence: AtomicU64,
    eos: Option<u32>,
    /// The ids of `" word"` for each of [`WORDS`], encoded once.
    words: Vec<Vec<u32>>,
    /// The ids of `"The answer is N."` for N in 0..100, encoded once.
    openings: Vec<Vec<u32>>,
    /// The ids of the preamble every answer starts with, encoded once.
    preamble: Vec<u32>,
    /// Every token's text, decoded once (logprob `tokens` need one per sampled id).
    token_texts: Vec<String>,
    /// Completions answered, when the config says to record them.
    pub(super) transcript: Mutex<Vec<super::Exchange>>,
    /// The version of the weights loaded ([`Simulator::set_weights`](super::Simulator::set_weights)).
    pub(super) weights: AtomicU64,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl State {
    pub(super) fn new(config: SimConfig) -> State {
        let tokenizer = &config.tokenizer;
        let encode = |text: &str| {
            tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        };
        let words = WORDS.iter().map(|w| encode(&format!(" {w}"))).collect();
        let openings = (0..100)
            .map(|n| encode(&format!("The answer is {n}.")))
            .collect();
        let preamble = encode(&config.preamble);
        let vocab = u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX);
        let token_texts = (0..vocab)
            .map(|id| tokenizer.decode(&[id], false).unwrap_or_default())
            .collect();
        State {
            eos: tokenizer.token_to_id(&config.eos_token),
            words,
            openings,
            preamble,
            token_texts,
            config,
            counters: Counters::default(),
            transcript: Mutex::new(Vec::new()),
            pause: pause_channel().0,
            sequence: AtomicU64::new(0),
            weights: AtomicU64::new(0),
        }
    }

    fn count(&self) -> u64 {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        self.config
            .tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.config.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// A token as logprobs spell it: `token_id:N`, or its text (decoded once at start).
    fn token_text(&self, id: u32, as_ids: bool) -> std::borrow::Cow<'_, str> {
        match self.token_texts.get(id as usize) {
            Some(text) if !as_ids => std::borrow::Cow::Borrowed(text.as_str()),
            _ if as_ids => std::borrow::Cow::Owned(format!("token_id:{id}")),
            _ => std::borrow::Cow::Owned(self.decode(&[id])),
        }
    }

    /// The scripted answer: a tool call when `calling`, else a final answer of
    /// `answer_tokens` tokens; both end with EOS. The call's arguments are returned too.
    fn answer(&self, reading: &Reading<'_>, calling: bool, seed: u64) -> Answer {
        let mut arguments = None;
        let mut ids = if calling {
            let args = match &self.config.tool_arguments {
                Some(template) => {
                    scripted_arguments(template, reading.question, seed, self.config.correct_rate)
                }
                None => tool_arguments(reading.question, seed),
            };
            let call = tool_call_text(self.config.call_format, &self.config.tool_name, &args);
            let ids = if self.config.spell_calls {
                let mut ids = self.preamble.clone();
                ids.extend(self.spell(&call));
                ids
            } else {
                // The preamble and the call encoded together, as one text.
                let text = format!("{}{call}", self.config.preamble);
                self.encode(&text, false).unwrap_or_default()
            };
            arguments = Some(args);
            ids
        } else {
            // "The answer is N." then words, from ids encoded once: no per-request tokenizing
            // unless N is the tool's result outside 0..100.
            let mut rng = mix(seed);
            let correct = reading
                .tool_result
                .filter(|_| unit(mix(seed ^ CORRECT_DRAW)) < self.config.correct_rate);
            let mut ids = match correct {
                Some(number) => match number.parse::<usize>() {
                    Ok(n) if n < self.openings.len() => self.openings[n].clone(),
                    _ => self
                        .encode(&format!("The answer is {number}."), false)
                        .unwrap_or_default(),
                },
                None => self.openings[(rng % 100) as usize].clone(),
            };
            while ids.len() < self.config.answer_tokens {
                rng = mix(rng);
                ids.extend_from_slice(&self.words[(rng % WORDS.len() as u64) as usize]);
            }
            ids.truncate(self.config.answer_tokens);
            if self.preamble.is_empty() {
                ids
            } else {
                [self.preamble.as_slice(), &ids].concat()
            }
        };
        let text = self.decode(&ids);
        ids.extend(self.eos);
        Answer {
            text,
            ids,
            arguments,
        }
    }

    /// The ids of `text` with every ordinary token longer than a character spelled one
    /// character per token; added tokens (the special ones templates write) stay whole.
    fn spell(&self, text: &str) -> Vec<u32> {
        let tokenizer = &self.config.tokenizer;
        let Ok(encoding) = tokenizer.encode(text, false) else {
            return Vec::new();
        };
        let added = tokenizer.get_added_tokens_decoder();
        let mut ids = Vec::new();
        for (&id, &(start, end)) in encoding.get_ids().iter().zip(encoding.get_offsets()) {
            let piece = text.get(start..end).unwrap_or_default();
            if added.contains_key(&id) || piece.chars().count() < 2 {
                ids.push(id);
                continue;
            }
            let mut buffer = [0u8; 4];
            for c in piece.chars() {
                ids.extend(
                    self.encode(c.encode_utf8(&mut buffer), false)
                        .unwrap_or_default(),
                );
            }
        }
        ids
    }

    /// What the policy reads in a prompt's text: the tool calls made so far (counted by
    /// their signature in the call format, `{"name": TOOL, "arguments"` for hermes), the
    /// question asked before the first of them, and the last number after it (the tool's
    /// result).
    fn read<'a>(&self, text: &'a str) -> Reading<'a> {
        let signature = call_signature(self.config.call_format, &self.config.tool_name);
        let calls = text.matches(&signature).count();
        let before = text.find(&signature).map_or(text, |at| &text[..at]);
        // The last user turn of a ChatML prompt; the whole text when there is no such marker.
        let turn = before
            .rfind("<|im_start|>user")
            .map_or(before, |at| &before[at..]);
        let tool_result = (calls > 0)
            .then(|| text.rfind(&signature).map(|at| &text[at..]))
            .flatten()
            .and_then(last_number);
        Reading {
            calls,
            question: last_expression(turn),
            tool_result,
        }
    }

    /// Waits out latency and pause; `Some(k)` when `/pause?mode=abort` ended the request after
    /// `k` tokens.
    async fn generate(&self, tokens: usize) -> Option<usize> {
        let mut pause = self.pause.subscribe();
        self.hold(&mut pause).await;
        let aborts = pause.borrow().aborts;
        let started = Instant::now();
        let total =
            self.config.latency + self.config.per_token * u32::try_from(tokens).unwrap_or(u32::MAX);
        if total.is_zero() {
            // No latency to simulate: no timer to arm (it would cost a scheduler round trip).
            return None;
        }
        tokio::select! {
            () = tokio::time::sleep(total) => {}
            () = wait_abort(&mut pause, aborts) => {
                let generating = started.elapsed().saturating_sub(self.config.latency);
                let done = if self.config.per_token.is_zero() {
                    0
                } else {
                    (generating.as_nanos() / self.config.per_token.as_nanos()) as usize
                };
                self.counters.aborted_by_pause.fetch_add(1, Ordering::Relaxed);
                return Some(done.min(tokens));
            }
        }
        if pause.borrow().paused && pause.borrow().freeze {
            self.hold(&mut pause).await;
        }
        None
    }

    /// Waits until the server is not paused, counted in `held_by_pause` meanwhile.
    async fn hold(&self, pause: &mut watch::Receiver<Pause>) {
        if !pause.borrow().paused {
            return;
        }
        let held = &self.counters.held_by_pause;
        held.fetch_add(1, Ordering::Relaxed);
        // Also when the client goes away and the request is dropped while held.
        let _release = Released(held);
        wait_unpaused(pause).await;
    }

    /// The injected fault for request `sequence`, if any (slow responses sleep here).
    async fn fault(&self, sequence: u64) -> Option<Fault> {
        let faults = &self.config.faults;
        let draw = unit(mix(self.config.fault_seed ^ mix(sequence)));
        let mut edge = faults.error_503;
        if draw < edge {
            self.counters.injected_503.fetch_add(1, Ordering::Relaxed);
            return Some(Fault::Unavailable);
        }
        edge += faults.drop_connection;
        if draw < edge {
            self.counters.injected_drops.fetch_add(1, Ordering::Relaxed);
            return Some(Fault::Drop);
        }
        edge += faults.slow;
        if draw < edge {
            self.counters.injected_slow.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(faults.slow_delay).await;
            return None;
        }
        edge += faults.malformed;
        if draw < edge {
            self.counters
                .injected_malformed
                .fetch_add(1, Ordering::Relaxed);
            return Some(Fault::Malformed);
        }
        None
    }

    /// The context check vLLM 0.32 makes: a prompt over the limit or exactly filling it is a
    /// 400; otherwise `max_tokens` is clipped to the room left.
    fn room(&self, prompt_len: usize, max_tokens: u32) -> Result<u32, Box<Response>> {
        let limit = self.config.max_model_len as usize;
        if prompt_len > limit {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "This model's maximum context length is {limit} tokens. However, your prompt contains \
                     at least {prompt_len} input tokens, which exceeds this limit even without any output \
                     tokens. Please reduce the length of the input prompt. (parameter=input_tokens, \
                     value={prompt_len})"
                ),
                "BadRequestError",
                Some("input_tokens"),
            )));
        }
        let room = (limit - prompt_len) as u32;
        if room == 0 {
            return Err(Box::new(error(
                StatusCode::BAD_REQUEST,
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                "BadRequestError",
                Some("max_tokens"),
            )));
        }
        Ok(max_tokens.min(room))
    }

    fn logprob(seed: u64, position: usize, id: u32) -> f64 {
        let draw = mix(seed ^ mix(position as u64) ^ u64::from(id));
        -((draw % 5000) as f64 / 1000.0) - 0.001
    }
}

enum Fault {
    Unavailable,
    Drop,
    Malformed,
}

/// Counts a generation request as aborted by disconnect if it is dropped before answering.
struct Pending {
    state: Arc<State>,
    answered: bool,
}

impl Pending {
    fn new(state: &Arc<State>) -> Pending {
        Pending {
            state: Arc::clone(state),
            answered: false,
        }
    }

    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.answered {
            self.state
                .counters
                .aborted_by_disconnect
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub(super) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/get_world_size", get(world_size))
        .route("/reset_prefix_cache", post(acknowledge))
        .route("/reward", post(reward))
        .route("/judge/{format}/v1/chat/completions", post(judge))
        .route("/classify", post(classify))
        .route("/init_weight_transfer_engine", post(acknowledge))
        .route("/start_weight_update", post(acknowledge))
        .route("/update_weights", post(acknowledge))
        .route("/finish_weight_update", post(acknowledge))
        .route("/sim/weights", post(set_weights))
        .with_state(state)
}

type Shared = Extract<Arc<State>>;

async fn health(Extract(state): Shared) -> StatusCode {
    state.count();
    StatusCode::OK
}

async fn models(Extract(state): Shared) -> Json<Value> {
    state.count();
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "async-grpo-simulator",
            "root": state.config.model,
            "max_model_len": state.config.max_model_len,
        }]
    }))
}

async fn completions(Extract(state): Shared, body: Bytes) -> Response {
    let sequence = state.count();
    let pending = Pending::new(&state);
    let response = complete(&state, sequence, &body).await;
    state.counters.completions.fetch_add(1, Ordering::Relaxed);
    pending.answered();
    response
}

async fn complete(state: &State, sequence: u64, body: &[u8]) -> Response {
    let request: CompletionRequest =
        match admit(state, sequence, body, |r: &CompletionRequest| &r.model).await {
            Ok(request) => request,
            Err(response) => return *response,
        };
    let prompt = match prompt_ids(state, &request) {
        Ok(ids) => ids,
        Err(response) => return *response,
    };
    let max_tokens = match state.room(prompt.len(), request.max_tokens) {
        Ok(max_tokens) => max_tokens as usize,
        Err(response) => return *response,
    };
    if let Some(start) = request.routed_experts_prompt_start
        && start > prompt.len()
    {
        return error(
            StatusCode::BAD_REQUEST,
            &format!(
                "routed_experts_prompt_start must be between 0 and the prompt length ({}), \
                 inclusive. (parameter=routed_experts_prompt_start, value={start})",
                prompt.len()
            ),
            "BadRequestError",
            Some("routed_experts_prompt_start"),
        );
    }
    let weights = state.weights.load(Ordering::Acquire);
    // Other weights answer otherwise: the request's seed drawn anew for each version.
    let seed = match request.sampling.seed.unwrap_or(sequence) {
        seed if weights == 0 => seed,
        seed => mix(seed ^ mix(weights ^ WEIGHTS_DRAW)),
    };
    let (ids, finish) = sample(state, &prompt, max_tokens, seed).await;
    let weights_changed = state.weights.load(Ordering::Acquire) != weights;
    let routed_experts = state.config.routed_experts.map(|router| {
        routed_experts(
            router,
            &prompt,
            &ids,
            request.routed_experts_prompt_start.unwrap_or(0),
            weights,
        )
    });
    let as_ids = request.return_tokens_as_token_ids == Some(true);
    // Typed and borrowed: the simulator must cost little next to the client it measures.
    let tokens: Vec<std::borrow::Cow<'_, str>> =
        ids.iter().map(|id| state.token_text(*id, as_ids)).collect();
    let logprobs = request
        .logprobs
        .map(|_| completion_logprobs(&tokens, &ids, seed));
    if state.config.record {
        lock(&state.transcript).push(super::Exchange {
            prompt_ids: prompt.clone(),
            token_ids: ids.clone(),
            logprobs: ids
                .iter()
                .enumerate()
                .map(|(i, id)| State::logprob(seed, i, *id))
                .collect(),
            finish_reason: finish,
            weights,
            weights_changed,
        });
    }
    let with_ids = request.return_token_ids;
    let body = SimCompletion {
        id: format!("cmpl-sim-{sequence}"),
        object: "text_completion",
        created: 0,
        model: &state.config.model,
        choices: [SimChoice {
            index: 0,
            text: state.decode(&ids),
            logprobs,
            finish_reason: finish,
            stop_reason: None,
            token_ids: with_ids.then_some(&ids),
            prompt_token_ids: with_ids.then_some(&prompt),
            routed_experts,
        }],
        usage: SimUsage {
            prompt_tokens: prompt.len(),
            completion_tokens: ids.len(),
            total_tokens: prompt.len() + ids.len(),
        },
    };
    Json(body).into_response()
}

/// A completion's prompt as ids: given, or its text encoded (special tokens added unless the
/// request says not to); `Err` is the 400 for a text the tokenizer refuses.
fn prompt_ids(state: &State, request: &CompletionRequest) -> Result<Vec<u32>, Box<Response>> {
    match &request.prompt {
        Prompt::Tokens(ids) => Ok(ids.clone()),
        Prompt::Text(text) => state
            .encode(text, request.add_special_tokens.unwrap_or(true))
            .map_err(|e| {
                Box::new(error(
                    StatusCode::BAD_REQUEST,
                    &e,
                    "BadRequestError",
                    Some("prompt"),
                ))
            }),
    }
}

/// The policy's answer to `prompt`, cut at `max_tokens` and by a pause that aborts it, with
/// why it ended (`stop`, `length` or `abort`).
async fn sample(
    state: &State,
    prompt: &[u32],
    max_tokens: usize,
    seed: u64,
) -> (Vec<u32>, &'static str) {
    // Reading the prompt costs a decode: only when the script has tool rounds to play.
    let text = if state.config.tool_rounds == 0 {
        String::new()
    } else {
        state.decode(prompt)
    };
    let reading = state.read(&text);
    let calling = reading.calls < state.config.tool_rounds;
    let mut ids = state.answer(&reading, calling, seed).ids;
    let mut finish = "stop";
    if ids.len() > max_tokens {
        ids.truncate(max_tokens);
        finish = "length";
    }
    if let Some(done) = state.generate(ids.len()).await {
        ids.truncate(done);
        finish = "abort";
    }
    (ids, finish)
}

/// What a draw of other weights mixes into a request's seed.
const WEIGHTS_DRAW: u64 = 0x5745_4947_4854_5321;

/// vLLM's `routed_experts` of a choice: base64 of the `.npy` bytes of the experts `router`
/// chose at each position from `start` to the last but one of `prompt` then `ids`.
fn routed_experts(
    router: super::SimRouting,
    prompt: &[u32],
    ids: &[u32],
    start: usize,
    weights: u64,
) -> String {
    use base64::Engine as _;
    let positions = (prompt.len() + ids.len()).saturating_sub(1);
    let rows = positions.saturating_sub(start);
    let wide = router.experts > 256;
    let mut data =
        Vec::with_capacity(rows * router.layers * router.top_k * (1 + usize::from(wide)));
    for (position, &token) in prompt
        .iter()
        .chain(ids)
        .enumerate()
        .take(positions)
        .skip(start)
    {
        for layer in 0..router.layers {
            let mut chosen: Vec<usize> = Vec::with_capacity(router.top_k);
            let mut draw =
                mix(u64::from(token) ^ mix(position as u64 ^ mix(layer as u64 ^ mix(weights))));
            while chosen.len() < router.top_k.min(router.experts) {
                let expert = (draw % router.experts as u64) as usize;
                if !chosen.contains(&expert) {
                    chosen.push(expert);
                }
                draw = mix(draw);
            }
            for expert in chosen {
                if wide {
                    data.extend_from_slice(&(expert as u16).to_le_bytes());
                } else {
                    data.push(expert as u8);
                }
            }
        }
    }
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': ({rows}, {}, {}), }}",
        if wide { "<u2" } else { "|u1" },
        router.layers,
        router.top_k
    );
    // numpy pads the header with spaces and a newline to a multiple of 64 bytes.
    let padded = (10 + dict.len() + 1).div_ceil(64) * 64 - 10;
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(padded as u16).to_le_bytes());
    bytes.extend_from_slice(dict.as_bytes());
    bytes.resize(10 + padded - 1, b' ');
    bytes.push(b'\n');
    bytes.extend_from_slice(&data);
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The logprobs of sampled `ids` spelled as `tokens`: each one's logprob (drawn from `seed`)
/// and where its text starts in the completion.
fn completion_logprobs<'a>(
    tokens: &'a [std::borrow::Cow<'a, str>],
    ids: &[u32],
    seed: u64,
) -> SimLogprobs<'a> {
    let mut offset = 0u32;
    let text_offset = tokens
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.len() as u32;
            at
        })
        .collect();
    let token_logprobs = ids
        .iter()
        .enumerate()
        .map(|(i, id)| State::logprob(seed, i, *id))
        .collect();
    SimLogprobs {
        tokens,
        token_logprobs,
        text_offset,
        top_logprobs: None,
    }
}

#[derive(serde::Serialize)]
struct SimCompletion<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [SimChoice<'a>; 1],
    usage: SimUsage,
}

#[derive(serde::Serialize)]
struct SimChoice<'a> {
    index: u32,
    text: String,
    logprobs: Option<SimLogprobs<'a>>,
    finish_reason: &'static str,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    routed_experts: Option<String>,
}

#[derive(serde::Serialize)]
struct SimLogprobs<'a> {
    tokens: &'a [std::borrow::Cow<'a, str>],
    token_logprobs: Vec<f64>,
    text_offset: Vec<u32>,
    top_logprobs: Option<()>,
}

#[derive(serde::Serialize)]
struct SimUsage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

/// What every generation request goes through first: its body parsed, its model checked,
/// and a fault drawn; `Err` is the response to give instead.
async fn admit<T: serde::de::DeserializeOwned>(
    state: &State,
    sequence: u64,
    body: &[u8],
    model: impl Fn(&T) -> &str,
) -> Result<T, Box<Response>> {
    let request: T = serde_json::from_slice(body).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!("invalid request: {e}"),
            "BadRequestError",
            None,
        ))
    })?;
    if model(&request) != state.config.model {
        return Err(Box::new(unknown_model(model(&request))));
    }
    match state.fault(sequence).await {
        Some(Fault::Unavailable) => Err(Box::new(unavailable())),
        Some(Fault::Drop) => Err(Box::new(dropped())),
        Some(Fault::Malformed) => Err(Box::new(malformed(&state.config.model))),
        None => Ok(request),
    }
}

async fn chat(Extract(state): Shared, body: Bytes) -> Response {
    let sequence = state.count();
    let pending = Pending::new(&state);
    let response = chat_complete(&state, sequence, &body).await;
    state.counters.chats.fetch_add(1, Ordering::Relaxed);
    pending.answered();
    response
}

async fn chat_complete(state: &State, sequence: u64, body: &[u8]) -> Response {
    let request: ChatRequest = match admit(state, sequence, body, |r: &ChatRequest| &r.model).await
    {
        Ok(request) => request,
        Err(response) => return *response,
    };
    // A ChatML rendering: good enough for a simulator, which never claims template fidelity.
    let mut text = String::new();
    for message in &request.messages {
        let role = message["role"].as_str().unwrap_or("user");
        let content = message["content"].as_str().unwrap_or_default();
        text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    }
    text.push_str("<|im_start|>assistant\n");
    let prompt = match state.encode(&text, false) {
        Ok(ids) => ids,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e,
                "BadRequestError",
                Some("messages"),
            );
        }
    };
    let max_tokens = match state.room(prompt.len(), request.max_tokens.unwrap_or(u32::MAX)) {
        Ok(max_tokens) => max_tokens as usize,
        Err(response) => return *response,
    };
    let has_tools = request
        .tools
        .as_ref()
        .is_some_and(|tools| !tools.is_empty());
    let reading = if state.config.tool_rounds == 0 {
        Reading::default()
    } else {
        chat_reading(&request.messages)
    };
    let calling = has_tools && reading.calls < state.config.tool_rounds;
    let seed = request.sampling.seed.unwrap_or(sequence);
    let Answer {
        text: answer,
        mut ids,
        arguments,
    } = state.answer(&reading, calling, seed);
    let mut finish = if calling { "tool_calls" } else { "stop" };
    if ids.len() > max_tokens {
        ids.truncate(max_tokens);
        finish = "length";
    }
    if let Some(done) = state.generate(ids.len()).await {
        ids.truncate(done);
        finish = "abort";
    }
    let message = if let Some(arguments) = arguments.filter(|_| finish == "tool_calls") {
        json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": format!("call_sim_{sequence}"),
                "type": "function",
                "function": { "name": state.config.tool_name, "arguments": arguments.to_string() },
            }],
        })
    } else {
        json!({ "role": "assistant", "content": if finish == "stop" { answer } else { state.decode(&ids) } })
    };
    let as_ids = request.return_tokens_as_token_ids == Some(true);
    let logprobs = (request.logprobs == Some(true)).then(|| {
        json!({
            "content": ids.iter().enumerate().map(|(i, id)| json!({
                "token": state.token_text(*id, as_ids),
                "logprob": State::logprob(seed, i, *id),
                "bytes": state.decode(&[*id]).into_bytes(),
                "top_logprobs": [],
            })).collect::<Vec<_>>()
        })
    });
    let mut choice = json!({ "index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish, "stop_reason": null });
    let mut response = json!({
        "id": format!("chatcmpl-sim-{sequence}"),
        "object": "chat.completion",
        "created": 0,
        "model": state.config.model,
        "usage": { "prompt_tokens": prompt.len(), "completion_tokens": ids.len(), "total_tokens": prompt.len() + ids.len() },
    });
    if request.return_token_ids == Some(true) {
        choice["token_ids"] = json!(ids);
        response["prompt_token_ids"] = json!(prompt);
    }
    response["choices"] = json!([choice]);
    Json(response).into_response()
}

async fn tokenize(Extract(state): Shared, Json(request): Json<TokenizeRequest>) -> Response {
    state.count();
    match state.encode(&request.prompt, request.add_special_tokens.unwrap_or(true)) {
        Ok(tokens) => Json(json!({
            "count": tokens.len(),
            "max_model_len": state.config.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        }))
        .into_response(),
        Err(e) => error(
            StatusCode::BAD_REQUEST,
            &e,
            "BadRequestError",
            Some("prompt"),
        ),
    }
}

async fn detokenize(Extract(state): Shared, Json(request): Json<DetokenizeRequest>) -> Json<Value> {
    state.count();
    Json(json!({ "prompt": state.decode(&request.tokens) }))
}

#[derive(Deserialize)]
struct PauseQuery {
    mode: Option<String>,
}

async fn pause(Extract(state): Shared, Query(query): Query<PauseQuery>) -> Response {
    state.count();
    let mode = query.mode.unwrap_or_else(|| "abort".to_owned());
    if !["keep", "abort", "wait"].contains(&mode.as_str()) {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("unknown pause mode '{mode}'"),
            "BadRequestError",
            Some("mode"),
        );
    }
    state.pause.send_modify(|pause| {
        pause.paused = true;
        pause.freeze = mode == "keep";
        if mode == "abort" {
            pause.aborts += 1;
        }
    });
    Json(json!({ "status": "paused" })).into_response()
}

async fn resume(Extract(state): Shared) -> Json<Value> {
    state.count();
    state.pause.send_modify(|pause| {
        pause.paused = false;
        pause.freeze = false;
    });
    Json(json!({ "status": "resumed" }))
}

async fn is_paused(Extract(state): Shared) -> Json<Value> {
    state.count();
    Json(json!({ "is_paused": state.pause.borrow().paused }))
}

async fn world_size(Extract(state): Shared) -> Json<Value> {
    state.count();
    Json(json!({ "world_size": 1 }))
}

/// How `POST /reward` shapes its answer: `?shape=object` answers `{"scores": [...]}`,
/// `?shape=short` leaves the last score out (a service that miscounts); else a bare array.
#[derive(Deserialize)]
struct RewardQuery {
    shape: Option<String>,
}

/// `POST /reward`, the simulator as a reward service (no vLLM endpoint): it takes a group as
/// the `http` reward sends it and scores each completion 1.0 when its text contains the row's
/// `answer`, 0.0 when not, `null` when the row has no `answer`. It answers after `latency`,
/// with the faults drawn per request as generation's are.
async fn reward(Extract(state): Shared, Query(query): Query<RewardQuery>, body: Bytes) -> Response {
    let counters = &state.counters;
    let gauges = [&counters.rewards_in_flight, &counters.rewards_in_flight_max];
    let (group, _release) =
        match scoring_request(&state, &counters.rewards, gauges, &body, "group").await {
            Ok(admitted) => admitted,
            Err(response) => return *response,
        };
    let answer = match &group["row"]["answer"] {
        Value::Null => None,
        Value::String(text) => Some(text.clone()),
        other => Some(other.to_string()),
    };
    let score = |completion: &Value| match &answer {
        None => Value::Null,
        Some(answer) => {
            let text = completion["text"].as_str().unwrap_or_default();
            json!(if text.contains(answer.as_str()) {
                1.0
            } else {
                0.0
            })
        }
    };
    let mut scores: Vec<Value> = group["completions"]
        .as_array()
        .map(|completions| completions.iter().map(score).collect())
        .unwrap_or_default();
    match query.shape.as_deref() {
        Some("object") => Json(json!({ "scores": scores })).into_response(),
        Some("short") => {
            scores.pop();
            Json(Value::Array(scores)).into_response()
        }
        _ => Json(Value::Array(scores)).into_response(),
    }
}

/// What the scoring endpoints (`/reward`, `/judge/...`) do before they answer: count the
/// request in `count` and in the `[in flight, most in flight]` gauges (until the guard
/// returned is dropped), read the body as JSON (`what` names it in a 400), wait the
/// simulator's latency, and answer the fault drawn for the request, if any.
async fn scoring_request<'a>(
    state: &State,
    count: &AtomicU64,
    [in_flight, most]: [&'a AtomicU64; 2],
    body: &[u8],
    what: &str,
) -> Result<(Value, Released<'a>), Box<Response>> {
    let sequence = state.count();
    count.fetch_add(1, Ordering::Relaxed);
    most.fetch_max(
        in_flight.fetch_add(1, Ordering::Relaxed) + 1,
        Ordering::Relaxed,
    );
    let release = Released(in_flight);
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        let message = format!("invalid {what}: {e}");
        Box::new(error(
            StatusCode::BAD_REQUEST,
            &message,
            "BadRequestError",
            None,
        ))
    })?;
    tokio::time::sleep(state.config.latency).await;
    match state.fault(sequence).await {
        Some(Fault::Unavailable) => Err(Box::new(unavailable())),
        Some(Fault::Drop) => Err(Box::new(dropped())),
        Some(Fault::Malformed) => Err(Box::new(malformed(&state.config.model))),
        None => Ok((value, release)),
    }
}

/// `POST /judge/FORMAT/v1/chat/completions`, the simulator as an LLM judge (see the crate's
/// documentation): scores scripted from the completions the prompt holds.
async fn judge(
    Extract(state): Shared,
    axum::extract::Path(format): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let counters = &state.counters;
    if headers
        .get(axum::http::header::AUTHORIZATION)
        .is_some_and(|value| value == "Bearer sim-judge-key")
    {
        counters.judges_with_key.fetch_add(1, Ordering::Relaxed);
    }
    let gauges = [&counters.judges_in_flight, &counters.judges_in_flight_max];
    let (request, _release) =
        match scoring_request(&state, &counters.judges, gauges, &body, "chat request").await {
            Ok(admitted) => admitted,
            Err(response) => return *response,
        };
    let asked = request["messages"]
        .as_array()
        .and_then(|messages| {
            messages
                .iter()
                .rev()
                .find(|m| m["role"] == "user")
                .and_then(|m| m["content"].as_str())
        })
        .unwrap_or_default();
    let between = |text: &str, open: &str, close: &str| -> Vec<String> {
        let mut found = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(open) {
            let after = &rest[start + open.len()..];
            // `<completion id="2">`: the tag ends at its `>`.
            let Some(body) = after.find('>').map(|end| &after[end + 1..]) else {
                break;
            };
            let Some(end) = body.find(close) else { break };
            found.push(body[..end].trim().to_owned());
            rest = &body[end + close.len()..];
        }
        found
    };
    let reference = between(asked, "<answer", "</answer>")
        .pop()
        .unwrap_or_default();
    let verdicts: Vec<bool> = between(asked, "<completion", "</completion>")
        .iter()
        .map(|completion| !reference.is_empty() && completion.contains(&reference))
        .collect();
    let number = |right: bool| u8::from(right);
    let label = |right: bool| if right { "CORRECT" } else { "INCORRECT" };
    let content = match (format.as_str(), verdicts.as_slice()) {
        ("number", [one]) => format!(
            "<think>The reference has 1 answer; compare it with 2 eyes.</think>\nScore: {}",
            number(*one)
        ),
        // A draft in the thinking that a reader must skip.
        ("json", [one]) => format!(
            "<think>A draft: {{\"score\": 5}}</think>```json\n{{\"reason\": \"compared with \
             the reference\", \"score\": {}}}\n```",
            number(*one)
        ),
        ("labels", [one]) => format!("Verdict: {}", label(*one)),
        ("json" | "number", many) => {
            json!({ "scores": many.iter().map(|v| number(*v)).collect::<Vec<_>>() }).to_string()
        }
        ("labels", many) => {
            json!({ "scores": many.iter().map(|v| label(*v)).collect::<Vec<_>>() }).to_string()
        }
        ("short", many) => {
            let scores: Vec<u8> = many.iter().map(|v| number(*v)).collect();
            json!({ "scores": &scores[..scores.len().saturating_sub(1)] }).to_string()
        }
        ("garbage", _) => "I would rather not say.".to_owned(),
        // A right completion scores the raw text X (`1e308`, `NaN`: what no sane judge says).
        (scripted, many) if scripted.starts_with("value:") => {
            let value = &scripted["value:".len()..];
            let scores: Vec<&str> = many.iter().map(|&v| if v { value } else { "0" }).collect();
            match scores.as_slice() {
                [one] => format!("{{\"score\": {one}}}"),
                many => format!("{{\"scores\": [{}]}}", many.join(", ")),
            }
        }
        (other, _) => {
            let message = format!(
                "unknown judge format '{other}': number, json, labels, short, garbage or \
                     value:X"
            );
            return error(StatusCode::NOT_FOUND, &message, "NotFoundError", None);
        }
    };
    Json(json!({
        "id": format!("chatcmpl-judge-{}", counters.judges.load(Ordering::Relaxed)),
        "object": "chat.completion",
        "model": request["model"],
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content },
            "finish_reason": "stop",
        }],
    }))
    .into_response()
}

/// `POST /classify`, the simulator as a reward model on vLLM's pooling runner (see the
/// crate's documentation): one conversation in, one score out, shaped as vLLM answers it.
async fn classify(Extract(state): Shared, body: Bytes) -> Response {
    let counters = &state.counters;
    let gauges = [
        &counters.classifications_in_flight,
        &counters.classifications_in_flight_max,
    ];
    let (request, _release) = match scoring_request(
        &state,
        &counters.classifications,
        gauges,
        &body,
        "classification request",
    )
    .await
    {
        Ok(admitted) => admitted,
        Err(response) => return *response,
    };
    let model = request["model"].as_str().unwrap_or_default();
    if model != state.config.model {
        return unknown_model(model);
    }
    let messages = request["messages"].as_array().map(Vec::as_slice);
    let Some(last) = messages.and_then(<[Value]>::last) else {
        return error(
            StatusCode::BAD_REQUEST,
            "The decoder prompt cannot be empty",
            "BadRequestError",
            None,
        );
    };
    let chars = last["content"].as_str().unwrap_or_default().chars().count();
    let raw = messages.map_or(0, <[Value]>::len) as f64 + chars as f64 / 1000.0;
    let score = if request["use_activation"] == false {
        raw
    } else {
        1.0 / (1.0 + (-raw).exp())
    };
    Json(json!({
        "id": format!("classify-{}", counters.classifications.load(Ordering::Relaxed)),
        "object": "list",
        "model": model,
        "data": [{ "index": 0, "label": "LABEL_0", "probs": [score], "num_classes": 1 }],
    }))
    .into_response()
}

#[derive(serde::Deserialize)]
struct Weights {
    version: u64,
}

/// `POST /sim/weights {"version": N}`: the simulator's own weight update.
async fn set_weights(Extract(state): Shared, Json(body): Json<Weights>) -> Json<Value> {
    state.count();
    state.weights.store(body.version, Ordering::Release);
    Json(json!({ "version": body.version }))
}

async fn acknowledge(Extract(state): Shared) -> Json<Value> {
    state.count();
    Json(json!({}))
}

/// Takes one off a gauge when dropped.
struct Released<'a>(&'a AtomicU64);

impl Drop for Released<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn wait_unpaused(pause: &mut watch::Receiver<Pause>) {
    while pause.borrow_and_update().paused {
        if pause.changed().await.is_err() {
            return;
        }
    }
}

async fn wait_abort(pause: &mut watch::Receiver<Pause>, seen: u64) {
    loop {
        if pause.borrow_and_update().aborts != seen {
            return;
        }
        if pause.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The arguments of a scripted call: the prompt's question when it has one, else `A * B`
/// drawn from the seed.
fn tool_arguments(question: Option<&str>, seed: u64) -> Value {
    let expression = question.map_or_else(
        || format!("{} * {}", mix(seed) % 50 + 2, mix(seed ^ 1) % 50 + 2),
        str::to_owned,
    );
    json!({ "expression": expression })
}

/// A scenario's call arguments: `template` with `{expression}` and `{answer}` filled in every
/// string (the answer right at `correct_rate`, drawn from the request's seed, else off by one).
fn scripted_arguments(
    template: &Value,
    question: Option<&str>,
    seed: u64,
    correct_rate: f64,
) -> Value {
    let expression = question.map_or_else(
        || format!("{} * {}", mix(seed) % 50 + 2, mix(seed ^ 1) % 50 + 2),
        str::to_owned,
    );
    let value = evaluate(&expression).unwrap_or(0);
    let right = unit(mix(seed ^ CORRECT_DRAW)) < correct_rate;
    let answer = if right { value } else { value + 1 };
    fill(template, &expression, &answer.to_string())
}

fn fill(template: &Value, expression: &str, answer: &str) -> Value {
    match template {
        Value::String(text) => Value::String(
            text.replace("{expression}", expression)
                .replace("{answer}", answer),
        ),
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| fill(v, expression, answer)).collect())
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), fill(v, expression, answer)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The value of an `A op B` of integers (`+ - * /`), spaced or not, as
/// [`last_expression`] finds it.
fn evaluate(expression: &str) -> Option<i64> {
    let text: String = expression.split_whitespace().collect();
    // The operator after the first integer (whose own sign comes first).
    let (at, op) = text
        .char_indices()
        .skip(1)
        .find(|&(_, c)| matches!(c, '+' | '-' | '*' | '/'))?;
    let (a, b) = (
        text[..at].parse::<i64>().ok()?,
        text[at + 1..].parse::<i64>().ok()?,
    );
    match op {
        '+' => a.checked_add(b),
        '-' => a.checked_sub(b),
        '*' => a.checked_mul(b),
        _ => a.checked_div(b),
    }
}

/// The call as the format's own chat templates render it, JSON spaced as Python's
/// `json.dumps` spaces an object (`{"expression": "17 * 23"}`), so that a re-render of the
/// parsed call gives the same text.
fn tool_call_text(format: CallFormat, tool: &str, arguments: &Value) -> String {
    if format == CallFormat::Qwen3Coder {
        let parameters: String = arguments
            .as_object()
            .into_iter()
            .flatten()
            .map(|(key, value)| {
                let value = match value {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                format!("<parameter={key}>\n{value}\n</parameter>\n")
            })
            .collect();
        return format!("<tool_call>\n<function={tool}>\n{parameters}</function>\n</tool_call>");
    }
    let arguments = match arguments.as_object() {
        Some(object) => {
            let fields: Vec<String> = object
                .iter()
                .map(|(key, value)| format!("{}: {value}", Value::from(key.as_str())))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
        None => arguments.to_string(),
    };
    match format {
        CallFormat::Llama3Json => format!("{{\"name\": \"{tool}\", \"parameters\": {arguments}}}"),
        CallFormat::Mistral => {
            format!("[TOOL_CALLS][{{\"name\": \"{tool}\", \"arguments\": {arguments}}}]")
        }
        CallFormat::Hermes | CallFormat::Qwen3Coder => format!(
            "<tool_call>\n{{\"name\": \"{tool}\", \"arguments\": {arguments}}}\n</tool_call>"
        ),
    }
}

/// What marks a call to `tool` in a prompt, in the format's own templates' rendering too:
/// `{"name": "TOOL", "arguments"` (hermes; Mistral's list of calls), `{"name": "TOOL",
/// "parameters"` (Llama 3), `<function=TOOL>` (Qwen3-Coder).
fn call_signature(format: CallFormat, tool: &str) -> String {
    match format {
        CallFormat::Hermes | CallFormat::Mistral => {
            format!("{{\"name\": \"{tool}\", \"arguments\"")
        }
        CallFormat::Llama3Json => format!("{{\"name\": \"{tool}\", \"parameters\""),
        CallFormat::Qwen3Coder => format!("<function={tool}>"),
    }
}

/// What the scripted policy reads in a prompt (see [`State::read`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Reading<'a> {
    /// Tool calls already made in the conversation.
    calls: usize,
    /// The last `A op B` of the question, as written (`"17 * 23"`).
    question: Option<&'a str>,
    /// The last number after the last tool call: the tool's result.
    tool_result: Option<&'a str>,
}

/// A scripted answer: its text (without EOS), its ids (with EOS), and the call's arguments
/// when it is a tool call.
struct Answer {
    text: String,
    ids: Vec<u32>,
    arguments: Option<Value>,
}

/// Salt of the draw that decides whether a final answer repeats the tool's result.
const CORRECT_DRAW: u64 = 0xC0DE_0FA1_153E_7500;

/// The chat path's reading: the same as [`State::read`] on the text, with the calls counted
/// from the assistant messages' `tool_calls` and the tool result taken from the messages
/// after the first of them.
fn chat_reading(messages: &[Value]) -> Reading<'_> {
    let first_call = messages
        .iter()
        .position(|m| {
            m["role"] == "assistant" && m["tool_calls"].as_array().is_some_and(|c| !c.is_empty())
        })
        .unwrap_or(messages.len());
    let calls = messages[first_call..]
        .iter()
        .filter(|m| {
            m["role"] == "assistant" && m["tool_calls"].as_array().is_some_and(|c| !c.is_empty())
        })
        .count();
    let question = messages[..first_call]
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| last_expression(content(m)));
    let tool_result = messages[first_call..]
        .iter()
        .rev()
        .find_map(|m| last_number(content(m)));
    Reading {
        calls,
        question,
        tool_result,
    }
}

fn content(message: &Value) -> &str {
    message["content"].as_str().unwrap_or_default()
}

/// The last `A op B` in `text` (integers, `op` one of `+ - * /`, spaces allowed around it),
/// as written: what `(-?\d+)\s*([-+*/])\s*(-?\d+)` would match last.
fn last_expression(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut found = None;
    let mut at = 0;
    while at < bytes.len() {
        if let Some(end) = expression_at(bytes, at) {
            found = Some(&text[at..end]);
            // A later match may start inside this one (`1 + 2 * 3` ends with `2 * 3`).
            at = integer_end(bytes, at).unwrap_or(at + 1);
        } else {
            at += 1;
        }
    }
    found
}

/// The end of an `A op B` starting exactly at `at`.
fn expression_at(bytes: &[u8], at: usize) -> Option<usize> {
    let skip = |mut i: usize| {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    let left = integer_end(bytes, at)?;
    let op = skip(left);
    if !matches!(bytes.get(op), Some(b'+' | b'-' | b'*' | b'/')) {
        return None;
    }
    integer_end(bytes, skip(op + 1))
}

/// The end of `-?\d+` starting exactly at `at`, taking every digit.
fn integer_end(bytes: &[u8], at: usize) -> Option<usize> {
    let start = if bytes.get(at) == Some(&b'-') {
        at + 1
    } else {
        at
    };
    let mut end = start;
    while bytes.get(end).is_some_and(u8::is_ascii_digit) {
        end += 1;
    }
    (end > start).then_some(end)
}

/// The last number in `text` (`-?\d+(\.\d+)?`), as written; a `-` counts as its sign only
/// when it does not follow a letter or digit (`17-5` ends with `5`).
fn last_number(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let end = bytes.iter().rposition(u8::is_ascii_digit)? + 1;
    let digits_from = |mut i: usize| {
        while i > 0 && bytes[i - 1].is_ascii_digit() {
            i -= 1;
        }
        i
    };
    let mut start = digits_from(end);
    if start >= 2 && bytes[start - 1] == b'.' && bytes[start - 2].is_ascii_digit() {
        start = digits_from(start - 1);
    }
    if start >= 1
        && bytes[start - 1] == b'-'
        && (start < 2 || !bytes[start - 2].is_ascii_alphanumeric())
    {
        start -= 1;
    }
    Some(&text[start..end])
}

fn error(status: StatusCode, message: &str, kind: &str, param: Option<&str>) -> Response {
    let body = json!({ "error": { "message": message, "type": kind, "param": param, "code": status.as_u16() } });
    (status, Json(body)).into_response()
}

fn unknown_model(model: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!("The model `{model}` does not exist."),
        "NotFoundError",
        Some("model"),
    )
}

fn unavailable() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "simulated overload: try again",
        "ServiceUnavailableError",
        None,
    )
}

fn dropped() -> Response {
    let stream = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("simulated connection drop"))
    });
    Response::new(Body::from_stream(stream))
}

fn malformed(model: &str) -> Response {
    let body = json!({
        "id": "cmpl-sim-malformed",
        "model": model,
        "choices": [{ "index": 0, "text": "x", "token_ids": "not a list", "finish_reason": "stop" }],
    });
    Json(body).into_response()
}

/// SplitMix64: a deterministic, well-mixed hash of a number.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scenario_s_arguments_carry_the_question_and_its_answer() {
        let template = json!({"filePath": "solution.py", "content": "return {answer}  # {expression}", "n": 3});
        let right = scripted_arguments(&template, Some("6 * 7"), 1, 1.0);
        assert_eq!(
            right,
            json!({"filePath": "solution.py", "content": "return 42  # 6 * 7", "n": 3})
        );
        let wrong = scripted_arguments(&template, Some("6 * 7"), 1, 0.0);
        assert_eq!(wrong["content"], "return 43  # 6 * 7");
        assert_eq!(evaluate("5-17"), Some(-12));
        assert_eq!(evaluate("-4 / -2"), Some(2));
        assert_eq!(evaluate("12"), None);
    }

    #[test]
    fn the_last_expression_is_found_as_written() {
        assert_eq!(last_expression("What is 17 * 23?"), Some("17 * 23"));
        assert_eq!(last_expression("e.g. 2 + 2. Now 5-17 please"), Some("5-17"));
        assert_eq!(last_expression("1 + 2 * 3"), Some("2 * 3"));
        assert_eq!(last_expression("-4 / -2"), Some("-4 / -2"));
        assert_eq!(last_expression("no numbers, or 12 alone"), None);
    }

    #[test]
    fn the_last_number_keeps_its_sign_and_decimals() {
        assert_eq!(
            last_number("<tool_response>\n391\n</tool_response>"),
            Some("391")
        );
        assert_eq!(last_number("\"-12\""), Some("-12"));
        assert_eq!(last_number("17-5"), Some("5"));
        assert_eq!(last_number("2.5 apples"), Some("2.5"));
        assert_eq!(last_number("version 1.2.3"), Some("2.3"));
        assert_eq!(last_number("none"), None);
    }
}
