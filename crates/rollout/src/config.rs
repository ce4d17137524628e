//! The engine's settings: [`RolloutConfig`], its checks, and the modes it names.

use std::{fmt, time::Duration};

use rollout_core::ReconcilerConfig;
use scoring::AdvantageConfig;

use crate::{Sampling, SettingError};

/// `as_str`, `Display` and `FromStr` for a setting whose values are names: each variant's
/// name in a file, on the command line and in the bridge, and what it means (the error for
/// an unknown name lists them).
macro_rules! named_values {
    ($kind:ident, $what:literal: $($variant:ident = $name:literal ($meaning:literal)),+ $(,)?) => {
        impl $kind {
            /// The value's name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($kind::$variant => $name,)+
                }
            }
        }

        impl fmt::Display for $kind {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $kind {
            type Err = String;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                match text {
                    $($name => Ok($kind::$variant),)+
                    other => Err(format!(
                        "unknown {} '{other}'; expected {}",
                        $what,
                        one_of(&[$(concat!($name, " (", $meaning, ")")),+])
                    )),
                }
            }
        }
    };
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [only] => (*only).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// How a rollout builds the prompt of each turn after the first.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum PromptMode {
    /// Token-in/token-out: the previous prompt, the ids the model sampled as it sampled
    /// them, and the ids the chat template writes after that answer up to the next generation
    /// ([`IncrementalRender::delta`](rollout_core::IncrementalRender::delta)). The model's tokens are
    /// never re-encoded: a rollout is one training row with no drift, even when the template
    /// rewrites history. A turn whose template has no exact delta is rendered as in
    /// [`PromptMode::Rerender`] and counted (`fallback_turns`). The parsed answer (content,
    /// `reasoning_content` split from a `<think>` block, tool calls) still goes to the
    /// tools and into the sample's `completion`.
    #[default]
    Append,
    /// TRL's way: the whole conversation rendered each turn (incrementally) and reconciled
    /// with the sampled ids; a template that rewrites history (Qwen3 dropping an empty think
    /// block of an earlier turn) makes the reconciler fork a new row at that turn.
    Rerender,
}

named_values!(PromptMode, "prompt mode":
    Append = "append" ("token-in/token-out"),
    Rerender = "rerender" ("render the whole conversation each turn"),
);

/// What [`Engine::pause`](crate::Engine::pause) does with the rollouts in flight (named as
/// vLLM's own pause modes; vllm-client's `PauseMode` is the server's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InFlight {
    /// They run to their end.
    #[default]
    Wait,
    /// They are cancelled; their groups are dropped (counted as cancelled).
    Abort,
    /// Their requests are interrupted, keeping the tokens sampled so far (with their
    /// logprobs and version), and no request is sent until the resume; each answer then
    /// continues from its prompt and those tokens under the version current at the resume.
    Continue,
}

named_values!(InFlight, "in-flight mode":
    Wait = "wait" ("rollouts run to their end"),
    Abort = "abort" ("cancelled"),
    Continue = "continue" ("interrupted, continued after the resume"),
);

/// What happens to a training row holding a token sampled more than `max_token_staleness`
/// versions before the version current when its group is complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleTokens {
    /// Those tokens are kept as context: `completion_mask` 0 (a row left with no trained
    /// token is dropped).
    #[default]
    Mask,
    /// The row is dropped.
    Drop,
}

named_values!(StaleTokens, "stale-token rule":
    Mask = "mask" ("the tokens trained on no more"),
    Drop = "drop" ("the row dropped"),
);

