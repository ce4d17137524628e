//! Every outcome is a message the model can read, counted by kind; nothing crashes the caller.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use async_grpo_tool_dispatch::{
    Arguments, DispatcherConfig, Outcome, Tool, ToolCall, ToolError, ToolSpec, Unavailable,
};
use serde_json::{Value, json};

use crate::{Gate, dispatcher, error_of, gated, ok_value, quick, wait_for, within};

#[tokio::test]
async fn an_unknown_name_lists_the_known_tools_and_is_counted_apart() {
    let dispatcher = dispatcher(
        vec![quick("alpha"), quick("beta")],
        DispatcherConfig::new(1),
    );
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("gamma", json!({})).with_id("c1")]),
    )
    .await
    .expect("open");

    assert_eq!(results[0].outcome, Outcome::UnknownTool);
    assert_eq!(
        error_of(&results[0].content),
        "unknown tool 'gamma'; available tools: alpha, beta"
    );
    assert_eq!(
        results[0].to_message(),
        json!({ "role": "tool", "tool_call_id": "c1", "name": "gamma", "content": results[0].content })
    );
    let metrics = dispatcher.metrics();
    assert_eq!(metrics.unknown_tool, 1);
    assert!(metrics.tools.iter().all(|tool| tool.calls == 0));
}

#[tokio::test]
async fn bad_arguments_are_refused_before_the_tool_runs() {
    let ran = Arc::new(AtomicBool::new(false));
    let spec = ToolSpec::new("add", "Adds").parameters(json!({
        "type": "object",
        "properties": { "a": { "type": "integer" }, "b": { "type": "integer" } },
        "required": ["a", "b"]
    }));
    let tool = {
        let ran = Arc::clone(&ran);
        Tool::new_sync(spec, move |_: Arguments| {
            ran.store(true, Ordering::SeqCst);
            ok_value(json!(0))
        })
    };
    let dispatcher = dispatcher(vec![tool], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![
            ToolCall::new("add", json!({ "a": 1 })),
            ToolCall::new("add", json!("[1, 2]")),
            ToolCall::new("add", json!({ "a": 1, "b": "2" })),
        ]),
    )
    .await
    .expect("open");

    let errors: Vec<String> = results.iter().map(|r| error_of(&r.content)).collect();
    assert_eq!(
        errors,
        [
            "invalid arguments for tool 'add': missing required argument(s): b",
            "invalid arguments for tool 'add': arguments must be a JSON object, got an array in a string",
            "invalid arguments for tool 'add': argument 'b' must be an integer, got a string",
        ]
    );
    assert!(
        results
            .iter()
            .all(|r| r.outcome == Outcome::InvalidArguments)
    );
    assert!(!ran.load(Ordering::SeqCst), "the tool never ran");
    assert_eq!(
        dispatcher
            .metrics()
            .tool("add")
            .map(|t| (t.calls, t.invalid_arguments)),
        Some((3, 3))
    );
}

#[tokio::test]
async fn a_tool_error_becomes_an_error_message() {
    let tool = Tool::new_sync(
        ToolSpec::new("open", "Opens a file"),
        |_: Arguments| -> Result<Value, ToolError> { Err("no such file: notes.txt".into()) },
    );
    let dispatcher = dispatcher(vec![tool], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("open", json!({}))]),
    )
    .await
    .expect("open");

    assert_eq!(results[0].outcome, Outcome::Failed);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'open' failed: no such file: notes.txt"
    );
    assert_eq!(dispatcher.metrics().tool("open").map(|t| t.failed), Some(1));
}

#[tokio::test]
async fn a_panicking_sync_tool_is_reported_and_its_thread_survives() {
    let boom = Tool::new_sync(
        ToolSpec::new("boom", "Panics"),
        |_: Arguments| -> Result<Value, ToolError> { panic!("index out of bounds: the len is 0") },
    );
    let dispatcher = dispatcher(vec![boom, quick("after")], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![
            ToolCall::new("boom", json!({})),
            ToolCall::new("after", json!({})),
        ]),
    )
    .await
    .expect("open");

    assert_eq!(results[0].outcome, Outcome::Panicked);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'boom' panicked: index out of bounds: the len is 0"
    );
    assert_eq!(
        results[1].content, "after",
        "the same single thread ran the next call"
    );
    let metrics = dispatcher.metrics();
    assert_eq!(metrics.tool("boom").map(|t| t.panicked), Some(1));
    assert_eq!(metrics.pool.threads, 1);
}

