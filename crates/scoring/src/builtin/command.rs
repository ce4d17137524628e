//! `command:PROGRAM`: any scorer, in any language, as an external program.

use std::process::Stdio;

use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{
    group::Group,
    reward::{AsyncReward, RewardError, Scores},
    sync::Arc,
};

/// Runs a program per group: the group goes to its stdin as JSON (`{"prompt", "completions":
/// [{"text", "messages", "token_ids", "has_training_row"}], "row"}`), and its stdout must be a
/// JSON array with one number or `null` per completion. A non-zero exit, or anything else on
/// stdout, fails the column for that group with the program's own words. The program runs in
/// a process group of its own, killed whole when it exits (what it left in the background
/// goes with it) or when the scorer stops waiting (a timeout, a drain).
#[derive(Debug, Clone)]
pub struct CommandReward {
    program: String,
    args: Vec<String>,
}

impl CommandReward {
    /// Runs `program` with `args`.
    pub fn new(
        program: impl Into<String>,
        args: impl IntoIterator<Item = String>,
    ) -> CommandReward {
        CommandReward {
            program: program.into(),
            args: args.into_iter().collect(),
        }
    }
}

impl AsyncReward for CommandReward {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let (program, args) = (self.program.clone(), self.args.clone());
        Box::pin(async move {
            let input = serde_json::to_vec(&*group)?;
            let mut command = tokio::process::Command::new(&program);
            command
                .args(&args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            #[cfg(unix)]
            command.process_group(0);
            let mut child = command
                .spawn()
                .map_err(|e| format!("could not start '{program}': {e}"))?;
            let group = ProcessGroup(child.id());
            let mut stdin = child
                .stdin
                .take()
                .ok_or("the child's stdin was not captured")?;
            let feed = async move {
                // A program that scores without reading all of stdin closes the pipe early:
                // not an error of ours.
                let _ = stdin.write_all(&input).await;
            };
            let (out, err) = (child.stdout.take(), child.stderr.take());
            // Once the program exits, what it left in its group is killed: a background process
            // holding stdout open must not keep the scorer waiting.
            let exited = async {
                let status = child.wait().await;
                drop(group);
                status
            };
            let ((), status, stdout, stderr) =
                tokio::join!(feed, exited, read_all(out), read_all(err));
            let status = status.map_err(|e| format!("'{program}' could not be waited for: {e}"))?;
            let output = std::process::Output {
                status,
                stdout,
                stderr,
            };
            if !output.status.success() {
                let stderr = String::from_utf8_lossy(&output.stderr);
                let tail: String = stderr
                    .trim()
                    .chars()
                    .rev()
                    .take(500)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                return Err(format!("'{program}' exited with {}: {tail}", output.status).into());
            }
            serde_json::from_slice::<Scores>(&output.stdout).map_err(|e| {
                let head: String = String::from_utf8_lossy(&output.stdout).chars().take(200).collect();
                format!("'{program}' must print a JSON array of numbers or nulls ({e}); it printed: {head:?}").into()
            })
        })
    }
}

/// A program's process group, killed (SIGKILL) when dropped; a group already gone is no
/// error. tool-dispatch's `command` tool has the same guard: the two crates are leaves.
struct ProcessGroup(Option<u32>);

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(pid) = self
            .0
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

/// Everything a pipe gives until it closes (nothing when there is no pipe or it fails).
async fn read_all(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<u8> {
    let mut bytes = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut bytes).await;
    }
    bytes
}
