//! The recording proxy's cost: one turn through it (HTTP, JSON, the capture's render or
//! delta, decoding, parsing, the answer or its SSE chunks) against the same turn's work in a
//! white-box rollout (the delta, decoding, parsing), and turns per second with 256 agents at
//! once. The model is a stub that answers at once (a tool call, then an answer, from the
//! real Qwen3 tokenizer), so what is measured is the proxy alone.
//!
//! `cargo bench -p async-grpo-harness --bench proxy` (or `cargo xtask bench`); needs the Qwen3 tokenizer
//! (`cargo xtask fixtures`). Results are printed and, with `BENCH_OUT`, written to
//! `$BENCH_OUT/proxy.json`.

#![allow(clippy::print_stdout, missing_docs)]

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use async_grpo_harness::proxy::{Proxy, ProxyConfig, ProxySession};
use rollout_api::{Finish, Sampled, Sampler};
use rollout_core::{
    ChatTokenizer, Message, RenderOptions, ToolCallParser,
    parse::{HermesParser, split_reasoning},
};
use serde_json::{Map, Value, json};
use test_support::cpu_seconds;

const CALL: &str = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n</tool_call>";
const ANSWER: &str = "The answer is 391.";

fn qwen3() -> ChatTokenizer {
    ChatTokenizer::from_dir(test_support::cache_dir().join("qwen3"))
        .expect("the Qwen3 tokenizer: run `cargo xtask fixtures`")
}

fn ids(tokenizer: &ChatTokenizer, text: &str) -> Vec<u32> {
    let mut ids = tokenizer
        .tokenizer()
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    ids.extend(tokenizer.eos_token_id());
    ids
}

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression of two integers.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    }}])
}

fn question() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a careful calculator. Use the tool."}),
        json!({"role": "user", "content": "What is 17 * 23?"}),
    ]
}

/// A session whose model answers at once: the call on even turns, the answer on odd ones.
fn session(proxy: &Proxy, call: Arc<Vec<u32>>, answer: Arc<Vec<u32>>) -> ProxySession {
    let (sampler, mut requests) = Sampler::channel();
    tokio::spawn(async move {
        let mut turn = 0;
        while let Some(request) = requests.next().await {
            let ids = if turn % 2 == 0 { &call } else { &answer };
            request.answer(Ok(Sampled::new(ids.to_vec(), Finish::Stop)));
            turn += 1;
        }
    });
    proxy.session(sampler)
}

/// One request, its answer read whole.
async fn post(client: &reqwest::Client, url: &str, key: &str, body: Value) {
    let answer = client.post(url).bearer_auth(key).json(&body).send().await;
    answer.expect("an answer").text().await.expect("a body");
}

