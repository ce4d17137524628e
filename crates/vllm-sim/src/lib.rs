//! A vLLM-compatible simulator server, for tests, benchmarks and GPU-free demos.
//!
//! It is a simulator, named as such everywhere: it speaks vLLM's JSON for the endpoints the
//! engine uses, encodes its answers with a real tokenizer (`tokenizers` crate), and follows a
//! scripted policy instead of a model:
//!
//! - a plain answer of `answer_tokens` tokens, or, for the first `tool_rounds` assistant turns
//!   of a conversation, a tool call to `tool_name` written in `call_format` (hermes/Qwen
//!   `<tool_call>{"name": ..., "arguments": ...}</tool_call>` by default; Qwen3-Coder XML,
//!   Llama-3 JSON and Mistral `[TOOL_CALLS]` as the model families write them), each after
//!   an optional `preamble` (a reasoning block, as a thinking model writes one);
//! - an arithmetic demo's policy when it has tool rounds to play: the call's arguments are
//!   `{"expression": "A op B"}` with the last `A op B` (integers, `+ - * /`) of the last user
//!   turn before the first call (`"What is 17 * 23?"` gives `"17 * 23"`), else a random
//!   `A * B`; after a call, the final answer `The answer is N.` repeats the last number of
//!   the prompt (the tool's result) with probability `correct_rate`, else N is random in
//!   0..100. With no tool rounds the prompt is never decoded, so the plain path stays cheap;
//! - latency of `latency + per_token * tokens`; logprobs derived from the request's seed, so
//!   the same request gives the same answer;
//! - fault injection by deterministic draw per request: a fraction of 503s, of connections
//!   dropped mid-response, of slow responses, of malformed bodies;
//! - `/pause` and `/resume` that really hold requests (`mode=keep` freezes them, `mode=abort`
//!   ends them with `finish_reason: "abort"` and their partial ids), and counters, among them
//!   requests aborted because the client disconnected;
//! - `POST /reward`, not a vLLM endpoint: a reward service for the engine's `http` reward
//!   (a completion whose text contains the row's `answer` scores 1, else 0), answering a
//!   JSON array (`?shape=object`: `{"scores": [...]}`; `?shape=short`: one score too few),
//!   with the same latency and faults, counting the groups it scored and its most requests
//!   at once;
//! - `POST /judge/FORMAT/v1/chat/completions`, an LLM judge for the engine's `judge` reward:
//!   it finds the reference between `<answer>` and `</answer>` in the last user message and
//!   each completion between `<completion...>` and `</completion>`, scores a completion 1
//!   when it contains the reference, else 0, and answers as FORMAT says: `number` (`Score:
//!   N` after a thinking block), `json` (`{"score": N}` in a fenced block after a thinking
//!   block that holds a draft score of 5, or `{"scores": [...]}` for several completions), `labels` (`Verdict: CORRECT` or `INCORRECT`; several:
//!   `{"scores": ["CORRECT", ...]}`), `short` (as `json`, one score too few), `garbage`
//!   (no score) or `value:X` (as `json`, a right completion scoring the raw text `X`, such as
//!   `1e308` or `NaN`: a judge gone wrong); with the same latency and faults, counting its
//!   requests and its most at once;
//! - `POST /classify`, vLLM's endpoint for a reward model on the pooling runner, for the
//!   engine's `reward_model` reward: it takes one conversation as `messages` and scores it
//!   `messages + chars / 1000` (how many messages, and the characters of the last one's
//!   content), through a sigmoid unless `use_activation` is false (vLLM applies the model's
//!   activation by default); an unknown `model` is a 404 and no message a 400; with the same
//!   latency and faults, counting its requests and its most at once.
//!
//! `async-grpo simulate --port P --tokenizer PATH` runs it from the binary.
//!
//! ```
//! use std::time::Duration;
//!
//! use vllm_client::{Client, ClientConfig, GenerateParams};
//! use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A small real tokenizer trained for the simulator; any Hugging Face tokenizer works.
//! let mut config = SimConfig::new(training_tokenizer());
//! config.answer_tokens = 6;
//! let server = Simulator::start(config, "127.0.0.1:0".parse()?).await?;
//!
//! let client = Client::new(ClientConfig::new(server.url()))?;
//! client.wait_until_ready(Duration::from_secs(10)).await?;
//! let turn = client.generate(&[1, 2, 3], &GenerateParams { max_tokens: 16, ..GenerateParams::default() }).await?;
//! assert_eq!(turn.token_ids.len(), 6 + 1); // the answer and EOS
//! assert_eq!(server.counters().completions, 1);
//! server.stop().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `clap` | no | `clap::Args` for [`SimSettings`], the flags of `async-grpo simulate` | clap |
//! | `schema` | no | `schemars::JsonSchema` for [`SimSettings`], from which the binary writes its settings reference | schemars |

