//! Session lifecycle on the real rollout loop against the vLLM simulator: every session is
//! created and closed exactly once on every path (finished, failed, timed out, panicked,
//! drain-cancelled, engine dropped), creation is retried and its failure isolated, open
//! sessions never outnumber `max_inflight`, sync sessions run on the tool pool, verify's
//! reward is the `env` column, what the environment says beyond it is kept in the rows, and
//! its tools are counted in the engine's metrics.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, LazyLock, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_grpo_harness::{
    Harness, HarnessConfig, Session, SessionError, SessionFactory, SyncSession, SyncSessionFactory,
    Task, ToolOutput, Verification,
};
use futures::future::BoxFuture;
use rollout::{DatasetError, DatasetRow, Engine, FailureCause, RolloutConfig, ScoredGroup};
use rollout_core::{ChatTemplate, ChatTokenizer, Message};
use scoring::{Scorer, ScorerConfig};
use serde_json::{Map, Value, json};
use test_support::{wait_until, within};
use tokenizers::Tokenizer;
use tool_dispatch::{DispatcherConfig, Registry, ToolDispatcher, ToolSpec};
use vllm_client::{Client, ClientConfig};
use vllm_sim::{SimConfig, Simulator};

/// A bound on every wait, so that a broken lifecycle fails instead of hanging the suite.
const PATIENCE: Duration = Duration::from_secs(60);

/// ChatML with tools, as the simulator's tokenizer reads it.
const CHATML_WITH_TOOLS: &str =
    include_str!("../../rollout/tests/fixtures/chatml_with_tools.jinja");

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

/// What the test sessions do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// The tool answers; verify gives a reward from the episode id.
    Finish,
    /// The tool says the episode is done.
    Done,
    /// The tool reports the environment broken.
    Break,
    /// The tool never answers.
    HangTool,
    /// Verify never answers.
    HangVerify,
    /// Verify panics.
    PanicVerify,
    /// The tool and verify say more than a reward: metadata, metrics, artifacts, not done.
    Report,
}

/// Counts sessions: created, closed, open at most at once; and what verify gave.
#[derive(Debug, Default)]
struct Counts {
    attempts: AtomicUsize,
    created: AtomicUsize,
    closed: AtomicUsize,
    open: AtomicUsize,
    max_open: AtomicUsize,
    tool_threads: Mutex<Vec<String>>,
    verified: Mutex<BTreeMap<String, f64>>,
}

impl Counts {
    fn opened(&self) {
        self.created.fetch_add(1, Ordering::SeqCst);
        let open = self.open.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_open.fetch_max(open, Ordering::SeqCst);
    }

    fn closed(&self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
        self.closed.fetch_add(1, Ordering::SeqCst);
    }

    fn created(&self) -> usize {
        self.created.load(Ordering::SeqCst)
    }

    fn closes(&self) -> usize {
        self.closed.load(Ordering::SeqCst)
    }
}

/// The reward verify gives an episode: from its id, so that each differs.
fn reward_of(episode_id: &str) -> f64 {
    episode_id.len() as f64 / 10.0 + episode_id.bytes().map(f64::from).sum::<f64>() / 1000.0
}

fn calculator() -> ToolSpec {
    ToolSpec::new("calculator", "Evaluates an expression").parameters(json!({
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }))
}

struct TestSession {
    counts: Arc<Counts>,
    behaviour: Behaviour,
    episode_id: String,
}

impl TestSession {
    fn answer(&self) -> Result<ToolOutput, SessionError> {
        match self.behaviour {
            Behaviour::Done => Ok(ToolOutput::new("5").done()),
            Behaviour::Break => Err(SessionError::fatal("the sandbox died")),
            Behaviour::Report => {
                let mut output = ToolOutput::new("5");
                output.metadata.insert("page".to_owned(), json!(3));
                Ok(output)
            }
            _ => Ok(ToolOutput::new("5")),
        }
    }

