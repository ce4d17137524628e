//! `async-grpo rollout`'s settings: declared once, as [`Settings`] (this binary's own) and the
//! engine's [`RolloutConfig`], [`Sampling`] and [`ReconcilerConfig`]; each of those structs is
//! at once the TOML file's keys (serde), the flags (clap, `augment_args_for_update`) and the
//! defaults (`Default`), and the run hands the engine its own struct, not a copy.
//!
//! Layering: the defaults, then the file `--config` names, then the flags given. A flag given
//! wins over the file; a flag not given leaves the file's value alone (the flags are parsed
//! without defaults, and clap's `update_from_arg_matches` sets only what was given). `--server`
//! and `--reward`, repeatable, replace the file's `servers` and `[[rewards]]` when given at all.
//! Paths in the file are relative to the file's directory, paths on the command line to the
//! current directory; [`Resolved`] holds them absolute. Unknown keys, anywhere in the file,
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
use async_grpo_run::rows::{RowsSpec, ServeRows};
use clap::Args;
use files::Shard;
use harness::{agent::ProgramConfig, mcp::McpEnvironment};
use rollout::{RolloutConfig, Sampling, SettingError, field_names};
use rollout_core::ReconcilerConfig;
use scoring::{AdvantageConfig, Credit, Reward, RewardTable};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use tool_dispatch::{
    Registry,
    builtin::{ToolConfig, ToolKind},
};
use vllm_sim::SimSettings;

use super::{
    agent, control, environment,
    programs::{check_program, program_path},
    progress::Mode as Progress,
};
use crate::layered::{Defaults, Layer};

/// `async-grpo rollout`'s command line: where the settings file is, whether to only check,
/// and every setting of [`Settings`] as a flag, to be laid over the file.
#[derive(Debug, Clone, Args)]
pub(crate) struct RolloutArgs {
    /// A TOML file holding the settings, keys named as these flags in snake_case (paths in it
    /// are relative to its directory); a flag given here wins over the file
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Check the settings, print them resolved, and exit without rolling out
    #[arg(long)]
    pub(crate) check: bool,
    #[command(flatten)]
    flags: Layer<Settings>,
}

impl Defaults for Settings {
    fn defaults_table() -> toml::Table {
        settings_table(&Settings::default()).unwrap_or_default()
    }
}