mod server;
mod settings;

pub use settings::SimSettings;

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokenizers::Tokenizer;
use tokio::sync::watch;

/// Fractions of requests that fail on purpose (each in `[0, 1]`, drawn per request).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    /// Answer 503 Service Unavailable.
    pub error_503: f64,
    /// Send the headers, then drop the connection mid-body.
    pub drop_connection: f64,
    /// Add `slow_delay` before answering.
    pub slow: f64,
    /// The extra delay of a slow response.
    pub slow_delay: Duration,
    /// Answer 200 with a body whose `choices[0].token_ids` is not a list.
    pub malformed: f64,
}

/// How the simulator writes a tool call: the formats the model families write, which the
/// engine's parsers of the same names read back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallFormat {
    /// `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>` (Qwen2.5, Qwen3, Hermes).
    #[default]
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3-Coder).
    Qwen3Coder,
    /// `{"name": .., "parameters": {..}}` (Llama 3.1 and later).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": .., "arguments": {..}}]` (Mistral).
    Mistral,
}

/// How the simulator behaves.
#[derive(Clone)]
pub struct SimConfig {
    /// Encodes answers and decodes prompts.
    pub tokenizer: Arc<Tokenizer>,
    /// The model name it serves.
    pub model: String,
    /// Its context length.
    pub max_model_len: u32,
    /// Tokens of a final answer (before the EOS token).
    pub answer_tokens: usize,
    /// Assistant turns that call a tool before the final answer.
    pub tool_rounds: usize,
    /// The tool it calls.
    pub tool_name: String,
    /// The scripted call's arguments, when not the arithmetic demo's `{"expression": ...}`:
    /// a JSON object whose strings may hold `{expression}` (the question's `A op B`) and
    /// `{answer}` (its value, right at `correct_rate`, else off by one). An agent scenario:
    /// `write` with `{"filePath": "solution.py", "content": "def solve():\n    return {answer}\n"}`.
    pub tool_arguments: Option<serde_json::Value>,
    /// How it writes the call.
    pub call_format: CallFormat,
    /// Text every answer starts with, call or final answer: empty by default; a reasoning
    /// block (`<think>\n...\n</think>\n\n`) plays a thinking model.
    pub preamble: String,
    /// Sample each call one character per token (special tokens kept whole) instead of its
    /// text's own encoding, as a real model may sample a text in other tokens (vLLM with
    /// structured output does): a client that re-encodes the text gets other ids.
    pub spell_calls: bool,
    /// The chance, drawn from each request's seed, that a final answer after a tool call
    /// repeats the tool's result (the last number of the prompt) instead of a random one.
    pub correct_rate: f64,
    /// The token that ends a finished answer, if the tokenizer has it.
    pub eos_token: String,
    /// Delay before the first token.
    pub latency: Duration,
    /// Delay per generated token.
    pub per_token: Duration,
    /// Deliberate failures.
    pub faults: Faults,
    /// Seed of the fault draws.
    pub fault_seed: u64,
    /// Keep every completion answered, for [`Simulator::transcript`] (tests compare what a
    /// client made of the answers with what was sampled).
    pub record: bool,
    /// Play a mixture-of-experts model served with `--enable-return-routed-experts`: every
    /// completion choice carries `routed_experts` as vLLM 0.32 writes it (see
    /// [`SimRouting`]).
    pub routed_experts: Option<SimRouting>,
}

