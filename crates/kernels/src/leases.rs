//! Leases: the kernels an engine holds, written down so that the next engine deletes what an
//! engine that was killed left ([`crate::Gateway::reap_leases`]).
//!
//! Each engine (one [`crate::Gateway`] and its clones) writes a file of its own in the lease
//! folder, `<pid>-<random>.leases`, made at its first kernel and locked (`flock`) for as long
//! as the engine lives: the kernel frees the lock when the process ends, however it ends, so
//! an unlocked file is one whose engine is gone. The file is a journal of lines `+ID`
//! (started) and `-ID` (deleted); the kernels it holds are the `+` lines no `-` line follows.
//! It is rewritten in place when it has grown well past what it holds.
//!
//! A reaper takes the lock of each other file it finds; one it cannot take belongs to a live
//! engine, which is left alone, so engines sharing a folder never delete each other's kernels.
//! Of a file it could lock, the reaper deletes the kernels and then the file (a file whose
//! kernels could not all be deleted keeps those, for the next reaper).

use std::{
    collections::BTreeSet,
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use rustix::fs::{FlockOperation, flock};

use crate::{KernelError, kernel::random_id};

/// Lines appended past twice what the file holds before it is rewritten.
const REWRITE_AFTER: usize = 1024;
/// The lease files' extension.
const EXTENSION: &str = "leases";

#[derive(Debug)]
pub(crate) struct Leases {
    /// The folder of every engine's lease file.
    dir: PathBuf,
    /// This engine's file in it.
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// This engine's file, open and locked, from its first kernel on.
    file: Option<File>,
    /// How many kernels this engine holds now.
    live: usize,
    /// Lines appended since the file was last rewritten.
    appended: usize,
}

impl Leases {
    pub(crate) fn new(dir: PathBuf) -> Leases {
        let path = dir.join(format!(
            "{}-{}.{EXTENSION}",
            std::process::id(),
            &random_id()[..12]
        ));
        Leases {
            dir,
            path,
            state: Mutex::new(State::default()),
        }
    }

    /// The lease folder.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records kernel `id` as held.
    pub(crate) fn add(&self, id: &str) -> Result<(), KernelError> {
        let mut state = self.lock();
        if state.file.is_none() {
            state.file = Some(self.create()?);
        }
        self.append(&mut state, &format!("+{id}\n"))?;
        state.live += 1;
        Ok(())
    }

    /// Records kernel `id` as deleted.
    pub(crate) fn release(&self, id: &str) -> Result<(), KernelError> {
        let mut state = self.lock();
        state.live = state.live.saturating_sub(1);
        self.append(&mut state, &format!("-{id}\n"))?;
        if state.appended > REWRITE_AFTER + 2 * state.live {
            let Some(file) = state.file.as_mut() else {
                return Ok(());
            };
            let held = read(file).map_err(|e| error(&self.path, e))?;
            rewrite(file, &held).map_err(|e| error(&self.path, e))?;
            state.appended = 0;
        }
        Ok(())
    }

    /// The lease files of engines that are gone, each locked (so that no other reaper takes
    /// it), with the kernels it holds.
    pub(crate) fn left(&self) -> Result<Vec<Left>, KernelError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(error(&self.dir, e)),
        };
        let mut left = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| error(&self.dir, e))?.path();
            if path == self.path || path.extension().is_none_or(|e| e != EXTENSION) {
                continue;
            }
            let mut file = match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(file) => file,
                // Reaped and removed by another engine meanwhile.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(error(&path, e)),
            };
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                // Its engine is alive.
                Err(rustix::io::Errno::WOULDBLOCK) => continue,
                Err(e) => return Err(error(&path, e.into())),
            }
            let held = read(&mut file).map_err(|e| error(&path, e))?;
            left.push(Left { path, file, held });
        }
        Ok(left)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This engine's file, made and locked.
    fn create(&self) -> Result<File, KernelError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| error(&self.dir, e))?;
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .open(&self.path)
            .map_err(|e| error(&self.path, e))?;
        flock(&file, FlockOperation::NonBlockingLockExclusive)
            .map_err(|e| error(&self.path, e.into()))?;
        Ok(file)
    }

    fn append(&self, state: &mut State, line: &str) -> Result<(), KernelError> {
        let Some(file) = state.file.as_mut() else {
            return Ok(());
        };
        file.write_all(line.as_bytes())
            .map_err(|e| error(&self.path, e))?;
        state.appended += 1;
        Ok(())
    }
}

