//! `/pause` and `/resume`: held requests complete after resume; aborted ones come back
//! partial with `finish_reason: "abort"`.

use std::time::Duration;

use vllm_client::{FinishReason, GenerateParams, PauseMode};

use crate::{client, eventually, fast_retry, simulator};

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: 64,
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn keep_freezes_requests_until_resume() {
    let sim = simulator(|c| c.answer_tokens = 10).await;
    let client = client(&[&sim], fast_retry());
    client.pause(PauseMode::Keep).await.expect("paused");
    assert!(client.is_paused().await.expect("answers"));

    let turn = {
        let client = client.clone();
        tokio::spawn(async move { client.generate(&[1, 2], &params()).await })
    };
    // Held: the simulator counts it while it waits for the resume, and cannot answer it
    // meanwhile. Answered instead: the turn ends without ever being counted.
    assert!(
        eventually(|| sim.counters().held_by_pause == 1 || turn.is_finished()).await,
        "the request was neither held nor answered within ten seconds"
    );
    assert!(!turn.is_finished(), "answered while paused: not held");

    client.resume().await.expect("resumed");
    let turn = tokio::time::timeout(Duration::from_secs(10), turn)
        .await
        .expect("answered within ten seconds of the resume")
        .expect("no panic")
        .expect("completes normally");
    assert_eq!(sim.counters().held_by_pause, 0, "released by the resume");
    assert_eq!(
        (turn.token_ids.len(), turn.finish_reason),
        (11, FinishReason::Stop)
    );
}

#[tokio::test]
async fn abort_ends_requests_in_flight_with_their_partial_ids() {
    let sim = simulator(|c| {
        c.answer_tokens = 200;
        c.per_token = Duration::from_millis(5);
    })
    .await;
    let client = client(&[&sim], fast_retry());
    let turn = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .generate(
                    &[1, 2],
                    &GenerateParams {
                        max_tokens: 300,
                        ..params()
                    },
                )
                .await
        })
    };
    assert!(eventually(|| sim.counters().requests >= 1).await);
    tokio::time::sleep(Duration::from_millis(150)).await;
    client.pause(PauseMode::Abort).await.expect("paused");

    let turn = turn
        .await
        .expect("no panic")
        .expect("an aborted turn is an answer, not an error");
    assert_eq!(turn.finish_reason, FinishReason::Abort);
    assert!(
        !turn.token_ids.is_empty() && turn.token_ids.len() < 201,
        "partial: {}",
        turn.token_ids.len()
    );
    assert_eq!(turn.logprobs.len(), turn.token_ids.len());
    assert_eq!(sim.counters().aborted_by_pause, 1);
    client.resume().await.expect("resumed");
    assert!(!client.is_paused().await.expect("answers"));
}
