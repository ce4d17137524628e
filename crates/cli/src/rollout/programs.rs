//! Programs a settings file names (tools, rewards, the agent, the environment's server):
//! where they are, relative to the file, and whether they are there (`process`'s rules, with
//! the place in the file said).

use std::path::Path;

pub(crate) use process::program_path;

/// Checks a command line of the file (at `place`, for messages): see
/// [`process::resolve_command`].
pub(crate) fn resolve_command(base: &Path, argv: &mut [String], place: &str) -> anyhow::Result<()> {
    process::resolve_command(base, argv).map_err(|e| anyhow::anyhow!("{place}: {e}"))
}

/// Checks that `program` can be started: a path to a file, or a name found on PATH.
pub(crate) fn check_program(program: &str) -> anyhow::Result<()> {
    process::check_program(program).map_err(|e| anyhow::anyhow!(e))
}