/// How the loop runs.
///
/// Its serde form is the settings file's (flat keys, durations as `10m`, `500ms`), and with
/// the `clap` feature it is also a set of flags (`--max-inflight N`, ...), each documented
/// here once. `sampling` and `reconciler` are settings of their own, read from the same
/// table (their keys sit beside these), and the fields marked *not a setting* are the
/// embedding program's to set.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct RolloutConfig {
    /// Completions per prompt: the group size
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub num_generations: usize,
    /// Rollouts in flight at once
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_inflight: usize,
    /// Assistant turns (generation calls) per rollout
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_turns: usize,
    /// Tokens sampled per assistant turn (clipped further to the context left)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub max_tokens: u32,
    /// Completion tokens per rollout, every turn together (default: no limit but the context)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u32>,
    /// The context length, instead of what the server reports
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// How long one attempt at a rollout may take, every turn and tool call together
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    pub rollout_timeout: Duration,
    /// Completions a group needs to be scored and kept
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub min_group_size: usize,
    /// Times a failed rollout is tried again on the same prompt (fresh sampling)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    pub retries: usize,
    /// Set malformed dataset rows aside (counted, reported at the end) instead of stopping
    #[cfg_attr(feature = "clap", arg(long))]
    pub skip_bad_rows: bool,
    /// Stop after N groups (default: one pass over the dataset)
    #[cfg_attr(feature = "clap", arg(long = "groups", value_name = "N"))]
    #[serde(rename = "groups", skip_serializing_if = "Option::is_none")]
    pub max_groups: Option<u64>,
    /// Cancel a group whose first turn was sampled more than this many model versions before
    /// the current one (versions come from the program or the control endpoint's
    /// /model_version); match the trainer's own bound (TRL's max_staleness), past which it
    /// drops samples anyway (default: never)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<u64>,
    /// With max_staleness: the groups the trainer takes per model version (its batch, in
    /// groups). Admission then holds a group that could not be trained on within the
    /// staleness bound (AReaL's rule: the k-th group admitted, from 0, waits until k <
    /// (versions since the start + max_staleness + 1) x groups_per_version)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups_per_version: Option<u64>,
    /// Bound each sampled token's staleness: a token sampled more than N versions before the
    /// version current when its group is complete is masked, or its row dropped (see
    /// stale_tokens); both are counted (default: no bound)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_token_staleness: Option<u64>,
    /// With max_token_staleness: mask the stale tokens (completion_mask 0) or drop their row
    #[cfg_attr(feature = "clap", arg(long, value_name = "RULE"))]
    pub stale_tokens: StaleTokens,
    /// What a pause for a weight update does to the rollouts in flight: wait (they run to
    /// their end under the old weights), abort (cancelled, their groups dropped) or continue
    /// (their requests interrupted with the tokens so far kept, continued after the resume
    /// under the new version); the control endpoint's /pause without ?mode= uses it
    #[cfg_attr(feature = "clap", arg(long, value_name = "MODE"))]
    pub in_flight: InFlight,
    /// Routing replay: ask the server for the experts its router chose for every token
    /// (vLLM started with --enable-return-routed-experts) and write them on each row
    #[cfg_attr(feature = "clap", arg(long))]
    pub routed_experts: bool,
    /// Stop the run (drain, exit 1) once more than this fraction of the rollouts that ended
    /// failed, judged from 16 rollouts on and at the end; failures because no server could
    /// be reached do not count (see --server-wait)
    #[cfg_attr(feature = "clap", arg(long, value_name = "FRACTION"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_failure_rate: Option<f64>,
    /// How long to wait for the servers: at start, and whenever every server is down mid-run
    /// (admission pauses meanwhile); past it the run drains and stops with an error
    #[cfg_attr(feature = "clap", arg(long, value_name = "DURATION", value_parser = humantime::parse_duration))]
    #[serde(with = "humantime_serde")]
    pub server_wait: Duration,
    /// Sampling.
    #[cfg_attr(feature = "clap", command(flatten))]
    #[serde(skip)]
    pub sampling: Sampling,
    /// How the prompts of later turns are built: append (the previous prompt, the ids the
    /// model sampled, and the chat template's ids for what follows: one exact row per
    /// rollout) or rerender (the whole conversation rendered each turn, as TRL does)
    #[cfg_attr(feature = "clap", arg(long, value_name = "MODE"))]
    pub prompt_mode: PromptMode,
    /// How turns become training rows.
    #[cfg_attr(feature = "clap", command(flatten))]
    #[serde(skip)]
    pub reconciler: ReconcilerConfig,
    /// How rewards become advantages. *Not a setting*: a program picks a preset
    /// ([`AdvantageConfig::preset`]) or builds one.
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub advantages: AdvantageConfig,
    /// Scored groups the output holds for a slow consumer before admission waits. *Not a
    /// setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub output_buffer: usize,
    /// The heartbeat's period. *Not a setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub heartbeat: Duration,
    /// A heartbeat later than this is logged as a warning. *Not a setting.*
    #[cfg_attr(feature = "clap", arg(skip))]
    #[serde(skip)]
    pub lag_warning: Duration,
}

