//! [`RewardTable`]: a reward function described by its settings, built by the same code
//! wherever it is given (the binary's `[[rewards]]` tables and `--reward` flags, the bridge's
//! reward specs).
//!
//! A table is `spec = "KIND:ARG"`, or `kind` with that kind's settings: one struct per kind
//! ([`RewardKind`]), read with its own keys only, so a key of another kind, a key of no kind
//! and a missing key are each refused by name when the table is read. Adding a kind is one
//! struct with its [`build`](Kind::build) and one line of [`kinds!`].

use std::{collections::BTreeMap, path::Path};

use process::program_path;
use serde::{
    Deserialize, Deserializer, Serialize,
    de::{DeserializeOwned, Error as _},
};
use serde_json::{Map, Value};

use settings::{
    Kinds, SettingError, field_names, read_kind, read_struct, read_with_part, refuse_unknown, take,
};

use crate::{Reward, builtin};

macro_rules! error {
    ($($words:tt)*) => {
        SettingError::new(format!($($words)*))
    };
}

macro_rules! bail {
    ($($words:tt)*) => {
        return Err(error!($($words)*))
    };
}

macro_rules! from_error {
    ($($error:ty),*) => {
        $(impl From<$error> for SettingError {
            fn from(error: $error) -> SettingError {
                SettingError::new(error.to_string())
            }
        })*
    };
}

from_error!(
    builtin::SpecError,
    builtin::LengthPenaltyError,
    builtin::ServiceError,
    builtin::JudgeError
);

/// A reward function described by its settings, as a config file's `[[rewards]]` table or a
/// bridge's reward spec: `spec = "KIND:ARG"`, or `kind` with the fields that kind takes;
/// `name` to tell apart two functions of one kind, `weight` for its share of the reward.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RewardTable {
    /// The function's name (metrics read `rewards/NAME`); the kind's own name by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What the function is.
    #[serde(flatten)]
    pub source: RewardSource,
    /// The column's weight in the combined reward (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// What a [`RewardTable`] describes: a spec, or a kind with its settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum RewardSource {
    /// `spec = "KIND:ARG[@WEIGHT]"`, as `--reward` takes it.
    Spec {
        /// The function as `--reward` takes it, `KIND:ARG[@WEIGHT]` (`"numeric:answer"`,
        /// `"exact:answer@0.5"`), instead of `kind` and its keys.
        spec: String,
    },
    /// `kind = "..."` with that kind's settings.
    Kind(Box<RewardKind>),
}

/// What building a table's reward needs of the run.
#[derive(Debug, Clone, Copy)]
pub struct BuildContext<'a> {
    /// The directory a `command` program's relative path is from.
    pub base: &'a Path,
    /// The run's sandbox, which a sandboxed `command` starts from.
    pub sandbox: &'a process::Sandbox,
    /// PEM certificates an `https://` service is trusted by too.
    pub roots: Option<&'a [u8]>,
}

/// The settings of one kind of reward: the keys it reads (a serde struct's), and the reward
/// they build.
trait Kind: Serialize + Sized {
    /// The keys this kind reads.
    fn fields() -> Vec<&'static str>;
    /// The settings from a table's keys (those of this kind only).
    fn read(map: Map<String, Value>) -> Result<Self, SettingError>;
    /// The reward of kind `kind` (two kinds may share one struct of settings).
    fn build(&self, kind: &'static str, at: BuildContext<'_>) -> Result<Reward, SettingError>;
}

/// A plain kind: its struct read as it is.
macro_rules! plain_kind {
    ($($settings:ty),*) => {
        $(impl Kind for $settings {
            fn fields() -> Vec<&'static str> {
                field_names::<$settings>().to_vec()
            }
            fn read(map: Map<String, Value>) -> Result<Self, SettingError> {
                read_struct(map)
            }
            fn build(&self, kind: &'static str, at: BuildContext<'_>) -> Result<Reward, SettingError> {
                <$settings>::build_reward(self, kind, at)
            }
        })*
    };
}

