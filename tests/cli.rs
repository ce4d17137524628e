//! The command line: help and version.

use std::process::Command;

fn async_grpo(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(args)
        .output()
        .expect("the binary starts");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn version_prints_the_package_version() {
    let (ok, stdout) = async_grpo(&["--version"]);
    assert!(ok);
    assert_eq!(
        stdout.trim(),
        format!("async-grpo {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_says_what_the_engine_is() {
    let (ok, stdout) = async_grpo(&["--help"]);
    assert!(ok);
    assert!(
        stdout.contains("rollout engine for asynchronous GRPO"),
        "{stdout}"
    );
    assert!(stdout.contains("Usage: async-grpo"), "{stdout}");
}

#[test]
fn an_unknown_flag_is_an_error() {
    let (ok, _) = async_grpo(&["--no-such-flag"]);
    assert!(!ok);
}
