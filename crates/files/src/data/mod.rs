//! What a run rolls out, in which order: the dataset's rows (JSON Lines or Parquet, by the
//! file's extension), repeated for each epoch, each pass shuffled with a seed when asked,
//! kept to one [`Shard`], less the groups a resumed output already holds ([`Plan`]).
//!
//! Every group's id is its place in the whole run (`epoch * rows + position in the epoch`),
//! whatever is skipped, so that shards and resumed runs write the ids (and, with a seed, the
//! request seeds) one run over everything would.

mod jsonl;

use std::{collections::HashSet, path::Path, sync::Arc};

use serde::{Deserialize, Serialize};

pub use self::jsonl::DatasetReader;
use crate::{FileError, file_error::bail};
pub use rollout_api::{DatasetError, DatasetRow};

/// Dataset rows, read lazily.
pub type Rows = Box<dyn Iterator<Item = Result<DatasetRow, DatasetError>> + Send>;

/// The groups to roll out: each row with its group's id.
pub type Items = Box<dyn Iterator<Item = Result<(u64, DatasetRow), DatasetError>> + Send>;

/// A dataset's format, from its file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// JSON Lines (any extension but `.parquet`).
    JsonLines,
    /// Apache Parquet (`.parquet`).
    Parquet,
}

impl Format {
    /// The format of the file at `path`, by its extension.
    pub fn of(path: &Path) -> Format {
        match path.extension().and_then(|e| e.to_str()) {
            Some(ext) if ext.eq_ignore_ascii_case("parquet") => Format::Parquet,
            _ => Format::JsonLines,
        }
    }
}

/// The rows of the dataset at `path`.
pub fn open(path: &Path) -> Result<Rows, FileError> {
    match Format::of(path) {
        Format::JsonLines => Ok(Box::new(DatasetReader::open(path)?)),
        Format::Parquet => open_parquet(path),
    }
}

#[cfg(feature = "parquet")]
fn open_parquet(path: &Path) -> Result<Rows, FileError> {
    Ok(Box::new(crate::parquet::rows(path)?))
}

#[cfg(not(feature = "parquet"))]
fn open_parquet(path: &Path) -> Result<Rows, FileError> {
    bail!("{}: {}", path.display(), NO_PARQUET)
}

/// Why a `.parquet` path cannot be used by a build without the `parquet` feature.
#[cfg(not(feature = "parquet"))]
pub(crate) const NO_PARQUET: &str = "a Parquet file, and this build reads and writes no Parquet \
     (the `rollout` crate's `parquet` feature): use JSON Lines instead";

/// One shard of the dataset: `index` of `count` (`I/N`, I from 0): the rows whose index
/// modulo `count` is `index`, so that `count` workers share a dataset without overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Which shard, from 0.
    pub index: u64,
    /// How many shards.
    pub count: u64,
}