/// Every kind, once: the enum, its names, how each is read and built.
macro_rules! kinds {
    ($($(#[$doc:meta])* $variant:ident($name:literal, $settings:ty),)*) => {
        /// A reward kind with its settings, by its `kind` name.
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
        #[serde(tag = "kind")]
        pub enum RewardKind {
            $($(#[$doc])* #[serde(rename = $name)] $variant($settings),)*
        }

        impl Kinds for RewardKind {
            const NAMES: &'static [&'static str] = &[$($name),*];

            fn fields_of(kind: &str) -> Option<Vec<&'static str>> {
                match kind {
                    $($name => Some(<$settings as Kind>::fields()),)*
                    _ => None,
                }
            }

            fn read_kind(kind: &str, map: Map<String, Value>) -> Result<RewardKind, SettingError> {
                match kind {
                    $($name => <$settings as Kind>::read(map).map(RewardKind::$variant),)*
                    other => Err(SettingError::new(format!("unknown kind '{other}'"))),
                }
            }
        }

        impl RewardKind {
            /// The kind's name, as `kind` gives it.
            pub fn name(&self) -> &'static str {
                match self {
                    $(RewardKind::$variant(_) => $name,)*
                }
            }

            /// The reward.
            fn build(&self, at: BuildContext<'_>) -> Result<Reward, SettingError> {
                match self {
                    $(RewardKind::$variant(settings) => settings.build($name, at),)*
                }
            }
        }
    };
}

kinds! {
    /// The answer's last number, compared with a column's.
    Numeric("numeric", ColumnSettings),
    /// The answer, compared with a column's text.
    Exact("exact", ColumnSettings),
    /// Whether the answer matches a pattern.
    Regex("regex", RegexSettings),
    /// A program that scores a group.
    Command("command", CommandSettings),
    /// A penalty on long answers.
    Length("length", LengthSettings),
    /// A reward service of the user's own.
    Http("http", Served<HttpSettings>),
    /// An LLM judge on an OpenAI-compatible chat endpoint.
    Judge("judge", Served<JudgeSettings>),
    /// A reward model on vLLM's pooling runner.
    RewardModel("reward_model", Served<RewardModelSettings>),
}

/// `kind = "numeric"` or `"exact"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ColumnSettings {
    /// The dataset column holding the answer.
    pub column: String,
}

impl ColumnSettings {
    fn build_reward(&self, kind: &str, _: BuildContext<'_>) -> Result<Reward, SettingError> {
        Ok(match kind {
            "exact" => builtin::exact(&self.column),
            _ => builtin::numeric(&self.column),
        })
    }
}

/// `kind = "regex"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RegexSettings {
    /// The pattern an answer must match.
    pub pattern: String,
}

impl RegexSettings {
    fn build_reward(&self, _: &str, _: BuildContext<'_>) -> Result<Reward, SettingError> {
        Ok(builtin::regex(&self.pattern)?)
    }
}

/// `kind = "command"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CommandSettings {
    /// The program and its arguments.
    pub program: Vec<String>,
    /// The `sandbox` (`"none"`, the default: the user's own program, or `"bwrap"`),
    /// `network` (with `sandbox = "bwrap"`; default false) and `limits` keys.
    #[serde(flatten)]
    pub keys: process::SandboxKeys,
}

impl CommandSettings {
    fn build_reward(&self, _: &str, at: BuildContext<'_>) -> Result<Reward, SettingError> {
        let Some((program, args)) = self.program.split_first() else {
            bail!("`program` needs at least the program: [\"./score.py\", ...]");
        };
        // The user's own program runs unsandboxed unless the table asks; sandboxed, it
        // starts from the run's sandbox (its files hidden).
        if let Err((key, problem)) = self.keys.check() {
            bail!("`{key}`: {problem}");
        }
        let sandbox = self.keys.opt_in(at.sandbox);
        sandbox.check().map_err(|e| error!("{e}"))?;
        Ok(builtin::command_in(
            &program_path(at.base, program),
            args.iter().cloned(),
            sandbox,
        ))
    }
}

/// `kind = "length"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct LengthSettings {
    /// The most tokens before the full penalty.
    pub max: usize,
    /// The tokens before `max` over which the penalty grows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<usize>,
}

impl LengthSettings {
    fn build_reward(&self, _: &str, _: BuildContext<'_>) -> Result<Reward, SettingError> {
        Ok(builtin::length(self.max, self.buffer)?)
    }
}

plain_kind!(ColumnSettings, RegexSettings, LengthSettings);

