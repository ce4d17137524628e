//! `Client::generate`: token ids in, ids and logprobs out, validated.

use std::time::Duration;

use async_grpo_vllm_sim::training_tokenizer;
use vllm_client::{
    ClientConfig, FinishReason, GenerateParams, SamplingParams,
    types::{DetokenizeRequest, TokenizeRequest},
};

use crate::{client, eventually, fast_retry, simulator};

fn params(max_tokens: u32) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn a_turn_returns_every_sampled_id_with_its_logprob_and_ends_with_eos() {
    let sim = simulator(|c| c.answer_tokens = 12).await;
    let client = client(&[&sim], fast_retry());
    let prompt: Vec<u32> = training_tokenizer()
        .encode("user\nWhat is 2 + 3?", false)
        .expect("encodes")
        .get_ids()
        .to_vec();

    let turn = client
        .generate(&prompt, &params(64))
        .await
        .expect("a completion");

    assert_eq!(turn.token_ids.len(), 13, "12 answer tokens and EOS");
    assert_eq!(turn.logprobs.len(), turn.token_ids.len());
    assert!(turn.logprobs.iter().all(|lp| *lp < 0.0));
    let eos = training_tokenizer().token_to_id("<|im_end|>");
    assert_eq!(turn.token_ids.last().copied(), eos);
    assert_eq!(turn.finish_reason, FinishReason::Stop);
    assert_eq!(turn.prompt_token_ids.as_deref(), Some(prompt.as_slice()));
}

#[tokio::test]
async fn requests_get_unique_seeds_and_a_given_seed_repeats_the_turn() {
    let sim = simulator(|_| {}).await;
    let client = client(&[&sim], fast_retry());
    let a = client.generate(&[1, 2, 3], &params(40)).await.expect("ok");
    let b = client.generate(&[1, 2, 3], &params(40)).await.expect("ok");
    assert_ne!(a.seed, b.seed);

    let fixed = GenerateParams {
        sampling: SamplingParams {
            seed: Some(7),
            ..Default::default()
        },
        ..params(40)
    };
    let c = client.generate(&[1, 2, 3], &fixed).await.expect("ok");
    let d = client.generate(&[1, 2, 3], &fixed).await.expect("ok");
    assert_eq!(
        (c.seed, &c.token_ids, &c.logprobs),
        (7, &d.token_ids, &d.logprobs)
    );
}