impl Default for RolloutConfig {
    /// 8 generations, 64 in flight, 8 turns of at most 512 tokens, append mode, 10 minutes
    /// per rollout, groups of at least 2, one retry, a run that stops past 50% failed
    /// rollouts or 10 minutes without a server, TRL's advantages, a 100 ms heartbeat.
    fn default() -> Self {
        Self {
            num_generations: 8,
            max_inflight: 64,
            max_turns: 8,
            max_tokens: 512,
            max_total_tokens: None,
            max_model_len: None,
            rollout_timeout: Duration::from_secs(600),
            min_group_size: 2,
            retries: 1,
            skip_bad_rows: false,
            max_groups: None,
            max_staleness: None,
            groups_per_version: None,
            max_token_staleness: None,
            stale_tokens: StaleTokens::Mask,
            in_flight: InFlight::Wait,
            routed_experts: false,
            max_failure_rate: Some(0.5),
            server_wait: Duration::from_secs(600),
            sampling: Sampling::default(),
            prompt_mode: PromptMode::Append,
            reconciler: ReconcilerConfig::default(),
            advantages: AdvantageConfig::default(),
            output_buffer: 16,
            heartbeat: Duration::from_millis(100),
            lag_warning: Duration::from_millis(50),
        }
    }
}

impl RolloutConfig {
    /// Checks that the settings can run, saying which one cannot.
    pub fn validate(&self) -> Result<(), SettingError> {
        let at_least_one = [
            ("num_generations", self.num_generations),
            ("max_inflight", self.max_inflight),
            ("max_turns", self.max_turns),
            ("max_tokens", self.max_tokens as usize),
            ("min_group_size", self.min_group_size),
        ];
        for (setting, value) in at_least_one {
            if value == 0 {
                return Err(SettingError::at(setting, "must be at least 1"));
            }
        }
        if self.min_group_size > self.num_generations {
            return Err(SettingError::at(
                "min_group_size",
                format!(
                    "({}) is more than num_generations ({}): no group could ever be kept",
                    self.min_group_size, self.num_generations
                ),
            ));
        }
        if self.groups_per_version == Some(0) {
            return Err(SettingError::at("groups_per_version", "must be at least 1"));
        }
        if self.groups_per_version.is_some() && self.max_staleness.is_none() {
            return Err(SettingError::at(
                "groups_per_version",
                "needs max_staleness: it bounds admission by how stale a group may get",
            ));
        }
        for (setting, value) in [
            ("rollout_timeout", self.rollout_timeout),
            ("server_wait", self.server_wait),
            ("heartbeat", self.heartbeat),
        ] {
            if value.is_zero() {
                return Err(SettingError::at(setting, "must be longer than 0s"));
            }
        }
        if let Some(rate) = self.max_failure_rate
            && !(0.0..=1.0).contains(&rate)
        {
            return Err(SettingError::at(
                "max_failure_rate",
                format!("must be a fraction between 0 and 1, got {rate}"),
            ));
        }
        self.sampling.validate()?;
        self.advantages
            .validate()
            .map_err(|e| SettingError::at("advantages", e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::field_names;

    #[test]
    fn named_values_read_their_names_and_list_them_when_one_is_unknown() {
        assert_eq!("continue".parse(), Ok(InFlight::Continue));
        assert_eq!(InFlight::Abort.to_string(), "abort");
        assert_eq!("drop".parse(), Ok(StaleTokens::Drop));
        assert_eq!(
            "keep".parse::<InFlight>(),
            Err(
                "unknown in-flight mode 'keep'; expected wait (rollouts run to their end), \
                 abort (cancelled) or continue (interrupted, continued after the resume)"
                    .to_owned()
            )
        );
        assert_eq!(
            "both".parse::<PromptMode>(),
            Err(
                "unknown prompt mode 'both'; expected append (token-in/token-out) or rerender \
                 (render the whole conversation each turn)"
                    .to_owned()
            )
        );
    }

    #[test]
    fn field_names_are_the_keys_serde_reads() {
        let names = field_names::<RolloutConfig>();
        assert!(names.contains(&"max_inflight"), "{names:?}");
        assert!(names.contains(&"groups"), "renamed: {names:?}");
        assert!(!names.contains(&"max_groups"), "{names:?}");
        assert!(!names.contains(&"heartbeat"), "skipped: {names:?}");
    }
}
