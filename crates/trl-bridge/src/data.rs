//! What a worker rolls out and where its groups go, through the engine's run spec
//! ([`async_grpo_run`]): the dataset (rows given in memory, or a JSON Lines or Parquet file),
//! the plan of passes, shuffle and shard by the binary's rule, and the [`Destination`]
//! every group handed to the trainer is also written to, which a worker started again with
//! `resume` continues.

use std::{io::Cursor, path::PathBuf, sync::Arc};

use async_grpo_run::{
    DatasetSource, Destination, OutputError, OutputMode, PlanSpec, RunPlan, ScanError, Scanned,
};
use files::{DatasetError, DatasetReader, DatasetRow};

use crate::settings::BridgeSettings;

/// The dataset's rows given as JSON lines, or the file at `path`, each row parsed now so
/// that a bad one is an error at construction, with what the scan found (its rows, its
/// columns). The error is the message (without the argument).
pub(crate) fn read_dataset(
    lines: Option<Vec<String>>,
    path: Option<PathBuf>,
) -> Result<(DatasetSource, Scanned), String> {
    let dataset = match (lines, path) {
        (Some(lines), None) => {
            let text = lines.join("\n");
            let rows: Result<Vec<DatasetRow>, DatasetError> =
                DatasetReader::new(Cursor::new(text.into_bytes()), "dataset").collect();
            DatasetSource::Rows(Arc::new(rows.map_err(|e| e.to_string())?))
        }
        (None, Some(path)) => DatasetSource::File(path),
        _ => return Err("give rows, or a .jsonl or .parquet path".to_owned()),
    };
    let scanned = dataset.scan(false).map_err(|e| match e {
        ScanError::Open(e) => e.to_string(),
        ScanError::Row(e) => e.to_string(),
    })?;
    if scanned.rows == 0 {
        return Err("the dataset has no row".to_owned());
    }
    Ok((dataset, scanned))
}

/// Each column a reward reads is in some row, as the binary checks it: the error names the
/// reward's place among `reward_funcs` and the columns the rows have.
pub(crate) fn check_columns(scanned: &Scanned, rewards: &[scoring::Reward]) -> Result<(), String> {
    match scanned.missing_column(rewards) {
        None => Ok(()),
        Some(missing) => Err(format!(
            "reward_funcs[{}]: {}",
            missing.reward,
            scanned.explain(&missing, "the dataset")
        )),
    }
}

/// What `settings` ask of the dataset, seeded by the sampling `seed` (or 0, as the binary's),
/// at most `max_groups` of the whole run. Without `epochs` the worker rolls out until it is
/// stopped.
pub(crate) fn plan_spec(
    settings: &BridgeSettings,
    seed: Option<u64>,
    max_groups: Option<u64>,
) -> PlanSpec {
    PlanSpec {
        epochs: settings.epochs,
        shuffle: settings.shuffle.then(|| seed.unwrap_or(0)),
        shard: settings.shard,
        max_groups,
    }
}

/// The run's plan over `rows` rows, less the groups `destination` held. The error names
/// the setting at fault.
pub(crate) fn plan(
    spec: &PlanSpec,
    rows: u64,
    destination: Option<&Destination>,
) -> Result<RunPlan, String> {
    let done = destination
        .map(|d| d.resumed().done.clone())
        .unwrap_or_default();
    spec.plan(rows, &done).map_err(|e| match e {
        async_grpo_run::PlanError::EmptyShard { .. } => format!("shard: {e}"),
        async_grpo_run::PlanError::NoEpochs => format!("epochs: {e}"),
        async_grpo_run::PlanError::NoRows => format!("dataset: {e}"),
    })
}

/// The output a worker writes every group it hands to the trainer to: to continue
/// (`resume`: the groups it holds are read back, to be left out of the plan) or to start;
/// without `resume`, one that holds rows already is refused rather than replaced, as the
/// binary refuses it. The error is the message (without the argument).
pub(crate) fn destination(path: PathBuf, resume: bool) -> Result<Destination, String> {
    let mode = if resume {
        OutputMode::Resume
    } else {
        OutputMode::Create
    };
    let destination = Destination::check(path, mode).map_err(|e| match e {
        OutputError::HoldsRows { path } => format!(
            "{} exists and holds rows; pass resume=True to continue the run that wrote it, \
             or remove it",
            path.display()
        ),
        OutputError::Unfinished { journal } => format!(
            "{} holds the rows of a run that did not finish; pass resume=True to continue \
             it, or remove it",
            journal.display()
        ),
        OutputError::Resume(e) => e.to_string(),
    })?;
    if destination.resumes() {
        let resumed = destination.resumed();
        let output = destination.path().display();
        tracing::info!(
            %output,
            groups = resumed.done.len(),
            samples = resumed.samples,
            "resuming: the groups already written are not rolled out again"
        );
        for dropped in &resumed.dropped {
            tracing::warn!(%output, "resuming: dropped {dropped}");
        }
    }
    Ok(destination)
}
