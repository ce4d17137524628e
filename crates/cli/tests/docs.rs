//! The user guide against the code: every fenced block of README.md and docs/*.md is run,
//! parsed or compared, so that a flag, a key or an API the docs show cannot drift away from
//! what exists.
//!
//! - `toml`: parsed; then, as a config file (a whole one with the quickstart's dataset and
//!   tokenizer where its own are not in the repository, a partial one added to a minimal
//!   config), accepted by `async-grpo rollout --check`;
//! - `sh`/`bash`: `bash -n`; each `async-grpo` command (`cargo run ... -- ARGS` or
//!   `async-grpo ARGS`) names a subcommand and its flags, and a `rollout` one passes
//!   `--check`; `cargo xtask TASK` names a task and flags of xtask's help; `pip install`
//!   names paths, wheels and extras that exist; `cargo nextest --profile P` a profile that
//!   exists;
//! - `python`: parsed by Python's own parser; `json`/`jsonl`: parsed; `yaml`: its
//!   `async-grpo` commands checked as in shell, the whole parsed where PyYAML is installed;
//! - `rust`: the same tokens as one of the snippets compiled (and run) below;
//! - `text`: output, not checked; any other language, or none, fails.
//!
//! Relative links between these files, and their anchors, must resolve too.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use test_support::ScratchDir;

/// xtask's source, whose `HELP` lists the tasks (read at build time, so that a renamed task
/// fails here).
const XTASK_MAIN: &str = include_str!("../../../xtask/src/main.rs");

/// The languages a block may have, and what is done with it.
const LANGUAGES: &[&str] = &[
    "toml", "sh", "bash", "python", "json", "jsonl", "yaml", "rust", "text",
];

/// A fenced block of a document.
#[derive(Debug)]
struct Block {
    /// The document, relative to the repository (`docs/tools.md`).
    file: String,
    /// The line of its opening fence, from 1.
    line: usize,
    /// The first word of the fence's info string (`toml`), empty when none.
    lang: String,
    /// Its lines, the fence's indentation removed.
    text: String,
}

impl Block {
    fn at(&self) -> String {
        format!("{}:{} (```{})", self.file, self.line, self.lang)
    }
}

/// What failed, every block checked before the test fails.
#[derive(Debug, Default)]
struct Failures(Vec<String>);

impl Failures {
    fn add(&mut self, block: &Block, what: impl std::fmt::Display) {
        self.0.push(format!("{}: {what}", block.at()));
    }

    #[track_caller]
    fn assert_none(self, checked: usize) {
        assert!(checked > 0, "no block was checked: the docs were not found");
        assert!(
            self.0.is_empty(),
            "{} failure(s) in the docs:\n\n{}",
            self.0.len(),
            self.0.join("\n\n")
        );
    }
}

/// README.md and every docs/*.md, relative to the repository, with their text.
fn documents() -> Vec<(String, String)> {
    let root = crate::repository();
    let mut names = vec!["README.md".to_string()];
    let mut pages: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is there")
        .map(|entry| entry.expect("a docs/ entry").file_name())
        .filter_map(|name| name.to_str().map(str::to_string))
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    // The generated references: their Python blocks (the stubs' declarations) parse too.
    pages.extend(
        std::fs::read_dir(root.join("docs").join("reference"))
            .expect("docs/reference/ is there")
            .map(|entry| entry.expect("a docs/reference/ entry").file_name())
            .filter_map(|name| name.to_str().map(str::to_string))
            .filter(|name| name.ends_with(".md"))
            .map(|name| format!("docs/reference/{name}")),
    );
    pages.sort();
    names.extend(pages);
    names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(root.join(&name))
                .unwrap_or_else(|e| panic!("cannot read {name}: {e}"));
            (name, text)
        })
        .collect()
}

/// The fenced blocks of `text` (``` or ~~~ fences, indented or not).
fn fenced(file: &str, text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, usize, String, String, Vec<String>)> = None;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut open {
            None => {
                for fence in ["```", "~~~"] {
                    if let Some(info) = trimmed.strip_prefix(fence) {
                        let lang = info
                            .trim_start_matches(fence.chars().next().unwrap_or('`'))
                            .split(|c: char| c.is_whitespace() || c == ',' || c == '{')
                            .next()
                            .unwrap_or_default()
                            .to_string();
                        open = Some((index + 1, indent, fence.to_string(), lang, Vec::new()));
                        break;
                    }
                }
            }
            Some((start, fence_indent, fence, lang, lines)) => {
                if trimmed.starts_with(fence.as_str())
                    && trimmed
                        .trim_start_matches(fence.chars().next().unwrap_or('`'))
                        .trim()
                        .is_empty()
                {
                    blocks.push(Block {
                        file: file.to_string(),
                        line: *start,
                        lang: std::mem::take(lang),
                        text: std::mem::take(lines).join("\n") + "\n",
                    });
                    open = None;
                } else {
                    let strip = indent.min(*fence_indent);
                    lines.push(line.get(strip..).unwrap_or(line).to_string());
                }
            }
        }
    }
    if let Some((start, _, _, lang, _)) = open {
        blocks.push(Block {
            file: file.to_string(),
            line: start,
            lang: format!("{lang} (never closed)"),
            text: String::new(),
        });
    }
    blocks
}

