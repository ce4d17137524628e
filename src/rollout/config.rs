//! `async-grpo rollout`'s settings: its flags, its TOML file, and [`Settings`], both merged.
//!
//! Every setting is a flag and a key of the file (the flag's name in snake_case); a flag
//! given wins over the file, and a setting given nowhere takes its default. `--server` and
//! `--reward`, repeatable, replace the file's `servers` and `[[rewards]]` when given at all.
//! Paths in the file are relative to the file's directory, paths on the command line to the
//! current directory; [`Settings`] holds them absolute. Unknown keys, anywhere in the file,
//! are errors naming the key, the file and the line.
//!
//! ```toml
//! dataset = "arithmetic.jsonl"
//! tokenizer = "quickstart"
//! num_generations = 8
//!
//! [[rewards]]
//! spec = "numeric:answer"          # or: kind = "numeric", column = "answer"
//!
//! [[tools]]
//! name = "calculator"
//! kind = "calculator"
//!
//! [simulator]                      # used only when no server is given
//! tool_rounds = 1
//! ```

use std::{
    ops::Range,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use rollout_core::{
    ReconcilerConfig,
    rollout::{PromptMode, RolloutConfig, Sampling},
};
use scoring::{AdvantageConfig, Reward, builtin::CommandReward};
use serde::Deserialize;
use toml::Spanned;
use tool_dispatch::builtin::{ToolConfig, parse_duration};
use vllm_client::{SamplingParams, sim::SimConfig};

/// Options of `async-grpo rollout`: dataset rows to multi-turn conversations with tools, to
/// rewards, to JSONL training rows.
#[derive(Debug, Default, Args)]
pub(crate) struct RolloutArgs {
    /// A TOML file holding the settings, keys named as these flags in snake_case (paths in it
    /// are relative to its directory); a flag given here wins over the file
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// A vLLM server's base URL, e.g. http://127.0.0.1:8000 (repeat for replicas); without
    /// any, the built-in simulator answers (scripted, not a model)
    #[arg(long = "server", value_name = "URL")]
    servers: Vec<String>,
    /// The model name the servers serve (default: the first one they list)
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// The tokenizer: a directory holding tokenizer.json and tokenizer_config.json, or a
    /// tokenizer.json whose directory holds the config (required)
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// A chat template (.jinja) to use instead of the tokenizer's own
    #[arg(long, value_name = "PATH")]
    chat_template: Option<PathBuf>,
    /// The tool-call format: hermes, qwen3_coder, llama3_json or mistral (default: detected
    /// from the chat template)
    #[arg(long, value_name = "NAME")]
    tool_parser: Option<String>,
    /// The prompts: JSON Lines of {"prompt": text or messages, ...columns} (required)
    #[arg(long, value_name = "FILE.jsonl")]
    dataset: Option<PathBuf>,
    /// Set malformed dataset rows aside (reported at the end) instead of stopping
    #[arg(long)]
    skip_bad_rows: bool,
    /// Completions per prompt: the group size [default: 8]
    #[arg(long, value_name = "N")]
    num_generations: Option<usize>,
    /// Rollouts in flight at once [default: 64]
    #[arg(long, value_name = "N")]
    max_inflight: Option<usize>,
    /// Assistant turns per rollout [default: 8]
    #[arg(long, value_name = "N")]
    max_turns: Option<usize>,
    /// Tokens per assistant turn [default: 512]
    #[arg(long, value_name = "N")]
    max_tokens: Option<u32>,
    /// Completion tokens per rollout, every turn together (default: no limit but the context)
    #[arg(long, value_name = "N")]
    max_total_tokens: Option<u32>,
    /// The context length, instead of what the server reports
    #[arg(long, value_name = "N")]
    max_model_len: Option<u32>,
    /// Sampling temperature [default: 1.0]
    #[arg(long, value_name = "T")]
    temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Keep the K most likely tokens (-1: all)
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    top_k: Option<i32>,
    /// Drop tokens less likely than this fraction of the most likely one
    #[arg(long, value_name = "P")]
    min_p: Option<f32>,
    /// Base seed of the requests (default: random)
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// A reward function: numeric:COLUMN, exact:COLUMN, regex:PATTERN, command:PROGRAM or
    /// length:MAX, each with an optional @WEIGHT (repeat for several; at least one)
    #[arg(long = "reward", value_name = "SPEC")]
    rewards: Vec<String>,
    /// The advantage estimator: trl, grpo, dr_grpo, rloo or batch [default: trl]
    #[arg(long, value_name = "NAME")]
    estimator: Option<String>,
    /// Stop after N groups (default: one pass over the dataset)
    #[arg(long, value_name = "N")]
    groups: Option<u64>,
    /// Replace the output file when it exists (else a run refuses to start rather than
    /// lose rows written before)
    #[arg(long)]
    overwrite: bool,
    /// Check the settings, print them resolved, and exit without rolling out
    #[arg(long)]
    pub(crate) check: bool,
    /// Where the training rows go (JSON Lines) [default: rollouts.jsonl]
    #[arg(long, value_name = "FILE.jsonl")]
    out: Option<PathBuf>,
    /// How the prompts of later turns are built: append (the previous prompt, the ids the
    /// model sampled, and the chat template's ids for what follows: one exact row per
    /// rollout) or rerender (the whole conversation rendered each turn, as TRL does)
    /// [default: append]
    #[arg(long, value_name = "MODE")]
    prompt_mode: Option<PromptMode>,
    /// Re-rendered prompts drifting from the sampled ids by more than this many tokens start
    /// a new training row [default: 16]
    #[arg(long, value_name = "N")]
    fork_threshold_tokens: Option<usize>,
    /// On Ctrl-C, how long rollouts in flight may take to finish, e.g. 30s [default: 30s]
    #[arg(long, value_name = "DURATION")]
    drain_timeout: Option<String>,
    /// How long one rollout may take, every turn and tool call together [default: 10m]
    #[arg(long, value_name = "DURATION")]
    rollout_timeout: Option<String>,
    /// Completions a group needs to be scored and kept [default: 2]
    #[arg(long, value_name = "N")]
    min_group_size: Option<usize>,
    /// Times a failed rollout is tried again on the same prompt [default: 1]
    #[arg(long, value_name = "N")]
    retries: Option<u32>,
    /// How progress shows: a bar on a terminal, log lines otherwise (auto), or off
    /// [default: auto]
    #[arg(long, value_name = "MODE")]
    progress: Option<Progress>,
}

/// How progress shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Progress {
    /// A bar when stderr is a terminal, else log lines.
    #[default]
    Auto,
    /// A progress bar.
    Bar,
    /// A log line now and then.
    Log,
    /// Nothing.
    Off,
}

