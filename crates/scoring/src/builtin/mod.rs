//! Built-in reward functions, and the `KIND:ARG[@WEIGHT]` specs that name them on a command
//! line or in a config file.
//!
//! | spec | function | score |
//! |---|---|---|
//! | `exact:COLUMN` | [`ExactMatch`] | 1 if the answer equals the column (after normalisation), else 0 |
//! | `regex:PATTERN` | [`RegexMatch`] | 1 if the answer matches the pattern anywhere, else 0 |
//! | `numeric:COLUMN` | [`NumericMatch`] | 1 if the answer's number (last `\boxed{}`, else last number) equals the column's within tolerance, else 0 |
//! | `length:MAX[:BUFFER]` | [`LengthPenalty`] | 0 up to `MAX - BUFFER` tokens, falling linearly to -1 at `MAX`, -1 beyond |
//! | `command:PROGRAM [ARGS..]` | [`CommandReward`] | whatever the program prints: the group as JSON on stdin, a JSON array of numbers or nulls on stdout |
//! | (no spec; [`http`]) | [`HttpReward`] | whatever a reward service answers: the group as JSON in a POST, a JSON array of numbers or nulls back |
//! | (no spec; [`judge`]) | [`Judge`] | what an LLM judge answers on an OpenAI-compatible chat endpoint, per completion or per group, read as a number, a JSON field or a label |
//! | (no spec; [`reward_model`]) | [`RewardModel`] | what a trained reward model served by vLLM's pooling runner gives the conversation, one request per completion |
//! | (no spec) | [`environment`] | the reward the rollout's environment gave its episode (`Completion::rollout_reward`) |
//!
//! A completion that cannot be judged (the row lacks the column, the column holds no
//! number, no token ids for a length) scores `None`, never a made-up 0.
//!
//! `exact` and `length` need no feature; `regex` and `numeric` need the `regex` feature and
//! `command` the `command` feature (all on by default); [`http`], [`judge`] and [`reward_model`] need
//! the `http` feature. Without its feature, a spec of that
//! kind is an error that names the feature.

#[cfg(feature = "command")]
mod command;
mod environment;
mod exact;
#[cfg(feature = "http")]
mod http;
#[cfg(feature = "http")]
mod judge;
mod length;
#[cfg(feature = "regex")]
mod numeric;
#[cfg(feature = "regex")]
mod pattern;
#[cfg(feature = "http")]
mod reward_model;
#[cfg(feature = "http")]
mod service;

#[cfg(feature = "command")]
pub use command::CommandReward;
pub use environment::{ENVIRONMENT_COLUMN, environment};
pub use exact::{ExactMatch, Normalization};
#[cfg(feature = "http")]
pub use http::HttpReward;
#[cfg(feature = "http")]
pub use judge::{Judge, JudgeConfig, JudgeError, JudgeMode, ScoreFormat};
pub use length::{LengthPenalty, LengthPenaltyError};
#[cfg(feature = "regex")]
pub use numeric::{NumericMatch, extract_number};
#[cfg(feature = "regex")]
pub use pattern::RegexMatch;
#[cfg(feature = "http")]
pub use reward_model::{RewardModel, RewardModelConfig};
#[cfg(feature = "http")]
pub use service::{ServiceConfig, ServiceError};

use crate::reward::Reward;

/// A reward spec that could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid reward spec {spec:?}: {reason}")]
pub struct SpecError {
    spec: String,
    reason: String,
}

