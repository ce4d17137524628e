//! `kind = "reward_model"`: a trained reward model on vLLM's pooling runner.

use std::sync::Arc;

use bytes::Bytes;
use futures::{future::BoxFuture, future::join_all};
use serde::Deserialize;
use serde_json::{Value, json};

use super::service::{Service, ServiceConfig, ServiceError, head};
use crate::{
    group::Group,
    reward::{AsyncReward, CallStats, RewardError, Scores},
};

/// What a [`RewardModel`] asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardModelConfig {
    model: String,
    activation: bool,
    class_index: usize,
}

impl RewardModelConfig {
    /// The model the server serves, its raw score (no activation), class 0.
    pub fn new(model: impl Into<String>) -> RewardModelConfig {
        RewardModelConfig {
            model: model.into(),
            activation: false,
            class_index: 0,
        }
    }

    /// Whether the server applies the model's activation to the score (vLLM's
    /// `use_activation`: a sigmoid for one class, a softmax over several). Off by default:
    /// a reward model's score is its raw output, as it was trained.
    pub fn activation(mut self, activation: bool) -> RewardModelConfig {
        self.activation = activation;
        self
    }

    /// Which of the model's outputs is the score (default 0, a reward model's only one; a
    /// two-class classifier's "good" class is often 1).
    pub fn class_index(mut self, index: usize) -> RewardModelConfig {
        self.class_index = index;
        self
    }
}

/// Scores each completion with a reward model served by vLLM's pooling runner
/// (`vllm serve RM --runner pooling`, for a `*ForSequenceClassification` checkpoint).
///
/// Each completion is one `POST` to the endpoint (`http://HOST:PORT/classify`, or
/// `/pooling`) with the conversation as `messages`: the prompt (a string becomes one user
/// message) followed by the completion's messages, tool turns included. The server renders
/// them with the reward model's own chat template, so the engine needs none of the reward
/// model's files. A group's requests are sent together (under the concurrency bound), so
/// the server can batch them. The score is `data[0].probs[class_index]` (`/classify`)
/// or `data[0].data[class_index]` (`/pooling`).
///
/// A call that fails (connection, timeout, an error status after the retries, an answer of
/// another shape or a score that is not finite) leaves that completion unscorable, counted
/// by cause; the run goes on. Cheap to clone; clones share the connection pool, the bound
/// and the counters.
#[derive(Clone)]
pub struct RewardModel {
    inner: Arc<Inner>,
}

struct Inner {
    service: Service,
    config: RewardModelConfig,
}

impl std::fmt::Debug for RewardModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModel")
            .field("url", &self.inner.service.url())
            .field("config", &self.inner.config)
            .field("calls", &self.inner.service.stats())
            .finish()
    }
}

impl RewardModel {
    /// A reward model at the endpoint `service` names; fails on a URL that is not `http://`
    /// or `https://` with a host.
    pub fn new(
        service: ServiceConfig,
        config: RewardModelConfig,
    ) -> Result<RewardModel, ServiceError> {
        Ok(RewardModel {
            inner: Arc::new(Inner {
                service: Service::new(service)?,
                config,
            }),
        })
    }

    /// The URL it posts to.
    pub fn url(&self) -> &str {
        self.inner.service.url()
    }
}

/// The conversation a completion closes: the prompt's messages, then the completion's.
fn conversation(group: &Group, completion: usize) -> Vec<Value> {
    let mut messages = match &group.prompt {
        Value::Array(messages) => messages.clone(),
        Value::Null => Vec::new(),
        Value::String(text) => vec![json!({ "role": "user", "content": text })],
        other => vec![json!({ "role": "user", "content": other.to_string() })],
    };
    messages.extend(group.completions[completion].messages.iter().cloned());
    messages
}

/// The answer of `/classify` (`probs`) and of `/pooling` (`data`), first item.
#[derive(Deserialize)]
struct Answer {
    data: Vec<Item>,
}

#[derive(Deserialize)]
struct Item {
    #[serde(alias = "data")]
    probs: Vec<f64>,
}

impl Inner {
    fn request(&self, messages: Vec<Value>) -> Bytes {
        let body = json!({
            "model": self.config.model,
            "messages": messages,
            "add_generation_prompt": false,
            "use_activation": self.config.activation,
        });
        Bytes::from(body.to_string())
    }

    /// The score `class_index` names in an answer.
    fn read(&self, answer: &[u8]) -> Result<f64, String> {
        let index = self.config.class_index;
        let expected = || {
            format!(
                "expected {{\"data\": [{{\"probs\": [...]}}]}} (vLLM's /classify) or \
                 {{\"data\": [{{\"data\": [...]}}]}} (/pooling) with a number at index {index}; \
                 it answered: {:?}",
                head(answer)
            )
        };
        let answer: Answer = serde_json::from_slice(answer).map_err(|_| expected())?;
        let score = answer
            .data
            .first()
            .and_then(|item| item.probs.get(index).copied())
            .ok_or_else(expected)?;
        if score.is_finite() {
            Ok(score)
        } else {
            Err(format!("the score is not a finite number: {score}"))
        }
    }

    async fn score(&self, group: &Group) -> Scores {
        let calls = (0..group.len()).map(|i| {
            let body = self.request(conversation(group, i));
            async move {
                self.service
                    .call(body, |answer| self.read(answer))
                    .await
                    .ok()
            }
        });
        join_all(calls).await
    }
}

impl AsyncReward for RewardModel {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { Ok(inner.score(&group).await) })
    }

    fn calls(&self) -> Option<CallStats> {
        Some(self.inner.service.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Completion;

    fn model(index: usize) -> Inner {
        Inner {
            service: Service::new(ServiceConfig::new("http://127.0.0.1:9/classify"))
                .expect("a valid URL"),
            config: RewardModelConfig::new("rm").class_index(index),
        }
    }

    #[test]
    fn scores_are_read_from_classify_and_pooling_answers_at_their_index() {
        let classify =
            br#"{"data":[{"index":0,"label":"LABEL_0","probs":[0.25,-1.5],"num_classes":2}]}"#;
        let pooling = br#"{"data":[{"index":0,"object":"pooling","data":[-0.32]}]}"#;
        assert_eq!(model(0).read(classify), Ok(0.25));
        assert_eq!(model(1).read(classify), Ok(-1.5));
        assert_eq!(model(0).read(pooling), Ok(-0.32));
        let out_of_range = model(2).read(classify).expect_err("no class 2");
        assert!(out_of_range.contains("index 2"), "{out_of_range}");
        assert!(model(0).read(br#"{"data":[]}"#).is_err());
        assert!(model(0).read(br#"{"error":{"message":"no"}}"#).is_err());
    }

    #[test]
    fn the_conversation_is_the_prompt_then_every_message_of_the_completion() {
        let mut completion = Completion::from_text("It is 5.");
        completion
            .messages
            .insert(0, json!({"role": "tool", "content": "5"}));
        let group = Group::new("What is 2 + 3?", vec![completion], Default::default());
        let request: Value =
            serde_json::from_slice(&model(0).request(conversation(&group, 0))).expect("JSON");
        assert_eq!(
            request["messages"],
            json!([
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": "It is 5."},
            ])
        );
        assert_eq!(request["model"], "rm");
        assert_eq!(request["use_activation"], false);
        assert_eq!(request["add_generation_prompt"], false);
    }
}