/// Everything `async-grpo rollout` needs, defaults applied, paths absolute, and every value
/// checked.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// The file the settings came from, if any.
    pub(crate) config_file: Option<PathBuf>,
    /// vLLM base URLs; empty means the simulator.
    pub(crate) servers: Vec<String>,
    /// The model name, when given.
    pub(crate) model: Option<String>,
    /// The tokenizer directory (tokenizer.json and tokenizer_config.json are in it).
    pub(crate) tokenizer: PathBuf,
    /// A chat template file replacing the tokenizer's.
    pub(crate) chat_template: Option<PathBuf>,
    /// The tool-call parser's name (a known one); `None`: detect it from the template.
    pub(crate) tool_parser: Option<String>,
    /// The dataset file.
    pub(crate) dataset: PathBuf,
    /// Set bad rows aside instead of failing.
    pub(crate) skip_bad_rows: bool,
    /// Replace an existing output file.
    pub(crate) overwrite: bool,
    /// Completions per prompt (>= 1).
    pub(crate) num_generations: usize,
    /// Rollouts in flight at once (>= 1).
    pub(crate) max_inflight: usize,
    /// Assistant turns per rollout (>= 1).
    pub(crate) max_turns: usize,
    /// Tokens per turn (>= 1).
    pub(crate) max_tokens: u32,
    /// Completion tokens per rollout.
    pub(crate) max_total_tokens: Option<u32>,
    /// The context length, overriding the server's.
    pub(crate) max_model_len: Option<u32>,
    /// Sampling: `temperature` always set; `top_p`, `top_k`, `min_p`, `seed` when given.
    pub(crate) sampling: SamplingParams,
    /// The reward functions, built (at least one).
    pub(crate) rewards: Vec<Reward>,
    /// The estimator preset's name.
    pub(crate) estimator: String,
    /// The estimator preset.
    pub(crate) advantage: AdvantageConfig,
    /// Groups to produce; `None`: one pass over the dataset.
    pub(crate) groups: Option<u64>,
    /// The output file.
    pub(crate) out: PathBuf,
    /// How later turns' prompts are built.
    pub(crate) prompt_mode: PromptMode,
    /// Drift, in tokens, past which a row forks.
    pub(crate) fork_threshold_tokens: usize,
    /// Grace period on Ctrl-C.
    pub(crate) drain_timeout: Duration,
    /// Time limit of one rollout.
    pub(crate) rollout_timeout: Duration,
    /// Smallest group kept (1 ..= num_generations).
    pub(crate) min_group_size: usize,
    /// Same-prompt retries of a failed rollout.
    pub(crate) retries: u32,
    /// How progress shows.
    pub(crate) progress: Progress,
    /// The tools, each checked with [`ToolConfig::build`].
    pub(crate) tools: Vec<ToolConfig>,
    /// The simulator's behaviour (used only without servers).
    pub(crate) simulator: SimSettings,
}

