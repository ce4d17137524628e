//! What the workspace's tests, benchmarks and tasks share, so that each exists once:
//!
//! - [`cache_dir`] and [`fixture`]: where `cargo xtask fixtures` keeps the real tokenizers,
//!   templates and venvs (xtask's own tasks read the same function);
//! - [`within`] and [`wait_until`] (feature `wait`): waits bounded in real time that fail
//!   the test with what was awaited, never by a hang, with the test clock paused or not;
//! - [`cpu_seconds`] and [`threads_cpu_seconds`]: this process's CPU time, or some of its
//!   threads', for the benchmarks' per-turn figures;
//! - [`ScratchDir`]: a test's working directory, removed when the test passes;
//! - [`is_root`] and [`PlantedInHome`]: for the sandbox's tests, whether the tests run as
//!   root, and a credential planted under `$HOME`;
//! - [`tokenizers`] (feature `tokenizers`): the real tokenizers and templates the tests load;
//! - [`jupyter`] (feature `jupyter`): a real Jupyter Kernel Gateway, for the remote sessions.

#[cfg(feature = "jupyter")]
pub mod jupyter;
#[cfg(feature = "tokenizers")]
pub mod tokenizers;

use std::path::{Path, PathBuf};
#[cfg(feature = "wait")]
use std::time::{Duration, Instant};

/// `ASYNC_GRPO_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/async-grpo`: where everything heavy
/// the project fetches goes, never inside the repository.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ASYNC_GRPO_CACHE").filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"))
        .join("async-grpo")
}

/// A file or folder of the fixture cache; fails with what to run when the cache lacks it.
#[track_caller]
pub fn fixture(relative: &str) -> PathBuf {
    let path = cache_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask fixtures` to fetch the real tokenizers, templates and \
         venvs (the suites that need them run in the `fixtures` nextest profile)",
        path.display()
    );
    path
}

/// Awaits `future`; fails the test, naming `what`, if it is not done within `patience` of
/// real time. A thread keeps the time, so a paused test clock (which jumps to the next
/// timer whenever the runtime idles) neither ends the wait early nor stretches it.
#[cfg(feature = "wait")]
pub async fn within<F: Future>(patience: Duration, what: &str, future: F) -> F::Output {
    let (expire, expired) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("test-watchdog".to_owned())
        .spawn(move || {
            std::thread::sleep(patience);
            let _ = expire.send(());
        })
        .expect("a watchdog thread starts");
    tokio::select! {
        biased;
        output = future => output,
        _ = expired => panic!("{what}: not done after {patience:?}"),
    }
}

/// Waits until `condition` holds, checking every millisecond of real time while the
/// runtime's other tasks run; fails the test, naming `what`, after `patience`. It never
/// sleeps on the runtime's clock, so a paused clock does not move while it waits.
#[cfg(feature = "wait")]
pub async fn wait_until(patience: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + patience;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "{what}: not so after {patience:?}"
        );
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// This process's CPU seconds (user + system, all threads), from `/proc/self/stat`; 0 where
/// there is no `/proc`.
pub fn cpu_seconds() -> f64 {
    stat_cpu_seconds(Path::new("/proc/self/stat"))
}

/// The CPU seconds of this process's threads whose name starts with `prefix` (a runtime's
/// `thread_name`), from `/proc/self/task`; 0 where there is no `/proc`.
pub fn threads_cpu_seconds(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|name| name.trim_end().starts_with(prefix))
        })
        .map(|task| stat_cpu_seconds(&task.path().join("stat")))
        .sum()
}

/// User + system CPU seconds from a `stat` file of `/proc` (a process's or a thread's).
fn stat_cpu_seconds(path: &Path) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 of stat(5) (utime, stime), counted after the command's `)`, in
    // clock ticks (`sysconf(_SC_CLK_TCK)`: 100 on every Linux this runs on).
    (ticks(11) + ticks(12)) / 100.0
}

/// A directory a test works in (`temp_dir()/NAME-PID` by default), empty when made. Dropped after the test
/// passed, it is removed; dropped while the test panics, it is kept for a look at what the
/// failing run left.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Makes `temp_dir()/NAME-PID`, emptied of what an earlier run left.
    #[track_caller]
    pub fn new(name: &str) -> ScratchDir {
        ScratchDir::new_in(&std::env::temp_dir(), name)
    }

    /// Makes `PARENT/NAME-PID`, emptied of what an earlier run left.
    #[track_caller]
    pub fn new_in(parent: &Path, name: &str) -> ScratchDir {
        let dir = parent.join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
        ScratchDir(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Whether this process runs as root: then the sandbox runs programs as users of their own
/// (`async_grpo_process::SANDBOX_UIDS`), and root-only files are what it must keep closed.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("Uid:"))?;
            line.split_whitespace().nth(2).map(|euid| euid == "0")
        })
        .unwrap_or(false)
}

/// A credential planted under `$HOME` for a test of what sandboxed programs see of it:
/// `$HOME/DIR/FILE` holding a secret; the folder is removed when dropped (also when the test
/// fails: it is the user's home).
#[derive(Debug)]
pub struct PlantedInHome {
    dir: PathBuf,
    file: PathBuf,
}

impl PlantedInHome {
    /// `$HOME/.async-grpo-test-NAME-PID/FILE` holding `secret`.
    #[track_caller]
    pub fn new(name: &str, file: &str, secret: &str) -> PlantedInHome {
        let dir = format!(".async-grpo-test-{name}-{}", std::process::id());
        PlantedInHome::at(&dir, file, secret).expect("a fresh folder under $HOME")
    }

    /// `$HOME/DIR/FILE` holding `secret`; `None` where `$HOME/DIR` is there already (a real
    /// one, which a test leaves alone).
    #[track_caller]
    pub fn at(dir: &str, file: &str, secret: &str) -> Option<PlantedInHome> {
        let home = std::env::var_os("HOME").expect("a HOME to plant in");
        let dir = PathBuf::from(home).join(dir);
        if dir.exists() {
            return None;
        }
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
        let file = dir.join(file);
        std::fs::write(&file, secret)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", file.display()));
        Some(PlantedInHome { dir, file })
    }

    /// The planted file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Its folder, as `$HOME` names it (relative).
    pub fn name(&self) -> &str {
        self.dir
            .file_name()
            .and_then(|name| name.to_str())
            .unwrap_or_default()
    }
}

impl Drop for PlantedInHome {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
