//! The rollout loop end to end with a scripted in-process generator: token accounting over
//! tool turns, failure isolation and retries, the context limit, backpressure, model
//! versions, drain, aborted answers, bad dataset rows, the heartbeat, and the group and turn
//! limits.

use std::{
    collections::{HashMap, HashSet},
    convert::Infallible,
    fmt::{self, Write as _},
    sync::{
        Arc, LazyLock, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_grpo_rollout::{
    Agent, AgentError, AgentOutcome, AgentRun, DatasetError, DatasetRow, Engine, FailureCause,
    Finish, GenerateError, GenerateRequest, Generation, Generator, Groups, InFlight, RolloutConfig,
    SampleRefused, Sampled, ScoredGroup,
};
use futures::future::BoxFuture;
use rollout_core::{ChatTemplate, ChatTokenizer, Message, RenderOptions};
use scoring::{
    AdvantageConfig, CompletionReward, Group, Reward, Scorer, ScorerConfig, group_advantages,
};
use serde_json::{Map, Value, json};
use test_support::{wait_until, within};
use tokenizers::Tokenizer;
use tokio::sync::watch;
use tool_dispatch::{DispatcherConfig, Registry, Tool, ToolDispatcher, ToolSpec};

/// ChatML with tools: the tools listed in a system turn, calls in hermes `<tool_call>` blocks,
/// tool results in `tool` turns. An assistant turn renders exactly as the scripted generator
/// samples it, so every turn boundary is clean.
const CHATML_WITH_TOOLS: &str = include_str!("fixtures/chatml_with_tools.jinja");

const ADD_CALL: &str =
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>";
const ECHO_CALL: &str =
    "<tool_call>\n{\"name\": \"echo\", \"arguments\": {\"text\": \"hello\"}}\n</tool_call>";
const WAIT_CALL: &str = "<tool_call>\n{\"name\": \"wait\", \"arguments\": {}}\n</tool_call>";
const BLOCK_CALL: &str = "<tool_call>\n{\"name\": \"block\", \"arguments\": {}}\n</tool_call>";

/// A bound on every wait, so that a broken loop fails instead of hanging the suite.
const PATIENCE: Duration = Duration::from_secs(60);

pub(crate) fn chat_tokenizer() -> ChatTokenizer {
    static TOKENIZER: LazyLock<Tokenizer> = LazyLock::new(vllm_sim::training_tokenizer);
    let template =
        ChatTemplate::new("chatml-tools", CHATML_WITH_TOOLS).expect("the template compiles");
    let special = json!({ "eos_token": "<|im_end|>" })
        .as_object()
        .cloned()
        .unwrap_or_default();
    ChatTokenizer::new(TOKENIZER.clone(), template, special)
}

/// One request as the generator saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Call {
    rollout: u64,
    /// Attempts are counted by turn-0 requests that do not continue an aborted answer.
    attempt: u32,
    turn: usize,
    /// The request continues an answer the generator aborted.
    continuation: bool,
}

/// What the generator does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Answer by the script.
    Answer,
    /// Fail with a generation error.
    Fail,
    /// Panic, as a buggy generator would.
    Panic,
    /// Never answer; the future only ends by being dropped.
    Hang,
    /// Answer the first `k` tokens of the scripted answer with [`Finish::Abort`].
    Abort(usize),
    /// Wait until the gate opens, then answer.
    Gate,
}

/// One answered (or failed) request.
#[derive(Debug, Clone)]
struct Logged {
    call: Call,
    prompt_ids: Vec<u32>,
    max_tokens: u32,
    sampled: Vec<u32>,
    logprobs: Vec<f32>,
    /// `None` for a failed request.
    finish: Option<Finish>,
}

#[derive(Debug, Default)]
struct Progress {
    attempts: u32,
    /// An aborted answer: its turn and how many of its tokens were sent.
    partial: Option<(usize, usize)>,
}

/// A latch tests open; everything waiting on it goes on.
#[derive(Debug, Clone)]
struct Gate(Arc<watch::Sender<bool>>);

impl Gate {
    fn new() -> Gate {
        Gate(Arc::new(watch::Sender::new(false)))
    }

    fn open(&self) {
        self.0.send_replace(true);
    }

    async fn wait(&self) {
        let mut open = self.0.subscribe();
        // The sender lives as long as `self`: waiting cannot fail.
        let _ = open.wait_for(|open| *open).await;
    }
}

/// Counts a future dropped before it finished.
struct DropGuard<'a>(&'a AtomicUsize);

impl Drop for DropGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

type Plan = dyn Fn(Call) -> Act + Send + Sync;

struct Script {
    tokenizer: Tokenizer,
    eos: u32,
    /// The text of turn `t` for `t < calls.len()`; later turns answer "The answer is N".
    calls: Vec<&'static str>,
    plan: Box<Plan>,
    gate: Gate,
    log: Mutex<Vec<Logged>>,
    rollouts: Mutex<HashMap<u64, Progress>>,
    hanging: AtomicUsize,
    hangs_dropped: AtomicUsize,
}

