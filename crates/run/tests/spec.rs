//! [`RunSpec`]: what it refuses before any work, the tool pool's one rule, and a run wired by
//! it against the simulator: servers waited for, tools on the pool, rewards scored.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use async_grpo_run::{
    DatasetSource, MAX_DEFAULT_TOOL_THREADS, PlanSpec, RunSpec, Running, Servers, SpecError,
    ToolPool,
};
use rollout::{DatasetRow, RolloutConfig};
use rollout_core::{ChatTemplate, ChatTokenizer, Message};
use serde_json::{Value, json};
use test_support::within;
use tool_dispatch::{Registry, Tool, ToolSpec};
use vllm_sim::{SimConfig, Simulator};

const PATIENCE: Duration = Duration::from_secs(60);

/// ChatML with the tools in a system turn and hermes calls, as the simulator writes them.
const CHATML: &str = r#"{%- if tools %}<|im_start|>system
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

fn tokenizer() -> ChatTokenizer {
    let template = ChatTemplate::new("chatml", CHATML).expect("the template compiles");
    let special = json!({ "eos_token": "<|im_end|>" })
        .as_object()
        .cloned()
        .unwrap_or_default();
    ChatTokenizer::new(vllm_sim::training_tokenizer(), template, special)
}

fn config() -> RolloutConfig {
    let mut config = RolloutConfig::default();
    config.num_generations = 2;
    config.max_inflight = 4;
    config.max_tokens = 64;
    config
}

fn servers(urls: &[String]) -> Servers {
    Servers {
        urls: urls.to_vec(),
        model: Some("sim".to_owned()),
        root_certificates_pem: None,
    }
}

fn rows(count: u64) -> Arc<Vec<DatasetRow>> {
    Arc::new(
        (0..count)
            .map(|line| DatasetRow {
                source: "memory".into(),
                line: line as usize + 1,
                prompt: vec![Message::user(format!("What is 2 + {line}?"))],
                columns: serde_json::Map::new(),
            })
            .collect(),
    )
}

#[test]
fn the_tool_pool_has_a_thread_per_rollout_in_flight_unless_set() {
    let pool = ToolPool::default();
    assert_eq!(pool.threads_for(64), 64);
    assert_eq!(pool.threads_for(0), 1);
    assert_eq!(pool.threads_for(100_000), MAX_DEFAULT_TOOL_THREADS);
    let set = ToolPool {
        threads: Some(3),
        ..ToolPool::default()
    };
    assert_eq!(set.threads_for(64), 3);
    let spec = RunSpec::new(
        config(),
        tokenizer(),
        servers(&["http://127.0.0.1:1".to_owned()]),
    );
    assert_eq!(spec.tool_threads(), 4, "max_inflight is 4");
}

#[test]
fn a_spec_is_refused_before_any_work_without_a_server_a_pool_or_with_rewards_of_one_name() {
    let no_server = RunSpec::new(config(), tokenizer(), servers(&[]));
    assert!(matches!(no_server.check(), Err(SpecError::NoServer)));

    let url = ["http://127.0.0.1:1".to_owned()];
    let no_threads = RunSpec::new(config(), tokenizer(), servers(&url)).tool_pool(ToolPool {
        threads: Some(0),
        ..ToolPool::default()
    });
    assert!(matches!(no_threads.check(), Err(SpecError::NoToolThreads)));

    let twice = RunSpec::new(config(), tokenizer(), servers(&url)).rewards(vec![
        scoring::builtin::numeric("answer"),
        scoring::builtin::numeric("answer"),
    ]);
    match twice.check() {
        Err(SpecError::Rewards(error)) => {
            assert!(error.to_string().contains("numeric"), "{error}");
        }
        other => panic!("expected the rewards refused, got {other:?}"),
    }

    let mut zero = config();
    zero.num_generations = 0;
    let bad_config = RunSpec::new(zero, tokenizer(), servers(&url));
    match bad_config.check() {
        Err(SpecError::Engine(error)) => {
            assert!(error.to_string().contains("num_generations"), "{error}");
        }
        other => panic!("expected the settings refused, got {other:?}"),
    }
    let fine = RunSpec::new(config(), tokenizer(), servers(&url));
    assert!(fine.check().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_rolls_out_its_plan_against_the_simulator_with_its_tools_on_its_pool() {
    let mut sim = SimConfig::new(vllm_sim::training_tokenizer());
    sim.tool_rounds = 1;
    let simulator = Simulator::start(sim, "127.0.0.1:0".parse().expect("an address"))
        .await
        .expect("the simulator starts");

    // The sync tool records the thread each call ran on.
    let threads = Arc::new(Mutex::new(HashSet::new()));
    let seen = Arc::clone(&threads);
    let mut registry = Registry::new();
    registry
        .add(Tool::new_sync(
            ToolSpec::new("calculator", "Evaluates an arithmetic expression"),
            move |_args| {
                let name = std::thread::current().name().unwrap_or("").to_owned();
                seen.lock().expect("not poisoned").insert(name);
                Ok(Value::from(5))
            },
        ))
        .expect("the tool is added");

    let dataset = DatasetSource::Rows(rows(6));
    let plan = PlanSpec {
        epochs: Some(1),
        shard: Some(files::Shard { index: 1, count: 2 }),
        ..PlanSpec::default()
    }
    .plan(6, &HashSet::new())
    .expect("a plan");
    assert_eq!(plan.total, Some(3));
    let spec = RunSpec::new(config(), tokenizer(), servers(&[simulator.url()]))
        .tools(registry)
        .tool_pool(ToolPool {
            thread_name: Some("spec-tool".to_owned()),
            ..ToolPool::default()
        })
        .rewards(vec![
            scoring::builtin::length(1000, None).expect("a length reward"),
        ]);
    let connected = within(PATIENCE, "the servers", spec.connect())
        .await
        .expect("the simulator answers");
    let items = dataset.items(plan.plan).expect("the items");
    let Running {
        engine, mut groups, ..
    } = connected.start(items).await.expect("the loop starts");

    let mut ids = Vec::new();
    while let Some(group) = within(PATIENCE, "a group", groups.recv()).await {
        assert_eq!(group.samples.len(), 2, "num_generations rows per group");
        ids.push(group.samples[0].group_id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [1, 3, 5], "shard 1/2's rows, each once");
    let report = within(PATIENCE, "the drain", engine.shutdown(PATIENCE)).await;
    assert!(report.error.is_none(), "{:?}", report.error);
    assert_eq!(report.stats.tool_calls, 6, "one call per rollout");
    let threads = threads.lock().expect("not poisoned").clone();
    assert!(
        !threads.is_empty() && threads.iter().all(|t| t.starts_with("spec-tool")),
        "every call on the run's pool: {threads:?}"
    );
    simulator.stop().await;
}