/// The binary's own settings; `engine` holds the rollout loop's. Each field is a key of the
/// file and, but for the tables, a flag (its doc comment is the flag's help).
#[derive(Debug, Clone, Args, Deserialize, Serialize)]
#[serde(default)]
pub(crate) struct Settings {
    /// A vLLM server's base URL, e.g. http://127.0.0.1:8000 (repeat for replicas); without
    /// any, the built-in simulator answers (scripted, not a model)
    #[arg(long = "server", value_name = "URL")]
    pub(crate) servers: Vec<String>,
    /// The model name the servers serve (default: the first one they list)
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    /// The tokenizer: a directory holding tokenizer.json and tokenizer_config.json, or a
    /// tokenizer.json whose directory holds the config (required)
    #[arg(long, value_name = "PATH")]
    pub(crate) tokenizer: PathBuf,
    /// A chat template (.jinja) to use instead of the tokenizer's own
    #[arg(long, value_name = "PATH")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) chat_template: Option<PathBuf>,
    /// The tool-call format: hermes, qwen3_coder, llama3_json or mistral (default: detected
    /// from the chat template)
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_parser: Option<String>,
    /// The prompts: JSON Lines (.jsonl) or Parquet (.parquet, as Hugging Face datasets writes
    /// it) of {"prompt": text or messages, ...columns} (required)
    #[arg(long, value_name = "FILE")]
    pub(crate) dataset: PathBuf,
    /// How many passes over the dataset (each shuffled anew with --shuffle)
    #[arg(long, value_name = "N")]
    pub(crate) epochs: u64,
    /// Roll the rows out in an order shuffled with --seed (0 without one), the same for
    /// every run, resume and shard of those settings
    #[arg(long)]
    pub(crate) shuffle: bool,
    /// Roll out only shard I of N (I from 0): the rows whose index modulo N is I, so that N
    /// workers share a dataset without overlap; group ids stay those of the whole dataset
    #[arg(long, value_name = "I/N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) shard: Option<Shard>,
    /// Where the training rows go: JSON Lines (.jsonl), Parquet (.parquet, written when the
    /// run ends), or - for JSON Lines on stdout
    #[arg(long, value_name = "FILE")]
    pub(crate) out: PathBuf,
    /// Replace the output file when it exists (else a run refuses to start rather than lose
    /// rows written before)
    #[arg(long)]
    pub(crate) overwrite: bool,
    /// Continue a run that was stopped or killed: the groups already in --out are kept and
    /// their rows not rolled out again, a group cut mid-write is dropped (and said), and new
    /// groups are appended
    #[arg(long)]
    pub(crate) resume: bool,
    /// Serve the control endpoint on this address (PORT or HOST:PORT; 127.0.0.1 when no
    /// host is given): /health, /metrics (Prometheus), POST /model_version, /pause, /resume.
    /// An address other machines reach wants --listen-token
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) listen: Option<String>,
    /// A bearer token every control request but /health must carry (Authorization: Bearer
    /// TOKEN; not empty, no spaces); also read from ASYNC_GRPO_LISTEN_TOKEN. Without one,
    /// POST /model_version moves the version by at most 1000000 at a time
    #[arg(
        long,
        value_name = "TOKEN",
        env = "ASYNC_GRPO_LISTEN_TOKEN",
        hide_env_values = true
    )]
    #[serde(skip_serializing)]
    pub(crate) listen_token: Option<String>,
    /// Serve the training rows live on this address (PORT or HOST:PORT; 127.0.0.1 when no
    /// host is given) over Apache Arrow Flight: each group a record batch, held until a
    /// trainer acknowledges it, every group to one reader. An address
    /// other machines reach wants --serve-rows-token
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) serve_rows: Option<String>,
    /// The bearer token every call to the row stream must carry (not empty, no spaces);
    /// also read from ASYNC_GRPO_ROWS_TOKEN
    #[arg(
        long,
        value_name = "TOKEN",
        env = "ASYNC_GRPO_ROWS_TOKEN",
        hide_env_values = true
    )]
    #[serde(skip_serializing)]
    pub(crate) serve_rows_token: Option<String>,
    /// With --serve-rows: the groups held unacknowledged at most; past it, admission waits
    /// for the trainer
    #[arg(long, value_name = "N")]
    pub(crate) serve_rows_capacity: usize,
    /// With --serve-rows: serve TLS only (clients connect to grpc+tls://) with this PEM
    /// certificate (chain); needs --serve-rows-key
    #[arg(long, value_name = "FILE.pem", requires = "serve_rows_key")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) serve_rows_cert: Option<PathBuf>,
    /// The PEM private key of --serve-rows-cert
    #[arg(long, value_name = "FILE.pem", requires = "serve_rows_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) serve_rows_key: Option<PathBuf>,
    /// A reward function: numeric:COLUMN, exact:COLUMN, regex:PATTERN, command:PROGRAM or
    /// length:MAX, each with an optional @WEIGHT (repeat for several; at least one)
    #[arg(long = "reward", value_name = "SPEC", value_parser = RewardTable::from_spec)]
    pub(crate) rewards: Vec<RewardTable>,
    /// The advantage estimator: trl, grpo, dr_grpo, rloo or batch
    #[arg(long, value_name = "NAME")]
    pub(crate) estimator: String,
    /// What an advantage is given to: episode (one per rollout, from its reward) or turn (one
    /// per assistant turn, from the turn's discounted return of step rewards and the reward;
    /// rows get advantage_spans)
    #[arg(long, value_name = "CREDIT")]
    pub(crate) credit: String,
    /// With credit = "turn": the discount per turn, from 0 to 1
    #[arg(long, value_name = "GAMMA")]
    pub(crate) gamma: f64,
    /// Threads that run sync tools and environment sessions (started on demand; async tools
    /// need none); default: one per rollout in flight (--max-inflight), at most 512
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tool_threads: Option<usize>,
    /// On Ctrl-C, how long rollouts in flight may take to finish, e.g. 30s
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub(crate) drain_timeout: Duration,
    /// A PEM file of certificates to trust besides the system's, for https:// servers with a
    /// private CA or a self-signed certificate
    #[arg(long, value_name = "FILE.pem")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ca_cert: Option<PathBuf>,
    /// How progress shows: a bar on a terminal, log lines otherwise (auto), or off
    #[arg(long, value_name = "MODE")]
    pub(crate) progress: Progress,
    /// The tools (`[[tools]]` tables; file only).
    #[arg(skip)]
    pub(crate) tools: Vec<ToolConfig>,
    /// The `[environment]` every rollout runs in, if any (file only).
    #[arg(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) environment: Option<McpEnvironment>,
    /// The loop-owning `[agent]` that runs every rollout, if any (file only).
    #[arg(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<ProgramConfig>,
    /// The simulator's behaviour (`[simulator]`; file only; used only without servers).
    #[arg(skip)]
    pub(crate) simulator: SimSettings,
    /// The rollout loop's settings, read from the same table of the file.
    #[command(flatten)]
    #[serde(skip)]
    pub(crate) engine: RolloutConfig,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            servers: Vec::new(),
            model: None,
            tokenizer: PathBuf::new(),
            chat_template: None,
            tool_parser: None,
            dataset: PathBuf::new(),
            epochs: 1,
            shuffle: false,
            shard: None,
            out: PathBuf::from("rollouts.jsonl"),
            overwrite: false,
            resume: false,
            listen: None,
            listen_token: None,
            serve_rows: None,
            serve_rows_token: None,
            serve_rows_capacity: async_grpo_run::rows::DEFAULT_CAPACITY,
            serve_rows_cert: None,
            serve_rows_key: None,
            rewards: Vec::new(),
            estimator: "trl".to_owned(),
            credit: "episode".to_owned(),
            gamma: 1.0,
            tool_threads: None,
            drain_timeout: Duration::from_secs(30),
            ca_cert: None,
            progress: Progress::Auto,
            tools: Vec::new(),
            environment: None,
            agent: None,
            simulator: SimSettings::default(),
            engine: RolloutConfig::default(),
        }
    }
}

