//! What a worker rolls out and where its groups go, through the engine's library: the
//! [`Dataset`] (rows given in memory, or a JSON Lines or Parquet file read with
//! [`rollout::data::open`]), the [`Plan`] of passes, shuffle and shard, and the
//! [`Destination`] every group handed to the trainer is also written to, which a worker
//! started again with `resume` continues ([`rollout::output`]).

use std::{collections::HashSet, io::Cursor, path::PathBuf, sync::Arc};

use rollout::{
    DatasetError, DatasetReader, DatasetRow,
    data::{self, Items, Plan},
    output::{self, Held, Output, Resumed},
};

use crate::settings::BridgeSettings;

/// The dataset's rows, every one checked at construction.
#[derive(Debug)]
pub(crate) enum Dataset {
    /// Rows given in memory.
    Rows(Arc<Vec<DatasetRow>>),
    /// A JSON Lines or Parquet file (by its extension), read again for each pass (all at
    /// once when shuffled), as the binary reads its dataset.
    File {
        /// Where it is.
        path: PathBuf,
        /// Its rows.
        rows: u64,
    },
}

impl Dataset {
    /// The rows given as JSON lines, or the file at `path`, each row parsed now so that a bad
    /// one is an error at construction. The error is the message (without the argument).
    pub(crate) fn read(
        lines: Option<Vec<String>>,
        path: Option<PathBuf>,
    ) -> Result<Dataset, String> {
        let dataset = match (lines, path) {
            (Some(lines), None) => {
                let text = lines.join("\n");
                let rows: Result<Vec<DatasetRow>, DatasetError> =
                    DatasetReader::new(Cursor::new(text.into_bytes()), "dataset").collect();
                Dataset::Rows(Arc::new(rows.map_err(|e| e.to_string())?))
            }
            (None, Some(path)) => {
                let mut rows = 0u64;
                for row in data::open(&path).map_err(|e| e.to_string())? {
                    row.map_err(|e| e.to_string())?;
                    rows += 1;
                }
                Dataset::File { path, rows }
            }
            _ => return Err("give rows, or a .jsonl or .parquet path".to_owned()),
        };
        if dataset.rows() == 0 {
            return Err("the dataset has no row".to_owned());
        }
        Ok(dataset)
    }

    /// How many rows it has.
    pub(crate) fn rows(&self) -> u64 {
        match self {
            Dataset::Rows(rows) => rows.len() as u64,
            Dataset::File { rows, .. } => *rows,
        }
    }

    /// The groups `plan` rolls out of it, each with its id.
    pub(crate) fn items(&self, plan: Plan) -> Result<Items, String> {
        match self {
            Dataset::Rows(rows) => Ok(plan.items_of(Arc::clone(rows))),
            Dataset::File { path, .. } => plan.items(path).map_err(|e| e.to_string()),
        }
    }
}

/// The run's passes over `rows` rows as `settings` ask, seeded by the sampling `seed` (or 0,
/// as the binary's), less the groups `done`. The error names the setting at fault.
///
/// Without `epochs` the worker rolls out until it is stopped: as many passes as group ids
/// (`epoch * rows + position`, a `u64`) can number, which no run reaches. The plan is a lazy
/// iterator, so nothing counts its groups ([`Plan::groups`] would go through every pass).
pub(crate) fn plan(
    rows: u64,
    settings: &BridgeSettings,
    seed: Option<u64>,
    done: HashSet<u64>,
) -> Result<Plan, String> {
    if let Some(shard) = settings.shard
        && shard.index >= rows
    {
        // Every pass would be empty: a plan without end would look for a group forever.
        return Err(format!(
            "shard: {shard} holds no row of a dataset of {rows} rows (it holds the rows whose \
             index modulo {} is {})",
            shard.count, shard.index
        ));
    }
    let epochs = settings.epochs.unwrap_or(u64::MAX / rows.max(1));
    let shuffle = settings.shuffle.then(|| seed.unwrap_or(0));
    Ok(Plan::new(rows, epochs, shuffle, settings.shard, done))
}

/// The output a worker writes every group it hands to the trainer to, and what it held when
/// the worker was made.
#[derive(Debug)]
pub(crate) struct Destination {
    path: PathBuf,
    resume: bool,
    resumed: Resumed,
}

impl Destination {
    /// `path`, to continue (`resume`: the groups it holds are read back, to be left out of the
    /// plan) or to start; without `resume`, one that holds rows already is refused rather than
    /// replaced, as the binary refuses it. The error is the message (without the argument).
    pub(crate) fn check(path: PathBuf, resume: bool) -> Result<Destination, String> {
        let resumed = if resume {
            let resumed = output::resume(&path).map_err(|e| e.to_string())?;
            tracing::info!(
                output = %path.display(),
                groups = resumed.done.len(),
                samples = resumed.samples,
                "resuming: the groups already written are not rolled out again"
            );
            for dropped in &resumed.dropped {
                tracing::warn!(output = %path.display(), "resuming: dropped {dropped}");
            }
            resumed
        } else {
            match output::held(&path) {
                None => Resumed::default(),
                Some(Held::Rows) => {
                    return Err(format!(
                        "{} exists and holds rows; pass resume=True to continue the run that \
                         wrote it, or remove it",
                        path.display()
                    ));
                }
                Some(Held::Journal(journal)) => {
                    return Err(format!(
                        "{} holds the rows of a run that did not finish; pass resume=True to \
                         continue it, or remove it",
                        journal.display()
                    ));
                }
            }
        };
        Ok(Destination {
            path,
            resume,
            resumed,
        })
    }

    /// The groups the output held (none unless resumed).
    pub(crate) fn done(&self) -> &HashSet<u64> {
        &self.resumed.done
    }

    /// Opens the output: created, or continued after its whole groups.
    pub(crate) fn open(&self) -> Result<Output, String> {
        Output::open(&self.path, self.resume, &self.resumed).map_err(|e| e.to_string())
    }
}
