//! Datasets and outputs of a run as files.
//!
//! - [`data`]: the dataset's rows, JSON Lines or Parquet by the file's extension, read lazily
//!   ([`data::open`]), and what a run rolls out of them in which order ([`data::Plan`]:
//!   epochs, shuffles, one [`Shard`], less what a resumed output holds).
//! - [`output`]: where the training rows go ([`output::Output`]: a JSON Lines file, stdout or
//!   a Parquet file) and what an earlier run of the same output wrote ([`output::resume`]).
//!
//! Errors are [`FileError`]s that name the file, the line and what was expected; a dataset's
//! own are [`DatasetError`]s. The row type, [`DatasetRow`], is the loop's
//! (async-grpo-rollout-api), re-exported here.
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `parquet` | no | Parquet datasets and outputs ([`data::open`], [`output::Output`]) | parquet, arrow |

pub mod data;
mod file_error;
pub mod output;
#[cfg(feature = "parquet")]
mod parquet;

pub use crate::{
    data::{DatasetError, DatasetReader, DatasetRow, Shard},
    file_error::FileError,
};
/// Training rows as Arrow: the schema of Parquet outputs, a group's rows as one record
/// batch of it (what the row stream serves), and the groups an output holds as such batches
/// (what a resumed row stream serves again).
#[cfg(feature = "parquet")]
pub mod arrow {
    pub use crate::parquet::{batch as row_batch, output_groups, schema as row_schema};
}
