//! Several servers: sticky keys, least-busy choice, ejection of a failing server.

use std::time::{Duration, Instant};

use async_grpo_vllm_sim::{SimConfig, Simulator, training_tokenizer};
use vllm_client::{ClientConfig, GenerateParams};

use crate::{eventually, fast_retry, simulator};

fn keyed(key: &str) -> GenerateParams {
    GenerateParams {
        max_tokens: 4,
        sticky_key: Some(key.into()),
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn a_sticky_key_keeps_a_rollout_on_one_server() {
    let (a, b) = (simulator(|_| {}).await, simulator(|_| {}).await);
    let client = crate::client(&[&a, &b], fast_retry());
    for _ in 0..10 {
        client
            .generate(&[1], &keyed("rollout-1"))
            .await
            .expect("ok");
    }
    let counts = (a.counters().completions, b.counters().completions);
    assert!(counts == (10, 0) || counts == (0, 10), "{counts:?}");
}

#[tokio::test]
async fn without_a_key_concurrent_requests_go_to_the_least_busy_server() {
    let slow = |c: &mut async_grpo_vllm_sim::SimConfig| c.latency = Duration::from_millis(300);
    let (a, b) = (simulator(slow).await, simulator(slow).await);
    let client = crate::client(&[&a, &b], fast_retry());
    let turns: Vec<_> = (0..8)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .generate(
                        &[1],
                        &GenerateParams {
                            max_tokens: 4,
                            ..Default::default()
                        },
                    )
                    .await
            })
        })
        .collect();
    assert!(eventually(|| client.in_flight().iter().sum::<usize>() == 8).await);
    assert_eq!(client.in_flight(), [4, 4]);
    for turn in turns {
        turn.await.expect("no panic").expect("ok");
    }
}

#[tokio::test]
async fn a_failing_server_is_ejected_and_its_requests_go_elsewhere_until_it_is_tried_again() {
    let eject_for = Duration::from_millis(300);
    let broken = simulator(|c| c.faults.error_503 = 1.0).await;
    let healthy = simulator(|_| {}).await;
    let config = ClientConfig::with_servers([broken.url(), healthy.url()])
        .model("sim")
        .retry(fast_retry())
        .eject_for(eject_for);
    let client = vllm_client::Client::new(config).expect("client");

    // A request every 10 ms until the broken server has failed twice. Its first failure
    // ejects it for `eject_for` from a moment after the request that met it was sent, so the
    // request that meets it again must end at least `eject_for` after that one was sent,
    // whatever the machine's speed.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut first_failure_sent = None;
    let mut sent = 0;
    let tried_again_done = loop {
        assert!(
            Instant::now() < deadline,
            "the broken server was not tried again within ten seconds (ejected for {eject_for:?})"
        );
        let at = Instant::now();
        client
            .generate(&[1], &keyed(&format!("r{sent}")))
            .await
            .expect("the healthy server answers");
        sent += 1;
        match broken.counters().completions {
            0 => {}
            1 => {
                first_failure_sent.get_or_insert(at);
            }
            2 if first_failure_sent.is_some() => break Instant::now(),
            n => panic!("the broken server got {n} requests by request {sent}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let since = tried_again_done.duration_since(first_failure_sent.expect("a first failure"));
    assert!(
        since >= eject_for,
        "tried again within {since:?} of its first failure, inside its ejection of {eject_for:?}"
    );
    assert_eq!(
        healthy.counters().completions,
        sent,
        "every request answered there"
    );
    assert_eq!(client.stats().ejections, 2, "ejected again");
}

#[tokio::test]
async fn a_dead_server_is_ejected_and_the_rollout_moves_on() {
    let dead = simulator(|_| {}).await;
    let dead_url = dead.url();
    dead.stop().await;
    let alive = simulator(|_| {}).await;
    let client = vllm_client::Client::new(
        ClientConfig::with_servers([dead_url, alive.url()])
            .model("sim")
            .retry(fast_retry()),
    )
    .expect("client");
    for i in 0..5 {
        client
            .generate(&[1], &keyed(&format!("k{i}")))
            .await
            .expect("ok");
    }
    assert_eq!(alive.counters().completions, 5);
    assert!(client.stats().ejections >= 1);
}

#[tokio::test]
async fn an_unreachable_server_that_answers_health_again_is_taken_back_before_its_ejection_ends() {
    // `gone` is down when the rollouts start, then comes back on the same port: the prober
    // takes it back long before its 60 s ejection would end.
    let gone = simulator(|_| {}).await;
    let addr = gone.addr();
    gone.stop().await;
    let healthy = simulator(|_| {}).await;
    let config = ClientConfig::with_servers([format!("http://{addr}"), healthy.url()])
        .model("sim")
        .retry(fast_retry())
        .eject_for(Duration::from_secs(60));
    let client = vllm_client::Client::new(config).expect("client");
    let prober = client.spawn_health_checks(Duration::from_millis(20));
    for i in 0..2 {
        client
            .generate(&[1], &keyed(&format!("a{i}")))
            .await
            .expect("the healthy server answers");
    }
    assert_eq!(client.stats().ejections, 1);

    let mut config = SimConfig::new(training_tokenizer());
    config.model = "sim".into();
    let back = Simulator::start(config, addr)
        .await
        .expect("the port is free again");
    let mut taken_back = false;
    for i in 0..300 {
        client
            .generate(&[1], &keyed(&format!("b{i}")))
            .await
            .expect("ok");
        if back.counters().completions > 0 {
            taken_back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    prober.abort();
    assert!(
        taken_back,
        "the server that came back received requests within 3 s, not 60 s"
    );
}

#[tokio::test]
async fn a_server_ejected_for_5xx_waits_out_its_ejection_even_if_health_answers() {
    let flaky = simulator(|c| c.faults.error_503 = 1.0).await;
    let healthy = simulator(|_| {}).await;
    let config = ClientConfig::with_servers([flaky.url(), healthy.url()])
        .model("sim")
        .retry(fast_retry())
        .eject_for(Duration::from_secs(60));
    let client = vllm_client::Client::new(config).expect("client");
    let prober = client.spawn_health_checks(Duration::from_millis(20));
    for i in 0..20 {
        client
            .generate(&[1], &keyed(&format!("k{i}")))
            .await
            .expect("ok");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    prober.abort();
    assert_eq!(
        flaky.counters().completions,
        1,
        "tried once, then left out although /health answers"
    );
    assert_eq!(client.stats().ejections, 1);
}

#[tokio::test]
async fn a_control_call_reaches_every_replica_and_names_the_one_that_failed() {
    let (a, b) = (simulator(|_| {}).await, simulator(|_| {}).await);
    let down = simulator(|_| {}).await;
    let down_url = down.url();
    down.stop().await;
    let client = vllm_client::Client::new(
        ClientConfig::with_servers([a.url(), down_url.clone(), b.url()])
            .model("sim")
            .retry(fast_retry()),
    )
    .expect("client");

    let error = client
        .pause(vllm_client::PauseMode::Keep)
        .await
        .expect_err("one replica is down");
    let message = error.to_string();
    assert!(
        message.starts_with(&format!(
            "POST /pause: failed on 1 of 3 servers: {down_url}: "
        )),
        "{message}"
    );
    // The replicas that answered are paused all the same.
    for sim in [&a, &b] {
        let single = crate::client(&[sim], fast_retry());
        assert!(single.is_paused().await.expect("answers"));
    }
}