impl SpecError {
    fn new(spec: &str, reason: impl Into<String>) -> SpecError {
        SpecError {
            spec: spec.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Builds a built-in reward from a spec: `exact:COLUMN`, `regex:PATTERN`, `numeric:COLUMN`,
/// `length:MAX[:BUFFER]` or `command:PROGRAM [ARGS..]`, each with an optional `@WEIGHT`
/// suffix (a trailing `@` followed by a number is always read as the weight).
pub fn from_spec(spec: &str) -> Result<Reward, SpecError> {
    let (body, weight) = match spec.rsplit_once('@') {
        Some((body, weight)) if weight.trim().parse::<f64>().is_ok() => {
            let weight: f64 = weight.trim().parse().unwrap_or(1.0);
            if !weight.is_finite() {
                return Err(SpecError::new(spec, "the weight must be a finite number"));
            }
            (body, weight)
        }
        _ => (spec, 1.0),
    };
    let Some((kind, argument)) = body.split_once(':') else {
        return Err(SpecError::new(
            spec,
            "expected KIND:ARGUMENT, e.g. numeric:answer or regex:^\\d+$",
        ));
    };
    if argument.is_empty() {
        return Err(SpecError::new(
            spec,
            format!("'{kind}' needs an argument after the colon"),
        ));
    }
    // A pattern or a command line may hold an `@`; a column or a length may not, so there an
    // `@` is a weight that is not a number.
    if matches!(kind, "exact" | "numeric" | "length")
        && let Some((_, weight)) = argument.rsplit_once('@')
    {
        return Err(SpecError::new(
            spec,
            format!("the weight after '@' must be a number, got '{weight}'"),
        ));
    }
    let reward = match kind {
        "exact" => exact(argument),
        #[cfg(feature = "regex")]
        "numeric" => numeric(argument),
        #[cfg(feature = "regex")]
        "regex" => regex(argument).map_err(|e| SpecError::new(spec, e.reason))?,
        #[cfg(not(feature = "regex"))]
        "numeric" | "regex" => {
            return Err(SpecError::new(
                spec,
                format!("kind '{kind}' needs scoring's `regex` feature"),
            ));
        }
        "length" => {
            let mut parts = argument.split(':');
            let max = parse_tokens(spec, parts.next(), "MAX")?;
            let buffer = match parts.next() {
                Some(text) => Some(parse_tokens(spec, Some(text), "BUFFER")?),
                None => None,
            };
            length(max, buffer).map_err(|e| SpecError::new(spec, e.to_string()))?
        }
        #[cfg(not(feature = "command"))]
        "command" => {
            return Err(SpecError::new(
                spec,
                "kind 'command' needs scoring's `command` feature",
            ));
        }
        #[cfg(feature = "command")]
        "command" => {
            let mut words = argument.split_whitespace();
            let program = words
                .next()
                .ok_or_else(|| SpecError::new(spec, "no program given"))?;
            command(program, words.map(str::to_owned))
        }
        other => {
            return Err(SpecError::new(
                spec,
                format!(
                    "unknown kind '{other}'; expected exact, regex, numeric, length or command"
                ),
            ));
        }
    };
    Ok(reward.weight(weight))
}

/// A reward service (named `http`): see [`HttpReward`].
#[cfg(feature = "http")]
pub fn http(service: ServiceConfig) -> Result<Reward, ServiceError> {
    Ok(Reward::from_async("http", HttpReward::new(service)?))
}

/// An LLM judge (named `judge`, reading the first column its template names): see [`Judge`].
#[cfg(feature = "http")]
pub fn judge(service: ServiceConfig, config: JudgeConfig) -> Result<Reward, JudgeError> {
    let judge = Judge::new(service, config)?;
    let column = judge.column().map(str::to_owned);
    let reward = Reward::from_async("judge", judge);
    Ok(match column {
        Some(column) => reward.reads_column(column),
        None => reward,
    })
}

/// A trained reward model on vLLM's pooling runner (named `reward_model`): see
/// [`RewardModel`].
#[cfg(feature = "http")]
pub fn reward_model(
    service: ServiceConfig,
    config: RewardModelConfig,
) -> Result<Reward, ServiceError> {
    Ok(Reward::from_async(
        "reward_model",
        RewardModel::new(service, config)?,
    ))
}

/// `exact:COLUMN`: 1 when the answer equals the row's `column` (normalized), else 0.
pub fn exact(column: &str) -> Reward {
    Reward::from_inline(format!("exact_{column}"), ExactMatch::new(column)).reads_column(column)
}

/// `numeric:COLUMN`: 1 when the answer's number equals the row's `column`, else 0.
#[cfg(feature = "regex")]
pub fn numeric(column: &str) -> Reward {
    Reward::from_inline(format!("numeric_{column}"), NumericMatch::new(column)).reads_column(column)
}

/// `regex:PATTERN`: 1 when the answer matches `pattern`, else 0.
#[cfg(feature = "regex")]
pub fn regex(pattern: &str) -> Result<Reward, SpecError> {
    let matcher = RegexMatch::new(pattern)
        .map_err(|e| SpecError::new(pattern, format!("bad pattern: {e}")))?;
    Ok(Reward::from_inline("regex", matcher))
}

/// `length:MAX[:BUFFER]`: DAPO's soft overlong penalty; the buffer is a quarter of `max`
/// when not given.
pub fn length(max: usize, buffer: Option<usize>) -> Result<Reward, LengthPenaltyError> {
    let penalty = LengthPenalty::new(max, buffer.unwrap_or(max / 4))?;
    Ok(Reward::from_inline("length_penalty", penalty))
}

/// `command:PROGRAM ARGS..`: the group on the program's stdin, its scores on its stdout;
/// named `command_STEM` after the program's file stem.
#[cfg(feature = "command")]
pub fn command(program: &str, args: impl IntoIterator<Item = String>) -> Reward {
    command_in(program, args, process::Sandbox::none())
}

/// [`command`] with the program run in `sandbox` (a reward that runs what the model wrote).
#[cfg(feature = "command")]
pub fn command_in(
    program: &str,
    args: impl IntoIterator<Item = String>,
    sandbox: process::Sandbox,
) -> Reward {
    let stem = std::path::Path::new(program).file_stem().map_or_else(
        || program.to_owned(),
        |stem| stem.to_string_lossy().into_owned(),
    );
    Reward::from_async(
        format!("command_{stem}"),
        CommandReward::new(program, args).sandbox(sandbox),
    )
}

fn parse_tokens(spec: &str, text: Option<&str>, what: &str) -> Result<usize, SpecError> {
    text.and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| SpecError::new(spec, format!("{what} must be a whole number of tokens")))
}

/// The expected value of `column` as text: strings as they are, numbers and booleans printed.
fn column_text(group: &crate::Group, column: &str) -> Option<String> {
    match group.column(column)? {
        serde_json::Value::String(text) => Some(text.clone()),
        serde_json::Value::Number(number) => Some(number.to_string()),
        serde_json::Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(feature = "regex", feature = "command"))]
    fn specs_name_kind_argument_and_weight() {
        let reward = from_spec("numeric:answer@0.5").expect("valid");
        assert_eq!(
            (reward.name(), reward.get_weight(), reward.is_sync()),
            ("numeric_answer", 0.5, true)
        );
        assert_eq!(reward.column(), Some("answer"));
        // The built-ins that only read the text run where the group is scored.
        for spec in ["numeric:answer", "exact:answer", "regex:x", "length:100"] {
            let reward = from_spec(spec).expect("valid");
            assert!(
                format!("{reward:?}").contains("\"inline\""),
                "{spec}: {reward:?}"
            );
        }
        assert_eq!(from_spec("regex:x").expect("valid").column(), None);
        let reward = from_spec("regex:^\\d+@x$")
            .expect("an @ not followed by a number stays in the pattern");
        assert_eq!(reward.get_weight(), 1.0);
        let reward = from_spec("command:./judge.py --strict@2").expect("valid");
        assert_eq!(
            (reward.name(), reward.get_weight(), reward.is_sync()),
            ("command_judge", 2.0, false)
        );
        assert_eq!(
            from_spec("length:100").expect("valid").name(),
            "length_penalty"
        );
    }

    #[test]
    fn bad_specs_say_what_was_expected() {
        let error = |spec: &str| {
            from_spec(spec)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            error("numeric"),
            "invalid reward spec \"numeric\": expected KIND:ARGUMENT, e.g. numeric:answer or regex:^\\d+$"
        );
        assert_eq!(
            error("fuzzy:answer"),
            "invalid reward spec \"fuzzy:answer\": unknown kind 'fuzzy'; expected exact, regex, numeric, length or command"
        );
        #[cfg(feature = "regex")]
        assert!(error("regex:(").starts_with("invalid reward spec \"regex:(\": bad pattern: "));
        assert_eq!(
            error("length:ten"),
            "invalid reward spec \"length:ten\": MAX must be a whole number of tokens"
        );
        assert_eq!(
            error("numeric:answer@abc"),
            "invalid reward spec \"numeric:answer@abc\": the weight after '@' must be a number, got 'abc'"
        );
        assert_eq!(
            error("exact:"),
            "invalid reward spec \"exact:\": 'exact' needs an argument after the colon"
        );
    }

    #[test]
    fn specs_of_kinds_left_out_name_the_feature_they_need() {
        let error = |spec: &str| from_spec(spec).err().map(|e| e.to_string());
        let expected = |spec: &str, feature: &str| {
            format!(
                "invalid reward spec \"{spec}\": kind '{}' needs scoring's `{feature}` feature",
                &spec[..spec.find(':').unwrap_or(0)]
            )
        };
        for spec in ["regex:x", "numeric:answer"] {
            assert_eq!(
                error(spec),
                (!cfg!(feature = "regex")).then(|| expected(spec, "regex"))
            );
        }
        assert_eq!(
            error("command:judge"),
            (!cfg!(feature = "command")).then(|| expected("command:judge", "command"))
        );
    }
}
