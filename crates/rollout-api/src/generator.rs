//! [`Generator`]: what the loop asks of an inference server, and its vllm-client implementation.

use std::{fmt, future::Future};

use crate::SettingError;
use rollout_core::{RolloutId, RoutedExperts};

/// Sampling settings shared by every request of a run (settings file keys and, with the
/// `clap` feature, flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[serde(default)]
pub struct Sampling {
    /// Sampling temperature (1.0: the policy itself, as RL needs)
    #[cfg_attr(feature = "clap", arg(long, value_name = "T"))]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass
    #[cfg_attr(feature = "clap", arg(long, value_name = "P"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens (-1: all)
    #[cfg_attr(
        feature = "clap",
        arg(long, value_name = "K", allow_negative_numbers = true)
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    /// Drop tokens less likely than this fraction of the most likely one
    #[cfg_attr(feature = "clap", arg(long, value_name = "P"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Base seed of the requests: each gets a distinct seed derived from it, the rollout and
    /// the turn, so a run can be replayed (default: the server chooses)
    #[cfg_attr(feature = "clap", arg(long, value_name = "N"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: None,
            top_k: None,
            min_p: None,
            seed: None,
        }
    }
}

impl Sampling {
    /// Checks that a server would accept these values, saying which one it would not.
    pub fn validate(&self) -> Result<(), SettingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SettingError::at(
                "temperature",
                format!("must be a number >= 0, got {t}"),
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(SettingError::at(
                "top_p",
                format!("must be in (0, 1], got {p}"),
            ));
        }
        if let Some(p) = self.min_p
            && !(0.0..=1.0).contains(&p)
        {
            return Err(SettingError::at(
                "min_p",
                format!("must be in [0, 1], got {p}"),
            ));
        }
        if let Some(k) = self.top_k
            && (k == 0 || k < -1)
        {
            return Err(SettingError::at(
                "top_k",
                format!("must be -1 (all tokens) or at least 1, got {k}"),
            ));
        }
        Ok(())
    }
}

/// One turn to sample.
#[derive(Debug, Clone, Copy)]
pub struct GenerateRequest<'a> {
    /// The rollout the turn belongs to (a generator may keep a rollout on one server).
    pub rollout: RolloutId,
    /// The turn's index in its rollout, from 0.
    pub turn: usize,
    /// The prompt, as token ids.
    pub prompt_ids: &'a [u32],
    /// Most tokens to sample: already clipped to the room left in the context.
    pub max_tokens: u32,
    /// Sampling settings.
    pub sampling: &'a Sampling,
    /// This request's seed, when the run has one.
    pub seed: Option<u64>,
    /// Routing replay: report the experts routed for the positions from this one of the
    /// prompt on (`None`: no routing asked).
    pub routed_experts_from: Option<usize>,
}

/// Why sampling stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model ended its answer (EOS or a stop sequence).
    Stop,
    /// `max_tokens` was reached: the answer is cut.
    Length,
    /// The server aborted the request (a weight update, a pause): the tokens so far are valid.
    Abort,
}

/// What a generator sampled for one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The sampled ids, the end-of-answer id included when it was sampled.
    pub token_ids: Vec<u32>,
    /// One log-probability per sampled id.
    pub logprobs: Vec<f32>,
    /// Why sampling stopped.
    pub finish: Finish,
    /// The experts routed for the positions asked for (`routed_experts_from` on), when the
    /// server reported them.
    pub routed_experts: Option<RoutedExperts>,
}

impl Generation {
    /// A generation without routing.
    pub fn new(token_ids: Vec<u32>, logprobs: Vec<f32>, finish: Finish) -> Generation {
        Generation {
            token_ids,
            logprobs,
            finish,
            routed_experts: None,
        }
    }
}

/// A turn that could not be sampled, after whatever retries the generator does itself.
#[derive(Debug)]
pub struct GenerateError {
    message: String,
    prompt_too_long: bool,
    unavailable: bool,
}

impl GenerateError {
    /// An error with a message for the report.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            prompt_too_long: false,
            unavailable: false,
        }
    }

    /// No server could be reached (refused, reset, hung, 5xx): the rollout says nothing of
    /// itself, and the loop waits for [`Generator::unavailable`] to clear before admitting
    /// more.
    #[must_use]
    pub fn server_unavailable(mut self) -> Self {
        self.unavailable = true;
        self
    }

    /// Whether no server could be reached.
    pub fn is_server_unavailable(&self) -> bool {
        self.unavailable
    }

    /// The server refused the prompt as longer than its context: retrying the same prompt
    /// cannot help.
    #[must_use]
    pub fn prompt_too_long(mut self) -> Self {
        self.prompt_too_long = true;
        self
    }

    /// Whether the server refused the prompt's length.
    pub fn is_prompt_too_long(&self) -> bool {
        self.prompt_too_long
    }
}

impl fmt::Display for GenerateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GenerateError {}

