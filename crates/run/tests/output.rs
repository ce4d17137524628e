//! [`Destination`]: an output that holds rows is refused, replaced or continued, as the run
//! says, and nothing written before is lost by accident.

use async_grpo_run::{Destination, OutputError, OutputMode};
use rollout_core::{Message, RolloutId, SampleMetrics, TrainingSample};
use serde_json::Map;
use test_support::ScratchDir;

fn sample(group_id: u64, rollout: u64) -> TrainingSample {
    TrainingSample {
        group_id,
        group_samples: 2,
        rollout_id: RolloutId(rollout),
        prompt: vec![Message::user("What is 6 * 7?")],
        completion: vec![Message::assistant("42")],
        input_ids: vec![1, 2, 3],
        completion_mask: vec![0, 1, 1],
        old_log_probs: vec![0.0, -0.5, -0.25],
        advantage: 0.5,
        reward: Some(1.0),
        rewards: Map::new(),
        model_version: 0,
        token_versions: Vec::new(),
        routed_experts: None,
        metrics: SampleMetrics::new(),
        environment: Map::new(),
        reward_notes: Map::new(),
        step_rewards: Vec::new(),
        advantage_spans: Vec::new(),
    }
}

/// Writes groups `ids` (two rows each) to `destination`'s file and closes it.
fn write(destination: &Destination, ids: &[u64]) {
    let mut output = destination.open().expect("the output opens");
    for &id in ids {
        output
            .write_group(&[sample(id, id * 2), sample(id, id * 2 + 1)])
            .expect("a group is written");
    }
    output.finish().expect("the output closes");
}

#[test]
fn an_output_that_holds_rows_is_refused_unless_the_run_resumes_or_replaces_it() {
    let dir = ScratchDir::new("run-output-refused");
    let path = dir.join("rows.jsonl");
    let fresh = Destination::check(&path, OutputMode::Create).expect("a new file may be written");
    assert!(fresh.resumed().done.is_empty());
    write(&fresh, &[0, 1]);

    match Destination::check(&path, OutputMode::Create) {
        Err(OutputError::HoldsRows { path: held }) => assert_eq!(held, path),
        other => panic!("expected the output refused, got {other:?}"),
    }
    // Replacing it is asked for: nothing read back, the file emptied when opened.
    let replaced = Destination::check(&path, OutputMode::Overwrite).expect("replacing is asked");
    assert!(replaced.resumed().done.is_empty());
    write(&replaced, &[7]);
    let text = std::fs::read_to_string(&path).expect("the output reads");
    assert_eq!(text.lines().count(), 2, "only the new group's rows: {text}");
}

#[test]
fn a_resumed_output_gives_its_whole_groups_and_keeps_them() {
    let dir = ScratchDir::new("run-output-resumed");
    let path = dir.join("rows.jsonl");
    write(
        &Destination::check(&path, OutputMode::Create).expect("a new file"),
        &[3, 5],
    );
    // A group cut mid-write, as a killed run leaves it.
    let mut text = std::fs::read_to_string(&path).expect("the output reads");
    text.push_str("{\"group_id\": 9, \"rollo");
    std::fs::write(&path, text).expect("the output is written");

    let resumed = Destination::check(&path, OutputMode::Resume).expect("the output resumes");
    assert!(resumed.resumes());
    let mut done: Vec<u64> = resumed.resumed().done.iter().copied().collect();
    done.sort_unstable();
    assert_eq!(done, [3, 5]);
    assert_eq!(resumed.resumed().samples, 4);
    assert_eq!(
        resumed.resumed().dropped.len(),
        1,
        "the cut group is dropped and said"
    );
    write(&resumed, &[6]);
    let text = std::fs::read_to_string(&path).expect("the output reads");
    assert_eq!(
        text.lines().count(),
        6,
        "kept groups, then the new one: {text}"
    );
}

#[test]
fn a_parquet_output_left_unfinished_is_refused_by_its_journal() {
    let dir = ScratchDir::new("run-output-journal");
    let path = dir.join("rows.parquet");
    let journal = files::output::journal_path(&path);
    std::fs::write(&journal, "{\"group_id\": 0}\n").expect("a journal is written");
    match Destination::check(&path, OutputMode::Create) {
        Err(OutputError::Unfinished { journal: held }) => assert_eq!(held, journal),
        other => panic!("expected the journal refused, got {other:?}"),
    }
    let destination = Destination::check(&path, OutputMode::Overwrite).expect("replacing is asked");
    let acks = files::output::acks_path(&path);
    assert_eq!(
        destination.files(),
        [path, journal, acks],
        "all three are the run's own files"
    );
}
