//! What a run checks before it touches its output or asks a server anything: the tokenizer
//! and its template, every dataset row, the columns the rewards read, whether the output
//! may be replaced, and the plan. `--check` runs exactly these checks.

use anyhow::bail;
use async_grpo_run::{
    DatasetSource, Destination, OutputError, OutputMode, PlanSpec, RunPlan, ScanError,
};
use rollout_core::{ChatTokenizer, RenderOptions};

use super::config::{Resolved, Settings};

/// What the checks found, for the run to use.
#[derive(Debug)]
pub(crate) struct Checked {
    /// The tokenizer, its chat template chosen.
    pub(crate) tokenizer: ChatTokenizer,
    /// The dataset.
    pub(crate) dataset: DatasetSource,
    /// Dataset rows that will be rolled out (bad rows skipped not counted).
    pub(crate) rows: u64,
    /// Bad rows set aside with `--skip-bad-rows`.
    pub(crate) bad_rows: u64,
    /// The output file (none for stdout), read back when resumed.
    pub(crate) destination: Option<Destination>,
    /// The groups the run rolls out.
    pub(crate) plan: RunPlan,
}

/// Runs every check that needs no server; the first failure is the error.
pub(crate) fn check(resolved: &Resolved) -> anyhow::Result<Checked> {
    let settings = &resolved.settings;
    let tokenizer = load_tokenizer(settings)?;
    let dataset = DatasetSource::File(settings.dataset.clone());
    let (rows, bad_rows) = scan_dataset(resolved, &dataset)?;
    let destination = check_output(settings)?;
    let done = destination
        .as_ref()
        .map(|d| d.resumed().done.clone())
        .unwrap_or_default();
    let plan = plan_spec(settings).plan(rows, &done)?;
    Ok(Checked {
        tokenizer,
        dataset,
        rows,
        bad_rows,
        destination,
        plan,
    })
}

/// What the settings ask of the dataset: `--epochs`, `--shuffle` (seeded by `--seed`, or 0),
/// `--shard`, `--groups` of the whole run.
pub(crate) fn plan_spec(settings: &Settings) -> PlanSpec {
    PlanSpec {
        epochs: Some(settings.epochs),
        shuffle: settings
            .shuffle
            .then(|| settings.engine.sampling.seed.unwrap_or(0)),
        shard: settings.shard,
        max_groups: settings.engine.max_groups,
    }
}

/// The run's tokenizer with its chat template (`--chat-template` when given), checked to
/// render a prompt.
pub(crate) fn load_tokenizer(settings: &Settings) -> anyhow::Result<ChatTokenizer> {
    let mut tokenizer = ChatTokenizer::from_dir(&settings.tokenizer)?;
    if let Some(template) = &settings.chat_template {
        tokenizer = tokenizer.with_template_file(template)?;
    }
    tokenizer.template(&RenderOptions::generation())?;
    Ok(tokenizer)
}

/// The output may be written: it holds no rows unless the run replaces them (`--overwrite`)
/// or continues them (`--resume`, read back now); a Parquet output's journal, left by a run
/// that did not finish, likewise. Stdout has no file to check.
fn check_output(settings: &Settings) -> anyhow::Result<Option<Destination>> {
    if settings.writes_stdout() {
        return Ok(None);
    }
    let mode = if settings.resume {
        OutputMode::Resume
    } else if settings.overwrite {
        OutputMode::Overwrite
    } else {
        OutputMode::Create
    };
    match Destination::check(&settings.out, mode) {
        Ok(destination) => Ok(Some(destination)),
        Err(OutputError::HoldsRows { path }) => bail!(
            "{} exists and holds rows; pass --resume to continue the run that wrote it, \
             --overwrite (or `overwrite = true`) to replace it, or --out to write elsewhere",
            path.display()
        ),
        Err(OutputError::Unfinished { journal }) => bail!(
            "{} holds the rows of a run that did not finish; pass --resume to continue it, or \
             --overwrite to start again",
            journal.display()
        ),
        Err(OutputError::Resume(error)) => Err(error.into()),
    }
}

/// Reads every row once: each must parse (or, with `--skip-bad-rows`, is counted), there must
/// be at least one, and each column a reward reads must be in some row. Returns the rows and
/// the bad rows.
fn scan_dataset(resolved: &Resolved, dataset: &DatasetSource) -> anyhow::Result<(u64, u64)> {
    let settings = &resolved.settings;
    let path = &settings.dataset;
    let scanned = match dataset.scan(settings.engine.skip_bad_rows) {
        Ok(scanned) => scanned,
        Err(ScanError::Open(error)) => return Err(error.into()),
        Err(ScanError::Row(error)) => {
            bail!("{error} (--skip-bad-rows sets bad rows aside and goes on)")
        }
    };
    if scanned.rows == 0 {
        bail!(
            "dataset {}: no row to roll out{}",
            path.display(),
            if scanned.bad_rows > 0 {
                format!(" ({} bad rows set aside)", scanned.bad_rows)
            } else {
                " (the file is empty)".to_owned()
            }
        );
    }
    let rewards: Vec<_> = resolved.rewards.iter().map(|r| r.reward.clone()).collect();
    if let Some(missing) = scanned.missing_column(&rewards) {
        bail!(
            "{}: {}",
            resolved.rewards[missing.reward].place(),
            scanned.explain(&missing, path.display())
        );
    }
    Ok((scanned.rows, scanned.bad_rows))
}
