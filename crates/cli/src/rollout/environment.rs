//! The `[environment]` table of `async-grpo rollout`: every rollout runs in a session of an
//! MCP server (its tools are the rollout's, its verify tool gives the `env` reward).
//!
//! The table is harness's [`McpEnvironment`] (its keys, defaults and value checks are
//! declared there, and it builds the environment); this module adds what is about this
//! binary's file and run: a program next to the config file, messages that say where, and
//! the `env` reward.
//!
//! A stdio server is the user's own program, so it runs unsandboxed unless the table asks
//! (`sandbox = "bwrap"`: then as the `[[tools]]` run, the run's files hidden); either way it
//! never sees the control endpoint's token.

use std::path::Path;

use harness::mcp::McpEnvironment;
use process::Sandbox;
use scoring::Reward;

/// Checks the `[environment]` table (at `place`, `FILE:LINE: environment`, for messages): its
/// values ([`McpEnvironment::validate`]), a stdio server's program found (a relative path, and
/// arguments naming files next to the config file, made paths from `base`), its sandbox
/// available here.
pub(crate) fn check(
    environment: &mut McpEnvironment,
    base: &Path,
    place: &str,
) -> anyhow::Result<()> {
    environment
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.within(place)))?;
    if let Some(argv) = &mut environment.command {
        super::programs::resolve_command(base, argv, &format!("{place}.command"))?;
    }
    environment
        .sandbox_in(&Sandbox::default())
        .check()
        .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
    Ok(())
}

/// The `env` reward column, weighted.
pub(crate) fn reward(environment: &McpEnvironment) -> Reward {
    scoring::builtin::environment().weight(environment.weight)
}