/// The `[simulator]` table, resolved.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SimSettings {
    /// Assistant turns that call a tool before the final answer (default 0).
    pub(crate) tool_rounds: usize,
    /// Tokens of a final answer (default 32).
    pub(crate) answer_tokens: usize,
    /// Chance an answer after a tool call repeats its result (default 0.5).
    pub(crate) correct_rate: f64,
    /// Delay before the first token (default 0).
    pub(crate) latency: Duration,
    /// Delay per token (default 0).
    pub(crate) per_token: Duration,
    /// Fraction of requests answered 503 (default 0).
    pub(crate) error_503: f64,
    /// Its context length (default 4096).
    pub(crate) max_model_len: u32,
    /// Seed of the fault draws (default 0).
    pub(crate) fault_seed: u64,
}

impl SimSettings {
    /// Sets these fields of a simulator's configuration (the rest, tokenizer and tool name
    /// included, are the caller's).
    pub(crate) fn apply_to(&self, config: &mut SimConfig) {
        config.tool_rounds = self.tool_rounds;
        config.answer_tokens = self.answer_tokens;
        config.correct_rate = self.correct_rate;
        config.latency = self.latency;
        config.per_token = self.per_token;
        config.faults.error_503 = self.error_503;
        config.max_model_len = self.max_model_len;
        config.fault_seed = self.fault_seed;
    }
}

/// The TOML file, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    servers: Option<Vec<String>>,
    model: Option<String>,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    tool_parser: Option<Spanned<String>>,
    dataset: Option<PathBuf>,
    skip_bad_rows: Option<bool>,
    overwrite: Option<bool>,
    num_generations: Option<usize>,
    max_inflight: Option<usize>,
    max_turns: Option<usize>,
    max_tokens: Option<u32>,
    max_total_tokens: Option<u32>,
    max_model_len: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    rewards: Option<Vec<Spanned<RewardTable>>>,
    estimator: Option<Spanned<String>>,
    groups: Option<u64>,
    out: Option<PathBuf>,
    prompt_mode: Option<PromptMode>,
    fork_threshold_tokens: Option<usize>,
    drain_timeout: Option<Spanned<String>>,
    rollout_timeout: Option<Spanned<String>>,
    min_group_size: Option<usize>,
    retries: Option<u32>,
    progress: Option<Progress>,
    tools: Option<Vec<Spanned<ToolConfig>>>,
    simulator: Option<SimTable>,
}

/// A `[[rewards]]` table: `spec = "KIND:ARG"`, or `kind` with its own field.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RewardTable {
    spec: Option<String>,
    kind: Option<String>,
    column: Option<String>,
    pattern: Option<String>,
    program: Option<Vec<String>>,
    max: Option<usize>,
    buffer: Option<usize>,
    weight: Option<f64>,
}

/// The `[simulator]` table, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimTable {
    tool_rounds: Option<usize>,
    answer_tokens: Option<usize>,
    correct_rate: Option<Spanned<f64>>,
    latency: Option<Spanned<String>>,
    per_token: Option<Spanned<String>>,
    error_503: Option<Spanned<f64>>,
    max_model_len: Option<u32>,
    fault_seed: Option<u64>,
}

/// The file being read: its path, text and directory, to point errors at lines.
struct Source {
    path: PathBuf,
    text: String,
    dir: PathBuf,
}

