//! `cargo xtask tidy`: repository rules that no compiler checks, also run as a test.
//!
//! - every `.rs` file starts with a `//!` line saying what it holds;
//! - no test is ignored or expected to panic (assert on the `Err` instead);
//! - every crate takes the workspace lints;
//! - in the `src/` of the crate loom checks (`loom::FOLDER`, tool-dispatch), only `sync.rs`
//!   names `std::sync` (the others import from it, so that loom's types can be swapped in);
//!   crates loom does not check use `std::sync` directly.

use std::path::{Path, PathBuf};

use anyhow::bail;

use crate::{loom, root};

// Spelled in pieces so that this file does not trip its own rule.
const IGNORE: &str = concat!("#[", "ignore");
const SHOULD_PANIC: &str = concat!("#[", "should_panic");
const STD_SYNC: &str = concat!("std::", "sync");

/// Whether a line names `std::sync`, directly or inside a `std::{...}` import (a single-line
/// one; rustfmt puts a long import on several lines, whose `sync::` line begins with `sync`).
fn names_std_sync(line: &str) -> bool {
    let words = |text: &str| {
        text.split(|c: char| !c.is_alphanumeric() && c != '_')
            .any(|word| word == "sync")
    };
    line.contains(STD_SYNC) || (line.contains("std::{") && words(line))
}

pub(crate) fn run() -> anyhow::Result<()> {
    let problems = check(&root())?;
    if !problems.is_empty() {
        bail!(
            "{} tidy problem(s):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    eprintln!("tidy: ok");
    Ok(())
}

/// Every rule broken under `root`, one line each, naming the file (and line).
fn check(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    let mut files = Vec::new();
    collect(root, &mut files)?;
    files.sort();
    for path in &files {
        // Only Rust and Cargo files have rules; others (a built Python module, bytecode) may
        // not even be text.
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("rs" | "toml")
        ) {
            continue;
        }
        let text = std::fs::read_to_string(path)?;
        let shown = path.strip_prefix(root).unwrap_or(path).display();
        match path.extension().and_then(|e| e.to_str()) {
            Some("rs") => {
                let first = text
                    .lines()
                    .find(|line| !line.trim().is_empty())
                    .unwrap_or("");
                if !first.starts_with("//!") {
                    problems.push(format!(
                        "{shown}:1: must start with a `//!` line saying what the file holds"
                    ));
                }
                let in_loom_checked_src = shown
                    .to_string()
                    .starts_with(&format!("crates/{}/src/", loom::FOLDER));
                let is_sync_module = path.file_name().is_some_and(|n| n == "sync.rs");
                // Inside a `use std::{` that rustfmt spread over several lines.
                let mut in_std_use = false;
                for (number, line) in text.lines().enumerate() {
                    let code = line.trim_start();
                    let std_sync = names_std_sync(line) || (in_std_use && code.starts_with("sync"));
                    if code.starts_with("use std::{") && !code.contains('}') {
                        in_std_use = true;
                    } else if in_std_use && code.starts_with("};") {
                        in_std_use = false;
                    }
                    if in_loom_checked_src && !is_sync_module && !code.starts_with("//") && std_sync
                    {
                        problems.push(format!(
                            "{shown}:{}: only the crate's sync.rs names `{STD_SYNC}` (loom checks this crate); import from `crate::sync`",
                            number + 1
                        ));
                    }
                    for banned in [IGNORE, SHOULD_PANIC] {
                        if line.contains(banned) {
                            problems.push(format!(
                                "{shown}:{}: `{banned}]` is not allowed: a test runs and asserts on the `Err`",
                                number + 1
                            ));
                        }
                    }
                }
            }
            Some("toml")
                if path.file_name().is_some_and(|n| n == "Cargo.toml")
                    && path.parent() != Some(root)
                    && !text.contains("[lints]\nworkspace = true") =>
            {
                problems.push(format!(
                    "{shown}: must take the workspace lints (`[lints]` `workspace = true`)"
                ));
            }
            _ => {}
        }
    }
    Ok(problems)
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') || name == "target" {
            continue;
        }
        if entry.file_type()?.is_dir() {
            collect(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_is_tidy() {
        let problems = check(&root()).expect("the repository is readable");
        assert!(
            problems.is_empty(),
            "tidy problems:\n{}",
            problems.join("\n")
        );
    }

    #[test]
    fn tidy_catches_a_missing_doc_line_and_a_banned_attribute() {
        let dir = std::env::temp_dir().join(format!("xtask-tidy-{}", std::process::id()));
        let loom_checked = format!("crates/{}/src", loom::FOLDER);
        std::fs::create_dir_all(dir.join("src")).expect("temp dir");
        std::fs::create_dir_all(dir.join("crates/c/src")).expect("temp dir");
        std::fs::create_dir_all(dir.join(&loom_checked)).expect("temp dir");
        std::fs::write(dir.join("src/bad.rs"), format!("fn f() {{}}\n{IGNORE}]\n")).expect("write");
        let names_std_sync = format!(
            "//! c\nuse {STD_SYNC}::Arc;\nuse std::{{fmt, sync::Mutex}};\nuse std::{{\n    fmt,\n    sync::Arc,\n}};\n"
        );
        // A crate loom does not check may name std::sync anywhere; the one it checks may not,
        // but in its sync.rs.
        std::fs::write(dir.join("crates/c/src/lib.rs"), &names_std_sync).expect("write");
        std::fs::write(dir.join(&loom_checked).join("lib.rs"), &names_std_sync).expect("write");
        std::fs::write(
            dir.join(&loom_checked).join("sync.rs"),
            format!("//! s\npub use {STD_SYNC}::Arc;\n"),
        )
        .expect("write");
        let problems = check(&dir).expect("readable");
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert_eq!(problems.len(), 5, "{problems:?}");
        assert!(problems[0].starts_with(&format!(
            "{loom_checked}/lib.rs:2: only the crate's sync.rs names `{STD_SYNC}`"
        )));
        assert!(problems[1].starts_with(&format!(
            "{loom_checked}/lib.rs:3: only the crate's sync.rs"
        )));
        assert!(problems[2].starts_with(&format!(
            "{loom_checked}/lib.rs:6: only the crate's sync.rs"
        )));
        assert!(problems[3].starts_with("src/bad.rs:1: must start with a `//!` line"));
        assert!(problems[4].starts_with(&format!("src/bad.rs:2: `{IGNORE}]` is not allowed")));
    }
}
