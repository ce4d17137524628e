//! `command` and `python`: tools that run a program through the `process` crate: sandboxed
//! by default, with a timeout that kills it and a cap on what its output may cost.
//!
//! A program runs in a process group of its own (and, sandboxed, a PID namespace of its own),
//! and the whole of it is killed when the call ends in any way: the program exits (what it
//! left running in the background goes with it), its timeout passes, or the call's future is
//! dropped (the dispatcher's timeout, a cancelled rollout, a drain past its deadline, the
//! runtime shutting down). Waiting for a program is not work for a thread: both tools are
//! async, and no pool thread is held.

use std::time::Duration;

use futures::future::BoxFuture;
use process::{Finished, InterpreterPool, Lent, Program, Sandbox};
use serde_json::{Value, json};

use crate::{
    sync::Arc,
    tool::{Arguments, AsyncTool, RolloutTool, ToolError},
};

/// Runs `argv` in `sandbox` with `input` on stdin; kills it after `timeout`. Each of stdout
/// and stderr keeps its first `max_output` bytes, and says how much more there was.
async fn run(
    argv: &[String],
    sandbox: &Sandbox,
    input: Vec<u8>,
    timeout: Duration,
    max_output: usize,
) -> Result<Finished, String> {
    Program::new(argv.iter().cloned())
        .sandbox(sandbox.clone())
        .run(input, timeout, max_output)
        .await
        .map_err(|e| e.to_string())
}

/// A program that gets the call's JSON arguments on stdin; its stdout is the result. A
/// non-zero exit is a tool error carrying the end of its stderr.
#[derive(Debug, Clone)]
pub(crate) struct CommandTool {
    pub(crate) argv: Vec<String>,
    pub(crate) sandbox: Sandbox,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
}

impl CommandTool {
    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let input = serde_json::to_vec(&Value::Object(args.into_inner()))?;
        let finished = run(
            &self.argv,
            &self.sandbox,
            input,
            self.timeout,
            self.max_output,
        )
        .await?;
        if !finished.status.success() {
            let tail = process::tail(&finished.stderr, 1000);
            return Err(
                format!("'{}' exited with {}: {tail}", self.argv[0], finished.status).into(),
            );
        }
        Ok(Value::String(
            finished.stdout.trim_end_matches('\n').to_owned(),
        ))
    }
}

/// Python code in a fresh interpreter (`python3 -I -`, the code on stdin), in its sandbox. The
/// result is what a person at a terminal would see: stdout, then stderr and the
/// exit code when there are any.
#[derive(Debug, Clone)]
pub(crate) struct PythonTool {
    pub(crate) interpreter: String,
    pub(crate) sandbox: Sandbox,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
}

impl PythonTool {
    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let code = code(&args)?;
        let argv = [self.interpreter.clone(), "-I".to_owned(), "-".to_owned()];
        let finished = run(
            &argv,
            &self.sandbox,
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

/// The code of a `python` call.
pub(crate) fn code(args: &Arguments) -> Result<&str, ToolError> {
    Ok(args
        .get("code")
        .and_then(Value::as_str)
        .ok_or("the python tool needs {\"code\": \"...\"}")?)
}

/// `python` with `session = "rollout"`: one interpreter per rollout, from `pool` at its first
/// call, whose variables, imports and files the rollout's next calls see; killed when the
/// rollout's dispatcher is dropped (the rollout ended in any way).
#[derive(Debug, Clone)]
pub(crate) struct PythonSessions {
    pub(crate) pool: InterpreterPool,
    pub(crate) timeout: Duration,
    pub(crate) max_output: usize,
}

impl RolloutTool for PythonSessions {
    fn open(&self) -> Arc<dyn AsyncTool> {
        Arc::new(PythonSession {
            tools: self.clone(),
            slot: Arc::new(tokio::sync::Mutex::new(Slot::default())),
        })
    }

    fn sessions_lost(&self) -> u64 {
        self.pool.stats().lost
    }
}

/// One rollout's session.
struct PythonSession {
    tools: PythonSessions,
    slot: Arc<tokio::sync::Mutex<Slot>>,
}

/// A session's interpreter, and why the last one was lost when it was.
#[derive(Default)]
struct Slot {
    interpreter: Option<Lent>,
    lost: Option<String>,
}

impl AsyncTool for PythonSession {
    fn call(&self, args: Arguments) -> BoxFuture<'static, Result<Value, ToolError>> {
        let (tools, slot) = (self.tools.clone(), Arc::clone(&self.slot));
        Box::pin(async move {
            let code = code(&args)?;
            // One cell at a time; a call dropped part-way drops its interpreter, killed.
            let mut slot = slot.lock().await;
            let cell = tokio::time::timeout(tools.timeout, async {
                let mut note = String::new();
                let mut interpreter = match slot.interpreter.take() {
                    Some(interpreter) => interpreter,
                    None => {
                        if let Some(why) = slot.lost.take() {
                            note = format!(
                                "[a new Python interpreter: {why}, and what earlier calls \
                                 defined is gone]\n"
                            );
                        }
                        tools.pool.acquire().await.map_err(|e| e.to_string())?
                    }
                };
                slot.lost = Some("the previous call did not finish".to_owned());
                let cell = interpreter.run(code, tools.max_output).await;
                if cell.is_ok() {
                    slot.interpreter = Some(interpreter);
                    slot.lost = None;
                } else {
                    tools.pool.count_lost();
                }
                cell.map(|cell| (note, cell))
                    .map_err(|lost| format!("{lost}: the session's state is lost"))
            })
            .await;
            match cell {
                Ok(Ok((note, cell))) => Ok(Value::String(
                    format!("{note}{}", cell.output)
                        .trim_end_matches('\n')
                        .to_owned(),
                )),
                Ok(Err(why)) => {
                    slot.lost.get_or_insert_with(|| why.clone());
                    Err(format!("{why}; the next call starts a new interpreter").into())
                }
                Err(_) => {
                    tools.pool.count_lost();
                    let timeout = crate::call::human(tools.timeout);
                    slot.lost = Some(format!("the previous call timed out after {timeout}"));
                    Err(format!(
                        "timed out after {timeout}: the interpreter was killed and the \
                         session's state is lost; the next call starts a new interpreter"
                    )
                    .into())
                }
            }
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
            sandbox: Sandbox::default(),
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
            sandbox: Sandbox::default(),
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
