//! [`Sandbox`]: what a program may see and use, and the bubblewrap command line that gives it.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use std::sync::{
    OnceLock, RwLock,
    atomic::{AtomicU32, Ordering},
};

use crate::Error;

/// Environment variables of the engine that no program it starts ever sees, sandboxed or not:
/// the control endpoint's token.
pub const ENGINE_SECRETS: &[&str] = &["ASYNC_GRPO_LISTEN_TOKEN"];

/// The variables [`hide_secret`] added to [`ENGINE_SECRETS`].
static HIDDEN: RwLock<BTreeSet<String>> = RwLock::new(BTreeSet::new());

/// Hides the environment variable `name` from every program the engine starts from now on,
/// sandboxed or not, as [`ENGINE_SECRETS`] are: for a key the run reads from its own
/// environment, such as a judge's API key.
pub fn hide_secret(name: &str) {
    HIDDEN
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_owned());
}

/// Every variable no program the engine starts sees: [`ENGINE_SECRETS`] and those
/// [`hide_secret`] added.
pub fn secrets() -> Vec<String> {
    let hidden = HIDDEN.read().unwrap_or_else(|e| e.into_inner());
    ENGINE_SECRETS
        .iter()
        .map(|name| (*name).to_owned())
        .chain(hidden.iter().cloned())
        .collect()
}

/// What a sandboxed program gets of the engine's environment (besides what its table sets and
/// `TMPDIR`). `HOME` is kept so that programs find what is installed under it (read-only).
/// `ASYNC_GRPO_TEST_MARKER` carries no secret: the workspace's tests mark a run with it to
/// find every process the run started, sandboxed ones included.
const PASSED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    "ASYNC_GRPO_TEST_MARKER",
];

/// Where credentials usually live under the home directory: hidden from sandboxed programs
/// even inside what they are shown of it (`$HOME` itself is shown by allow-list).
const HOME_SECRETS: &[&str] = &[
    ".huggingface",
    ".kaggle",
    ".netrc",
    ".pgpass",
    ".terraformrc",
    ".terraform.d",
    ".ssh",
    ".aws",
    ".azure",
    ".gnupg",
    ".git-credentials",
    ".pypirc",
    ".npmrc",
    ".docker",
    ".kube",
    ".config",
    ".cache/huggingface",
    ".cargo/credentials",
    ".cargo/credentials.toml",
];

/// How a program is isolated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// In a bubblewrap sandbox: see [`Sandbox`].
    #[default]
    Bwrap,
    /// With the engine's own permissions, file system and network. The environment is the
    /// engine's less [`ENGINE_SECRETS`]; the process group and the limits still apply, and
    /// the program (not what it starts) dies with the engine (`setpriv --pdeathsig KILL`).
    None,
}

/// Resource limits of one program and everything it starts (`prlimit`, so per process: a
/// child gets the same limits again; `tmp_mib` by the size of its private `/tmp`). `0` is no
/// limit. Where the engine can make cgroups ([`CgroupSupport`](crate::CgroupSupport)), a
/// sandboxed program's whole tree also has one of its own, bounded by `memory_mib` in all and
/// `processes` in all: a tree that forks cannot multiply them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// MiB of data segment (heap and private writable mappings: what a program allocates);
    /// with a cgroup, also the tree's memory in all (its private `/tmp` included).
    pub memory_mib: u64,
    /// Seconds of CPU time.
    pub cpu_seconds: u64,
    /// Processes of the program's user: in a sandbox, of the program's whole tree, which runs
    /// as a user of its own (see [`Sandbox`]); unsandboxed, of the engine's user, and not
    /// enforced when that is root.
    pub processes: u64,
    /// MiB of a file it writes.
    pub file_size_mib: u64,
    /// Open file descriptors.
    pub open_files: u64,
    /// In a sandbox, MiB of all it writes to its private `/tmp` (and as many to `/dev/shm`),
    /// which lives in memory.
    pub tmp_mib: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            memory_mib: 4096,
            cpu_seconds: 600,
            processes: 256,
            file_size_mib: 1024,
            open_files: 1024,
            tmp_mib: 1024,
        }
    }
}

impl Limits {
    /// No limit at all.
    pub fn none() -> Limits {
        Limits {
            memory_mib: 0,
            cpu_seconds: 0,
            processes: 0,
            file_size_mib: 0,
            open_files: 0,
            tmp_mib: 0,
        }
    }

    /// `prlimit` and its options, or nothing when no limit is set.
    fn prefix(&self) -> Vec<String> {
        const MIB: u64 = 1024 * 1024;
        let options: Vec<String> = [
            ("data", self.memory_mib.saturating_mul(MIB)),
            ("cpu", self.cpu_seconds),
            ("nproc", self.processes),
            ("fsize", self.file_size_mib.saturating_mul(MIB)),
            ("nofile", self.open_files),
        ]
        .into_iter()
        .filter(|&(_, value)| value > 0)
        .map(|(name, value)| format!("--{name}={value}"))
        .collect();
        if options.is_empty() {
            return Vec::new();
        }
        let mut prefix = vec!["prlimit".to_owned()];
        prefix.extend(options);
        prefix.push("--".to_owned());
        prefix
    }
}

