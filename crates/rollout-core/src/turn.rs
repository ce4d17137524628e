//! What one generation call produced: the exact prompt sent and what the server sampled.

use crate::RoutedExperts;

/// One model call of a conversation, as the server saw it and answered.
///
/// Training rows are built from these ids, never from re-tokenized text: `prompt_ids` are
/// the ids sent (after rendering), `sampled_ids` and `logprobs` the ids the server sampled
/// and their log-probabilities under the policy of `model_version`.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnRecord {
    /// The prompt token ids exactly as sent to the server.
    pub prompt_ids: Vec<u32>,
    /// The token ids the server sampled, in order (EOS included when it was sampled).
    pub sampled_ids: Vec<u32>,
    /// One log-probability per sampled id.
    pub logprobs: Vec<f32>,
    /// Which sampled ids are trained on (`true`) and which are kept as context only
    /// (`false`); `None` trains on all of them. One entry per sampled id when present.
    pub mask: Option<Vec<bool>>,
    /// The model version the ids were sampled under.
    pub model_version: u64,
    /// With routing replay, the experts the server's router chose for the positions it
    /// reported of `prompt_ids` then `sampled_ids`.
    pub routed_experts: Option<RoutedExperts>,
}

impl TurnRecord {
    /// A turn whose every sampled token is trained on.
    pub fn new(
        prompt_ids: Vec<u32>,
        sampled_ids: Vec<u32>,
        logprobs: Vec<f32>,
        model_version: u64,
    ) -> Self {
        Self {
            prompt_ids,
            sampled_ids,
            logprobs,
            mask: None,
            model_version,
            routed_experts: None,
        }
    }

    /// Sets the routing the server reported.
    #[must_use]
    pub fn with_routed_experts(mut self, routed: Option<RoutedExperts>) -> Self {
        self.routed_experts = routed;
        self
    }

    /// Sets the per-token mask (`true` = trained on).
    #[must_use]
    pub fn with_mask(mut self, mask: Vec<bool>) -> Self {
        self.mask = Some(mask);
        self
    }
}