/// `command`'s keys are its own and the sandbox keys it flattens (which serde does not list
/// for a flattened struct).
impl Kind for CommandSettings {
    fn fields() -> Vec<&'static str> {
        [&["program"][..], &process::SandboxKeys::KEYS].concat()
    }
    /// The sandbox keys read apart, so that an error in one names its key.
    fn read(map: Map<String, Value>) -> Result<Self, SettingError> {
        read_with_part(
            map,
            &process::SandboxKeys::KEYS,
            |c: &mut CommandSettings| &mut c.keys,
        )
    }
    fn build(&self, kind: &'static str, at: BuildContext<'_>) -> Result<Reward, SettingError> {
        self.build_reward(kind, at)
    }
}

/// Where a reward's service is and how to call it: the keys `http`, `judge` and
/// `reward_model` share, declared once.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ServiceSettings {
    /// The service's URL.
    pub url: String,
    /// The most requests in flight at once (default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// Attempts per call, retries of transport errors and 5xx included (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// The environment variable holding the key sent as `Authorization: Bearer KEY`; no
    /// program the run starts sees that variable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
}

impl ServiceSettings {
    /// The service's configuration. Reads the key `api_key_env` names, and hides that
    /// variable from every program the run starts.
    fn config(&self, roots: Option<&[u8]>) -> Result<builtin::ServiceConfig, SettingError> {
        if self.concurrency == Some(0) {
            bail!("`concurrency` must be at least 1");
        }
        if self.attempts == Some(0) {
            bail!("`attempts` must be at least 1");
        }
        let mut config = builtin::ServiceConfig::new(&self.url);
        if let Some(concurrency) = self.concurrency {
            config = config.concurrency(concurrency);
        }
        if let Some(attempts) = self.attempts {
            config = config.attempts(attempts);
        }
        if let Some(variable) = &self.api_key_env {
            let key = std::env::var(variable).map_err(|_| {
                error!(
                    "api_key_env = \"{variable}\": the environment variable is not set (or \
                     not UTF-8); export it before the run"
                )
            })?;
            if key.is_empty() {
                bail!("api_key_env = \"{variable}\": the environment variable is empty");
            }
            process::hide_secret(variable);
            config = config.api_key(key);
        }
        if let Some(pem) = roots {
            config = config.root_certificates_pem(pem);
        }
        Ok(config)
    }
}

/// A kind that calls a service: the service's keys and the kind's own.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Served<S> {
    /// Where the service is and how to call it.
    #[serde(flatten)]
    pub service: ServiceSettings,
    /// The kind's own settings.
    #[serde(flatten)]
    pub settings: S,
}

/// The own settings of a kind that calls a service.
trait ServedKind: DeserializeOwned + Serialize {
    fn build_served(
        &self,
        service: builtin::ServiceConfig,
        at: BuildContext<'_>,
    ) -> Result<Reward, SettingError>;
}

impl<S: ServedKind> Kind for Served<S> {
    fn fields() -> Vec<&'static str> {
        let mut fields = field_names::<ServiceSettings>().to_vec();
        fields.extend(field_names::<S>());
        fields
    }

    fn read(mut map: Map<String, Value>) -> Result<Self, SettingError> {
        let service = settings::split(&mut map, field_names::<ServiceSettings>());
        Ok(Served {
            service: read_struct(service)?,
            settings: read_struct(map)?,
        })
    }

    fn build(&self, _: &'static str, at: BuildContext<'_>) -> Result<Reward, SettingError> {
        let service = self.service.config(at.roots)?;
        self.settings.build_served(service, at)
    }
}

/// `kind = "http"`: the service's keys alone.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {}

impl ServedKind for HttpSettings {
    fn build_served(
        &self,
        service: builtin::ServiceConfig,
        _: BuildContext<'_>,
    ) -> Result<Reward, SettingError> {
        Ok(builtin::http(service)?)
    }
}

/// `kind = "judge"`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JudgeSettings {
    /// The model the endpoint serves.
    pub model: String,
    /// The user message, with `{prompt}`, `{completion}` (or `{completions}` in group mode)
    /// and `{COLUMN}` for the row's columns.
    pub template: String,
    /// A system message before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// `"number"` (the default: the answer's last number), `"json"` (a field of a JSON
    /// object in the answer) or `"labels"` (the last of `labels` in it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<String>,
    /// With `score = "json"`: the field (default `score`, or `scores` in group mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Labels and the scores they stand for, `{ CORRECT = 1, WRONG = 0 }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, f64>>,
    /// `"each"` (the default: a request per completion) or `"group"` (a request per group,
    /// one score per completion back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Answers kept by request, so that the same request is asked once (default 0: none
    /// kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<usize>,
    /// The most tokens of an answer (default 1024).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// The judge's temperature (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Keep each answer as the row's note (`reward_notes`; default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_answers: Option<bool>,
}