    fn verification(&self) -> Verification {
        let reward = reward_of(&self.episode_id);
        let mut verified = self.counts.verified.lock().expect("not poisoned");
        verified.insert(self.episode_id.clone(), reward);
        let mut verification = Verification::reward(reward);
        if self.behaviour == Behaviour::Report {
            verification.done = false;
            verification.metrics.insert("steps".to_owned(), 2.0);
            verification
                .artifacts
                .insert("log".to_owned(), json!("all good"));
        }
        verification
    }
}

impl Session for TestSession {
    fn initial_messages(&self) -> Vec<Message> {
        vec![Message::system("You are in a test environment.")]
    }

    fn tools(&self) -> Vec<ToolSpec> {
        vec![calculator()]
    }

    fn call_tool(
        &self,
        _name: &str,
        _arguments: Map<String, Value>,
    ) -> BoxFuture<'_, Result<ToolOutput, SessionError>> {
        Box::pin(async move {
            if self.behaviour == Behaviour::HangTool {
                std::future::pending::<()>().await;
            }
            self.answer()
        })
    }

    fn verify(&self, _transcript: &[Message]) -> BoxFuture<'_, Result<Verification, SessionError>> {
        Box::pin(async move {
            match self.behaviour {
                Behaviour::HangVerify => std::future::pending().await,
                Behaviour::PanicVerify => panic!("verify exploded"),
                _ => Ok(self.verification()),
            }
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.counts.closed() })
    }
}

/// Async sessions; the first `fail_first` creates fail.
struct TestFactory {
    counts: Arc<Counts>,
    behaviour: Behaviour,
    fail_first: usize,
}

impl SessionFactory for TestFactory {
    fn create(&self, task: Task) -> BoxFuture<'_, Result<Box<dyn Session>, SessionError>> {
        Box::pin(async move {
            let attempt = self.counts.attempts.fetch_add(1, Ordering::SeqCst);
            if attempt < self.fail_first {
                return Err(SessionError::new("the sandbox service is busy"));
            }
            assert!(
                task.row.contains_key("prompt"),
                "the task is the dataset row"
            );
            self.counts.opened();
            Ok(Box::new(TestSession {
                counts: Arc::clone(&self.counts),
                behaviour: self.behaviour,
                episode_id: task.episode_id,
            }) as Box<dyn Session>)
        })
    }
}

/// The same sessions, blocking; each call notes the thread it ran on.
struct SyncTestFactory(Arc<Counts>);

struct SyncTestSession(TestSession);

impl SyncTestSession {
    fn note_thread(&self) {
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        self.0
            .counts
            .tool_threads
            .lock()
            .expect("not poisoned")
            .push(name);
    }
}

impl SyncSession for SyncTestSession {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![calculator()]
    }

    fn call_tool(
        &self,
        _name: &str,
        _arguments: Map<String, Value>,
    ) -> Result<ToolOutput, SessionError> {
        self.note_thread();
        self.0.answer()
    }

    fn verify(&self, _transcript: &[Message]) -> Result<Verification, SessionError> {
        self.note_thread();
        Ok(self.0.verification())
    }

    fn close(&self) {
        self.note_thread();
        self.0.counts.closed();
    }
}

impl SyncSessionFactory for SyncTestFactory {
    fn create(&self, task: &Task) -> Result<Box<dyn SyncSession>, SessionError> {
        self.0.attempts.fetch_add(1, Ordering::SeqCst);
        self.0.opened();
        let session = SyncTestSession(TestSession {
            counts: Arc::clone(&self.0),
            behaviour: Behaviour::Finish,
            episode_id: task.episode_id.clone(),
        });
        session.note_thread();
        Ok(Box::new(session))
    }
}

fn rows(count: usize) -> Vec<Result<DatasetRow, DatasetError>> {
    (1..=count)
        .map(|line| {
            Ok(DatasetRow {
                source: "rows.jsonl".into(),
                line,
                prompt: vec![Message::user(format!("What is 2 + 3? (question {line})"))],
                columns: Map::new(),
            })
        })
        .collect()
}