/// The `sandbox`, `network`, `limits`, `home`, `read_only` and `writable` keys of a settings
/// table that starts
/// programs (a tool, an agent, an MCP server, a reward program), declared once and flattened
/// into each (`#[serde(flatten)]`): each key given changes the sandbox a run starts from, each
/// left out keeps it.
///
/// ```toml
/// sandbox = "bwrap"                 # or "none": with the engine's own permissions
/// network = false                   # true: the host's network
/// limits = { memory_mib = 8192 }    # Limits; its unset fields keep their defaults
/// home = [".cache/uv"]              # what of $HOME the programs see besides what PATH needs
/// read_only = ["/data/corpus"]      # what else of the host they see
/// writable = ["/scratch/shared"]    # what of the host they may write
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SandboxKeys {
    /// How the programs are isolated: `"bwrap"` (a sandbox) or `"none"` (the engine's own
    /// permissions). Left out, a table keeps its own default: `"bwrap"` for what the model
    /// drives (the `command` and `python` tools, an agent), `"none"` for the user's own
    /// programs (a `command` reward, an environment's MCP server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Isolation>,
    /// Whether the programs get the host's network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<bool>,
    /// The programs' resource limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// Paths under `$HOME` (relative to it) the programs see, read-only, besides what
    /// [`Sandbox`] shows of it by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<Vec<PathBuf>>,
    /// Absolute paths outside `$HOME` the programs see, read-only (a corpus, a model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<Vec<PathBuf>>,
    /// Absolute paths the programs may write (their user must be allowed to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writable: Option<Vec<PathBuf>>,
}

impl SandboxKeys {
    /// The keys, as a table writes them: what a struct that flattens these keys reads besides
    /// its own (for a list of a table's keys).
    pub const KEYS: [&'static str; 6] = [
        "sandbox",
        "network",
        "limits",
        "home",
        "read_only",
        "writable",
    ];

    /// Whether any key is given.
    pub fn is_set(&self) -> bool {
        self.sandbox.is_some()
            || self.network.is_some()
            || self.limits.is_some()
            || self.home.is_some()
            || self.read_only.is_some()
            || self.writable.is_some()
    }

    /// What is wrong with the keys' values: a path of `read_only` or `writable` that is not
    /// absolute, or that does not exist; the key and the problem.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        for (key, paths) in [("read_only", &self.read_only), ("writable", &self.writable)] {
            for path in paths.iter().flatten() {
                if !path.is_absolute() {
                    return Err((key, format!("'{}' is not an absolute path", path.display())));
                }
                if !path.exists() {
                    return Err((key, format!("'{}' does not exist", path.display())));
                }
            }
        }
        Ok(())
    }

    /// `base` as the keys change it: each key given replaces its value, each left out keeps
    /// it (what runs the policy's commands starts sandboxed: tools, agents).
    pub fn apply(&self, mut base: Sandbox) -> Sandbox {
        if let Some(isolation) = self.sandbox {
            base.isolation = isolation;
        }
        if let Some(network) = self.network {
            base.network = network;
        }
        if let Some(limits) = self.limits {
            base.limits = limits;
        }
        if let Some(home) = &self.home {
            base.home.clone_from(home);
        }
        if let Some(read_only) = &self.read_only {
            base.read_only.clone_from(read_only);
        }
        if let Some(writable) = &self.writable {
            base.writable.clone_from(writable);
        }
        base
    }

    /// The sandbox of a program the user wrote (an MCP server, a reward program), which runs
    /// with the engine's permissions unless `sandbox = "bwrap"`: then in `base` (the run's
    /// sandbox, its files hidden). The other keys apply either way.
    pub fn opt_in(&self, base: &Sandbox) -> Sandbox {
        let start = match self.sandbox {
            Some(Isolation::Bwrap) => base.clone(),
            Some(Isolation::None) | None => Sandbox::none(),
        };
        SandboxKeys {
            sandbox: None,
            ..self.clone()
        }
        .apply(start)
    }
}