/// One agent conversation: the question, then the tool's result; returns the turns made.
async fn converse(client: &reqwest::Client, url: &str, key: &str, stream: bool) -> usize {
    let body = json!({"messages": question(), "tools": tools(), "stream": stream});
    post(client, url, key, body).await;
    // The agent writes the call back its own way: compact arguments, its own call id.
    let mut messages = question();
    messages.push(json!({"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "calculator", "arguments": "{\"expression\":\"17 * 23\"}"},
    }]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_0", "content": "391"}));
    let body = json!({"messages": messages, "tools": tools(), "stream": stream});
    post(client, url, key, body).await;
    2
}

/// The white-box turn's own work for the same conversation: the template's delta after the
/// call, decoding and parsing the answer.
fn white_box_turn(tokenizer: &ChatTokenizer, parser: &HermesParser, call: &[u32]) -> Duration {
    let options =
        RenderOptions::generation().with_tools(tools().as_array().cloned().unwrap_or_default());
    let mut render = tokenizer.incremental(options).expect("the template");
    let question: Vec<Message> = question()
        .into_iter()
        .map(|m| serde_json::from_value(m).expect("a message"))
        .collect();
    render.push(&question);
    render.prompt().expect("renders");
    let first = render.state();
    let rounds = 200;
    let started = Instant::now();
    for _ in 0..rounds {
        let mut render = tokenizer.resume(first.clone()).expect("resumes");
        let text = tokenizer
            .tokenizer()
            .decode(&call[..call.len() - 1], false)
            .expect("decodes");
        let (_, rest) = split_reasoning(&text);
        let parsed = parser.parse(rest);
        let message =
            Message::assistant(parsed.content.clone()).with_tool_calls(&parsed.tool_calls);
        let at = render.len();
        render.push(&[
            message,
            Message::tool_result("calculator", "391", Some("call_0".into())),
        ]);
        let delta = render
            .delta(&first, at, *call.last().expect("an id"))
            .expect("an exact delta");
        std::hint::black_box((delta, parsed.tool_calls.len()));
    }
    started.elapsed() / rounds
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let tokenizer = qwen3();
        let call = Arc::new(ids(&tokenizer, CALL));
        let answer = Arc::new(ids(&tokenizer, ANSWER));
        let mut results = Map::new();

        let white = white_box_turn(&tokenizer, &HermesParser, &call);
        println!("white-box turn work (delta, decode, parse): {white:?}");
        results.insert("white_box_turn_us".into(), json!(white.as_secs_f64() * 1e6));

        let proxy = Proxy::start(qwen3(), ProxyConfig::new("policy"))
            .await
            .expect("the proxy starts");
        let url = format!("{}/chat/completions", proxy.base_url());
        let client = reqwest::Client::new();
        for stream in [false, true] {
            let conversations = 300;
            let started = Instant::now();
            for _ in 0..conversations {
                let s = session(&proxy, Arc::clone(&call), Arc::clone(&answer));
                converse(&client, &url, s.key(), stream).await;
                s.finish().await;
            }
            let per_turn = started.elapsed() / (2 * conversations);
            let name = if stream { "sse" } else { "json" };
            println!("one agent, turn through the proxy ({name}, client included): {per_turn:?}");
            results.insert(format!("proxy_turn_{name}_us"), json!(per_turn.as_secs_f64() * 1e6));
        }

        for agents in [256usize] {
            let conversations_each = 8;
            let cpu = cpu_seconds();
            let started = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..agents {
                let (client, url, proxy_call, proxy_answer) =
                    (client.clone(), url.clone(), Arc::clone(&call), Arc::clone(&answer));
                let sessions: Vec<ProxySession> = (0..conversations_each)
                    .map(|_| session(&proxy, Arc::clone(&proxy_call), Arc::clone(&proxy_answer)))
                    .collect();
                tasks.push(tokio::spawn(async move {
                    let mut turns = 0;
                    for s in sessions {
                        turns += converse(&client, &url, s.key(), true).await;
                        s.finish().await;
                    }
                    turns
                }));
            }
            let mut turns = 0;
            for task in tasks {
                turns += task.await.expect("an agent");
            }
            let elapsed = started.elapsed();
            let cpu = cpu_seconds() - cpu;
            let rate = turns as f64 / elapsed.as_secs_f64();
            println!(
                "{agents} agents at once: {turns} turns in {elapsed:.2?}: {rate:.0} turns/s, {:.3} ms CPU per turn (proxy, stub samplers and clients)",
                cpu * 1e3 / turns as f64
            );
            results.insert(format!("agents_{agents}_turns_per_s"), json!(rate));
            results.insert(
                format!("agents_{agents}_cpu_ms_per_turn"),
                json!(cpu * 1e3 / turns as f64),
            );
        }
        if let Some(out) = std::env::var_os("BENCH_OUT") {
            let path = PathBuf::from(out).join("proxy.json");
            let text = serde_json::to_string_pretty(&Value::Object(results)).unwrap_or_default();
            if let Err(error) = std::fs::write(&path, text) {
                println!("could not write {}: {error}", path.display());
            }
        }
    });
}
