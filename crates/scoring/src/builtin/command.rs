//! `command:PROGRAM`: any scorer, in any language, as an external program.

use std::time::Duration;

use std::sync::Arc;

use futures::future::BoxFuture;
use process::{Program, Sandbox};

use crate::{
    group::Group,
    reward::{AsyncReward, RewardError, Scores},
};

/// Runs a program per group: the group goes to its stdin as JSON (`{"prompt", "completions":
/// [{"text", "messages", "token_ids", "has_training_row"}], "row"}`), and its stdout must be a
/// JSON array with one number or `null` per completion. A non-zero exit, or anything else on
/// stdout, fails the column for that group with the program's own words. The program runs in
/// a process group of its own, killed whole when it exits (what it left in the background
/// goes with it) or when the scorer stops waiting (a timeout, a drain). What it prints is read
/// up to 16 MiB on each of stdout and stderr: more fails the column. It runs unsandboxed (the
/// reward is the user's own program) unless [`CommandReward::sandbox`] says otherwise; either
/// way it never sees the engine's secrets ([`process::ENGINE_SECRETS`]).
#[derive(Debug, Clone)]
pub struct CommandReward {
    program: String,
    args: Vec<String>,
    sandbox: Sandbox,
}

/// Bytes read of a reward program's stdout, and of its stderr.
const MAX_OUTPUT: usize = 16 * 1024 * 1024;

impl CommandReward {
    /// Runs `program` with `args`.
    pub fn new(
        program: impl Into<String>,
        args: impl IntoIterator<Item = String>,
    ) -> CommandReward {
        CommandReward {
            program: program.into(),
            args: args.into_iter().collect(),
            sandbox: Sandbox::none(),
        }
    }

    /// Runs the program in `sandbox` instead (for a reward that runs what the model wrote).
    pub fn sandbox(mut self, sandbox: Sandbox) -> CommandReward {
        self.sandbox = sandbox;
        self
    }
}

impl AsyncReward for CommandReward {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let this = self.clone();
        Box::pin(async move {
            let input = serde_json::to_vec(&*group)?;
            let program = this.program.clone();
            let mut argv = vec![this.program];
            argv.extend(this.args);
            // The scorer's timeout bounds the wait (dropping this future kills the group);
            // this one only keeps a program that never ends from being waited for forever.
            let finished = Program::new(argv)
                .sandbox(this.sandbox)
                .run(input, Duration::from_secs(24 * 3600), MAX_OUTPUT)
                .await
                .map_err(|e| e.to_string())?;
            if !finished.status.success() {
                let tail = process::tail(&finished.stderr, 500);
                return Err(format!("'{program}' exited with {}: {tail}", finished.status).into());
            }
            serde_json::from_str::<Scores>(&finished.stdout).map_err(|e| {
                let head: String = finished.stdout.chars().take(200).collect();
                format!("'{program}' must print a JSON array of numbers or nulls ({e}); it printed: {head:?}").into()
            })
        })
    }
}