/// Every block of the docs.
fn blocks() -> Vec<Block> {
    documents()
        .iter()
        .flat_map(|(file, text)| fenced(file, text))
        .collect()
}

fn blocks_in(langs: &[&str]) -> Vec<Block> {
    blocks()
        .into_iter()
        .filter(|block| langs.contains(&block.lang.as_str()))
        .collect()
}

#[test]
fn every_block_is_in_a_language_this_test_checks() {
    let mut failures = Failures::default();
    let all = blocks();
    for block in &all {
        if !LANGUAGES.contains(&block.lang.as_str()) {
            failures.add(
                block,
                format!(
                    "a block in no language this test checks (one of {}); mark output as ```text",
                    LANGUAGES.join(", ")
                ),
            );
        }
    }
    failures.assert_none(all.len());
}

// ---------------------------------------------------------------------------------------
// Config files.

/// The quickstart's dataset, tokenizer folder and config file.
fn quickstart_dataset() -> PathBuf {
    crate::rollout::quickstart().join("arithmetic.jsonl")
}

fn string(path: &Path) -> toml::Value {
    toml::Value::String(path.display().to_string())
}

/// `value` when it names a path of the repository (relative to its root), else `fallback`.
fn in_repository(value: Option<&toml::Value>, fallback: PathBuf) -> toml::Value {
    value
        .and_then(toml::Value::as_str)
        .map(|path| crate::repository().join(path))
        .filter(|path| path.exists())
        .map_or_else(|| string(&fallback), |path| string(&path))
}

/// Every string of `value` that starts with `./` (a program or file of the reader's own).
fn relative_files(value: &toml::Value, found: &mut BTreeSet<String>) {
    match value {
        toml::Value::String(text) if text.starts_with("./") => {
            found.insert(text.clone());
        }
        toml::Value::Array(items) => items.iter().for_each(|item| relative_files(item, found)),
        toml::Value::Table(table) => table.values().for_each(|item| relative_files(item, found)),
        _ => {}
    }
}

/// The environment variables named by `*_env` keys (`api_key_env`, `gateway_token_env`).
fn named_variables(value: &toml::Value, found: &mut BTreeSet<String>) {
    match value {
        toml::Value::Array(items) => items.iter().for_each(|item| named_variables(item, found)),
        toml::Value::Table(table) => {
            for (key, item) in table {
                match item {
                    toml::Value::String(name) if key.ends_with("_env") => {
                        found.insert(name.clone());
                    }
                    _ => named_variables(item, found),
                }
            }
        }
        _ => {}
    }
}

/// The config a block stands for: a whole one (it has `dataset`) with its dataset and
/// tokenizer found in the repository or replaced by the quickstart's; a partial one (a
/// table, some keys) on top of the quickstart's dataset and tokenizer, with a numeric
/// reward unless it has rewards of its own.
fn config_of(block: &toml::Table) -> toml::Table {
    let mut config = block.clone();
    let whole = block.contains_key("dataset");
    config.insert(
        "dataset".into(),
        in_repository(
            whole.then(|| block.get("dataset")).flatten(),
            quickstart_dataset(),
        ),
    );
    config.insert(
        "tokenizer".into(),
        in_repository(
            whole.then(|| block.get("tokenizer")).flatten(),
            crate::rollout::quickstart(),
        ),
    );
    if !whole && !config.contains_key("rewards") {
        let mut reward = toml::Table::new();
        reward.insert("spec".into(), "numeric:answer".into());
        config.insert(
            "rewards".into(),
            toml::Value::Array(vec![toml::Value::Table(reward)]),
        );
    }
    config
}