/// One reward function, built, and where it was given.
#[derive(Debug, Clone)]
pub(crate) struct RewardSetting {
    /// The function.
    pub(crate) reward: Reward,
    /// `FILE:LINE: rewards[i]` or `--reward SPEC`, for messages.
    place: String,
}

impl RewardSetting {
    /// Where it was given: `FILE:LINE: rewards[i]` or `--reward SPEC`.
    pub(crate) fn place(&self) -> &str {
        &self.place
    }
}

/// The settings of a run: every layer merged, paths absolute, every value checked, and what
/// they describe built.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    /// The settings; `settings.engine` is the loop's configuration as the engine takes it.
    pub(crate) settings: Settings,
    /// The reward functions (at least one), in the order given.
    pub(crate) rewards: Vec<RewardSetting>,
    /// The file the settings came from, if any.
    pub(crate) config_file: Option<PathBuf>,
    /// The row stream, checked and its PEM files read, when `--serve-rows` asks for one.
    pub(crate) rows: Option<ServeRows>,
}

impl Resolved {
    /// The sandbox every program the policy drives starts from: the run's own files (dataset,
    /// output and its journal, configuration) hidden. Each table changes it as it says.
    pub(crate) fn sandbox(&self) -> process::Sandbox {
        run_sandbox(&self.settings, self.config_file.as_deref())
    }

    /// The reward functions, built (the environment's `env` column last).
    pub(crate) fn reward_functions(&self) -> Vec<Reward> {
        let mut rewards: Vec<Reward> = self.rewards.iter().map(|r| r.reward.clone()).collect();
        rewards.extend(self.settings.environment.as_ref().map(environment::reward));
        rewards.extend(self.settings.agent.as_ref().and_then(agent::reward));
        rewards
    }

    /// The settings as a config file that resolves to them again: every key written, paths
    /// absolute. What `--check` prints.
    pub(crate) fn to_toml(&self) -> anyhow::Result<String> {
        // Layer by layer, each as serde writes it (an f32 stays `0.2`), the engine's plain
        // keys before this binary's, whose tables come last.
        let engine = &self.settings.engine;
        let layers = [
            toml::to_string(engine),
            toml::to_string(&engine.sampling),
            toml::to_string(&engine.reconciler),
            toml::to_string(&self.settings),
        ];
        let mut text = String::new();
        for layer in layers {
            text.push_str(&layer.context("cannot write the settings as TOML")?);
        }
        Ok(text)
    }
}

