//! `cargo xtask msrv`: the workspace checked with the oldest Rust it claims (`rust-version` in
//! the root `Cargo.toml`), every feature on, with rustup's minimal toolchain of that version
//! (installed on first use) and a target folder of its own (`target/msrv`). Where the
//! toolchain cannot be downloaded, the step says it was skipped and passes.

use anyhow::bail;

use crate::{root, run_checked};

pub(crate) fn run() -> anyhow::Result<()> {
    let version = rust_version()?;
    let installed = std::process::Command::new("rustup")
        .args(["run", &version, "rustc", "--version"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !installed {
        let install = run_checked(
            std::process::Command::new("rustup")
                .args(["toolchain", "install", &version, "--profile", "minimal"])
                .arg("--no-self-update"),
        );
        if let Err(error) = install {
            // Where rustup's server cannot be reached, the check cannot run: said loudly,
            // not failed, so that a machine without that download still runs the rest.
            eprintln!(
                "msrv: SKIPPED: Rust {version} could not be installed ({error:#}); the \
                 workspace was not checked with its rust-version"
            );
            return Ok(());
        }
    }
    run_checked(
        std::process::Command::new("rustup")
            .args([
                "run",
                &version,
                "cargo",
                "check",
                "--workspace",
                "--all-features",
            ])
            .env("CARGO_TARGET_DIR", root().join("target").join("msrv"))
            // Not the running cargo's toolchain: rustup's of `version`.
            .env_remove("RUSTC")
            .env_remove("RUSTDOC")
            .env_remove("CARGO")
            .env_remove("RUSTUP_TOOLCHAIN")
            .current_dir(root()),
    )
}

/// `[workspace.package] rust-version` of the root manifest (`rust-version = "1.88"`).
fn rust_version() -> anyhow::Result<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml"))?;
    let version = manifest
        .split("[workspace.package]")
        .nth(1)
        .and_then(|section| section.split("\n[").next())
        .and_then(|section| {
            section.lines().find_map(|line| {
                let (key, value) = line.split_once('=')?;
                (key.trim() == "rust-version").then(|| value.trim().trim_matches('"').to_owned())
            })
        });
    match version {
        Some(version) if !version.is_empty() => Ok(version),
        _ => bail!("the root Cargo.toml has no [workspace.package] rust-version"),
    }
}
