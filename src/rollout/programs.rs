//! Programs a settings file names (tools, rewards, the agent, the environment's server):
//! where they are, relative to the file, and whether they are there.

use std::path::Path;

use anyhow::bail;

/// Checks a command line of the file (at `place`, for messages): not empty, its program found
/// (a relative path with a folder is from `base`, the config file's folder), and each
/// argument naming a file next to the config file made a path from `base`.
pub(crate) fn resolve_command(base: &Path, argv: &mut [String], place: &str) -> anyhow::Result<()> {
    let Some((program, args)) = argv.split_first_mut() else {
        bail!("{place}: empty; expected the program and its arguments");
    };
    *program = program_path(base, program);
    check_program(program).map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
    for arg in args {
        let beside = base.join(&*arg);
        if Path::new(arg.as_str()).is_relative() && !arg.contains('{') && beside.is_file() {
            *arg = beside.display().to_string();
        }
    }
    Ok(())
}

/// A program named by a relative path with a directory part (`./score.py`, `bin/x`) is
/// relative to `base`; a bare name is looked up on PATH as usual.
pub(crate) fn program_path(base: &Path, program: &str) -> String {
    let path = Path::new(program);
    if path.is_relative() && path.components().count() > 1 {
        base.join(path).display().to_string()
    } else {
        program.to_owned()
    }
}

/// Checks that `program` can be started: a path to a file, or a name found on PATH.
pub(crate) fn check_program(program: &str) -> anyhow::Result<()> {
    let path = Path::new(program);
    let found = if path.components().count() > 1 {
        path.is_file()
    } else {
        std::env::var_os("PATH")
            .is_some_and(|dirs| std::env::split_paths(&dirs).any(|dir| dir.join(path).is_file()))
    };
    if !found {
        bail!(
            "program '{program}' not found: {}",
            if path.components().count() > 1 {
                "no such file"
            } else {
                "not on PATH"
            }
        );
    }
    Ok(())
}
