//! Session lifecycle and tool-call overhead: sessions created and closed per second
//! (in-process async and sync sessions through `Harness`, and MCP stdio servers), and the
//! latency of one tool call through an MCP stdio session against a `[[tools]]` command tool.
//!
//! `cargo bench -p async-grpo-harness --bench sessions` (or `cargo xtask bench`); the MCP parts need the
//! Python MCP SDK (`cargo xtask fixtures`, or `ASYNC_GRPO_MCP_PYTHON`). Results are printed
//! and, with `BENCH_OUT`, written to `$BENCH_OUT/harness.json`.

#![allow(clippy::print_stdout, missing_docs)]

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use async_grpo_harness::{
    Harness, Session, SessionError, SessionFactory, SyncSession, SyncSessionFactory, Task,
    ToolOutput, Verification,
    mcp::{McpConfig, McpFactory, McpServer},
};
use futures::future::BoxFuture;
use rollout_api::{Environment, EpisodeRequest};
use rollout_core::Message;
use serde_json::{Map, Value, json};
use tool_dispatch::{
    DispatcherConfig, Registry, ToolCall, ToolDispatcher, ToolSpec, builtin::ToolConfig,
};

struct Noop;

impl Session for Noop {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![ToolSpec::new("noop", "Does nothing")]
    }
    fn call_tool(
        &self,
        _: &str,
        _: Map<String, Value>,
    ) -> BoxFuture<'_, Result<ToolOutput, SessionError>> {
        Box::pin(async { Ok(ToolOutput::new("ok")) })
    }
    fn verify(&self, _: &[Message]) -> BoxFuture<'_, Result<Verification, SessionError>> {
        Box::pin(async { Ok(Verification::reward(1.0)) })
    }
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

struct NoopFactory;

impl SessionFactory for NoopFactory {
    fn create(&self, _: Task) -> BoxFuture<'_, Result<Box<dyn Session>, SessionError>> {
        Box::pin(async { Ok(Box::new(Noop) as Box<dyn Session>) })
    }
}

struct SyncNoop;

impl SyncSession for SyncNoop {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![ToolSpec::new("noop", "Does nothing")]
    }
    fn call_tool(&self, _: &str, _: Map<String, Value>) -> Result<ToolOutput, SessionError> {
        Ok(ToolOutput::new("ok"))
    }
    fn verify(&self, _: &[Message]) -> Result<Verification, SessionError> {
        Ok(Verification::reward(1.0))
    }
    fn close(&self) {}
}

struct SyncNoopFactory;

impl SyncSessionFactory for SyncNoopFactory {
    fn create(&self, _: &Task) -> Result<Box<dyn SyncSession>, SessionError> {
        Ok(Box::new(SyncNoop))
    }
}

fn request(i: usize) -> EpisodeRequest {
    let row = rollout_api::DatasetRow {
        source: "bench".into(),
        line: i,
        prompt: vec![Message::user("What is 2 + 3?")],
        columns: Map::new(),
    };
    EpisodeRequest::new(&row, i as u64, format!("e{i}"))
}

/// Sessions opened and closed one after another, per second.
async fn lifecycle_rate(environment: &Harness, count: usize) -> f64 {
    let start = Instant::now();
    for i in 0..count {
        let episode = environment.open(request(i)).await.expect("a session");
        episode.close().await;
    }
    count as f64 / start.elapsed().as_secs_f64()
}

/// p50 and mean (microseconds) of `count` single-call turns of `tool` through `dispatcher`.
async fn call_latency(
    dispatcher: &ToolDispatcher,
    tool: &str,
    args: Value,
    count: usize,
) -> (f64, f64) {
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let start = Instant::now();
        let results = dispatcher
            .run(vec![ToolCall::new(tool, args.clone())])
            .await
            .expect("admitted");
        assert!(results[0].is_ok(), "{}", results[0].content);
        samples.push(start.elapsed());
    }
    samples.sort();
    let p50 = samples[samples.len() / 2].as_secs_f64() * 1e6;
    let mean = samples.iter().sum::<Duration>().as_secs_f64() * 1e6 / count as f64;
    (p50, mean)
}

fn mcp_python() -> Option<PathBuf> {
    if let Some(python) = std::env::var_os("ASYNC_GRPO_MCP_PYTHON") {
        return Some(PathBuf::from(python));
    }
    let python = test_support::cache_dir().join("venv-mcp/bin/python");
    python.is_file().then_some(python)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let pool = ToolDispatcher::new(Registry::new(), DispatcherConfig::new(8));
        let mut results = Map::new();
        // Each figure after a warm-up.
        let asynchronous = Harness::new("noop", NoopFactory, pool.clone());
        lifecycle_rate(&asynchronous, 1_000).await;
        let rate = lifecycle_rate(&asynchronous, 50_000).await;
        println!("async sessions created+closed/s: {rate:.0}");
        results.insert("async_sessions_per_s".into(), json!(rate));
        let sync = Harness::new_sync("sync-noop", SyncNoopFactory, pool.clone());
        lifecycle_rate(&sync, 1_000).await;
        let rate = lifecycle_rate(&sync, 20_000).await;
        println!("sync sessions created+closed/s (on the pool): {rate:.0}");
        results.insert("sync_sessions_per_s".into(), json!(rate));

        let command: ToolConfig = serde_json::from_value(json!({
            "name": "echo", "kind": "command", "command": ["cat"], "timeout": "10s"
        }))
        .expect("a tool table");
        let commands = pool.with_tools(
            Registry::new()
                .with(command.build().expect("the command tool builds"))
                .expect("one tool"),
        );
        call_latency(&commands, "echo", json!({"key": "x"}), 20).await;
        let (p50, mean) = call_latency(&commands, "echo", json!({"key": "x"}), 300).await;
        println!("[[tools]] command tool (cat), per call: p50 {p50:.0} us, mean {mean:.0} us");
        results.insert("command_tool_call_p50_us".into(), json!(p50));
        results.insert("command_tool_call_mean_us".into(), json!(mean));

        match mcp_python() {
            None => println!("MCP: skipped (no Python MCP SDK: run `cargo xtask fixtures`)"),
            Some(python) => {
                let server = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../examples/environment/kv_env.py");
                let argv = vec![python.display().to_string(), server.display().to_string()];
                let mcp = Harness::new(
                    "kv-env",
                    McpFactory::new(McpConfig::new(McpServer::Command(argv))),
                    pool.clone(),
                );
                let rate = lifecycle_rate(&mcp, 10).await;
                println!("MCP stdio sessions created+closed/s (a Python server each): {rate:.2}");
                results.insert("mcp_stdio_sessions_per_s".into(), json!(rate));
                let episode = mcp.open(request(0)).await.expect("an MCP session");
                call_latency(episode.tools(), "read", json!({"key": "x"}), 20).await;
                let (p50, mean) =
                    call_latency(episode.tools(), "read", json!({"key": "x"}), 300).await;
                println!(
                    "MCP stdio tool call (kv_env read), per call: p50 {p50:.0} us, mean {mean:.0} us"
                );
                results.insert("mcp_stdio_call_p50_us".into(), json!(p50));
                results.insert("mcp_stdio_call_mean_us".into(), json!(mean));
                episode.close().await;
            }
        }
        pool.shutdown(Duration::from_secs(5)).await;
        if let Some(out) = std::env::var_os("BENCH_OUT") {
            let path = PathBuf::from(out).join("harness.json");
            let text = serde_json::to_string_pretty(&Value::Object(results)).unwrap_or_default();
            if let Err(error) = std::fs::write(&path, text) {
                println!("could not write {}: {error}", path.display());
            }
        }
    });
}