/// Every layer of `settings` as one table, as the file holds them.
fn settings_table(settings: &Settings) -> Result<toml::Table, toml::ser::Error> {
    let mut table = toml::Table::try_from(settings)?;
    let engine = &settings.engine;
    for layer in [
        toml::Table::try_from(engine)?,
        toml::Table::try_from(engine.sampling)?,
        toml::Table::try_from(engine.reconciler)?,
    ] {
        table.extend(layer);
    }
    Ok(table)
}

/// How a refusal of the row stream says to set its token.
const SET_ROWS_TOKEN: &str = "--serve-rows-token TOKEN or ASYNC_GRPO_ROWS_TOKEN";

impl Settings {
    /// The row stream's settings, when `--serve-rows` asks for one.
    fn rows_spec(&self) -> Option<RowsSpec> {
        let address = self.serve_rows.clone()?;
        Some(RowsSpec {
            address,
            token: self.serve_rows_token.clone(),
            capacity: self.serve_rows_capacity,
            certificate: self.serve_rows_cert.clone(),
            key: self.serve_rows_key.clone(),
        })
    }

    /// Whether the rows go to stdout (`--out -`).
    pub(crate) fn writes_stdout(&self) -> bool {
        self.out.as_os_str() == "-"
    }

    /// Lays the file `--config` names and the flags given over the defaults, makes paths
    /// absolute, checks every value and builds the rewards and tools once to prove them.
    pub(crate) fn resolve(args: RolloutArgs) -> anyhow::Result<Resolved> {
        let cwd = std::env::current_dir().context("cannot read the current directory")?;
        let source = args.config.as_deref().map(Source::read).transpose()?;
        let mut settings = match &source {
            Some(source) => source.settings()?,
            None => Settings::default(),
        };
        args.flags.lay_over(&mut settings)?;
        let places = Places {
            source: source.as_ref(),
            flags: &args.flags,
        };
        let base = source.as_ref().map_or(cwd.as_path(), |s| s.dir.as_path());
        settings.make_paths_absolute(&places, &cwd, base);

        let file_name = source
            .as_ref()
            .map_or_else(String::new, |s| format!(" in {}", s.path.display()));
        settings.check_paths(&file_name)?;
        settings.check_values(&places)?;
        let rows = settings
            .rows_spec()
            .map(|spec| spec.resolve(SET_ROWS_TOKEN))
            .transpose()
            .map_err(|e| anyhow::anyhow!("{}: {}", places.of(e.key), e.message))?;
        settings.check_tables(&places, base, &file_name)?;
        let sandbox = run_sandbox(&settings, source.as_ref().map(|s| s.path.as_path()));
        let rewards = build_rewards(&settings, &places, base, &file_name, &sandbox)?;
        check_tools(&settings.tools, &places)?;
        check_simulator(&settings.simulator, &places)?;
        Ok(Resolved {
            settings,
            rewards,
            config_file: source.map(|s| s.path),
            rows,
        })
    }