/// What a program may see and use.
///
/// The default, for everything the policy drives, is bubblewrap with:
/// - a PID namespace of its own (and IPC, UTS, cgroup and, unless `network`, network
///   namespaces): every process it starts dies with it, whether it called `setsid` or not,
///   and it sees no process of the engine or of another rollout;
/// - a user of its own: when the engine is root, each program runs as an unprivileged uid and
///   gid nobody else has (from [`SANDBOX_UIDS`], its directory given to it), so that owner
///   bits grant it nothing of the host's (`/etc/shadow`, root's files) and `limits.processes`
///   binds its whole tree; otherwise, in a user namespace, as the engine's user;
/// - no capabilities, a new session (no terminal to write into);
/// - of the file system, an allow-list: the system's runtime read-only (`/usr` and the links
///   into it, and of `/etc` only what the C library, TLS, locales and interpreters read:
///   `passwd`, `hosts`, `ld.so.*`, `ssl`, `python3*`...); outside `$HOME`, the folder of each file its command line names by an
///   absolute path and each `PATH` entry (the folder above, for a `bin`), and what
///   [`Sandbox::see`] and [`Sandbox::write`] add; a private, empty `/tmp` of at most
///   `limits.tmp_mib` (and `/var/tmp`, `/dev/shm`, and `/run` when there is no network); the
///   program's own directory writable; nothing else of the host;
/// - of `$HOME`, nothing but the top directories under it of `PATH`'s entries (`~/.cargo`,
///   `~/.pyenv`), those of the files its command line names by absolute path (a venv's
///   Python, a script), and what [`Sandbox::see_in_home`] adds: an allow-list, read-only.
///   Credentials inside what it shows (`.ssh`, `.aws`, `.config`, `.cache/huggingface`,
///   `.huggingface`, ...) stay hidden, as does whatever the engine adds with
///   [`Sandbox::hide`] (its output, dataset, configuration, other rollouts' directories): an
///   empty directory or file in their place;
/// - the environment cleared to `PATH`, `HOME` (the engine's), `LANG`/`LC_*`, `TZ`, `TERM`
///   and `TMPDIR=/tmp`, plus what the program is given;
/// - a program or script named by its path in one of the private directories (a config's
///   directory under `/tmp`) seen read-only, with what lies beside it;
/// - no network (its own loopback only) unless `network`;
/// - [`Limits::default`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sandbox {
    /// How the program is isolated.
    pub isolation: Isolation,
    /// Whether it shares the host's network (with [`Isolation::None`], it always does).
    pub network: bool,
    /// Its resource limits.
    pub limits: Limits,
    hidden: Vec<PathBuf>,
    home: Vec<PathBuf>,
    read_only: Vec<PathBuf>,
    writable: Vec<PathBuf>,
}

impl Default for Sandbox {
    fn default() -> Sandbox {
        Sandbox {
            isolation: Isolation::Bwrap,
            network: false,
            limits: Limits::default(),
            hidden: Vec::new(),
            home: Vec::new(),
            read_only: Vec::new(),
            writable: Vec::new(),
        }
    }
}

impl Sandbox {
    /// No sandbox and no limits: for programs the engine's user trusts (a reward program, an
    /// environment's server). The process group, the output caps and the removal of
    /// [`ENGINE_SECRETS`] from its environment still hold.
    pub fn none() -> Sandbox {
        Sandbox {
            isolation: Isolation::None,
            network: true,
            limits: Limits::none(),
            hidden: Vec::new(),
            home: Vec::new(),
            read_only: Vec::new(),
            writable: Vec::new(),
        }
    }

    /// With `isolation`.
    pub fn isolation(mut self, isolation: Isolation) -> Sandbox {
        self.isolation = isolation;
        self
    }

    /// With the host's network or without.
    pub fn network(mut self, network: bool) -> Sandbox {
        self.network = network;
        self
    }

    /// With `limits`.
    pub fn limits(mut self, limits: Limits) -> Sandbox {
        self.limits = limits;
        self
    }

    /// Hides `path` (a file or a directory; nothing when it does not exist) from the program.
    pub fn hide(mut self, path: impl Into<PathBuf>) -> Sandbox {
        self.hidden.push(path.into());
        self
    }

    /// The paths [`Sandbox::hide`] added.
    pub fn hidden(&self) -> &[PathBuf] {
        &self.hidden
    }

    /// Lets the program see `path` (relative to `$HOME`, or absolute under it), read-only:
    /// `$HOME` shows nothing else but what `PATH` and the command line need.
    pub fn see_in_home(mut self, path: impl Into<PathBuf>) -> Sandbox {
        self.home.push(path.into());
        self
    }

    /// Lets the program see `path` (absolute), read-only: outside `$HOME` it sees nothing
    /// but the system's runtime, its own directory and what its command line and `PATH`
    /// name.
    pub fn see(mut self, path: impl Into<PathBuf>) -> Sandbox {
        self.read_only.push(path.into());
        self
    }

    /// Lets the program write `path` (absolute), which its user must be allowed to write
    /// (when the engine is root, a uid of [`SANDBOX_UIDS`]: a folder writable by all, say).
    pub fn write(mut self, path: impl Into<PathBuf>) -> Sandbox {
        self.writable.push(path.into());
        self
    }

    /// The paths [`Sandbox::see`] and [`Sandbox::write`] added, and whether each is writable.
    pub fn shown(&self) -> impl Iterator<Item = (&Path, bool)> {
        self.read_only
            .iter()
            .map(|path| (path.as_path(), false))
            .chain(self.writable.iter().map(|path| (path.as_path(), true)))
    }

    /// The paths [`Sandbox::see_in_home`] added.
    pub fn seen_in_home(&self) -> &[PathBuf] {
        &self.home
    }