/// An in-process generator answering by a script: a tool call per scripted turn, then "The
/// answer is N" with N the rollout id (so rewards differ), each ended by EOS, with log-probs
/// derived from (rollout, turn, position). Every request is logged.
#[derive(Clone)]
struct ScriptedGenerator {
    script: Arc<Script>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The log-prob the generator reports for a token: never 0, different for each rollout,
/// turn and position.
fn logprob(rollout: u64, turn: usize, position: usize) -> f32 {
    let x = (rollout * 131 + turn as u64 * 17 + position as u64 * 7) % 997;
    -((x + 1) as f32) / 1000.0
}

impl ScriptedGenerator {
    fn new(
        tokenizer: &ChatTokenizer,
        calls: &[&'static str],
        plan: impl Fn(Call) -> Act + Send + Sync + 'static,
    ) -> ScriptedGenerator {
        ScriptedGenerator {
            script: Arc::new(Script {
                tokenizer: tokenizer.tokenizer().clone(),
                eos: tokenizer.eos_token_id().expect("<|im_end|> is a token"),
                calls: calls.to_vec(),
                plan: Box::new(plan),
                gate: Gate::new(),
                log: Mutex::new(Vec::new()),
                rollouts: Mutex::new(HashMap::new()),
                hanging: AtomicUsize::new(0),
                hangs_dropped: AtomicUsize::new(0),
            }),
        }
    }

    fn answering(tokenizer: &ChatTokenizer, calls: &[&'static str]) -> ScriptedGenerator {
        ScriptedGenerator::new(tokenizer, calls, |_| Act::Answer)
    }

    /// The full scripted answer of a turn, EOS included.
    fn answer(&self, rollout: u64, turn: usize) -> Vec<u32> {
        let text = match self.script.calls.get(turn) {
            Some(call) => (*call).to_owned(),
            None => format!("The answer is {rollout}"),
        };
        let mut ids = self
            .script
            .tokenizer
            .encode(text, false)
            .expect("the script encodes")
            .get_ids()
            .to_vec();
        ids.push(self.script.eos);
        ids
    }

    /// The attempt a request belongs to, and where an aborted answer it continues stopped.
    fn begin(&self, rollout: u64, turn: usize) -> (u32, usize) {
        let mut rollouts = lock(&self.script.rollouts);
        let progress = rollouts.entry(rollout).or_default();
        match progress.partial.take() {
            Some((partial_turn, sent)) if partial_turn == turn => (progress.attempts, sent),
            _ => {
                if turn == 0 {
                    progress.attempts += 1;
                }
                (progress.attempts, 0)
            }
        }
    }

    fn log(&self) -> Vec<Logged> {
        lock(&self.script.log).clone()
    }

    /// The answered requests of one rollout, in order.
    fn answered(&self, rollout: u64) -> Vec<Logged> {
        self.log()
            .into_iter()
            .filter(|l| l.call.rollout == rollout && l.finish.is_some())
            .collect()
    }

    fn open_gate(&self) {
        self.script.gate.open();
    }

    fn hanging(&self) -> usize {
        self.script.hanging.load(Ordering::SeqCst)
    }

    fn hangs_dropped(&self) -> usize {
        self.script.hangs_dropped.load(Ordering::SeqCst)
    }
}

impl Generator for ScriptedGenerator {
    async fn generate(&self, request: GenerateRequest<'_>) -> Result<Generation, GenerateError> {
        let script = &*self.script;
        let rollout = request.rollout.0;
        let turn = request.turn;
        let (attempt, offset) = self.begin(rollout, turn);
        let call = Call {
            rollout,
            attempt,
            turn,
            continuation: offset > 0,
        };
        let act = (script.plan)(call);
        let mut logged = Logged {
            call,
            prompt_ids: request.prompt_ids.to_vec(),
            max_tokens: request.max_tokens,
            sampled: Vec::new(),
            logprobs: Vec::new(),
            finish: None,
        };
        match act {
            Act::Panic => panic!("scripted panic of rollout {rollout}"),
            Act::Fail => {
                lock(&script.log).push(logged);
                return Err(GenerateError::new(format!(
                    "scripted failure of rollout {rollout}, attempt {attempt}, turn {turn}"
                )));
            }
            Act::Hang => {
                let _guard = DropGuard(&script.hangs_dropped);
                script.hanging.fetch_add(1, Ordering::SeqCst);
                let never: Infallible = std::future::pending().await;
                match never {}
            }
            Act::Gate => script.gate.wait().await,
            Act::Answer | Act::Abort(_) => {}
        }
        let full = self.answer(rollout, turn);
        let rest = &full[offset.min(full.len())..];
        let max = request.max_tokens as usize;
        let (sampled, finish) = match act {
            Act::Abort(k) => (&rest[..k.min(rest.len()).min(max)], Finish::Abort),
            _ if rest.len() > max => (&rest[..max], Finish::Length),
            _ => (rest, Finish::Stop),
        };
        if finish == Finish::Abort {
            lock(&script.rollouts).entry(rollout).or_default().partial =
                Some((turn, offset + sampled.len()));
        }
        logged.sampled = sampled.to_vec();
        logged.logprobs = (offset..offset + sampled.len())
            .map(|position| logprob(rollout, turn, position))
            .collect();
        logged.finish = Some(finish);
        lock(&script.log).push(logged.clone());
        Ok(Generation {
            token_ids: logged.sampled,
            logprobs: logged.logprobs,
            finish,
            routed_experts: None,
        })
    }
}

/// The number at the end of the answer: "The answer is 6" scores 6.
pub(crate) fn scorer() -> Scorer {
    let answer = Reward::new_sync("answer", |group: &Group| {
        Ok(group
            .completions
            .iter()
            .map(|c| c.text.rsplit(' ').next().and_then(|n| n.parse().ok()))
            .collect())
    });
    Scorer::new(vec![answer], ScorerConfig::default().threads(1)).expect("one reward")
}

fn row(line: usize) -> DatasetRow {
    DatasetRow {
        source: "rows.jsonl".into(),
        line,
        prompt: vec![Message::user(format!("What is 2 + 3? (question {line})"))],
        columns: Map::new(),
    }
}

fn rows(count: usize) -> Vec<Result<DatasetRow, DatasetError>> {
    (1..=count).map(|line| Ok(row(line))).collect()
}

fn config(num_generations: usize) -> RolloutConfig {
    let mut config = RolloutConfig::default();
    config.num_generations = num_generations;
    config.max_inflight = 2 * num_generations;
    config.max_tokens = 256;
    config
}

/// `add` (sync, a + b), `echo` (async, its text back), `wait` (async, until `gate` opens,
/// then "waited"), `block` (sync, sleeps 1.5 s, counting starts and ends).
fn tools(
    threads: usize,
    gate: Option<Gate>,
    block: Option<Arc<(AtomicUsize, AtomicUsize)>>,
) -> ToolDispatcher {
    #[derive(serde::Deserialize)]
    struct AddArgs {
        a: i64,
        b: i64,
    }
    let registry = Registry::new()
        .with(Tool::new_sync(
            ToolSpec::new("add", "Adds a and b"),
            |args| {
                let AddArgs { a, b } = args.parse()?;
                Ok(json!(a + b))
            },
        ))
        .and_then(|r| {
            r.with(Tool::new_async(
                ToolSpec::new("echo", "Answers its text"),
                |args| async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok(args.get("text").cloned().unwrap_or(Value::Null))
                },
            ))
        })
        .and_then(|r| {
            r.with(Tool::new_async(
                ToolSpec::new("wait", "Waits for the gate"),
                move |_| {
                    let gate = gate.clone();
                    async move {
                        if let Some(gate) = gate {
                            gate.wait().await;
                        }
                        Ok(json!("waited"))
                    }
                },
            ))
        })
        .and_then(|r| {
            r.with(Tool::new_sync(
                ToolSpec::new("block", "Blocks its thread for 1.5 s"),
                move |_| {
                    if let Some(block) = &block {
                        block.0.fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::sleep(Duration::from_millis(1500));
                    if let Some(block) = &block {
                        block.1.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(json!("unblocked"))
                },
            ))
        })
        .expect("distinct tool names");
    ToolDispatcher::new(registry, DispatcherConfig::new(threads))
}

fn start(
    generator: &ScriptedGenerator,
    tools: Option<ToolDispatcher>,
    config: RolloutConfig,
    rows: Vec<Result<DatasetRow, DatasetError>>,
) -> (Engine<ScriptedGenerator>, Groups) {
    let mut builder = Engine::builder(generator.clone(), chat_tokenizer(), scorer()).config(config);
    if let Some(tools) = tools {
        builder = builder.tools(tools);
    }
    builder.start(rows).expect("the loop starts")
}

/// Every group until the output ends.
async fn collect(groups: &mut Groups) -> Vec<ScoredGroup> {
    let mut out = Vec::new();
    while let Some(group) = within(PATIENCE, "the next group", groups.recv()).await {
        out.push(group);
    }
    out
}

fn metric(sample: &rollout_core::TrainingSample, name: &str) -> f64 {
    sample
        .metrics
        .get(name)
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// The trained positions of a sample hold exactly what the generator sampled for its rollout,
/// in order, with the logged log-probs; everything else has log-prob 0.
fn assert_trained_tokens_are_the_sampled_ones(
    generator: &ScriptedGenerator,
    sample: &rollout_core::TrainingSample,
) {
    let answered = generator.answered(sample.rollout_id.0);
    assert!(
        !answered.is_empty(),
        "rollout {:?} was sampled",
        sample.rollout_id
    );
    let sampled: Vec<u32> = answered.iter().flat_map(|l| l.sampled.clone()).collect();
    let logprobs: Vec<f32> = answered.iter().flat_map(|l| l.logprobs.clone()).collect();
    let mut trained = Vec::new();
    let mut trained_logprobs = Vec::new();
    assert_eq!(sample.input_ids.len(), sample.completion_mask.len());
    assert_eq!(sample.input_ids.len(), sample.old_log_probs.len());
    for ((&id, &mask), &logprob) in sample
        .input_ids
        .iter()
        .zip(&sample.completion_mask)
        .zip(&sample.old_log_probs)
    {
        if mask == 1 {
            trained.push(id);
            trained_logprobs.push(logprob);
        } else {
            assert_eq!(mask, 0);
            assert_eq!(logprob, 0.0, "an untrained position has log-prob 0");
        }
    }
    assert_eq!(trained, sampled, "rollout {:?}", sample.rollout_id);
    assert_eq!(
        trained_logprobs, logprobs,
        "rollout {:?}",
        sample.rollout_id
    );
    assert!(
        sample.input_ids.starts_with(&answered[0].prompt_ids),
        "the row starts with the first prompt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trained_tokens_and_log_probs_are_exactly_what_was_sampled_across_tool_turns() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[ADD_CALL, ECHO_CALL]);
    let config = config(4);
    let advantages = config.advantages;
    let (engine, mut groups) = start(&generator, Some(tools(4, None, None)), config, rows(3));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.clean, "{report:?}");

    let mut ids: Vec<u64> = out.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2]);
    for group in &out {
        assert!(group.failures.is_empty(), "{:?}", group.failures);
        assert_eq!(group.samples.len(), 4, "one row per rollout, four rollouts");
        let mut rewards = Vec::new();
        for sample in &group.samples {
            assert_eq!(sample.group_id, group.group_id);
            assert_trained_tokens_are_the_sampled_ones(&generator, sample);
            let answered = generator.answered(sample.rollout_id.0);
            assert_eq!(answered.len(), 3, "two tool turns and the answer");
            assert_eq!(metric(sample, "turns"), 3.0);
            assert_eq!(metric(sample, "tool_calls"), 2.0);
            assert_eq!(metric(sample, "realigned_turns"), 0.0);
            assert_eq!(metric(sample, "forked_turns"), 0.0);
            // The turns' prompts grow by exactly what was sampled and the tool results.
            for pair in answered.windows(2) {
                let mut expected = pair[0].prompt_ids.clone();
                expected.extend_from_slice(&pair[0].sampled);
                assert!(pair[1].prompt_ids.starts_with(&expected));
            }
            let tool_contents: Vec<&str> = sample
                .completion
                .iter()
                .filter(|m| m["role"] == "tool")
                .filter_map(|m| m["content"].as_str())
                .collect();
            assert_eq!(tool_contents, ["5", "hello"]);
            let last = sample.completion.last().expect("messages");
            assert_eq!(last["role"], "assistant");
            assert_eq!(
                last["content"],
                format!("The answer is {}", sample.rollout_id.0)
            );
            assert_eq!(sample.reward, Some(sample.rollout_id.0 as f64));
            rewards.push(CompletionReward::scored(sample.rollout_id.0 as f64));
        }
        let expected = group_advantages(&rewards, &advantages);
        let got: Vec<f64> = group.samples.iter().map(|s| s.advantage).collect();
        assert_eq!(got, expected.advantages);
        assert!(got.iter().any(|a| *a != 0.0), "the rewards differ");
    }
    let stats = report.stats;
    assert_eq!(stats.groups_completed, 3);
    assert_eq!(stats.rollouts_completed, 12);
    assert_eq!(stats.tool_calls, 24);
    assert_eq!(stats.turns, 36);
    assert_eq!(stats.samples, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_that_always_fails_leaves_its_group_scored_on_the_rest() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |call| {
        if call.rollout == 1 {
            Act::Fail
        } else {
            Act::Answer
        }
    });
    let (engine, mut groups) = start(&generator, None, config(4), rows(2));
    let mut out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    out.sort_by_key(|g| g.group_id);
    assert_eq!(out.len(), 2);
    let first = &out[0];
    assert_eq!(first.samples.len(), 3);
    assert!(first.samples.iter().all(|s| s.rollout_id.0 != 1));
    assert_eq!(first.failures.len(), 1);
    let failure = &first.failures[0];
    assert_eq!(failure.rollout_id.0, 1);
    assert_eq!(failure.group_id, 0);
    assert_eq!(failure.line, 1);
    assert_eq!(failure.cause, FailureCause::Generation);
    assert_eq!(failure.attempts, 2, "the default is one retry");
    assert!(failure.message.contains("scripted failure of rollout 1"));
    assert_eq!(out[1].samples.len(), 4);
    assert!(out[1].failures.is_empty());
    // The group's advantages are computed over the three that succeeded.
    let rewards: Vec<_> = [0.0, 2.0, 3.0].map(CompletionReward::scored).to_vec();
    let expected = group_advantages(&rewards, &AdvantageConfig::default());
    let got: Vec<f64> = first.samples.iter().map(|s| s.advantage).collect();
    assert_eq!(got, expected.advantages);
    assert_eq!(report.stats.rollouts_failed, 1);
    assert_eq!(report.stats.rollouts_retried, 1);
    assert_eq!(report.stats.groups_completed, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_generator_fails_only_its_rollout_and_the_loop_goes_on() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |call| {
        if call.rollout == 2 {
            Act::Panic
        } else {
            Act::Answer
        }
    });
    let (engine, mut groups) = start(&generator, None, config(4), rows(3));
    let mut out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    out.sort_by_key(|g| g.group_id);
    assert_eq!(out.len(), 3, "every group is scored");
    assert_eq!(out[0].samples.len(), 3);
    let failure = &out[0].failures[0];
    assert_eq!(failure.rollout_id.0, 2);
    assert_eq!(failure.cause, FailureCause::Panic);
    assert_eq!(failure.attempts, 1, "a panic is a bug: not retried");
    assert!(
        failure.message.contains("scripted panic of rollout 2"),
        "{}",
        failure.message
    );
    assert!(out[1..].iter().all(|g| g.samples.len() == 4));
    assert_eq!(report.stats.rollouts_failed, 1);
    assert!(report.clean);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_fewer_successes_than_min_group_size_is_dropped_and_counted() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |call| {
        if call.rollout == 1 {
            Act::Fail
        } else {
            Act::Answer
        }
    });
    let mut config = config(4);
    config.min_group_size = 4;
    let (engine, mut groups) = start(&generator, None, config, rows(2));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].group_id, 1);
    assert_eq!(report.stats.groups_too_small, 1);
    assert_eq!(report.stats.groups_completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_failing_only_their_first_attempt_are_retried_and_every_group_completes() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[ADD_CALL], |call| {
        if call.attempt == 1 && call.turn == 1 {
            Act::Fail
        } else {
            Act::Answer
        }
    });
    let mut config = config(3);
    config.retries = 1;
    let (engine, mut groups) = start(&generator, Some(tools(2, None, None)), config, rows(2));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 2);
    for group in &out {
        assert!(group.failures.is_empty(), "{:?}", group.failures);
        assert_eq!(group.samples.len(), 3);
        for sample in &group.samples {
            assert_eq!(metric(sample, "attempts"), 2.0);
            // The row holds the second attempt only.
            let second: Vec<u32> = generator
                .answered(sample.rollout_id.0)
                .iter()
                .filter(|l| l.call.attempt == 2)
                .flat_map(|l| l.sampled.clone())
                .collect();
            let trained: Vec<u32> = sample
                .input_ids
                .iter()
                .zip(&sample.completion_mask)
                .filter(|(_, m)| **m == 1)
                .map(|(id, _)| *id)
                .collect();
            assert_eq!(trained, second);
        }
    }
    assert_eq!(report.stats.rollouts_retried, 6);
    assert_eq!(report.stats.rollouts_started, 12);
    assert_eq!(report.stats.rollouts_failed, 0);
    assert_eq!(report.stats.groups_completed, 2);
}

