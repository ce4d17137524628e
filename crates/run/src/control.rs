//! A trainer's pause and resume of a running engine, answered alike wherever they come from
//! (the binary's control endpoint, the row stream's actions).

use rollout::{Engine, InFlight};
use serde_json::json;
use vllm_client::Client;

/// Stops `engine`'s admission (`mode`, else the run's `in_flight`) and answers once it has:
/// `{"paused": true, "in_flight": N, "queued": N}`.
pub async fn pause(engine: &Engine<Client>, mode: Option<InFlight>) -> serde_json::Value {
    engine
        .pause(mode.unwrap_or(engine.config().in_flight))
        .await;
    let health = engine.health();
    json!({"paused": true, "in_flight": health.in_flight, "queued": health.queued})
}

/// Starts `engine`'s admission again: `{"paused": false}`.
pub fn resume(engine: &Engine<Client>) -> serde_json::Value {
    engine.resume();
    json!({"paused": false})
}