    /// Checks every plain value: servers, parser, estimator (its advantages set), the
    /// engine's settings, epochs, resume, the control endpoint, tool threads, the CA file.
    fn check_values(&mut self, places: &Places<'_>) -> anyhow::Result<()> {
        for server in &self.servers {
            if !(server.starts_with("http://") || server.starts_with("https://")) {
                bail!("server '{server}' must start with http:// or https://");
            }
        }
        if let Some(name) = &self.tool_parser {
            rollout_core::parse::parser_by_name(name)
                .map_err(|e| anyhow::anyhow!("{}: {e}", places.of("tool_parser")))?;
        }
        let Some(advantages) = AdvantageConfig::preset(&self.estimator) else {
            bail!(
                "{}: unknown estimator '{}'; expected one of {}",
                places.of("estimator"),
                self.estimator,
                scoring::PRESETS.join(", ")
            );
        };
        if !(0.0..=1.0).contains(&self.gamma) {
            bail!(
                "{}: gamma must be a number from 0 to 1, got {}",
                places.of("gamma"),
                self.gamma
            );
        }
        let credit = match self.credit.as_str() {
            "episode" => Credit::Episode,
            "turn" => Credit::Turn { gamma: self.gamma },
            other => bail!(
                "{}: unknown credit '{other}'; expected episode or turn",
                places.of("credit")
            ),
        };
        self.engine.advantages = AdvantageConfig {
            credit,
            ..advantages
        };
        self.engine
            .validate()
            .map_err(|e| anyhow::anyhow!("{}", places.problem(&e)))?;
        if self.epochs == 0 {
            bail!("{}: epochs must be at least 1", places.of("epochs"));
        }
        if self.resume && self.overwrite {
            bail!(
                "{} and {} together: --resume keeps the rows of --out, --overwrite replaces \
                     them; give one",
                places.of("resume"),
                places.of("overwrite")
            );
        }
        if self.resume && self.writes_stdout() {
            bail!(
                "{}: --resume reads back what --out holds, and --out - (stdout) holds nothing \
                     to read",
                places.of("resume")
            );
        }
        if let Some(listen) = &self.listen {
            let address = async_grpo_run::listen::listen_address(listen, control::SET_TOKEN)
                .map_err(|e| anyhow::anyhow!("{}: {e}", places.of("listen")))?;
            if let Some(token) = &self.listen_token {
                control::check_token(token).map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            control::check_address(address, self.listen_token.is_some())
                .map_err(|e| anyhow::anyhow!("{}: {e}", places.of("listen")))?;
        }
        if self.serve_rows.is_none()
            && (self.serve_rows_cert.is_some() || self.serve_rows_key.is_some())
        {
            bail!(
                "{}: a certificate for the row stream, but no --serve-rows",
                places.of("serve_rows_cert")
            );
        }
        if self.tool_threads == Some(0) {
            bail!(
                "{}: tool_threads must be at least 1",
                places.of("tool_threads")
            );
        }
        if let Some(pem) = &self.ca_cert {
            let text = std::fs::read(pem)
                .with_context(|| format!("--ca-cert {}: cannot read the file", pem.display()))?;
            vllm_client::Client::new(
                vllm_client::ClientConfig::new("https://localhost").root_certificates_pem(text),
            )
            .map_err(|e| anyhow::anyhow!("--ca-cert {}: {e}", pem.display()))?;
        }
        Ok(())
    }

    /// Checks `[environment]` and `[agent]` (programs beside the file made absolute from
    /// `base`) and what they cannot be combined with.
    fn check_tables(
        &mut self,
        places: &Places<'_>,
        base: &Path,
        file_name: &str,
    ) -> anyhow::Result<()> {
        if let Some(table) = &mut self.environment {
            let place = places
                .source
                .and_then(|s| s.place(&["environment"]))
                .unwrap_or_else(|| "environment".to_owned());
            environment::check(table, base, &place)?;
            if !self.tools.is_empty() {
                bail!(
                    "[[tools]] and [environment] together{file_name}: the environment's server \
                         offers the rollout's tools; serve the [[tools]] from it instead, or drop \
                         [environment]"
                );
            }
        }
        if let Some(table) = &mut self.agent {
            let place = places
                .source
                .and_then(|s| s.place(&["agent"]))
                .unwrap_or_else(|| "agent".to_owned());
            agent::check(table, base, &place)?;
            if !self.tools.is_empty() {
                bail!(
                    "[agent] with [[tools]]{file_name}: a loop-owning agent brings its own \
                         tools and runs them itself; drop the [[tools]]"
                );
            }
            if self.environment.is_some() && table.verifies() {
                bail!(
                    "[agent] verify with [environment]{file_name}: the environment's verify \
                         judges the agent's transcript; drop one of the two"
                );
            }
        }
        Ok(())
    }

    /// A flag's path against the current directory, the file's against the file's
    /// directory; programs named by a relative path with a directory part too.
    fn make_paths_absolute(&mut self, places: &Places<'_>, cwd: &Path, base: &Path) {
        // A default path (`out`) is the current directory's, like a flag's.
        let against = |key: &str| {
            let in_file = places.source.is_some_and(|s| s.place(&[key]).is_some());
            if in_file && !places.given(key) {
                base
            } else {
                cwd
            }
        };
        let absolute = |path: &mut PathBuf, key: &str| {
            if !path.as_os_str().is_empty() {
                *path = against(key).join(&*path);
            }
        };
        absolute(&mut self.tokenizer, "tokenizer");
        absolute(&mut self.dataset, "dataset");
        if !self.writes_stdout() {
            absolute(&mut self.out, "out");
        }
        if let Some(path) = &mut self.chat_template {
            absolute(path, "chat_template");
        }
        if let Some(path) = &mut self.ca_cert {
            absolute(path, "ca_cert");
        }
        if let Some(path) = &mut self.serve_rows_cert {
            absolute(path, "serve_rows_cert");
        }
        if let Some(path) = &mut self.serve_rows_key {
            absolute(path, "serve_rows_key");
        }
        for tool in &mut self.tools {
            if let ToolKind::Command(command) = &mut tool.kind
                && let Some(program) = command.command.first_mut()
            {
                *program = program_path(base, program);
            }
        }
        if !places.given("rewards") {
            for table in &mut self.rewards {
                table.make_program_absolute(base);
            }
        }
    }

    /// The tokenizer, the template and the dataset exist.
    fn check_paths(&mut self, file_name: &str) -> anyhow::Result<()> {
        if self.tokenizer.as_os_str().is_empty() {
            bail!(
                "no tokenizer: set --tokenizer PATH or `tokenizer = \"PATH\"`{file_name} (a \
                 directory with tokenizer.json and tokenizer_config.json, whose chat template \
                 renders the conversations)"
            );
        }
        self.tokenizer = tokenizer_dir(std::mem::take(&mut self.tokenizer))?;
        if let Some(template) = &self.chat_template
            && !template.is_file()
        {
            bail!("chat template {}: no such file", template.display());
        }
        if self.dataset.as_os_str().is_empty() {
            bail!(
                "no dataset: set --dataset FILE.jsonl or `dataset = \"FILE.jsonl\"`{file_name} \
                 (JSON Lines of {{\"prompt\": ..., ...columns}})"
            );
        }
        if !self.dataset.is_file() {
            bail!("dataset {}: no such file", self.dataset.display());
        }
        Ok(())
    }
}

/// Where each setting's value came from, to point messages at it.
struct Places<'a> {
    source: Option<&'a Source>,
    flags: &'a Layer<Settings>,
}

