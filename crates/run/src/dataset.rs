//! [`DatasetSource`]: the rows a run rolls out, a JSON Lines or Parquet file or rows in
//! memory, scanned once before any work (every row parsed, the columns noted) and read again
//! for the run's [`Plan`].

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use files::{
    DatasetError, DatasetRow, FileError,
    data::{self, Items, Plan},
};
use scoring::Reward;

/// Where a run's rows are.
#[derive(Debug, Clone)]
pub enum DatasetSource {
    /// A JSON Lines or Parquet file (by its extension), read again for each pass (all at once
    /// when shuffled).
    File(PathBuf),
    /// Rows given in memory.
    Rows(Arc<Vec<DatasetRow>>),
}

/// What a scan of the dataset found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scanned {
    /// The rows that will be rolled out.
    pub rows: u64,
    /// Bad rows set aside (only when the scan was asked to skip them).
    pub bad_rows: u64,
    /// Every column some row has, the prompt aside.
    pub columns: BTreeSet<String>,
}

/// A dataset a scan could not read.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The file could not be opened.
    #[error(transparent)]
    Open(#[from] FileError),
    /// A row could not be read or is not of the expected shape.
    #[error(transparent)]
    Row(#[from] DatasetError),
}

/// A column a reward reads that no row of the dataset has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingColumn {
    /// The reward's place among the run's rewards.
    pub reward: usize,
    /// The column it reads.
    pub column: String,
}

impl DatasetSource {
    /// Reads every row once: each must parse, or with `skip_bad_rows` a row of the wrong
    /// shape is counted and set aside. Says how far it got every few seconds on a long file.
    ///
    /// # Errors
    ///
    /// The file cannot be opened, or a row cannot be read (or, without `skip_bad_rows`, is
    /// not of the expected shape).
    pub fn scan(&self, skip_bad_rows: bool) -> Result<Scanned, ScanError> {
        let mut scanned = Scanned::default();
        let note = |scanned: &mut Scanned, row: &DatasetRow| {
            scanned.rows += 1;
            for column in row.columns.keys() {
                if !scanned.columns.contains(column) {
                    scanned.columns.insert(column.clone());
                }
            }
        };
        match self {
            DatasetSource::Rows(rows) => {
                for row in rows.iter() {
                    note(&mut scanned, row);
                }
            }
            DatasetSource::File(path) => {
                let started = Instant::now();
                let mut said = started;
                for row in data::open(path)? {
                    match row {
                        Ok(row) => note(&mut scanned, &row),
                        Err(DatasetError::Row { .. }) if skip_bad_rows => scanned.bad_rows += 1,
                        Err(error) => return Err(error.into()),
                    }
                    if scanned.rows.is_multiple_of(4096) && said.elapsed() >= Duration::from_secs(5)
                    {
                        said = Instant::now();
                        tracing::info!(rows = scanned.rows, elapsed = ?started.elapsed(), "checking the dataset");
                    }
                }
            }
        }
        Ok(scanned)
    }

    /// The file, when the rows are in one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DatasetSource::File(path) => Some(path),
            DatasetSource::Rows(_) => None,
        }
    }

    /// The groups `plan` rolls out of it, each with its id.
    ///
    /// # Errors
    ///
    /// The file cannot be opened again, or changed since it was scanned.
    pub fn items(&self, plan: Plan) -> Result<Items, FileError> {
        match self {
            DatasetSource::Rows(rows) => Ok(plan.items_of(Arc::clone(rows))),
            DatasetSource::File(path) => plan.items(path),
        }
    }
}

impl Scanned {
    /// The first reward of `rewards` that reads a column no row has.
    pub fn missing_column(&self, rewards: &[Reward]) -> Option<MissingColumn> {
        rewards.iter().enumerate().find_map(|(reward, r)| {
            let column = r.column()?;
            (!self.columns.contains(column)).then(|| MissingColumn {
                reward,
                column: column.to_owned(),
            })
        })
    }

    /// `missing` in words, for `dataset` (its path, or how it was given): no row of it has
    /// the column, and the columns its rows do have.
    pub fn explain(&self, missing: &MissingColumn, dataset: impl std::fmt::Display) -> String {
        let present = if self.columns.is_empty() {
            "no column but the prompt".to_owned()
        } else {
            self.columns
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "no row of {dataset} has a column '{}'; its rows have: {present}",
            missing.column
        )
    }
}