#[tokio::test]
async fn a_panicking_async_tool_is_reported() {
    let boom = Tool::new_async(ToolSpec::new("boom", "Panics"), |_: Arguments| async {
        tokio::task::yield_now().await;
        panic!("async boom")
    });
    let dispatcher = dispatcher(vec![boom], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("boom", json!({}))]),
    )
    .await
    .expect("open");

    assert_eq!(results[0].outcome, Outcome::Panicked);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'boom' panicked: async boom"
    );
}

#[tokio::test(start_paused = true)]
async fn a_sync_timeout_answers_at_once_and_counts_the_thread_as_stuck_until_it_returns() {
    let gate = Gate::default();
    let entered = Arc::new(AtomicBool::new(false));
    let slow = {
        let (gate, entered) = (gate.clone(), Arc::clone(&entered));
        Tool::new_sync(
            ToolSpec::new("slow", "Waits for the test"),
            move |_: Arguments| {
                entered.store(true, Ordering::SeqCst);
                if gate.wait() {
                    ok_value(json!("opened"))
                } else {
                    Err("the test never opened the gate".into())
                }
            },
        )
        .timeout(Duration::from_secs(1))
    };
    let dispatcher = dispatcher(vec![slow], DispatcherConfig::new(1));
    let turn = {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move { dispatcher.run(vec![ToolCall::new("slow", json!({}))]).await })
    };
    // The paused clock stands still until the pool thread is inside the tool: the call times
    // out while running (what this test is about), never while queued (another test).
    wait_for("the pool thread starts the call", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    let results = within("the timed-out turn", turn)
        .await
        .expect("no panic")
        .expect("open");

    assert_eq!(results[0].outcome, Outcome::TimedOut);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'slow' timed out after 1s"
    );
    let metrics = dispatcher.metrics();
    assert_eq!(metrics.tool("slow").map(|t| t.timed_out), Some(1));
    assert_eq!((metrics.pool.stuck, metrics.pool.busy), (1, 1));

    gate.open();
    // The returning thread clears `stuck` (the call's handshake), then `busy` (the pool's
    // bookkeeping), one after the other: wait for both.
    wait_for("the stuck thread came back", || {
        let pool = dispatcher.metrics().pool;
        (pool.stuck, pool.busy) == (0, 0)
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_async_timeout_cancels_the_tools_future() {
    let dropped = Arc::new(AtomicBool::new(false));
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let tool = {
        let dropped = Arc::clone(&dropped);
        Tool::new_async(ToolSpec::new("hang", "Hangs"), move |_: Arguments| {
            let guard = SetOnDrop(Arc::clone(&dropped));
            async move {
                let _guard = guard;
                tokio::time::sleep(Duration::from_secs(3600)).await;
                ok_value(json!("late"))
            }
        })
        .timeout(Duration::from_secs(2))
    };
    let dispatcher = dispatcher(vec![tool], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("hang", json!({}))]),
    )
    .await
    .expect("open");

    assert_eq!(results[0].outcome, Outcome::TimedOut);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'hang' timed out after 2s"
    );
    assert!(
        dropped.load(Ordering::SeqCst),
        "the async tool's future was dropped"
    );
    assert_eq!(dispatcher.metrics().pool.stuck, 0);
}

#[tokio::test]
async fn a_call_that_times_out_while_queued_never_runs() {
    let gate = Gate::default();
    let ran = Arc::new(AtomicBool::new(false));
    let queued = {
        let ran = Arc::clone(&ran);
        Tool::new_sync(ToolSpec::new("queued", "Runs late"), move |_: Arguments| {
            ran.store(true, Ordering::SeqCst);
            ok_value(json!("ran"))
        })
        .timeout(Duration::from_millis(30))
    };
    let dispatcher = dispatcher(
        vec![gated("block", &gate), queued],
        DispatcherConfig::new(1),
    );

    let blocker = {
        let dispatcher = dispatcher.clone();
        tokio::spawn(async move {
            dispatcher
                .run(vec![ToolCall::new("block", json!({}))])
                .await
        })
    };
    wait_for("the blocking call runs", || {
        dispatcher.metrics().pool.busy == 1
    })
    .await;
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("queued", json!({}))]),
    )
    .await
    .expect("open");
    assert_eq!(results[0].outcome, Outcome::TimedOut);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'queued' timed out after 30ms waiting for a pool thread"
    );

    gate.open();
    within("the blocking turn", blocker)
        .await
        .expect("no panic")
        .expect("open");
    wait_for("both jobs left the pool", || {
        dispatcher.metrics().pool.completed == 2
    })
    .await;
    assert!(
        !ran.load(Ordering::SeqCst),
        "an abandoned queued call is skipped"
    );
    assert_eq!(dispatcher.metrics().pool.stuck, 0);
}

