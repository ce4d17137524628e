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
