//! Whether any server can take requests: every server down, then one back.

use std::time::Duration;

use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
use vllm_client::{Client, ClientConfig, GenerateParams};

use crate::{eventually, fast_retry, simulator};

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: 4,
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn a_server_that_cannot_be_reached_makes_the_client_unavailable_until_it_answers() {
    // A port that was free a moment ago: nothing listens there now.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let up = simulator(|_| {}).await;
    let client = Client::new(
        ClientConfig::with_servers([format!("http://127.0.0.1:{port}"), up.url()])
            .model("sim")
            .retry(fast_retry()),
    )
    .expect("the client starts");
    assert_eq!(client.unavailable(), None, "nothing has failed yet");
    client
        .generate(&[1], &params())
        .await
        .expect("one server answers");
    // Fail the closed port directly: one attempt there marks it down, but the other is up.
    let dead_only = Client::new(
        ClientConfig::new(format!("http://127.0.0.1:{port}"))
            .model("sim")
            .retry(fast_retry()),
    )
    .expect("the client starts");
    let error = dead_only
        .generate(&[1], &params())
        .await
        .expect_err("nothing listens");
    assert!(error.is_connect() || error.is_transport(), "{error}");
    let why = dead_only.unavailable().expect("its only server is down");
    assert!(
        why.starts_with(&format!("http://127.0.0.1:{port}: ")),
        "{why}"
    );

    // The server comes up on that port; the health checks notice and take it back.
    let checks = dead_only.spawn_health_checks(Duration::from_millis(50));
    let back = Simulator::start(
        SimConfig::new(training_tokenizer()),
        format!("127.0.0.1:{port}").parse().expect("an address"),
    )
    .await
    .expect("the simulator starts on the freed port");
    assert!(
        eventually(|| dead_only.unavailable().is_none()).await,
        "still unavailable: {:?}",
        dead_only.unavailable()
    );
    checks.abort();
    dead_only
        .generate(&[1], &params())
        .await
        .expect("the server is back");
    back.stop().await;
    up.stop().await;
}
