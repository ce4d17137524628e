//! A blocking sync tool must not stall the async runtime, nor wait for tokio's blocking pool.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_grpo_tool_dispatch::{
    Arguments, DispatcherConfig, Outcome, SyncTool, Tool, ToolCall, ToolSpec,
};
use serde_json::json;

use crate::{PATIENCE, dispatcher, quick, within};

fn sleeper() -> impl SyncTool + Clone {
    |_: Arguments| {
        std::thread::sleep(Duration::from_millis(200));
        Ok(json!("rested"))
    }
}

/// Starts a task that counts 10 ms ticks on the (single-threaded) test runtime.
async fn start_ticker() -> Arc<AtomicUsize> {
    let ticks = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&ticks);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    // Let the ticker start.
    tokio::task::yield_now().await;
    ticks
}

/// The way a naive rollout worker runs a sync tool: called inline in async code, on the
/// runtime's own thread. Kept to prove that the ticker test detects that mistake.
async fn run_inline(tool: &impl SyncTool, args: Arguments) -> String {
    tool.call(args)
        .map(|value| value.to_string())
        .unwrap_or_else(|e| e.to_string())
}

#[tokio::test]
async fn the_runtime_keeps_ticking_while_a_sync_tool_blocks() {
    let dispatcher = dispatcher(
        vec![Tool::from_sync(
            ToolSpec::new("sleep", "Blocks for 200 ms"),
            sleeper(),
        )],
        DispatcherConfig::new(1),
    );
    let ticks = start_ticker().await;

    let before = ticks.load(Ordering::SeqCst);
    let results = within(
        "the sleeping turn",
        dispatcher.run(vec![ToolCall::new("sleep", json!({}))]),
    )
    .await
    .expect("open");
    let during = ticks.load(Ordering::SeqCst) - before;

    assert_eq!(results[0].outcome, Outcome::Ok);
    // 200 ms of 10 ms ticks is about 20; a coarse bound keeps the signal without timing
    // fragility: run inline, the ticker cannot advance at all (see the next test).
    assert!(
        during > 2,
        "the ticker advanced only {during} time(s) while the tool blocked"
    );
}

#[tokio::test]
async fn the_ticker_test_catches_a_sync_tool_run_inline() {
    let ticks = start_ticker().await;

    let before = ticks.load(Ordering::SeqCst);
    let content = run_inline(&sleeper(), Arguments::default()).await;
    let during = ticks.load(Ordering::SeqCst) - before;

    assert_eq!(content, "\"rested\"");
    assert!(
        during <= 1,
        "an inline sync tool stalls the runtime, yet the ticker advanced {during} times"
    );
}

/// Tools run on the dispatcher's own threads, so they do not queue behind whatever else holds
/// tokio's blocking pool (reward scoring, file IO). Here that pool has one thread, and it is
/// busy until the test ends.
#[test]
fn a_sync_tool_runs_while_tokios_blocking_pool_is_full() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .max_blocking_threads(1)
        .build()
        .expect("a runtime");
    // The occupant holds the blocking pool's only thread until told to go, and in any case
    // longer than the test waits for the tool.
    let (release, released) = std::sync::mpsc::channel::<()>();
    runtime.block_on(async {
        let occupant =
            tokio::task::spawn_blocking(move || released.recv_timeout(PATIENCE * 3).is_ok());
        let dispatcher = dispatcher(vec![quick("quick")], DispatcherConfig::new(1));
        let results = tokio::time::timeout(
            PATIENCE,
            dispatcher.run(vec![ToolCall::new("quick", json!({}))]),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the sync tool waited for tokio's blocking pool, which is full: it must run on \
                 the dispatcher's own threads"
            )
        })
        .expect("open");
        assert_eq!(results[0].content, "quick");

        let _ = release.send(());
        assert!(
            within("the blocking pool's task", occupant)
                .await
                .expect("no panic"),
            "the occupant was released by the test"
        );
    });
}
