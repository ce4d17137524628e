//! What a run rolls out: `async_grpo_files::data::Plan` over a dataset file and over rows
//! in memory, one shard of it exactly the rows whose index modulo N is I, each with the id
//! one full run gives it.

use std::{collections::HashSet, path::PathBuf, sync::Arc};

use async_grpo_files::{
    DatasetRow, Shard,
    data::{Items, Plan},
};
use serde_json::json;

/// A dataset of `rows` rows in a file of its own; row `i` asks question `i`.
struct Dataset {
    path: PathBuf,
}

impl Dataset {
    fn new(name: &str, rows: usize) -> Dataset {
        let path =
            std::env::temp_dir().join(format!("rollout-data-{name}-{}.jsonl", std::process::id()));
        let text: String = (0..rows)
            .map(|i| {
                json!({"prompt": [{"role": "user", "content": format!("question {i}")}]})
                    .to_string()
                    + "\n"
            })
            .collect();
        std::fs::write(&path, text).expect("write the dataset");
        Dataset { path }
    }

    /// Every row, read back.
    fn rows(&self) -> Vec<DatasetRow> {
        async_grpo_files::data::open(&self.path)
            .expect("the dataset opens")
            .map(|row| row.expect("a good row"))
            .collect()
    }
}

impl Drop for Dataset {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Each group's id and the question its row asks.
fn taken(items: Items) -> Vec<(u64, String)> {
    items
        .map(|item| {
            let (id, row) = item.expect("a group");
            let question = row.prompt[0].content().unwrap_or_default().to_owned();
            (id, question)
        })
        .collect()
}

#[test]
fn shard_one_of_three_takes_the_rows_whose_index_modulo_three_is_one() {
    let dataset = Dataset::new("shard", 7);
    let shard: Shard = "1/3".parse().expect("a shard");
    let plan = Plan::new(7, 1, None, Some(shard), HashSet::new());
    let expected = vec![(1, "question 1".to_owned()), (4, "question 4".to_owned())];
    assert_eq!(
        taken(plan.clone().items(&dataset.path).expect("the plan reads")),
        expected,
        "read from the file"
    );
    assert_eq!(
        taken(plan.clone().items_of(Arc::new(dataset.rows()))),
        expected,
        "from rows in memory"
    );
    assert_eq!(plan.groups(), 2, "the groups counted are the groups taken");
    // The second pass takes the same rows, their ids one pass further.
    let two_passes = Plan::new(7, 2, None, Some(shard), HashSet::new());
    let ids: Vec<u64> = taken(two_passes.items(&dataset.path).expect("the plan reads"))
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, [1, 4, 8, 11]);
}
