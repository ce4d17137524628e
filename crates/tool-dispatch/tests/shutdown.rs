//! Shutdown drains: queued calls are cancelled, running ones awaited up to a deadline, every
//! thread joined or accounted for. Dropping without shutdown neither hangs nor leaks.

use std::time::Duration;

use serde_json::json;
use tool_dispatch::{DispatcherConfig, Outcome, ToolCall, ToolDispatcher};

use crate::{Gate, dispatcher, error_of, eventually, gated, quick, threads_named};

fn spawn_turn(
    dispatcher: &ToolDispatcher,
    calls: Vec<ToolCall>,
) -> tokio::task::JoinHandle<Vec<tool_dispatch::ToolResult>> {
    let dispatcher = dispatcher.clone();
    tokio::spawn(async move {
        dispatcher
            .run(calls)
            .await
            .expect("admitted before shutdown")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_queued_calls_and_awaits_running_ones() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(1)
        .queue_capacity(2)
        .thread_name("td-drain");
    let dispatcher = dispatcher(vec![gated("block", &gate), quick("quick")], config);

    // The only thread runs `block`; the turn's second call has not started yet.
    let running = spawn_turn(
        &dispatcher,
        vec![
            ToolCall::new("block", json!({})),
            ToolCall::new("quick", json!({})),
        ],
    );
    assert!(eventually(|| dispatcher.metrics().pool.busy == 1).await);
    // This one waits in the queue.
    let queued = spawn_turn(&dispatcher, vec![ToolCall::new("quick", json!({}))]);
    assert!(eventually(|| dispatcher.metrics().pool.queued == 1).await);

    let shutdown = {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move { dispatcher.shutdown(Duration::from_secs(10)).await })
    };
    let queued = queued.await.expect("no panic");
    assert_eq!(queued[0].outcome, Outcome::Cancelled);
    assert_eq!(error_of(&queued[0].content), "cancelled: shutting down");
    assert!(
        !shutdown.is_finished(),
        "shutdown waits for the running call"
    );

    gate.open();
    let report = shutdown.await.expect("no panic");
    let running = running.await.expect("no panic");
    assert_eq!(running[0].content, "opened", "the running call completed");
    assert_eq!(
        running[1].outcome,
        Outcome::Cancelled,
        "the turn's next call never started"
    );

    assert_eq!(
        (report.completed, report.cancelled, report.still_running),
        (1, 2, 0)
    );
    assert_eq!((report.threads_joined, report.threads_detached), (1, 0));
    assert_eq!(threads_named("td-drain"), 0, "every pool thread was joined");

    // Closed for good: no new turns, and a second shutdown returns the same report.
    let refused = dispatcher
        .run(vec![ToolCall::new("quick", json!({}))])
        .await;
    assert!(refused.is_err_and(|error| error.is_closed()));
    assert_eq!(dispatcher.shutdown(Duration::ZERO).await, report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_running_at_the_deadline_is_reported_and_its_thread_detached() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(1).thread_name("td-deadline");
    let dispatcher = dispatcher(vec![gated("block", &gate)], config);
    let running = spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]);
    assert!(eventually(|| dispatcher.metrics().pool.busy == 1).await);

    let report = dispatcher.shutdown(Duration::from_millis(100)).await;
    assert_eq!(
        (report.completed, report.cancelled, report.still_running),
        (0, 0, 1)
    );
    assert_eq!((report.threads_joined, report.threads_detached), (0, 1));

    let running = running.await.expect("no panic");
    assert_eq!(running[0].outcome, Outcome::Cancelled);
    assert!(error_of(&running[0].content).contains("shut down while the tool was running"));

    // The detached thread exits as soon as its tool returns.
    assert_eq!(threads_named("td-deadline"), 1);
    gate.open();
    assert!(
        eventually(|| threads_named("td-deadline") == 0).await,
        "the detached thread exited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_dispatcher_without_shutdown_neither_hangs_nor_leaks_threads() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(2).thread_name("td-drop");
    let dispatcher = dispatcher(vec![gated("block", &gate)], config);
    let turns: Vec<_> = (0..3)
        .map(|_| spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]))
        .collect();
    assert!(
        eventually(|| {
            let pool = dispatcher.metrics().pool;
            (pool.busy, pool.queued) == (2, 1)
        })
        .await
    );
    assert_eq!(threads_named("td-drop"), 2);

    // Drop every handle: the turns' tasks and the dispatcher itself. Nothing waits here.
    for turn in &turns {
        turn.abort();
    }
    for turn in turns {
        assert!(turn.await.is_err_and(|error| error.is_cancelled()));
    }
    drop(dispatcher);

    // Both threads are still inside the tool; once it returns they exit on their own.
    assert_eq!(threads_named("td-drop"), 2);
    gate.open();
    assert!(
        eventually(|| threads_named("td-drop") == 0).await,
        "the pool's threads exited"
    );
}
