//! `command` and `python`: tools that run a program, with a timeout that kills it and a cap on
//! what its output may cost.

use std::{
    io::{Read, Write},
    process::{Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::tool::{Arguments, BoxError};

/// What a finished program left.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) status: ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// Runs `argv` with `input` on stdin; kills it after `timeout`. Each of stdout and stderr keeps
/// its first `max_output` bytes, and says how much more there was.
pub(crate) fn run(
    argv: &[String],
    input: Vec<u8>,
    timeout: Duration,
    max_output: usize,
) -> Result<Finished, String> {
    let (program, args) = argv.split_first().ok_or("no program to run")?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start '{program}': {e}"))?;
    // Feed and drain on threads of their own: a program that writes much before reading all of
    // its input must not deadlock against us.
    if let Some(mut stdin) = child.stdin.take() {
        thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
    }
    let stdout = drain(child.stdout.take(), max_output);
    let stderr = drain(child.stderr.take(), max_output);

    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "'{program}' timed out after {timeout:?} and was killed"
                ));
            }
            Ok(None) => thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("could not wait for '{program}': {e}")),
        }
    };
    let collect = |reader: Option<thread::JoinHandle<String>>| {
        reader.and_then(|r| r.join().ok()).unwrap_or_default()
    };
    Ok(Finished {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    })
}

fn drain(
    pipe: Option<impl Read + Send + 'static>,
    max_output: usize,
) -> Option<thread::JoinHandle<String>> {
    let mut pipe = pipe?;
    Some(thread::spawn(move || {
        let mut kept = Vec::new();
        let mut more = 0usize;
        let mut buffer = [0u8; 8192];
        while let Ok(read) = pipe.read(&mut buffer) {
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
    }))
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
    pub(crate) fn call(&self, args: Arguments) -> Result<Value, BoxError> {
        let input = serde_json::to_vec(&Value::Object(args.into_inner()))?;
        let finished = run(&self.argv, input, self.timeout, self.max_output)?;
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
    pub(crate) fn call(&self, args: Arguments) -> Result<Value, BoxError> {
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
        )?;
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

    #[test]
    fn a_command_reads_its_arguments_on_stdin_and_answers_on_stdout() {
        let echo = sh("cat");
        assert_eq!(
            echo.call(args(json!({"q": "rust"}))).ok(),
            Some(json!("{\"q\":\"rust\"}"))
        );
    }

    #[test]
    fn a_failing_command_is_an_error_with_its_stderr() {
        let error = sh("cat >/dev/null; echo 'no such term' >&2; exit 4")
            .call(args(json!({})))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("'sh' exited with exit status: 4: no such term")
        );
    }

    #[test]
    fn a_command_past_its_timeout_is_killed_and_output_is_capped() {
        let slow = CommandTool {
            timeout: Duration::from_millis(200),
            ..sh("sleep 30")
        };
        let started = Instant::now();
        let error = slow.call(args(json!({}))).err().map(|e| e.to_string());
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
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        assert_eq!(
            output,
            "y\ny\ny\ny\ny\n\n[output truncated: 4990 more bytes]"
        );
    }

    #[test]
    fn python_shows_stdout_then_stderr_and_a_non_zero_exit_code() {
        let python = PythonTool {
            interpreter: "python3".into(),
            timeout: Duration::from_secs(20),
            max_output: 4000,
        };
        let ok = python.call(args(json!({"code": "print(17 * 23)"}))).ok();
        assert_eq!(ok, Some(json!("391")));
        let failed = python
            .call(args(json!({"code": "print('before')\n1/0"})))
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
