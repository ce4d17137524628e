//! `async-grpo rollout`'s settings: a TOML file and flags, resolved (read back from the TOML
//! `--check` prints), and what `--check` refuses before any output is touched.

use std::{path::Path, process::Command};

use test_support::ScratchDir;

/// A fresh directory with a dataset and a tokenizer folder (the quickstart's files).
fn workspace(name: &str) -> ScratchDir {
    let dir = ScratchDir::new(&format!("async-grpo-config-{name}"));
    std::fs::create_dir_all(dir.join("data/tok")).expect("temp dir");
    std::fs::write(
        dir.join("data/rows.jsonl"),
        "{\"prompt\": \"What is 2 + 3?\", \"answer\": \"5\"}\n",
    )
    .expect("write");
    let quickstart = crate::repository().join("examples/quickstart");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(quickstart.join(file), dir.join("data/tok").join(file)).expect("copy");
    }
    dir
}

/// Runs `async-grpo rollout --check ARGS` in `dir`: the settings it prints when they
/// resolve, else its stderr.
fn rollout(dir: &Path, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .arg("rollout")
        .arg("--check")
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary starts");
    if output.status.success() {
        String::from_utf8_lossy(&output.stdout).into_owned()
    } else {
        String::from_utf8_lossy(&output.stderr).into_owned()
    }
}

/// The settings printed, when they resolved, as TOML.
fn resolved(output: &str) -> toml::Table {
    output
        .parse()
        .unwrap_or_else(|e| panic!("not resolved settings ({e}): {output}"))
}

/// `settings[key]` as TOML writes it (`4`, `"rloo"`, `0.7`).
fn value(settings: &toml::Table, key: &str) -> String {
    settings
        .get(key)
        .map_or_else(|| format!("no {key}"), ToString::to_string)
}

/// A TOML string of `path`.
fn quoted(path: &Path) -> String {
    toml::Value::String(path.display().to_string()).to_string()
}

const CONFIG: &str = r#"
# a comment
dataset = "data/rows.jsonl"
tokenizer = "data/tok"
num_generations = 4
temperature = 0.7
estimator = "rloo"
drain_timeout = "5s"

[[rewards]]
spec = "numeric:answer"

[[rewards]]
kind = "length"
max = 100
weight = 0.5

[[tools]]
name = "calculator"
kind = "calculator"

[simulator]
tool_rounds = 1
correct_rate = 0.25
latency = "2ms"
"#;

#[test]
fn file_values_are_read_and_paths_resolve_against_the_file_s_directory() {
    let dir = workspace("paths");
    std::fs::create_dir_all(dir.join("elsewhere")).expect("dir");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    // Run from another directory: the file's paths still point next to the file.
    let output = rollout(&dir.join("elsewhere"), &["--config", "../run.toml"]);
    let settings = resolved(&output);
    let data = dir.join("data");
    assert_eq!(
        value(&settings, "dataset"),
        quoted(&data.join("rows.jsonl"))
    );
    assert_eq!(value(&settings, "tokenizer"), quoted(&data.join("tok")));
    assert_eq!(
        value(&settings, "out"),
        quoted(&dir.join("elsewhere/rollouts.jsonl")),
        "the default output is in the current directory"
    );
    for (key, expected) in [
        ("num_generations", "4"),
        ("temperature", "0.7"),
        ("estimator", "\"rloo\""),
        ("drain_timeout", "\"5s\""),
        ("max_inflight", "64"),
        ("max_turns", "8"),
        ("max_tokens", "512"),
        ("server_wait", "\"10m\""),
        ("max_failure_rate", "0.5"),
    ] {
        assert_eq!(value(&settings, key), expected, "{key} in {output}");
    }
    for expected in [
        "spec = \"numeric:answer\"",
        "kind = \"length\"\nmax = 100\nweight = 0.5",
        "name = \"calculator\"\nkind = \"calculator\"",
        "tool_rounds = 1\nanswer_tokens = 32\ncorrect_rate = 0.25\nlatency = \"2ms\"",
    ] {
        assert!(output.contains(expected), "{expected} in {output}");
    }
}

#[test]
fn what_check_prints_is_a_config_file_that_resolves_to_the_same_settings() {
    let dir = workspace("roundtrip");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    let first = rollout(&dir, &["--config", "run.toml", "--seed", "7"]);
    resolved(&first);
    std::fs::create_dir_all(dir.join("other")).expect("dir");
    std::fs::write(dir.join("other/printed.toml"), &first).expect("write");
    // Read back from elsewhere: every path in it is absolute.
    let second = rollout(&dir.join("other"), &["--config", "printed.toml"]);
    assert_eq!(second, first);
}