    /// Whether this sandbox can be had here: for bubblewrap, that `bwrap` is on `PATH` and can
    /// make its namespaces, and (with limits) that `prlimit` is there. Checked once per
    /// process; the error says what is missing and how to get it.
    pub fn check(&self) -> Result<(), Error> {
        if !self.limits.prefix().is_empty() {
            static PRLIMIT: OnceLock<Result<(), String>> = OnceLock::new();
            PRLIMIT
                .get_or_init(check_prlimit)
                .clone()
                .map_err(Error::SandboxUnavailable)?;
        }
        if self.isolation == Isolation::Bwrap {
            static BWRAP: OnceLock<Result<(), String>> = OnceLock::new();
            BWRAP
                .get_or_init(check_bwrap)
                .clone()
                .map_err(Error::SandboxUnavailable)?;
        }
        Ok(())
    }

    /// The command line that runs `argv` in this sandbox, with `dir` as its writable working
    /// directory, as `user` (a uid and gid of [`SANDBOX_UIDS`], for an engine that is root)
    /// or as the engine's user.
    pub(crate) fn command_line(
        &self,
        argv: &[String],
        dir: Option<&Path>,
        user: Option<u32>,
    ) -> Vec<OsString> {
        let mut line: Vec<OsString> = Vec::new();
        match self.isolation {
            Isolation::Bwrap => {
                line.extend(self.bwrap_options(argv, dir, user.is_some()));
                line.push("--".into());
                if let Some(user) = user {
                    line.extend(drop_to(user).into_iter().map(OsString::from));
                }
            }
            Isolation::None => line.extend(parent_death_prefix().iter().map(OsString::from)),
        }
        line.extend(self.limits.prefix().into_iter().map(OsString::from));
        line.extend(argv.iter().map(OsString::from));
        line
    }

    /// The user a program in this sandbox runs as: one of its own when the sandbox is
    /// bubblewrap and the engine is root, else the engine's (`None`).
    pub(crate) fn user(&self) -> Option<u32> {
        (self.isolation == Isolation::Bwrap && engine_is_root()).then(next_sandbox_uid)
    }