/// A running loop against the simulator with an environment.
struct Run {
    engine: Engine<Client>,
    groups: rollout::Groups,
    simulator: Simulator,
}

async fn start(
    environment: impl FnOnce(ToolDispatcher) -> Harness,
    config: RolloutConfig,
    rows_count: usize,
) -> Run {
    let tokenizer = chat_tokenizer();
    let mut sim = SimConfig::new(tokenizer.tokenizer().clone());
    sim.tool_rounds = 1;
    let simulator = Simulator::start(sim, "127.0.0.1:0".parse().expect("an address"))
        .await
        .expect("the simulator starts");
    let client =
        Client::new(ClientConfig::with_servers([simulator.url()]).model("sim")).expect("a client");
    within(PATIENCE, "the simulator", client.wait_until_ready(PATIENCE))
        .await
        .expect("the simulator is ready");
    let pool = ToolDispatcher::new(
        Registry::new(),
        DispatcherConfig::new(config.max_inflight).thread_name("env-pool"),
    );
    let harness = environment(pool.clone());
    let scorer = Scorer::new(
        vec![scoring::builtin::environment()],
        ScorerConfig::default().threads(1),
    )
    .expect("a scorer");
    let (engine, groups) = Engine::builder(client, tokenizer, scorer)
        .tools(pool)
        .environment(Arc::new(harness))
        .config(config)
        .start(rows(rows_count))
        .expect("the loop starts");
    Run {
        engine,
        groups,
        simulator,
    }
}

fn config(max_inflight: usize) -> RolloutConfig {
    let mut config = RolloutConfig::default();
    config.num_generations = 2;
    config.min_group_size = 1;
    config.max_inflight = max_inflight;
    config.max_tokens = 128;
    config.max_turns = 4;
    config.retries = 0;
    config.max_failure_rate = None;
    config
}

fn asynchronous(
    counts: &Arc<Counts>,
    behaviour: Behaviour,
) -> impl FnOnce(ToolDispatcher) -> Harness {
    let factory = TestFactory {
        counts: Arc::clone(counts),
        behaviour,
        fail_first: 0,
    };
    move |pool| Harness::new("test-env", factory, pool)
}

