//! Training samples: the engine's output, one per training row.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Message, reconcile::RolloutId};

/// One training row with everything a trainer needs to learn from it. A forked conversation
/// gives several samples with the same `rollout_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSample {
    /// The group (one dataset row, `num_generations` rollouts) the sample belongs to.
    pub group_id: u64,
    /// How many samples its group has: the group is whole in a file when that many lines
    /// carry its `group_id` (a reader resuming a cut file drops a group cut short).
    #[serde(default)]
    pub group_samples: u64,
    /// The rollout (conversation) it comes from.
    pub rollout_id: RolloutId,
    /// The prompt messages: the dataset row's, after the initial messages of the rollout's
    /// environment session when it ran in one.
    pub prompt: Vec<Message>,
    /// The messages the rollout added: assistant turns and tool results.
    pub completion: Vec<Message>,
    /// Every token of the row.
    pub input_ids: Vec<u32>,
    /// `1` for a sampled token that is trained on, `0` elsewhere.
    pub completion_mask: Vec<u8>,
    /// The sampling log-prob of each sampled token, `0.0` elsewhere.
    pub old_log_probs: Vec<f32>,
    /// The rollout's advantage within its group.
    pub advantage: f64,
    /// The combined reward; `null` when unscorable.
    pub reward: Option<f64>,
    /// Per reward function, by name: its score, or `null` when it could not score.
    pub rewards: Map<String, Value>,
    /// The model version its group's first turn was sampled under (the oldest of the
    /// group's turns); the span of the sample's own turns is in `metrics`
    /// (`model_version_min`, `model_version_max`).
    pub model_version: u64,
    /// Per-sample numbers (turns, tool calls, drift, ...).
    pub metrics: Map<String, Value>,
    /// What the rollout's environment said that is not a number (absent when it said
    /// nothing): `artifacts`, what its verify returned beyond the reward, `done` and numeric
    /// metrics (those are in `metrics`: `env/NAME`, `env_verify_done`); `tools`, one
    /// `{"name", "metadata"}` per tool call whose result carried metadata (an MCP result's
    /// structured content is its metadata's `structured`), in call order.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub environment: Map<String, Value>,
}
