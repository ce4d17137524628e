//! [`Cgroup`]: a control group of a program's own, which bounds the memory and the processes
//! of its whole tree, where the machine lets the engine make one.
//!
//! `prlimit`'s limits are per process: a child gets the same again, so a session that forks
//! could hold `processes × memory_mib`. A cgroup counts the tree as one. The engine makes one
//! per sandboxed program it runs to its end ([`Program::run`](crate::Program::run)) and per
//! Python session, inside its own cgroup (so what the engine is bounded by, its children
//! are too):
//!
//! - **cgroup v2** (the unified hierarchy), where the engine's cgroup delegates the `memory`
//!   and `pids` controllers to its children (`cgroup.subtree_control`): `memory.max` and
//!   `memory.swap.max = 0`, `pids.max`; killed whole through `cgroup.kill`.
//! - **cgroup v1**, where its `memory` and `pids` hierarchies are mounted and writable (a
//!   container's root): `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`),
//!   `pids.max`.
//! - **Neither** (not root, no delegation, a read-only `/sys/fs/cgroup`): the limits stay
//!   per process (`prlimit`), and the process count binds the tree still where the engine is
//!   root (each program has a uid of its own). [`Cgroup::availability`] says which, and why.
//!
//! A program enters its cgroup before it starts anything: its command line begins with
//! `sh -c 'echo $$ > …/cgroup.procs; exec "$@"'`, run outside the sandbox. The cgroup is
//! removed when dropped, after its processes are killed; one an engine killed with SIGKILL
//! left (empty: its programs died with it) is removed by the next engine that makes one.

use std::{
    path::{Path, PathBuf},
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::Limits;

/// Where the engine's programs' cgroups go, and in which hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Hierarchy {
    /// cgroup v2: the folder of the engine's own cgroup.
    V2(PathBuf),
    /// cgroup v1: the engine's own cgroup's folders in the `memory` and `pids` hierarchies.
    V1 { memory: PathBuf, pids: PathBuf },
}

/// What bounds a sandboxed program's whole tree here: cgroups, or per-process limits only.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CgroupSupport {
    /// cgroup v2, its memory and pids controllers delegated to the engine's cgroup.
    V2,
    /// cgroup v1's memory and pids hierarchies.
    V1,
    /// No cgroup can be made: why. Limits stay per process (`prlimit`), the process count
    /// per user (the whole tree's when the engine is root).
    Unavailable(String),
}

/// A cgroup of one program's tree, removed (its processes killed) when dropped.
#[derive(Debug)]
pub(crate) struct Cgroup {
    /// Its folders: one in v2, the memory and the pids one in v1.
    dirs: Vec<PathBuf>,
    v2: bool,
}

/// The prefix of the engine's programs' cgroups: `async-grpo-<engine pid>-<count>`.
const PREFIX: &str = "async-grpo-";

impl Cgroup {
    /// What this machine offers the engine, found once.
    pub(crate) fn availability() -> CgroupSupport {
        match hierarchy() {
            Ok(Hierarchy::V2(_)) => CgroupSupport::V2,
            Ok(Hierarchy::V1 { .. }) => CgroupSupport::V1,
            Err(why) => CgroupSupport::Unavailable(why.clone()),
        }
    }

