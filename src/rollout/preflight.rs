//! What a run checks before it touches its output or asks a server anything: the tokenizer
//! and its template, every dataset row, the columns the rewards read, and whether the output
//! may be replaced. `--check` runs exactly these checks.

use std::{collections::BTreeSet, time::Instant};

use anyhow::bail;
use rollout::{
    DatasetError, data,
    output::{self, Held},
};
use rollout_core::{ChatTokenizer, RenderOptions};

use super::config::{Resolved, Settings};

/// What the checks found, for the run to use.
#[derive(Debug)]
pub(crate) struct Checked {
    /// The tokenizer, its chat template chosen.
    pub(crate) tokenizer: ChatTokenizer,
    /// Dataset rows that will be rolled out (bad rows skipped not counted).
    pub(crate) rows: u64,
    /// Bad rows set aside with `--skip-bad-rows`.
    pub(crate) bad_rows: u64,
}

/// Runs every check that needs no server; the first failure is the error.
pub(crate) fn check(resolved: &Resolved) -> anyhow::Result<Checked> {
    let settings = &resolved.settings;
    let tokenizer = load_tokenizer(settings)?;
    let (rows, bad_rows) = scan_dataset(resolved)?;
    check_output(settings)?;
    Ok(Checked {
        tokenizer,
        rows,
        bad_rows,
    })
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
/// or continues them (`--resume`); a Parquet output's journal, left by a run that did not
/// finish, likewise.
fn check_output(settings: &Settings) -> anyhow::Result<()> {
    if settings.writes_stdout() || settings.resume || settings.overwrite {
        return Ok(());
    }
    match output::held(&settings.out) {
        None => Ok(()),
        Some(Held::Rows) => bail!(
            "{} exists and holds rows; pass --resume to continue the run that wrote it, \
             --overwrite (or `overwrite = true`) to replace it, or --out to write elsewhere",
            settings.out.display()
        ),
        Some(Held::Journal(journal)) => bail!(
            "{} holds the rows of a run that did not finish; pass --resume to continue it, or \
             --overwrite to start again",
            journal.display()
        ),
    }
}

/// Reads every row once: each must parse (or, with `--skip-bad-rows`, is counted), there must
/// be at least one, and each column a reward reads must be in some row. Returns the rows and
/// the bad rows.
fn scan_dataset(resolved: &Resolved) -> anyhow::Result<(u64, u64)> {
    let settings = &resolved.settings;
    let path = &settings.dataset;
    let reader = data::open(path)?;
    let started = Instant::now();
    let mut said = started;
    let mut rows = 0u64;
    let mut bad_rows = 0u64;
    let mut columns = BTreeSet::new();
    for row in reader {
        let row = match row {
            Ok(row) => row,
            Err(DatasetError::Row { .. }) if settings.engine.skip_bad_rows => {
                bad_rows += 1;
                continue;
            }
            Err(error) => bail!("{error} (--skip-bad-rows sets bad rows aside and goes on)"),
        };
        rows += 1;
        for column in row.columns.keys() {
            if !columns.contains(column) {
                columns.insert(column.clone());
            }
        }
        if rows.is_multiple_of(4096) && said.elapsed().as_secs() >= 5 {
            said = Instant::now();
            tracing::info!(rows, elapsed = ?started.elapsed(), "checking the dataset");
        }
    }
    if rows == 0 {
        bail!(
            "dataset {}: no row to roll out{}",
            path.display(),
            if bad_rows > 0 {
                format!(" ({bad_rows} bad rows set aside)")
            } else {
                " (the file is empty)".to_owned()
            }
        );
    }
    for reward in &resolved.rewards {
        if let Some(column) = reward.reward.column()
            && !columns.contains(column)
        {
            let known: Vec<&str> = columns.iter().map(String::as_str).collect();
            bail!(
                "{}: no row of {} has a column '{column}'; its rows have: {}",
                reward.place(),
                path.display(),
                if known.is_empty() {
                    "no column but the prompt".to_owned()
                } else {
                    known.join(", ")
                }
            );
        }
    }
    Ok((rows, bad_rows))
}