/// The prompt's length in tokens, rendered as the loop renders it (no tools).
fn prompt_len(tokenizer: &ChatTokenizer, row: &DatasetRow) -> u32 {
    let mut render = tokenizer
        .incremental(RenderOptions::generation())
        .expect("the template renders");
    render.push(&row.prompt);
    render.prompt().expect("the prompt renders").ids.len() as u32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_is_clipped_to_the_room_left_in_the_context() {
    let tokenizer = chat_tokenizer();
    let prompt = prompt_len(&tokenizer, &row(1));
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let mut config = config(2);
    config.max_model_len = Some(prompt + 3);
    let (engine, mut groups) = start(&generator, None, config, rows(1));
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    let log = generator.log();
    assert_eq!(
        log.len(),
        2,
        "one turn per rollout: the context is then full"
    );
    for logged in &log {
        assert_eq!(logged.prompt_ids.len() as u32, prompt);
        assert_eq!(logged.max_tokens, 3);
        assert_eq!(logged.sampled.len(), 3);
        assert_eq!(logged.finish, Some(Finish::Length));
    }
    assert_eq!(out.len(), 1);
    for sample in &out[0].samples {
        assert_eq!(sample.input_ids.len() as u32, prompt + 3);
        assert_eq!(metric(sample, "truncated"), 1.0);
    }
}

/// Records the events logged on its thread, each as the text of its fields.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    /// The events recorded so far.
    pub(crate) fn events(&self) -> Vec<String> {
        lock(&self.0).clone()
    }
}

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        let _ = write!(self.0, "{}={value:?} ", field.name());
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = String::new();
        event.record(&mut Fields(&mut text));
        lock(&self.0).push(text);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

