//! `python` with `session = "rollout"`: one interpreter per rollout, through the dispatcher a
//! rollout asks for ([`ToolDispatcher::for_rollout`]), in the real sandbox.

use std::time::Duration;

use async_grpo_tool_dispatch::{
    DispatcherConfig, Outcome, ToolCall, ToolDispatcher, ToolResult, builtin::ToolConfig,
};
use serde_json::{Value, json};

use crate::{dispatcher, error_of, within};

/// A dispatcher with a session-backed `python` tool of this `timeout` for `rollouts` rollouts.
fn sessions(timeout: &str, rollouts: usize) -> ToolDispatcher {
    let config = json!({"name": "python", "kind": "python", "session": "rollout", "warm": 2, "timeout": timeout});
    let tool = serde_json::from_value::<ToolConfig>(config)
        .expect("a tool table")
        .build_for(&process::Sandbox::default(), rollouts)
        .expect("a valid tool");
    dispatcher(vec![tool], DispatcherConfig::new(2))
}

async fn run(tools: &ToolDispatcher, code: &str) -> ToolResult {
    let mut results = within(
        "a Python call",
        tools.run(vec![ToolCall::new("python", json!({ "code": code }))]),
    )
    .await
    .expect("open");
    results.remove(0)
}

fn ok(result: &ToolResult) -> &str {
    assert_eq!(result.outcome, Outcome::Ok, "{}", result.content);
    &result.content
}

#[tokio::test]
async fn a_rollout_keeps_its_interpreter_and_a_sibling_sees_none_of_it() {
    let run_tools = sessions("20s", 4);
    let one = run_tools.for_rollout().expect("a per-rollout tool");
    let two = run_tools.for_rollout().expect("a per-rollout tool");
    ok(&run(
        &one,
        "import json\nseen = {'a': 1}\nopen('f.txt', 'w').write('x')",
    )
    .await);
    assert_eq!(
        ok(&run(&one, "json.dumps(seen), open('f.txt').read()").await),
        "('{\"a\": 1}', 'x')"
    );
    assert_eq!(
        ok(&run(
            &two,
            "import os\n'seen' in globals(), os.path.exists('f.txt')"
        )
        .await),
        "(False, False)"
    );
    // Outside a rollout, each call has an interpreter of its own.
    ok(&run(&run_tools, "kept = 1").await);
    let error = ok(&run(&run_tools, "kept").await).to_owned();
    assert!(error.contains("NameError"), "{error}");
    assert!(
        run_tools.metrics().tools[0].calls >= 5,
        "a rollout's calls count in the run's metrics: {:?}",
        run_tools.metrics().tools
    );
}

#[tokio::test]
async fn a_call_past_its_timeout_kills_the_interpreter_and_the_next_call_says_it_starts_afresh() {
    let base = sessions("1s", 2);
    let tools = base.for_rollout().expect("a per-rollout tool");
    ok(&run(&tools, "x = 41").await);
    let stuck = run(&tools, "while True:\n    pass").await;
    assert_eq!(stuck.outcome, Outcome::Failed);
    assert_eq!(
        error_of(&stuck.content),
        "tool 'python' failed: timed out after 1s: the interpreter was killed and the \
         session's state is lost; the next call starts a new interpreter"
    );
    let next = run(&tools, "'x' in globals()").await;
    assert_eq!(
        ok(&next),
        "[a new Python interpreter: the previous call timed out after 1s, and what earlier \
         calls defined is gone]\nFalse"
    );
    ok(&run(&tools, "x = 1").await);
    let died = run(&tools, "import os; os._exit(9)").await;
    assert_eq!(
        error_of(&died.content),
        "tool 'python' failed: the interpreter exited with code 9: the session's state is \
         lost; the next call starts a new interpreter"
    );
    assert!(ok(&run(&tools, "'x' in globals()").await).ends_with("]\nFalse"));
    // Both losses are counted, in the metrics of the dispatcher the run holds.
    let metrics = &base.metrics().tools[0];
    assert_eq!((metrics.sessions_lost, metrics.failed), (2, 2));
}

#[tokio::test]
async fn a_rollout_s_interpreter_dies_with_its_dispatcher() {
    let marker = format!("7{}.5", std::process::id());
    let tools = sessions("20s", 2)
        .for_rollout()
        .expect("a per-rollout tool");
    let code = format!(
        "import subprocess, time\np = subprocess.Popen(['sleep', '{marker}'])\n\
         while open(f'/proc/{{p.pid}}/cmdline').read().find('{marker}') < 0:\n    time.sleep(0.01)"
    );
    ok(&run(&tools, &code).await);
    assert!(running(&marker));
    drop(tools);
    let gone = async {
        while running(&marker) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within("the session's processes to die", gone).await;
}

/// Whether a process of this machine has `marker` on its command line.
fn running(marker: &str) -> bool {
    std::fs::read_dir("/proc").is_ok_and(|entries| {
        entries
            .flatten()
            .filter_map(|entry| std::fs::read(entry.path().join("cmdline")).ok())
            .any(|line| String::from_utf8_lossy(&line).contains(marker))
    })
}

#[test]
fn warm_without_a_session_is_refused_by_name() {
    let config: Value = json!({"name": "py", "kind": "python", "warm": 3});
    let error = serde_json::from_value::<ToolConfig>(config)
        .expect("a tool table")
        .build()
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        error.as_deref(),
        Some(
            "tool 'py': `warm` keeps interpreters ready for sessions: it needs `session = \"rollout\"`"
        )
    );
}