impl Drop for Leases {
    /// An engine that holds no kernel leaves no file.
    fn drop(&mut self) {
        let state = self.lock();
        if state.file.is_some() && state.live == 0 {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The lease file of an engine that is gone, locked by this one until dropped.
#[derive(Debug)]
pub(crate) struct Left {
    path: PathBuf,
    file: File,
    /// The kernels it holds.
    pub(crate) held: BTreeSet<String>,
}

impl Left {
    /// Done with: the file is removed when every kernel it held is gone, else rewritten to
    /// hold those still there, for the next reaper.
    pub(crate) fn finish(mut self, still_held: &BTreeSet<String>) -> Result<(), KernelError> {
        if still_held.is_empty() {
            return match std::fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(error(&self.path, e)),
                _ => Ok(()),
            };
        }
        rewrite(&mut self.file, still_held).map_err(|e| error(&self.path, e))
    }
}

fn error(path: &Path, source: std::io::Error) -> KernelError {
    KernelError::Leases {
        path: path.to_owned(),
        source,
    }
}

/// What a lease file holds; a line that is not a lease (a torn last line) is skipped.
fn read(file: &mut File) -> std::io::Result<BTreeSet<String>> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_string(&mut text)?;
    let mut held = BTreeSet::new();
    for line in text.lines() {
        if let Some(id) = line.strip_prefix('+').filter(|id| valid_id(id)) {
            held.insert(id.to_owned());
        } else if let Some(id) = line.strip_prefix('-') {
            held.remove(id);
        }
    }
    Ok(held)
}

/// Rewrites a lease file in place (a new file renamed over it would not carry its lock).
fn rewrite(file: &mut File, held: &BTreeSet<String>) -> std::io::Result<()> {
    let text: String = held.iter().map(|id| format!("+{id}\n")).collect();
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(text.as_bytes())?;
    file.sync_data()
}

/// Whether `id` can be a kernel's id: it goes into URLs and the lease file, and a gateway's
/// answer is not trusted to be one (Jupyter's are UUIDs).
pub(crate) fn valid_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use test_support::ScratchDir;

    use super::*;

    fn ids(left: &[Left]) -> Vec<Vec<String>> {
        left.iter()
            .map(|l| l.held.iter().cloned().collect())
            .collect()
    }

    #[test]
    fn a_live_engines_leases_are_not_left_and_a_gone_engines_are() {
        let dir = ScratchDir::new("kernels-leases-held");
        let first = Leases::new(dir.to_path_buf());
        first.add("a").expect("added");
        first.add("b").expect("added");
        first.release("a").expect("released");
        let second = Leases::new(dir.to_path_buf());
        assert!(
            ids(&second.left().expect("read")).is_empty(),
            "a live engine's file is locked"
        );
        let done = Leases::new(dir.to_path_buf());
        done.add("c").expect("added");
        done.release("c").expect("released");
        drop(done);
        drop(first);
        let left = second.left().expect("read");
        assert_eq!(ids(&left), [["b"]]);
        assert!(
            ids(&Leases::new(dir.to_path_buf()).left().expect("read")).is_empty(),
            "a file being reaped is locked by its reaper"
        );
        for left in left {
            left.finish(&BTreeSet::new()).expect("finished");
        }
        assert_eq!(
            std::fs::read_dir(&*dir).expect("the folder").count(),
            0,
            "an engine that held nothing at its end left no file, and a reaped file is removed"
        );
    }

    #[test]
    fn a_file_keeps_what_could_not_be_reaped() {
        let dir = ScratchDir::new("kernels-leases-kept");
        let path = dir.join("1-gone.leases");
        std::fs::write(&path, "+a\n+b\n").expect("written");
        let reaper = Leases::new(dir.to_path_buf());
        let left = reaper.left().expect("read");
        assert_eq!(ids(&left), [["a", "b"]]);
        for left in left {
            left.finish(&BTreeSet::from(["b".to_owned()]))
                .expect("finished");
        }
        assert_eq!(std::fs::read_to_string(&path).expect("kept"), "+b\n");
    }

    #[test]
    fn the_journal_is_rewritten_when_it_grows_and_keeps_its_lock() {
        let dir = ScratchDir::new("kernels-leases-rewrite");
        let leases = Leases::new(dir.to_path_buf());
        leases.add("kept").expect("added");
        for i in 0..REWRITE_AFTER {
            leases.add(&format!("k{i}")).expect("added");
            leases.release(&format!("k{i}")).expect("released");
        }
        let text = std::fs::read_to_string(&leases.path).expect("the file");
        assert!(
            text.lines().count() < 2 * REWRITE_AFTER,
            "{} lines",
            text.lines().count()
        );
        assert!(text.contains("+kept\n"));
        let other = Leases::new(dir.to_path_buf());
        assert!(ids(&other.left().expect("read")).is_empty(), "still locked");
        drop(leases);
        assert_eq!(ids(&other.left().expect("read")), [["kept"]]);
    }

    #[test]
    fn lines_that_are_not_leases_and_files_that_are_not_lease_files_are_skipped() {
        let dir = ScratchDir::new("kernels-leases-torn");
        std::fs::write(dir.join("1-x.leases"), "+a\ngarbage\n+../etc\n+b").expect("written");
        std::fs::write(dir.join("notes.txt"), "+c\n").expect("written");
        let left = Leases::new(dir.to_path_buf()).left().expect("read");
        assert_eq!(ids(&left), [["a", "b"]]);
    }
}
