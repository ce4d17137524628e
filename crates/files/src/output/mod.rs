//! Where the training rows go: a JSON Lines file, stdout, or a Parquet file ([`Output`]);
//! and [`resume`], which reads back what an earlier run of the same output wrote.
//!
//! A JSON Lines output gets each group in one write and a flush. A Parquet file is readable
//! only once its footer, written last, is there, so a Parquet output is written when the run
//! ends, from a JSON Lines journal (`OUT.partial.jsonl`) the run appends to group by group,
//! as it would to a JSON Lines output: a killed run leaves the journal, which `--resume`
//! continues.
//!
//! On resume, a torn last line (a write cut short) is dropped, and so is a group with
//! fewer rows in the file than its `group_samples`, which only the last group can be: each
//! is said. The groups left are done; the run rolls out the others and appends.

use std::{
    collections::{HashMap, HashSet},
    fs::{File, OpenOptions},
    io::{self, Read},
    path::{Path, PathBuf},
};

use rollout_core::TrainingSample;

pub use self::sink::JsonlSink;
use crate::{
    FileError,
    data::Format,
    file_error::{Context, bail},
};

mod sink;

/// An open output.
#[derive(Debug)]
pub enum Output {
    /// A JSON Lines file.
    Jsonl(JsonlSink<File>),
    /// JSON Lines on stdout.
    Stdout(JsonlSink<io::Stdout>),
    /// A Parquet file, written at the end from its journal.
    Parquet {
        /// The journal the run appends to.
        journal: JsonlSink<File>,
        /// Where the journal is.
        journal_path: PathBuf,
        /// The Parquet file.
        out: PathBuf,
        /// A complete Parquet output a resumed run continues, whose rows come first.
        previous: Option<PathBuf>,
    },
}

/// The journal of a Parquet output.
pub fn journal_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial.jsonl");
    PathBuf::from(name)
}

/// Where a run that serves its rows (`--serve-rows`) records the groups its trainers
/// acknowledged, beside `out`: `OUT.acks`, one position (a group's place among the output's
/// groups, from 0) per line. A run that starts afresh removes it; one that resumes serves the
/// output's groups it does not list again.
pub fn acks_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".acks");
    PathBuf::from(name)
}

/// The positions `out`'s acknowledgement record lists (see [`acks_path`]); `None` when there
/// is none. A torn last line (a write cut short) is not an acknowledgement.
pub fn acknowledged(out: &Path) -> Result<Option<HashSet<u64>>, FileError> {
    let path = acks_path(out);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => bail!("cannot read {}: {error}", path.display()),
    };
    let whole = text.rfind('\n').map_or("", |at| &text[..at]);
    let mut positions = HashSet::new();
    for (index, line) in whole.lines().enumerate() {
        match line.trim().parse::<u64>() {
            Ok(position) => {
                positions.insert(position);
            }
            Err(_) => bail!(
                "{}:{}: expected a group's position (a whole number), found {line:?}",
                path.display(),
                index + 1
            ),
        }
    }
    Ok(Some(positions))
}

/// Opens `out`'s acknowledgement record to append to (created when missing), cut back to its
/// whole lines first: a torn last line left by a killed run would otherwise run into the
/// next position written.
pub fn open_acks(out: &Path) -> Result<File, FileError> {
    let path = acks_path(out);
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let text = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let whole = text
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |at| at + 1);
    if whole < text.len() {
        file.set_len(whole as u64)
            .with_context(|| format!("cannot cut {} back to its whole lines", path.display()))?;
    }
    Ok(file)
}

/// What an output path already holds that a run starting afresh would replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// The output itself holds rows.
    Rows,
    /// A Parquet output's journal, at this path, holds the rows of a run that did not finish.
    Journal(PathBuf),
}

/// What `out` already holds, if anything: rows of its own, or (a Parquet output) a journal
/// left by a run that did not finish. A run that does not resume or replace it must refuse.
pub fn held(out: &Path) -> Option<Held> {
    let holds_rows = |path: &Path| std::fs::metadata(path).is_ok_and(|m| m.len() > 0);
    if holds_rows(out) {
        return Some(Held::Rows);
    }
    let journal = journal_path(out);
    (Format::of(out) == Format::Parquet && holds_rows(&journal)).then_some(Held::Journal(journal))
}

