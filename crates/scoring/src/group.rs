//! What a reward function sees: one group of completions of the same prompt.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The completions of one prompt, with the dataset row they came from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The prompt: a string, or a list of chat messages.
    pub prompt: Value,
    /// The completions, in order.
    pub completions: Vec<Completion>,
    /// The dataset row's other columns (the answer, test cases, ...).
    #[serde(default)]
    pub row: Map<String, Value>,
}

impl Group {
    /// A group of `completions` of `prompt`, for the dataset `row`.
    pub fn new(
        prompt: impl Into<Value>,
        completions: Vec<Completion>,
        row: Map<String, Value>,
    ) -> Group {
        Group {
            prompt: prompt.into(),
            completions,
            row,
        }
    }

    /// How many completions the group holds.
    pub fn len(&self) -> usize {
        self.completions.len()
    }

    /// Whether the group holds no completion.
    pub fn is_empty(&self) -> bool {
        self.completions.is_empty()
    }

    /// A column of the dataset row.
    pub fn column(&self, name: &str) -> Option<&Value> {
        self.row.get(name)
    }
}

/// One completion: the messages the model produced (tool turns included), its final answer
/// text, and the token ids it sampled.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The final answer: the content of the last assistant message.
    pub text: String,
    /// Every message after the prompt (assistant, tool), in OpenAI chat shape.
    #[serde(default)]
    pub messages: Vec<Value>,
    /// The sampled token ids of the completion.
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Whether the rollout produced a training row; a completion without one (an empty
    /// trace) is scored but never enters its siblings' baseline.
    #[serde(default = "yes")]
    pub has_training_row: bool,
    /// A reward the rollout itself produced, such as an environment's verdict on its
    /// episode; `None` when it produced none. [`builtin::environment`](crate::builtin::environment)
    /// makes it a column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_reward: Option<f64>,
}

fn yes() -> bool {
    true
}

impl Completion {
    /// A completion made of one assistant message.
    pub fn from_text(text: impl Into<String>) -> Completion {
        let text = text.into();
        Completion {
            messages: vec![json!({ "role": "assistant", "content": text })],
            text,
            token_ids: Vec::new(),
            has_training_row: true,
            rollout_reward: None,
        }
    }

    /// Sets the sampled token ids.
    pub fn with_token_ids(mut self, token_ids: Vec<u32>) -> Completion {
        self.token_ids = token_ids;
        self
    }
}
