//! The `[agent]` table of `async-grpo rollout`: every rollout is run by a loop-owning agent
//! program (a coding agent) against the recording proxy, and judged by a verify command (or
//! by an `[environment]`'s verify, its session opened for each rollout).
//!
//! ```toml
//! [agent]
//! command = ["opencode", "run", "--format", "json", "{prompt}"]  # {prompt} {workdir} {task_json}
//! env = { OPENCODE_DISABLE_AUTOUPDATE = "1" }   # plus OPENAI_BASE_URL / OPENAI_API_KEY per rollout
//! workdir = "fresh"                             # a new directory per rollout, removed after verify
//! setup = ["./setup.sh"]                        # optional, in the workdir, before the agent
//! verify = ["python3", "./verify.py"]          # in the workdir after the agent, the row as JSON on stdin: a printed number, or exit 0/1
//! timeout = "10m"                               # the agent's; then its process group is killed
//! weight = 1.0                                  # of the `env` column (verify's reward)
//! sandbox = "bwrap"                             # or "none": with the engine's permissions
//! network = false                               # only its proxy (true: the host's network)
//! limits = { memory_mib = 8192 }                # process::Limits; unset fields keep defaults
//! ```
//!
//! The agent, setup and verify run sandboxed by default (see `process::Sandbox`): a PID
//! namespace each, the environment cleared to what `env` gives plus the proxy's URL and key,
//! the file system read-only but their own directory and a private `/tmp`, the run's dataset,
//! output and configuration and the other rollouts' directories hidden. verify gets the
//! dataset row as JSON on its stdin, so the answer never needs to enter the agent's directory
//! or arguments.

use std::{collections::BTreeMap, path::Path, sync::Arc, time::Duration};

use anyhow::bail;
use harness::{
    agent::{ProgramAgent, ProgramConfig},
    proxy::Proxy,
};
use process::{Isolation, Limits, Sandbox};
use scoring::Reward;
use serde::{Deserialize, Serialize};

/// The `[agent]` table: as written, and, once [`AgentSettings::check`]ed, as the run uses it
/// (programs next to the config file made absolute).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentSettings {
    /// The agent's command line; `{prompt}`, `{workdir}` and `{task_json}` are replaced.
    command: Vec<String>,
    /// More environment variables for the agent, setup and verify.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    env: BTreeMap<String, String>,
    /// Where each rollout runs: `fresh`, a new directory removed after verify.
    #[serde(default)]
    workdir: Workdir,
    /// A command run in the directory before the agent (it must exit 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    setup: Option<Vec<String>>,
    /// A command run in the directory after the agent: the number it prints, else its exit
    /// code (0: 1.0, 1: 0.0), is the `env` reward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    verify: Option<Vec<String>>,
    /// How long the agent may run.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    timeout: Duration,
    /// How long setup and verify may each run.
    #[serde(default = "default_command_timeout", with = "humantime_serde")]
    command_timeout: Duration,
    /// The weight of the `env` column among the rewards.
    #[serde(default = "default_weight")]
    weight: f64,
    /// `"bwrap"` (the default) or `"none"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sandbox: Option<Isolation>,
    /// Whether the agent gets the host's network (default false: only its proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    network: Option<bool>,
    /// Resource limits of the agent, setup and verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    limits: Option<Limits>,
}

/// Where an agent runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
enum Workdir {
    /// A new directory per rollout attempt, removed after verify.
    #[default]
    Fresh,
}

fn default_timeout() -> Duration {
    Duration::from_secs(600)
}

fn default_command_timeout() -> Duration {
    Duration::from_secs(120)
}

fn default_weight() -> f64 {
    1.0
}

impl AgentSettings {
    /// Checks the table (at `place`, for messages); programs and arguments naming files next
    /// to the config file become paths from `base`.
    pub(crate) fn check(&mut self, base: &Path, place: &str) -> anyhow::Result<()> {
        for (key, argv) in [
            ("command", Some(&mut self.command)),
            ("setup", self.setup.as_mut()),
            ("verify", self.verify.as_mut()),
        ] {
            if let Some(argv) = argv {
                super::config::resolve_command(base, argv, &format!("{place}.{key}"))?;
            }
        }
        if self.timeout.is_zero() || self.command_timeout.is_zero() {
            bail!("{place}: timeout and command_timeout must be longer than zero");
        }
        if !self.weight.is_finite() {
            bail!(
                "{place}.weight: expected a finite number, got {}",
                self.weight
            );
        }
        self.sandbox_in(Sandbox::default())
            .check()
            .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        Ok(())
    }

    /// `base` as the table changes it.
    fn sandbox_in(&self, base: Sandbox) -> Sandbox {
        base.with_keys(self.sandbox, self.network, self.limits)
    }

    /// Whether a verify command gives the `env` reward.
    pub(crate) fn verifies(&self) -> bool {
        self.verify.is_some()
    }

    /// The agent, run against `proxy`, its programs in `sandbox` as the table changes it.
    pub(crate) fn agent(
        &self,
        proxy: Arc<Proxy>,
        sandbox: Sandbox,
    ) -> anyhow::Result<ProgramAgent> {
        let mut config = ProgramConfig::new(self.command.clone());
        config.env = self.env.clone();
        config.setup = self.setup.iter().cloned().collect();
        config.verify = self.verify.clone();
        config.timeout = self.timeout;
        config.command_timeout = self.command_timeout;
        config.sandbox = self.sandbox_in(sandbox);
        // Without the host's network, the agent reaches its proxy through this binary.
        let this = std::env::current_exe().map_err(|e| {
            anyhow::anyhow!("cannot find this program to forward agents' requests: {e}")
        })?;
        config.forwarder = Some(vec![
            this.to_string_lossy().into_owned(),
            "agent-forward".to_owned(),
        ]);
        Ok(ProgramAgent::new(proxy, config)?)
    }

    /// The `env` column (verify's reward), weighted, when a verify command gives one.
    pub(crate) fn reward(&self) -> Option<Reward> {
        self.verifies()
            .then(|| scoring::builtin::environment().weight(self.weight))
    }
}

/// `async-grpo agent-forward`: what runs an agent inside its sandbox (see
/// `harness::agent::forward`).
#[derive(Debug, clap::Args)]
pub(crate) struct ForwardArgs {
    /// The port to listen on (127.0.0.1 of the sandbox's network namespace).
    #[arg(long)]
    port: u16,
    /// The Unix socket that reaches the proxy.
    #[arg(long)]
    socket: std::path::PathBuf,
    /// The agent's command line.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs `agent-forward`; exits as the agent did.
pub(crate) fn forward(args: ForwardArgs) -> anyhow::Result<std::process::ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let status = runtime.block_on(harness::agent::forward(
        args.port,
        args.socket,
        &args.command,
    ))?;
    // Killed by a signal: 128 + the signal, as a shell says it.
    let code = status.code().unwrap_or_else(|| {
        128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0)
    });
    Ok(std::process::ExitCode::from(
        u8::try_from(code).unwrap_or(1),
    ))
}