    /// A new cgroup bounded by `limits` (`memory_mib` for the tree's memory, `processes` for
    /// its processes; 0 for none), or `None` where none can be made (said once in the log).
    pub(crate) fn new(limits: &Limits) -> Option<Cgroup> {
        let hierarchy = hierarchy().as_ref().ok()?;
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        );
        let (dirs, v2) = match hierarchy {
            Hierarchy::V2(base) => (vec![base.join(&name)], true),
            Hierarchy::V1 { memory, pids } => (vec![memory.join(&name), pids.join(&name)], false),
        };
        let cgroup = Cgroup { dirs, v2 };
        match cgroup.make(limits) {
            Ok(()) => Some(cgroup),
            Err(error) => {
                static SAID: OnceLock<()> = OnceLock::new();
                SAID.get_or_init(|| {
                    tracing::warn!("a cgroup could not be made ({error}): limits stay per process");
                });
                None
            }
        }
    }

    fn make(&self, limits: &Limits) -> std::io::Result<()> {
        const MIB: u64 = 1024 * 1024;
        let memory = limits.memory_mib.saturating_mul(MIB);
        for dir in &self.dirs {
            std::fs::create_dir(dir)?;
        }
        let set = |dir: &Path, file: &str, value: u64| -> std::io::Result<()> {
            if value > 0 {
                std::fs::write(dir.join(file), value.to_string())?;
            }
            Ok(())
        };
        if self.v2 {
            let dir = &self.dirs[0];
            set(dir, "memory.max", memory)?;
            if memory > 0 {
                // Absent where the kernel has no swap accounting: nothing to bound.
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            }
            set(dir, "pids.max", limits.processes)?;
        } else {
            set(&self.dirs[0], "memory.limit_in_bytes", memory)?;
            let swap = self.dirs[0].join("memory.memsw.limit_in_bytes");
            if memory > 0 && swap.exists() {
                std::fs::write(swap, memory.to_string())?;
            }
            set(&self.dirs[1], "pids.max", limits.processes)?;
        }
        Ok(())
    }

    /// The command line's start that moves the program into this cgroup, then runs the rest
    /// (`sh -c … sh FILE… -- PROGRAM ARGS…`).
    pub(crate) fn prefix(&self) -> Vec<String> {
        let mut prefix = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            // Each file gets the shell's pid; then the shell becomes the program.
            r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@""#
                .to_owned(),
            "sh".to_owned(),
        ];
        prefix.extend(
            self.dirs
                .iter()
                .map(|dir| dir.join("cgroup.procs").to_string_lossy().into_owned()),
        );
        prefix.push("--".to_owned());
        prefix
    }

    /// Kills every process in the cgroup.
    fn kill(&self) {
        if self.v2 && std::fs::write(self.dirs[0].join("cgroup.kill"), "1").is_ok() {
            return;
        }
        for dir in &self.dirs {
            for pid in members(dir) {
                kill(pid);
            }
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.kill();
        let dirs = std::mem::take(&mut self.dirs);
        // Killed processes leave their cgroup as they exit, within a few milliseconds: wait
        // that long here, so that a run that ends now leaves no cgroup behind.
        for _ in 0..50 {
            if remove(&dirs) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Still busy (a loaded machine): removed later, off this thread.
        std::thread::spawn(move || {
            for _ in 0..500 {
                std::thread::sleep(Duration::from_millis(10));
                if remove(&dirs) {
                    return;
                }
            }
            tracing::warn!(?dirs, "a program's cgroup could not be removed");
        });
    }
}

/// Removes the cgroups' folders (empty of processes); whether none is left.
fn remove(dirs: &[PathBuf]) -> bool {
    dirs.iter().all(|dir| match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(error) => error.kind() == std::io::ErrorKind::NotFound,
    })
}

/// The pids in a cgroup folder.
fn members(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

#[cfg(unix)]
fn kill(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(not(unix))]
fn kill(_pid: i32) {}

/// Where the engine's programs' cgroups go, found once; why none can be made otherwise.
fn hierarchy() -> &'static Result<Hierarchy, String> {
    static FOUND: OnceLock<Result<Hierarchy, String>> = OnceLock::new();
    FOUND.get_or_init(|| {
        let found = find(Path::new("/sys/fs/cgroup"), &own_cgroups()?);
        if let Ok(hierarchy) = &found {
            sweep(hierarchy);
        }
        found
    })
}

/// The engine's own cgroups, from `/proc/self/cgroup`: (controllers, path) per line.
fn own_cgroups() -> Result<Vec<(String, String)>, String> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|error| format!("/proc/self/cgroup cannot be read: {error}"))?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let _id = fields.next()?;
            Some((fields.next()?.to_owned(), fields.next()?.to_owned()))
        })
        .collect())
}