#[test]
fn flags_override_the_file_and_their_paths_the_current_directory() {
    let dir = workspace("flags");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    std::fs::write(
        dir.join("other.jsonl"),
        "{\"prompt\": \"hi\", \"answer\": \"1\"}\n",
    )
    .expect("write");
    let output = rollout(
        &dir,
        &[
            "--config",
            "run.toml",
            "--num-generations",
            "6",
            "--dataset",
            "other.jsonl",
            "--temperature",
            "0.2",
            "--estimator",
            "dr_grpo",
            "--reward",
            "exact:answer@2",
            "--drain-timeout",
            "1m",
            "--out",
            "out/rows.jsonl",
        ],
    );
    let settings = resolved(&output);
    for (key, expected) in [
        ("num_generations", "6".to_owned()),
        ("dataset", quoted(&dir.join("other.jsonl"))),
        ("out", quoted(&dir.join("out/rows.jsonl"))),
        ("temperature", "0.2".to_owned()),
        ("estimator", "\"dr_grpo\"".to_owned()),
        ("drain_timeout", "\"1m\"".to_owned()),
    ] {
        assert_eq!(value(&settings, key), expected, "{key} in {output}");
    }
    // --reward replaces the file's rewards.
    assert!(output.contains("spec = \"exact:answer@2\""), "{output}");
    assert!(!output.contains("numeric:answer"), "{output}");
}

#[test]
fn the_prompt_mode_is_append_unless_the_file_or_a_flag_says_rerender() {
    let dir = workspace("prompt-mode");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    let settings = rollout(&dir, &["--config", "run.toml"]);
    assert!(
        value(&resolved(&settings), "prompt_mode") == "\"append\"",
        "{settings}"
    );
    let rerender = format!("prompt_mode = \"rerender\"\n{CONFIG}");
    std::fs::write(dir.join("rerender.toml"), rerender).expect("write");
    let settings = rollout(&dir, &["--config", "rerender.toml"]);
    assert!(
        value(&resolved(&settings), "prompt_mode") == "\"rerender\"",
        "{settings}"
    );
    let settings = rollout(
        &dir,
        &["--config", "rerender.toml", "--prompt-mode", "append"],
    );
    assert!(
        value(&resolved(&settings), "prompt_mode") == "\"append\"",
        "{settings}"
    );
    let stderr = rollout(
        &dir,
        &["--config", "run.toml", "--prompt-mode", "retokenize"],
    );
    assert!(
        stderr.contains("invalid value 'retokenize' for '--prompt-mode <MODE>'")
            && stderr.contains("[possible values: append, rerender]"),
        "{stderr}"
    );
    std::fs::write(
        dir.join("bad.toml"),
        format!("prompt_mode = \"both\"\n{CONFIG}"),
    )
    .expect("write");
    let stderr = rollout(&dir, &["--config", "bad.toml"]);
    assert!(
        stderr.contains("bad.toml:1:") && stderr.contains("expected `append` or `rerender`"),
        "{stderr}"
    );
}

#[test]
fn an_unknown_key_is_named_with_the_file_and_its_line() {
    let dir = workspace("unknown");
    let config = CONFIG.replace("[simulator]\n", "[simulator]\ntool_round = 2\n");
    std::fs::write(dir.join("run.toml"), &config).expect("write");
    let stderr = rollout(&dir, &["--config", "run.toml"]);
    let line = config
        .lines()
        .position(|l| l.starts_with("tool_round "))
        .expect("the line")
        + 1;
    let place = format!("{}:{line}:", dir.join("run.toml").display());
    assert!(stderr.contains(&place), "{place} in {stderr}");
    assert!(stderr.contains("unknown field `tool_round`"), "{stderr}");

    std::fs::write(dir.join("top.toml"), format!("datset = \"x\"\n{CONFIG}")).expect("write");
    let stderr = rollout(&dir, &["--config", "top.toml"]);
    assert!(stderr.contains("top.toml:1:"), "{stderr}");
    assert!(stderr.contains("unknown field `datset`"), "{stderr}");
}

