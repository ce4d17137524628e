//! The `[agent]` table of `async-grpo rollout`: every rollout is run by a loop-owning agent
//! program (a coding agent) against the recording proxy, and judged by a verify command (or
//! by an `[environment]`'s verify, its session opened for each rollout).
//!
//! The table is harness's [`ProgramConfig`] (its keys, defaults and value checks are
//! declared there); this module adds what is about this binary's file and run: programs
//! next to the config file, messages that say where, the sandbox every program of the run
//! starts from, the forwarder, and the `env` reward.
//!
//! The agent, setup and verify run sandboxed by default (see `process::Sandbox`): a PID
//! namespace each, the environment cleared to what `env` gives plus the proxy's URL and key,
//! the file system read-only but their own directory and a private `/tmp`, the run's dataset,
//! output and configuration and the other rollouts' directories hidden. verify gets the
//! dataset row as JSON on its stdin, so the answer never needs to enter the agent's directory
//! or arguments.

use std::path::Path;

use harness::agent::ProgramConfig;
use process::Sandbox;
use scoring::Reward;

/// Checks the `[agent]` table (at `place`, `FILE:LINE: agent`, for messages): its values
/// ([`ProgramConfig::validate`]), its programs found (those named by a path next to the config
/// file, and arguments naming files there, made paths from `base`), its sandbox available
/// here. Without the host's network, the agent reaches its proxy through this binary's
/// `agent-forward`, which becomes its forwarder.
pub(crate) fn check(config: &mut ProgramConfig, base: &Path, place: &str) -> anyhow::Result<()> {
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.within(place)))?;
    for (key, argv) in config.command_lines_mut() {
        super::programs::resolve_command(base, argv, &format!("{place}.{key}"))?;
    }
    config
        .sandbox_in(&Sandbox::default())
        .check()
        .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
    let this = std::env::current_exe().map_err(|e| {
        anyhow::anyhow!("cannot find this program to forward agents' requests: {e}")
    })?;
    config.forwarder = Some(vec![
        this.to_string_lossy().into_owned(),
        "agent-forward".to_owned(),
    ]);
    Ok(())
}

/// The `env` column (verify's reward), weighted, when a verify command gives one.
pub(crate) fn reward(config: &ProgramConfig) -> Option<Reward> {
    config
        .verifies()
        .then(|| scoring::builtin::environment().weight(config.weight))
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
