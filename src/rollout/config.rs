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
use serde::{Deserialize, Serialize};
use toml::Spanned;
use tool_dispatch::{
    Registry,
    builtin::{ToolConfig, ToolKind, parse_duration},
};
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
    /// How long to wait for the servers: at start, and whenever every server is down
    /// mid-run (admission pauses meanwhile); past it the run drains and exits 1
    /// [default: 10m]
    #[arg(long, value_name = "DURATION")]
    server_wait: Option<String>,
    /// Stop the run (drain, exit 1) once more than this fraction of the rollouts that ended
    /// failed, judged from 16 rollouts on and at the end; failures because no server could be
    /// reached do not count (see --server-wait) [default: 0.5]
    #[arg(long, value_name = "FRACTION")]
    max_failure_rate: Option<f64>,
    /// A PEM file of certificates to trust besides the system's, for https:// servers with
    /// a private CA or a self-signed certificate
    #[arg(long, value_name = "FILE.pem")]
    ca_cert: Option<PathBuf>,
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Deserialize, Serialize)]
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
    /// The reward functions (at least one), each built and as written.
    pub(crate) rewards: Vec<RewardSetting>,
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
    /// How long to wait for a server, at start and mid-run.
    pub(crate) server_wait: Duration,
    /// Failed fraction of rollouts past which the run stops.
    pub(crate) max_failure_rate: f64,
    /// Extra trusted certificates (PEM).
    pub(crate) ca_cert: Option<PathBuf>,
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
    /// The `[environment]` every rollout runs in, if any.
    pub(crate) environment: Option<super::environment::EnvironmentSettings>,
}

/// One reward function: built, as a table that writes it back, and where it was given.
#[derive(Debug, Clone)]
pub(crate) struct RewardSetting {
    /// The function.
    pub(crate) reward: Reward,
    /// As a `[[rewards]]` table (a `--reward` as `spec`), paths absolute.
    table: RewardTable,
    /// `FILE:LINE rewards[i]` or `--reward`, for messages.
    place: String,
}

impl RewardSetting {
    /// Where it was given: `FILE:LINE: rewards[i]` or `--reward SPEC`.
    pub(crate) fn place(&self) -> &str {
        &self.place
    }

    /// The program a `command` reward runs.
    fn program(&self) -> Option<&str> {
        match (&self.table.program, &self.table.spec) {
            (Some(argv), _) => argv.first().map(String::as_str),
            (None, Some(spec)) => spec
                .strip_prefix("command:")
                .and_then(|rest| rest.split_whitespace().next()),
            (None, None) => None,
        }
    }
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
    /// The tool it calls (default: the first of `[[tools]]`).
    pub(crate) tool_name: Option<String>,
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
        if let Some(tool) = &self.tool_name {
            config.tool_name = tool.clone();
        }
    }
}

/// The TOML file, as written (and as `--check` prints the resolved settings back).
#[derive(Debug, Default, Deserialize, Serialize)]
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
    server_wait: Option<Spanned<String>>,
    max_failure_rate: Option<f64>,
    ca_cert: Option<PathBuf>,
    min_group_size: Option<usize>,
    retries: Option<u32>,
    progress: Option<Progress>,
    tools: Option<Vec<Spanned<ToolConfig>>>,
    simulator: Option<SimTable>,
    environment: Option<Spanned<super::environment::EnvironmentTable>>,
}

