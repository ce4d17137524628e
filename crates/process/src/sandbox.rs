//! [`Sandbox`]: what a program may see and use, and the bubblewrap command line that gives it.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use std::sync::{OnceLock, RwLock};

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
/// although the rest of the file system is readable.
const HOME_SECRETS: &[&str] = &[
    ".ssh",
    ".aws",
    ".azure",
    ".gnupg",
    ".netrc",
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
/// child gets the same limits again). `0` is no limit.
///
/// | field | default | limit |
/// |---|---|---|
/// | `memory_mib` | 4096 | data segment (heap and private writable mappings: what a program allocates) |
/// | `cpu_seconds` | 600 | CPU time |
/// | `processes` | 256 | processes of the user (not enforced for root, which the kernel exempts; the PID namespace still kills them all at the end) |
/// | `file_size_mib` | 1024 | size of a file it writes |
/// | `open_files` | 1024 | open file descriptors |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// MiB of data segment.
    pub memory_mib: u64,
    /// Seconds of CPU time.
    pub cpu_seconds: u64,
    /// Processes of the user.
    pub processes: u64,
    /// MiB per written file.
    pub file_size_mib: u64,
    /// Open file descriptors.
    pub open_files: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            memory_mib: 4096,
            cpu_seconds: 600,
            processes: 256,
            file_size_mib: 1024,
            open_files: 1024,
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

/// The `sandbox`, `network` and `limits` keys of a settings table that starts programs (a
/// tool, an agent, an MCP server, a reward program), declared once and flattened into each
/// (`#[serde(flatten)]`): each key given changes the sandbox a run starts from, each left out
/// keeps it.
///
/// ```toml
/// sandbox = "bwrap"                 # or "none": with the engine's own permissions
/// network = false                   # true: the host's network
/// limits = { memory_mib = 8192 }    # Limits; its unset fields keep their defaults
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct SandboxKeys {
    /// How the programs are isolated (`"bwrap"` or `"none"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Isolation>,
    /// Whether the programs get the host's network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<bool>,
    /// The programs' resource limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
}

impl SandboxKeys {
    /// The keys, as a table writes them: what a struct that flattens these keys reads besides
    /// its own (for a list of a table's keys).
    pub const KEYS: [&'static str; 3] = ["sandbox", "network", "limits"];

    /// Whether any key is given.
    pub fn is_set(&self) -> bool {
        self.sandbox.is_some() || self.network.is_some() || self.limits.is_some()
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
        base
    }

    /// The sandbox of a program the user wrote (an MCP server, a reward program), which runs
    /// with the engine's permissions unless `sandbox = "bwrap"`: then in `base` (the run's
    /// sandbox, its files hidden). `network` and `limits` apply either way.
    pub fn opt_in(&self, base: &Sandbox) -> Sandbox {
        let start = match self.sandbox {
            Some(Isolation::Bwrap) => base.clone(),
            Some(Isolation::None) | None => Sandbox::none(),
        };
        SandboxKeys {
            sandbox: None,
            ..*self
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
/// - no capabilities, a new session (no terminal to write into);
/// - the file system read-only; a private, empty `/tmp` (and `/var/tmp`, `/dev/shm`, and `/run`
///   when there is no network); the program's own directory writable;
/// - hidden (an empty directory or file in their place): credentials under `$HOME`
///   (`.ssh`, `.aws`, `.config`, `.cache/huggingface`, ...) and whatever the engine adds with
///   [`Sandbox::hide`] (its output, dataset, configuration, other rollouts' directories);
/// - the environment cleared to `PATH`, `HOME` (the engine's, read-only like the rest),
///   `LANG`/`LC_*`, `TZ`, `TERM` and `TMPDIR=/tmp`, plus what the program is given;
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
}

impl Default for Sandbox {
    fn default() -> Sandbox {
        Sandbox {
            isolation: Isolation::Bwrap,
            network: false,
            limits: Limits::default(),
            hidden: Vec::new(),
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
    /// directory.
    pub(crate) fn command_line(&self, argv: &[String], dir: Option<&Path>) -> Vec<OsString> {
        let mut line: Vec<OsString> = Vec::new();
        match self.isolation {
            Isolation::Bwrap => {
                line.extend(self.bwrap_options(argv, dir));
                line.push("--".into());
            }
            Isolation::None => line.extend(parent_death_prefix().iter().map(OsString::from)),
        }
        line.extend(self.limits.prefix().into_iter().map(OsString::from));
        line.extend(argv.iter().map(OsString::from));
        line
    }

    fn bwrap_options(&self, argv: &[String], dir: Option<&Path>) -> Vec<OsString> {
        let mut options: Vec<OsString> = Vec::new();
        let mut push = |items: &[&dyn AsRef<std::ffi::OsStr>]| {
            options.extend(items.iter().map(|item| item.as_ref().to_owned()));
        };
        push(&[&"bwrap", &"--unshare-all"]);
        if self.network {
            push(&[&"--share-net"]);
        }
        push(&[
            &"--die-with-parent",
            &"--new-session",
            &"--cap-drop",
            &"ALL",
            &"--ro-bind",
            &"/",
            &"/",
            &"--dev",
            &"/dev",
            &"--proc",
            &"/proc",
            &"--tmpfs",
            &"/tmp",
            &"--tmpfs",
            &"/dev/shm",
        ]);
        let mut private = vec![PathBuf::from("/tmp"), PathBuf::from("/dev/shm")];
        let mut covered = vec![PathBuf::from("/var/tmp")];
        if !self.network {
            covered.push(PathBuf::from("/run"));
        }
        for path in &covered {
            if path.is_dir() {
                push(&[&"--tmpfs", path]);
            }
        }
        private.extend(covered);
        // A program or script named by its path in a private directory (a config's directory
        // under /tmp) is seen, read-only, with what lies beside it; what is hidden below is
        // hidden there too.
        for arg in argv.iter().map(Path::new) {
            if arg.is_absolute()
                && private.iter().any(|p| arg.starts_with(p))
                && arg.exists()
                && let Some(parent) = arg.parent()
            {
                push(&[&"--ro-bind", &parent, &parent]);
            }
        }
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let secrets = home
            .iter()
            .flat_map(|home| HOME_SECRETS.iter().map(move |name| home.join(name)));
        for path in secrets.chain(self.hidden.iter().cloned()) {
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_dir() => push(&[&"--tmpfs", &path]),
                Ok(_) => push(&[&"--ro-bind", &"/dev/null", &path]),
                Err(_) => {}
            }
        }
        match dir {
            Some(dir) => push(&[&"--bind", &dir, &dir, &"--chdir", &dir]),
            None => push(&[&"--chdir", &"/tmp"]),
        }
        options
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

fn check_bwrap() -> Result<(), String> {
    let output = check_command("bwrap")
        .args([
            "--unshare-all",
            "--die-with-parent",
            "--cap-drop",
            "ALL",
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--",
            "true",
        ])
        .output();
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
        let none = keys(serde_json::json!({"sandbox": "none"})).apply(base);
        assert_eq!(none.isolation, Isolation::None);
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

    #[test]
    fn the_keys_listed_are_the_keys_read() {
        let all = serde_json::json!({"sandbox": "bwrap", "network": false, "limits": {}});
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