// A runtime on the test's thread, so that the recorder sees what the loop logs.
#[tokio::test(flavor = "current_thread")]
async fn a_prompt_longer_than_the_context_fails_naming_both_lengths_without_a_request() {
    let recorder = Recorder::default();
    let _recording = tracing::subscriber::set_default(recorder.clone());
    let tokenizer = chat_tokenizer();
    let prompt = prompt_len(&tokenizer, &row(1));
    let limit = prompt - 1;
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let mut config = config(2);
    config.max_model_len = Some(limit);
    config.retries = 2;
    let (engine, mut groups) = start(&generator, None, config, rows(1));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    // Every rollout of the group failed, so the group is dropped: its failures reach the
    // log and the counters.
    assert!(out.is_empty());
    assert!(generator.log().is_empty(), "nothing was sent");
    assert_eq!(report.stats.rollouts_failed, 2);
    assert_eq!(
        report.stats.rollouts_retried, 0,
        "a prompt too long is final"
    );
    assert_eq!(report.stats.groups_too_small, 1);
    let events = recorder.events();
    let failures: Vec<&String> = events
        .iter()
        .filter(|e| e.contains("rollout failed"))
        .collect();
    assert_eq!(failures.len(), 2, "{events:#?}");
    for failure in failures {
        assert!(
            failure.contains("after 1 attempt(s): prompt_too_long"),
            "{failure}"
        );
        assert!(
            failure.contains(&format!("the prompt is {prompt} tokens")),
            "{failure}"
        );
        assert!(
            failure.contains(&format!("context is {limit}")),
            "{failure}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_stops_admission_at_the_reserved_slots_and_loses_nothing() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let mut config = config(2);
    config.max_inflight = 3;
    config.output_buffer = 1;
    // Admission reserves an output slot per group; the output holds
    // ceil(max_inflight / num_generations) + 1 + output_buffer of them.
    let bound = 3usize.div_ceil(2) as u64 + 1 + 1;
    let (engine, mut groups) = start(&generator, None, config, rows(12));
    wait_until(PATIENCE, "the reserved slots to fill", || {
        engine.health().stats.groups_completed >= bound
    })
    .await;
    // With every slot holding a scored group, admission can take no further row: give it
    // every chance to (it would within a few scheduler ticks).
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let stats = engine.health().stats;
        assert_eq!(stats.groups_admitted, bound, "{stats:?}");
        assert_eq!(stats.groups_completed, bound, "{stats:?}");
    }
    assert!(!engine.health().admission_closed);
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    let mut ids: Vec<u64> = out.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..12).collect::<Vec<_>>());
    assert!(out.iter().all(|g| g.samples.len() == 2));
    assert_eq!(report.stats.groups_admitted, 12);
    assert_eq!(report.stats.groups_completed, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_record_the_model_version_they_were_sampled_under() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[WAIT_CALL]);
    let gate = Gate::new();
    let (engine, mut groups) = start(
        &generator,
        Some(tools(2, Some(gate.clone()), None)),
        config(2),
        rows(1),
    );
    // The second turns are held by the tool before their requests are made (a turn's
    // version is read when its request is sent).
    wait_until(PATIENCE, "both first turns", || {
        engine.health().stats.turns == 2
    })
    .await;
    engine.set_model_version(3).expect("versions grow");
    assert_eq!(engine.health().model_version, 3);
    gate.open();
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].samples.len(), 2);
    for sample in &out[0].samples {
        assert_eq!(
            sample.model_version, 0,
            "a sample carries the oldest version among its tokens"
        );
        assert_eq!(metric(sample, "model_version_min"), 0.0);
        assert_eq!(metric(sample, "model_version_max"), 3.0);
        // The first answer's tokens under 0, the second's under 3, each span exactly an
        // answer's sampled tokens.
        let versions: Vec<u64> = sample.token_versions.iter().map(|s| s.version).collect();
        assert_eq!(versions, [0, 3], "{:?}", sample.token_versions);
        for span in &sample.token_versions {
            assert!(
                sample.completion_mask[span.start..span.end]
                    .iter()
                    .all(|&m| m == 1)
            );
        }
        let sampled: usize = sample.token_versions.iter().map(|s| s.end - s.start).sum();
        assert_eq!(
            sampled,
            sample.completion_mask.iter().filter(|&&m| m == 1).count()
        );
    }
}