impl Places<'_> {
    /// Whether the setting `key` (a field name) was given as a flag.
    fn given(&self, key: &str) -> bool {
        self.flags.given(match key {
            "groups" => "max_groups",
            other => other,
        })
    }

    /// `--flag`, `FILE:LINE: key` or `key`: where the value of `key` was given.
    fn of(&self, key: &str) -> String {
        if self.given(key) {
            return match key {
                "servers" => "--server".to_owned(),
                "rewards" => "--reward".to_owned(),
                other => format!("--{}", other.replace('_', "-")),
            };
        }
        match self.source.and_then(|s| s.place(&[key])) {
            Some(place) => place,
            None => key.to_owned(),
        }
    }

    /// A refused engine setting, said with where its value came from.
    fn problem(&self, error: &SettingError) -> String {
        let Some(key) = error.key.as_deref() else {
            return error.problem.clone();
        };
        let place = self.of(key);
        if place == key {
            error.to_string()
        } else {
            format!("{place}: {}", error.problem)
        }
    }
}

/// The sandbox every program the policy drives starts from: the run's own files (dataset,
/// output and its journal, the configuration file) hidden.
fn run_sandbox(settings: &Settings, config_file: Option<&Path>) -> process::Sandbox {
    let mut sandbox = process::Sandbox::default()
        .hide(&settings.dataset)
        .hide(&settings.out)
        .hide(files::output::journal_path(&settings.out));
    if let Some(file) = config_file {
        sandbox = sandbox.hide(file);
    }
    sandbox
}