/// What an output held when a run resumed it.
#[derive(Debug, Default)]
pub struct Resumed {
    /// Groups whole in the output: not rolled out again.
    pub done: HashSet<u64>,
    /// Rows of those groups.
    pub samples: u64,
    /// What was dropped, for the user.
    pub dropped: Vec<String>,
    /// Where the JSON Lines kept end (bytes): the rest is cut off before appending.
    keep: Option<u64>,
    /// A complete Parquet output a Parquet run continues.
    previous: Option<PathBuf>,
}

impl Output {
    /// JSON Lines on stdout.
    pub fn stdout() -> Output {
        Output::Stdout(JsonlSink::new(io::stdout()))
    }

    /// Opens the output `out`: created (or emptied), or, with `resume`, continued after
    /// what `resumed` (from [`resume`]) found whole.
    pub fn open(out: &Path, resume: bool, resumed: &Resumed) -> Result<Output, FileError> {
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        if !resume {
            // Acknowledgements of the rows this run replaces would name its own.
            let acks = acks_path(out);
            match std::fs::remove_file(&acks) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => {
                    bail!("cannot remove {}: {error}", acks.display())
                }
                _ => {}
            }
        }
        match Format::of(out) {
            Format::JsonLines => Ok(Output::Jsonl(open_jsonl(out, resume, resumed)?)),
            Format::Parquet => {
                check_parquet(out)?;
                let journal_path = journal_path(out);
                Ok(Output::Parquet {
                    journal: open_jsonl(&journal_path, resume, resumed)?,
                    journal_path,
                    out: out.to_path_buf(),
                    previous: resumed.previous.clone(),
                })
            }
        }
    }

    /// Writes one group (one write and a flush).
    pub fn write_group(&mut self, samples: &[TrainingSample]) -> io::Result<()> {
        match self {
            Output::Jsonl(sink) => sink.write_group(samples),
            Output::Stdout(sink) => sink.write_group(samples),
            Output::Parquet { journal, .. } => journal.write_group(samples),
        }
    }

    /// Closes the output (a Parquet one is written now); returns the groups and samples
    /// this run wrote.
    pub fn finish(self) -> Result<(u64, u64), FileError> {
        match self {
            Output::Jsonl(sink) => Ok(sink.written()),
            Output::Stdout(sink) => Ok(sink.written()),
            Output::Parquet {
                journal,
                journal_path,
                out,
                previous,
            } => {
                let written = journal.written();
                drop(journal);
                write_parquet(&out, previous.as_deref(), &journal_path)?;
                std::fs::remove_file(&journal_path)
                    .with_context(|| format!("cannot remove {}", journal_path.display()))?;
                Ok(written)
            }
        }
    }
}