/// Two turns per rollout, the first under version 0 and the second under 3 (the version
/// moved while the tool held the rollouts), run with `max_token_staleness` and `rule`:
/// the samples and the end's counters.
async fn run_with_token_bound(
    bound: u64,
    rule: async_grpo_rollout::StaleTokens,
) -> (Vec<ScoredGroup>, async_grpo_rollout::Stats) {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[WAIT_CALL]);
    let gate = Gate::new();
    let mut config = config(2);
    config.max_token_staleness = Some(bound);
    config.stale_tokens = rule;
    let (engine, mut groups) = start(
        &generator,
        Some(tools(2, Some(gate.clone()), None)),
        config,
        rows(1),
    );
    wait_until(PATIENCE, "both first turns", || {
        engine.health().stats.turns == 2
    })
    .await;
    engine.set_model_version(3).expect("versions grow");
    gate.open();
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    (out, report.stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_past_the_per_token_bound_are_masked_or_their_row_dropped_and_counted() {
    use async_grpo_rollout::StaleTokens;
    // Three versions behind is within a bound of 3: nothing changes.
    let (out, stats) = run_with_token_bound(3, StaleTokens::Mask).await;
    assert_eq!(out[0].samples.len(), 2);
    assert_eq!(stats.tokens_offpolicy_masked, 0);
    let trained =
        |s: &rollout_core::TrainingSample| s.completion_mask.iter().filter(|&&m| m == 1).count();
    let whole: Vec<usize> = out[0].samples.iter().map(trained).collect();

    // A bound of 2: the first answer's tokens (version 0) are masked, the second's kept.
    let (out, stats) = run_with_token_bound(2, StaleTokens::Mask).await;
    let mut masked = 0;
    for (sample, whole) in out[0].samples.iter().zip(&whole) {
        let [old, new] = sample.token_versions[..] else {
            panic!("two spans: {:?}", sample.token_versions);
        };
        assert!(
            sample.completion_mask[old.start..old.end]
                .iter()
                .all(|&m| m == 0)
        );
        assert!(
            sample.completion_mask[new.start..new.end]
                .iter()
                .all(|&m| m == 1)
        );
        assert_eq!(trained(sample), new.end - new.start);
        masked += whole - trained(sample);
        // The logprobs stay: the tokens are context now, as the trainer saw them sampled.
        assert!(
            sample.old_log_probs[old.start..old.end]
                .iter()
                .all(|&l| l != 0.0)
        );
    }
    assert_eq!(stats.tokens_offpolicy_masked, masked as u64);
    assert_eq!(stats.rows_offpolicy_dropped, 0);

    // The same bound, dropping: no row is left, and both are counted.
    let (out, stats) = run_with_token_bound(2, StaleTokens::Drop).await;
    assert!(out.iter().all(|g| g.samples.is_empty()), "{out:?}");
    assert_eq!(stats.rows_offpolicy_dropped, 2);
    assert_eq!(stats.tokens_offpolicy_masked, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_model_version_is_refused_with_the_current_one_and_turns_keep_the_current() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[WAIT_CALL]);
    let gate = Gate::new();
    let (engine, mut groups) = start(
        &generator,
        Some(tools(2, Some(gate.clone()), None)),
        config(2),
        rows(1),
    );
    // The second turns are held by the tool: they are sent after the refusal.
    wait_until(PATIENCE, "both first turns", || {
        engine.health().stats.turns == 2
    })
    .await;
    assert_eq!(engine.set_model_version(5), Ok(()));
    assert_eq!(
        engine.set_model_version(2),
        Err(5),
        "a lower version is refused with the current one"
    );
    assert_eq!(engine.model_version(), 5, "the refusal changed nothing");
    assert_eq!(
        engine.set_model_version(5),
        Ok(()),
        "the current version again is no error"
    );
    gate.open();
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 1);
    for sample in &out[0].samples {
        assert_eq!(metric(sample, "model_version_min"), 0.0);
        assert_eq!(
            metric(sample, "model_version_max"),
            5.0,
            "the turns after the refusal were sampled under the current version"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_falls_more_than_max_staleness_behind_is_cancelled_at_once() {
    let tokenizer = chat_tokenizer();
    // Group 0's first turns call a tool held by the gate, and its second turns hang; group 1
    // starts once its slots free up.
    let generator = ScriptedGenerator::new(&tokenizer, &[WAIT_CALL], |call| {
        if call.rollout < 2 && call.turn > 0 {
            Act::Hang
        } else {
            Act::Answer
        }
    });
    let gate = Gate::new();
    let mut config = config(2);
    config.max_inflight = 2;
    config.max_staleness = Some(1);
    let (engine, mut groups) = start(
        &generator,
        Some(tools(1, Some(gate.clone()), None)),
        config,
        rows(2),
    );
    wait_until(PATIENCE, "group 0's first turns", || {
        engine.health().stats.turns == 2
    })
    .await;
    engine.set_model_version(1).expect("versions grow");
    // One version behind is within the bound: the group keeps running. A rollout checks its
    // group's staleness before each step of its conversation (a biased select), so a second
    // turn sent after the gate opens proves the check saw version 1 and let the group go on.
    gate.open();
    wait_until(
        PATIENCE,
        "group 0's second turns, or its cancellation",
        || generator.hanging() == 2 || engine.health().stats.groups_stale > 0,
    )
    .await;
    assert_eq!(
        engine.health().stats.groups_stale,
        0,
        "a group one version behind, with max_staleness 1, was cancelled"
    );
    assert_eq!(generator.hangs_dropped(), 0);
    engine.set_model_version(2).expect("versions grow");
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(
        generator.hangs_dropped(),
        2,
        "the stale requests were dropped"
    );
    assert_eq!(out.len(), 1, "only the fresh group is sent");
    assert_eq!(out[0].group_id, 1);
    assert!(out[0].samples.iter().all(|s| s.model_version == 2));
    assert_eq!(report.stats.groups_stale, 1);
    assert_eq!(report.stats.groups_completed, 1);
    assert!(
        report
            .failures
            .iter()
            .all(|f| f.cause == FailureCause::Stale && f.attempts == 1),
        "{:?}",
        report.failures
    );
    assert!(report.clean);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_deadline_cancels_and_drops_every_hanging_request() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |_| Act::Hang);
    let mut config = config(2);
    config.max_inflight = 4;
    let (engine, mut groups) = start(&generator, None, config, rows(5));
    wait_until(PATIENCE, "every slot to hang", || generator.hanging() == 4).await;
    // A third group is admitted and waits for slots: it is cancelled before it starts.
    wait_until(PATIENCE, "a group waiting for slots", || {
        engine.health().queued == 2
    })
    .await;
    let report = within(
        PATIENCE,
        "the drain",
        engine.shutdown(Duration::from_millis(200)),
    )
    .await;
    assert!(!report.clean);
    assert_eq!(report.cancelled_at_deadline, 4);
    assert!(
        within(PATIENCE, "the output to end", groups.recv())
            .await
            .is_none()
    );
    assert_eq!(generator.hanging(), 4);
    assert_eq!(
        generator.hangs_dropped(),
        4,
        "every hanging request was dropped"
    );
    let stats = report.stats;
    assert_eq!(stats.groups_admitted, 3, "{stats:?}");
    assert_eq!(stats.groups_completed, 0, "{stats:?}");
    assert_eq!(
        stats.groups_cancelled, 3,
        "every admitted group is accounted for"
    );
    assert_eq!(
        stats.rollouts_cancelled, 6,
        "four running, two never started"
    );
    assert!(engine.health().admission_closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_admitted_but_not_started_when_a_drain_begins_is_counted_as_cancelled() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |_| Act::Hang);
    let mut config = config(2);
    config.max_inflight = 2;
    let (engine, mut groups) = start(&generator, None, config, rows(3));
    wait_until(PATIENCE, "the second group to wait for slots", || {
        generator.hanging() == 2 && engine.health().queued == 2
    })
    .await;
    let report = within(
        PATIENCE,
        "the drain",
        engine.shutdown(Duration::from_millis(50)),
    )
    .await;
    assert!(
        within(PATIENCE, "the output to end", groups.recv())
            .await
            .is_none()
    );
    let stats = report.stats;
    assert_eq!(stats.groups_admitted, 2, "{stats:?}");
    assert_eq!(stats.groups_cancelled, 2, "{stats:?}");
    assert_eq!(stats.rollouts_cancelled, 4, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_rollouts_that_finish_in_time() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |_| Act::Gate);
    let mut config = config(2);
    config.max_inflight = 4;
    let (engine, mut groups) = start(&generator, None, config, rows(5));
    wait_until(PATIENCE, "the first requests", || {
        engine.health().in_flight == 4
    })
    .await;
    wait_until(PATIENCE, "a group waiting for slots", || {
        engine.health().queued == 2
    })
    .await;
    let engine = Arc::new(engine);
    let drain = tokio::spawn({
        let engine = Arc::clone(&engine);
        async move { engine.shutdown(Duration::from_secs(30)).await }
    });
    wait_until(PATIENCE, "admission to close", || {
        engine.health().admission_closed
    })
    .await;
    generator.open_gate();
    let out = collect(&mut groups).await;
    let report = within(PATIENCE, "the drain", drain)
        .await
        .expect("the drain task ran");
    assert!(report.clean, "{report:?}");
    assert_eq!(report.cancelled_at_deadline, 0);
    let stats = report.stats;
    // Every group whose rollouts started is out; a group admitted while the drain began
    // but not started is cancelled, and counted.
    let mut ids: Vec<u64> = out.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1], "{stats:?}");
    assert!(out.iter().all(|g| g.samples.len() == 2));
    assert_eq!(stats.groups_completed, 2, "{stats:?}");
    assert_eq!(
        stats.rollouts_cancelled,
        2 * stats.groups_cancelled,
        "{stats:?}"
    );
    assert_eq!(
        stats.groups_admitted,
        stats.groups_completed + stats.groups_cancelled,
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_returns_once_the_rollouts_in_flight_end_and_admits_nothing_until_resumed() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[], |_| Act::Gate);
    let mut config = config(2);
    config.max_inflight = 4;
    let (engine, mut groups) = start(&generator, None, config, rows(3));
    wait_until(PATIENCE, "the first requests", || {
        engine.health().in_flight == 4
    })
    .await;
    let engine = Arc::new(engine);
    let pause = tokio::spawn({
        let engine = Arc::clone(&engine);
        async move { engine.pause(InFlight::Wait).await }
    });
    wait_until(PATIENCE, "the pause to hold admission", || {
        engine.health().paused
    })
    .await;
    assert!(
        !pause.is_finished(),
        "the pause returned while four rollouts were in flight"
    );
    generator.open_gate();
    // Woken by the last slot given back: a pause that missed it would never return.
    within(PATIENCE, "the pause once its rollouts ended", pause)
        .await
        .expect("the pause task ran");
    let health = engine.health();
    assert_eq!(health.in_flight, 0, "{health:?}");
    assert_eq!(
        health.stats.rollouts_started, 4,
        "the third group started while paused: {health:?}"
    );
    engine.resume();
    let out = collect(&mut groups).await;
    assert_eq!(out.len(), 3, "every group once resumed");
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.clean, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_answer_is_continued_and_trained_as_one_answer() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::new(&tokenizer, &[ADD_CALL], |call| {
        if call.rollout == 0 && call.turn == 0 && !call.continuation {
            Act::Abort(3)
        } else {
            Act::Answer
        }
    });
    let (engine, mut groups) = start(&generator, Some(tools(2, None, None)), config(2), rows(1));
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;

    let answered = generator.answered(0);
    assert_eq!(
        answered.len(),
        3,
        "an aborted segment, its continuation, the answer"
    );
    let (aborted, continued) = (&answered[0], &answered[1]);
    assert_eq!(aborted.finish, Some(Finish::Abort));
    assert_eq!(aborted.sampled.len(), 3);
    assert!(continued.call.continuation);
    assert_eq!(continued.call.turn, 0);
    let mut expected = aborted.prompt_ids.clone();
    expected.extend_from_slice(&aborted.sampled);
    assert_eq!(continued.prompt_ids, expected);
    assert_eq!(continued.max_tokens, aborted.max_tokens - 3);
    let mut whole = aborted.sampled.clone();
    whole.extend_from_slice(&continued.sampled);
    assert_eq!(whole, generator.answer(0, 0));

    let samples: Vec<_> = out[0]
        .samples
        .iter()
        .filter(|s| s.rollout_id.0 == 0)
        .collect();
    assert_eq!(samples.len(), 1, "one training row");
    assert_trained_tokens_are_the_sampled_ones(&generator, samples[0]);
    assert_eq!(
        metric(samples[0], "tool_calls"),
        1.0,
        "the joined answer was parsed"
    );
    assert_eq!(samples[0].reward, Some(0.0));
}