/// `async-grpo rollout --check` on the config `block` stands for, in `dir`: `Err` with what
/// it said when it refused.
fn check_config(dir: &Path, block: &toml::Table) -> Result<(), String> {
    let config = config_of(block);
    let mut files = BTreeSet::new();
    relative_files(&toml::Value::Table(config.clone()), &mut files);
    for file in files {
        // A program of the reader's own (`./setup.sh`): here, one that does nothing.
        let path = dir.join(&file);
        std::fs::write(&path, "#!/bin/sh\nexit 0\n").expect("write a stub");
        executable(&path);
    }
    let text = toml::to_string(&config).map_err(|e| format!("cannot write it back: {e}"))?;
    let path = dir.join("docs.toml");
    std::fs::write(&path, &text).expect("write the config");
    let mut variables = BTreeSet::new();
    named_variables(&toml::Value::Table(config), &mut variables);
    let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
    command
        .args(["rollout", "--check", "--config"])
        .arg(&path)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0")
        .env_remove("ASYNC_GRPO_LISTEN_TOKEN");
    for variable in variables {
        command.env(variable, "docs-test");
    }
    let output = command.output().expect("the binary starts");
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`async-grpo rollout --check` refused it:\n{}\nthe config checked:\n{text}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The rows in `path`: JSON Lines, or Parquet (its footer's count).
fn rows_in(path: &Path) -> Vec<serde_json::Value> {
    if path.extension().is_some_and(|ext| ext == "parquet") {
        use parquet::file::reader::{FileReader as _, SerializedFileReader};
        let file = std::fs::File::open(path).expect("the Parquet output");
        let reader = SerializedFileReader::new(file).expect("a Parquet file");
        let rows = reader.metadata().file_metadata().num_rows();
        return vec![serde_json::Value::Null; usize::try_from(rows).expect("a count")];
    }
    std::fs::read_to_string(path)
        .expect("the output")
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON row"))
        .collect()
}

/// A page that opens with a whole config run by the simulator (`dataset`, no `servers`): the
/// run it describes, done, and the rows it says it writes (`groups` x `num_generations`).
#[test]
fn every_page_that_opens_with_a_config_runs_it() {
    let dir = ScratchDir::new("async-grpo-docs-run");
    let mut ran = Vec::new();
    for (index, block) in blocks().iter().enumerate() {
        let first = blocks()
            .into_iter()
            .find(|other| other.file == block.file)
            .is_some_and(|first| first.line == block.line);
        let Ok(table) = block.text.parse::<toml::Table>() else {
            continue;
        };
        if !first
            || block.lang != "toml"
            || !table.contains_key("dataset")
            || table.contains_key("servers")
        {
            continue;
        }
        let scratch = dir.join(index.to_string());
        std::fs::create_dir_all(&scratch).expect("a scratch dir");
        let config = config_of(&table);
        let path = scratch.join("docs.toml");
        std::fs::write(&path, toml::to_string(&config).expect("TOML")).expect("write it");
        let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
            .args(["rollout", "--progress", "off", "--config"])
            .arg(&path)
            .current_dir(&scratch)
            .env("NO_COLOR", "1")
            .output()
            .expect("the binary starts");
        assert!(
            output.status.success(),
            "{}:{}: the page's example failed:\n{}",
            block.file,
            block.line,
            String::from_utf8_lossy(&output.stderr)
        );
        let out = table
            .get("out")
            .and_then(toml::Value::as_str)
            .unwrap_or("rollouts.jsonl");
        let rows = rows_in(&scratch.join(out));
        let count = |key: &str| table.get(key).and_then(toml::Value::as_integer);
        let expected = count("groups")
            .zip(count("num_generations"))
            .map(|(g, n)| g * n);
        assert_eq!(
            Some(i64::try_from(rows.len()).expect("a count")),
            expected,
            "{}:{}: the example's rows",
            block.file,
            block.line
        );
        // What the tools page says the python session answers.
        if block.file == "docs/tools.md" {
            let text = serde_json::to_string(&rows).expect("JSON");
            assert!(text.contains("-66"), "no tool answered -66: {text:.2000}");
        }
        ran.push(block.file.clone());
    }
    assert_eq!(
        ran,
        ["docs/configuration.md", "docs/tools.md"],
        "the pages that open with a config"
    );
}

/// scale-out.md opens with two shards of the quickstart and says what their rows are
/// together: its rollout commands run as written (from a scratch folder, the config found in
/// the repository), and the claim checked.
#[test]
fn the_scale_out_pages_shards_write_what_it_says() {
    let dir = ScratchDir::new("async-grpo-docs-shards");
    let block = blocks()
        .into_iter()
        .find(|block| block.file == "docs/scale-out.md")
        .expect("scale-out.md has a block");
    assert!(
        block
            .text
            .contains("# 512 rows of 64 groups, each group id once"),
        "the claim this test checks changed:\n{}",
        block.text
    );
    let mut outs = Vec::new();
    for words in logical_lines(&block.text)
        .iter()
        .flat_map(|line| commands(line))
    {
        let Some(args) = words
            .iter()
            .position(|word| word == "--")
            .map(|at| &words[at + 1..])
            .filter(|args| args.first().is_some_and(|first| first == "rollout"))
        else {
            continue;
        };
        let args: Vec<String> = args
            .iter()
            .map(|arg| {
                if arg.ends_with(".toml") {
                    crate::repository().join(arg).display().to_string()
                } else {
                    arg.clone()
                }
            })
            .collect();
        let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
            .args(&args)
            .args(["--progress", "off"])
            .current_dir(&*dir)
            .output()
            .expect("the binary starts");
        assert!(
            output.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let out = args
            .iter()
            .position(|arg| arg == "--out")
            .map(|at| args[at + 1].clone())
            .expect("each shard names its output");
        outs.push(rows_in(&dir.join(out)));
    }
    assert_eq!(outs.len(), 2, "two shards");
    let group = |row: &serde_json::Value| row["group_id"].as_u64().expect("a group id");
    let groups: Vec<BTreeSet<u64>> = outs
        .iter()
        .map(|rows| rows.iter().map(group).collect())
        .collect();
    assert_eq!(outs.iter().map(Vec::len).sum::<usize>(), 512);
    assert_eq!(groups[0].len() + groups[1].len(), 64);
    assert!(
        groups[0].is_disjoint(&groups[1]),
        "a group id in both shards"
    );
}

fn executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn every_toml_block_parses_and_passes_the_binarys_check() {
    let dir = ScratchDir::new("async-grpo-docs-toml");
    let mut failures = Failures::default();
    let blocks = blocks_in(&["toml"]);
    for (index, block) in blocks.iter().enumerate() {
        let table: toml::Table = match block.text.parse() {
            Ok(table) => table,
            Err(e) => {
                failures.add(block, format!("not TOML: {e}"));
                continue;
            }
        };
        let scratch = dir.join(index.to_string());
        std::fs::create_dir_all(&scratch).expect("a scratch dir");
        if let Err(e) = check_config(&scratch, &table) {
            failures.add(block, e);
        }
    }
    failures.assert_none(blocks.len());
}

// ---------------------------------------------------------------------------------------
// Command lines.

/// The simple commands of a shell line, each as its words: quotes removed, nothing expanded
/// (`$VAR` stays as written), a comment dropped; split on `;`, `&&`, `||`, `|` and `&`.
fn commands(line: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars().peekable();
    let end_word = |word: &mut Option<String>, words: &mut Vec<String>| {
        if let Some(done) = word.take() {
            words.push(done);
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let current = word.get_or_insert_with(String::new);
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    current.push(c);
                }
            }
            '"' => {
                let current = word.get_or_insert_with(String::new);
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => {
                            if let Some(next) = chars.next() {
                                current.push(next);
                            }
                        }
                        _ => current.push(c),
                    }
                }
            }
            '\\' => {
                if let Some(next) = chars.next() {
                    word.get_or_insert_with(String::new).push(next);
                }
            }
            '#' if word.is_none() => break,
            ';' | '|' | '&' => {
                end_word(&mut word, &mut words);
                while chars.peek().is_some_and(|next| matches!(next, '|' | '&')) {
                    chars.next();
                }
                commands.push(std::mem::take(&mut words));
            }
            c if c.is_whitespace() => end_word(&mut word, &mut words),
            _ => word.get_or_insert_with(String::new).push(c),
        }
    }
    end_word(&mut word, &mut words);
    commands.push(words);
    commands.retain(|words| !words.is_empty());
    commands
}

