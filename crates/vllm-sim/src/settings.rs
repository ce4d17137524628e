//! [`SimSettings`]: the simulator's behaviour as settings, declared once: a run's
//! `[simulator]` table (serde), the flags of `async-grpo simulate` (clap, behind the `clap`
//! feature), and the defaults of [`SimConfig::new`].

use std::time::Duration;

use serde::{Deserialize, Serialize};
use settings::SettingError;

use crate::{Faults, SimConfig};

/// How the simulator answers. Its `Default` is the simulator's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(default, deny_unknown_fields)]
pub struct SimSettings {
    /// Assistant turns that call a tool before the final answer
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub tool_rounds: usize,
    /// Tokens of a final answer (before the end-of-answer token)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub answer_tokens: usize,
    /// Chance that a final answer after a tool call repeats the tool's result (the last
    /// number of the prompt) rather than a random number; drawn from each request's seed
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    pub correct_rate: f64,
    /// Delay before the first token, e.g. 10ms
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub latency: Duration,
    /// Delay per generated token, e.g. 1ms
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub per_token: Duration,
    /// Fraction of generation requests answered 503
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    pub error_503: f64,
    /// Fraction of generation requests whose connection is dropped mid-response
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    pub drop_connection: f64,
    /// Fraction of generation requests delayed by slow_delay
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    pub slow: f64,
    /// The delay of a slow response
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    pub slow_delay: Duration,
    /// Fraction of generation requests answered with a malformed body
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    pub malformed: f64,
    /// Its context length
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_model_len: u32,
    /// Seed of the fault draws
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub fault_seed: u64,
    /// The model name it serves
    #[cfg_attr(feature = "clap", arg(long, value_name = "NAME"))]
    pub model: String,
    /// The tool the scripted calls name (default: a run's first tool, else calculator)
    #[cfg_attr(feature = "clap", arg(long, value_name = "NAME"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    /// The scripted call's arguments (file only): a table whose strings may hold
    /// `{expression}` and `{answer}` (default: the calculator's `expression`)
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// The end-of-answer token, appended when the tokenizer has it (default: a run's
    /// tokenizer's EOS token, else <|im_end|>)
    #[cfg_attr(feature = "clap", arg(long, value_name = "TOKEN"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<String>,
    /// Play a mixture-of-experts model reporting its routed experts, as vLLM with
    /// --enable-return-routed-experts: LAYERSxTOP_KxEXPERTS, e.g. 2x2x8 (default: a dense
    /// model, no routing)
    #[cfg_attr(feature = "clap", arg(long, value_name = "LxKxE"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
}

/// The tool the scripted calls name when none is given.
const DEFAULT_TOOL: &str = "calculator";
/// The end-of-answer token when none is given.
const DEFAULT_EOS: &str = "<|im_end|>";

impl Default for SimSettings {
    /// Model `sim`, 4096 tokens of context, 32-token answers, no tool rounds, a correct rate
    /// of 0.5, no latency, no faults (a slow response, when asked for, is 5 s late).
    fn default() -> Self {
        SimSettings {
            model: "sim".to_owned(),
            max_model_len: 4096,
            answer_tokens: 32,
            tool_rounds: 0,
            tool_name: None,
            tool_arguments: None,
            correct_rate: 0.5,
            eos_token: None,
            routed_experts: None,
            latency: Duration::ZERO,
            per_token: Duration::ZERO,
            error_503: 0.0,
            drop_connection: 0.0,
            slow: 0.0,
            slow_delay: Duration::from_secs(5),
            malformed: 0.0,
            fault_seed: 0,
        }
    }
}

impl SimSettings {
    /// Checks that every fraction is one, naming the setting (its key and, in kebab case, its
    /// flag) that is not.
    pub fn validate(&self) -> Result<(), SettingError> {
        for (setting, value) in [
            ("correct_rate", self.correct_rate),
            ("error_503", self.error_503),
            ("drop_connection", self.drop_connection),
            ("slow", self.slow),
            ("malformed", self.malformed),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(SettingError::at(
                    setting,
                    format!("must be a fraction between 0 and 1, got {value}"),
                ));
            }
        }
        if let Some(routing) = &self.routed_experts {
            routing
                .parse::<crate::SimRouting>()
                .map_err(|e| SettingError::at("routed_experts", e))?;
        }
        Ok(())
    }

    /// Sets the fields of `config` these settings hold; a tool name or end-of-answer token
    /// not given leaves the config's.
    pub fn apply_to(&self, config: &mut SimConfig) {
        config.model.clone_from(&self.model);
        config.max_model_len = self.max_model_len;
        config.answer_tokens = self.answer_tokens;
        config.tool_rounds = self.tool_rounds;
        if let Some(tool) = &self.tool_name {
            config.tool_name.clone_from(tool);
        }
        if let Some(arguments) = &self.tool_arguments {
            config.tool_arguments = Some(serde_json::Value::Object(arguments.clone()));
        }
        config.correct_rate = self.correct_rate;
        if let Some(eos) = &self.eos_token {
            config.eos_token.clone_from(eos);
        }
        config.latency = self.latency;
        config.per_token = self.per_token;
        config.faults = Faults {
            error_503: self.error_503,
            drop_connection: self.drop_connection,
            slow: self.slow,
            slow_delay: self.slow_delay,
            malformed: self.malformed,
        };
        config.fault_seed = self.fault_seed;
        config.routed_experts = self.routed_experts.as_deref().and_then(|r| r.parse().ok());
    }

    /// The tool name given, or the default.
    pub(crate) fn tool_name_or_default(&self) -> String {
        self.tool_name
            .clone()
            .unwrap_or_else(|| DEFAULT_TOOL.to_owned())
    }

    /// The end-of-answer token given, or the default.
    pub(crate) fn eos_token_or_default(&self) -> String {
        self.eos_token
            .clone()
            .unwrap_or_else(|| DEFAULT_EOS.to_owned())
    }
}