fn bad_row(line: usize) -> Result<DatasetRow, DatasetError> {
    Err(DatasetError::Row {
        path: "data.jsonl".to_owned(),
        line,
        reason: "expected \"prompt\" to be a string or a list of messages".to_owned(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_dataset_row_stops_admission_and_is_reported() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let rows = vec![Ok(row(1)), bad_row(2), Ok(row(3))];
    let (engine, mut groups) = start(&generator, None, config(2), rows);
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].group_id, 0);
    let error = report.error.expect("admission stopped on an error");
    assert!(error.contains("data.jsonl:2"), "{error}");
    assert_eq!(report.stats.groups_admitted, 1);
    assert_eq!(report.stats.bad_rows, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_dataset_rows_are_skipped_counted_and_listed_when_asked() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let rows = vec![Ok(row(1)), bad_row(2), Ok(row(3)), bad_row(4)];
    let mut config = config(2);
    config.skip_bad_rows = true;
    let (engine, mut groups) = start(&generator, None, config, rows);
    let mut out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    out.sort_by_key(|g| g.group_id);
    let prompts: Vec<String> = out
        .iter()
        .map(|g| g.samples[0].prompt[0]["content"].to_string())
        .collect();
    assert_eq!(prompts.len(), 2);
    assert!(prompts[0].contains("question 1"), "{prompts:?}");
    assert!(prompts[1].contains("question 3"), "{prompts:?}");
    assert!(report.error.is_none(), "{:?}", report.error);
    assert_eq!(report.stats.bad_rows, 2);
    assert_eq!(report.bad_rows.len(), 2);
    assert!(report.bad_rows[0].contains("data.jsonl:2"));
    assert!(report.bad_rows[1].contains("data.jsonl:4"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_keeps_beating_while_sync_tools_block() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[BLOCK_CALL]);
    let block = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let mut config = config(4);
    config.max_inflight = 4;
    let (engine, mut groups) = start(
        &generator,
        Some(tools(4, None, Some(Arc::clone(&block)))),
        config,
        rows(1),
    );
    wait_until(PATIENCE, "four tools blocking at once", || {
        block.0.load(Ordering::SeqCst) == 4
    })
    .await;
    let mut samples_while_blocked = 0;
    for _ in 0..10 {
        let age = engine.health().heartbeat_age;
        if block.1.load(Ordering::SeqCst) > 0 {
            break;
        }
        assert!(
            age < Duration::from_secs(1),
            "the heartbeat is {age:?} old while tools block"
        );
        samples_while_blocked += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        samples_while_blocked >= 3,
        "only {samples_while_blocked} samples were taken while the tools blocked"
    );
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 1);
    assert_eq!(block.1.load(Ordering::SeqCst), 4);
}

/// A later turn's prompt is built off the runtime: on a single-threaded runtime, a task that
/// ticks every millisecond keeps ticking while a tool result takes long to render (here a
/// template that loops over each tool message; in a run, a long result through a real
/// tokenizer). Built on the runtime's one thread, the render would stop every tick.
#[tokio::test(flavor = "current_thread")]
async fn a_later_turn_s_prompt_is_built_off_the_runtime() {
    let slow = CHATML_WITH_TOOLS.replace(
        "{% elif m.role == \"tool\" %}",
        "{% elif m.role == \"tool\" %}{% for i in range(2000) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
    );
    assert_ne!(
        slow, CHATML_WITH_TOOLS,
        "the template has a tool branch to slow down"
    );
    let template = ChatTemplate::new("slow-tools", &slow).expect("the template compiles");
    let base = chat_tokenizer();
    let special = json!({ "eos_token": "<|im_end|>" })
        .as_object()
        .cloned()
        .unwrap_or_default();
    let tokenizer = ChatTokenizer::new(base.tokenizer().clone(), template, special);
    let ticks = Arc::new(AtomicUsize::new(0));
    let ticker = tokio::spawn({
        let ticks = Arc::clone(&ticks);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                ticks.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    // The ticks seen by each turn's request: between them, the tool ran and the second
    // prompt was built.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let generator = ScriptedGenerator::new(&tokenizer, &[ADD_CALL], {
        let (ticks, seen) = (Arc::clone(&ticks), Arc::clone(&seen));
        move |_| {
            lock(&seen).push(ticks.load(Ordering::SeqCst));
            Act::Answer
        }
    });
    let mut config = config(1);
    config.min_group_size = 1;
    config.max_inflight = 1;
    let (engine, mut groups) = Engine::builder(generator.clone(), tokenizer, scorer())
        .config(config)
        .tools(tools(1, None, None))
        .start(rows(1))
        .expect("the loop starts");
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    ticker.abort();
    assert_eq!(out.len(), 1, "the group is scored");
    let seen = lock(&seen).clone();
    assert_eq!(seen.len(), 2, "two turns: the call, then the answer");
    let during = seen[1] - seen[0];
    assert!(
        during >= 20,
        "the runtime ticked {during} times while the second prompt was built: it was built on \
         the runtime's thread"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_groups_stops_admission_after_that_many_groups() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let mut config = config(2);
    config.max_groups = Some(2);
    let (engine, mut groups) = start(&generator, None, config, rows(6));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    let mut ids: Vec<u64> = out.iter().map(|g| g.group_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1]);
    assert_eq!(report.stats.groups_admitted, 2);
    let rollouts: HashSet<u64> = generator.log().iter().map(|l| l.call.rollout).collect();
    assert_eq!(rollouts, HashSet::from([0, 1, 2, 3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_turns_bounds_the_generation_calls_of_a_rollout() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[ADD_CALL, ADD_CALL, ADD_CALL]);
    let mut config = config(2);
    config.max_turns = 2;
    let (engine, mut groups) = start(&generator, Some(tools(2, None, None)), config, rows(2));
    let out = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(out.len(), 2);
    for rollout in 0..4 {
        assert_eq!(generator.answered(rollout).len(), 2, "rollout {rollout}");
    }
    assert_eq!(report.stats.turns, 8);
    for sample in out.iter().flat_map(|g| &g.samples) {
        assert_eq!(metric(sample, "turns"), 2.0);
        assert_trained_tokens_are_the_sampled_ones(&generator, sample);
    }
}

/// A loop-owning agent in-process: it asks for `turns` turns, each prompt the previous one,
/// the ids sampled and a user message; it logs what it was answered. `None` fails its run.
struct TestAgent {
    turns: Option<usize>,
    answers: Arc<Mutex<Vec<Result<Sampled, SampleRefused>>>>,
}

impl Agent for TestAgent {
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>> {
        let (turns, answers) = (self.turns, Arc::clone(&self.answers));
        Box::pin(async move {
            let Some(turns) = turns else {
                return Err(AgentError("the agent crashed at start".to_owned()));
            };
            let tokenizer = chat_tokenizer();
            let encode = |text: &str| {
                tokenizer
                    .tokenizer()
                    .encode(text, false)
                    .expect("encodes")
                    .get_ids()
                    .to_vec()
            };
            let mut prompt = encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
            for _ in 0..turns {
                let answer = run.sampler.sample(prompt.clone(), None).await;
                if let Ok(sampled) = &answer {
                    prompt.extend_from_slice(&sampled.token_ids);
                    prompt.extend(encode(
                        "\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n",
                    ));
                }
                lock(&answers).push(answer);
            }
            Ok(AgentOutcome::new(
                vec![Message::user("Hi")],
                vec![Message::assistant(format!(
                    "The answer is {}",
                    run.rollout_id.0
                ))],
            ))
        })
    }
}

fn start_agent(
    generator: &ScriptedGenerator,
    agent: TestAgent,
    config: RolloutConfig,
    rows: Vec<Result<DatasetRow, DatasetError>>,
) -> (Engine<ScriptedGenerator>, Groups) {
    Engine::builder(generator.clone(), chat_tokenizer(), scorer())
        .config(config)
        .agent(Arc::new(agent))
        .start(rows)
        .expect("the loop starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_s_turns_are_sampled_by_the_engine_and_trained_exactly() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let answers = Arc::new(Mutex::new(Vec::new()));
    let agent = TestAgent {
        turns: Some(3),
        answers: Arc::clone(&answers),
    };
    let (engine, mut groups) = start_agent(&generator, agent, config(2), rows(2));
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    let samples: Vec<_> = out.iter().flat_map(|g| &g.samples).collect();
    assert_eq!(samples.len(), 4, "one row per rollout");
    for sample in samples {
        assert_trained_tokens_are_the_sampled_ones(&generator, sample);
        assert_eq!(metric(sample, "turns"), 3.0);
        assert_eq!(metric(sample, "forked_turns"), 0.0);
        assert_eq!(metric(sample, "capture_forks"), 0.0);
        // The agent's transcript is the sample's.
        assert_eq!(sample.prompt, vec![Message::user("Hi")]);
        let reward = sample.rewards["answer"].as_f64();
        assert_eq!(reward, Some(sample.rollout_id.0 as f64));
    }
    assert!(lock(&answers).iter().all(Result::is_ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_past_max_turns_are_refused_and_the_rollout_is_still_scored() {
    let tokenizer = chat_tokenizer();
    let generator = ScriptedGenerator::answering(&tokenizer, &[]);
    let answers = Arc::new(Mutex::new(Vec::new()));
    let agent = TestAgent {
        turns: Some(4),
        answers: Arc::clone(&answers),
    };
    let mut config = config(2);
    config.max_turns = 2;
    let (engine, mut groups) = start_agent(&generator, agent, config, rows(1));
    let out = collect(&mut groups).await;
    engine.shutdown(Duration::from_secs(10)).await;
    let samples: Vec<_> = out.iter().flat_map(|g| &g.samples).collect();
    assert_eq!(samples.len(), 2);
    assert!(samples.iter().all(|s| metric(s, "turns") == 2.0));
    let refused = lock(&answers)
        .iter()
        .filter(|a| matches!(a, Err(SampleRefused::MaxTurns(2))))
        .count();
    assert_eq!(refused, 4, "two refused turns per rollout");
    assert_eq!(generator.log().len(), 4, "refused turns reach no server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_samples_or_fails_fails_its_rollout_with_that_cause() {
    for (turns, cause) in [
        (Some(0), FailureCause::EmptyTrace),
        (None, FailureCause::Agent),
    ] {
        let tokenizer = chat_tokenizer();
        let generator = ScriptedGenerator::answering(&tokenizer, &[]);
        let agent = TestAgent {
            turns,
            answers: Arc::new(Mutex::new(Vec::new())),
        };
        let mut config = config(2);
        config.max_failure_rate = None;
        let (engine, mut groups) = start_agent(&generator, agent, config, rows(1));
        let out = collect(&mut groups).await;
        let report = engine.shutdown(Duration::from_secs(10)).await;
        assert!(out.iter().all(|g| g.samples.is_empty()), "{cause:?}");
        assert_eq!(report.stats.rollouts_failed, 2, "{cause:?}");
        assert!(
            report.failures.iter().all(|f| f.cause == cause),
            "{:?}",
            report.failures
        );
    }
}

/// An agent with a side conversation: conversation 0 asks once for a title, between the two
/// turns of conversation 1, the main one (each prompt the previous, the ids sampled and a
/// user message). With `keep_main` its outcome keeps only the main conversation's rows.
struct SideAgent {
    keep_main: bool,
}

impl Agent for SideAgent {
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>> {
        let keep_main = self.keep_main;
        Box::pin(async move {
            let tokenizer = chat_tokenizer();
            let encode = |text: &str| {
                tokenizer
                    .tokenizer()
                    .encode(text, false)
                    .expect("encodes")
                    .get_ids()
                    .to_vec()
            };
            let failed = |e: SampleRefused| AgentError(e.to_string());
            let mut main = encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
            let first = run.sampler.sample_in(1, main.clone(), None).await;
            main.extend_from_slice(&first.map_err(failed)?.token_ids);
            main.extend(encode(
                "\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n",
            ));
            let title = encode("<|im_start|>user\nA title?<|im_end|>\n<|im_start|>assistant\n");
            run.sampler
                .sample_in(0, title, None)
                .await
                .map_err(failed)?;
            run.sampler.sample_in(1, main, None).await.map_err(failed)?;
            let outcome = AgentOutcome::new(
                vec![Message::user("Hi")],
                vec![Message::assistant(format!(
                    "The answer is {}",
                    run.rollout_id.0
                ))],
            );
            Ok(if keep_main {
                outcome.main_conversation(1)
            } else {
                outcome
            })
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_s_side_conversation_is_counted_not_trained_when_it_keeps_its_main_one() {
    for (keep_main, rows_per_rollout) in [(true, 1), (false, 2)] {
        let tokenizer = chat_tokenizer();
        let generator = ScriptedGenerator::answering(&tokenizer, &[]);
        let (engine, mut groups) = Engine::builder(generator.clone(), chat_tokenizer(), scorer())
            .config(config(2))
            .agent(Arc::new(SideAgent { keep_main }))
            .start(rows(1))
            .expect("the loop starts");
        let out = collect(&mut groups).await;
        engine.shutdown(Duration::from_secs(10)).await;
        let samples: Vec<_> = out.iter().flat_map(|g| &g.samples).collect();
        assert_eq!(
            samples.len(),
            2 * rows_per_rollout,
            "keep_main: {keep_main}"
        );
        for sample in &samples {
            // Each conversation is reconciled apart: the title between the main turns
            // forks nothing.
            assert_eq!(metric(sample, "forked_turns"), 0.0);
            assert_eq!(metric(sample, "turns"), 3.0, "every turn sampled counts");
        }
        if keep_main {
            for sample in &samples {
                assert_eq!(metric(sample, "agent_side_conversations"), 1.0);
                assert_eq!(metric(sample, "agent_side_turns"), 1.0);
                // Trained on exactly the main conversation's answers: the first and the last.
                let answered = generator.answered(sample.rollout_id.0);
                let main: Vec<u32> = [&answered[0], &answered[2]]
                    .iter()
                    .flat_map(|l| l.sampled.clone())
                    .collect();
                let trained: Vec<u32> = (sample.input_ids.iter().zip(&sample.completion_mask))
                    .filter(|(_, mask)| **mask == 1)
                    .map(|(id, _)| *id)
                    .collect();
                assert_eq!(trained, main);
            }
        } else {
            assert!(
                samples
                    .iter()
                    .all(|s| !s.metrics.contains_key("agent_side_turns"))
            );
        }
    }
}
