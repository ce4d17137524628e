//! [`Destination`]: the file a run writes its groups to, checked before any work by one rule
//! for every adapter: a file that holds rows is continued only when the run resumes it,
//! replaced only when it says so, and refused otherwise, so no run loses rows written
//! before.

use std::path::{Path, PathBuf};

use files::{
    FileError,
    output::{self, Held, Output, Resumed},
};

/// What a run does with an output that holds rows already.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputMode {
    /// Refuse it (the default): nothing written before is lost.
    #[default]
    Create,
    /// Replace it.
    Overwrite,
    /// Continue it: its whole groups are kept and not rolled out again, a group cut
    /// mid-write is dropped, new groups are appended.
    Resume,
}

/// An output that may be written, and what it held when checked.
#[derive(Debug)]
pub struct Destination {
    path: PathBuf,
    mode: OutputMode,
    resumed: Resumed,
}

/// An output a run may not write as asked.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// It holds rows, and the run neither resumes nor replaces them.
    #[error("{} exists and holds rows", path.display())]
    HoldsRows {
        /// The output.
        path: PathBuf,
    },
    /// A Parquet output's journal holds the rows of a run that did not finish.
    #[error("{} holds the rows of a run that did not finish", journal.display())]
    Unfinished {
        /// The journal.
        journal: PathBuf,
    },
    /// What it holds could not be read back to resume it.
    #[error(transparent)]
    Resume(#[from] FileError),
}

impl Destination {
    /// `path` for a run in `mode`: read back when resumed (its whole groups found), refused
    /// when it holds rows and `mode` is [`OutputMode::Create`].
    ///
    /// # Errors
    ///
    /// An output that holds rows (or a journal) a [`OutputMode::Create`] run would replace,
    /// or one that cannot be read back to resume.
    pub fn check(path: impl Into<PathBuf>, mode: OutputMode) -> Result<Destination, OutputError> {
        let path = path.into();
        let resumed = match mode {
            OutputMode::Resume => output::resume(&path)?,
            OutputMode::Overwrite => Resumed::default(),
            OutputMode::Create => match output::held(&path) {
                None => Resumed::default(),
                Some(Held::Rows) => return Err(OutputError::HoldsRows { path }),
                Some(Held::Journal(journal)) => return Err(OutputError::Unfinished { journal }),
            },
        };
        Ok(Destination {
            path,
            mode,
            resumed,
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the run continues it.
    pub fn resumes(&self) -> bool {
        self.mode == OutputMode::Resume
    }

    /// What it held (nothing unless resumed): the groups done, their rows, what was dropped.
    pub fn resumed(&self) -> &Resumed {
        &self.resumed
    }

    /// Opens it: created (or emptied), or continued after its whole groups.
    ///
    /// # Errors
    ///
    /// The file cannot be created, cut back or opened.
    pub fn open(&self) -> Result<Output, FileError> {
        Output::open(&self.path, self.resumes(), &self.resumed)
    }

    /// The files of this output (the output, a Parquet one's journal, and the row stream's
    /// acknowledgements): what nothing the policy drives may read.
    pub fn files(&self) -> [PathBuf; 3] {
        [
            self.path.clone(),
            output::journal_path(&self.path),
            output::acks_path(&self.path),
        ]
    }
}
