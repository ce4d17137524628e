//! Shutdown drains: queued calls are cancelled, running ones awaited up to a deadline, every
//! thread joined or accounted for, and the report counts what each call resolved to. Dropping
//! a turn abandons its call; dropping the dispatcher without shutdown neither hangs nor leaks.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::Poll,
    time::Duration,
};

use async_grpo_tool_dispatch::{
    Arguments, DispatcherConfig, Outcome, Tool, ToolCall, ToolDispatcher, ToolResult, ToolSpec,
};
use serde_json::json;
use tower_test::mock::Spawn;

use crate::{Gate, dispatcher, error_of, gated, ok_value, quick, threads_named, wait_for, within};

fn spawn_turn(
    dispatcher: &ToolDispatcher,
    calls: Vec<ToolCall>,
) -> tokio::task::JoinHandle<Vec<ToolResult>> {
    let dispatcher = dispatcher.clone();
    tokio::spawn(async move {
        dispatcher
            .run(calls)
            .await
            .expect("admitted before shutdown")
    })
}

/// A sync tool that notes that it ran.
fn recording(name: &str, ran: &Arc<AtomicBool>) -> Tool {
    let ran = Arc::clone(ran);
    Tool::new_sync(
        ToolSpec::new(name, "Notes that it ran"),
        move |_: Arguments| {
            ran.store(true, Ordering::SeqCst);
            ok_value(json!("ran"))
        },
    )
}

/// Whether `dispatcher` refuses new turns, as a caller sees it (its slots are closed).
fn refuses_turns(dispatcher: &ToolDispatcher) -> bool {
    let mut caller = Spawn::new(dispatcher.clone());
    matches!(caller.poll_ready(), Poll::Ready(Err(error)) if error.is_closed())
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
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;
    // This one waits in the queue.
    let queued = spawn_turn(&dispatcher, vec![ToolCall::new("quick", json!({}))]);
    wait_for("the second turn's call is queued", || {
        dispatcher.metrics().pool.queued == 1
    })
    .await;

    let shutdown = {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move { dispatcher.shutdown(Duration::from_secs(10)).await })
    };
    let queued = within("the queued turn", queued).await.expect("no panic");
    assert_eq!(queued[0].outcome, Outcome::Cancelled);
    assert_eq!(error_of(&queued[0].content), "cancelled: shutting down");
    assert!(
        !shutdown.is_finished(),
        "shutdown waits for the running call"
    );

    gate.open();
    let report = within("shutdown", shutdown).await.expect("no panic");
    let running = within("the running turn", running).await.expect("no panic");
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
    assert!(
        dispatcher.is_closed(),
        "a drained dispatcher says it is closed"
    );
    let refused = within(
        "a turn after shutdown",
        dispatcher.run(vec![ToolCall::new("quick", json!({}))]),
    )
    .await;
    assert!(refused.is_err_and(|error| error.is_closed()));
    assert_eq!(
        within("a second shutdown", dispatcher.shutdown(Duration::ZERO)).await,
        report
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_call_later_in_a_turn_is_cancelled_by_shutdown_not_run() {
    let gate = Gate::default();
    let ran = Arc::new(AtomicBool::new(false));
    let later = {
        let ran = Arc::clone(&ran);
        Tool::new_async(
            ToolSpec::new("later", "Notes that it ran"),
            move |_: Arguments| {
                ran.store(true, Ordering::SeqCst);
                async { ok_value(json!("ran")) }
            },
        )
    };
    let dispatcher = dispatcher(
        vec![gated("block", &gate), later],
        DispatcherConfig::new(1).thread_name("td-later"),
    );
    let turn = spawn_turn(
        &dispatcher,
        vec![
            ToolCall::new("block", json!({})),
            ToolCall::new("later", json!({})),
        ],
    );
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;

    let shutdown = {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move { dispatcher.shutdown(Duration::from_secs(10)).await })
    };
    wait_for("shutdown has begun (no new turn is admitted)", || {
        refuses_turns(&dispatcher)
    })
    .await;
    // The running call finishes within the deadline; the async one after it must not start.
    gate.open();
    let results = within("the turn", turn).await.expect("no panic");
    assert_eq!(results[0].content, "opened");
    assert_eq!(
        results[1].outcome,
        Outcome::Cancelled,
        "an async call later in a turn is cancelled by shutdown, not run (it answered {})",
        results[1].content
    );
    assert_eq!(error_of(&results[1].content), "cancelled: shutting down");
    assert!(!ran.load(Ordering::SeqCst), "the async tool never ran");

    let report = within("shutdown", shutdown).await.expect("no panic");
    assert_eq!(
        (report.completed, report.cancelled, report.still_running),
        (1, 1, 0)
    );
    assert!(
        dispatcher.is_closed(),
        "a drained dispatcher says it is closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_running_at_the_deadline_is_reported_and_its_thread_detached() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(1).thread_name("td-deadline");
    let dispatcher = dispatcher(vec![gated("block", &gate)], config);
    let running = spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]);
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;

    let report = within("shutdown", dispatcher.shutdown(Duration::from_millis(100))).await;
    assert_eq!(
        (report.completed, report.cancelled, report.still_running),
        (0, 0, 1)
    );
    assert_eq!((report.threads_joined, report.threads_detached), (0, 1));

    let running = within("the running turn", running).await.expect("no panic");
    assert_eq!(running[0].outcome, Outcome::Cancelled);
    assert!(error_of(&running[0].content).contains("shut down while the tool was running"));

    // The detached thread exits as soon as its tool returns.
    assert_eq!(threads_named("td-deadline"), 1);
    gate.open();
    wait_for("the detached thread exited", || {
        threads_named("td-deadline") == 0
    })
    .await;
}