/// Samples turns from token ids: an inference server, or anything that acts as one.
///
/// Dropping the future returned by [`Generator::generate`] must abandon the request (the
/// loop drops it when a rollout is cancelled or runs past its deadline); vllm-client's
/// [`Client`](vllm_client::Client) aborts it on the server.
pub trait Generator: Send + Sync + 'static {
    /// Samples one turn.
    fn generate(
        &self,
        request: GenerateRequest<'_>,
    ) -> impl Future<Output = Result<Generation, GenerateError>> + Send;

    /// The server's context length, when it reports one.
    fn max_model_len(&self) -> Option<u32> {
        None
    }

    /// Ends the requests in flight early, each answering at once with what it sampled so far
    /// ([`Finish::Abort`]), so that the loop can continue them under new weights; the server
    /// then serves requests again. `Ok(false)` when this generator cannot (its requests run
    /// to their end instead), which is the default.
    fn interrupt(&self) -> impl Future<Output = Result<bool, GenerateError>> + Send {
        std::future::ready(Ok(false))
    }

    /// A rollout has ended: forget whatever was kept for it.
    fn release(&self, rollout: RolloutId) {
        let _ = rollout;
    }

    /// Why no request can be served now (every server down, with the last error), or `None`
    /// when one can. The loop admits no group while this says why, and stops the run when it
    /// lasts longer than the run's `server_wait` (async-grpo-rollout's `RolloutConfig`).
    fn unavailable(&self) -> Option<String> {
        None
    }

    /// Counters of the generator's own (requests retried, servers ejected), for metrics.
    fn stats(&self) -> GeneratorStats {
        GeneratorStats::default()
    }
}

/// What a [`Generator`] counts of its own, reported with the loop's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct GeneratorStats {
    /// Requests sent (every attempt).
    pub attempts: u64,
    /// Attempts retried after a retryable failure.
    pub retries: u64,
    /// Requests that failed in the end.
    pub failures: u64,
    /// Servers ejected after a failure.
    pub ejections: u64,
}

impl GeneratorStats {
    /// Stats with every counter given.
    pub fn new(attempts: u64, retries: u64, failures: u64, ejections: u64) -> GeneratorStats {
        GeneratorStats {
            attempts,
            retries,
            failures,
            ejections,
        }
    }
}

#[cfg(feature = "vllm-client")]
mod vllm {
    use vllm_client::{Client, FinishReason, GenerateParams, PauseMode, SamplingParams};

    use super::{Finish, GenerateError, GenerateRequest, Generation, Generator, GeneratorStats};
    use rollout_core::{ExpertDtype, RolloutId, RoutedExperts};

    fn sticky_key(rollout: RolloutId) -> String {
        format!("rollout-{}", rollout.0)
    }

    /// Turns go to `/v1/completions` as token ids, a rollout's turns to one server (sticky on
    /// the rollout id, so they reuse its prefix cache).
    impl Generator for Client {
        async fn generate(
            &self,
            request: GenerateRequest<'_>,
        ) -> Result<Generation, GenerateError> {
            let params = GenerateParams {
                max_tokens: request.max_tokens,
                sampling: SamplingParams {
                    temperature: Some(request.sampling.temperature),
                    top_p: request.sampling.top_p,
                    top_k: request.sampling.top_k,
                    min_p: request.sampling.min_p,
                    seed: request.seed,
                    ..SamplingParams::default()
                },
                structured_outputs: None,
                sticky_key: Some(sticky_key(request.rollout)),
                routed_experts_from: request.routed_experts_from,
            };
            let completion = Client::generate(self, request.prompt_ids, &params)
                .await
                .map_err(|error| {
                    let refused = GenerateError::new(error.to_string());
                    if error.is_prompt_too_long() {
                        refused.prompt_too_long()
                    } else if error.is_retryable() || error.is_timeout() {
                        refused.server_unavailable()
                    } else {
                        refused
                    }
                })?;
            let finish = match completion.finish_reason {
                FinishReason::Length => Finish::Length,
                FinishReason::Abort => Finish::Abort,
                _ => Finish::Stop,
            };
            let routed_experts = completion.routed_experts.map(|routed| {
                let [tokens, layers, top_k] = routed.shape;
                RoutedExperts {
                    start: request.routed_experts_from.unwrap_or(0),
                    tokens,
                    layers,
                    top_k,
                    dtype: if routed.width == 2 {
                        ExpertDtype::Uint16
                    } else {
                        ExpertDtype::Uint8
                    },
                    data: routed.data,
                }
            });
            Ok(Generation {
                logprobs: completion.logprobs.iter().map(|&l| l as f32).collect(),
                token_ids: completion.token_ids,
                finish,
                routed_experts,
            })
        }

        /// `POST /pause?mode=abort` then `/resume` on every server: the requests in flight
        /// answer at once with `finish_reason: "abort"` and their partial ids (needs the
        /// server's `VLLM_SERVER_DEV_MODE=1`).
        async fn interrupt(&self) -> Result<bool, GenerateError> {
            let paused = Client::pause(self, PauseMode::Abort).await;
            // Resumed whatever the pause did: a server left paused would hold every request.
            let resumed = Client::resume(self).await;
            paused
                .and(resumed)
                .map(|()| true)
                .map_err(|e| GenerateError::new(e.to_string()))
        }

        fn max_model_len(&self) -> Option<u32> {
            Client::max_model_len(self)
        }

        fn release(&self, rollout: RolloutId) {
            Client::release(self, &sticky_key(rollout));
        }

        fn unavailable(&self) -> Option<String> {
            Client::unavailable(self)
        }

        fn stats(&self) -> GeneratorStats {
            let stats = Client::stats(self);
            GeneratorStats::new(
                stats.attempts,
                stats.retries,
                stats.failures,
                stats.ejections,
            )
        }
    }
}
