//! [`RewardTable`]: a reward function described by its settings, built by the same code
//! wherever it is given (the binary's `[[rewards]]` tables and `--reward` flags, the bridge's
//! reward specs).

use std::{collections::BTreeMap, path::Path};

use process::program_path;
use serde::{Deserialize, Serialize};

use crate::{Reward, builtin};

/// Why a [`RewardTable`] does not describe a reward function.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TableError(String);

macro_rules! error {
    ($($words:tt)*) => {
        TableError(format!($($words)*))
    };
}

macro_rules! bail {
    ($($words:tt)*) => {
        return Err(error!($($words)*))
    };
}

macro_rules! from_error {
    ($($error:ty),*) => {
        $(impl From<$error> for TableError {
            fn from(error: $error) -> TableError {
                TableError(error.to_string())
            }
        })*
    };
}

from_error!(
    builtin::SpecError,
    builtin::LengthPenaltyError,
    builtin::ServiceError,
    builtin::JudgeError,
    process::Error
);

/// A reward function described by its settings, as a config file's `[[rewards]]` table or a
/// bridge's reward spec: `spec = "KIND:ARG"`, or `kind` with the fields that kind takes;
/// `name` to tell apart two functions of one kind, `weight` for its share of the reward.
/// Fields that no kind takes, or that the kind given does not, are refused by name.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RewardTable {
    /// The function's name (metrics read `rewards/NAME`); the kind's own name by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `KIND:ARG[@WEIGHT]`, as `--reward` takes it; not with `kind`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
    /// `numeric`, `exact`, `regex`, `command`, `length`, `http`, `judge` or `reward_model`,
    /// with its fields.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// `kind = "numeric"` or `"exact"`: the dataset column holding the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// `kind = "regex"`: the pattern an answer must match.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// `kind = "command"`: the program and its arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program: Option<Vec<String>>,
    /// `kind = "length"`: the most tokens before the full penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<usize>,
    /// `kind = "length"`: the tokens before `max` over which the penalty grows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buffer: Option<usize>,
    /// The column's weight in the combined reward (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// `kind = "command"`: `"none"` (the default: the user's own program) or `"bwrap"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<process::Isolation>,
    /// `kind = "command"` with `sandbox = "bwrap"`: the host's network or not (default false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<bool>,
    /// `kind = "command"`: resource limits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<process::Limits>,
    /// `kind = "http"`, `"judge"` or `"reward_model"`: the service's URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `kind = "http"`, `"judge"` or `"reward_model"`: the most requests in flight at once
    /// (default 8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    /// `kind = "http"`, `"judge"` or `"reward_model"`: attempts per call, retries of transport errors and 5xx
    /// included (default 3).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// `kind = "http"`, `"judge"` or `"reward_model"`: the environment variable holding the key sent as
    /// `Authorization: Bearer KEY`; no program the run starts sees that variable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// `kind = "judge"` or `"reward_model"`: the model the endpoint serves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `kind = "judge"`: the user message, with `{prompt}`, `{completion}` (or
    /// `{completions}` in group mode) and `{COLUMN}` for the row's columns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// `kind = "judge"`: a system message before it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// `kind = "judge"`: `"number"` (the default: the answer's last number), `"json"` (a
    /// field of a JSON object in the answer) or `"labels"` (the last of `labels` in it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<String>,
    /// `kind = "judge"` with `score = "json"`: the field (default `score`, or `scores` in
    /// group mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// `kind = "judge"`: labels and the scores they stand for, `{ CORRECT = 1, WRONG = 0 }`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, f64>>,
    /// `kind = "judge"`: `"each"` (the default: a request per completion) or `"group"` (a
    /// request per group, one score per completion back).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `kind = "judge"`: answers kept by request, so that the same request is asked once
    /// (default 0: none kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<usize>,
    /// `kind = "judge"`: the most tokens of an answer (default 1024).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// `kind = "judge"`: the judge's temperature (default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// `kind = "judge"`: keep each answer as the row's note (`reward_notes`; default false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_answers: Option<bool>,
    /// `kind = "reward_model"`: the server applies the model's activation (a sigmoid for one
    /// class; default false: the raw score).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation: Option<bool>,
    /// `kind = "reward_model"`: which of the model's outputs is the score (default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class_index: Option<usize>,
}