/// The lines of a shell block with their `\` continuations joined.
fn logical_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(start) = line.strip_suffix('\\') {
            current.push_str(start);
            current.push(' ');
        } else {
            current.push_str(line);
            lines.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines
}

/// What the checks of command lines read once: the binary's help texts, xtask's help.
#[derive(Default)]
struct Helps(BTreeMap<String, String>);

impl Helps {
    /// `async-grpo [SUBCOMMAND] --help`.
    fn of(&mut self, subcommand: &str) -> &str {
        self.0.entry(subcommand.to_string()).or_insert_with(|| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
            if !subcommand.is_empty() {
                command.arg(subcommand);
            }
            let output = command.arg("--help").output().expect("the binary starts");
            String::from_utf8_lossy(&output.stdout).into_owned()
        })
    }

    /// The subcommands `async-grpo --help` lists.
    fn subcommands(&mut self) -> BTreeSet<String> {
        self.of("")
            .lines()
            .skip_while(|line| !line.starts_with("Commands:"))
            .skip(1)
            .take_while(|line| line.starts_with("  "))
            .filter_map(|line| line.split_whitespace().next())
            .map(str::to_string)
            .collect()
    }
}

/// xtask's `HELP` text.
fn xtask_help() -> &'static str {
    let start = XTASK_MAIN
        .find("const HELP: &str = \"")
        .expect("xtask/src/main.rs has a HELP const");
    let rest = &XTASK_MAIN[start..];
    let end = rest.find("\";").expect("HELP ends");
    &rest[..end]
}

/// The task names xtask's `HELP` lists (the first word of each task line).
fn xtask_tasks() -> BTreeSet<&'static str> {
    xtask_help()
        .lines()
        .skip_while(|line| !line.starts_with("tasks:"))
        .skip(1)
        .filter(|line| line.starts_with("  ") && !line.starts_with("   "))
        .filter_map(|line| line.split_whitespace().next())
        .collect()
}

/// Whether `text` names the flag `flag` (`--out`, not as the start of `--out-dir`).
fn names_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        !text[at + flag.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// The `--flags` of `args` (`--out=x` as `--out`).
fn flags(args: &[String]) -> impl Iterator<Item = &str> {
    args.iter()
        .filter(|arg| arg.starts_with("--") && arg.len() > 2)
        .map(|arg| arg.split('=').next().unwrap_or(arg))
}

/// The checks of the commands of shell lines, and how many were checked.
struct Shell<'a> {
    helps: &'a mut Helps,
    failures: &'a mut Failures,
    scratch: &'a Path,
    checks: usize,
}