impl Source {
    fn read(path: &Path) -> anyhow::Result<Source> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config {}: cannot read the file", path.display()))?;
        // Canonical, so that the file's own paths resolve against where it really is.
        let path = std::fs::canonicalize(path).or_else(|_| absolute(path))?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(Source { path, text, dir })
    }

    /// `FILE:LINE`, for the byte offset `at`.
    fn at(&self, span: Range<usize>) -> String {
        let upto = &self.text[..span.start.min(self.text.len())];
        format!("{}:{}", self.path.display(), upto.matches('\n').count() + 1)
    }

    fn parse(&self) -> anyhow::Result<FileSettings> {
        toml::from_str(&self.text).map_err(|error| {
            let place = error
                .span()
                .map_or_else(|| self.path.display().to_string(), |span| self.at(span));
            anyhow::anyhow!("{place}: {}", error.message().trim_end())
        })
    }
}

/// A flag's name, for error messages about its value.
fn from_flag(flag: &str) -> String {
    format!("--{flag}")
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    Ok(cwd.join(path))
}

/// A program named by a relative path with a directory part (`./score.py`, `bin/x`) is
/// relative to `base`; a bare name is looked up on PATH as usual.
fn program_path(base: &Path, program: &str) -> String {
    let path = Path::new(program);
    if path.is_relative() && path.components().count() > 1 {
        base.join(path).display().to_string()
    } else {
        program.to_owned()
    }
}

impl Settings {
    /// The rollout loop's part of the settings.
    pub(crate) fn rollout_config(&self) -> RolloutConfig {
        let mut config = RolloutConfig::default();
        config.num_generations = self.num_generations;
        config.max_inflight = self.max_inflight;
        config.max_turns = self.max_turns;
        config.max_tokens = self.max_tokens;
        config.max_total_tokens = self.max_total_tokens;
        config.max_model_len = self.max_model_len;
        config.rollout_timeout = self.rollout_timeout;
        config.min_group_size = self.min_group_size;
        config.retries = self.retries as usize;
        config.skip_bad_rows = self.skip_bad_rows;
        config.max_groups = self.groups;
        config.sampling = Sampling {
            temperature: self.sampling.temperature.unwrap_or(1.0),
            top_p: self.sampling.top_p,
            top_k: self.sampling.top_k,
            min_p: self.sampling.min_p,
            seed: self.sampling.seed,
        };
        config.prompt_mode = self.prompt_mode;
        config.reconciler = ReconcilerConfig {
            fork_threshold_tokens: self.fork_threshold_tokens,
        };
        config.advantages = self.advantage;
        config
    }

