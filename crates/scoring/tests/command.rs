//! `command:PROGRAM`: a real external program scores the group.

use std::{sync::Arc, time::Duration};

use async_grpo_scoring::{
    Completion, FailureKind, Group, Reward, Scorer, ScorerConfig, builtin::CommandReward,
};
use serde_json::json;

fn group() -> Arc<Group> {
    Arc::new(Group::new(
        json!([{ "role": "user", "content": "Say hi" }]),
        vec![
            Completion::from_text("hi"),
            Completion::from_text("hello there"),
        ],
        json!({ "answer": "hi" })
            .as_object()
            .cloned()
            .unwrap_or_default(),
    ))
}

fn shell(script: &str) -> CommandReward {
    CommandReward::new("sh", ["-c".to_owned(), script.to_owned()])
}

async fn score_with(reward: CommandReward, timeout: Duration) -> async_grpo_scoring::Column {
    let scorer = Scorer::new(
        vec![Reward::from_async("command", reward).timeout(timeout)],
        ScorerConfig::default(),
    )
    .expect("valid");
    scorer.score(group()).await.columns.remove(0)
}

#[tokio::test]
async fn a_program_reads_the_group_on_stdin_and_prints_one_score_per_completion() {
    // A Python scorer: 1 when the text equals the row's answer, else minus its length / 100.
    let script = r#"
import json, sys
group = json.load(sys.stdin)
answer = group["row"]["answer"]
print(json.dumps([1.0 if c["text"] == answer else -len(c["text"]) / 100 for c in group["completions"]]))
"#;
    let column = score_with(
        CommandReward::new("python3", ["-c".to_owned(), script.to_owned()]),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(column.failure, None);
    assert_eq!(column.values, [Some(1.0), Some(-0.11)]);
}

#[tokio::test]
async fn a_failing_program_fails_its_column_with_its_own_words() {
    let column = score_with(
        shell("cat >/dev/null; echo 'no GPU for the judge' >&2; exit 3"),
        Duration::from_secs(20),
    )
    .await;
    let failure = column.failure.expect("the column failed");
    assert_eq!(failure.kind, FailureKind::Error);
    assert_eq!(
        failure.message,
        "'sh' exited with exit status: 3: no GPU for the judge"
    );
}

#[tokio::test]
async fn output_that_is_not_a_list_of_scores_is_explained() {
    let column = score_with(
        shell("cat >/dev/null; echo 'score: 1'"),
        Duration::from_secs(20),
    )
    .await;
    let failure = column.failure.expect("the column failed");
    assert!(
        failure
            .message
            .starts_with("'sh' must print a JSON array of numbers or nulls"),
        "{}",
        failure.message
    );
    assert!(
        failure.message.ends_with("it printed: \"score: 1\\n\""),
        "{}",
        failure.message
    );
}

#[tokio::test]
async fn a_program_past_its_timeout_is_stopped() {
    let started = std::time::Instant::now();
    let column = score_with(shell("sleep 30"), Duration::from_millis(200)).await;
    assert_eq!(column.failure.map(|f| f.kind), Some(FailureKind::Timeout));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the scorer did not wait for the program"
    );
}

#[tokio::test]
async fn a_missing_program_is_named() {
    let column = score_with(
        CommandReward::new("/nonexistent/judge", []),
        Duration::from_secs(5),
    )
    .await;
    let message = column.failure.map(|f| f.message).unwrap_or_default();
    assert!(
        message.starts_with("could not start '/nonexistent/judge': "),
        "{message}"
    );
}

#[tokio::test]
async fn a_program_killed_at_its_timeout_is_really_gone() {
    let pid_file = std::env::temp_dir().join(format!("scoring-kill-{}", std::process::id()));
    let script = format!("echo $$ > {}; exec sleep 30", pid_file.display());
    let column = score_with(shell(&script), Duration::from_millis(300)).await;
    assert_eq!(column.failure.map(|f| f.kind), Some(FailureKind::Timeout));

    let pid = std::fs::read_to_string(&pid_file).expect("the program wrote its pid");
    let _ = std::fs::remove_file(&pid_file);
    assert!(
        std::path::Path::new("/proc/self/stat").exists(),
        "this test reads /proc (Linux)"
    );
    let running = still_running(&pid).await;
    assert!(
        !running,
        "the program was killed when the scorer stopped waiting"
    );
}

#[tokio::test]
async fn what_a_program_leaves_running_is_killed_when_it_exits() {
    let pid_file = std::env::temp_dir().join(format!("scoring-tree-{}", std::process::id()));
    // The scorer answers at once but leaves a sleeper in the background holding stdout.
    let script = format!(
        "cat >/dev/null; sleep 7777 & echo $! > {}; echo '[1, 0]'",
        pid_file.display()
    );
    let started = std::time::Instant::now();
    let column = score_with(shell(&script), Duration::from_secs(20)).await;
    let waited = started.elapsed();
    let pid = std::fs::read_to_string(&pid_file).expect("the program wrote its child's pid");
    let _ = std::fs::remove_file(&pid_file);
    let running = still_running(&pid).await;
    if running {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status();
    }
    assert!(!running, "the background process outlived its scorer");
    assert_eq!(column.failure, None, "the scores were read");
    assert_eq!(column.values, [Some(1.0), Some(0.0)]);
    assert!(
        waited < Duration::from_secs(10),
        "the background process kept the scorer waiting"
    );
}

/// Whether process `pid` still runs after up to 2 s of waiting: gone, or a zombie waiting to
/// be reaped, is not running.
async fn still_running(pid: &str) -> bool {
    let stat = format!("/proc/{}/stat", pid.trim());
    for _ in 0..200 {
        let state = std::fs::read_to_string(&stat)
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.chars().next()));
        if !matches!(state, Some(Some(c)) if c != 'Z') {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}
