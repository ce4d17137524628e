//! `command:PROGRAM`: any scorer, in any language, as an external program.

use std::process::Stdio;

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt;

use crate::{
    group::Group,
    reward::{AsyncReward, BoxError, Scores},
    sync::Arc,
};

/// Runs a program per group: the group goes to its stdin as JSON (`{"prompt", "completions":
/// [{"text", "messages", "token_ids", "has_training_row"}], "row"}`), and its stdout must be a
/// JSON array with one number or `null` per completion. A non-zero exit, or anything else on
/// stdout, fails the column for that group with the program's own words. The program is
/// killed if the scorer stops waiting (timeout).
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
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, BoxError>> {
        let (program, args) = (self.program.clone(), self.args.clone());
        Box::pin(async move {
            let input = serde_json::to_vec(&*group)?;
            let mut child = tokio::process::Command::new(&program)
                .args(&args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("could not start '{program}': {e}"))?;
            let mut stdin = child
                .stdin
                .take()
                .ok_or("the child's stdin was not captured")?;
            let feed = async move {
                // A program that scores without reading all of stdin closes the pipe early:
                // not an error of ours.
                let _ = stdin.write_all(&input).await;
            };
            let ((), output) = tokio::join!(feed, child.wait_with_output());
            let output = output.map_err(|e| format!("'{program}' could not be waited for: {e}"))?;
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
