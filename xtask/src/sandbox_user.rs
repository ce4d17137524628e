//! `cargo xtask sandbox-as-user`: the process crate's sandbox tests again as an unprivileged
//! user (`nobody`), where the tests otherwise run as root (CI, most containers). As root the
//! sandbox drops each program to a uid of its own; as any other user it runs the program in a
//! user namespace as that user. The test step covers the first; this, the second.
//!
//! The test binary is built as usual, copied with a home and a scratch folder into a folder of
//! that user's own under `target/`, and run there under `setpriv` with nothing of root's environment: `PATH`
//! is the system's (`/usr/bin:/bin`, Debian's Python), `HOME` that folder's. Not root: the
//! test step ran as this user already, and the task says so and does nothing. Where user
//! namespaces are off, the tests fail with the sandbox's own message, which says what to do.

use std::{os::unix::fs::chown, path::Path, process::Command};

use anyhow::Context;

use crate::run_checked;

/// The user the tests run as: `nobody`, on every Linux.
const USER: u32 = 65534;

pub(crate) fn run() -> anyhow::Result<()> {
    if !test_support::is_root() {
        eprintln!(
            "sandbox-as-user: not root: the test step ran the sandbox's tests as this user already"
        );
        return Ok(());
    }
    // The test step's build (the workspace with every feature), not one of its own.
    let binary = crate::test_binary("async-grpo-process", "tests")?;
    // Not under /tmp, which the sandbox replaces: what it hides there must be its doing.
    let dir = crate::root()
        .join("target")
        .join(format!("sandbox-as-user-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let result = run_in(&dir, &binary);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Copies `binary` into `dir` with a home and a scratch folder, all the user's, and runs it.
fn run_in(dir: &Path, binary: &Path) -> anyhow::Result<()> {
    let (home, scratch) = (dir.join("home"), dir.join("scratch"));
    for folder in [dir, &home, &scratch] {
        std::fs::create_dir_all(folder)
            .with_context(|| format!("could not create {}", folder.display()))?;
    }
    let copy = dir.join("process-tests");
    std::fs::copy(binary, &copy).with_context(|| format!("could not copy {}", binary.display()))?;
    for path in [dir, &home, &scratch, &copy] {
        chown(path, Some(USER), Some(USER))
            .with_context(|| format!("could not give {} to uid {USER}", path.display()))?;
    }
    eprintln!("sandbox-as-user: the process crate's tests as uid {USER}");
    let user = USER.to_string();
    run_checked(
        Command::new("setpriv")
            .arg(format!("--reuid={user}"))
            .arg(format!("--regid={user}"))
            .args(["--clear-groups", "--reset-env", "--", "env"])
            .arg(format!("HOME={}", home.display()))
            .arg("PATH=/usr/bin:/bin")
            .arg(format!("ASYNC_GRPO_TEST_SCRATCH={}", scratch.display()))
            // The tests check that the sandbox hides the runner's variables: one of cargo's.
            .arg("CARGO_PKG_NAME=async-grpo-process")
            .arg(&copy)
            .current_dir(dir),
    )
}