impl std::str::FromStr for SimRouting {
    type Err = String;

    /// `LAYERSxTOP_KxEXPERTS`, e.g. `2x2x8`: each at least 1, top_k at most experts, at most
    /// 65536 experts (uint16 ids).
    fn from_str(text: &str) -> Result<SimRouting, String> {
        let parts: Vec<usize> = text
            .split('x')
            .map(|p| p.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("'{text}' is not LAYERSxTOP_KxEXPERTS (e.g. 2x2x8)"))?;
        let [layers, top_k, experts] = parts[..] else {
            return Err(format!("'{text}' is not LAYERSxTOP_KxEXPERTS (e.g. 2x2x8)"));
        };
        if layers == 0 || top_k == 0 || top_k > experts || experts > 65536 {
            return Err(format!(
                "'{text}': layers and top_k at least 1, top_k at most experts, experts at most 65536"
            ));
        }
        Ok(SimRouting {
            layers,
            top_k,
            experts,
        })
    }
}

/// The router of a simulated mixture-of-experts model. A completion's `routed_experts` is
/// base64 of the `.npy` bytes of an array of shape `(positions, layers, top_k)`, `uint8`
/// when `experts <= 256` else `uint16`, for the positions from the request's
/// `routed_experts_prompt_start` (default 0) to the last but one of prompt + sampled ids, as
/// vLLM 0.32 reports them. A position's experts depend on its token, its place and the
/// weights' version ([`Simulator::set_weights`]), so re-sending a row's ids reports the same
/// routing under the same weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimRouting {
    /// MoE layers.
    pub layers: usize,
    /// Experts per token and layer.
    pub top_k: usize,
    /// Experts per layer.
    pub experts: usize,
}

impl SimConfig {
    /// [`SimSettings::default`]'s behaviour (model `sim`, 4096 tokens of context, 32-token
    /// answers, no tool rounds, a correct rate of 0.5, no latency, no faults, tool
    /// `calculator`, EOS `<|im_end|>`), hermes calls, no preamble.
    pub fn new(tokenizer: Tokenizer) -> SimConfig {
        SimConfig::with_settings(tokenizer, &SimSettings::default())
    }

    /// A simulator answering as `settings` say, hermes calls, no preamble.
    pub fn with_settings(tokenizer: Tokenizer, settings: &SimSettings) -> SimConfig {
        let mut config = SimConfig {
            tokenizer: Arc::new(tokenizer),
            model: String::new(),
            max_model_len: 0,
            answer_tokens: 0,
            tool_rounds: 0,
            tool_name: settings.tool_name_or_default(),
            tool_arguments: None,
            call_format: CallFormat::Hermes,
            preamble: String::new(),
            spell_calls: false,
            correct_rate: 0.0,
            eos_token: settings.eos_token_or_default(),
            latency: Duration::ZERO,
            per_token: Duration::ZERO,
            faults: Faults::default(),
            fault_seed: 0,
            record: false,
            routed_experts: None,
        };
        settings.apply_to(&mut config);
        config
    }

    /// Loads a `tokenizer.json` (a Hugging Face tokenizer file).
    pub fn from_tokenizer_file(path: &Path) -> Result<SimConfig, TokenizerFileError> {
        let tokenizer = Tokenizer::from_file(path).map_err(|source| TokenizerFileError {
            path: path.to_owned(),
            source,
        })?;
        Ok(SimConfig::new(tokenizer))
    }
}