impl ServedKind for JudgeSettings {
    fn build_served(
        &self,
        service: builtin::ServiceConfig,
        _: BuildContext<'_>,
    ) -> Result<Reward, SettingError> {
        Ok(builtin::judge(service, self.judge()?)?)
    }
}

impl JudgeSettings {
    /// What the judge asks and how it reads the answer.
    fn judge(&self) -> Result<builtin::JudgeConfig, SettingError> {
        let mode = match self.mode.as_deref() {
            None | Some("each") => builtin::JudgeMode::Each,
            Some("group") => builtin::JudgeMode::Group,
            Some(other) => bail!("mode = \"{other}\": expected \"each\" or \"group\""),
        };
        let labels: Vec<(String, f64)> = self
            .labels
            .iter()
            .flatten()
            .map(|(label, score)| (label.clone(), *score))
            .collect();
        if let Some((label, _)) = labels.iter().find(|(_, score)| !score.is_finite()) {
            bail!("labels: '{label}' must stand for a finite number");
        }
        let default_field = match mode {
            builtin::JudgeMode::Each => "score",
            builtin::JudgeMode::Group => "scores",
        };
        let score = match self.score.as_deref() {
            None | Some("number") => builtin::ScoreFormat::Number,
            Some("json") => builtin::ScoreFormat::Json {
                field: self
                    .field
                    .clone()
                    .unwrap_or_else(|| default_field.to_owned()),
            },
            Some("labels") if labels.is_empty() => {
                bail!("score = \"labels\" needs `labels = {{ LABEL = SCORE, ... }}`")
            }
            Some("labels") => builtin::ScoreFormat::Labels(labels.clone()),
            Some(other) => {
                bail!("score = \"{other}\": expected \"number\", \"json\" or \"labels\"")
            }
        };
        if self.field.is_some() && !matches!(score, builtin::ScoreFormat::Json { .. }) {
            bail!("`field` goes with score = \"json\"");
        }
        if self.labels.is_some() && matches!(score, builtin::ScoreFormat::Number) {
            bail!("`labels` go with score = \"labels\" or \"json\"");
        }
        let mut config = builtin::JudgeConfig::new(&self.model, &self.template)
            .mode(mode)
            .score(score)
            .labels(labels)
            .keep_answers(self.keep_answers.unwrap_or(false));
        if let Some(system) = &self.system {
            config = config.system(system.clone());
        }
        if let Some(entries) = self.cache {
            config = config.cache(entries);
        }
        if let Some(max_tokens) = self.max_tokens {
            if max_tokens == 0 {
                bail!("`max_tokens` must be at least 1");
            }
            config = config.max_tokens(max_tokens);
        }
        if let Some(temperature) = self.temperature {
            if !(temperature.is_finite() && temperature >= 0.0) {
                bail!("`temperature` must be a number of 0 or more");
            }
            config = config.temperature(temperature);
        }
        Ok(config)
    }
}

/// `kind = "reward_model"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RewardModelSettings {
    /// The model the endpoint serves.
    pub model: String,
    /// The server applies the model's activation (a sigmoid for one class; default false:
    /// the raw score).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<bool>,
    /// Which of the model's outputs is the score (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_index: Option<usize>,
}

impl ServedKind for RewardModelSettings {
    fn build_served(
        &self,
        service: builtin::ServiceConfig,
        _: BuildContext<'_>,
    ) -> Result<Reward, SettingError> {
        let config = builtin::RewardModelConfig::new(&self.model)
            .activation(self.activation.unwrap_or(false))
            .class_index(self.class_index.unwrap_or(0));
        Ok(builtin::reward_model(service, config)?)
    }
}

/// The keys every table reads, whatever its kind.
const TABLE_KEYS: &[&str] = &["name", "weight", "spec", "kind"];

impl RewardTable {
    /// The table `{spec = SPEC}`, for a spec given alone (`numeric:answer@0.5`); checked
    /// when it is built. Never fails: its signature is a command-line value parser's.
    pub fn from_spec(spec: &str) -> Result<RewardTable, String> {
        Ok(RewardTable {
            name: None,
            weight: None,
            source: RewardSource::Spec {
                spec: spec.to_owned(),
            },
        })
    }