/// The rewards: each built once (to refuse a bad one now), named apart, their programs found.
fn build_rewards(
    settings: &Settings,
    places: &Places<'_>,
    base: &Path,
    file_name: &str,
    sandbox: &process::Sandbox,
) -> anyhow::Result<Vec<RewardSetting>> {
    let from_flags = places.given("rewards");
    // A judge or a reward service over TLS trusts what `--server` trusts.
    let roots = match &settings.ca_cert {
        Some(pem) => Some(
            std::fs::read(pem)
                .with_context(|| format!("--ca-cert {}: cannot read the file", pem.display()))?,
        ),
        None => None,
    };
    let mut rewards: Vec<RewardSetting> = Vec::new();
    for (i, table) in settings.rewards.iter().enumerate() {
        let place = match (table.spec(), from_flags) {
            (Some(spec), true) => format!("--reward {spec}"),
            _ => places
                .source
                .and_then(|s| s.place_in_array("rewards", i))
                .unwrap_or_else(|| format!("rewards[{i}]")),
        };
        let reward = table.build(base, sandbox, roots.as_deref()).map_err(|e| {
            let place = if from_flags {
                "--reward"
            } else {
                place.as_str()
            };
            anyhow::anyhow!("{place}: {e}")
        })?;
        let name = reward.name();
        if rewards.iter().any(|r| r.reward.name() == name) {
            bail!(
                "{place}: a second reward named '{name}'; give each its own `name = \"...\"` in \
                 its [[rewards]] table{file_name} (rewards given with --reward cannot be \
                 named: list them as [[rewards]] tables instead)"
            );
        }
        if let Some(program) = table.program() {
            check_program(program).map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        }
        rewards.push(RewardSetting { reward, place });
    }
    let verified = settings.environment.is_some()
        || settings.agent.as_ref().is_some_and(ProgramConfig::verifies);
    if rewards.is_empty() && !verified {
        bail!(
            "no reward function: a run without rewards has nothing to train on; add \
             --reward numeric:answer (or exact:COLUMN, regex:PATTERN, command:PROGRAM, \
             length:MAX) or a [[rewards]] table with spec = \"numeric:answer\"{file_name}"
        );
    }
    Ok(rewards)
}

/// Each tool built as the run builds it, so that what the registry refuses (an empty name,
/// a schema that is not an object, a name twice) is refused here too; programs found.
fn check_tools(tools: &[ToolConfig], places: &Places<'_>) -> anyhow::Result<()> {
    let mut registry = Registry::new();
    for (i, tool) in tools.iter().enumerate() {
        let place = places
            .source
            .and_then(|s| s.place_in_array("tools", i))
            .unwrap_or_else(|| format!("tools[{i}]"));
        // Sized for no rollout: a session-backed tool starts no interpreter for a check.
        let built = tool
            .build_for(&process::Sandbox::default(), 0)
            .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        if let Some(sandbox) = tool.sandbox_in(&process::Sandbox::default()) {
            sandbox
                .check()
                .map_err(|e| anyhow::anyhow!("{place} (tool '{}'): {e}", tool.name))?;
        }
        registry
            .add(built)
            .map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        if let Some(program) = tool.program() {
            check_program(program).map_err(|e| anyhow::anyhow!("{place}: {e}"))?;
        }
    }
    Ok(())
}

/// The simulator's fractions are fractions.
fn check_simulator(simulator: &SimSettings, places: &Places<'_>) -> anyhow::Result<()> {
    simulator.validate().map_err(|e| {
        let key = e.key.as_deref().unwrap_or_default();
        let place = places
            .source
            .and_then(|s| s.place(&["simulator", key]))
            .unwrap_or_else(|| format!("simulator.{key}"));
        anyhow::anyhow!("{place}: {}", e.problem)
    })
}