#[tokio::test]
async fn a_timeout_of_duration_max_means_no_limit_rather_than_a_panic() {
    let dispatcher = dispatcher(
        vec![quick("sync").timeout(Duration::MAX)],
        DispatcherConfig::new(1).default_timeout(Duration::MAX),
    );
    let results = within(
        "the turn",
        dispatcher.run(vec![ToolCall::new("sync", json!({}))]),
    )
    .await
    .expect("open");
    assert_eq!(results[0].content, "sync");
    let report = within("shutdown", dispatcher.shutdown(Duration::MAX)).await;
    assert_eq!((report.threads_joined, report.threads_detached), (1, 0));
}

#[tokio::test]
async fn per_rollout_tools_are_counted_in_the_dispatcher_they_were_made_from() {
    let root = dispatcher(vec![quick("alpha")], DispatcherConfig::new(2));
    let failing = || {
        Tool::new_sync(ToolSpec::new("search", "Fails"), |_: Arguments| {
            Err::<Value, _>("no such page".into())
        })
    };
    // Two rollouts' sessions, each with tools of its own; one also has the root's `alpha`.
    let first = root.with_tools(
        async_grpo_tool_dispatch::Registry::new()
            .with(failing())
            .expect("one tool"),
    );
    let second = root.with_tools(
        async_grpo_tool_dispatch::Registry::new()
            .with(failing())
            .and_then(|r| r.with(quick("alpha")))
            .expect("two tools"),
    );
    for session in [&first, &second] {
        within(
            "a session's turn",
            session.run(vec![ToolCall::new("search", json!({}))]),
        )
        .await
        .expect("open");
    }
    within(
        "a session's turn",
        second.run(vec![ToolCall::new("alpha", json!({}))]),
    )
    .await
    .expect("open");
    // One-off work on the pool is not a tool anyone called.
    let uncounted = root.with_uncounted_tools(
        async_grpo_tool_dispatch::Registry::new()
            .with(quick("session_create"))
            .expect("one tool"),
    );
    within(
        "a one-off",
        uncounted.run(vec![ToolCall::new("session_create", json!({}))]),
    )
    .await
    .expect("open");

    let metrics = root.metrics();
    let names: Vec<&str> = metrics.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["alpha", "search"]);
    let search = metrics.tool("search").expect("the sessions' tool");
    assert_eq!((search.calls, search.failed), (2, 2));
    assert_eq!(search.latency.count, 2);
    assert_eq!(metrics.tool("alpha").map(|t| (t.calls, t.ok)), Some((1, 1)));
}

#[tokio::test]
async fn a_backend_that_cannot_serve_is_unavailable_not_a_failure_of_the_call() {
    let down = Tool::new_async(ToolSpec::new("python", "Runs code"), |_: Arguments| async {
        Err::<Value, ToolError>(Unavailable("the gateway cannot be reached".to_owned()).into())
    });
    let failing = Tool::new_async(ToolSpec::new("broken", "Fails"), |_: Arguments| async {
        Err::<Value, ToolError>("bad input".into())
    });
    let dispatcher = dispatcher(vec![down, failing], DispatcherConfig::new(1));
    let results = within(
        "the turn",
        dispatcher.run(vec![
            ToolCall::new("python", json!({})),
            ToolCall::new("broken", json!({})),
        ]),
    )
    .await
    .expect("open");
    assert_eq!(results[0].outcome, Outcome::Unavailable);
    assert_eq!(
        error_of(&results[0].content),
        "tool 'python' is unavailable: the gateway cannot be reached"
    );
    assert_eq!(results[1].outcome, Outcome::Failed);
    let metrics = dispatcher.metrics();
    let counts: Vec<(u64, u64)> = metrics
        .tools
        .iter()
        .map(|tool| (tool.unavailable, tool.failed))
        .collect();
    assert_eq!(counts, [(1, 0), (0, 1)]);
}