#[test]
fn a_bad_reward_spec_is_an_error_naming_it() {
    let dir = workspace("reward");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    let stderr = rollout(
        &dir,
        &["--config", "run.toml", "--reward", "numerik:answer"],
    );
    assert!(
        stderr.contains("--reward: invalid reward spec \"numerik:answer\""),
        "{stderr}"
    );
    assert!(stderr.contains("unknown kind 'numerik'"), "{stderr}");

    let config = CONFIG.replace("spec = \"numeric:answer\"", "spec = \"regex:(\"");
    std::fs::write(dir.join("bad.toml"), &config).expect("write");
    let stderr = rollout(&dir, &["--config", "bad.toml"]);
    let line = config
        .lines()
        .position(|l| l == "[[rewards]]")
        .expect("line")
        + 1;
    assert!(
        stderr.contains(&format!("bad.toml:{line}: rewards[0]: invalid reward spec")),
        "{stderr}"
    );
}

#[test]
fn a_bad_estimator_is_an_error_listing_the_known_ones() {
    let dir = workspace("estimator");
    std::fs::write(dir.join("run.toml"), CONFIG).expect("write");
    let stderr = rollout(&dir, &["--config", "run.toml", "--estimator", "ppo"]);
    assert!(
        stderr.contains(
            "--estimator: unknown estimator 'ppo'; expected one of trl, grpo, dr_grpo, rloo, batch"
        ),
        "{stderr}"
    );
}

#[test]
fn a_missing_dataset_says_which_flag_or_key_to_set() {
    let dir = workspace("dataset");
    std::fs::write(
        dir.join("run.toml"),
        CONFIG.replace("dataset = \"data/rows.jsonl\"\n", ""),
    )
    .expect("write");
    let stderr = rollout(&dir, &["--config", "run.toml"]);
    assert!(
        stderr.contains("no dataset: set --dataset FILE.jsonl or `dataset = "),
        "{stderr}"
    );
    assert!(stderr.contains("run.toml"), "{stderr}");
}

#[test]
fn no_reward_is_an_error_saying_how_to_add_one() {
    let dir = workspace("norewards");
    let stderr = rollout(
        &dir,
        &[
            "--dataset",
            "data/rows.jsonl",
            "--tokenizer",
            "data/tok/tokenizer.json",
        ],
    );
    assert!(stderr.contains("no reward function"), "{stderr}");
    assert!(stderr.contains("--reward numeric:answer"), "{stderr}");
}

#[test]
fn the_quickstart_config_resolves() {
    let root = crate::repository();
    let output = rollout(&root, &["--config", "examples/quickstart.toml"]);
    let settings = resolved(&output);
    assert_eq!(value(&settings, "servers"), "[]");
    assert_eq!(value(&settings, "num_generations"), "8");
    assert!(output.contains("tool_rounds = 1"), "{output}");
}

#[test]
fn a_flag_not_given_leaves_the_file_s_value_switches_included() {
    let dir = workspace("layers");
    let file = format!(
        "skip_bad_rows = true\nmax_inflight = 5\nrollout_timeout = \"90s\"\ntop_k = 7\n{CONFIG}"
    );
    std::fs::write(dir.join("run.toml"), file).expect("write");
    // Other flags given: none of these four is, so the file's values stand.
    let output = rollout(
        &dir,
        &[
            "--config",
            "run.toml",
            "--num-generations",
            "2",
            "--overwrite",
        ],
    );
    let settings = resolved(&output);
    for (key, expected) in [
        ("skip_bad_rows", "true"),
        ("max_inflight", "5"),
        ("rollout_timeout", "\"1m 30s\""),
        ("top_k", "7"),
        ("num_generations", "2"),
        ("overwrite", "true"),
    ] {
        assert_eq!(value(&settings, key), expected, "{key} in {output}");
    }
    // A switch given on the command line is on whatever the file says.
    std::fs::write(
        dir.join("off.toml"),
        format!("skip_bad_rows = false\n{CONFIG}"),
    )
    .expect("write");
    let output = rollout(&dir, &["--config", "off.toml", "--skip-bad-rows"]);
    assert_eq!(
        value(&resolved(&output), "skip_bad_rows"),
        "true",
        "{output}"
    );
}

const ENVIRONMENT: &str = r#"
dataset = "data/rows.jsonl"
tokenizer = "data/tok"

[environment]
kind = "mcp"
command = ["sh", "server.sh"]
timeout = "5s"
weight = 2.0
"#;