/// A JSON Lines file created, or continued where the resumed scan says it ends.
fn open_jsonl(path: &Path, resume: bool, resumed: &Resumed) -> Result<JsonlSink<File>, FileError> {
    if !resume {
        return JsonlSink::create(path)
            .with_context(|| format!("cannot create {}", path.display()));
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    if let Some(keep) = resumed.keep {
        file.set_len(keep)
            .with_context(|| format!("cannot cut {} back to its whole groups", path.display()))?;
    }
    Ok(JsonlSink::new(file))
}

#[cfg(feature = "parquet")]
fn check_parquet(_: &Path) -> Result<(), FileError> {
    Ok(())
}

#[cfg(not(feature = "parquet"))]
fn check_parquet(out: &Path) -> Result<(), FileError> {
    bail!("{}: {}", out.display(), crate::data::NO_PARQUET)
}

#[cfg(feature = "parquet")]
fn write_parquet(out: &Path, previous: Option<&Path>, journal: &Path) -> Result<(), FileError> {
    crate::parquet::write(out, previous, journal).map(|_| ())
}

#[cfg(not(feature = "parquet"))]
fn write_parquet(out: &Path, _: Option<&Path>, _: &Path) -> Result<(), FileError> {
    bail!("{}: {}", out.display(), crate::data::NO_PARQUET)
}

/// What the output `out` already holds, to resume it (nothing when it does not exist yet).
pub fn resume(out: &Path) -> Result<Resumed, FileError> {
    match Format::of(out) {
        Format::JsonLines if out.exists() => scan_jsonl(out),
        Format::JsonLines => Ok(Resumed::default()),
        Format::Parquet => {
            check_parquet(out)?;
            let journal = journal_path(out);
            let mut resumed = if journal.exists() {
                scan_jsonl(&journal)?
            } else {
                Resumed::default()
            };
            if out.exists() {
                let done = parquet_groups(out)?;
                resumed.samples += done.values().sum::<u64>();
                resumed.done.extend(done.keys());
                resumed.previous = Some(out.to_path_buf());
            }
            Ok(resumed)
        }
    }
}

#[cfg(feature = "parquet")]
fn parquet_groups(path: &Path) -> Result<HashMap<u64, u64>, FileError> {
    let mut groups = HashMap::new();
    for (group, _) in crate::parquet::groups(path)? {
        *groups.entry(group).or_insert(0) += 1;
    }
    Ok(groups)
}

#[cfg(not(feature = "parquet"))]
fn parquet_groups(path: &Path) -> Result<HashMap<u64, u64>, FileError> {
    bail!("{}: {}", path.display(), crate::data::NO_PARQUET)
}

/// A group as a resumed scan finds it.
struct Seen {
    /// Rows of it in the file.
    rows: u64,
    /// Rows it has (`group_samples`).
    expected: u64,
    /// Where its first row starts.
    start: u64,
    /// The line of its first row.
    line: usize,
}

/// Reads back a JSON Lines output: its whole groups, and where what follows them starts.
fn scan_jsonl(path: &Path) -> Result<Resumed, FileError> {
    let mut file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let mut resumed = Resumed::default();
    let complete = bytes
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |at| at + 1);
    let mut keep = complete as u64;
    if complete < bytes.len() {
        resumed.dropped.push(format!(
            "a torn last line ({} bytes, a write cut short)",
            bytes.len() - complete
        ));
    }
    let mut groups: Vec<(u64, Seen)> = Vec::new();
    let mut offset = 0u64;
    let lines: Vec<&[u8]> = bytes[..complete].split_inclusive(|&b| b == b'\n').collect();
    for (index, line) in lines.iter().enumerate() {
        let start = offset;
        offset += line.len() as u64;
        let sample: TrainingSample = match serde_json::from_slice(line) {
            Ok(sample) => sample,
            Err(_) if index + 1 == lines.len() => {
                resumed.dropped.push(format!(
                    "a last line that is not a whole training row ({} bytes)",
                    line.len()
                ));
                keep = start;
                break;
            }
            Err(error) => bail!(
                "{}:{}: not a training row ({error}); only an output this engine wrote can \
                 be resumed",
                path.display(),
                index + 1
            ),
        };
        match groups.last_mut() {
            Some((id, seen)) if *id == sample.group_id => seen.rows += 1,
            _ => groups.push((
                sample.group_id,
                Seen {
                    rows: 1,
                    expected: sample.group_samples,
                    start,
                    line: index + 1,
                },
            )),
        }
    }
    let last = groups.len().saturating_sub(1);
    for (index, (id, seen)) in groups.iter().enumerate() {
        if seen.rows >= seen.expected && !resumed.done.contains(id) {
            resumed.done.insert(*id);
            resumed.samples += seen.rows;
        } else if index == last && seen.rows < seen.expected {
            resumed.dropped.push(format!(
                "group {id}, cut mid-write ({} of its {} rows, from line {})",
                seen.rows, seen.expected, seen.line
            ));
            keep = seen.start;
        } else {
            bail!(
                "{}:{}: group {id} is not whole or not in one piece ({} rows there, {} \
                 expected); --resume continues only an output this program wrote",
                path.display(),
                seen.line,
                seen.rows,
                seen.expected
            );
        }
    }
    resumed.keep = Some(keep);
    Ok(resumed)
}
