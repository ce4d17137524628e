//! `command` and `python`: tools that run a program, with a timeout that kills it and a cap on
//! what its output may cost.
//!
//! A program runs in a process group of its own, and the whole group is killed when the call
//! ends in any way: the program exits (what it left running in the background goes with
//! it), its timeout passes, or the call's future is dropped (the dispatcher's timeout, a
//! cancelled rollout, a drain past its deadline, the runtime shutting down). Waiting for a
//! program is not work for a thread: both tools are async, and no pool thread is held.

use std::{
    process::{ExitStatus, Stdio},
    time::Duration,
};

use serde_json::{Value, json};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    process::Command,
};

use crate::tool::{Arguments, ToolError};

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

/// A program's process group (started with `process_group(0)`, so its id is the program's
/// pid), killed whole with SIGKILL when dropped or by [`ProcessGroup::kill`]. Public for
/// other long-lived programs an engine starts (an environment's server).
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

/// SIGKILL to every process of group `id`; a group already gone is no error.
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

/// Runs `argv` with `input` on stdin; kills its process group after `timeout`. Each of stdout
/// and stderr keeps its first `max_output` bytes, and says how much more there was.
pub(crate) async fn run(
    argv: &[String],
    input: Vec<u8>,
    timeout: Duration,
    max_output: usize,
) -> Result<Finished, String> {
    let (program, args) = argv.split_first().ok_or("no program to run")?;
    let mut command = Command::new(program);
    command.args(args);
    run_command(command, input, timeout, max_output).await
}

/// Runs `command` (its program, arguments, directory and environment as the caller set them)
/// in a process group of its own with `input` on stdin. The group is killed when the program
/// exits (what it left in the background goes with it), after `timeout`, or when the future is
/// dropped. Each of stdout and stderr keeps its first `max_output` bytes, and says how much
/// more there was. An error says the program could not start, or timed out and was killed.
pub async fn run_command(
    mut command: Command,
    input: Vec<u8>,
    timeout: Duration,
    max_output: usize,
) -> Result<Finished, String> {
    let program = command
        .as_std()
        .get_program()
        .to_string_lossy()
        .into_owned();
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    #[cfg(unix)]
    command.process_group(0);
    let mut child = command
        .spawn()
        .map_err(|e| format!("could not start '{program}': {e}"))?;
    // Its own group: the leader's id is the group's. Dropped on every way out of here.
    let group = ProcessGroup(child.id());
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    // Feed and drain at once: a program that writes much before reading all of its input must
    // not deadlock against us. Once the program exits, what it left in its group is killed,
    // so that a background process holding the pipes cannot keep the call open.
    let exited = async {
        let status = child.wait().await;
        drop(group);
        status
    };
    let feed = async move {
        if let Some(mut stdin) = stdin {
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
        Ok((Err(e), _, _)) => Err(format!("could not wait for '{program}': {e}")),
        // Dropping `work` drops the group (killed) and the child (reaped by tokio).
        Err(_elapsed) => Err(format!(
            "'{program}' timed out after {timeout:?} and was killed"
        )),
    }
}

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

/// A program that gets the call's JSON arguments on stdin; its stdout is the result. A
/// non-zero exit is a tool error carrying the end of its stderr.
#[derive(Debug, Clone)]
pub(crate) struct CommandTool {
    pub(crate) argv: Vec<String>,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
}

impl CommandTool {
    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let input = serde_json::to_vec(&Value::Object(args.into_inner()))?;
        let finished = run(&self.argv, input, self.timeout, self.max_output).await?;
        if !finished.status.success() {
            let stderr = finished.stderr.trim();
            let tail: String = stderr
                .chars()
                .rev()
                .take(1000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(
                format!("'{}' exited with {}: {tail}", self.argv[0], finished.status).into(),
            );
        }
        Ok(Value::String(
            finished.stdout.trim_end_matches('\n').to_owned(),
        ))
    }
}

/// Python code in a fresh interpreter (`python3 -I -`, the code on stdin). Not a sandbox: the
/// code runs with the engine's own permissions; give it a container if the model is not
/// trusted. The result is what a person at a terminal would see: stdout, then stderr and the
/// exit code when there are any.
#[derive(Debug, Clone)]
pub(crate) struct PythonTool {
    pub(crate) interpreter: String,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
}

impl PythonTool {
    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let code = args
            .get("code")
            .and_then(Value::as_str)
            .ok_or("the python tool needs {\"code\": \"...\"}")?;
        let argv = [self.interpreter.clone(), "-I".to_owned(), "-".to_owned()];
        let finished = run(
            &argv,
            code.as_bytes().to_vec(),
            self.timeout,
            self.max_output,
        )
        .await?;
        let mut text = finished.stdout;
        if !finished.stderr.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&finished.stderr);
        }
        if !finished.status.success() {
            let code = finished
                .status
                .code()
                .map_or_else(|| "a signal".to_owned(), |c| c.to_string());
            text.push_str(&format!("\n[exit code {code}]"));
        }
        Ok(Value::String(text.trim_end_matches('\n').to_owned()))
    }

    pub(crate) fn parameters() -> Value {
        json!({
            "type": "object",
            "properties": { "code": { "type": "string", "description": "Python code; print what you want to see" } },
            "required": ["code"]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: Value) -> Arguments {
        Arguments::new(value.as_object().cloned().unwrap_or_default())
    }

    fn sh(script: &str) -> CommandTool {
        CommandTool {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            timeout: Duration::from_secs(10),
            max_output: 1000,
        }
    }

    #[tokio::test]
    async fn a_command_reads_its_arguments_on_stdin_and_answers_on_stdout() {
        let echo = sh("cat");
        assert_eq!(
            echo.call(args(json!({"q": "rust"}))).await.ok(),
            Some(json!("{\"q\":\"rust\"}"))
        );
    }

    #[tokio::test]
    async fn a_failing_command_is_an_error_with_its_stderr() {
        let error = sh("cat >/dev/null; echo 'no such term' >&2; exit 4")
            .call(args(json!({})))
            .await
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("'sh' exited with exit status: 4: no such term")
        );
    }

    #[tokio::test]
    async fn a_command_past_its_timeout_is_killed_and_output_is_capped() {
        let slow = CommandTool {
            timeout: Duration::from_millis(200),
            ..sh("sleep 30")
        };
        let started = std::time::Instant::now();
        let error = slow
            .call(args(json!({})))
            .await
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("'sh' timed out after 200ms and was killed")
        );
        assert!(started.elapsed() < Duration::from_secs(10));

        let loud = CommandTool {
            max_output: 10,
            ..sh("cat >/dev/null; yes | head -c 5000")
        };
        let output = loud
            .call(args(json!({})))
            .await
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        assert_eq!(
            output,
            "y\ny\ny\ny\ny\n\n[output truncated: 4990 more bytes]"
        );
    }

    #[tokio::test]
    async fn python_shows_stdout_then_stderr_and_a_non_zero_exit_code() {
        let python = PythonTool {
            interpreter: "python3".into(),
            timeout: Duration::from_secs(20),
            max_output: 4000,
        };
        let ok = python
            .clone()
            .call(args(json!({"code": "print(17 * 23)"})))
            .await
            .ok();
        assert_eq!(ok, Some(json!("391")));
        let failed = python
            .call(args(json!({"code": "print('before')\n1/0"})))
            .await
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        assert!(failed.starts_with("before\nTraceback"), "{failed}");
        assert!(
            failed.contains("ZeroDivisionError") && failed.ends_with("[exit code 1]"),
            "{failed}"
        );
    }
}
