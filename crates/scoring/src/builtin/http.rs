//! `kind = "http"`: a reward service of the user's own, over HTTP.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Deserialize;

use super::service::{Service, ServiceConfig, ServiceError, head};
use crate::{
    group::Group,
    reward::{AsyncReward, CallStats, RewardError, Scores},
};

/// Posts each group to a reward service and reads one score or `null` per completion.
///
/// The request is the group as JSON, as a `command` reward gets it on stdin: `{"prompt",
/// "completions": [{"text", "messages", "token_ids", "has_training_row"}], "row"}`. The
/// answer is a JSON array with one number or `null` per completion, or an object whose
/// `scores` field is that array. A `null` leaves that completion unscorable for this column.
/// A call that fails (connection, timeout, an error status after the retries, an answer of
/// another shape) fails the column for that group, with the cause in its message; the run
/// goes on. Cheap to clone; clones share the connection pool, the concurrency bound and the
/// counters.
#[derive(Clone)]
pub struct HttpReward {
    service: Arc<Service>,
}

impl std::fmt::Debug for HttpReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpReward")
            .field("url", &self.service.url())
            .field("calls", &self.service.stats())
            .finish()
    }
}

/// The answer's two shapes.
#[derive(Deserialize)]
#[serde(untagged)]
enum Answer {
    Scores(Scores),
    Object { scores: Scores },
}

impl HttpReward {
    /// A reward calling the service `config` names; fails on a URL that is not `http://` or
    /// `https://` with a host.
    pub fn new(config: ServiceConfig) -> Result<HttpReward, ServiceError> {
        Ok(HttpReward {
            service: Arc::new(Service::new(config)?),
        })
    }

    /// The URL it posts to.
    pub fn url(&self) -> &str {
        self.service.url()
    }
}

/// One number or `null` per completion, bare or under `scores`.
fn read(answer: &[u8]) -> Result<Scores, String> {
    match serde_json::from_slice::<Answer>(answer) {
        Ok(Answer::Scores(scores) | Answer::Object { scores }) => Ok(scores),
        Err(_) => Err(format!(
            "expected a JSON array with one number or null per completion, or \
             {{\"scores\": [...]}}; it answered: {:?}",
            head(answer)
        )),
    }
}

impl AsyncReward for HttpReward {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let service = Arc::clone(&self.service);
        Box::pin(async move {
            let body = serde_json::to_vec(&*group)?;
            let scores = service
                .call(body.into(), read)
                .await
                .map_err(|message| format!("reward service {message}"))?;
            Ok(scores)
        })
    }

    fn calls(&self) -> Option<CallStats> {
        Some(self.service.stats())
    }
}
