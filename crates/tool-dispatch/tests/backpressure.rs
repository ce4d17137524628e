//! `poll_ready` reserves a pool slot; it is pending while the pool is full, and every slot
//! comes back exactly once.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_grpo_tool_dispatch::{Arguments, DispatcherConfig, Outcome, Tool, ToolCall, ToolSpec};
use serde_json::json;
use tokio_test::{assert_pending, assert_ready_ok};
use tower_test::mock::Spawn;

use crate::{Gate, dispatcher, gated, ok_value, quick, wait_for, within};

fn one_slot() -> DispatcherConfig {
    DispatcherConfig::new(1).queue_capacity(0)
}

/// A sync tool that says when a thread has entered it, then waits behind `gate`.
fn entered_then_gated(name: &str, entered: &Arc<AtomicBool>, gate: &Gate) -> Tool {
    let (entered, gate) = (Arc::clone(entered), gate.clone());
    Tool::new_sync(
        ToolSpec::new(name, "Says it started, then waits for the test"),
        move |_: Arguments| {
            entered.store(true, Ordering::SeqCst);
            if gate.wait() {
                ok_value(json!("opened"))
            } else {
                Err("the test never opened the gate".into())
            }
        },
    )
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
    let results = within("the blocking turn", running)
        .await
        .expect("no panic")
        .expect("open");
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
        std::future::pending::<Result<serde_json::Value, async_grpo_tool_dispatch::ToolError>>()
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

#[tokio::test]
async fn finished_calls_give_their_slot_back_once() {
    let service = dispatcher(vec![quick("quick")], one_slot());
    for _ in 0..3 {
        let results = within(
            "a quick turn",
            service.run(vec![
                ToolCall::new("quick", json!({})),
                ToolCall::new("quick", json!({})),
            ]),
        )
        .await
        .expect("open");
        assert!(results.iter().all(|result| result.outcome == Outcome::Ok));
    }

    // One slot, not more: a slot released twice would let a second caller in.
    let mut first = Spawn::new(service.clone());
    let mut second = Spawn::new(service);
    assert_ready_ok!(first.poll_ready());
    assert_pending!(
        second.poll_ready(),
        "a second slot appeared: a call released its slot more than once"
    );
}

#[tokio::test]
async fn a_call_that_times_out_while_queued_gives_its_slot_back_when_its_thread_skips_it() {
    // One thread, room for one queued call: two slots.
    let gate = Gate::default();
    let queued = quick("queued").timeout(Duration::from_millis(30));
    let service = dispatcher(
        vec![gated("block", &gate), queued],
        DispatcherConfig::new(1).queue_capacity(1),
    );
    let blocker = {
        let service = service.clone();
        tokio::spawn(async move { service.run(vec![ToolCall::new("block", json!({}))]).await })
    };
    wait_for("the blocking call runs", || {
        service.metrics().pool.busy == 1
    })
    .await;

    let results = within(
        "the queued call",
        service.run(vec![ToolCall::new("queued", json!({}))]),
    )
    .await
    .expect("open");
    assert_eq!(results[0].outcome, Outcome::TimedOut);

    gate.open();
    within("the blocking turn", blocker)
        .await
        .expect("no panic")
        .expect("open");
    wait_for("both jobs left the pool", || {
        service.metrics().pool.completed == 2
    })
    .await;

    let mut first = Spawn::new(service.clone());
    let mut second = Spawn::new(service);
    assert_ready_ok!(first.poll_ready());
    assert_ready_ok!(
        second.poll_ready(),
        "the skipped call's slot never came back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_sync_call_keeps_its_slot_until_its_thread_is_free() {
    let gate = Gate::default();
    let entered = Arc::new(AtomicBool::new(false));
    let block = entered_then_gated("block", &entered, &gate).timeout(Duration::from_secs(1));
    let service = dispatcher(vec![block], one_slot());

    let turn = {
        let service = service.clone();
        tokio::spawn(async move { service.run(vec![ToolCall::new("block", json!({}))]).await })
    };
    // The paused clock stands still while this waits, so the call times out while running,
    // never while queued, however long the thread takes to start it.
    wait_for("the pool thread starts the call", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    let results = within("the timed-out turn", turn)
        .await
        .expect("no panic")
        .expect("open");
    assert_eq!(results[0].outcome, Outcome::TimedOut);
    assert_eq!(service.metrics().pool.stuck, 1);

    // The thread is still inside the tool, so the pool has no room: no slot is free.
    let mut next = Spawn::new(service.clone());
    assert_pending!(next.poll_ready());

    gate.open();
    wait_for("the stuck thread came back", || {
        service.metrics().pool.stuck == 0
    })
    .await;
    wait_for("freeing the slot wakes the waiting caller", || {
        next.is_woken()
    })
    .await;
    assert_ready_ok!(next.poll_ready());
}
