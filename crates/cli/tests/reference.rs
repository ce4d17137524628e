//! `docs/reference/settings.md` is what the binary's declarations say now: written by
//! `async-grpo reference` (`cargo xtask docs`), so that no flag's help drifts from it.

use std::process::Command;

/// The committed reference.
fn committed() -> std::path::PathBuf {
    super::repository().join("docs/reference/settings.md")
}

fn generated() -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .arg("reference")
        .output()
        .expect("the binary starts");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).expect("UTF-8")
}

#[test]
fn the_committed_settings_reference_is_the_binarys() {
    let generated = generated();
    let committed = std::fs::read_to_string(committed()).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/reference/settings.md is stale (a flag's declaration changed): run `cargo xtask \
         docs` and commit it"
    );
}

#[test]
fn the_reference_lists_every_flag_of_every_subcommand_with_its_help() {
    let generated = generated();
    for subcommand in ["rollout", "render", "simulate"] {
        let help = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
            .args([subcommand, "--help"])
            .output()
            .expect("the binary starts");
        let help = String::from_utf8_lossy(&help.stdout);
        let section = generated
            .split(&format!("## `async-grpo {subcommand}`"))
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .unwrap_or_else(|| panic!("no section for {subcommand}"));
        for flag in help
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix("--"))
            .filter_map(|rest| rest.split([' ', ',']).next())
            .filter(|flag| *flag != "help")
        {
            assert!(
                section.contains(&format!("| `--{flag}` |")),
                "{subcommand} --{flag} is not in the reference"
            );
        }
    }
    // A key of the file is named as its field, which is not always the flag's name.
    assert!(
        generated.contains("| `--server` | `servers` |"),
        "{generated}"
    );
}

/// The section of `reference` under `heading`, up to the next heading of its level or above.
fn section<'a>(reference: &'a str, heading: &str) -> &'a str {
    let level = heading.split(' ').next().unwrap_or("#");
    let start = reference
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no section {heading}"));
    let rest = &reference[start + heading.len() + 2..];
    let end = rest
        .match_indices("\n#")
        .find(|(at, _)| {
            let hashes = rest[at + 1..].chars().take_while(|c| *c == '#').count();
            hashes <= level.len()
        })
        .map_or(rest.len(), |(at, _)| at);
    &rest[..end]
}

/// Whether `section` lists `key`: a row of its own, or the sandbox keys' row.
fn lists(section: &str, key: &str) -> bool {
    section.lines().any(|line| {
        line.starts_with(&format!("| `{key}` |"))
            || (line.starts_with("| `sandbox`, ") && line.contains(&format!("`{key}`")))
    })
}

#[test]
fn the_reference_lists_every_key_each_kind_of_tool_and_reward_reads() {
    use settings::Kinds;
    let generated = generated();
    for (table, names, fields) in [
        (
            "[[tools]]",
            tool_dispatch::builtin::ToolKind::NAMES,
            tool_dispatch::builtin::ToolKind::fields_of as fn(&str) -> Option<Vec<&'static str>>,
        ),
        (
            "[[rewards]]",
            scoring::RewardKind::NAMES,
            scoring::RewardKind::fields_of,
        ),
    ] {
        let tables = section(&generated, &format!("### `{table}`"));
        for kind in names {
            let own = section(tables, &format!("#### `kind = \"{kind}\"`"));
            for key in fields(kind).expect("a kind") {
                assert!(
                    lists(own, key),
                    "{table} kind {kind}: `{key}` is read but not in the reference:\n{own}"
                );
            }
            // And nothing the kind does not read.
            for line in own.lines().filter(|line| line.starts_with("| `")) {
                let key = line.split('`').nth(1).unwrap_or_default();
                assert!(
                    fields(kind).expect("a kind").contains(&key),
                    "{table} kind {kind}: the reference lists `{key}`, which it does not read"
                );
            }
        }
    }
    // The sandbox keys' own section, with the limits' keys and their defaults.
    let sandbox = section(&generated, "### Sandbox keys");
    for key in process::SandboxKeys::KEYS {
        assert!(lists(sandbox, key), "`{key}` is not in the sandbox keys");
    }
    let defaults = process::Limits::default();
    assert!(
        sandbox.contains(&format!(
            "| `memory_mib` | integer | `{}` |",
            defaults.memory_mib
        )),
        "{sandbox}"
    );
}
