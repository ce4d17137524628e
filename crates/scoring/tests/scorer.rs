//! The scorer: concurrency between functions, and failure isolation between columns.

use std::{
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use async_grpo_scoring::{
    Completion, FailureKind, Group, Reward, RewardError, Scorer, ScorerConfig, ScorerError, Scores,
};
use serde_json::json;

fn group(n: usize) -> Arc<Group> {
    let completions = (0..n)
        .map(|i| Completion::from_text(format!("answer {i}")))
        .collect();
    Arc::new(Group::new(
        "prompt",
        completions,
        json!({ "answer": "answer 0" })
            .as_object()
            .cloned()
            .unwrap_or_default(),
    ))
}

fn constant(name: &str, value: f64) -> Reward {
    Reward::new_sync(name, move |group: &Group| {
        Ok(vec![Some(value); group.len()])
    })
}

/// A signal one reward function raises and another waits for (at most five seconds).
#[derive(Clone, Default)]
struct Signal(Arc<(Mutex<bool>, Condvar)>);

impl Signal {
    fn raise(&self) {
        *self.0.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.1.notify_all();
    }

    fn wait(&self) -> bool {
        let guard = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .0
            .1
            .wait_timeout_while(guard, Duration::from_secs(5), |raised| !*raised)
            .unwrap_or_else(|e| e.into_inner());
        *guard
    }
}

#[tokio::test]
async fn a_blocking_sync_reward_does_not_delay_an_async_one_in_the_same_group() {
    // The sync function blocks until the async one has run. Run one after the other, or the
    // sync one on the runtime's only thread, and the async one could never raise the signal:
    // the sync function would give up after five seconds and fail its column.
    let signal = Signal::default();
    let waiter = {
        let signal = signal.clone();
        Reward::new_sync(
            "waits",
            move |group: &Group| -> Result<Scores, RewardError> {
                if !signal.wait() {
                    return Err("the async reward never ran while this one blocked".into());
                }
                let thread = std::thread::current().name().unwrap_or_default().to_owned();
                if !thread.starts_with("reward-") {
                    return Err(format!("ran on {thread:?}, not on the scorer's pool").into());
                }
                Ok(vec![Some(1.0); group.len()])
            },
        )
    };
    let raiser = {
        let signal = signal.clone();
        Reward::new_async("raises", move |group: Arc<Group>| {
            let signal = signal.clone();
            async move {
                tokio::task::yield_now().await;
                signal.raise();
                Ok(vec![Some(0.5); group.len()])
            }
        })
    };
    let scorer =
        Scorer::new(vec![waiter, raiser], ScorerConfig::default().threads(1)).expect("valid");
    let scores = scorer.score(group(2)).await;

    assert_eq!(scores.columns[0].failure, None);
    assert_eq!(scores.rewards, [Some(1.5), Some(1.5)]);
}

#[tokio::test]
async fn errors_panics_timeouts_and_wrong_lengths_leave_the_other_columns_intact() {
    let rewards = vec![
        constant("good", 1.0).weight(2.0),
        Reward::new_sync("error", |_: &Group| -> Result<Scores, RewardError> {
            Err("judge unavailable".into())
        }),
        Reward::new_sync("panic", |_: &Group| -> Result<Scores, RewardError> {
            panic!("index out of range")
        }),
        Reward::new_async("async_panic", |_: Arc<Group>| async {
            panic!("async boom")
        }),
        Reward::new_sync("slow", |group: &Group| {
            std::thread::sleep(Duration::from_millis(500));
            Ok(vec![Some(9.0); group.len()])
        })
        .timeout(Duration::from_millis(50)),
        Reward::new_sync("short", |_: &Group| Ok(vec![Some(1.0)])),
    ];
    let scorer = Scorer::new(rewards, ScorerConfig::default().threads(2)).expect("valid");
    let scores = scorer.score(group(3)).await;

    assert_eq!(scores.columns[0].values, [Some(1.0); 3]);
    assert_eq!(
        scores.rewards,
        [Some(2.0); 3],
        "the group is scored on the good column alone"
    );
    let failures: Vec<_> = scores.columns[1..]
        .iter()
        .map(|c| c.failure.as_ref().map(|f| (f.kind, f.message.as_str())))
        .collect();
    assert_eq!(
        failures,
        [
            Some((FailureKind::Error, "judge unavailable")),
            Some((FailureKind::Panic, "index out of range")),
            Some((FailureKind::Panic, "async boom")),
            Some((FailureKind::Timeout, "timed out after 50ms")),
            Some((
                FailureKind::WrongLength,
                "returned 1 score(s) for 3 completion(s)"
            )),
        ]
    );
    assert!(scores.columns[1..].iter().all(|c| c.values == [None; 3]));

    let stats = scorer.stats();
    let counts: Vec<_> = stats
        .iter()
        .map(|(n, s)| {
            (
                n.as_str(),
                s.groups,
                s.errors + s.panics + s.timeouts + s.wrong_length,
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            ("good", 1, 0),
            ("error", 1, 1),
            ("panic", 1, 1),
            ("async_panic", 1, 1),
            ("slow", 1, 1),
            ("short", 1, 1)
        ]
    );
    assert_eq!(stats[4].1.timeouts, 1);
    let kept = stats[1].1.last_failure.as_ref().map(|f| f.message.as_str());
    assert_eq!(
        kept,
        Some("judge unavailable"),
        "the error is kept for the metrics"
    );
    assert_eq!(stats[0].1.last_failure, None);
}

#[tokio::test]
async fn nan_and_infinite_scores_are_unscored_cells_not_a_poisoned_group() {
    let odd = Reward::new_sync("odd", |_: &Group| {
        Ok(vec![Some(f64::NAN), Some(1.0), Some(f64::INFINITY)])
    });
    let scorer =
        Scorer::new(vec![odd, constant("base", 0.5)], ScorerConfig::default()).expect("valid");
    let scores = scorer.score(group(3)).await;

    assert_eq!(scores.columns[0].values, [None, Some(1.0), None]);
    assert_eq!(scores.columns[0].non_finite, [0, 2]);
    assert_eq!(scores.rewards, [Some(0.5), Some(1.5), Some(0.5)]);
    assert_eq!(scorer.stats()[0].1.non_finite, 2);
}

#[tokio::test]
async fn a_completion_no_column_scores_is_unscorable_and_metrics_say_so() {
    let partial = Reward::new_sync("partial", |_: &Group| {
        Ok(vec![Some(1.0), None, Some(0.0), Some(0.0)])
    });
    let scorer = Scorer::new(vec![partial], ScorerConfig::default()).expect("valid");
    let group = group(4);
    let scores = scorer.score(Arc::clone(&group)).await;

    assert_eq!(scores.rewards, [Some(1.0), None, Some(0.0), Some(0.0)]);
    let metrics = scores.metrics.to_map();
    // Scorable {1, 0, 0}: mean 1/3; population variance (4/9 + 1/9 + 1/9) / 3 = 2/9.
    assert!((metrics["reward"] - 1.0 / 3.0).abs() < 1e-12);
    assert!((metrics["reward_std"] - (2.0f64 / 9.0).sqrt()).abs() < 1e-12);
    assert!((metrics["rewards/partial/mean"] - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(
        (metrics["frac_unscorable"], metrics["frac_reward_zero_std"]),
        (0.25, 0.0)
    );

    let advantages = scores.advantages(&group, &async_grpo_scoring::AdvantageConfig::default());
    assert_eq!(advantages.advantages[1], 0.0);
    assert_eq!(advantages.baseline_size, 3);
}

#[tokio::test]
async fn a_group_where_everyone_ties_is_flagged_zero_std() {
    let scorer = Scorer::new(vec![constant("same", 1.0)], ScorerConfig::default()).expect("valid");
    let scores = scorer.score(group(3)).await;
    assert!(scores.metrics.zero_std);
    assert_eq!(scores.metrics.to_map()["frac_reward_zero_std"], 1.0);
}

#[test]
fn a_scorer_refuses_duplicate_names_and_non_finite_weights() {
    let duplicate = Scorer::new(
        vec![constant("a", 1.0), constant("a", 2.0)],
        ScorerConfig::default(),
    );
    assert_eq!(
        duplicate.err(),
        Some(ScorerError::Duplicate { name: "a".into() })
    );
    let weight = Scorer::new(
        vec![constant("a", 1.0).weight(f64::NAN)],
        ScorerConfig::default(),
    );
    assert!(matches!(weight.err(), Some(ScorerError::BadWeight { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_does_not_eat_into_a_functions_timeout() {
    // One thread, three groups at once, each call 150 ms with a 400 ms timeout: the third
    // starts about 300 ms after it was queued. Counted from the queue it would pass 400 ms
    // with its own run; counted from its start it is well within.
    let slow = Reward::new_sync("slow", |group: &Group| {
        std::thread::sleep(Duration::from_millis(150));
        Ok(vec![Some(1.0); group.len()])
    })
    .timeout(Duration::from_millis(400));
    let scorer = Scorer::new(vec![slow], ScorerConfig::default().threads(1)).expect("valid");
    let groups = (0..3).map(|_| {
        let scorer = scorer.clone();
        tokio::spawn(async move { scorer.score(group(1)).await })
    });
    for scored in futures::future::join_all(groups).await {
        let scored = scored.expect("no panic");
        assert_eq!(scored.columns[0].failure, None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_given_up_while_queued_never_runs() {
    const PATIENCE: Duration = Duration::from_secs(10);
    let signal = Signal::default();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (entered, mut entries) = tokio::sync::mpsc::unbounded_channel();
    let blocking = {
        let (signal, calls) = (signal.clone(), Arc::clone(&calls));
        Reward::new_sync("blocking", move |group: &Group| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = entered.send(());
            signal.wait();
            Ok(vec![Some(1.0); group.len()])
        })
    };
    let config = ScorerConfig::default()
        .threads(1)
        .queue_timeout(Duration::from_millis(100));
    let scorer = Scorer::new(vec![blocking], config).expect("valid");

    let first = {
        let scorer = scorer.clone();
        tokio::spawn(async move { scorer.score(group(1)).await })
    };
    // The first call holds the only thread before the second one is asked for.
    tokio::time::timeout(PATIENCE, entries.recv())
        .await
        .expect("the first call started on the pool's thread within 10 s");
    let second = scorer.score(group(1)).await;
    let failure = second.columns[0].failure.clone().expect("given up");
    assert_eq!(
        (failure.kind, failure.message.as_str()),
        (
            FailureKind::Timeout,
            "waited 100ms for a reward thread (all busy); not run"
        )
    );

    signal.raise();
    assert_eq!(first.await.expect("no panic").columns[0].failure, None);
    // The pool takes jobs in the order they came: by the time a third call has run, the
    // abandoned one queued before it was taken, and skipped or run.
    let third = tokio::time::timeout(PATIENCE, scorer.score(group(1)))
        .await
        .expect("a third call scored within 10 s");
    assert_eq!(third.columns[0].failure, None);
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "only the first and the third call ran: the abandoned one was skipped"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_inline_reward_runs_on_the_scoring_thread_and_its_panic_fails_only_its_column() {
    let scoring_thread = std::thread::current().id();
    let here = Reward::from_inline(
        "here",
        move |group: &Group| -> Result<Scores, RewardError> {
            if std::thread::current().id() != scoring_thread {
                return Err("ran on another thread than the one scoring the group".into());
            }
            Ok(vec![Some(1.0); group.len()])
        },
    );
    let panics = Reward::from_inline("panics", |_: &Group| -> Result<Scores, RewardError> {
        panic!("inline boom")
    });
    let scorer =
        Scorer::new(vec![here, panics], ScorerConfig::default().threads(1)).expect("valid");
    let scores = scorer.score(group(2)).await;

    assert_eq!(scores.columns[0].failure, None);
    assert_eq!(scores.rewards, [Some(1.0), Some(1.0)]);
    let failure = scores.columns[1]
        .failure
        .as_ref()
        .expect("the panic fails its column");
    assert_eq!(failure.kind, FailureKind::Panic);
    assert!(
        failure.message.contains("inline boom"),
        "{}",
        failure.message
    );
}
