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
//! ```

use std::{path::Path, time::Duration};

use anyhow::bail;
use harness::{
    Harness, HarnessConfig,
    mcp::{McpConfig, McpFactory, McpServer},
};
use scoring::Reward;
use serde::{Deserialize, Serialize};
use tool_dispatch::ToolDispatcher;

/// The `[environment]` table, as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EnvironmentTable {
    kind: Option<String>,
    command: Option<Vec<String>>,
    url: Option<String>,
    verify_tool: Option<String>,
    timeout: Option<String>,
    weight: Option<f64>,
    create_attempts: Option<u32>,
}

/// The `[environment]` table, resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EnvironmentSettings {
    /// The server.
    pub(crate) server: McpServer,
    /// Its verify tool.
    pub(crate) verify_tool: String,
    /// Per request.
    pub(crate) timeout: Duration,
    /// The weight of the `env` column.
    pub(crate) weight: f64,
    /// Tries at creating a session.
    pub(crate) create_attempts: u32,
}

impl EnvironmentSettings {
    /// Checks `table` (at `place`, for messages); a relative program path, and arguments
    /// naming files next to the config file, are taken relative to `base`.
    pub(crate) fn resolve(
        table: EnvironmentTable,
        base: &Path,
        place: &str,
    ) -> anyhow::Result<EnvironmentSettings> {
        match table.kind.as_deref() {
            Some("mcp") => {}
            Some(other) => bail!("{place}: unknown kind '{other}'; expected kind = \"mcp\""),
            None => bail!("{place}: kind is missing; expected kind = \"mcp\""),
        }
        let server = match (table.command, table.url) {
            (Some(_), Some(_)) => {
                bail!("{place}: give command (a stdio server) or url (streamable HTTP), not both")
            }
            (None, None) => bail!(
                "{place}: no server: give command = [\"python3\", \"server.py\"] (stdio) or \
                 url = \"http://127.0.0.1:9000/mcp\" (streamable HTTP)"
            ),
            (Some(argv), None) => {
                let Some((program, args)) = argv.split_first() else {
                    bail!("{place}: command is empty; expected the program and its arguments");
                };
                let program = relative_program(base, program);
                super::config::check_program(&program)
                    .map_err(|e| anyhow::anyhow!("{place}.command: {e}"))?;
                let mut resolved = vec![program];
                resolved.extend(args.iter().map(|arg| {
                    let beside = base.join(arg);
                    if Path::new(arg).is_relative() && beside.is_file() {
                        beside.display().to_string()
                    } else {
                        arg.clone()
                    }
                }));
                McpServer::Command(resolved)
            }
            (None, Some(url)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("{place}.url: '{url}' is not an http:// or https:// URL");
                }
                McpServer::Url(url)
            }
        };
        let timeout = match &table.timeout {
            Some(text) => tool_dispatch::builtin::parse_duration(text)
                .map_err(|e| anyhow::anyhow!("{place}.timeout: {e}"))?,
            None => Duration::from_secs(30),
        };
        if timeout.is_zero() {
            bail!("{place}.timeout: must be longer than zero");
        }
        let weight = table.weight.unwrap_or(1.0);
        if !weight.is_finite() {
            bail!("{place}.weight: expected a finite number, got {weight}");
        }
        let create_attempts = table.create_attempts.unwrap_or(3);
        if create_attempts == 0 {
            bail!("{place}.create_attempts: must be at least 1");
        }
        let verify_tool = table.verify_tool.unwrap_or_else(|| "verify".to_owned());
        if verify_tool.is_empty() {
            bail!("{place}.verify_tool: must name a tool of the server");
        }
        Ok(EnvironmentSettings {
            server,
            verify_tool,
            timeout,
            weight,
            create_attempts,
        })
    }

    /// The environment, its sessions' tools run through `pool`.
    pub(crate) fn harness(&self, pool: ToolDispatcher) -> Harness {
        let factory = McpFactory::new(
            McpConfig::new(self.server.clone())
                .verify_tool(self.verify_tool.clone())
                .timeout(self.timeout),
        );
        Harness::new(self.server.to_string(), factory, pool).config(
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

    /// The table that resolves to these settings again (paths absolute).
    pub(crate) fn to_table(&self) -> EnvironmentTable {
        let (command, url) = match &self.server {
            McpServer::Command(argv) => (Some(argv.clone()), None),
            McpServer::Url(url) => (None, Some(url.clone())),
        };
        EnvironmentTable {
            kind: Some("mcp".to_owned()),
            command,
            url,
            verify_tool: Some(self.verify_tool.clone()),
            timeout: Some(format!("{}ms", self.timeout.as_millis())),
            weight: Some(self.weight),
            create_attempts: Some(self.create_attempts),
        }
    }
}

/// A program path with a directory part, relative, is taken from `base`; a bare name is
/// looked up on `PATH`.
fn relative_program(base: &Path, program: &str) -> String {
    let path = Path::new(program);
    if path.is_relative() && path.components().count() > 1 {
        base.join(path).display().to_string()
    } else {
        program.to_owned()
    }
}
