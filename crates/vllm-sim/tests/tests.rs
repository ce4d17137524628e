//! The vLLM client against the simulator, over real HTTP: one test binary, one module per
//! area. It lives here rather than in vllm-client because the simulator reads requests with
//! the client's wire types: vllm-client depends on nothing of ours, not even for its tests.
//! (The client's suite against a real vLLM server is vllm-client's `e2e`.) `judge`: scoring's
//! LLM judge against the simulator's scripted judge, here for the same reason (the simulator
//! scores with scoring's types).

mod arithmetic;
mod availability;
mod chat;
mod generate;
mod judge;
mod limits;
mod pause;
mod replicas;
mod retry;

use std::time::Duration;

use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
use vllm_client::{Client, ClientConfig, RetryPolicy};

/// A simulator on a free loopback port, with `configure` applied to the defaults.
pub(crate) async fn simulator(configure: impl FnOnce(&mut SimConfig)) -> Simulator {
    let mut config = SimConfig::new(training_tokenizer());
    configure(&mut config);
    Simulator::start(config, "127.0.0.1:0".parse().expect("an address"))
        .await
        .expect("the simulator starts")
}

/// A client of `servers` for the simulator's model, retrying fast.
pub(crate) fn client(servers: &[&Simulator], retry: RetryPolicy) -> Client {
    let config = ClientConfig::with_servers(servers.iter().map(|s| s.url()))
        .model("sim")
        .retry(retry);
    Client::new(config).expect("the client starts")
}

/// Retries quickly: 10 ms doubling to 50 ms, 8 attempts, 10 s deadline.
pub(crate) fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 8,
        base_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        deadline: Duration::from_secs(10),
    }
}

/// Polls `condition` every 5 ms for up to ten seconds.
pub(crate) async fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    for _ in 0..2000 {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    condition()
}