async fn collect(run: &mut Run) -> Vec<ScoredGroup> {
    let mut out = Vec::new();
    while let Some(group) = within(PATIENCE, "the next group", run.groups.recv()).await {
        out.push(group);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_rollouts_close_every_session_and_verify_is_the_env_reward() {
    let counts = Arc::new(Counts::default());
    let mut run = start(asynchronous(&counts, Behaviour::Finish), config(3), 6).await;
    let groups = collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let samples: Vec<_> = groups.iter().flat_map(|g| &g.samples).collect();
    assert_eq!(samples.len(), 12);
    assert_eq!(counts.created(), 12);
    assert_eq!(counts.closes(), 12, "every session closed once");
    assert!(
        counts.max_open.load(Ordering::SeqCst) <= 3,
        "open sessions never outnumber max_inflight"
    );
    let verified = counts.verified.lock().expect("not poisoned").clone();
    for sample in &samples {
        let episode = format!("r{}-a1", sample.rollout_id.0);
        assert_eq!(
            sample.rewards["env"].as_f64(),
            Some(verified[&episode]),
            "the env column is what verify returned"
        );
        // The session's tool was rendered, called, and its result went back to the model.
        assert!(
            sample
                .completion
                .iter()
                .any(|m| m["role"] == "tool" && m["content"] == "5")
        );
        assert_eq!(sample.metrics["env_verified"], 1.0);
        // What the model was prompted with: the session's initial messages, then the row's.
        assert_eq!(
            sample.prompt[0],
            Message::system("You are in a test environment.")
        );
        assert_eq!(sample.prompt[1].role(), "user");
    }
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_done_tool_ends_the_episode_and_the_last_tool_calls_stay_in_the_completion() {
    let counts = Arc::new(Counts::default());
    let mut run = start(asynchronous(&counts, Behaviour::Done), config(2), 1).await;
    let groups = collect(&mut run).await;
    run.engine.shutdown(Duration::from_secs(10)).await;
    let samples: Vec<_> = groups.iter().flat_map(|g| &g.samples).collect();
    assert_eq!(samples.len(), 2);
    for sample in samples {
        assert_eq!(sample.metrics["turns"], 1.0, "no turn after done");
        assert_eq!(sample.metrics["env_done"], 1.0);
        let assistant = sample
            .completion
            .iter()
            .rev()
            .find(|m| m["role"] == "assistant")
            .expect("an assistant message");
        assert!(
            assistant.as_map().get("tool_calls").is_some(),
            "the final assistant message keeps its tool calls: {assistant}"
        );
        assert!(sample.rewards["env"].is_number());
    }
    assert_eq!(counts.closes(), counts.created());
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_environment_says_is_kept_in_the_rows_and_its_tools_are_counted_as_the_engines() {
    let counts = Arc::new(Counts::default());
    let mut run = start(asynchronous(&counts, Behaviour::Report), config(2), 2).await;
    let groups = collect(&mut run).await;
    let samples: Vec<_> = groups.iter().flat_map(|g| &g.samples).collect();
    assert_eq!(samples.len(), 4);
    let mut calls = 0.0;
    for sample in &samples {
        assert_eq!(sample.metrics["env/steps"], 2.0, "verify's metrics");
        assert_eq!(sample.metrics["env_verify_done"], 0.0, "verify's done");
        let tool_calls = sample.metrics["tool_calls"];
        assert!(tool_calls >= 1.0, "the simulator calls the tool");
        calls += tool_calls;
        let tools =
            vec![json!({"name": "calculator", "metadata": {"page": 3}}); tool_calls as usize];
        assert_eq!(
            Value::Object(sample.environment.clone()),
            json!({"artifacts": {"log": "all good"}, "tools": tools}),
            "verify's artifacts and each call's metadata"
        );
    }
    // The sessions' tools are counted where `[[tools]]` are: the engine's metrics.
    let metrics = run.engine.metrics();
    let tools = metrics.tools.clone().expect("the engine runs tools");
    let calculator = tools
        .tool("calculator")
        .expect("the sessions' tool is counted");
    assert_eq!(
        (calculator.calls as f64, calculator.ok as f64),
        (calls, calls)
    );
    assert_eq!(calculator.latency.count as f64, calls);
    assert!(
        metrics
            .values()
            .contains(&("tools/calculator/calls".to_owned(), calls)),
        "the bridge's values and the summary read the same counts"
    );
    assert!(tools.tool("session_verify").is_none() && tools.tool("session_create").is_none());
    run.engine.shutdown(Duration::from_secs(10)).await;
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_environment_fails_its_rollouts_and_still_closes_their_sessions() {
    let counts = Arc::new(Counts::default());
    let mut run = start(asynchronous(&counts, Behaviour::Break), config(2), 2).await;
    let groups = collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert!(groups.iter().all(|g| g.samples.is_empty()));
    assert_eq!(report.failures.len(), 4);
    for failure in &report.failures {
        assert_eq!(failure.cause, FailureCause::Environment);
        assert!(
            failure.message.contains("test-env: the sandbox died"),
            "{failure}"
        );
    }
    assert_eq!(counts.created(), 4);
    assert_eq!(counts.closes(), 4);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_past_its_deadline_closes_its_session() {
    let counts = Arc::new(Counts::default());
    let mut config = config(2);
    config.rollout_timeout = Duration::from_millis(300);
    let mut run = start(asynchronous(&counts, Behaviour::HangVerify), config, 1).await;
    collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.failures.len(), 2);
    assert!(
        report
            .failures
            .iter()
            .all(|f| f.cause == FailureCause::Deadline)
    );
    assert_eq!(counts.created(), 2);
    assert_eq!(counts.closes(), 2);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_session_fails_its_rollout_and_is_closed() {
    let counts = Arc::new(Counts::default());
    let mut run = start(asynchronous(&counts, Behaviour::PanicVerify), config(2), 1).await;
    collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.failures.len(), 2);
    assert!(
        report
            .failures
            .iter()
            .all(|f| f.cause == FailureCause::Panic)
    );
    assert_eq!(counts.created(), 2);
    assert_eq!(counts.closes(), 2);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_deadline_closes_the_sessions_it_cancels() {
    let counts = Arc::new(Counts::default());
    let run = start(asynchronous(&counts, Behaviour::HangTool), config(4), 2).await;
    wait_until(PATIENCE, "four sessions open", || counts.created() == 4).await;
    let report = within(
        PATIENCE,
        "the drain",
        run.engine.shutdown(Duration::from_millis(200)),
    )
    .await;
    assert_eq!(report.cancelled_at_deadline, 4);
    assert_eq!(counts.closes(), 4, "closed before shutdown returned");
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_engine_closes_every_open_session() {
    let counts = Arc::new(Counts::default());
    let run = start(asynchronous(&counts, Behaviour::HangTool), config(4), 2).await;
    wait_until(PATIENCE, "four sessions open", || counts.created() == 4).await;
    drop(run.engine);
    wait_until(PATIENCE, "every session closed", || counts.closes() == 4).await;
    assert_eq!(counts.created(), 4);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_creation_is_retried_with_backoff() {
    let counts = Arc::new(Counts::default());
    let factory = TestFactory {
        counts: Arc::clone(&counts),
        behaviour: Behaviour::Finish,
        fail_first: 2,
    };
    let config = config(1);
    let harness = move |pool| {
        Harness::new("test-env", factory, pool).config(
            HarnessConfig::default()
                .create_attempts(3)
                .create_backoff(Duration::from_millis(1)),
        )
    };
    let mut run = start(harness, config, 1).await;
    let groups = collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(groups[0].samples.len(), 2);
    assert_eq!(
        counts.attempts.load(Ordering::SeqCst),
        4,
        "two failures, then one each"
    );
    assert_eq!(counts.closes(), 2);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_cannot_be_created_fails_its_rollout_alone_with_cause_session_create() {
    let counts = Arc::new(Counts::default());
    let factory = TestFactory {
        counts: Arc::clone(&counts),
        behaviour: Behaviour::Finish,
        fail_first: 2,
    };
    let harness = move |pool| {
        Harness::new("test-env", factory, pool).config(
            HarnessConfig::default()
                .create_attempts(2)
                .create_backoff(Duration::from_millis(1)),
        )
    };
    // One rollout at a time: the first uses up the two failures, the second succeeds.
    let mut run = start(harness, config(1), 1).await;
    let groups = collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.failures.len(), 1);
    let failure = &report.failures[0];
    assert_eq!(failure.cause, FailureCause::SessionCreate);
    assert!(
        failure
            .message
            .contains("test-env: no session after 2 attempt(s): the sandbox service is busy"),
        "{failure}"
    );
    assert_eq!(groups[0].samples.len(), 1, "the sibling rollout goes on");
    assert_eq!(counts.created(), 1);
    assert_eq!(counts.closes(), 1);
    run.simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_sessions_run_every_call_on_the_tool_pool() {
    let counts = Arc::new(Counts::default());
    let factory = SyncTestFactory(Arc::clone(&counts));
    let mut run = start(
        move |pool| Harness::new_sync("sync-env", factory, pool),
        config(2),
        2,
    )
    .await;
    let groups = collect(&mut run).await;
    let report = run.engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(groups.iter().map(|g| g.samples.len()).sum::<usize>(), 4);
    assert_eq!(counts.created(), 4);
    assert_eq!(counts.closes(), 4);
    let threads = counts.tool_threads.lock().expect("not poisoned").clone();
    // create, a tool call, verify and close for each of the 4 sessions.
    assert_eq!(threads.len(), 16, "{threads:?}");
    assert!(
        threads.iter().all(|name| name.starts_with("env-pool")),
        "every sync call ran on the tool pool, never on the runtime: {threads:?}"
    );
    run.simulator.stop().await;
}