impl Shell<'_> {
    fn command(&mut self, block: &Block, words: &[String]) {
        let mut words: Vec<String> = words.to_vec();
        // `exec CMD`, `VAR=value CMD`: the command is CMD.
        while words.first().is_some_and(|word| {
            word == "exec"
                || word.split_once('=').is_some_and(|(name, _)| {
                    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
        }) {
            words.remove(0);
        }
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        match words.as_slice() {
            ["cargo", "run", rest @ ..] => {
                if let Some(at) = rest.iter().position(|word| *word == "--") {
                    self.binary(block, &rest[at + 1..]);
                }
            }
            ["async-grpo", rest @ ..] => self.binary(block, rest),
            ["cargo", "xtask", rest @ ..] => self.xtask(block, rest),
            ["pip" | "pip3", "install", rest @ ..]
            | ["python" | "python3", "-m", "pip", "install", rest @ ..] => self.pip(block, rest),
            ["cargo", "nextest", "run", rest @ ..] => self.nextest(block, rest),
            _ => {}
        }
    }

    /// `async-grpo ARGS`: a subcommand it has, flags that subcommand has, and for `rollout`
    /// the settings `--check` accepts.
    fn binary(&mut self, block: &Block, args: &[&str]) {
        self.checks += 1;
        let Some(subcommand) = args.first() else {
            self.failures.add(block, "`async-grpo` with no subcommand");
            return;
        };
        let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
        if !self.helps.subcommands().contains(*subcommand) {
            self.failures.add(
                block,
                format!("`async-grpo {subcommand}`: no such subcommand in `async-grpo --help`"),
            );
            return;
        }
        let help = self.helps.of(subcommand).to_string();
        for flag in flags(&args[1..]) {
            if !names_flag(&help, flag) {
                self.failures.add(
                    block,
                    format!("`async-grpo {subcommand} {flag}`: no such flag in `async-grpo {subcommand} --help`"),
                );
            }
        }
        let expanded = args.iter().any(|arg| arg.contains('$'));
        if *subcommand == "rollout"
            && !expanded
            && !args.iter().any(|arg| arg == "--help")
            && let Err(e) = self.check_rollout(block, &args[1..])
        {
            self.failures
                .add(block, format!("`async-grpo {}`: {e}", args.join(" ")));
        }
    }

    /// `async-grpo rollout ARGS --check` in a scratch directory: the files the line names
    /// that are not in the repository (the reader's own) replaced by the quickstart's.
    fn check_rollout(&mut self, block: &Block, args: &[String]) -> Result<(), String> {
        let root = crate::repository();
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let dir = self.scratch.join(format!("rollout-{}", self.checks));
        std::fs::create_dir_all(&dir).expect("a scratch dir");
        let found = |value: &str| -> Option<PathBuf> {
            let path = match (value.strip_prefix("~/"), &home) {
                (Some(rest), Some(home)) => home.join(rest),
                _ => root.join(value),
            };
            path.exists().then_some(path)
        };
        let mut resolved: Vec<String> = vec!["rollout".into()];
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            resolved.push(arg.clone());
            let replacement = match arg.as_str() {
                "--config" => Some(iter.next().and_then(|v| found(v)).unwrap_or_else(|| {
                    // The reader's own run.toml: a config of the quickstart's files.
                    let path = dir.join("run.toml");
                    let text = format!(
                        "dataset = {}\ntokenizer = {}\n\n[[rewards]]\nspec = \"numeric:answer\"\n\n[[tools]]\nname = \"calculator\"\nkind = \"calculator\"\n",
                        crate::rollout::toml_path(&quickstart_dataset()),
                        crate::rollout::toml_path(&crate::rollout::quickstart()),
                    );
                    std::fs::write(&path, text).expect("write run.toml");
                    path
                })),
                "--tokenizer" => Some(
                    iter.next()
                        .and_then(|v| found(v))
                        .unwrap_or_else(crate::rollout::quickstart),
                ),
                "--dataset" => Some(
                    iter.next()
                        .and_then(|v| found(v))
                        .unwrap_or_else(quickstart_dataset),
                ),
                "--out" => Some(dir.join(
                    iter.next()
                        .and_then(|v| Path::new(v).file_name().map(PathBuf::from))
                        .unwrap_or_else(|| "out.jsonl".into()),
                )),
                _ => None,
            };
            if let Some(path) = replacement {
                resolved.push(path.display().to_string());
            }
        }
        let mut command = Command::new(env!("CARGO_BIN_EXE_async-grpo"));
        if !resolved.iter().any(|arg| arg == "--check") {
            resolved.push("--check".into());
        }
        command
            .args(&resolved)
            .current_dir(&dir)
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0")
            .env_remove("ASYNC_GRPO_LISTEN_TOKEN")
            .env_remove("ASYNC_GRPO_ROWS_TOKEN");
        // A block that sets a token in the environment: the line runs with one.
        for variable in ["ASYNC_GRPO_LISTEN_TOKEN", "ASYNC_GRPO_ROWS_TOKEN"] {
            if block.text.contains(variable) {
                command.env(variable, "docs-test");
            }
        }
        let output = command.output().expect("the binary starts");
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "`--check` refused it (run as `async-grpo {}`):\n{}",
                resolved.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// `cargo xtask TASK ARGS`: a task of xtask's help, and flags it names.
    fn xtask(&mut self, block: &Block, args: &[&str]) {
        self.checks += 1;
        let Some(task) = args.first() else {
            self.failures.add(block, "`cargo xtask` with no task");
            return;
        };
        if !xtask_tasks().contains(task) {
            self.failures.add(
                block,
                format!(
                    "`cargo xtask {task}`: no such task in xtask's HELP ({})",
                    xtask_tasks().into_iter().collect::<Vec<_>>().join(", ")
                ),
            );
        }
        let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
        for flag in flags(&args) {
            if !names_flag(xtask_help(), flag) {
                self.failures.add(
                    block,
                    format!("`cargo xtask {task} {flag}`: xtask's HELP names no such flag"),
                );
            }
        }
    }

    /// `pip install ARGS`: a project folder that exists, a wheel where `cargo xtask` writes
    /// it, extras the project has. A requirement from the package index is not checked.
    fn pip(&mut self, block: &Block, args: &[&str]) {
        self.checks += 1;
        let root = crate::repository();
        for arg in args.iter().filter(|arg| !arg.starts_with('-')) {
            // `$(ls target/wheels/*.whl)[trl]`: the path `ls` prints, then the extras.
            let (path, extras) = match arg.strip_prefix("$(ls ") {
                Some(rest) => match rest.split_once(')') {
                    Some((path, extras)) => (path, extras),
                    None => (rest, ""),
                },
                None => match arg.find('[') {
                    Some(at) => (&arg[..at], &arg[at..]),
                    None => (*arg, ""),
                },
            };
            let project = if path.ends_with(".whl") {
                // A wheel is built: its folder must be where `cargo xtask` writes wheels.
                let folder = Path::new(path)
                    .parent()
                    .map(|folder| folder.display().to_string())
                    .unwrap_or_default();
                if folder.is_empty() || !xtask_help().contains(&format!("into {folder}/")) {
                    self.failures.add(
                        block,
                        format!("`pip install {arg}`: no xtask task writes wheels into {folder}/"),
                    );
                    continue;
                }
                root.join("crates/trl-bridge")
            } else if path.starts_with('.') || path.starts_with('/') || path.contains('/') {
                let folder = root.join(path);
                if !folder.join("pyproject.toml").is_file() {
                    self.failures.add(
                        block,
                        format!("`pip install {arg}`: {path} holds no pyproject.toml"),
                    );
                    continue;
                }
                folder
            } else {
                continue;
            };
            let extras: Vec<&str> = extras
                .trim_start_matches('[')
                .trim_end_matches(']')
                .split(',')
                .map(str::trim)
                .filter(|extra| !extra.is_empty())
                .collect();
            if extras.is_empty() {
                continue;
            }
            let pyproject: toml::Table = std::fs::read_to_string(project.join("pyproject.toml"))
                .expect("read pyproject.toml")
                .parse()
                .expect("pyproject.toml is TOML");
            let declared = pyproject
                .get("project")
                .and_then(|project| project.get("optional-dependencies"))
                .and_then(toml::Value::as_table);
            for extra in extras {
                if !declared.is_some_and(|declared| declared.contains_key(extra)) {
                    self.failures.add(
                        block,
                        format!(
                            "`pip install {arg}`: {} declares no extra `{extra}`",
                            project.join("pyproject.toml").display()
                        ),
                    );
                }
            }
        }
    }

    /// `cargo nextest run --profile P`: a profile of `.config/nextest.toml`.
    fn nextest(&mut self, block: &Block, args: &[&str]) {
        self.checks += 1;
        let Some(at) = args.iter().position(|arg| *arg == "--profile") else {
            return;
        };
        let Some(profile) = args.get(at + 1) else {
            self.failures.add(block, "`--profile` without a name");
            return;
        };
        let config: toml::Table =
            std::fs::read_to_string(crate::repository().join(".config/nextest.toml"))
                .expect("read .config/nextest.toml")
                .parse()
                .expect(".config/nextest.toml is TOML");
        let profiles = config.get("profile").and_then(toml::Value::as_table);
        if !profiles.is_some_and(|profiles| profiles.contains_key(*profile)) {
            self.failures.add(
                block,
                format!("`cargo nextest run --profile {profile}`: no such profile in .config/nextest.toml"),
            );
        }
    }
}

/// `bash -n`: `Err` with what bash said.
fn bash_syntax(text: &str) -> Result<(), String> {
    run_with_stdin(Command::new("bash").arg("-n"), text)
}

/// Runs `command` with `text` on its stdin: `Err` with its stderr when it fails.
fn run_with_stdin(command: &mut Command, text: &str) -> Result<(), String> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write stdin");
    let output = child.wait_with_output().expect("wait");
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
    }
}

