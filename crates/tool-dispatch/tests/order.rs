//! A turn's calls run one after another in the model's order; turns run concurrently.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_grpo_tool_dispatch::{Arguments, DispatcherConfig, Outcome, Tool, ToolCall, ToolSpec};
use serde_json::json;

use crate::{Rendezvous, dispatcher, quick, wait_for, within};

type Log = Arc<Mutex<Vec<String>>>;

fn logging_sync(name: &str, log: &Log, delay: Duration) -> Tool {
    let (log, label) = (Arc::clone(log), name.to_owned());
    Tool::new_sync(
        ToolSpec::new(name, "Logs its call"),
        move |args: Arguments| {
            std::thread::sleep(delay);
            let entry = format!("{label}:{}", args.get("n").cloned().unwrap_or_default());
            log.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(entry.clone());
            Ok(json!(entry))
        },
    )
}

fn logging_async(name: &str, log: &Log, delay: Duration) -> Tool {
    let (log, label) = (Arc::clone(log), name.to_owned());
    Tool::new_async(
        ToolSpec::new(name, "Logs its call"),
        move |args: Arguments| {
            let (log, label) = (Arc::clone(&log), label.clone());
            async move {
                tokio::time::sleep(delay).await;
                let entry = format!("{label}:{}", args.get("n").cloned().unwrap_or_default());
                log.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(entry.clone());
                Ok(json!(entry))
            }
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_sync_and_async_calls_keep_the_models_order_and_their_counts() {
    let log = Log::default();
    let dispatcher = dispatcher(
        vec![
            // The slow sync call comes first: run concurrently, the async ones would finish
            // before it and the log would be out of order.
            logging_sync("slow_sync", &log, Duration::from_millis(40)),
            logging_async("fast_async", &log, Duration::from_millis(1)),
            logging_sync("fast_sync", &log, Duration::ZERO),
        ],
        DispatcherConfig::new(4),
    );
    let calls: Vec<ToolCall> = [
        ("slow_sync", 1),
        ("fast_async", 2),
        ("fast_sync", 3),
        ("fast_async", 4),
        ("slow_sync", 5),
        ("nope", 6),
        ("fast_sync", 7),
    ]
    .into_iter()
    .map(|(name, n)| ToolCall::new(name, json!({ "n": n })).with_id(format!("call_{n}")))
    .collect();

    let results = within("the turn", dispatcher.run(calls))
        .await
        .expect("the dispatcher is open");

    let expected_log = [
        "slow_sync:1",
        "fast_async:2",
        "fast_sync:3",
        "fast_async:4",
        "slow_sync:5",
        "fast_sync:7",
    ];
    assert_eq!(*log.lock().unwrap_or_else(|e| e.into_inner()), expected_log);
    let ids: Vec<_> = results
        .iter()
        .map(|r| r.call_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        ids,
        [
            "call_1", "call_2", "call_3", "call_4", "call_5", "call_6", "call_7"
        ]
    );
    assert_eq!(results[0].content, "slow_sync:1");
    assert_eq!(results[5].outcome, Outcome::UnknownTool);

    let metrics = dispatcher.metrics();
    let counts = |name: &str| metrics.tool(name).map(|t| (t.calls, t.ok));
    assert_eq!(counts("slow_sync"), Some((2, 2)));
    assert_eq!(counts("fast_async"), Some((2, 2)));
    assert_eq!(counts("fast_sync"), Some((2, 2)));
    assert_eq!(metrics.unknown_tool, 1);
    // Only sync calls wait for a pool thread.
    assert_eq!(
        metrics.tool("slow_sync").map(|t| t.queue_wait.count),
        Some(2)
    );
    assert_eq!(
        metrics.tool("fast_async").map(|t| t.queue_wait.count),
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_of_different_rollouts_run_concurrently_up_to_the_pool_bound() {
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    // The first two calls must be inside the tool at once to meet: with fewer threads than
    // that, the first one's wait runs out and its call fails, saying so.
    let rendezvous = Rendezvous::new(2);
    let tool = {
        let (running, peak) = (Arc::clone(&running), Arc::clone(&peak));
        Tool::new_sync(ToolSpec::new("work", "Works"), move |_: Arguments| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            let met = rendezvous.meet();
            std::thread::sleep(Duration::from_millis(20));
            running.fetch_sub(1, Ordering::SeqCst);
            if met {
                Ok(json!(std::thread::current().name().unwrap_or_default()))
            } else {
                Err("no second call came to run beside this one".into())
            }
        })
    };
    let dispatcher = dispatcher(vec![tool], DispatcherConfig::new(2).thread_name("td-order"));

    let turns: Vec<_> = (0..6)
        .map(|_| {
            let dispatcher = dispatcher.clone();
            tokio::spawn(
                async move { dispatcher.run(vec![ToolCall::new("work", json!({}))]).await },
            )
        })
        .collect();
    let mut thread_names = Vec::new();
    for turn in turns {
        let results = within("a turn", turn)
            .await
            .expect("the turn task does not panic")
            .expect("open");
        assert_eq!(results[0].outcome, Outcome::Ok, "{}", results[0].content);
        thread_names.push(results[0].content.clone());
    }

    assert_eq!(
        peak.load(Ordering::SeqCst),
        2,
        "two turns ran at once, never more"
    );
    assert!(
        thread_names
            .iter()
            .all(|name| name.starts_with("td-order-")),
        "sync tools run on the dispatcher's own threads, not the runtime's: {thread_names:?}"
    );
    assert_eq!(dispatcher.metrics().pool.threads, 2);
}

#[tokio::test]
async fn an_idle_pool_thread_wakes_for_the_next_call() {
    let dispatcher = dispatcher(vec![quick("quick")], DispatcherConfig::new(1));
    let first = within(
        "the first call",
        dispatcher.run(vec![ToolCall::new("quick", json!({}))]),
    )
    .await
    .expect("open");
    assert_eq!(first[0].content, "quick");
    // The pool's only thread has gone back to waiting for work.
    wait_for("the pool thread is idle", || {
        let pool = dispatcher.metrics().pool;
        (pool.threads, pool.busy, pool.completed) == (1, 0, 1)
    })
    .await;

    let second = within(
        "a call handed to the idle thread (a lost wake-up leaves it queued)",
        dispatcher.run(vec![ToolCall::new("quick", json!({}))]),
    )
    .await
    .expect("open");
    assert_eq!(second[0].content, "quick");
}

/// A tool with an environment behind it: a struct, not a closure.
struct Counter(AtomicUsize);

impl async_grpo_tool_dispatch::SyncTool for Counter {
    fn call(&self, _: Arguments) -> Result<serde_json::Value, async_grpo_tool_dispatch::ToolError> {
        Ok(json!(self.0.fetch_add(1, Ordering::SeqCst) + 1))
    }
}

/// An async tool as a struct.
struct Echo {
    prefix: String,
}

impl async_grpo_tool_dispatch::AsyncTool for Echo {
    fn call(
        &self,
        args: Arguments,
    ) -> futures::future::BoxFuture<
        'static,
        Result<serde_json::Value, async_grpo_tool_dispatch::ToolError>,
    > {
        let text = format!(
            "{}{}",
            self.prefix,
            args.get("text")
                .and_then(|t| t.as_str())
                .unwrap_or_default()
        );
        Box::pin(async move { Ok(json!(text)) })
    }
}

#[tokio::test]
async fn structs_implementing_the_tool_traits_are_tools_too() {
    let dispatcher = dispatcher(
        vec![
            Tool::from_sync(
                ToolSpec::new("count", "Counts its calls"),
                Counter(AtomicUsize::new(0)),
            ),
            Tool::from_async(
                ToolSpec::new("echo", "Echoes"),
                Echo {
                    prefix: "> ".into(),
                },
            ),
        ],
        DispatcherConfig::new(1),
    );
    let results = within(
        "the turn",
        dispatcher.run(vec![
            ToolCall::new("count", json!({})),
            ToolCall::new("echo", json!({ "text": "hi" })),
            ToolCall::new("count", json!({})),
        ]),
    )
    .await
    .expect("open");
    let contents: Vec<&str> = results.iter().map(|r| r.content.as_str()).collect();
    assert_eq!(contents, ["1", "> hi", "2"]);
}