    /// bubblewrap's options. `as_root`: the engine is root, and the program drops to a user
    /// of its own in the sandbox (no user namespace, which would map it back to root): the
    /// sandbox keeps the capabilities to change user (which `setpriv` then drops with every
    /// other), the other namespaces are asked for one by one.
    fn bwrap_options(&self, argv: &[String], dir: Option<&Path>, as_root: bool) -> Vec<OsString> {
        let mut options: Vec<OsString> = Vec::new();
        let mut push = |items: &[&dyn AsRef<std::ffi::OsStr>]| {
            options.extend(items.iter().map(|item| item.as_ref().to_owned()));
        };
        if as_root {
            push(&[
                &"bwrap",
                &"--unshare-ipc",
                &"--unshare-pid",
                &"--unshare-uts",
                &"--unshare-cgroup-try",
            ]);
            if !self.network {
                push(&[&"--unshare-net"]);
            }
        } else {
            push(&[&"bwrap", &"--unshare-all"]);
            if self.network {
                push(&[&"--share-net"]);
            }
        }
        push(&[
            &"--die-with-parent",
            &"--new-session",
            &"--cap-drop",
            &"ALL",
        ]);
        if as_root {
            push(&[
                &"--cap-add",
                &"CAP_SETUID",
                &"--cap-add",
                &"CAP_SETGID",
                &"--cap-add",
                &"CAP_SETPCAP",
            ]);
        }
        // The folders bubblewrap makes on the way to a mount point are root's alone when it
        // runs privileged: made here first, traversable by any user.
        let mut made = BTreeSet::new();
        // The system's runtime, read-only: nothing else of the host unless named below.
        push(&[&"--perms", &"0755", &"--dir", &"/etc"]);
        for (kind, source, target) in system_view() {
            push(&[&kind, &source, &target]);
        }
        push(&[&"--dev", &"/dev", &"--proc", &"/proc"]);
        let outside = self.shown_outside_home(argv);
        // Where a hidden path must be covered: inside what the program is shown.
        let mut visible: Vec<PathBuf> = SYSTEM.iter().chain(&["/etc"]).map(PathBuf::from).collect();
        visible.extend(outside.iter().map(|(path, _)| path.clone()));
        for (path, writable) in outside {
            for dir in parents_to_make(&mut made, Path::new("/"), &path) {
                push(&[&"--perms", &"0755", &"--dir", &dir]);
            }
            let bind = if writable { "--bind" } else { "--ro-bind" };
            push(&[&bind, &path, &path]);
        }
        // Private, in memory, writable by every user (sticky): at most `tmp_mib` each.
        let size = self.limits.tmp_mib.saturating_mul(1024 * 1024).to_string();
        let mut private = vec![PathBuf::from("/tmp"), PathBuf::from("/dev/shm")];
        for covered in ["/var/tmp", "/run"] {
            let covered = PathBuf::from(covered);
            if covered.is_dir() && (covered != Path::new("/run") || !self.network) {
                private.push(covered);
            }
        }
        for tmp in &private {
            for dir in parents_to_make(&mut made, Path::new("/"), tmp) {
                push(&[&"--perms", &"0755", &"--dir", &dir]);
            }
            push(&[&"--perms", &"1777"]);
            if self.limits.tmp_mib > 0 {
                push(&[&"--size", &size]);
            }
            push(&[&"--tmpfs", tmp]);
        }
        // A program or script named by its path in a private directory (a config's directory
        // under /tmp) is seen, read-only, with what lies beside it; what is hidden below is
        // hidden there too.
        for arg in argv.iter().map(Path::new) {
            if let Some(root) = private.iter().find(|p| arg.starts_with(p))
                && arg.is_absolute()
                && arg.exists()
                && let Some(parent) = arg.parent()
            {
                for dir in parents_to_make(&mut made, root, parent) {
                    push(&[&"--perms", &"0755", &"--dir", &dir]);
                }
                push(&[&"--ro-bind", &parent, &parent]);
                visible.push(parent.to_path_buf());
            }
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .filter(|home| home.is_absolute() && home.parent().is_some() && home.is_dir());
        let mut shown = Vec::new();
        if let Some(home) = &home {
            // Nothing of $HOME but what is allowed, read-only, traversable by any user.
            for dir in parents_to_make(&mut made, Path::new("/"), home) {
                push(&[&"--perms", &"0755", &"--dir", &dir]);
            }
            push(&[&"--perms", &"0755", &"--tmpfs", home]);
            shown = self.shown_of_home(home, argv);
            for seen in &shown {
                for dir in parents_to_make(&mut made, home, seen) {
                    push(&[&"--perms", &"0755", &"--dir", &dir]);
                }
                push(&[&"--ro-bind", seen, seen]);
            }
        }
        // Credentials inside what is shown of $HOME stay hidden; so do the engine's paths
        // inside what is shown (what is not shown is not there to hide).
        visible.extend(shown.iter().cloned());
        visible.extend(dir.map(Path::to_path_buf));
        let unseen = |path: &PathBuf| !visible.iter().any(|seen| path.starts_with(seen));
        let secrets = home
            .iter()
            .flat_map(|home| HOME_SECRETS.iter().map(move |name| home.join(name)));
        for path in secrets.chain(self.hidden.iter().cloned()) {
            if unseen(&path) {
                continue;
            }
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_dir() => push(&[&"--tmpfs", &path]),
                Ok(_) => push(&[&"--ro-bind", &"/dev/null", &path]),
                Err(_) => {}
            }
        }
        match dir {
            Some(dir) => {
                for parent in parents_to_make(&mut made, Path::new("/"), dir) {
                    push(&[&"--perms", &"0755", &"--dir", &parent]);
                }
                push(&[&"--bind", &dir, &dir, &"--chdir", &dir]);
            }
            None => push(&[&"--chdir", &"/tmp"]),
        }
        // Last: the mount points above are made in it first.
        if let Some(home) = &home {
            push(&[&"--remount-ro", home]);
        }
        options
    }