#[test]
fn an_environment_resolves_its_files_beside_the_config_and_needs_no_other_reward() {
    let dir = workspace("environment");
    std::fs::write(dir.join("server.sh"), "exit 0\n").expect("write");
    std::fs::write(dir.join("run.toml"), ENVIRONMENT).expect("write");
    let first = rollout(&dir, &["--config", "run.toml"]);
    let settings = resolved(&first);
    let environment = settings["environment"]
        .as_table()
        .expect("an environment table");
    assert_eq!(
        environment["command"].to_string(),
        format!("[\"sh\", {}]", quoted(&dir.join("server.sh")))
    );
    assert_eq!(environment["verify_tool"].to_string(), "\"verify\"");
    assert_eq!(environment["weight"].to_string(), "2.0");
    // What --check prints resolves to the same settings, from elsewhere too.
    std::fs::create_dir_all(dir.join("other")).expect("dir");
    std::fs::write(dir.join("other/printed.toml"), &first).expect("write");
    assert_eq!(
        rollout(&dir.join("other"), &["--config", "printed.toml"]),
        first
    );
}

#[test]
fn a_bad_environment_table_says_what_is_wrong_and_where() {
    let dir = workspace("bad-environment");
    let cases = [
        (
            "kind = \"mcp\"",
            "kind = \"gym\"",
            "unknown variant `gym`, expected `mcp`",
        ),
        (
            "timeout = \"5s\"",
            "url = \"http://127.0.0.1:9/mcp\"",
            "give command (a stdio server) or url (streamable HTTP), not both",
        ),
        (
            "command = [\"sh\", \"server.sh\"]",
            "command = []",
            "environment.command: empty; expected the program and its arguments",
        ),
        (
            "command = [\"sh\", \"server.sh\"]",
            "command = [\"no-such-program-here\"]",
            "environment.command: program 'no-such-program-here' not found",
        ),
        (
            "timeout = \"5s\"",
            "timeout = \"5\"",
            "\"5\", expected a duration",
        ),
        ("weight = 2.0", "wieght = 2.0", "unknown field `wieght`"),
        (
            "[environment]",
            "[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n\n[environment]",
            "[[tools]] and [environment] together in",
        ),
    ];
    assert_each_refused(&dir, ENVIRONMENT, &cases);
}

/// Each `(from, to, expected)`: `config` with `from` replaced by `to` is refused with a
/// message holding `expected` and naming the file.
fn assert_each_refused(dir: &Path, config: &str, cases: &[(&str, &str, &str)]) {
    for (from, to, expected) in cases {
        let config = config.replace(from, to);
        std::fs::write(dir.join("run.toml"), &config).expect("write");
        let stderr = rollout(dir, &["--config", "run.toml"]);
        assert!(
            stderr.contains(expected),
            "{to}: expected {expected:?} in {stderr}"
        );
        assert!(stderr.contains("run.toml"), "{to}: the file in {stderr}");
    }
}

const AGENT: &str = r#"
dataset = "data/rows.jsonl"
tokenizer = "data/tok"

[agent]
command = ["sh", "agent.sh", "{prompt}"]
verify = ["sh", "verify.sh"]
timeout = "5s"
"#;

#[test]
fn an_agent_resolves_its_scripts_beside_the_config() {
    let dir = workspace("agent");
    for script in ["agent.sh", "verify.sh"] {
        std::fs::write(dir.join(script), "exit 0\n").expect("write");
    }
    std::fs::write(dir.join("run.toml"), AGENT).expect("write");
    let printed = rollout(&dir, &["--config", "run.toml"]);
    let settings = resolved(&printed);
    let agent = settings["agent"].as_table().expect("an agent table");
    assert_eq!(
        agent["command"].to_string(),
        format!(
            "[\"sh\", {}, \"{{prompt}}\"]",
            quoted(&dir.join("agent.sh"))
        )
    );
    assert_eq!(agent["timeout"].to_string(), "\"5s\"");
}

#[test]
fn a_bad_agent_table_says_what_is_wrong_and_where() {
    let dir = workspace("bad-agent");
    let cases = [
        (
            "command = [\"sh\", \"agent.sh\", \"{prompt}\"]",
            "command = []",
            "agent.command: empty",
        ),
        (
            "timeout = \"5s\"",
            "timeout = \"0s\"",
            "must be longer than zero",
        ),
        (
            "timeout = \"5s\"",
            "tmeout = \"5s\"",
            "unknown field `tmeout`",
        ),
        (
            "verify = [\"sh\", \"verify.sh\"]\n",
            "",
            "no reward function",
        ),
        (
            "[agent]",
            "[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n\n[agent]",
            "[agent] with [[tools]] in",
        ),
        (
            "[agent]",
            "[environment]\nkind = \"mcp\"\ncommand = [\"sh\", \"server.sh\"]\n\n[agent]",
            "[agent] verify with [environment] in",
        ),
    ];
    assert_each_refused(&dir, AGENT, &cases);
}