#[test]
fn every_shell_block_parses_and_names_real_commands_flags_and_files() {
    let dir = ScratchDir::new("async-grpo-docs-shell");
    let mut failures = Failures::default();
    let mut helps = Helps::default();
    let blocks = blocks_in(&["sh", "bash"]);
    let mut shell = Shell {
        helps: &mut helps,
        failures: &mut failures,
        scratch: &dir,
        checks: 0,
    };
    for block in &blocks {
        if let Err(e) = bash_syntax(&block.text) {
            shell.failures.add(block, format!("`bash -n`: {e}"));
        }
        for line in logical_lines(&block.text) {
            for words in commands(&line) {
                shell.command(block, &words);
            }
        }
    }
    assert!(shell.checks > 0, "no command of the docs was checked");
    failures.assert_none(blocks.len());
}

/// The `async-grpo` command lines of a YAML block (a folded scalar's lines joined).
fn yaml_commands(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let Some(at) = line.find("async-grpo ") else {
            continue;
        };
        let indent = line.len() - line.trim_start().len();
        let mut command = line[at..].to_string();
        for next in &lines[index + 1..] {
            let next_indent = next.len() - next.trim_start().len();
            if next.trim().is_empty() || next_indent < indent || next.trim_start().starts_with("- ")
            {
                break;
            }
            command.push(' ');
            command.push_str(next.trim());
        }
        found.push(command);
    }
    found
}