#[tokio::test]
async fn max_tokens_cuts_the_turn_with_finish_reason_length() {
    let sim = simulator(|c| c.answer_tokens = 30).await;
    let turn = client(&[&sim], fast_retry())
        .generate(&[5, 6], &params(8))
        .await
        .expect("ok");
    assert_eq!(
        (turn.token_ids.len(), turn.finish_reason),
        (8, FinishReason::Length)
    );
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_a_4xx_with_vllms_message_and_no_retry() {
    let sim = simulator(|c| c.max_model_len = 64).await;
    let client = client(&[&sim], fast_retry());
    let error = client
        .generate(&[1; 100], &params(8))
        .await
        .expect_err("too long");

    assert_eq!(error.status(), Some(400));
    assert!(!error.is_retryable());
    assert!(error.is_prompt_too_long());
    assert_eq!(
        error.server_error().and_then(|e| e.param.as_deref()),
        Some("input_tokens")
    );
    let message = error.to_string();
    assert!(message.starts_with("POST /v1/completions: vLLM answered 400: This model's maximum context length is 64 tokens. However, your prompt contains at least 100 input tokens"), "{message}");
    assert_eq!((client.stats().attempts, client.stats().retries), (1, 0));

    let full = client
        .generate(&[1; 64], &params(8))
        .await
        .expect_err("no room");
    assert!(
        full.to_string()
            .contains("max_tokens must be at least 1, got 0"),
        "{full}"
    );
    // A prompt plus max_tokens that overflows is clipped, not refused.
    let clipped = client
        .generate(&[1; 60], &params(100))
        .await
        .expect("clipped");
    assert_eq!(
        (clipped.token_ids.len(), clipped.finish_reason),
        (4, FinishReason::Length)
    );
}

#[tokio::test]
async fn a_malformed_body_is_a_decode_error_naming_the_field() {
    let sim = simulator(|c| c.faults.malformed = 1.0).await;
    let client = client(&[&sim], fast_retry());
    let error = client
        .generate(&[1, 2], &params(8))
        .await
        .expect_err("malformed");

    assert!(error.is_decode() && !error.is_retryable());
    let message = error.to_string();
    assert!(message.starts_with("POST /v1/completions: unexpected response body at `choices[0].token_ids`: invalid type: string \"not a list\""), "{message}");
    assert_eq!(client.stats().attempts, 1);
}

#[tokio::test]
async fn dropping_the_future_closes_the_connection_and_the_server_sees_the_abort() {
    let sim = simulator(|c| c.latency = Duration::from_secs(30)).await;
    let client = client(&[&sim], fast_retry());
    let turn = {
        let client = client.clone();
        tokio::spawn(async move { client.generate(&[1, 2, 3], &params(8)).await })
    };
    assert!(
        eventually(|| sim.counters().requests == 1).await,
        "the request reached the server"
    );
    turn.abort();

    assert!(
        eventually(|| sim.counters().aborted_by_disconnect == 1).await,
        "{:?}",
        sim.counters()
    );
    assert_eq!(client.in_flight(), [0]);
}

#[tokio::test]
async fn the_model_and_context_length_come_from_the_server_when_not_configured() {
    let sim = simulator(|c| c.max_model_len = 1234).await;
    let client = vllm_client::Client::new(ClientConfig::new(sim.url())).expect("client");
    assert!(
        client
            .generate(&[1], &params(4))
            .await
            .is_err_and(|e| e.to_string().contains("no model name"))
    );

    let card = client
        .wait_until_ready(Duration::from_secs(5))
        .await
        .expect("ready");
    assert_eq!(
        (card.id.as_str(), client.max_model_len()),
        ("sim", Some(1234))
    );
    assert!(client.generate(&[1], &params(4)).await.is_ok());
}

#[tokio::test]
async fn waiting_for_a_server_that_never_comes_fails_with_the_last_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let client = vllm_client::Client::new(ClientConfig::new(format!("http://127.0.0.1:{port}")))
        .expect("client");
    let error = client
        .wait_until_ready(Duration::from_millis(600))
        .await
        .expect_err("nobody listens");
    assert!(error.is_timeout());
    let message = error.to_string();
    let expected = format!(
        "GET http://127.0.0.1:{port}/health: no usable answer within 600ms; last error: GET /health: connection failed"
    );
    assert!(message.starts_with(&expected), "{message}");
}

#[tokio::test]
async fn a_server_url_without_a_scheme_is_refused_up_front() {
    let error = vllm_client::Client::new(ClientConfig::new("localhost:8000"))
        .expect_err("not a URL to call");
    assert!(!error.is_retryable());
    assert_eq!(
        error.to_string(),
        "client: server URL 'localhost:8000' must be http://HOST:PORT or https://HOST:PORT"
    );
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_with_the_tokenizers_crate() {
    let sim = simulator(|_| {}).await;
    let client = client(&[&sim], fast_retry());
    let text = "The answer is 5 because we check the sum";
    let expected = training_tokenizer()
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec();

    let ids = client
        .tokenize(&TokenizeRequest {
            model: Some("sim".into()),
            prompt: text.into(),
            add_special_tokens: Some(false),
        })
        .await
        .expect("tokenized");
    assert_eq!(ids.tokens, expected);
    let back = client
        .detokenize(&DetokenizeRequest {
            model: Some("sim".into()),
            tokens: ids.tokens,
        })
        .await
        .expect("ok");
    assert_eq!(back.prompt, text);
}