    /// The spec, when the table is one.
    pub fn spec(&self) -> Option<&str> {
        match &self.source {
            RewardSource::Spec { spec } => Some(spec),
            RewardSource::Kind(_) => None,
        }
    }

    /// The table's keys read: `name`, `weight`, and `spec` or `kind` with that kind's keys.
    /// A key of no kind, a key of another kind, a key the kind needs and a value of the wrong
    /// type are each refused by name.
    fn read(mut map: Map<String, Value>) -> Result<RewardTable, SettingError> {
        refuse_unknown::<RewardKind>(&map, TABLE_KEYS)?;
        let name = take::<String>(&mut map, "name")?;
        let weight = take::<f64>(&mut map, "weight")?;
        let spec = take::<String>(&mut map, "spec")?;
        let kind = take::<String>(&mut map, "kind")?;
        let source = match (spec, kind) {
            (Some(_), Some(_)) => return Err(SettingError::new("give `spec` or `kind`, not both")),
            (None, None) => {
                return Err(SettingError::new(
                    "expected `spec = \"KIND:ARG\"` or `kind = \"...\"` with its field",
                ));
            }
            (Some(spec), None) => {
                if let Some(field) = map.keys().next() {
                    return Err(SettingError::new(format!(
                        "`{field}` goes with `kind`, not with `spec`"
                    )));
                }
                RewardSource::Spec { spec }
            }
            (None, Some(kind)) => RewardSource::Kind(Box::new(read_kind(&kind, map)?)),
        };
        Ok(RewardTable {
            name,
            weight,
            source,
        })
    }

    /// The reward this table describes: `spec`, or `kind` with its settings.
    ///
    /// A `command` program named by a relative path with a directory part is relative to
    /// `base`; a sandboxed one starts from `sandbox` (the run's); `roots` are PEM
    /// certificates an `https://` service is trusted by too.
    pub fn build(
        &self,
        base: &Path,
        sandbox: &process::Sandbox,
        roots: Option<&[u8]>,
    ) -> Result<Reward, SettingError> {
        let at = BuildContext {
            base,
            sandbox,
            roots,
        };
        let reward = match &self.source {
            RewardSource::Spec { spec } => {
                if self.weight.is_some()
                    && spec
                        .rsplit_once('@')
                        .is_some_and(|(_, w)| w.trim().parse::<f64>().is_ok())
                {
                    bail!(
                        "the weight is given twice, in `spec` (\"...@WEIGHT\") and as \
                         `weight`: keep one"
                    );
                }
                builtin::from_spec(spec)?
            }
            RewardSource::Kind(kind) => kind.build(at)?,
        };
        let reward = match self.weight {
            Some(weight) if !weight.is_finite() => bail!("weight must be a finite number"),
            Some(weight) => reward.weight(weight),
            None => reward,
        };
        Ok(match &self.name {
            Some(name) if name.trim().is_empty() => bail!("`name` must not be empty"),
            Some(name) => reward.named(name.clone()),
            None => reward,
        })
    }

    /// A `command` reward's program named by a relative path with a directory part is
    /// relative to the file's directory.
    pub fn make_program_absolute(&mut self, base: &Path) {
        match &mut self.source {
            RewardSource::Kind(kind) => {
                if let RewardKind::Command(command) = kind.as_mut()
                    && let Some(program) = command.program.first_mut()
                {
                    *program = program_path(base, program);
                }
            }
            RewardSource::Spec { spec } => {
                if let Some(rest) = spec.strip_prefix("command:") {
                    let program = rest.split_whitespace().next().unwrap_or_default();
                    *spec = format!(
                        "command:{}{}",
                        program_path(base, program),
                        &rest.trim_start()[program.len()..]
                    );
                }
            }
        }
    }

    /// The program a `command` reward runs.
    pub fn program(&self) -> Option<&str> {
        match &self.source {
            RewardSource::Kind(kind) => match kind.as_ref() {
                RewardKind::Command(command) => command.program.first().map(String::as_str),
                _ => None,
            },
            RewardSource::Spec { spec } => spec
                .strip_prefix("command:")
                .and_then(|rest| rest.split_whitespace().next()),
        }
    }
}

impl<'de> Deserialize<'de> for RewardTable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<RewardTable, D::Error> {
        let map = Map::<String, Value>::deserialize(deserializer)?;
        RewardTable::read(map).map_err(D::Error::custom)
    }
}
