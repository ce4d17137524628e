//! Training samples: the engine's output, one per training row.

use std::{borrow::Cow, fmt, ops::Index};

use serde::{Deserialize, Serialize, de, ser::SerializeMap};
use serde_json::{Map, Value};

use crate::{Message, RowRouting, reconcile::RolloutId};

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
    /// The oldest model version among the row's sampled tokens (its first turn's when it
    /// holds none): what a trainer's staleness check reads, conservative for every token.
    pub model_version: u64,
    /// The model version of each sampled token, as spans of `input_ids` in order
    /// (`[{"start", "end", "version"}]`): every sampled token is in exactly one span, context
    /// tokens in none. Empty in files written before per-token versions.
    #[serde(default)]
    pub token_versions: Vec<VersionSpan>,
    /// With routing replay: for every token of `input_ids`, per layer, the experts the
    /// server's router chose (see [`RowRouting`] for its JSON form). Absent without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<RowRouting>,
    /// Per-sample numbers (turns, tool calls, drift, ...).
    pub metrics: SampleMetrics,
    /// What the rollout's environment said that is not a number (absent when it said
    /// nothing): `artifacts`, what its verify returned beyond the reward, `done` and numeric
    /// metrics (those are in `metrics`: `env/NAME`, `env_verify_done`); `tools`, one
    /// `{"name", "metadata"}` per tool call whose result carried metadata (an MCP result's
    /// structured content is its metadata's `structured`), in call order.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub environment: Map<String, Value>,
    /// Per reward function that keeps a note of its verdict (a judge asked to keep its
    /// answers), by name: the note on this completion, text. Absent when none did.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub reward_notes: Map<String, Value>,
    /// One per assistant turn of the row, in order: the reward the rollout's environment gave
    /// the turn's tool calls (their sum; `null` when none of them carried one). Absent when
    /// the environment gave no step reward in the whole rollout.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_rewards: Vec<Option<f64>>,
    /// With turn-level credit, one per assistant turn of the row, in order: where the turn's
    /// sampled tokens are in `input_ids` and their advantage. Absent with episode credit,
    /// where `advantage` is every trained token's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub advantage_spans: Vec<AdvantageSpan>,
}

/// The model version that sampled the tokens `input_ids[start..end]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionSpan {
    /// The first token.
    pub start: usize,
    /// One past the last token.
    pub end: usize,
    /// The version of the weights that sampled them.
    pub version: u64,
}

/// The advantage of the tokens `input_ids[start..end]` (one assistant turn's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdvantageSpan {
    /// The turn's first token.
    pub start: usize,
    /// One past its last token.
    pub end: usize,
    /// The advantage of each of its trained tokens.
    pub advantage: f64,
}

/// A sample's numbers by name, in the order they were put, written as a JSON object of
/// numbers (a non-finite number as `null`, read back as NaN). The engine's own names are
/// static strings: a sample's metrics are one small vector, not a map with a string and a
/// JSON value per name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleMetrics(Vec<(Cow<'static, str>, f64)>);

impl SampleMetrics {
    /// No metric yet.
    pub fn new() -> SampleMetrics {
        SampleMetrics::default()
    }

    /// No metric yet, with room for `capacity`.
    pub fn with_capacity(capacity: usize) -> SampleMetrics {
        SampleMetrics(Vec::with_capacity(capacity))
    }

    /// Sets `name` to `value`: where it already is, else last.
    pub fn insert(&mut self, name: impl Into<Cow<'static, str>>, value: f64) {
        let name = name.into();
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some((_, old)) => *old = value,
            None => self.0.push((name, value)),
        }
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }

    /// Whether `name` is set.
    pub fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// The metrics, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, f64)> {
        self.0.iter().map(|(n, v)| (n.as_ref(), *v))
    }

    /// How many metrics are set.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Index<&str> for SampleMetrics {
    type Output = f64;

    /// The value of `name`; panics when it is not set.
    fn index(&self, name: &str) -> &f64 {
        match self.0.iter().find(|(n, _)| n == name) {
            Some((_, value)) => value,
            None => panic!("no sample metric named '{name}'"),
        }
    }
}

impl<N: Into<Cow<'static, str>>> FromIterator<(N, f64)> for SampleMetrics {
    fn from_iter<I: IntoIterator<Item = (N, f64)>>(iter: I) -> SampleMetrics {
        let mut metrics = SampleMetrics::new();
        for (name, value) in iter {
            metrics.insert(name, value);
        }
        metrics
    }
}

impl Serialize for SampleMetrics {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(name.as_ref(), value)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for SampleMetrics {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl<'de> de::Visitor<'de> for Visitor {
            type Value = SampleMetrics;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of numbers (or null)")
            }

            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<SampleMetrics, A::Error> {
                let mut metrics = SampleMetrics::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((name, value)) = map.next_entry::<String, Option<f64>>()? {
                    metrics.insert(name, value.unwrap_or(f64::NAN));
                }
                Ok(metrics)
            }
        }

        deserializer.deserialize_map(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_metrics_keep_their_order_replace_in_place_and_write_a_json_object() {
        let mut metrics = SampleMetrics::with_capacity(3);
        metrics.insert("turns", 2.0);
        metrics.insert(format!("env/{}", "steps"), 3.0);
        metrics.insert("broken", f64::NAN);
        metrics.insert("turns", 4.0);
        assert_eq!(metrics.len(), 3);
        assert_eq!(metrics["turns"], 4.0);
        assert_eq!(metrics.get("env/steps"), Some(3.0));
        assert!(!metrics.contains_key("tool_calls"));
        let text = serde_json::to_string(&metrics).expect("serializes");
        assert_eq!(text, r#"{"turns":4.0,"env/steps":3.0,"broken":null}"#);
        let back: SampleMetrics = serde_json::from_str(&text).expect("deserializes");
        let names: Vec<&str> = back.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["turns", "env/steps", "broken"]);
        assert!(back["broken"].is_nan());
        let error = serde_json::from_str::<SampleMetrics>(r#"{"turns":"two"}"#)
            .expect_err("a string is not a number");
        assert!(error.to_string().contains("invalid type"), "{error}");
    }
}
