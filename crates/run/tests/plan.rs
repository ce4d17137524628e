//! [`PlanSpec`]: passes, shuffle, shards, resume and `max_groups`, by one rule.

use std::collections::HashSet;

use async_grpo_run::{PlanError, PlanSpec};
use files::Shard;

fn shard(index: u64, count: u64) -> Option<Shard> {
    Some(Shard { index, count })
}

#[test]
fn a_shard_that_holds_no_row_is_an_error_not_an_empty_run() {
    let spec = PlanSpec {
        epochs: Some(1),
        shard: shard(3, 4),
        ..PlanSpec::default()
    };
    let error = spec
        .plan(2, &HashSet::new())
        .expect_err("shard 3/4 of 2 rows is empty");
    assert_eq!(
        error,
        PlanError::EmptyShard {
            shard: Shard { index: 3, count: 4 },
            rows: 2
        }
    );
    assert_eq!(
        error.to_string(),
        "shard 3/4 holds no row of a dataset of 2 rows (it holds the rows whose index modulo 4 \
         is 3)"
    );
    // Unbounded passes over an empty shard would look for a group forever: refused too.
    let unbounded = PlanSpec {
        epochs: None,
        ..spec
    };
    assert!(matches!(
        unbounded.plan(2, &HashSet::new()),
        Err(PlanError::EmptyShard { .. })
    ));
    // The last row's shard holds it.
    let last = PlanSpec {
        shard: shard(1, 4),
        ..spec
    };
    assert_eq!(last.plan(2, &HashSet::new()).map(|p| p.total), Ok(Some(1)));
}

#[test]
fn a_dataset_without_rows_or_a_run_without_passes_is_refused() {
    let spec = PlanSpec {
        epochs: Some(1),
        ..PlanSpec::default()
    };
    assert!(matches!(
        spec.plan(0, &HashSet::new()),
        Err(PlanError::NoRows)
    ));
    let none = PlanSpec {
        epochs: Some(0),
        ..spec
    };
    assert!(matches!(
        none.plan(5, &HashSet::new()),
        Err(PlanError::NoEpochs)
    ));
}

#[test]
fn a_bounded_plan_counts_every_pass_of_its_shard_less_the_groups_done() {
    let spec = PlanSpec {
        epochs: Some(3),
        shuffle: Some(7),
        shard: shard(1, 2),
        max_groups: None,
    };
    // 5 rows: shard 1/2 holds rows 1 and 3 of each pass, 6 groups in 3 passes.
    let all = spec.plan(5, &HashSet::new()).expect("a plan");
    assert_eq!(all.total, Some(6));
    assert_eq!(all.plan.epochs, 3);
    assert_eq!(all.plan.shuffle, Some(7));
    // Two of those written by an earlier run: four left.
    let rows: Vec<u64> = group_ids(&all.plan);
    let done: HashSet<u64> = rows.iter().take(2).copied().collect();
    let resumed = spec.plan(5, &done).expect("a plan");
    assert_eq!(resumed.total, Some(4));
    let left = group_ids(&resumed.plan);
    assert_eq!(
        left,
        rows[2..].to_vec(),
        "the same groups, in the same order, less those done"
    );
}

#[test]
fn max_groups_counts_the_groups_a_resumed_output_holds() {
    let spec = PlanSpec {
        epochs: Some(2),
        max_groups: Some(5),
        ..PlanSpec::default()
    };
    let fresh = spec.plan(10, &HashSet::new()).expect("a plan");
    assert_eq!((fresh.max_groups, fresh.total), (Some(5), Some(5)));
    let done: HashSet<u64> = [0, 1, 2].into_iter().collect();
    let resumed = spec.plan(10, &done).expect("a plan");
    assert_eq!((resumed.max_groups, resumed.total), (Some(2), Some(2)));
    let past: HashSet<u64> = (0..7).collect();
    let over = spec.plan(10, &past).expect("a plan");
    assert_eq!((over.max_groups, over.total), (Some(0), Some(0)));
}

#[test]
fn a_plan_without_epochs_runs_until_stopped_and_counts_no_total() {
    let spec = PlanSpec {
        epochs: None,
        shard: shard(0, 4),
        ..PlanSpec::default()
    };
    let plan = spec.plan(8, &HashSet::new()).expect("a plan");
    assert_eq!(plan.total, None);
    assert_eq!(
        plan.plan.epochs,
        u64::MAX / 8,
        "as many passes as group ids can number"
    );
    // Rows 0 and 4 of pass after pass.
    let first: Vec<u64> = ids_of(plan.plan).take(5).collect();
    assert_eq!(first, [0, 4, 8, 12, 16]);
    let bounded = PlanSpec {
        max_groups: Some(3),
        ..spec
    };
    assert_eq!(
        bounded.plan(8, &HashSet::new()).map(|p| p.total),
        Ok(Some(3))
    );
}

/// Every group id a bounded plan rolls out, in order.
fn group_ids(plan: &files::data::Plan) -> Vec<u64> {
    ids_of(plan.clone()).collect()
}

/// The group ids of `plan`, in order, over rows made in memory.
fn ids_of(plan: files::data::Plan) -> impl Iterator<Item = u64> {
    let rows = (0..plan.rows)
        .map(|line| files::DatasetRow {
            source: "memory".into(),
            line: line as usize + 1,
            prompt: vec![rollout_core::Message::user(format!("question {line}"))],
            columns: serde_json::Map::new(),
        })
        .collect();
    plan.items_of(std::sync::Arc::new(rows))
        .map(|item| item.expect("rows in memory are good").0)
}
