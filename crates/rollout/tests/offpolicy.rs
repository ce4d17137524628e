//! Rows for off-policy trainers, against the simulator through vllm-client's generator: a
//! weight update in flight in continue mode keeps every token with the version of the
//! weights that sampled it; routing replay rows carry what the server routed, a re-score
//! agrees, and a server that does not report routing, or reports it wrong, is refused.

use std::{sync::Arc, time::Duration};

use async_grpo_rollout::{
    DatasetError, DatasetRow, Engine, FailureCause, GenerateError, GenerateRequest, Generation,
    Generator, InFlight, RolloutConfig, ScoredGroup,
};
use rollout_core::{Message, TrainingSample};
use serde_json::Map;
use test_support::{wait_until, within};
use tool_dispatch::{DispatcherConfig, ToolDispatcher};
use vllm_client::{Client, GenerateParams};
use vllm_sim::{Exchange, SimConfig, SimRouting, Simulator};

use crate::{
    prompt_modes::{calculator, serve},
    rollout::{chat_tokenizer, scorer},
};

const PATIENCE: Duration = Duration::from_secs(120);

const ROUTER: SimRouting = SimRouting {
    layers: 3,
    top_k: 2,
    experts: 8,
};

/// A simulator that calls the calculator once, then answers in 40 tokens at 3 ms a token,
/// recording every exchange; a MoE router when `routing`.
async fn simulator(routing: bool) -> (Simulator, Client) {
    let mut sim = SimConfig::new(chat_tokenizer().tokenizer().clone());
    sim.tool_rounds = 1;
    sim.answer_tokens = 40;
    sim.per_token = Duration::from_millis(3);
    sim.record = true;
    sim.routed_experts = routing.then_some(ROUTER);
    serve(sim).await
}

fn rows(count: usize) -> Vec<Result<DatasetRow, DatasetError>> {
    (1..=count)
        .map(|line| {
            Ok(DatasetRow {
                source: "rows.jsonl".into(),
                line,
                prompt: vec![Message::user(format!("What is {line} * 7?"))],
                columns: Map::new(),
            })
        })
        .collect()
}

fn config(routing: bool) -> RolloutConfig {
    let mut config = RolloutConfig::default();
    config.num_generations = 2;
    config.max_inflight = 4;
    config.max_tokens = 128;
    config.routed_experts = routing;
    config.in_flight = InFlight::Continue;
    config.sampling.seed = Some(3);
    config
}

fn start<G: Generator>(
    generator: G,
    config: RolloutConfig,
    groups: usize,
) -> (Engine<G>, async_grpo_rollout::Groups) {
    Engine::builder(generator, chat_tokenizer(), scorer())
        .tools(ToolDispatcher::new(calculator(), DispatcherConfig::new(2)))
        .config(config)
        .start(rows(groups))
        .expect("the loop starts")
}

async fn collect(groups: &mut async_grpo_rollout::Groups) -> Vec<TrainingSample> {
    let mut out: Vec<ScoredGroup> = Vec::new();
    while let Some(group) = within(PATIENCE, "the next group", groups.recv()).await {
        out.push(group);
    }
    out.into_iter().flat_map(|g| g.samples).collect()
}

/// Per position of `sample`, the exchanges whose sampled ids are there (the rollouts of a
/// group may sample the same ids, each with its own logprobs): their prompt is the
/// row up to that position and their ids follow it.
fn exchanges_of<'a>(sample: &TrainingSample, transcript: &'a [Exchange]) -> Vec<Vec<&'a Exchange>> {
    let ids = &sample.input_ids;
    let mut by_position = vec![Vec::new(); ids.len()];
    for exchange in transcript {
        let (start, end) = (
            exchange.prompt_ids.len(),
            exchange.prompt_ids.len() + exchange.token_ids.len(),
        );
        if end <= ids.len()
            && ids[..start] == exchange.prompt_ids[..]
            && ids[start..end] == exchange.token_ids[..]
        {
            for slot in &mut by_position[start..end] {
                slot.push(exchange);
            }
        }
    }
    by_position
}