    /// What the program sees outside `$HOME` and the system's runtime, and whether it may
    /// write there: the folder of each file its command line names by an absolute path (its
    /// prefix when that folder is a `bin`: a venv, a Node install), each `PATH` entry (the
    /// same way), and what [`Sandbox::see`] and [`Sandbox::write`] added; those that exist,
    /// each once, a path inside another shown one left out.
    fn shown_outside_home(&self, argv: &[String]) -> Vec<(PathBuf, bool)> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let elsewhere = |path: &Path| {
            path.is_absolute()
                && !home.as_ref().is_some_and(|home| path.starts_with(home))
                && !SYSTEM.iter().any(|system| path.starts_with(system))
                && !["/tmp", "/var/tmp", "/dev", "/proc", "/run"]
                    .iter()
                    .any(|private| path.starts_with(private))
        };
        let prefix = |folder: &Path| -> PathBuf {
            match (folder.file_name(), folder.parent()) {
                (Some(name), Some(parent)) if name == "bin" && parent != Path::new("/") => {
                    parent.to_path_buf()
                }
                _ => folder.to_path_buf(),
            }
        };
        let path_var = std::env::var_os("PATH").unwrap_or_default();
        let files = argv
            .iter()
            .map(PathBuf::from)
            .filter(|path| path.is_absolute() && path.is_file())
            .filter_map(|path| path.parent().map(Path::to_path_buf));
        let mut shown: BTreeMap<PathBuf, bool> = std::env::split_paths(&path_var)
            .chain(files)
            .filter(|path| elsewhere(path) && path.is_dir())
            .map(|path| (prefix(&path), false))
            .collect();
        shown.extend(self.read_only.iter().map(|path| (path.clone(), false)));
        shown.extend(self.writable.iter().map(|path| (path.clone(), true)));
        let shown: Vec<(PathBuf, bool)> = shown
            .into_iter()
            .filter(|(path, _)| path.is_absolute() && path.exists())
            .collect();
        shown
            .iter()
            .filter(|(path, writable)| {
                !shown.iter().any(|(other, other_writable)| {
                    other != path && path.starts_with(other) && (other_writable >= writable)
                })
            })
            .cloned()
            .collect()
    }

    /// What the program sees of `home`: the top directory under it of each `PATH` entry
    /// (the engine's, which [`Sandbox::environment`] passes on), of each file its command
    /// line names by an absolute path (a program in a venv needs the venv), and what
    /// [`Sandbox::see_in_home`] added; those that exist, outermost first, each once.
    fn shown_of_home(&self, home: &Path, argv: &[String]) -> Vec<PathBuf> {
        let path_var = std::env::var_os("PATH").unwrap_or_default();
        let top = |path: &Path| -> Option<PathBuf> {
            let first = path.strip_prefix(home).ok()?.components().next()?;
            matches!(first, std::path::Component::Normal(_)).then(|| home.join(first))
        };
        // Of the command line, the files it names (a program, a script): not a folder nor
        // any other text, which a dataset's prompt on it could be.
        let files = argv
            .iter()
            .map(PathBuf::from)
            .filter(|path| path.is_absolute() && path.is_file());
        let mut shown: BTreeSet<PathBuf> = std::env::split_paths(&path_var)
            .filter(|path| path.is_absolute())
            .chain(files)
            .filter_map(|path| top(&path))
            .collect();
        shown.extend(self.home.iter().map(|path| home.join(path)).filter(|path| {
            path.starts_with(home)
                && !path
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
        }));
        let shown: Vec<PathBuf> = shown.into_iter().filter(|path| path.exists()).collect();
        // A path inside another shown one is already seen.
        shown
            .iter()
            .filter(|path| {
                !shown
                    .iter()
                    .any(|other| other != *path && path.starts_with(other))
            })
            .cloned()
            .collect()
    }

    /// The environment of a program given `own` variables: `None` to inherit the engine's
    /// (less [`secrets`]), or the whole environment to set.
    pub(crate) fn environment(
        &self,
        own: &BTreeMap<String, String>,
    ) -> Option<Vec<(OsString, OsString)>> {
        if self.isolation == Isolation::None {
            return None;
        }
        let mut env: BTreeMap<OsString, OsString> = PASSED_ENV
            .iter()
            .filter_map(|name| std::env::var_os(name).map(|value| ((*name).into(), value)))
            .collect();
        env.insert("TMPDIR".into(), "/tmp".into());
        env.extend(own.iter().map(|(k, v)| (k.into(), v.into())));
        for secret in secrets() {
            env.remove(std::ffi::OsStr::new(&secret));
        }
        Some(env.into_iter().collect())
    }
}

/// The system's runtime, shown read-only to every sandboxed program: `/usr` and the folders
/// that are links into it (or folders of their own) on a system whose `/usr` is not merged.
const SYSTEM: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];

/// What a sandboxed program sees of `/etc`: what the C library, the dynamic linker, TLS,
/// locales and the interpreters read; not the host's users' secrets, package managers'
/// credentials (`pip.conf`, `npmrc`), `gitconfig`, `ssh`, `machine-id`, nor anything else.
const ETC: &[&str] = &[
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "fonts",
    "gai.conf",
    "group",
    "host.conf",
    "hostname",
    "hosts",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "magic",
    "magic.mime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "passwd",
    "pki",
    "protocols",
    "resolv.conf",
    "services",
    "shells",
    "ssl",
    "terminfo",
    "timezone",
];

/// The mounts of the system's runtime: (`--ro-bind` or `--symlink`, source, target) for each
/// of [`SYSTEM`] and [`ETC`] (and `/etc/python3*`) that exists. A link in `/etc` is shown as
/// what it points to (`resolv.conf` into `/run`, which the sandbox does not show).
fn system_view() -> Vec<(&'static str, PathBuf, PathBuf)> {
    let mut view = Vec::new();
    for path in SYSTEM.iter().map(PathBuf::from) {
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(&path) {
                    view.push(("--symlink", target, path));
                }
            }
            Ok(meta) if meta.is_dir() => view.push(("--ro-bind", path.clone(), path)),
            _ => {}
        }
    }
    let etc = Path::new("/etc");
    let pythons = std::fs::read_dir(etc)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("python3"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let names = ETC.iter().map(|name| (*name).to_owned()).chain(pythons);
    for name in names {
        let target = etc.join(&name);
        if let Ok(source) = std::fs::canonicalize(&target) {
            view.push(("--ro-bind", source, target));
        }
    }
    view
}

/// The folders strictly between `outer` and `inner` (inside it), outermost first, that
/// `made` does not hold yet (added to it): those a mount at `inner` needs made in the
/// sandbox, where bubblewrap would make them readable by root alone.
fn parents_to_make(made: &mut BTreeSet<PathBuf>, outer: &Path, inner: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = inner
        .ancestors()
        .skip(1)
        .take_while(|dir| dir.starts_with(outer) && *dir != outer)
        .filter(|dir| made.insert(dir.to_path_buf()))
        .map(Path::to_path_buf)
        .collect();
    dirs.reverse();
    dirs
}

