//! [`FileError`]: a dataset or an output that could not be read or written, said as the user
//! needs it (the file, the line where there is one, and why), with the crate's own helpers
//! to build one.

use std::fmt;

/// A dataset or an output could not be read or written: which file (and line, when there
/// is one) and why, in one sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FileError(String);

impl FileError {
    /// An error saying `message`.
    pub(crate) fn new(message: impl Into<String>) -> FileError {
        FileError(message.into())
    }
}

impl From<std::io::Error> for FileError {
    fn from(error: std::io::Error) -> Self {
        FileError(error.to_string())
    }
}

impl From<crate::DatasetError> for FileError {
    fn from(error: crate::DatasetError) -> Self {
        FileError(error.to_string())
    }
}

impl From<serde_json::Error> for FileError {
    fn from(error: serde_json::Error) -> Self {
        FileError(error.to_string())
    }
}

#[cfg(feature = "parquet")]
impl From<arrow_schema::ArrowError> for FileError {
    fn from(error: arrow_schema::ArrowError) -> Self {
        FileError(error.to_string())
    }
}

#[cfg(feature = "parquet")]
impl From<parquet::errors::ParquetError> for FileError {
    fn from(error: parquet::errors::ParquetError) -> Self {
        FileError(error.to_string())
    }
}

/// What was being done when an error happened, put before it: `cannot read x: No such
/// file or directory`.
pub(crate) trait Context<T> {
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T, FileError>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T, FileError> {
        self.map_err(|error| FileError(format!("{}: {error}", what())))
    }
}

impl<T> Context<T> for Option<T> {
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T, FileError> {
        self.ok_or_else(|| FileError(what()))
    }
}

/// Returns a [`FileError`] saying the formatted message.
macro_rules! bail {
    ($($message:tt)*) => {
        return Err($crate::FileError::new(format!($($message)*)).into())
    };
}
pub(crate) use bail;