/// A `tokenizer.json` the simulator could not load.
#[derive(Debug, thiserror::Error)]
#[error("could not load tokenizer {}", path.display())]
pub struct TokenizerFileError {
    /// The file.
    pub path: std::path::PathBuf,
    /// Why.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl std::fmt::Debug for SimConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimConfig")
            .field("model", &self.model)
            .field("max_model_len", &self.max_model_len)
            .field("answer_tokens", &self.answer_tokens)
            .field("tool_rounds", &self.tool_rounds)
            .field("tool_name", &self.tool_name)
            .field("call_format", &self.call_format)
            .field("preamble", &self.preamble)
            .field("spell_calls", &self.spell_calls)
            .field("correct_rate", &self.correct_rate)
            .field("latency", &self.latency)
            .field("per_token", &self.per_token)
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

/// One `/v1/completions` exchange: the prompt a request carried and the answer sent to it
/// (with `record` on).
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    /// The prompt ids the request carried.
    pub prompt_ids: Vec<u32>,
    /// The ids sampled.
    pub token_ids: Vec<u32>,
    /// Their logprobs, as sent.
    pub logprobs: Vec<f64>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: &'static str,
    /// The version of the weights that sampled the ids ([`Simulator::set_weights`]).
    pub weights: u64,
    /// Whether the weights changed while the request ran (its ids are then not all of
    /// `weights`, as with vLLM's `/pause?mode=keep` around a weight update).
    pub weights_changed: bool,
}

/// What the simulator has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Requests to every endpoint.
    pub requests: u64,
    /// Completion requests answered (any outcome).
    pub completions: u64,
    /// Chat completion requests answered.
    pub chats: u64,
    /// Generation requests dropped because the client disconnected before the answer.
    pub aborted_by_disconnect: u64,
    /// Generation requests ended by `/pause?mode=abort`.
    pub aborted_by_pause: u64,
    /// Generation requests held by a pause right now, waiting for `/resume` (a gauge: tests
    /// wait on it to know a request is held rather than merely slow).
    pub held_by_pause: u64,
    /// 503s injected.
    pub injected_503: u64,
    /// Connections dropped on purpose.
    pub injected_drops: u64,
    /// Slow responses injected.
    pub injected_slow: u64,
    /// Malformed bodies injected.
    pub injected_malformed: u64,
    /// Groups scored by `POST /reward` (the simulator as a reward service), any outcome.
    pub rewards: u64,
    /// The most `POST /reward` requests that were in flight at once.
    pub rewards_in_flight_max: u64,
    /// Requests to the judge's endpoint (`POST /judge/FORMAT/v1/chat/completions`), any
    /// outcome.
    pub judges: u64,
    /// The most judge requests that were in flight at once.
    pub judges_in_flight_max: u64,
    /// Judge requests that carried `Authorization: Bearer sim-judge-key`, the key the
    /// simulator's judge expects of a client given one.
    pub judges_with_key: u64,
    /// Requests to `POST /classify` (the simulator as a reward model), any outcome.
    pub classifications: u64,
    /// The most `/classify` requests that were in flight at once.
    pub classifications_in_flight_max: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    completions: AtomicU64,
    chats: AtomicU64,
    aborted_by_disconnect: AtomicU64,
    aborted_by_pause: AtomicU64,
    held_by_pause: AtomicU64,
    injected_503: AtomicU64,
    injected_drops: AtomicU64,
    injected_slow: AtomicU64,
    injected_malformed: AtomicU64,
    rewards: AtomicU64,
    rewards_in_flight: AtomicU64,
    rewards_in_flight_max: AtomicU64,
    judges: AtomicU64,
    judges_in_flight: AtomicU64,
    judges_in_flight_max: AtomicU64,
    judges_with_key: AtomicU64,
    classifications: AtomicU64,
    classifications_in_flight: AtomicU64,
    classifications_in_flight_max: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SimCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SimCounters {
            requests: get(&self.requests),
            completions: get(&self.completions),
            chats: get(&self.chats),
            aborted_by_disconnect: get(&self.aborted_by_disconnect),
            aborted_by_pause: get(&self.aborted_by_pause),
            held_by_pause: get(&self.held_by_pause),
            injected_503: get(&self.injected_503),
            injected_drops: get(&self.injected_drops),
            injected_slow: get(&self.injected_slow),
            injected_malformed: get(&self.injected_malformed),
            rewards: get(&self.rewards),
            rewards_in_flight_max: get(&self.rewards_in_flight_max),
            judges: get(&self.judges),
            judges_in_flight_max: get(&self.judges_in_flight_max),
            judges_with_key: get(&self.judges_with_key),
            classifications: get(&self.classifications),
            classifications_in_flight_max: get(&self.classifications_in_flight_max),
        }
    }
}