impl Shard {
    /// Whether the dataset row at `row` (its index among the rows, from 0) is this shard's.
    pub fn holds(self, row: u64) -> bool {
        row % self.count == self.index
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    fn from_str(text: &str) -> Result<Shard, String> {
        let expected = || format!("expected I/N with 0 <= I < N, such as 0/4; got '{text}'");
        let (index, count) = text.split_once('/').ok_or_else(expected)?;
        let index: u64 = index.trim().parse().map_err(|_| expected())?;
        let count: u64 = count.trim().parse().map_err(|_| expected())?;
        if count == 0 || index >= count {
            return Err(expected());
        }
        Ok(Shard { index, count })
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl Serialize for Shard {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Shard {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Shard, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The run's passes over the dataset.
///
/// Every group's id is its place in the whole run (`epoch * rows + position in the epoch`),
/// whatever is skipped, so that shards and resumed runs write the ids (and, with a seed, the
/// request seeds) one run over everything would.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Rows the dataset holds (bad rows set aside not counted).
    pub rows: u64,
    /// Passes over the dataset.
    pub epochs: u64,
    /// The seed of the shuffle, when the rows are shuffled (each pass anew).
    pub shuffle: Option<u64>,
    /// The one shard rolled out, if not all.
    pub shard: Option<Shard>,
    /// Groups already written (a resumed run): not rolled out again.
    pub done: Arc<HashSet<u64>>,
}

impl Plan {
    /// `epochs` passes over a dataset of `rows` rows, less the groups `done`.
    pub fn new(
        rows: u64,
        epochs: u64,
        shuffle: Option<u64>,
        shard: Option<Shard>,
        done: HashSet<u64>,
    ) -> Plan {
        Plan {
            rows,
            epochs,
            shuffle,
            shard,
            done: Arc::new(done),
        }
    }

    /// The groups this run rolls out: every pass's rows of its shard, less those done.
    pub fn groups(&self) -> u64 {
        let mut count = 0;
        for epoch in 0..self.epochs {
            for (position, row) in self.order(epoch).into_iter().enumerate() {
                if self.takes(epoch, row, position as u64) {
                    count += 1;
                }
            }
        }
        count
    }

    /// The rows of pass `epoch`, in the order they are rolled out.
    fn order(&self, epoch: u64) -> Vec<u64> {
        match self.shuffle {
            Some(seed) => permutation(self.rows, seed, epoch),
            None => (0..self.rows).collect(),
        }
    }

    fn takes(&self, epoch: u64, row: u64, position: u64) -> bool {
        self.shard.is_none_or(|shard| shard.holds(row))
            && !self.done.contains(&(epoch * self.rows + position))
    }

    /// The groups to roll out, each with its id, reading the dataset again for each pass
    /// (all at once when shuffled). A bad row is passed on once, in the first pass, for the
    /// loop to stop at or skip.
    pub fn items(self, path: &Path) -> Result<Items, FileError> {
        if self.rows == 0 {
            bail!("{}: no row to roll out", path.display());
        }
        let path = path.to_path_buf();
        if self.shuffle.is_some() {
            let rows: Vec<DatasetRow> = open(&path)?.filter_map(Result::ok).collect();
            if rows.len() as u64 != self.rows {
                bail!(
                    "{}: {} rows now, {} when it was checked: the file changed under the run",
                    path.display(),
                    rows.len(),
                    self.rows
                );
            }
            return Ok(self.items_of(Arc::new(rows)));
        }
        let plan = self;
        let mut epoch = 0;
        let mut current = Some(open(&path)?);
        let mut position = 0u64;
        Ok(Box::new(std::iter::from_fn(move || {
            loop {
                let rows = current.as_mut()?;
                match rows.next() {
                    Some(Ok(row)) => {
                        let at = position;
                        position += 1;
                        if plan.takes(epoch, at, at) {
                            return Some(Ok((epoch * plan.rows + at, row)));
                        }
                    }
                    Some(Err(error)) if epoch == 0 => return Some(Err(error)),
                    Some(Err(_)) => {}
                    None => {
                        epoch += 1;
                        position = 0;
                        if epoch >= plan.epochs {
                            current = None;
                            return None;
                        }
                        match open(&path) {
                            Ok(rows) => current = Some(rows),
                            Err(error) => {
                                current = None;
                                return Some(Err(DatasetError::Row {
                                    path: path.display().to_string(),
                                    line: 0,
                                    reason: format!(
                                        "cannot read it again for pass {epoch}: {error}"
                                    ),
                                }));
                            }
                        }
                    }
                }
            }
        })))
    }

    /// The groups to roll out from rows already in memory (all of the dataset's, in its
    /// order), each with its id.
    ///
    /// # Panics
    ///
    /// When `rows` does not hold the plan's [`Plan::rows`] rows.
    pub fn items_of(self, rows: Arc<Vec<DatasetRow>>) -> Items {
        assert_eq!(
            rows.len() as u64,
            self.rows,
            "the plan's rows are the rows given"
        );
        let plan = self;
        Box::new((0..plan.epochs).flat_map(move |epoch| {
            let (rows, plan) = (Arc::clone(&rows), plan.clone());
            plan.order(epoch)
                .into_iter()
                .enumerate()
                .filter_map(move |(position, row)| {
                    let position = position as u64;
                    plan.takes(epoch, row, position)
                        .then(|| Ok((epoch * plan.rows + position, rows[row as usize].clone())))
                })
        }))
    }
}

/// The order of `rows` rows in pass `epoch` of a run shuffled with `seed`: a Fisher-Yates
/// shuffle driven by SplitMix64. Written here rather than taken from `rand`, whose shuffles
/// may change between versions: a resumed run and every shard must find the order of the
/// run they continue, whatever version of the program wrote it.
pub fn permutation(rows: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut state = seed ^ epoch.wrapping_mul(0xa076_1d64_78bd_642f);
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut order: Vec<u64> = (0..rows).collect();
    for i in (1..order.len()).rev() {
        // Lemire's multiply-shift: an index in 0..=i without modulo bias worth the name.
        let j = ((u128::from(next()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_permutation_holds_every_row_once_and_depends_on_seed_and_epoch() {
        let order = permutation(100, 7, 0);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(order, (0..100).collect::<Vec<_>>(), "shuffled");
        assert_eq!(order, permutation(100, 7, 0), "the same for the same seed");
        assert_ne!(order, permutation(100, 8, 0), "another seed, another order");
        assert_ne!(order, permutation(100, 7, 1), "another pass, another order");
    }

    fn plan(rows: u64, epochs: u64, shard: Option<Shard>, done: &[u64]) -> Plan {
        Plan {
            rows,
            epochs,
            shuffle: Some(3),
            shard,
            done: Arc::new(done.iter().copied().collect()),
        }
    }

    #[test]
    fn shards_split_every_pass_without_overlap_and_resumed_groups_are_left_out() {
        let all = plan(10, 2, None, &[]).groups();
        assert_eq!(all, 20);
        let parts: u64 = (0..3)
            .map(|index| plan(10, 2, Some(Shard { index, count: 3 }), &[]).groups())
            .sum();
        assert_eq!(parts, all);
        assert_eq!(plan(10, 2, None, &[0, 5, 19]).groups(), 17);
    }
}