#[test]
fn an_unknown_key_in_agent_or_environment_is_named_with_the_file_and_its_line() {
    let dir = workspace("unknown-table-key");
    for script in ["agent.sh", "verify.sh", "server.sh"] {
        std::fs::write(dir.join(script), "exit 0\n").expect("write");
    }
    for (config, after, key) in [
        (AGENT, "timeout = \"5s\"\n", "tmeout"),
        (ENVIRONMENT, "weight = 2.0\n", "wieght"),
    ] {
        let config = config.replace(after, &format!("{after}{key} = 1\n"));
        std::fs::write(dir.join("run.toml"), &config).expect("write");
        let stderr = rollout(&dir, &["--config", "run.toml"]);
        let line = config
            .lines()
            .position(|l| l.starts_with(&format!("{key} ")))
            .expect("the line")
            + 1;
        let place = format!("{}:{line}:", dir.join("run.toml").display());
        assert!(stderr.contains(&place), "{place} in {stderr}");
        assert!(
            stderr.contains(&format!("unknown field `{key}`")),
            "{stderr}"
        );
    }
}

#[test]
fn a_key_of_another_kind_in_a_later_tool_is_named_at_its_own_line() {
    let dir = workspace("misplaced-tool-key");
    // The first tool has a `url` of its own: the line must be the second tool's.
    let config = r#"
dataset = "data/rows.jsonl"
tokenizer = "data/tok"

[[rewards]]
spec = "numeric:answer"

[[tools]]
name = "lookup"
kind = "http"
url = "http://127.0.0.1:9/lookup"

[[tools]]
name = "calc"
kind = "calculator"
url = "http://127.0.0.1:9/calc"
"#;
    std::fs::write(dir.join("run.toml"), config).expect("write");
    let stderr = rollout(&dir, &["--config", "run.toml"]);
    let line = config
        .lines()
        .position(|l| l.contains("/calc"))
        .expect("the line")
        + 1;
    let place = format!("{}:{line}:", dir.join("run.toml").display());
    assert!(stderr.contains(&place), "{place} in {stderr}");
    assert!(
        stderr.contains("tool 'calc': `url` is not a field of kind \"calculator\""),
        "{stderr}"
    );
}

#[test]
fn an_agent_s_setup_is_one_command_or_a_list_and_check_prints_it_as_given() {
    let dir = workspace("agent-setup");
    for script in ["agent.sh", "verify.sh", "setup.sh"] {
        std::fs::write(dir.join(script), "exit 0\n").expect("write");
    }
    let setup = quoted(&dir.join("setup.sh"));
    for (given, printed) in [
        (
            "setup = [\"sh\", \"setup.sh\"]".to_owned(),
            format!("[\"sh\", {setup}]"),
        ),
        (
            "setup = [[\"sh\", \"setup.sh\"], [\"true\"]]".to_owned(),
            format!("[[\"sh\", {setup}], [\"true\"]]"),
        ),
    ] {
        let config = AGENT.replace(
            "timeout = \"5s\"\n",
            &format!("timeout = \"5s\"\n{given}\n"),
        );
        std::fs::write(dir.join("run.toml"), &config).expect("write");
        let first = rollout(&dir, &["--config", "run.toml"]);
        let settings = resolved(&first);
        let agent = settings["agent"].as_table().expect("an agent table");
        assert_eq!(agent["setup"].to_string(), printed, "{given}");
        // The defaults harness declares, written out.
        assert_eq!(agent["command_timeout"].to_string(), "\"2m\"");
        assert_eq!(agent["workdir"].to_string(), "\"fresh\"");
        std::fs::write(dir.join("printed.toml"), &first).expect("write");
        assert_eq!(rollout(&dir, &["--config", "printed.toml"]), first);
    }
    let cases = [
        (
            "timeout = \"5s\"",
            "timeout = \"5s\"\nsetup = [[\"sh\", \"setup.sh\"], []]",
            "agent.setup[1]: empty; expected the program and its arguments",
        ),
        (
            "timeout = \"5s\"",
            "timeout = \"5s\"\nsetup = [\"no-such-program-here\"]",
            "agent.setup: program 'no-such-program-here' not found",
        ),
        (
            "timeout = \"5s\"",
            "timeout = \"5s\"\nsetup = [[\"true\"], \"x\"]",
            "not both",
        ),
    ];
    assert_each_refused(&dir, AGENT, &cases);
}
