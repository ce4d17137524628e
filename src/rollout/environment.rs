//! The `[environment]` table of `async-grpo rollout`: every rollout runs in a session of an
//! MCP server (its tools are the rollout's, its verify tool gives the `env` reward).
//!
//! ```toml
//! [environment]
//! kind = "mcp"
//! command = ["python3", "env_server.py"]   # stdio: one server process per rollout
//! # url = "http://127.0.0.1:9000/mcp"      # or streamable HTTP: one MCP session per rollout
//! verify_tool = "verify"                   # called once at the end, never shown to the model
//! timeout = "30s"                          # per request
//! weight = 1.0                             # of the `env` column among the rewards
//! create_attempts = 3                      # tries at starting a session
//! sandbox = "bwrap"                        # a stdio server sandboxed (default "none")
//! network = false                          # with bwrap: the host's network or not (default false)
//! limits = { memory_mib = 2048 }           # process::Limits (default none; with bwrap, bwrap's)
//! ```
//!
//! A stdio server is the user's own program, so it runs unsandboxed unless the table asks
//! (`sandbox = "bwrap"`: then as the `[[tools]]` run, the run's files hidden); either way it
//! never sees the control endpoint's token.

use std::{path::Path, time::Duration};

use anyhow::bail;
use harness::{
    Harness, HarnessConfig,
    mcp::{McpConfig, McpFactory, McpServer},
};
use process::{Isolation, Limits, Sandbox};
use scoring::Reward;
use serde::{Deserialize, Serialize};
use tool_dispatch::ToolDispatcher;

/// The `[environment]` table: as written, and, once [`EnvironmentSettings::check`]ed, as
/// the run uses it (paths absolute).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EnvironmentSettings {
    /// What serves the episodes: `mcp`.
    kind: Kind,
    /// A stdio server: the program and its arguments (one process per rollout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    command: Option<Vec<String>>,
    /// A streamable-HTTP server (one MCP session per rollout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    /// The tool called once at the end, never shown to the model.
    #[serde(default = "default_verify_tool")]
    verify_tool: String,
    /// Per request.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    timeout: Duration,
    /// The weight of the `env` column among the rewards.
    #[serde(default = "default_weight")]
    weight: f64,
    /// Tries at starting a session.
    #[serde(default = "default_create_attempts")]
    create_attempts: u32,
    /// A stdio server's isolation: `"none"` (the default) or `"bwrap"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sandbox: Option<Isolation>,
    /// With `sandbox = "bwrap"`: whether the server gets the host's network (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    network: Option<bool>,
    /// A stdio server's resource limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    limits: Option<Limits>,
}

/// What serves an environment's episodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    /// An MCP server.
    Mcp,
}

fn default_verify_tool() -> String {
    "verify".to_owned()
}

fn default_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_weight() -> f64 {
    1.0
}

fn default_create_attempts() -> u32 {
    3
}

impl EnvironmentSettings {
    /// Checks the table (at `place`, for messages); a relative program path, and arguments
    /// naming files next to the config file, become paths from `base`.
    pub(crate) fn check(&mut self, base: &Path, place: &str) -> anyhow::Result<()> {
        match (&mut self.command, &self.url) {
            (Some(_), Some(_)) => {
                bail!("{place}: give command (a stdio server) or url (streamable HTTP), not both")
            }
            (None, None) => bail!(
                "{place}: no server: give command = [\"python3\", \"server.py\"] (stdio) or \
                 url = \"http://127.0.0.1:9000/mcp\" (streamable HTTP)"
            ),
            (Some(argv), None) => {
                super::config::resolve_command(base, argv, &format!("{place}.command"))?;
            }
            (None, Some(url)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("{place}.url: '{url}' is not an http:// or https:// URL");
                }
            }
        }
        if self.timeout.is_zero() {
            bail!("{place}.timeout: must be longer than zero");
        }
        if !self.weight.is_finite() {
            bail!(
                "{place}.weight: expected a finite number, got {}",
                self.weight
            );
        }
        if self.create_attempts == 0 {
            bail!("{place}.create_attempts: must be at least 1");
        }
        if self.verify_tool.is_empty() {
            bail!("{place}.verify_tool: must name a tool of the server");
        }
        let keys = self.sandbox.is_some() || self.network.is_some() || self.limits.is_some();
        if keys && self.command.is_none() {
            bail!(
                "{place}: sandbox, network and limits are for a stdio server (command), not a url"
            );
        }
        self.sandbox_in(Sandbox::default())
            .check()
            .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        Ok(())
    }

    /// Where a stdio server runs: unsandboxed unless the table says `sandbox = "bwrap"`, then
    /// in `base` (the run's files hidden) as the table changes it.
    fn sandbox_in(&self, base: Sandbox) -> Sandbox {
        let start = match self.sandbox {
            Some(Isolation::Bwrap) => base,
            Some(Isolation::None) | None => Sandbox::none(),
        };
        start.with_keys(None, self.network, self.limits)
    }

    /// The server, as the harness takes it.
    fn server(&self) -> McpServer {
        match (&self.command, &self.url) {
            (Some(argv), _) => McpServer::Command(argv.clone()),
            (None, url) => McpServer::Url(url.clone().unwrap_or_default()),
        }
    }

    /// The environment, its sessions' tools run through `pool`, a stdio server in `sandbox`
    /// as the table changes it.
    pub(crate) fn harness(&self, pool: ToolDispatcher, sandbox: Sandbox) -> Harness {
        let server = self.server();
        let factory = McpFactory::new(
            McpConfig::new(server.clone())
                .verify_tool(self.verify_tool.clone())
                .timeout(self.timeout)
                .sandbox(self.sandbox_in(sandbox)),
        );
        Harness::new(server.to_string(), factory, pool).config(
            HarnessConfig::default()
                .create_attempts(self.create_attempts)
                .timeout(self.timeout)
                // The server's start, then the handshake, tools/list and reset, each bounded
                // by `timeout` in the MCP session itself.
                .create_timeout(self.timeout.saturating_mul(4)),
        )
    }

    /// The `env` reward column, weighted.
    pub(crate) fn reward(&self) -> Reward {
        scoring::builtin::environment().weight(self.weight)
    }
}
