//! Retries: transport errors and 5xx only, bounded by attempts and a deadline.

use std::time::{Duration, Instant};

use vllm_client::{GenerateParams, RetryPolicy};

use crate::{client, fast_retry, simulator};

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn a_503_is_retried_until_the_server_answers() {
    let sim = simulator(|c| {
        c.faults.error_503 = 0.5;
        c.fault_seed = 11;
    })
    .await;
    let client = client(&[&sim], fast_retry());
    for _ in 0..20 {
        client
            .generate(&[1, 2], &params())
            .await
            .expect("every call succeeds in the end");
    }
    let injected = sim.counters().injected_503;
    assert!(injected > 0, "the fault seed injects some 503s");
    assert_eq!(
        client.stats().retries,
        injected,
        "each 503 cost exactly one retry"
    );
    assert_eq!(client.stats().failures, 0);
}

#[tokio::test]
async fn a_connection_dropped_mid_response_is_retried() {
    let sim = simulator(|c| {
        c.faults.drop_connection = 0.5;
        c.fault_seed = 3;
    })
    .await;
    let client = client(&[&sim], fast_retry());
    for _ in 0..10 {
        client
            .generate(&[1, 2], &params())
            .await
            .expect("every call succeeds in the end");
    }
    assert!(sim.counters().injected_drops > 0);
    assert_eq!(client.stats().retries, sim.counters().injected_drops);
}

#[tokio::test]
async fn attempts_are_bounded() {
    let sim = simulator(|c| c.faults.error_503 = 1.0).await;
    let retry = RetryPolicy {
        max_attempts: 3,
        ..fast_retry()
    };
    let client = client(&[&sim], retry);
    let error = client
        .generate(&[1, 2], &params())
        .await
        .expect_err("always 503");

    assert_eq!(error.status(), Some(503));
    assert_eq!(
        error.to_string(),
        "POST /v1/completions: vLLM answered 503: simulated overload: try again"
    );
    assert_eq!(
        (
            client.stats().attempts,
            client.stats().retries,
            client.stats().failures
        ),
        (3, 2, 1)
    );
}

#[tokio::test]
async fn the_deadline_bounds_the_whole_call_retries_included() {
    let sim = simulator(|c| c.faults.error_503 = 1.0).await;
    let retry = RetryPolicy {
        max_attempts: 1000,
        base_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(100),
        deadline: Duration::from_millis(400),
    };
    let client = client(&[&sim], retry);
    let started = Instant::now();
    let error = client
        .generate(&[1, 2], &params())
        .await
        .expect_err("always 503");

    // Coarse bound: the call stops near its 400 ms deadline, far below 1000 attempts.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    // The deadline ends the call between attempts (the last 503 is the error) or during
    // one (a timeout that names the last 503), depending on where it falls.
    let text = error.to_string();
    assert!(
        error.status() == Some(503)
            || (error.is_timeout() && text.contains("last error") && text.contains("503")),
        "{text}"
    );
    assert!(client.stats().attempts > 1 && client.stats().attempts < 1000);
}

#[tokio::test]
async fn a_slow_server_past_the_deadline_is_a_timeout() {
    let sim = simulator(|c| c.latency = Duration::from_secs(30)).await;
    let retry = RetryPolicy {
        deadline: Duration::from_millis(200),
        ..fast_retry()
    };
    let error = client(&[&sim], retry)
        .generate(&[1, 2], &params())
        .await
        .expect_err("too slow");
    assert!(error.is_timeout());
    assert_eq!(
        error.to_string(),
        "POST /v1/completions: no usable answer within 200ms"
    );
}
