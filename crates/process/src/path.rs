//! Where a configured program is: a command line named in a settings file (or a Python
//! mapping) is read relative to where it was written, not to the directory the program later
//! runs in (an agent's fresh directory, say).

use std::{ffi::OsStr, path::Path};

/// A program named by a relative path with a directory part (`./score.py`, `bin/x`) is
/// relative to `base`; a bare name is looked up on PATH as usual, and an absolute path is
/// kept.
pub fn program_path(base: &Path, program: &str) -> String {
    let path = Path::new(program);
    if path.is_relative() && path.components().count() > 1 {
        base.join(path).display().to_string()
    } else {
        program.to_owned()
    }
}

/// Checks that `program` can be started: a path to a file, or a name found on PATH.
///
/// # Errors
/// What is missing: `program 'X' not found: no such file` (or `not on PATH`).
pub fn check_program(program: &str) -> Result<(), String> {
    if found(program, None, std::env::var_os("PATH").as_deref()) {
        return Ok(());
    }
    let why = if Path::new(program).components().count() > 1 {
        "no such file"
    } else {
        "not on PATH"
    };
    Err(format!("program '{program}' not found: {why}"))
}

/// Whether `program` is there to be started: a file where its path names one (relative to
/// `dir`, when given, if the path is relative), or a name found in one of `path_var`'s
/// directories.
pub(crate) fn found(program: &str, dir: Option<&Path>, path_var: Option<&OsStr>) -> bool {
    let path = Path::new(program);
    if path.components().count() > 1 {
        return dir
            .map_or_else(|| path.to_path_buf(), |dir| dir.join(path))
            .is_file();
    }
    path_var.is_some_and(|dirs| std::env::split_paths(dirs).any(|dir| dir.join(path).is_file()))
}

/// Resolves a command line written at `base`: its program found ([`program_path`],
/// [`check_program`]), and each relative argument naming a file in `base` (`./verify.py`)
/// made a path from `base`, so that it still names that file from another directory. An
/// argument with a placeholder (`{workdir}`) is left as it is.
///
/// # Errors
/// An empty command line, or a program that cannot be found.
pub fn resolve_command(base: &Path, argv: &mut [String]) -> Result<(), String> {
    let Some((program, args)) = argv.split_first_mut() else {
        return Err("empty; expected the program and its arguments".to_owned());
    };
    *program = program_path(base, program);
    check_program(program)?;
    for arg in args {
        let beside = base.join(&*arg);
        if Path::new(arg.as_str()).is_relative() && !arg.contains('{') && beside.is_file() {
            *arg = beside.display().to_string();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn a_command_line_is_read_from_where_it_was_written() {
        let base = std::env::temp_dir().join(format!("process-path-{}", std::process::id()));
        std::fs::create_dir_all(base.join("bin")).expect("a directory");
        std::fs::write(base.join("bin/run"), "").expect("a program");
        std::fs::write(base.join("verify.py"), "").expect("a file");
        let mut line = argv(&["bin/run", "verify.py", "{workdir}/x", "absent.py", "-v"]);
        resolve_command(&base, &mut line).expect("found");
        let expected = [
            base.join("bin/run").display().to_string(),
            base.join("verify.py").display().to_string(),
            "{workdir}/x".to_owned(),
            "absent.py".to_owned(),
            "-v".to_owned(),
        ];
        assert_eq!(line, expected);
        // A bare name is PATH's, and must be on it.
        let mut missing = argv(&["no-such-program-anywhere"]);
        let error = resolve_command(&base, &mut missing).expect_err("not on PATH");
        assert_eq!(
            error,
            "program 'no-such-program-anywhere' not found: not on PATH"
        );
        let mut gone = argv(&["./gone.sh"]);
        let error = resolve_command(&base, &mut gone).expect_err("no such file");
        assert!(
            error.ends_with("gone.sh' not found: no such file"),
            "{error}"
        );
        assert!(resolve_command(&base, &mut []).is_err());
        std::fs::remove_dir_all(&base).expect("removed");
    }
}