/// The version of each position of `sample`, from its spans (`None` outside them).
fn versions_of(sample: &TrainingSample) -> Vec<Option<u64>> {
    let mut versions = vec![None; sample.input_ids.len()];
    for span in &sample.token_versions {
        for slot in &mut versions[span.start..span.end] {
            assert!(
                slot.is_none(),
                "overlapping spans: {:?}",
                sample.token_versions
            );
            *slot = Some(span.version);
        }
    }
    versions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_update_in_continue_mode_keeps_every_token_with_the_version_that_sampled_it() {
    let (simulator, client) = simulator(true).await;
    let (engine, mut groups) = start(client, config(true), 6);
    let engine = Arc::new(engine);
    // Two weight updates while answers are being sampled: the rollouts run in step, so a
    // moment after four more answers came back the next four are on the wire (an answer
    // takes 120 ms).
    for version in 1..=2 {
        wait_until(PATIENCE, "answers being sampled", || {
            simulator.counters().completions >= 4 * version
        })
        .await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        engine.pause(InFlight::Continue).await;
        // No request is on the wire now: the weights change under none.
        simulator.set_weights(version);
        engine.set_model_version(version).expect("versions grow");
        engine.resume();
    }
    let samples = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    let transcript = simulator.transcript();
    simulator.stop().await;
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    // A retry would start the rollout afresh under the new version, hiding a broken one.
    assert_eq!(report.stats.rollouts_retried, 0, "{:?}", report.stats);
    assert_eq!(samples.len(), 12);
    assert!(
        report.stats.answers_continued > 0,
        "no answer was interrupted and continued: {:?}",
        report.stats
    );
    assert!(
        transcript.iter().all(|e| !e.weights_changed),
        "the weights changed under a request in flight"
    );
    let mut across_an_update = 0;
    for sample in &samples {
        let exchanges = exchanges_of(sample, &transcript);
        let versions = versions_of(sample);
        for (position, (candidates, version)) in exchanges.iter().zip(&versions).enumerate() {
            let trained = sample.completion_mask[position] == 1;
            if candidates.is_empty() {
                assert!(
                    version.is_none() && !trained,
                    "position {position} was not sampled but has {version:?}"
                );
                continue;
            }
            // A sampled token: its version is that of the weights that sampled it, its
            // logprob theirs (a logprob depends on the request's seed and the weights).
            assert!(trained, "position {position} was sampled");
            let logprob = sample.old_log_probs[position];
            assert!(
                candidates.iter().any(|e| {
                    let at = position - e.prompt_ids.len();
                    *version == Some(e.weights) && e.logprobs[at] as f32 == logprob
                }),
                "position {position}: version {version:?}, logprob {logprob}, sampled as {:?}",
                candidates
                    .iter()
                    .map(|e| (e.weights, e.logprobs[position - e.prompt_ids.len()]))
                    .collect::<Vec<_>>()
            );
        }
        let mut spans: Vec<u64> = sample.token_versions.iter().map(|s| s.version).collect();
        spans.dedup();
        across_an_update += usize::from(spans.len() > 1);
        assert_eq!(sample.model_version, *spans.iter().min().expect("a span"));
        let routing = sample.routed_experts.as_ref().expect("routing");
        assert_eq!(routing.tokens(), sample.input_ids.len());
    }
    assert!(across_an_update > 0, "no row holds tokens of two versions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_replay_rows_carry_what_the_server_routed_and_a_re_score_agrees() {
    let (simulator, client) = simulator(true).await;
    let (engine, mut groups) = start(client.clone(), config(true), 2);
    let samples = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(samples.len(), 4);
    for sample in &samples {
        let routing = sample.routed_experts.as_ref().expect("routing");
        let tokens = sample.input_ids.len();
        assert_eq!(
            (routing.tokens(), routing.layers, routing.top_k),
            (tokens, 3, 2)
        );
        // The server never runs the model on the last id it samples.
        assert_eq!(
            routing.missing,
            std::iter::once(tokens - 1..tokens).collect::<Vec<_>>()
        );
        // The row's ids sent back whole: the routing of every token but the last is the row's.
        let params = GenerateParams {
            max_tokens: 1,
            routed_experts_from: Some(0),
            ..GenerateParams::default()
        };
        let rescored = client
            .generate(&sample.input_ids, &params)
            .await
            .expect("a re-score");
        let rescored = rescored.routed_experts.expect("routing");
        assert_eq!(rescored.shape, [tokens, 3, 2]);
        let stride = 3 * 2;
        assert_eq!(
            routing.data[..(tokens - 1) * stride],
            rescored.data[..(tokens - 1) * stride]
        );
        assert_eq!(routing.data[(tokens - 1) * stride..], [0; 6]);
    }
    assert_eq!(report.stats.routing_missing_tokens, 4);
    simulator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_asked_of_a_server_that_does_not_report_it_stops_the_run_naming_the_flag() {
    let (simulator, client) = simulator(false).await;
    let (engine, mut groups) = start(client, config(true), 4);
    let samples = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    simulator.stop().await;
    assert!(samples.is_empty(), "no row without its routing");
    let error = report.error.expect("the run stopped");
    assert!(error.contains("--enable-return-routed-experts"), "{error}");
    assert!(
        report
            .failures
            .iter()
            .all(|f| f.cause == FailureCause::Routing),
        "{:?}",
        report.failures
    );
}

/// A server whose routing for rollout 0 is one position short.
struct ShortRouting(Client);

impl Generator for ShortRouting {
    async fn generate(&self, request: GenerateRequest<'_>) -> Result<Generation, GenerateError> {
        let mut generation = Generator::generate(&self.0, request).await?;
        if request.rollout.0 == 0
            && let Some(routed) = &mut generation.routed_experts
        {
            routed.tokens -= 1;
            routed.data.truncate(routed.tokens * routed.stride());
        }
        Ok(generation)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_that_does_not_fit_the_tokens_fails_that_rollout_and_no_other() {
    let (simulator, client) = simulator(true).await;
    let mut config = config(true);
    config.retries = 0;
    config.min_group_size = 1;
    let (engine, mut groups) = start(ShortRouting(client), config, 2);
    let samples = collect(&mut groups).await;
    let report = engine.shutdown(Duration::from_secs(10)).await;
    simulator.stop().await;
    assert!(report.error.is_none(), "{:?}", report.error);
    let [failure] = &report.failures[..] else {
        panic!("one failure: {:?}", report.failures);
    };
    assert_eq!(
        (failure.rollout_id.0, failure.cause),
        (0, FailureCause::Routing)
    );
    assert!(failure.message.contains("need"), "{failure}");
    assert!(samples.iter().all(|s| s.rollout_id.0 != 0));
    assert_eq!(samples.len(), 3);
}
