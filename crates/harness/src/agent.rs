//! [`ProgramAgent`]: a loop-owning agent program (a coding agent such as opencode) run once
//! per rollout attempt against the recording [`Proxy`], as the loop's
//! [`rollout_core::rollout::Agent`].
//!
//! Each attempt gets a directory of its own (removed at the end), a proxy key of its own
//! (`OPENAI_BASE_URL`, `OPENAI_API_KEY` in the agent's environment), its `setup` commands run
//! in the directory, then the agent, in a process group of its own, killed whole when it
//! exits, times out, or the attempt is dropped (a drain, Ctrl-C, the rollout's deadline).
//! Its output is kept, capped, for the log. Then `verify` runs in the directory: its reward is
//! the number it prints, else its exit code (0 is 1.0, 1 is 0.0, anything else unscorable).
//! Nothing of one attempt is visible to another: directory, key, process group.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use futures::future::BoxFuture;
use rollout_core::{
    DatasetRow,
    rollout::{Agent, AgentError, AgentOutcome, AgentRun, Verdict},
};
use serde_json::Value;
use tokio::process::Command;
use tool_dispatch::builtin::{Finished, run_command};

use crate::{proxy::Proxy, sync::Arc};

/// How to run the agent program.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProgramConfig {
    /// The agent's command line; `{prompt}` (the task's text), `{workdir}` and `{task_json}`
    /// (the dataset row as JSON) are replaced in each argument.
    pub command: Vec<String>,
    /// More environment variables for the agent, setup and verify (the proxy's URL and key
    /// are added).
    pub env: BTreeMap<String, String>,
    /// Commands run in the directory before the agent, in order (each must exit 0).
    pub setup: Vec<Vec<String>>,
    /// The command that judges the directory after the agent exited.
    pub verify: Option<Vec<String>>,
    /// How long the agent may run before its process group is killed.
    pub timeout: Duration,
    /// How long each setup and verify command may run.
    pub command_timeout: Duration,
    /// Where attempt directories are made.
    pub workdir_root: PathBuf,
    /// Bytes of the agent's stdout and of its stderr kept for the log.
    pub max_output: usize,
}

impl ProgramConfig {
    /// Runs `command` with the defaults: 10 minutes, 2 minutes per setup or verify command,
    /// directories under the system's temporary directory, 64 KiB of output kept.
    pub fn new(command: Vec<String>) -> ProgramConfig {
        ProgramConfig {
            command,
            env: BTreeMap::new(),
            setup: Vec::new(),
            verify: None,
            timeout: Duration::from_secs(600),
            command_timeout: Duration::from_secs(120),
            workdir_root: std::env::temp_dir().join("async-grpo-agents"),
            max_output: 64 * 1024,
        }
    }
}

/// An agent program as the loop's agent; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ProgramAgent {
    proxy: Arc<Proxy>,
    config: Arc<ProgramConfig>,
}

impl ProgramAgent {
    /// Runs `config`'s program against `proxy`.
    pub fn new(proxy: Arc<Proxy>, config: ProgramConfig) -> ProgramAgent {
        ProgramAgent {
            proxy,
            config: Arc::new(config),
        }
    }
}

impl Agent for ProgramAgent {
    fn run(&self, run: AgentRun) -> BoxFuture<'static, Result<AgentOutcome, AgentError>> {
        let this = self.clone();
        Box::pin(async move { this.attempt(run).await })
    }
}

/// An attempt's directory, removed when dropped.
struct Workdir(PathBuf);

impl Drop for Workdir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), %error, "cannot remove an agent's directory");
        }
    }
}

