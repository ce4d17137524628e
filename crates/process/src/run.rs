//! [`Program`]: a command line with its environment, directory and sandbox; run to its end
//! with capped output ([`Program::run`]), or started for a caller that talks to it
//! ([`Program::command`]). [`ProcessGroup`]: the kill that takes everything it started.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{ExitStatus, Stdio},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    process::Command,
};

use crate::{Error, Sandbox, cgroup::Cgroup};

/// What a finished program left.
#[derive(Debug)]
#[non_exhaustive]
pub struct Finished {
    /// How it exited.
    pub status: ExitStatus,
    /// The start of its standard output (capped).
    pub stdout: String,
    /// The start of its standard error (capped).
    pub stderr: String,
}

/// The last `chars` characters of `text`, trimmed: the end of a program's output, where
/// its error usually is, for a message.
pub fn tail(text: &str, chars: usize) -> &str {
    let text = text.trim();
    let Some(last) = chars.checked_sub(1) else {
        return "";
    };
    let start = text
        .char_indices()
        .rev()
        .nth(last)
        .map_or(0, |(index, _)| index);
    &text[start..]
}

/// A process group (a program started with `process_group(0)`: its id is the program's pid),
/// killed whole with SIGKILL when dropped or by [`ProcessGroup::kill`].
#[derive(Debug)]
pub struct ProcessGroup(Option<u32>);

impl ProcessGroup {
    /// The group led by process `id` (`None`: nothing to kill).
    pub fn new(id: Option<u32>) -> ProcessGroup {
        ProcessGroup(id)
    }

    /// Kills every process of the group now (once; a group already gone is no error).
    pub fn kill(&mut self) {
        if let Some(id) = self.0.take() {
            kill_group(id);
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(unix)]
fn kill_group(id: u32) {
    if let Some(pid) = i32::try_from(id)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(not(unix))]
fn kill_group(_id: u32) {}

/// A program to run: its command line, the variables it is given, its working directory
/// (writable in the sandbox) and its [`Sandbox`] ([`Sandbox::default`] unless set).
#[derive(Debug, Clone)]
pub struct Program {
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    dir: Option<PathBuf>,
    sandbox: Sandbox,
}

impl Program {
    /// `argv[0]` with the rest as arguments, sandboxed by default.
    pub fn new<I, S>(argv: I) -> Program
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Program {
            argv: argv.into_iter().map(Into::into).collect(),
            env: BTreeMap::new(),
            dir: None,
            sandbox: Sandbox::default(),
        }
    }

    /// With variable `key` set to `value`.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Program {
        self.env.insert(key.into(), value.into());
        self
    }

    /// With these variables set.
    pub fn envs<I, K, V>(mut self, vars: I) -> Program
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.env
            .extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Run in `dir` (writable in the sandbox).
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Program {
        self.dir = Some(dir.into());
        self
    }

    /// Run in `sandbox`.
    pub fn sandbox(mut self, sandbox: Sandbox) -> Program {
        self.sandbox = sandbox;
        self
    }

    /// The program's name, for messages.
    pub fn name(&self) -> &str {
        self.argv.first().map_or("", String::as_str)
    }

    /// The command that starts it, for a caller that talks to it (an MCP server's pipes): in
    /// its sandbox, in a process group of its own, killed when the child is dropped. Its
    /// stdio is the caller's to set. Hold a [`ProcessGroup`] of the child's id to kill what
    /// it starts too.
    ///
    /// Sandboxed while the engine is root, the program runs as a user of its own
    /// ([`SANDBOX_UIDS`](crate::SANDBOX_UIDS)), to whom its directory, and everything in
    /// it, is given here (a walk of the directory: this call blocks for it).
    pub fn command(&self) -> Result<Command, Error> {
        self.command_in(None)
    }

    /// A sandboxed program's cgroup (see [`CgroupSupport`](crate::CgroupSupport)), where one
    /// can be made: hold it as long as the program runs.
    pub(crate) fn cgroup(&self) -> Option<Cgroup> {
        (self.sandbox.isolation == crate::Isolation::Bwrap)
            .then(|| Cgroup::new(&self.sandbox.limits))
            .flatten()
    }