/// The engine's cgroup folders under `root` that can hold children bounded in memory and
/// processes: v2's when its controllers are delegated, else v1's.
fn find(root: &Path, own: &[(String, String)]) -> Result<Hierarchy, String> {
    let relative = |path: &str| PathBuf::from(path.trim_start_matches('/'));
    let writable = |dir: &Path| {
        // A folder made and removed: what making one per program needs.
        let probe = dir.join(format!("{PREFIX}probe-{}", std::process::id()));
        std::fs::create_dir(&probe).and_then(|()| std::fs::remove_dir(&probe))
    };
    let mut why = Vec::new();
    if let Some((_, path)) = own.iter().find(|(controllers, _)| controllers.is_empty()) {
        // v2 mounted at the root, or beside v1 (hybrid) at `unified`.
        for mount in [root.to_path_buf(), root.join("unified")] {
            let dir = mount.join(relative(path));
            let Ok(delegated) = std::fs::read_to_string(dir.join("cgroup.subtree_control")) else {
                continue;
            };
            let has = |name: &str| delegated.split_whitespace().any(|c| c == name);
            if !(has("memory") && has("pids")) {
                why.push(format!(
                    "cgroup v2's {} does not delegate the memory and pids controllers to its \
                     children (its cgroup.subtree_control: '{}')",
                    dir.display(),
                    delegated.trim()
                ));
                continue;
            }
            match writable(&dir) {
                Ok(()) => return Ok(Hierarchy::V2(dir)),
                Err(error) => why.push(format!("{} is not writable: {error}", dir.display())),
            }
        }
    }
    let v1 = |controller: &str| -> Result<PathBuf, String> {
        let (_, path) = own
            .iter()
            .find(|(controllers, _)| controllers.split(',').any(|c| c == controller))
            .ok_or_else(|| format!("no cgroup v1 {controller} hierarchy"))?;
        let dir = root.join(controller).join(relative(path));
        writable(&dir).map_err(|error| format!("{} is not writable: {error}", dir.display()))?;
        Ok(dir)
    };
    match (v1("memory"), v1("pids")) {
        (Ok(memory), Ok(pids)) => Ok(Hierarchy::V1 { memory, pids }),
        (memory, pids) => {
            why.extend(memory.err());
            why.extend(pids.err());
            Err(why.join("; "))
        }
    }
}

/// Removes the empty cgroups engines that are gone left (killed with SIGKILL, they could
/// not remove their own).
fn sweep(hierarchy: &Hierarchy) {
    let bases = match hierarchy {
        Hierarchy::V2(base) => vec![base.clone()],
        Hierarchy::V1 { memory, pids } => vec![memory.clone(), pids.clone()],
    };
    for base in bases {
        let Ok(entries) = std::fs::read_dir(&base) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(engine) = name
                .strip_prefix(PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{engine}")).exists() {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(lines: &[(&str, &str)]) -> Vec<(String, String)> {
        lines
            .iter()
            .map(|(c, p)| ((*c).to_owned(), (*p).to_owned()))
            .collect()
    }

    #[test]
    fn v2_is_taken_only_where_memory_and_pids_are_delegated_then_v1_is_tried() {
        let root = std::env::temp_dir().join(format!("cgroup-test-{}", std::process::id()));
        let unified = root.join("unified/engine");
        std::fs::create_dir_all(&unified).expect("a folder");
        std::fs::write(unified.join("cgroup.subtree_control"), "cpu pids\n").expect("a file");
        let lines = own(&[("", "/engine"), ("memory", "/engine"), ("pids", "/")]);
        let error = find(&root, &lines).err().unwrap_or_default();
        assert!(
            error.contains("does not delegate the memory and pids controllers")
                && error.contains("no cgroup v1")
                || error.contains("is not writable"),
            "{error}"
        );
        std::fs::write(unified.join("cgroup.subtree_control"), "memory pids\n").expect("a file");
        assert_eq!(find(&root, &lines), Ok(Hierarchy::V2(unified)));
        std::fs::remove_file(root.join("unified/engine/cgroup.subtree_control")).expect("rm");
        std::fs::create_dir_all(root.join("memory/engine")).expect("a folder");
        std::fs::create_dir_all(root.join("pids")).expect("a folder");
        assert_eq!(
            find(&root, &lines),
            Ok(Hierarchy::V1 {
                memory: root.join("memory/engine"),
                pids: root.join("pids"),
            })
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
