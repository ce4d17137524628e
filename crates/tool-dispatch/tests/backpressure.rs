//! `poll_ready` reserves a pool slot; it is pending while the pool is full.

use std::time::Duration;

use serde_json::json;
use tokio_test::{assert_pending, assert_ready_ok};
use tool_dispatch::{Arguments, DispatcherConfig, Outcome, Tool, ToolCall, ToolSpec};
use tower_test::mock::Spawn;

use crate::{Gate, dispatcher, eventually, gated};

fn one_slot() -> DispatcherConfig {
    DispatcherConfig::new(1).queue_capacity(0)
}

#[tokio::test]
async fn poll_ready_is_pending_while_the_pool_is_full_and_wakes_when_a_slot_frees() {
    let gate = Gate::default();
    let service = dispatcher(vec![gated("block", &gate)], one_slot());
    let mut first = Spawn::new(service.clone());
    let mut second = Spawn::new(service.clone());

    assert_ready_ok!(first.poll_ready());
    let running = tokio::spawn(first.call(vec![ToolCall::new("block", json!({}))]));
    assert_pending!(second.poll_ready());

    gate.open();
    let results = running.await.expect("no panic").expect("open");
    assert_eq!(results[0].content, "opened");
    assert!(
        second.is_woken(),
        "freeing the slot wakes the waiting caller"
    );
    assert_ready_ok!(second.poll_ready());
}

#[tokio::test]
async fn a_clone_does_not_copy_a_reserved_slot() {
    let service = dispatcher(vec![], one_slot());
    let mut reserved = Spawn::new(service);
    assert_ready_ok!(reserved.poll_ready());

    let mut clone = Spawn::new(reserved.get_ref().clone());
    assert_pending!(clone.poll_ready());

    drop(reserved);
    assert!(clone.is_woken());
    assert_ready_ok!(clone.poll_ready());
}

#[tokio::test(start_paused = true)]
async fn dropping_a_response_future_releases_its_slot() {
    let pending = Tool::new_async(ToolSpec::new("forever", "Never ends"), |_: Arguments| {
        std::future::pending::<Result<serde_json::Value, tool_dispatch::BoxError>>()
    });
    let service = dispatcher(vec![pending], one_slot());
    let mut first = Spawn::new(service.clone());
    let mut second = Spawn::new(service);

    assert_ready_ok!(first.poll_ready());
    let mut turn = tokio_test::task::spawn(first.call(vec![ToolCall::new("forever", json!({}))]));
    assert_pending!(turn.poll());
    assert_pending!(second.poll_ready());

    drop(turn);
    assert!(second.is_woken());
    assert_ready_ok!(second.poll_ready());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_sync_call_keeps_its_slot_until_its_thread_is_free() {
    let gate = Gate::default();
    let block = gated("block", &gate).timeout(Duration::from_secs(1));
    let service = dispatcher(vec![block], one_slot());

    let results = service
        .run(vec![ToolCall::new("block", json!({}))])
        .await
        .expect("open");
    assert_eq!(results[0].outcome, Outcome::TimedOut);
    assert_eq!(service.metrics().pool.stuck, 1);

    // The thread is still inside the tool, so the pool has no room: no slot is free.
    let mut next = Spawn::new(service.clone());
    assert_pending!(next.poll_ready());

    gate.open();
    assert!(
        eventually(|| service.metrics().pool.stuck == 0).await,
        "the stuck thread came back"
    );
    assert!(next.is_woken());
    assert_ready_ok!(next.poll_ready());
}