    /// [`Program::command`], started in `cgroup` when given.
    pub(crate) fn command_in(&self, cgroup: Option<&Cgroup>) -> Result<Command, Error> {
        if self.argv.is_empty() {
            return Err(Error::NoProgram);
        }
        let user = self.sandbox.user();
        if let (Some(user), Some(dir)) = (user, &self.dir) {
            crate::sandbox::give_to(dir, user).map_err(|source| Error::Start {
                program: self.name().to_owned(),
                source: std::io::Error::new(
                    source.kind(),
                    format!(
                        "its directory {} could not be given to its sandbox's user: {source}",
                        dir.display()
                    ),
                ),
            })?;
        }
        let mut line = self
            .sandbox
            .command_line(&self.argv, self.dir.as_deref(), user);
        if let Some(cgroup) = cgroup {
            line.splice(0..0, cgroup.prefix().into_iter().map(Into::into));
        }
        if line.len() > self.argv.len() && self.sandbox.isolation == crate::Isolation::None {
            // A wrapper (setpriv, prlimit) would start and then fail to run a program that is
            // not there: say so as a program that could not start, as without the wrapper.
            self.check_found()?;
        }
        tracing::debug!(target: "async_grpo_process", ?line, "the command line of a program");
        let (program, args) = line.split_first().ok_or(Error::NoProgram)?;
        let mut command = Command::new(program);
        command.args(args).kill_on_drop(true);
        if let Some(dir) = &self.dir {
            command.current_dir(dir);
        }
        match self.sandbox.environment(&self.env) {
            Some(env) => {
                command.env_clear().envs(env);
            }
            None => {
                for secret in crate::secrets() {
                    command.env_remove(secret);
                }
                command.envs(&self.env);
            }
        }
        #[cfg(unix)]
        command.process_group(0);
        Ok(command)
    }

    /// That the program is there to be started: a file where its path names one (from its
    /// directory when relative), or a name found on its `PATH` (its own, else the engine's).
    fn check_found(&self) -> Result<(), Error> {
        let program = self.name();
        let path_var = match self.env.get("PATH") {
            Some(own) => Some(std::ffi::OsString::from(own)),
            None => std::env::var_os("PATH"),
        };
        if crate::path::found(program, self.dir.as_deref(), path_var.as_deref()) {
            return Ok(());
        }
        Err(Error::Start {
            program: program.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such file, or not on PATH",
            ),
        })
    }

    /// Runs the program to its end with `input` on stdin. Its process group (and, sandboxed,
    /// its PID namespace) is killed when it exits (what it left in the background goes with
    /// it), after `timeout`, or when this future is dropped. Each of stdout and stderr keeps its
    /// first `max_output` bytes, and says how much more there was.
    pub async fn run(
        &self,
        input: Vec<u8>,
        timeout: Duration,
        max_output: usize,
    ) -> Result<Finished, Error> {
        let program = self.name().to_owned();
        // Dropped last, on every way out: its processes killed, then removed.
        let cgroup = self.cgroup();
        let mut command = self.command_in(cgroup.as_ref())?;
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().map_err(|source| Error::Start {
            program: program.clone(),
            source,
        })?;
        // Its own group: the leader's id is the group's. Dropped on every way out of here.
        let group = ProcessGroup(child.id());
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        // Feed and drain at once: a program that writes much before reading all of its input
        // must not deadlock against us. Once the program exits, what it left in its group is
        // killed, so that a background process holding the pipes cannot keep the call open.
        let exited = async {
            let status = child.wait().await;
            drop(group);
            status
        };
        let feed = async move {
            if let Some(mut stdin) = stdin {
                // A program that does not read all of its input closes the pipe early: not an
                // error of ours.
                let _ = stdin.write_all(&input).await;
            }
        };
        let work = async {
            let ((), status, stdout, stderr) = tokio::join!(
                feed,
                exited,
                drain(stdout, max_output),
                drain(stderr, max_output)
            );
            (status, stdout, stderr)
        };
        match tokio::time::timeout(timeout, work).await {
            Ok((Ok(status), stdout, stderr)) => Ok(Finished {
                status,
                stdout,
                stderr,
            }),
            Ok((Err(source), _, _)) => Err(Error::Wait { program, source }),
            // Dropping `work` drops the group (killed) and the child (reaped by tokio).
            Err(_elapsed) => Err(Error::Timeout { program, timeout }),
        }
    }
}

/// The first `max_output` bytes a pipe gives until it closes, and how many more there were.
async fn drain(pipe: Option<impl AsyncRead + Unpin>, max_output: usize) -> String {
    let Some(mut pipe) = pipe else {
        return String::new();
    };
    let mut kept = Vec::new();
    let mut more = 0usize;
    let mut buffer = [0u8; 8192];
    while let Ok(read) = pipe.read(&mut buffer).await {
        if read == 0 {
            break;
        }
        let room = max_output.saturating_sub(kept.len());
        kept.extend_from_slice(&buffer[..read.min(room)]);
        more += read.saturating_sub(room);
    }
    let mut text = String::from_utf8_lossy(&kept).into_owned();
    if more > 0 {
        text.push_str(&format!("\n[output truncated: {more} more bytes]"));
    }
    text
}