/// A turn `[block, quick]` whose first call is still running at the deadline: both calls
/// resolve as cancelled, and the report counts both, `block` as still running and `quick`
/// as cancelled, although `quick` is cancelled only once the deadline abandoned `block`.
#[tokio::test(start_paused = true)]
async fn the_report_counts_every_call_of_a_turn_cut_by_the_deadline_as_it_resolved() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(1).thread_name("td-cut");
    let dispatcher = dispatcher(vec![gated("block", &gate), quick("quick")], config);
    let turn = spawn_turn(
        &dispatcher,
        vec![
            ToolCall::new("block", json!({})),
            ToolCall::new("quick", json!({})),
        ],
    );
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;

    // The paused clock reaches the deadline as soon as nothing else can happen.
    let report = within("shutdown", dispatcher.shutdown(Duration::from_millis(100))).await;
    let results = within("the turn", turn).await.expect("no panic");
    let outcomes: Vec<Outcome> = results.iter().map(|result| result.outcome).collect();
    assert_eq!(outcomes, [Outcome::Cancelled, Outcome::Cancelled]);
    assert_eq!(
        (report.completed, report.cancelled, report.still_running),
        (0, 1, 1),
        "{report}"
    );
    assert_eq!(
        report.cancelled + report.still_running as u64,
        outcomes.len() as u64,
        "every cancelled call is counted once"
    );

    gate.open();
    wait_for("the detached thread exited", || {
        threads_named("td-cut") == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_turn_abandons_its_queued_sync_call_which_then_never_runs() {
    let gate = Gate::default();
    let ran = Arc::new(AtomicBool::new(false));
    let dispatcher = dispatcher(
        vec![gated("block", &gate), recording("record", &ran)],
        DispatcherConfig::new(1).queue_capacity(1),
    );
    let blocker = spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]);
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;
    let dropped = spawn_turn(&dispatcher, vec![ToolCall::new("record", json!({}))]);
    wait_for("the second call is queued", || {
        dispatcher.metrics().pool.queued == 1
    })
    .await;

    // Dropping the turn's future (here, by aborting its task) drops its waiter.
    dropped.abort();
    assert!(
        within("the aborted turn", dropped)
            .await
            .is_err_and(|error| error.is_cancelled())
    );
    gate.open();
    within("the blocking turn", blocker)
        .await
        .expect("no panic");
    wait_for("both jobs left the pool", || {
        dispatcher.metrics().pool.completed == 2
    })
    .await;
    assert!(
        !ran.load(Ordering::SeqCst),
        "a call whose turn was dropped while it was queued ran anyway"
    );
    assert_eq!(dispatcher.metrics().pool.stuck, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_turn_counts_its_running_sync_call_as_stuck_until_it_returns() {
    let gate = Gate::default();
    let dispatcher = dispatcher(vec![gated("block", &gate)], DispatcherConfig::new(1));
    let turn = spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]);
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;

    turn.abort();
    assert!(
        within("the aborted turn", turn)
            .await
            .is_err_and(|error| error.is_cancelled())
    );
    assert_eq!(
        dispatcher.metrics().pool.stuck,
        1,
        "a call whose turn was dropped while it ran counts as a stuck thread"
    );

    gate.open();
    wait_for("the stuck thread came back", || {
        dispatcher.metrics().pool.stuck == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_dispatcher_without_shutdown_neither_hangs_nor_leaks_threads() {
    let gate = Gate::default();
    let config = DispatcherConfig::new(2).thread_name("td-drop");
    let dispatcher = dispatcher(vec![gated("block", &gate)], config);
    let turns: Vec<_> = (0..3)
        .map(|_| spawn_turn(&dispatcher, vec![ToolCall::new("block", json!({}))]))
        .collect();
    wait_for("two calls run and one is queued", || {
        let pool = dispatcher.metrics().pool;
        (pool.busy, pool.queued) == (2, 1)
    })
    .await;
    assert_eq!(threads_named("td-drop"), 2);

    // Drop every handle: the turns' tasks and the dispatcher itself. Nothing waits here.
    for turn in &turns {
        turn.abort();
    }
    for turn in turns {
        assert!(
            within("an aborted turn", turn)
                .await
                .is_err_and(|error| error.is_cancelled())
        );
    }
    drop(dispatcher);

    // Both threads are still inside the tool; once it returns they exit on their own.
    assert_eq!(threads_named("td-drop"), 2);
    gate.open();
    wait_for("the pool's threads exited", || {
        threads_named("td-drop") == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_added_with_with_tools_share_the_pool_and_its_shutdown() {
    let config = DispatcherConfig::new(1).thread_name("td-shared");
    let dispatcher = dispatcher(Vec::new(), config);
    let thread = Tool::new_sync(
        ToolSpec::new("thread", "Names its thread"),
        |_: Arguments| ok_value(json!(std::thread::current().name().unwrap_or_default())),
    );
    let registry = async_grpo_tool_dispatch::Registry::new()
        .with(thread)
        .expect("one tool");
    let per_rollout = dispatcher.with_tools(registry);
    assert!(
        dispatcher.registry().is_empty(),
        "the parent keeps its own tools"
    );
    let results = within(
        "the derived turn",
        per_rollout.run(vec![ToolCall::new("thread", json!({}))]),
    )
    .await
    .expect("admitted");
    assert_eq!(
        results[0].content, "td-shared-0",
        "ran on the parent's pool"
    );
    let report = within("the shutdown", dispatcher.shutdown(Duration::from_secs(5))).await;
    assert_eq!(report.threads_joined, 1);
    assert!(
        refuses_turns(&per_rollout),
        "the parent's shutdown closes the derived dispatcher too"
    );
}