impl RewardTable {
    /// The table `{spec = SPEC}`, for a spec given alone (`numeric:answer@0.5`); checked
    /// when it is built. Never fails: its signature is a command-line value parser's.
    pub fn from_spec(spec: &str) -> Result<RewardTable, String> {
        Ok(RewardTable {
            spec: Some(spec.to_owned()),
            ..RewardTable::default()
        })
    }
    /// The reward this table describes: `spec`, or `kind` with the field that kind takes.
    ///
    /// A `command` program named by a relative path with a directory part is relative to
    /// `base`; a sandboxed one starts from `sandbox` (the run's); `roots` are PEM
    /// certificates an `https://` service is trusted by too.
    pub fn build(
        &self,
        base: &Path,
        sandbox: &process::Sandbox,
        roots: Option<&[u8]>,
    ) -> Result<Reward, TableError> {
        let given = [
            ("column", self.column.is_some()),
            ("pattern", self.pattern.is_some()),
            ("program", self.program.is_some()),
            ("max", self.max.is_some()),
            ("buffer", self.buffer.is_some()),
            ("sandbox", self.sandbox.is_some()),
            ("network", self.network.is_some()),
            ("limits", self.limits.is_some()),
            ("url", self.url.is_some()),
            ("concurrency", self.concurrency.is_some()),
            ("attempts", self.attempts.is_some()),
            ("api_key_env", self.api_key_env.is_some()),
            ("model", self.model.is_some()),
            ("template", self.template.is_some()),
            ("system", self.system.is_some()),
            ("score", self.score.is_some()),
            ("field", self.field.is_some()),
            ("labels", self.labels.is_some()),
            ("mode", self.mode.is_some()),
            ("cache", self.cache.is_some()),
            ("max_tokens", self.max_tokens.is_some()),
            ("temperature", self.temperature.is_some()),
            ("keep_answers", self.keep_answers.is_some()),
            ("activation", self.activation.is_some()),
            ("class_index", self.class_index.is_some()),
        ];
        let reward = match (&self.spec, &self.kind) {
            (Some(_), Some(_)) => bail!("give `spec` or `kind`, not both"),
            (None, None) => {
                bail!("expected `spec = \"KIND:ARG\"` or `kind = \"...\"` with its field")
            }
            (Some(spec), None) => {
                if let Some((field, _)) = given.iter().find(|(_, present)| *present) {
                    bail!("`{field}` goes with `kind`, not with `spec`");
                }
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
            (None, Some(kind)) => self.build_kind(kind, &given, base, sandbox, roots)?,
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

    /// `kind = "..."` with its own field, built with scoring's typed constructors.
    fn build_kind(
        &self,
        kind: &str,
        given: &[(&str, bool)],
        base: &Path,
        sandbox: &process::Sandbox,
        roots: Option<&[u8]>,
    ) -> Result<Reward, TableError> {
        let wants: &[&str] = match kind {
            "numeric" | "exact" => &["column"],
            "regex" => &["pattern"],
            "command" => &["program", "sandbox", "network", "limits"],
            "length" => &["max", "buffer"],
            "http" => &["url", "concurrency", "attempts", "api_key_env"],
            "judge" => &[
                "url",
                "model",
                "template",
                "system",
                "score",
                "field",
                "labels",
                "mode",
                "cache",
                "max_tokens",
                "temperature",
                "keep_answers",
                "concurrency",
                "attempts",
                "api_key_env",
            ],
            "reward_model" => &[
                "url",
                "model",
                "activation",
                "class_index",
                "concurrency",
                "attempts",
                "api_key_env",
            ],
            other => {
                bail!(
                    "unknown kind '{other}'; expected numeric, exact, regex, command, length, \
                     http, judge or reward_model"
                )
            }
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
        let missing = || error!("kind \"{kind}\" needs `{}`", wants[0]);
        Ok(match kind {
            "numeric" => builtin::numeric(self.column.as_deref().ok_or_else(missing)?),
            "exact" => builtin::exact(self.column.as_deref().ok_or_else(missing)?),
            "regex" => builtin::regex(self.pattern.as_deref().ok_or_else(missing)?)?,
            "command" => {
                let argv = self.program.as_deref().ok_or_else(missing)?;
                let Some((program, args)) = argv.split_first() else {
                    bail!("`program` needs at least the program: [\"./score.py\", ...]");
                };
                // The user's own program runs unsandboxed unless the table asks; sandboxed,
                // it starts from the run's sandbox (its files hidden).
                let start = match self.sandbox {
                    Some(process::Isolation::Bwrap) => sandbox.clone(),
                    Some(process::Isolation::None) | None => process::Sandbox::none(),
                };
                let sandbox = start.with_keys(None, self.network, self.limits);
                sandbox.check()?;
                builtin::command_in(&program_path(base, program), args.iter().cloned(), sandbox)
            }
            "http" => builtin::http(self.service(roots)?)?,
            "judge" => builtin::judge(self.service(roots)?, self.judge()?)?,
            "reward_model" => {
                let model = self
                    .model
                    .as_deref()
                    .ok_or_else(|| error!("kind \"reward_model\" needs `model`"))?;
                let config = builtin::RewardModelConfig::new(model)
                    .activation(self.activation.unwrap_or(false))
                    .class_index(self.class_index.unwrap_or(0));
                builtin::reward_model(self.service(roots)?, config)?
            }
            _ => builtin::length(self.max.ok_or_else(missing)?, self.buffer)?,
        })
    }

    /// Where an `http`, `judge` or `reward_model` reward's service is, and how to call it. Reads the key
    /// `api_key_env` names, and hides that variable from every program the run starts.
    fn service(&self, roots: Option<&[u8]>) -> Result<builtin::ServiceConfig, TableError> {
        let url = self
            .url
            .as_deref()
            .ok_or_else(|| error!("kind \"{}\" needs `url`", self.kind_name()))?;
        if self.concurrency == Some(0) {
            bail!("`concurrency` must be at least 1");
        }
        if self.attempts == Some(0) {
            bail!("`attempts` must be at least 1");
        }
        let mut config = builtin::ServiceConfig::new(url);
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

    /// What a `judge` reward asks and how it reads the answer.
    fn judge(&self) -> Result<builtin::JudgeConfig, TableError> {
        let model = self
            .model
            .as_deref()
            .ok_or_else(|| error!("kind \"judge\" needs `model`"))?;
        let template = self
            .template
            .as_deref()
            .ok_or_else(|| error!("kind \"judge\" needs `template`"))?;
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
        let mut config = builtin::JudgeConfig::new(model, template)
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

    fn kind_name(&self) -> &str {
        self.kind.as_deref().unwrap_or_default()
    }

    /// A `command` reward's program named by a relative path with a directory part is
    /// relative to the file's directory.
    pub fn make_program_absolute(&mut self, base: &Path) {
        if let Some(program) = self.program.as_mut().and_then(|argv| argv.first_mut()) {
            *program = program_path(base, program);
        }
        if let Some(spec) = &self.spec
            && let Some(rest) = spec.strip_prefix("command:")
        {
            let program = rest.split_whitespace().next().unwrap_or_default();
            self.spec = Some(format!(
                "command:{}{}",
                program_path(base, program),
                &rest.trim_start()[program.len()..]
            ));
        }
    }

    /// The program a `command` reward runs.
    pub fn program(&self) -> Option<&str> {
        match (&self.program, &self.spec) {
            (Some(argv), _) => argv.first().map(String::as_str),
            (None, Some(spec)) => spec
                .strip_prefix("command:")
                .and_then(|rest| rest.split_whitespace().next()),
            (None, None) => None,
        }
    }
}