/// Pause state: whether requests are held, and how many abort signals were given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Pause {
    paused: bool,
    /// `mode=keep`: requests in flight are frozen too, not only new ones.
    freeze: bool,
    aborts: u64,
}

/// A running simulator; dropping it stops the server.
#[derive(Debug)]
pub struct Simulator {
    addr: SocketAddr,
    state: Arc<server::State>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Simulator {
    /// Starts serving on `addr` (`127.0.0.1:0` picks a free port) on the current runtime.
    pub async fn start(config: SimConfig, addr: SocketAddr) -> std::io::Result<Simulator> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(server::State::new(config));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = server::router(Arc::clone(&state));
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stopped.await;
            });
            if let Err(error) = serve.await {
                tracing::error!(%error, "the simulator stopped with an error");
            }
        });
        Ok(Simulator {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The counters so far.
    pub fn counters(&self) -> SimCounters {
        self.state.counters.snapshot()
    }

    /// Loads weights of `version`: from now on answers, their logprobs and their routing are
    /// those of these weights (version 0, the start's, answers as the simulator always did).
    /// What a trainer's weight update does to a real server; `POST /sim/weights
    /// {"version": N}` does the same over HTTP.
    pub fn set_weights(&self, version: u64) {
        self.state.weights.store(version, Ordering::Release);
    }

    /// Every completion answered so far, in order (empty unless `record` was set).
    pub fn transcript(&self) -> Vec<Exchange> {
        lock(&self.state.transcript).clone()
    }

    /// Stops accepting connections and ends the server task. Connections already open run on
    /// tasks of their own and may still finish the request they carry.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A small byte-level BPE tokenizer trained, in well under a second, on text shaped like the
/// simulator's answers and chat markup, with `<|im_start|>`, `<|im_end|>`, `<tool_call>` and
/// `</tool_call>` as special tokens: a real tokenizer for hermetic tests and demos, without a
/// model download.
pub fn training_tokenizer() -> Tokenizer {
    use tokenizers::{
        AddedToken,
        models::{
            TrainerWrapper,
            bpe::{BPE, BpeTrainerBuilder},
        },
        pre_tokenizers::byte_level::ByteLevel,
    };
    let specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"];
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(600)
        .min_frequency(1)
        .show_progress(false)
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let corpus = server::WORDS
        .iter()
        .map(|w| format!("{w} "))
        .chain([
            "user\nWhat is 2 + 3? The answer is 5.\n".to_owned(),
            "{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n".to_owned(),
            "system\nYou are a helpful assistant. 0123456789\n".to_owned(),
        ])
        .collect::<Vec<_>>();
    if let Err(error) = tokenizer.train(&mut trainer, corpus.iter()) {
        unreachable!("training on a fixed in-memory corpus cannot fail: {error}");
    }
    tokenizer.add_special_tokens(&specials.map(|s| AddedToken::from(s, true)));
    tokenizer
}

fn pause_channel() -> (watch::Sender<Pause>, watch::Receiver<Pause>) {
    watch::channel(Pause::default())
}

/// Locks `mutex`, recovering the guard if a holder panicked (no critical section here can
/// leave the data half-updated).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
