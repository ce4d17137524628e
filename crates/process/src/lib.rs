//! Every program an RL rollout engine starts, started one way.
//!
//! A rollout engine runs programs on behalf of a policy in training: the code of a `python`
//! tool call, a `command` tool, an agent such as opencode and its `setup` and `verify`, a
//! reward program, an MCP server. The policy is optimised for reward and will find any way to
//! crash its evaluator, read what it should not or forge its reward, so what it drives must
//! not reach the engine's secrets, files, network or exit status. This crate is the one place
//! that starts such programs:
//!
//! - **A process group of its own**, killed whole (SIGKILL) when the program exits, times out
//!   or its future is dropped ([`ProcessGroup`]): what it left in the background goes with it.
//! - **Death with the engine**, even an engine killed with SIGKILL that runs no code of its
//!   own: a sandboxed program and all it started by bubblewrap's `--die-with-parent` and PID
//!   namespace, an unsandboxed one by its parent-death signal (`setpriv --pdeathsig KILL`).
//! - **Output caps**: each of stdout and stderr keeps its first `max_output` bytes and says how
//!   much more there was ([`Finished`]); nothing a program prints can grow the engine.
//! - **A sandbox** ([`Sandbox`]), by default for what the policy drives, built on
//!   [bubblewrap](https://github.com/containers/bubblewrap) (`bwrap`, the sandbox Flatpak
//!   uses): a PID namespace per program (every descendant dies with it, `setsid` or not), the
//!   environment cleared to an allow-list, the file system read-only but for a private `/tmp`
//!   and the program's own directory, the engine's files and credentials hidden, no network
//!   unless asked, and resource limits ([`Limits`], through util-linux's `prlimit`).
//!   [`Sandbox::check`] tells, before a run starts, whether the sandbox can be had here, and
//!   what to install or set when not.
//!
//! ```no_run
//! # async fn demo() -> Result<(), async_grpo_process::Error> {
//! use std::time::Duration;
//! use async_grpo_process::{Program, Sandbox};
//!
//! let sandbox = Sandbox::default(); // bubblewrap, no network, default limits
//! sandbox.check()?;
//! let finished = Program::new(["python3", "-I", "-"])
//!     .sandbox(sandbox)
//!     .run(b"print(17 * 23)".to_vec(), Duration::from_secs(10), 16 * 1024)
//!     .await?;
//! assert_eq!(finished.stdout, "391\n");
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `schema` | no | `schemars::JsonSchema` for [`SandboxKeys`], [`Limits`] and [`Isolation`], from which the binary writes its settings reference | schemars |

mod cgroup;
mod interpreter;
mod path;
mod run;
mod sandbox;

pub use self::{
    cgroup::CgroupSupport,
    interpreter::{Cell, Interpreter, InterpreterPool, InterpreterSpec, Lent, Lost, PoolStats},
    path::{check_program, program_path, resolve_command},
    run::{Finished, ProcessGroup, Program, tail},
    sandbox::{
        ENGINE_SECRETS, Isolation, Limits, SANDBOX_UIDS, Sandbox, SandboxKeys, hide_secret, secrets,
    },
};

/// What a panic of in-process code the policy's output reached (a sync tool, a reward
/// function) says: its message when it has one. The in-process counterpart of a program's
/// [`Finished`], so that tools and rewards report a panic in the same words.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

/// What bounds a sandboxed program's whole tree on this machine: a cgroup of its own (v2 or
/// v1), or per-process limits only, and why (found once).
pub fn cgroup_support() -> CgroupSupport {
    cgroup::Cgroup::availability()
}

/// Why a program could not be run to its end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// There was no program to run (an empty command line).
    #[error("no program to run")]
    NoProgram,
    /// The program could not be started.
    #[error("could not start '{program}': {source}")]
    Start {
        /// The program.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The program ran past its timeout and was killed with everything it started.
    #[error("'{program}' timed out after {timeout:?} and was killed")]
    Timeout {
        /// The program.
        program: String,
        /// Its timeout.
        timeout: std::time::Duration,
    },
    /// Waiting for the program failed.
    #[error("could not wait for '{program}': {source}")]
    Wait {
        /// The program.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The sandbox a program asks for cannot be had on this machine.
    #[error("{0}")]
    SandboxUnavailable(String),
}

impl Error {
    /// Whether the program ran past its timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }
}