    /// Merges the flags, the file `--config` names and the defaults, and checks every value.
    pub(crate) fn resolve(args: RolloutArgs) -> anyhow::Result<Settings> {
        let source = args.config.as_deref().map(Source::read).transpose()?;
        let file = match &source {
            Some(source) => source.parse()?,
            None => FileSettings::default(),
        };
        let cwd = std::env::current_dir().context("cannot read the current directory")?;
        let base = source.as_ref().map_or(cwd.as_path(), |s| s.dir.as_path());
        // `FILE:LINE key` for a value of the file, for error messages.
        let key_at = |key: &str, span: Range<usize>| match &source {
            Some(source) => format!("{}: {key}", source.at(span)),
            None => key.to_owned(),
        };
        let file_name = source
            .as_ref()
            .map_or_else(String::new, |s| format!(" in {}", s.path.display()));
        // A path: the flag's against the current directory, the file's against its directory.
        let path = |flag: Option<PathBuf>, key: Option<PathBuf>| -> Option<PathBuf> {
            flag.map(|p| cwd.join(p))
                .or_else(|| key.map(|p| base.join(p)))
        };

        let servers = if args.servers.is_empty() {
            file.servers.unwrap_or_default()
        } else {
            args.servers
        };
        for server in &servers {
            if !(server.starts_with("http://") || server.starts_with("https://")) {
                bail!("server '{server}' must start with http:// or https://");
            }
        }

        let Some(tokenizer) = path(args.tokenizer, file.tokenizer) else {
            bail!(
                "no tokenizer: set --tokenizer PATH or `tokenizer = \"PATH\"`{file_name} (a \
                 directory with tokenizer.json and tokenizer_config.json, whose chat template \
                 renders the conversations)"
            );
        };
        let tokenizer = tokenizer_dir(tokenizer)?;
        let chat_template = path(args.chat_template, file.chat_template);
        if let Some(template) = &chat_template
            && !template.is_file()
        {
            bail!("chat template {}: no such file", template.display());
        }

        let tool_parser = match (args.tool_parser, file.tool_parser) {
            (Some(name), _) => Some((name, from_flag("tool-parser"))),
            (None, Some(name)) => {
                let place = key_at("tool_parser", name.span());
                Some((name.into_inner(), place))
            }
            (None, None) => None,
        };
        if let Some((name, place)) = &tool_parser {
            rollout_core::parse::parser_by_name(name)
                .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        }

        let Some(dataset) = path(args.dataset, file.dataset) else {
            bail!(
                "no dataset: set --dataset FILE.jsonl or `dataset = \"FILE.jsonl\"`{file_name} \
                 (JSON Lines of {{\"prompt\": ..., ...columns}})"
            );
        };
        if !dataset.is_file() {
            bail!("dataset {}: no such file", dataset.display());
        }

        let num_generations = args.num_generations.or(file.num_generations).unwrap_or(8);
        let max_inflight = args.max_inflight.or(file.max_inflight).unwrap_or(64);
        let max_turns = args.max_turns.or(file.max_turns).unwrap_or(8);
        let max_tokens = args.max_tokens.or(file.max_tokens).unwrap_or(512);
        let min_group_size = args.min_group_size.or(file.min_group_size).unwrap_or(2);
        for (name, value) in [
            ("num_generations", num_generations),
            ("max_inflight", max_inflight),
            ("max_turns", max_turns),
            ("max_tokens", max_tokens as usize),
            ("min_group_size", min_group_size),
        ] {
            if value == 0 {
                bail!(
                    "{name} must be at least 1 (--{} or `{name}`)",
                    name.replace('_', "-")
                );
            }
        }
        if min_group_size > num_generations {
            bail!(
                "min_group_size {min_group_size} is more than num_generations {num_generations}: \
                 no group could ever be kept"
            );
        }

        let sampling = SamplingParams {
            temperature: Some(args.temperature.or(file.temperature).unwrap_or(1.0)),
            top_p: args.top_p.or(file.top_p),
            top_k: args.top_k.or(file.top_k),
            min_p: args.min_p.or(file.min_p),
            seed: args.seed.or(file.seed),
            ..SamplingParams::default()
        };
        check_sampling(&sampling)?;

        let rewards = if args.rewards.is_empty() {
            let mut rewards = Vec::new();
            for (i, table) in file.rewards.unwrap_or_default().into_iter().enumerate() {
                let place = key_at(&format!("rewards[{i}]"), table.span());
                rewards.push(
                    reward_from_table(table.into_inner(), base)
                        .map_err(|e| anyhow::anyhow!("{place}: {e}"))?,
                );
            }
            rewards
        } else {
            args.rewards
                .iter()
                .map(|spec| {
                    scoring::builtin::from_spec(spec).map_err(|e| anyhow::anyhow!("--reward: {e}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        };
        if rewards.is_empty() {
            bail!(
                "no reward function: a run without rewards has nothing to train on; add \
                 --reward numeric:answer (or exact:COLUMN, regex:PATTERN, command:PROGRAM, \
                 length:MAX) or a [[rewards]] table with spec = \"numeric:answer\"{file_name}"
            );
        }

        let (estimator, place) = match (args.estimator, file.estimator) {
            (Some(name), _) => (name, from_flag("estimator")),
            (None, Some(name)) => {
                let place = key_at("estimator", name.span());
                (name.into_inner(), place)
            }
            (None, None) => ("trl".to_owned(), String::new()),
        };
        let Some(advantage) = AdvantageConfig::preset(&estimator) else {
            bail!(
                "{place}: unknown estimator '{estimator}'; expected one of {}",
                scoring::PRESETS.join(", ")
            );
        };

        let duration = |flag: Option<String>,
                        key: Option<Spanned<String>>,
                        name: &str,
                        default: Duration|
         -> anyhow::Result<Duration> {
            let (text, place) = match (flag, key) {
                (Some(text), _) => (text, from_flag(&name.replace('_', "-"))),
                (None, Some(text)) => {
                    let place = key_at(name, text.span());
                    (text.into_inner(), place)
                }
                (None, None) => return Ok(default),
            };
            parse_duration(&text).map_err(|e| anyhow::anyhow!("{place}: {e}"))
        };
        let drain_timeout = duration(
            args.drain_timeout,
            file.drain_timeout,
            "drain_timeout",
            Duration::from_secs(30),
        )?;
        let rollout_timeout = duration(
            args.rollout_timeout,
            file.rollout_timeout,
            "rollout_timeout",
            Duration::from_secs(600),
        )?;

        let mut tools: Vec<ToolConfig> = Vec::new();
        for (i, table) in file.tools.unwrap_or_default().into_iter().enumerate() {
            let place = key_at(&format!("tools[{i}]"), table.span());
            let mut tool = table.into_inner();
            if let Some(program) = tool.command.as_mut().and_then(|argv| argv.first_mut()) {
                *program = program_path(base, program);
            }
            tool.build().map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
            if tools.iter().any(|t| t.name == tool.name) {
                bail!("{place}: a second tool named '{}'", tool.name);
            }
            tools.push(tool);
        }

        let simulator = sim_settings(file.simulator.unwrap_or_default(), &key_at)?;

        Ok(Settings {
            config_file: source.as_ref().map(|s| s.path.clone()),
            servers,
            model: args.model.or(file.model),
            tokenizer,
            chat_template,
            tool_parser: tool_parser.map(|(name, _)| name),
            dataset,
            skip_bad_rows: args.skip_bad_rows || file.skip_bad_rows.unwrap_or(false),
            overwrite: args.overwrite || file.overwrite.unwrap_or(false),
            num_generations,
            max_inflight,
            max_turns,
            max_tokens,
            max_total_tokens: args.max_total_tokens.or(file.max_total_tokens),
            max_model_len: args.max_model_len.or(file.max_model_len),
            sampling,
            rewards,
            estimator,
            advantage,
            groups: args.groups.or(file.groups),
            out: path(args.out, file.out).unwrap_or_else(|| cwd.join("rollouts.jsonl")),
            prompt_mode: args.prompt_mode.or(file.prompt_mode).unwrap_or_default(),
            fork_threshold_tokens: args
                .fork_threshold_tokens
                .or(file.fork_threshold_tokens)
                .unwrap_or(16),
            drain_timeout,
            rollout_timeout,
            min_group_size,
            retries: args.retries.or(file.retries).unwrap_or(1),
            progress: args.progress.or(file.progress).unwrap_or_default(),
            tools,
            simulator,
        })
    }
}

/// The tokenizer directory of `path`, a directory or a tokenizer.json in one.
fn tokenizer_dir(path: PathBuf) -> anyhow::Result<PathBuf> {
    let dir = if path.is_file() {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    } else {
        path
    };
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        if !dir.join(file).is_file() {
            bail!(
                "tokenizer {}: no {file} there; --tokenizer / `tokenizer` names a Hugging Face \
                 tokenizer directory (tokenizer.json and tokenizer_config.json)",
                dir.display()
            );
        }
    }
    Ok(dir)
}

fn check_sampling(sampling: &SamplingParams) -> anyhow::Result<()> {
    if let Some(t) = sampling.temperature
        && !(t.is_finite() && t >= 0.0)
    {
        bail!("temperature must be a number >= 0, got {t}");
    }
    if let Some(p) = sampling.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        bail!("top_p must be in (0, 1], got {p}");
    }
    if let Some(p) = sampling.min_p
        && !(0.0..=1.0).contains(&p)
    {
        bail!("min_p must be in [0, 1], got {p}");
    }
    if let Some(k) = sampling.top_k
        && (k == 0 || k < -1)
    {
        bail!("top_k must be -1 (all tokens) or at least 1, got {k}");
    }
    Ok(())
}

/// A `[[rewards]]` table built: `spec`, or `kind` with the field that kind takes.
fn reward_from_table(table: RewardTable, base: &Path) -> anyhow::Result<Reward> {
    let RewardTable {
        spec,
        kind,
        column,
        pattern,
        program,
        max,
        buffer,
        weight,
    } = table;
    let given = [
        ("column", column.is_some()),
        ("pattern", pattern.is_some()),
        ("program", program.is_some()),
        ("max", max.is_some()),
        ("buffer", buffer.is_some()),
    ];
    let reward = match (spec, kind) {
        (Some(_), Some(_)) => bail!("give `spec` or `kind`, not both"),
        (None, None) => {
            bail!("expected `spec = \"KIND:ARG\"` or `kind = \"...\"` with its field")
        }
        (Some(spec), None) => {
            if let Some((field, _)) = given.iter().find(|(_, present)| *present) {
                bail!("`{field}` goes with `kind`, not with `spec`");
            }
            let spec = match spec.strip_prefix("command:") {
                Some(rest) => {
                    let program = rest.split_whitespace().next().unwrap_or_default();
                    format!(
                        "command:{}{}",
                        program_path(base, program),
                        &rest.trim_start()[program.len()..]
                    )
                }
                None => spec,
            };
            scoring::builtin::from_spec(&spec)?
        }
        (None, Some(kind)) => {
            let wants: &[&str] = match kind.as_str() {
                "numeric" | "exact" => &["column"],
                "regex" => &["pattern"],
                "command" => &["program"],
                "length" => &["max", "buffer"],
                other => bail!(
                    "unknown kind '{other}'; expected numeric, exact, regex, command or length"
                ),
            };
            if let Some((field, _)) = given
                .iter()
                .find(|(field, present)| *present && !wants.contains(field))
            {
                bail!(
                    "`{field}` is not a field of kind \"{kind}\" (it takes {})",
                    wants.join(", ")
                );
            }
            let missing = || anyhow::anyhow!("kind \"{kind}\" needs `{}`", wants[0]);
            match kind.as_str() {
                "numeric" | "exact" => {
                    let column = column.ok_or_else(missing)?;
                    scoring::builtin::from_spec(&format!("{kind}:{column}"))?
                }
                "regex" => {
                    let pattern = pattern.ok_or_else(missing)?;
                    scoring::builtin::from_spec(&format!("regex:{pattern}"))?
                }
                "command" => {
                    let argv = program.ok_or_else(missing)?;
                    let Some((program, args)) = argv.split_first() else {
                        bail!("`program` needs at least the program: [\"./score.py\", ...]");
                    };
                    let stem = Path::new(program)
                        .file_stem()
                        .map_or_else(|| program.clone(), |s| s.to_string_lossy().into_owned());
                    Reward::from_async(
                        format!("command_{stem}"),
                        CommandReward::new(program_path(base, program), args.iter().cloned()),
                    )
                }
                _ => {
                    let max = max.ok_or_else(missing)?;
                    let spec = match buffer {
                        Some(buffer) => format!("length:{max}:{buffer}"),
                        None => format!("length:{max}"),
                    };
                    scoring::builtin::from_spec(&spec)?
                }
            }
        }
    };
    Ok(match weight {
        Some(weight) if !weight.is_finite() => bail!("weight must be a finite number"),
        Some(weight) => reward.weight(weight),
        None => reward,
    })
}

fn sim_settings(
    table: SimTable,
    key_at: &dyn Fn(&str, Range<usize>) -> String,
) -> anyhow::Result<SimSettings> {
    let fraction = |value: Option<Spanned<f64>>, key: &str, default: f64| {
        let Some(value) = value else {
            return Ok(default);
        };
        let place = key_at(key, value.span());
        let value = value.into_inner();
        if !(0.0..=1.0).contains(&value) {
            bail!("{place}: expected a fraction between 0 and 1, got {value}");
        }
        Ok(value)
    };
    let duration = |value: Option<Spanned<String>>, key: &str| {
        let Some(value) = value else {
            return Ok(Duration::ZERO);
        };
        let place = key_at(key, value.span());
        parse_duration(value.get_ref()).map_err(|e| anyhow::anyhow!("{place}: {e}"))
    };
    Ok(SimSettings {
        tool_rounds: table.tool_rounds.unwrap_or(0),
        answer_tokens: table.answer_tokens.unwrap_or(32),
        correct_rate: fraction(table.correct_rate, "simulator.correct_rate", 0.5)?,
        latency: duration(table.latency, "simulator.latency")?,
        per_token: duration(table.per_token, "simulator.per_token")?,
        error_503: fraction(table.error_503, "simulator.error_503", 0.0)?,
        max_model_len: table.max_model_len.unwrap_or(4096),
        fault_seed: table.fault_seed.unwrap_or(0),
    })
}