/// The uids (each also a gid) sandboxed programs run as when the engine is root: one per
/// program, `start + (engine's pid mod 2^14) * 2^16 + (the engine's program count mod 2^16)`,
/// so that two programs running at once, of one engine or of two, do not share one (and
/// `limits.processes` counts each program's tree alone). No account has them: `id` shows
/// the numbers, `$HOME` stays the engine's.
pub const SANDBOX_UIDS: std::ops::Range<u32> = 2_000_000_000..2_000_000_000 + (1 << 30);

/// Whether the engine runs as root (then sandboxed programs drop to [`SANDBOX_UIDS`]).
fn engine_is_root() -> bool {
    #[cfg(unix)]
    {
        rustix::process::geteuid().is_root()
    }
    #[cfg(not(unix))]
    {
        false
    }
}

/// The next program's uid of [`SANDBOX_UIDS`].
fn next_sandbox_uid() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let count = NEXT.fetch_add(1, Ordering::Relaxed) & 0xffff;
    let engine = std::process::id() & 0x3fff;
    SANDBOX_UIDS.start + (engine << 16 | count)
}

/// What runs a program as `user` (its uid and gid, no other group), with no capability
/// left in any set and no way to gain one (`no_new_privs`): util-linux's `setpriv`, run by
/// bubblewrap in the sandbox, which keeps for it only the capabilities to do this.
fn drop_to(user: u32) -> Vec<String> {
    vec![
        "setpriv".to_owned(),
        format!("--reuid={user}"),
        format!("--regid={user}"),
        "--clear-groups".to_owned(),
        "--bounding-set=-all".to_owned(),
        "--inh-caps=-all".to_owned(),
        "--no-new-privs".to_owned(),
        "--".to_owned(),
    ]
}