impl ProgramAgent {
    async fn attempt(&self, run: AgentRun) -> Result<AgentOutcome, AgentError> {
        let config = &self.config;
        let workdir = make_workdir(&config.workdir_root, &run.episode_id)?;
        let task = Value::Object(run.row.to_json()).to_string();
        let prompt = task_text(&run.row);
        let session = self.proxy.session(run.sampler);
        let mut env = config.env.clone();
        env.insert("OPENAI_BASE_URL".into(), session.base_url().to_owned());
        env.insert("OPENAI_API_KEY".into(), session.key().to_owned());
        env.insert("ASYNC_GRPO_EPISODE".into(), run.episode_id.clone());
        let place = Placeholders {
            prompt: &prompt,
            workdir: &workdir.0,
            task: &task,
        };
        for (index, argv) in config.setup.iter().enumerate() {
            let finished = self
                .program(argv, &place, &env, config.command_timeout)
                .await
                .map_err(|e| AgentError(format!("setup[{index}]: {e}")))?;
            if !finished.status.success() {
                return Err(AgentError(format!(
                    "setup[{index}] exited with {}: {}",
                    finished.status,
                    tail(&finished.stderr)
                )));
            }
        }
        let ran = self
            .program(&config.command, &place, &env, config.timeout)
            .await;
        let mut metrics = BTreeMap::new();
        match &ran {
            Ok(finished) => {
                let code = finished.status.code().map_or(-1.0, f64::from);
                metrics.insert("agent_exit_code".to_owned(), code);
                metrics.insert("agent_timed_out".to_owned(), 0.0);
                tracing::debug!(
                    episode = %run.episode_id,
                    status = %finished.status,
                    stdout = %tail(&finished.stdout),
                    stderr = %tail(&finished.stderr),
                    "the agent exited"
                );
            }
            Err(error) => {
                metrics.insert("agent_timed_out".to_owned(), 1.0);
                tracing::warn!(episode = %run.episode_id, %error, "the agent did not finish");
            }
        }
        let transcript = session.finish().await;
        if let Err(error) = &ran
            && transcript.stats.requests == 0
        {
            return Err(AgentError(format!("the agent did not run: {error}")));
        }
        let verdict = match &config.verify {
            Some(argv) => Some(self.verify(argv, &place, &env).await),
            None => None,
        };
        let stats = transcript.stats;
        metrics.insert("capture_reused_turns".into(), stats.reused_turns as f64);
        metrics.insert("capture_rendered_turns".into(), stats.rendered_turns as f64);
        metrics.insert("capture_limited_turns".into(), stats.limited as f64);
        let mut outcome = AgentOutcome::new(transcript.prompt, transcript.completion)
            .tool_calls(stats.tool_calls);
        outcome.metrics = metrics;
        if let Some(verdict) = verdict {
            outcome = outcome.verdict(verdict);
        }
        drop(workdir);
        Ok(outcome)
    }

    /// Runs `argv` (placeholders replaced) in the attempt's directory with `env`.
    async fn program(
        &self,
        argv: &[String],
        place: &Placeholders<'_>,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<Finished, String> {
        let argv: Vec<String> = argv.iter().map(|arg| place.fill(arg)).collect();
        let (program, args) = argv.split_first().ok_or("no program to run")?;
        let mut command = Command::new(program);
        command
            .args(args)
            .current_dir(place.workdir)
            .envs(env)
            .stdin(Stdio::null());
        run_command(command, Vec::new(), timeout, self.config.max_output).await
    }

    /// The reward `verify` gives: the number it prints, else its exit code (0: 1.0, 1: 0.0).
    async fn verify(
        &self,
        argv: &[String],
        place: &Placeholders<'_>,
        env: &BTreeMap<String, String>,
    ) -> Verdict {
        let finished = match self
            .program(argv, place, env, self.config.command_timeout)
            .await
        {
            Ok(finished) => finished,
            Err(error) => return unverified(format!("verify: {error}")),
        };
        if let Ok(reward) = finished.stdout.trim().parse::<f64>()
            && reward.is_finite()
        {
            return Verdict {
                reward: Some(reward),
                ..Verdict::default()
            };
        }
        match finished.status.code() {
            Some(0) => Verdict {
                reward: Some(1.0),
                ..Verdict::default()
            },
            Some(1) => Verdict {
                reward: Some(0.0),
                ..Verdict::default()
            },
            _ => unverified(format!(
                "verify exited with {}: {}",
                finished.status,
                tail(&finished.stderr)
            )),
        }
    }
}

fn unverified(error: String) -> Verdict {
    Verdict {
        error: Some(error),
        ..Verdict::default()
    }
}

/// What the placeholders of a command line stand for.
struct Placeholders<'a> {
    prompt: &'a str,
    workdir: &'a Path,
    task: &'a str,
}

impl Placeholders<'_> {
    fn fill(&self, arg: &str) -> String {
        arg.replace("{prompt}", self.prompt)
            .replace("{workdir}", &self.workdir.to_string_lossy())
            .replace("{task_json}", self.task)
    }
}

/// A fresh directory for the attempt.
fn make_workdir(root: &Path, episode: &str) -> Result<Workdir, AgentError> {
    let cannot = |e: std::io::Error| {
        AgentError(format!(
            "cannot make a directory under {}: {e}",
            root.display()
        ))
    };
    std::fs::create_dir_all(root).map_err(cannot)?;
    for n in 0u32.. {
        let dir = root.join(format!("{episode}-{}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(Workdir(dir)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(cannot(e)),
        }
    }
    Err(AgentError("no free directory name".to_owned()))
}

/// The task's text: the row's last user message.
fn task_text(row: &DatasetRow) -> String {
    row.prompt
        .iter()
        .rev()
        .find(|m| m.role() == "user")
        .and_then(|m| m.content())
        .unwrap_or_default()
        .to_owned()
}

/// The last 2000 characters of an output, for messages.
fn tail(text: &str) -> String {
    let text = text.trim();
    let start = text
        .char_indices()
        .rev()
        .nth(1999)
        .map_or(0, |(index, _)| index);
    text[start..].to_owned()
}