/// The file being read: its path, text and directory, to point errors at lines.
#[derive(Debug)]
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

    /// Every layer of the file: this binary's settings and the engine's, each read from the
    /// whole file (a layer ignores the others' keys); a key no layer knows is an error.
    fn settings(&self) -> anyhow::Result<Settings> {
        let mut settings: Settings = self.layer()?;
        settings.engine = self.layer()?;
        settings.engine.sampling = self.layer()?;
        settings.engine.reconciler = self.layer()?;
        let known: Vec<&str> = [
            field_names::<Settings>(),
            field_names::<RolloutConfig>(),
            field_names::<Sampling>(),
            field_names::<ReconcilerConfig>(),
        ]
        .concat();
        let table = toml::de::DeTable::parse(&self.text).map_err(|e| self.error(&e))?;
        for (key, _) in table.get_ref() {
            if !known.contains(&key.get_ref().as_ref()) {
                bail!(
                    "{}: unknown field `{}`, expected one of {}",
                    self.at(key.span()),
                    key.get_ref(),
                    known
                        .iter()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        Ok(settings)
    }

    /// One layer, read from the whole file.
    fn layer<T: DeserializeOwned>(&self) -> anyhow::Result<T> {
        toml::from_str(&self.text).map_err(|error| self.error(&error))
    }

    fn error(&self, error: &toml::de::Error) -> anyhow::Error {
        let message = error.message().trim_end();
        let place = error.span().map_or_else(
            || self.path.display().to_string(),
            |span| self.at(self.unknown_key(message, span.start).unwrap_or(span)),
        );
        anyhow::anyhow!("{place}: {message}")
    }

    /// Where the key an error about an unknown or misplaced key names is ("unknown field
    /// `K`", "`K` is not a field of kind ..."), for an error toml reports at `table` (where
    /// the table, or the first of an array of tables, starts). A table read by kind, or with
    /// flattened keys (the sandbox keys), reports such a key at the table, not at the key:
    /// this finds the key in the first table from there that has it (the tool the message
    /// names, when it names one by `tool 'NAME'`).
    fn unknown_key(&self, message: &str, table: usize) -> Option<Range<usize>> {
        let key = match message.split_once("unknown field `") {
            Some((_, rest)) => rest.split_once('`')?.0,
            None => {
                let (before, _) = message.split_once("` is not a field of kind")?;
                before.rsplit_once('`')?.1
            }
        };
        let tool = message
            .split_once("tool '")
            .and_then(|(_, rest)| rest.split_once('\''))
            .map(|(name, _)| name);
        let document = toml::de::DeTable::parse(&self.text).ok()?;
        let mut tables = Vec::new();
        collect_tables(document.get_ref(), &mut tables);
        tables
            .into_iter()
            .filter(|t| t.1 >= table)
            .filter(|t| {
                tool.is_none_or(|name| {
                    t.0.get("name")
                        .and_then(|v| v.get_ref().as_str())
                        .is_some_and(|n| n == name)
                })
            })
            .find_map(|(t, _)| t.get_key_value(key).map(|(k, _)| k.span()))
    }

    /// `FILE:LINE: a.b` for the key at `path` (tables, then the key), if the file has it.
    fn place(&self, path: &[&str]) -> Option<String> {
        let table = toml::de::DeTable::parse(&self.text).ok()?;
        let mut table = table.get_ref();
        let (last, tables) = path.split_last()?;
        for key in tables {
            match table.get(*key)?.get_ref() {
                toml::de::DeValue::Table(inner) => table = inner,
                _ => return None,
            }
        }
        let (key, _) = table.get_key_value(*last)?;
        Some(format!("{}: {}", self.at(key.span()), path.join(".")))
    }

    /// `FILE:LINE: name[i]` for the `i`th table of the array `name`, if the file has it.
    fn place_in_array(&self, name: &str, i: usize) -> Option<String> {
        let table = toml::de::DeTable::parse(&self.text).ok()?;
        let toml::de::DeValue::Array(items) = table.get_ref().get(name)?.get_ref() else {
            return None;
        };
        let item = items.get(i)?;
        Some(format!("{}: {name}[{i}]", self.at(item.span())))
    }
}

/// Every table under `table` (tables, and the tables of arrays), with where each starts.
fn collect_tables<'a>(
    table: &'a toml::de::DeTable<'a>,
    into: &mut Vec<(&'a toml::de::DeTable<'a>, usize)>,
) {
    for (_, value) in table {
        match value.get_ref() {
            toml::de::DeValue::Table(inner) => {
                into.push((inner, value.span().start));
                collect_tables(inner, into);
            }
            toml::de::DeValue::Array(items) => {
                for item in items {
                    if let toml::de::DeValue::Table(inner) = item.get_ref() {
                        into.push((inner, item.span().start));
                        collect_tables(inner, into);
                    }
                }
            }
            _ => {}
        }
    }
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    Ok(cwd.join(path))
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

#[cfg(test)]
mod tests {
    use clap::Args;

    use super::*;

    #[test]
    fn the_help_shows_the_defaults_of_the_default_impls() {
        let command = RolloutArgs::augment_args(clap::Command::new("rollout"));
        let help = |long: &str| {
            command
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_help().map(ToString::to_string))
                .unwrap_or_default()
        };
        let defaults = RolloutConfig::default();
        assert!(
            help("max-inflight").ends_with(&format!("[default: {}]", defaults.max_inflight)),
            "{}",
            help("max-inflight")
        );
        assert!(help("rollout-timeout").ends_with("[default: 10m]"));
        assert!(help("estimator").ends_with("[default: trl]"));
        assert!(help("groups").find("[default").is_none());
    }
}