/// Gives `dir` and everything in it to `user` (uid and gid), symlinks themselves and never
/// what they point to, without leaving `dir`'s file system: a program's own directory,
/// before it starts, so that it may write there though it is not root. What is `user`'s
/// already is left as it is.
pub(crate) fn give_to(dir: &Path, user: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, lchown};
    let device = std::fs::symlink_metadata(dir)?.dev();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            // Gone since it was listed: nothing to give.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error),
        };
        if meta.uid() != user || meta.gid() != user {
            lchown(&path, Some(user), Some(user))?;
        }
        if meta.is_dir() && meta.dev() == device {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// A command for a check: nothing of the engine's environment but `PATH` (a check is no
/// program of the run's, and carries none of its variables).
fn check_command(program: &str) -> std::process::Command {
    let mut command = std::process::Command::new(program);
    command.env_clear().stdin(std::process::Stdio::null());
    if let Some(path) = std::env::var_os("PATH") {
        command.env("PATH", path);
    }
    command
}

/// Runs `true` in the sandbox every program gets (less its limits, which `prlimit`'s check
/// covers): as a user of [`SANDBOX_UIDS`] when the engine is root.
fn check_bwrap() -> Result<(), String> {
    let user = engine_is_root().then_some(SANDBOX_UIDS.start);
    let line =
        Sandbox::default()
            .limits(Limits::none())
            .command_line(&["true".to_owned()], None, user);
    let output = check_command("bwrap").args(&line[1..]).output();
    match output {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Err(
            "the sandbox needs bubblewrap (`bwrap`), which is not on PATH: install it \
             (Debian, Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`; \
             Arch: `pacman -S bubblewrap`), or set `sandbox = \"none\"` to run the program \
             unsandboxed, with the engine's permissions"
                .to_owned(),
        ),
        Err(error) => Err(format!(
            "the sandbox's `bwrap` could not be started: {error}"
        )),
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) if user.is_some() => Err(format!(
            "bubblewrap (`bwrap`) cannot make its namespaces, or util-linux's `setpriv` cannot \
             change to an unprivileged user in them, here ({}: {}): the engine runs as root, \
             so the sandbox needs no user namespace, but its mount, PID and network namespaces \
             and `setpriv` (util-linux) must work; install util-linux, run where a \
             container's seccomp profile allows them, or set `sandbox = \"none\"` to run the \
             program unsandboxed, with the engine's permissions",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(output) => Err(format!(
            "bubblewrap (`bwrap`) cannot make its namespaces here ({}: {}): user namespaces are \
             off or forbidden (see `sysctl user.max_user_namespaces` and \
             `kernel.unprivileged_userns_clone`, or a container's seccomp profile); allow them, \
             run where they are allowed, or set `sandbox = \"none\"` to run the program \
             unsandboxed, with the engine's permissions",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
    }
}

/// What makes an unsandboxed program die with the engine, even when the engine is killed with
/// SIGKILL and runs no code of its own: util-linux's `setpriv --pdeathsig KILL`, which sets the
/// parent-death signal of the program (the sandbox has bubblewrap's `--die-with-parent` and
/// its PID namespace instead). The signal reaches the program itself, not what it started: an
/// unsandboxed program's children go with it only when the engine kills its process group.
/// Nothing (with one warning) where `setpriv` cannot be run.
fn parent_death_prefix() -> &'static [&'static str] {
    static PREFIX: OnceLock<&'static [&'static str]> = OnceLock::new();
    PREFIX.get_or_init(|| {
        const SETPRIV: &[&str] = &["setpriv", "--pdeathsig", "KILL", "--"];
        match check_command(SETPRIV[0])
            .args(&SETPRIV[1..])
            .arg("true")
            .output()
        {
            Ok(output) if output.status.success() => SETPRIV,
            outcome => {
                let why = match outcome {
                    Ok(output) => String::from_utf8_lossy(&output.stderr).trim().to_owned(),
                    Err(error) => error.to_string(),
                };
                tracing::warn!(
                    "util-linux's `setpriv` cannot be run ({why}): an unsandboxed program will \
                     outlive an engine killed with SIGKILL; install util-linux to have it die \
                     with the engine"
                );
                &[]
            }
        }
    })
}

fn check_prlimit() -> Result<(), String> {
    match check_command("prlimit")
        .args(["--nofile=1024", "--", "true"])
        .output()
    {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => Err(format!(
            "`prlimit` cannot set limits here ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Err(error) => Err(format!(
            "resource limits need util-linux's `prlimit`, which could not be run ({error}): \
             install util-linux, or set every limit to 0"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(table: serde_json::Value) -> SandboxKeys {
        serde_json::from_value(table).expect("the keys read")
    }

    #[test]
    fn each_key_given_replaces_its_value_and_each_left_out_keeps_the_base_s() {
        let base = Sandbox::default().hide("/run-files");
        assert_eq!(SandboxKeys::default().apply(base.clone()), base);
        let changed = keys(serde_json::json!({"network": true, "limits": {"processes": 8}}))
            .apply(base.clone());
        assert_eq!(changed.isolation, Isolation::Bwrap, "kept");
        assert!(changed.network);
        assert_eq!(changed.limits.processes, 8);
        assert_eq!(changed.limits.memory_mib, Limits::default().memory_mib);
        assert_eq!(
            changed.hidden(),
            base.hidden(),
            "what the base hides stays hidden"
        );
        let none = keys(serde_json::json!({"sandbox": "none"})).apply(base.clone());
        assert_eq!(none.isolation, Isolation::None);
        let home = keys(serde_json::json!({"home": [".cache/uv"]})).apply(base);
        assert_eq!(home.seen_in_home(), [PathBuf::from(".cache/uv")]);
    }

    #[test]
    fn a_user_s_own_program_is_sandboxed_only_when_its_table_asks() {
        let base = Sandbox::default().hide("/run-files");
        let unasked = SandboxKeys::default().opt_in(&base);
        assert_eq!(unasked, Sandbox::none());
        let asked = keys(serde_json::json!({"sandbox": "bwrap", "network": true})).opt_in(&base);
        assert_eq!(asked.isolation, Isolation::Bwrap);
        assert!(asked.network);
        assert_eq!(
            asked.hidden(),
            base.hidden(),
            "the run's sandbox, its files hidden"
        );
        let limited = keys(serde_json::json!({"limits": {"memory_mib": 10}})).opt_in(&base);
        assert_eq!(limited.isolation, Isolation::None);
        assert_eq!(
            limited.limits.memory_mib, 10,
            "limits apply unsandboxed too"
        );
    }

    /// The command line as text.
    fn line(user: Option<u32>) -> Vec<String> {
        Sandbox::default()
            .command_line(&["true".to_owned()], None, user)
            .into_iter()
            .map(|arg| arg.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn bubblewrap_drops_every_capability_but_those_the_change_of_user_needs() {
        // As root the program cannot tell (setpriv drops the rest, as the sandbox's tests
        // check): what this pins is that nothing but setpriv ever holds them.
        let root = line(Some(SANDBOX_UIDS.start)).join(" ");
        assert!(
            root.contains(
                "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_SETPCAP "
            ),
            "{root}"
        );
        assert!(
            !root.contains("--unshare-user") && !root.contains("--unshare-all"),
            "{root}"
        );
        let user = line(None).join(" ");
        assert!(user.contains("--unshare-all"), "{user}");
        assert!(
            user.contains("--cap-drop ALL") && !user.contains("--cap-add"),
            "{user}"
        );
        assert!(!user.contains("setpriv"), "{user}");
    }

    #[test]
    fn the_keys_listed_are_the_keys_read() {
        let all = serde_json::json!({"sandbox": "bwrap", "network": false, "limits": {}, "home": [], "read_only": [], "writable": []});
        let read = keys(all.clone());
        assert!(read.is_set());
        let written = serde_json::to_value(read).expect("the keys write");
        let names: Vec<&str> = written
            .as_object()
            .expect("a table")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(names, SandboxKeys::KEYS);
    }
}
