//! `cargo xtask features`: every package of the workspace with no default features, and with
//! each of its features alone, type-checks without an error or a warning.
//!
//! The packages and their features come from `cargo metadata`, so a feature added later is
//! checked without touching this file. For each package (xtask aside) and each combination
//! (`--no-default-features`, then `--no-default-features --features F` for every F),
//! `cargo check --all-targets`: the library, binaries, tests, benchmarks and examples that the
//! combination enables (`required-features` decides) compile without an error or a warning in
//! the workspace's crates, so a feature that uses an item of another without enabling it, or
//! a gate that leaves an import unused, fails here. (The lints of clippy run once, with every
//! feature, in the clippy step.)
//!
//! It checks; it does not build or run. A combination's code is the all-features code less
//! what its gates leave out: no test is gated on a feature being off (`cfg(not(feature))`
//! gates only the errors a build without the feature gives), so running the unit tests
//! again per combination would run the same tests on the same code. The whole suites run
//! once, with every feature, in `cargo xtask ci`'s test and doc-test steps. Checking shares
//! the clippy step's dependency metadata (clippy checks dependencies with plain rustc), and
//! takes minutes where building and testing each combination took a quarter of an hour.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::{cargo, describe, root};

/// A package and the features it declares (`default` left out).
struct Package {
    name: String,
    features: Vec<String>,
}

/// The workspace's packages, xtask aside, in the order `cargo metadata` lists them.
fn packages() -> anyhow::Result<Vec<Package>> {
    let output = cargo(&["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .context("could not run cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let metadata: Value =
        serde_json::from_slice(&output.stdout).context("cargo metadata's output is not JSON")?;
    let mut packages = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let name = package["name"].as_str().unwrap_or_default().to_owned();
        if name == "xtask" || name.is_empty() {
            continue;
        }
        let features: BTreeMap<String, Value> = package["features"]
            .as_object()
            .map(|map| map.clone().into_iter().collect())
            .unwrap_or_default();
        packages.push(Package {
            name,
            features: features
                .into_keys()
                .filter(|feature| feature != "default")
                .collect(),
        });
    }
    Ok(packages)
}

/// Runs a check (`command`, a cargo command that compiles) with JSON messages, prints the
/// workspace's own diagnostics, and fails on an error or on any warning in a workspace crate:
/// a combination that leaves an import or a function unused is a feature gated wrongly.
/// Dependencies' warnings are not ours and are not shown; cargo replays the warnings of
/// crates already built, so a second run finds them too.
fn check_without_warnings(command: &mut Command) -> anyhow::Result<()> {
    command.arg("--message-format=json");
    command.stdout(Stdio::piped());
    let workspace = format!("path+file://{}", root().display());
    let mut child = command
        .spawn()
        .with_context(|| format!("could not start {}", describe(command)))?;
    let mut warnings = 0;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.context("could not read cargo's messages")?;
            let Ok(message) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            let ours = message["package_id"]
                .as_str()
                .is_some_and(|id| id.starts_with(&workspace));
            if message["reason"] != "compiler-message" || !ours {
                continue;
            }
            if message["message"]["level"] == "warning" {
                warnings += 1;
            }
            if let Some(rendered) = message["message"]["rendered"].as_str() {
                eprint!("{rendered}");
            }
        }
    }
    let status = child.wait().context("cargo was lost")?;
    if !status.success() {
        bail!("the build failed ({status})");
    }
    if warnings > 0 {
        bail!("the build has {warnings} warning(s) in the workspace's crates");
    }
    Ok(())
}

pub(crate) fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let packages = packages()?;
    let mut combinations = 0;
    for package in &packages {
        let alone = std::iter::once(None).chain(package.features.iter().map(Some));
        for feature in alone {
            let combination_started = Instant::now();
            let mut features = vec!["--package", &package.name, "--no-default-features"];
            if let Some(feature) = feature {
                features.extend(["--features", feature]);
            }
            let label = format!(
                "{} {}",
                package.name,
                feature.map_or("(no features)".to_owned(), |f| format!("+{f}"))
            );
            let mut command = cargo(&[&["check", "--all-targets"], features.as_slice()].concat());
            check_without_warnings(&mut command)
                .with_context(|| format!("{label}: `{}` failed", describe(&command)))?;
            combinations += 1;
            eprintln!(
                "features: {label} ok ({:.1?})",
                combination_started.elapsed()
            );
        }
    }
    eprintln!(
        "features: {combinations} combinations of {} packages checked in {:.1?}",
        packages.len(),
        started.elapsed()
    );
    Ok(())
}