/// Whether `python3` here has PyYAML.
fn python_has_yaml() -> bool {
    Command::new(python())
        .args(["-c", "import yaml"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

#[test]
fn every_yaml_block_parses_and_its_commands_are_real() {
    let dir = ScratchDir::new("async-grpo-docs-yaml");
    let mut failures = Failures::default();
    let mut helps = Helps::default();
    let blocks = blocks_in(&["yaml"]);
    let parse = python_has_yaml();
    for block in &blocks {
        if parse
            && let Err(e) = run_with_stdin(
                Command::new(python()).args(["-c", "import sys, yaml; yaml.safe_load(sys.stdin)"]),
                &block.text,
            )
        {
            failures.add(block, format!("not YAML: {e}"));
        }
        let mut shell = Shell {
            helps: &mut helps,
            failures: &mut failures,
            scratch: &dir,
            checks: 0,
        };
        for line in yaml_commands(&block.text) {
            for words in commands(&line) {
                shell.command(block, &words);
            }
        }
        if !parse && shell.checks == 0 {
            failures.add(
                block,
                "neither parsed (no PyYAML) nor holding an async-grpo command",
            );
        }
    }
    failures.assert_none(blocks.len().max(1));
}

// ---------------------------------------------------------------------------------------
// Python, JSON.

/// Debian's `/usr/bin/python3` where there is one, else the `python3` on `PATH`.
fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

#[test]
fn every_python_block_parses() {
    let mut failures = Failures::default();
    let blocks = blocks_in(&["python"]);
    for block in &blocks {
        if let Err(e) = run_with_stdin(
            Command::new(python()).args(["-c", "import ast, sys; ast.parse(sys.stdin.read())"]),
            &block.text,
        ) {
            failures.add(block, format!("Python's parser refused it: {e}"));
        }
    }
    failures.assert_none(blocks.len());
}

#[test]
fn every_json_block_parses() {
    let mut failures = Failures::default();
    let blocks = blocks_in(&["json", "jsonl"]);
    for block in &blocks {
        let documents: Vec<(usize, &str)> = if block.lang == "jsonl" {
            block
                .text
                .lines()
                .enumerate()
                .filter(|(_, line)| !line.trim().is_empty())
                .collect()
        } else {
            vec![(0, block.text.as_str())]
        };
        for (line, text) in documents {
            if let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
                failures.add(
                    block,
                    format!("line {} of the block is not JSON: {e}", line + 1),
                );
            }
        }
    }
    failures.assert_none(blocks.len());
}

// ---------------------------------------------------------------------------------------
// Rust: the snippets, compiled here.

/// Declares each snippet as an async function (its body the docs' block, its arguments
/// what the block takes as given) and `SNIPPETS`, each body's tokens as `stringify!` writes
/// them.
macro_rules! snippets {
    ($($(#[$meta:meta])* async fn $name:ident($($arg:ident: $ty:ty),*) $body:block)*) => {
        $(
            $(#[$meta])*
            async fn $name($($arg: $ty),*) -> anyhow::Result<()> {
                $body
                Ok(())
            }
        )*
        const SNIPPETS: &[(&str, &str)] = &[$((stringify!($name), stringify!($body))),*];
    };
}

snippets! {
    /// docs/crates.md: tool-dispatch on its own.
    async fn tool_dispatch_on_its_own() {
        use serde_json::json;
        use tool_dispatch::{DispatcherConfig, Registry, Tool, ToolCall, ToolDispatcher, ToolSpec};

        let tools = Registry::new().with(Tool::new_sync(
            ToolSpec::new("shout", "Upper-cases text")
                .parameters(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
            |args| Ok(json!(args.get("text").and_then(|t| t.as_str()).unwrap_or_default().to_uppercase())),
        ))?;
        let dispatcher = ToolDispatcher::new(tools, DispatcherConfig::new(64));
        let results = dispatcher.run(vec![ToolCall::new("shout", json!({"text": "hi"}))]).await?;
        assert_eq!(results[0].content, "HI");
        dispatcher.shutdown(std::time::Duration::from_secs(30)).await;
    }

    /// docs/crates.md: scoring a group on its own.
    async fn scoring_on_its_own() {
        use scoring::{AdvantageConfig, Completion, Group, Scorer, ScorerConfig, builtin};

        let scorer = Scorer::new(vec![builtin::from_spec("numeric:answer")?], ScorerConfig::default())?;
        let group = std::sync::Arc::new(Group::new(
            "What is 6 * 7?",
            vec![Completion::from_text("\\boxed{42}"), Completion::from_text("41")],
            serde_json::json!({"answer": "42"}).as_object().cloned().unwrap_or_default(),
        ));
        let scores = scorer.score(group.clone()).await;
        assert_eq!(scores.rewards, [Some(1.0), Some(0.0)]);
        let advantages = scores.advantages(&group, &AdvantageConfig::default()).advantages;
        assert!((advantages[0] - 1.0).abs() < 1e-6 && (advantages[1] + 1.0).abs() < 1e-6);
    }

    /// docs/crates.md: a turn from token ids (compiled; it needs a server to run).
    async fn generating_a_turn_on_its_own(prompt_ids: Vec<u32>) {
        use vllm_client::{Client, ClientConfig, GenerateParams};

        let client = Client::new(ClientConfig::new("http://127.0.0.1:8000"))?;
        client.wait_until_ready(std::time::Duration::from_secs(120)).await?;
        let turn = client.generate(&prompt_ids, &GenerateParams { max_tokens: 256, ..Default::default() }).await?;
        assert_eq!(turn.logprobs.len(), turn.token_ids.len());
    }
}

/// Rust source without its `//` comments (string literals kept whole) and without
/// whitespace: what the docs' block and `stringify!` agree on.
fn rust_tokens(source: &str) -> String {
    let mut out = String::new();
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push(c);
                while let Some(c) = chars.next() {
                    out.push(c);
                    if c == '\\' {
                        if let Some(next) = chars.next() {
                            out.push(next);
                        }
                    } else if c == '"' {
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            c if c.is_whitespace() => {}
            _ => out.push(c),
        }
    }
    out.chars().filter(|c| !c.is_whitespace()).collect()
}

#[test]
fn every_rust_block_is_a_snippet_compiled_here() {
    let mut failures = Failures::default();
    let blocks = blocks_in(&["rust"]);
    let compiled: BTreeMap<String, &str> = SNIPPETS
        .iter()
        .map(|(name, body)| {
            let tokens = rust_tokens(body);
            let inner = tokens
                .strip_prefix('{')
                .and_then(|tokens| tokens.strip_suffix('}'))
                .unwrap_or(&tokens)
                .to_string();
            (inner, *name)
        })
        .collect();
    for block in &blocks {
        if !compiled.contains_key(&rust_tokens(&block.text)) {
            failures.add(
                block,
                format!(
                    "not the tokens of any snippet compiled in crates/cli/tests/docs.rs ({}); \
                     change both together",
                    SNIPPETS
                        .iter()
                        .map(|(name, _)| *name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
    }
    failures.assert_none(blocks.len());
}

#[test]
fn the_tool_dispatch_snippet_runs() {
    crate::rollout::runtime()
        .block_on(tool_dispatch_on_its_own())
        .expect("the snippet runs");
}

#[test]
fn the_scoring_snippet_runs() {
    crate::rollout::runtime()
        .block_on(scoring_on_its_own())
        .expect("the snippet runs");
}

#[test]
fn the_vllm_client_snippet_compiles() {
    // Built, not polled: it needs a vLLM server at 127.0.0.1:8000.
    let future = generating_a_turn_on_its_own(Vec::new());
    drop(future);
}

// ---------------------------------------------------------------------------------------
// Links.

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as
/// `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks), repeats numbered.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut found = BTreeSet::new();
    for line in outside_code(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = anchor(heading);
        let count = seen.entry(base.clone()).or_insert(0);
        found.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    found
}

/// The lines of a Markdown text outside its fenced blocks.
fn outside_code(text: &str) -> Vec<&str> {
    let mut inside = false;
    text.lines()
        .filter(|line| {
            let fence = line.trim_start().starts_with("```");
            if fence {
                inside = !inside;
            }
            !fence && !inside
        })
        .collect()
}

/// The targets of the inline links `[text](target)` of a line.
fn link_targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .collect()
}

#[test]
fn every_relative_link_of_the_docs_resolves() {
    let root = crate::repository();
    let mut files = vec![
        "README.md".to_string(),
        "ARCHITECTURE.md".to_string(),
        "BENCHMARKS.md".to_string(),
    ];
    files.extend(
        documents()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| name.starts_with("docs/")),
    );
    let mut failures = Vec::new();
    let mut links = 0;
    for file in &files {
        let text = std::fs::read_to_string(root.join(file)).expect("read");
        let dir = root.join(file).parent().expect("a folder").to_path_buf();
        let mut inside = false;
        for (number, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                inside = !inside;
            }
            if inside {
                continue;
            }
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                links += 1;
                let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
                let linked = if path.is_empty() {
                    root.join(file)
                } else {
                    dir.join(path)
                };
                if !linked.exists() {
                    failures.push(format!("{file}:{}: {target}: no such file", number + 1));
                    continue;
                }
                if !fragment.is_empty() && linked.extension().is_some_and(|ext| ext == "md") {
                    let headings = anchors(&std::fs::read_to_string(&linked).expect("read"));
                    if !headings.contains(fragment) {
                        failures.push(format!(
                            "{file}:{}: {target}: no heading with the anchor #{fragment}",
                            number + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(links > 0, "no link found");
    assert!(
        failures.is_empty(),
        "broken links:\n{}",
        failures.join("\n")
    );
}