/// A `[[rewards]]` table: `spec = "KIND:ARG"`, or `kind` with its own field; `name` to tell
/// apart two functions of one kind.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RewardTable {
    name: Option<String>,
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
#[derive(Debug, Default, Deserialize, Serialize)]
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
    tool_name: Option<String>,
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
        config.server_wait = self.server_wait;
        config.max_failure_rate = Some(self.max_failure_rate);
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

    /// The reward functions, built (the environment's `env` column last).
    pub(crate) fn reward_functions(&self) -> Vec<Reward> {
        let mut rewards: Vec<Reward> = self.rewards.iter().map(|r| r.reward.clone()).collect();
        rewards.extend(self.environment.as_ref().map(|e| e.reward()));
        rewards
    }

    /// The settings as a config file that resolves to them again: every key written, paths
    /// absolute. What `--check` prints.
    pub(crate) fn to_toml(&self) -> anyhow::Result<String> {
        let text = |value: String| Spanned::new(0..0, value);
        let duration = |value: Duration| Some(text(format_duration(value)));
        let sim = &self.simulator;
        let file = FileSettings {
            servers: Some(self.servers.clone()),
            model: self.model.clone(),
            tokenizer: Some(self.tokenizer.clone()),
            chat_template: self.chat_template.clone(),
            tool_parser: self.tool_parser.clone().map(text),
            dataset: Some(self.dataset.clone()),
            skip_bad_rows: Some(self.skip_bad_rows),
            overwrite: Some(self.overwrite),
            num_generations: Some(self.num_generations),
            max_inflight: Some(self.max_inflight),
            max_turns: Some(self.max_turns),
            max_tokens: Some(self.max_tokens),
            max_total_tokens: self.max_total_tokens,
            max_model_len: self.max_model_len,
            temperature: self.sampling.temperature,
            top_p: self.sampling.top_p,
            top_k: self.sampling.top_k,
            min_p: self.sampling.min_p,
            seed: self.sampling.seed,
            rewards: Some(
                self.rewards
                    .iter()
                    .map(|r| Spanned::new(0..0, r.table.clone()))
                    .collect(),
            ),
            estimator: Some(text(self.estimator.clone())),
            groups: self.groups,
            out: Some(self.out.clone()),
            fork_threshold_tokens: Some(self.fork_threshold_tokens),
            prompt_mode: Some(self.prompt_mode),
            drain_timeout: duration(self.drain_timeout),
            rollout_timeout: duration(self.rollout_timeout),
            server_wait: duration(self.server_wait),
            max_failure_rate: Some(self.max_failure_rate),
            ca_cert: self.ca_cert.clone(),
            min_group_size: Some(self.min_group_size),
            retries: Some(self.retries),
            progress: Some(self.progress),
            tools: Some(
                self.tools
                    .iter()
                    .map(|t| Spanned::new(0..0, t.clone()))
                    .collect(),
            ),
            simulator: Some(SimTable {
                tool_rounds: Some(sim.tool_rounds),
                answer_tokens: Some(sim.answer_tokens),
                correct_rate: Some(Spanned::new(0..0, sim.correct_rate)),
                latency: duration(sim.latency),
                per_token: duration(sim.per_token),
                error_503: Some(Spanned::new(0..0, sim.error_503)),
                max_model_len: Some(sim.max_model_len),
                fault_seed: Some(sim.fault_seed),
                tool_name: sim.tool_name.clone(),
            }),
            environment: self
                .environment
                .as_ref()
                .map(|e| Spanned::new(0..0, e.to_table())),
        };
        toml::to_string(&file).context("cannot write the settings as TOML")
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

        let environment = match file.environment {
            Some(table) => {
                let place = key_at("environment", table.span());
                Some(super::environment::EnvironmentSettings::resolve(
                    table.into_inner(),
                    base,
                    &place,
                )?)
            }
            None => None,
        };
        let rewards = if args.rewards.is_empty() {
            let mut rewards = Vec::new();
            for (i, table) in file.rewards.unwrap_or_default().into_iter().enumerate() {
                let place = key_at(&format!("rewards[{i}]"), table.span());
                let table = table.into_inner();
                let (reward, table) =
                    reward_from_table(table, base).map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
                rewards.push(RewardSetting {
                    reward,
                    table,
                    place,
                });
            }
            rewards
        } else {
            args.rewards
                .iter()
                .map(|spec| {
                    let reward = scoring::builtin::from_spec(spec)
                        .map_err(|e| anyhow::anyhow!("--reward: {e}"))?;
                    Ok(RewardSetting {
                        reward,
                        table: RewardTable {
                            spec: Some(spec.clone()),
                            ..RewardTable::default()
                        },
                        place: format!("--reward {spec}"),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        };
        for (i, reward) in rewards.iter().enumerate() {
            let name = reward.reward.name();
            if rewards[..i].iter().any(|r| r.reward.name() == name) {
                bail!(
                    "{}: a second reward named '{name}'; give each its own `name = \"...\"` in \
                     its [[rewards]] table{file_name} (rewards given with --reward cannot be \
                     named: list them as [[rewards]] tables instead)",
                    reward.place
                );
            }
            if let Some(program) = reward.program() {
                check_program(program).map_err(|e| anyhow::anyhow!("{}: {e}", reward.place))?;
            }
        }
        if rewards.is_empty() && environment.is_none() {
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
        let server_wait = duration(
            args.server_wait,
            file.server_wait,
            "server_wait",
            Duration::from_secs(600),
        )?;
        for (name, value) in [
            ("rollout_timeout", rollout_timeout),
            ("server_wait", server_wait),
        ] {
            if value.is_zero() {
                bail!(
                    "{name} must be longer than 0s (--{} or `{name}`)",
                    name.replace('_', "-")
                );
            }
        }
        let max_failure_rate = args
            .max_failure_rate
            .or(file.max_failure_rate)
            .unwrap_or(0.5);
        if !(0.0..=1.0).contains(&max_failure_rate) {
            bail!(
                "max_failure_rate must be a fraction between 0 and 1 (--max-failure-rate or \
                 `max_failure_rate`), got {max_failure_rate}"
            );
        }
        let ca_cert = path(args.ca_cert, file.ca_cert);
        if let Some(pem) = &ca_cert {
            let text = std::fs::read(pem)
                .with_context(|| format!("--ca-cert {}: cannot read the file", pem.display()))?;
            vllm_client::Client::new(
                vllm_client::ClientConfig::new("https://localhost").root_certificates_pem(text),
            )
            .map_err(|e| anyhow::anyhow!("--ca-cert {}: {e}", pem.display()))?;
        }

        let mut tools: Vec<ToolConfig> = Vec::new();
        // Built as the run builds them, so that what the registry refuses (an empty name, a
        // schema that is not an object, a name twice) is refused here too.
        let mut registry = Registry::new();
        for (i, table) in file.tools.unwrap_or_default().into_iter().enumerate() {
            let place = key_at(&format!("tools[{i}]"), table.span());
            let mut tool = table.into_inner();
            if let Some(program) = tool.command.as_mut().and_then(|argv| argv.first_mut()) {
                *program = program_path(base, program);
            }
            let built = tool.build().map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
            registry
                .add(built)
                .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
            let program = match tool.kind {
                ToolKind::Command => tool.command.as_ref().and_then(|argv| argv.first()).cloned(),
                ToolKind::Python => Some(
                    tool.interpreter
                        .clone()
                        .unwrap_or_else(|| "python3".to_owned()),
                ),
                ToolKind::Http | ToolKind::Calculator => None,
            };
            if let Some(program) = program {
                check_program(&program).map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
            }
            tools.push(tool);
        }

        let simulator = sim_settings(file.simulator.unwrap_or_default(), &key_at)?;
        if environment.is_some() && !tools.is_empty() {
            bail!(
                "[[tools]] and [environment] together{file_name}: the environment's server \
                 offers the rollout's tools; serve the [[tools]] from it instead, or drop \
                 [environment]"
            );
        }

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
            server_wait,
            max_failure_rate,
            ca_cert,
            min_group_size,
            retries: args.retries.or(file.retries).unwrap_or(1),
            progress: args.progress.or(file.progress).unwrap_or_default(),
            tools,
            simulator,
            environment,
        })
    }
}

/// `500ms`, `30s`, `10m`, `2h`: the largest unit that says `value` exactly, as
/// [`parse_duration`] reads it back.
fn format_duration(value: Duration) -> String {
    let millis = value.as_millis();
    if !millis.is_multiple_of(1000) {
        return format!("{millis}ms");
    }
    let secs = value.as_secs();
    match secs {
        0 => "0s".to_owned(),
        s if s.is_multiple_of(3600) => format!("{}h", s / 3600),
        s if s.is_multiple_of(60) => format!("{}m", s / 60),
        s => format!("{s}s"),
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

/// A `[[rewards]]` table built: `spec`, or `kind` with the field that kind takes; and the
/// table again, its program's path made absolute.
fn reward_from_table(table: RewardTable, base: &Path) -> anyhow::Result<(Reward, RewardTable)> {
    let written = table.clone();
    let RewardTable {
        name,
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
    let (reward, absolute_spec) = match (spec, kind) {
        (Some(_), Some(_)) => bail!("give `spec` or `kind`, not both"),
        (None, None) => {
            bail!("expected `spec = \"KIND:ARG\"` or `kind = \"...\"` with its field")
        }
        (Some(spec), None) => {
            if let Some((field, _)) = given.iter().find(|(_, present)| *present) {
                bail!("`{field}` goes with `kind`, not with `spec`");
            }
            if weight.is_some()
                && spec
                    .rsplit_once('@')
                    .is_some_and(|(_, w)| w.trim().parse::<f64>().is_ok())
            {
                bail!(
                    "the weight is given twice, in `spec` (\"...@WEIGHT\") and as `weight`: \
                     keep one"
                );
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
            let reward = scoring::builtin::from_spec(&spec)?;
            (reward, Some(spec))
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
            let reward = match kind.as_str() {
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
            };
            (reward, None)
        }
    };
    let reward = match weight {
        Some(weight) if !weight.is_finite() => bail!("weight must be a finite number"),
        Some(weight) => reward.weight(weight),
        None => reward,
    };
    let reward = match name {
        Some(name) if name.trim().is_empty() => bail!("`name` must not be empty"),
        Some(name) => reward.named(name),
        None => reward,
    };
    let mut written = written;
    if absolute_spec.is_some() {
        written.spec = absolute_spec;
    }
    if let Some(program) = written.program.as_mut().and_then(|argv| argv.first_mut()) {
        *program = program_path(base, program);
    }
    Ok((reward, written))
}

/// Checks that `program` can be started: a path to a file, or a name found on PATH.
pub(crate) fn check_program(program: &str) -> anyhow::Result<()> {
    let path = Path::new(program);
    let found = if path.components().count() > 1 {
        path.is_file()
    } else {
        std::env::var_os("PATH")
            .is_some_and(|dirs| std::env::split_paths(&dirs).any(|dir| dir.join(path).is_file()))
    };
    if !found {
        bail!(
            "program '{program}' not found: {}",
            if path.components().count() > 1 {
                "no such file"
            } else {
                "not on PATH"
            }
        );
    }
    Ok(())
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
        tool_name: table.tool_name,
    })
}
