//! The lease file: the kernels an engine holds, so that the next run deletes what a run that
//! was killed left ([`crate::Gateway::reap_leases`]).
//!
//! A journal of lines `+ID` (started) and `-ID` (deleted), appended as kernels come and go;
//! the kernels it holds are the `+` lines no `-` line follows. It is rewritten (to a
//! temporary file renamed into place) when it has grown well past what it holds, and when
//! leases are reaped. One engine (one [`crate::Gateway`] and its clones) per file: two that
//! share a file reap each other's kernels.

use std::{
    collections::{BTreeSet, HashSet},
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use crate::KernelError;

/// Lines appended past twice what the file holds before it is rewritten.
const REWRITE_AFTER: usize = 1024;

#[derive(Debug)]
pub(crate) struct Leases {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The kernels this engine holds now.
    live: HashSet<String>,
    /// Lines appended since the file was last rewritten.
    appended: usize,
}

impl Leases {
    pub(crate) fn new(path: PathBuf) -> Leases {
        Leases {
            path,
            state: Mutex::new(State::default()),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Records kernel `id` as held.
    pub(crate) fn add(&self, id: &str) -> Result<(), KernelError> {
        let mut state = self.lock();
        self.append(&format!("+{id}\n"))?;
        state.live.insert(id.to_owned());
        state.appended += 1;
        Ok(())
    }

    /// Records kernel `id` as deleted.
    pub(crate) fn release(&self, id: &str) -> Result<(), KernelError> {
        let mut state = self.lock();
        state.live.remove(id);
        self.append(&format!("-{id}\n"))?;
        state.appended += 1;
        if state.appended > REWRITE_AFTER + 2 * state.live.len() {
            let held = self.read()?;
            self.rewrite(&held)?;
            state.appended = 0;
        }
        Ok(())
    }

    /// The kernels the file holds that this engine does not: an earlier run's.
    pub(crate) fn left(&self) -> Result<Vec<String>, KernelError> {
        let state = self.lock();
        Ok(self
            .read()?
            .into_iter()
            .filter(|id| !state.live.contains(id))
            .collect())
    }

    /// Drops `gone` from the file, rewriting it.
    pub(crate) fn forget(&self, gone: &[String]) -> Result<(), KernelError> {
        let mut state = self.lock();
        let mut held = self.read()?;
        for id in gone {
            held.remove(id);
        }
        self.rewrite(&held)?;
        state.appended = 0;
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn error(&self, source: std::io::Error) -> KernelError {
        KernelError::Leases {
            path: self.path.clone(),
            source,
        }
    }

    fn append(&self, line: &str) -> Result<(), KernelError> {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| self.error(e))?;
        file.write_all(line.as_bytes()).map_err(|e| self.error(e))
    }

    /// What the file holds; a missing file holds nothing, and a line that is not a lease
    /// (a torn last line) is skipped.
    fn read(&self) -> Result<BTreeSet<String>, KernelError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(self.error(e)),
        };
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

    fn rewrite(&self, held: &BTreeSet<String>) -> Result<(), KernelError> {
        let mut name = self.path.file_name().unwrap_or_default().to_owned();
        name.push(".new");
        let staging = self.path.with_file_name(name);
        let text: String = held.iter().map(|id| format!("+{id}\n")).collect();
        std::fs::write(&staging, text).map_err(|e| self.error(e))?;
        std::fs::rename(&staging, &self.path).map_err(|e| self.error(e))
    }
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

    #[test]
    fn a_lease_is_held_until_released_and_a_new_engine_sees_what_is_left() {
        let dir = ScratchDir::new("kernels-leases-held");
        let path = dir.join("leases");
        let first = Leases::new(path.clone());
        first.add("a").expect("added");
        first.add("b").expect("added");
        first.release("a").expect("released");
        assert!(
            first.left().expect("read").is_empty(),
            "its own are not left"
        );
        let second = Leases::new(path.clone());
        assert_eq!(second.left().expect("read"), ["b"]);
        second.add("c").expect("added");
        second.forget(&["b".to_owned()]).expect("forgotten");
        assert!(second.left().expect("read").is_empty());
        assert_eq!(std::fs::read_to_string(&path).expect("the file"), "+c\n");
    }

    #[test]
    fn the_journal_is_rewritten_when_it_grows() {
        let dir = ScratchDir::new("kernels-leases-rewrite");
        let path = dir.join("leases");
        let leases = Leases::new(path.clone());
        leases.add("kept").expect("added");
        for i in 0..REWRITE_AFTER {
            leases.add(&format!("k{i}")).expect("added");
            leases.release(&format!("k{i}")).expect("released");
        }
        let text = std::fs::read_to_string(&path).expect("the file");
        assert!(
            text.lines().count() < 2 * REWRITE_AFTER,
            "{} lines",
            text.lines().count()
        );
        assert!(text.contains("+kept\n"));
        assert_eq!(Leases::new(path).left().expect("read"), ["kept"]);
    }

    #[test]
    fn lines_that_are_not_leases_are_skipped() {
        let dir = ScratchDir::new("kernels-leases-torn");
        let path = dir.join("leases");
        std::fs::write(&path, "+a\ngarbage\n+../etc\n+b").expect("written");
        assert_eq!(Leases::new(path).left().expect("read"), ["a", "b"]);
    }
}
