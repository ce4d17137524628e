//! The client against a real vLLM server: run by `cargo xtask e2e`, which starts vLLM on CPU
//! with SmolLM2-135M-Instruct and passes `VLLM_URL`, `VLLM_MAX_MODEL_LEN` and
//! `VLLM_TOKENIZER`. Without them every test fails, saying so: this suite never skips.

use std::time::{Duration, Instant};

use async_grpo_vllm_client::{
    Client, ClientConfig, FinishReason, GenerateParams, PauseMode, SamplingParams,
    StructuredOutputs,
    types::{ChatRequest, DetokenizeRequest, TokenizeRequest},
};

fn env(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set: run this suite with `cargo xtask e2e`"))
}

async fn client() -> Client {
    let client = Client::new(ClientConfig::new(env("VLLM_URL"))).expect("a client");
    client
        .wait_until_ready(Duration::from_secs(120))
        .await
        .expect("the server is ready");
    client
}

async fn ids_of(client: &Client, text: &str) -> Vec<u32> {
    let request = TokenizeRequest {
        model: client.model(),
        prompt: text.into(),
        add_special_tokens: Some(false),
    };
    client.tokenize(&request).await.expect("tokenized").tokens
}

fn greedy(max_tokens: u32) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        },
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn a_token_id_prompt_gives_ids_and_one_logprob_per_id() {
    let client = client().await;
    let prompt = ids_of(
        &client,
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    )
    .await;
    let turn = client
        .generate(&prompt, &greedy(24))
        .await
        .expect("a completion");

    assert!(!turn.token_ids.is_empty());
    assert_eq!(turn.logprobs.len(), turn.token_ids.len());
    assert!(turn.logprobs.iter().all(|lp| *lp <= 0.0));
    assert_eq!(
        turn.prompt_token_ids.as_deref(),
        Some(prompt.as_slice()),
        "the server saw exactly our ids"
    );
    assert!(turn.text.contains("Paris"), "{}", turn.text);
    if turn.finish_reason == FinishReason::Stop {
        assert_eq!(
            turn.token_ids.last(),
            Some(&2),
            "a finished turn ends with <|im_end|>"
        );
    }
}

#[tokio::test]
async fn tokenize_and_detokenize_agree_with_the_tokenizers_crate() {
    let client = client().await;
    let text = "Reinforcement learning from 42 rollouts, token by token.";
    let tokenizer = tokenizers::Tokenizer::from_file(env("VLLM_TOKENIZER"))
        .expect("the model's tokenizer.json");
    let expected = tokenizer
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec();

    let ids = ids_of(&client, text).await;
    assert_eq!(ids, expected);
    let back = client
        .detokenize(&DetokenizeRequest {
            model: client.model(),
            tokens: ids,
        })
        .await
        .expect("ok");
    assert_eq!(back.prompt, text);
}

#[tokio::test]
async fn chat_completions_return_ids_and_logprobs() {
    let client = client().await;
    let request = ChatRequest {
        model: client.model().expect("known"),
        messages: vec![serde_json::json!({"role": "user", "content": "Say hello."})],
        max_tokens: Some(16),
        sampling: SamplingParams {
            temperature: Some(0.0),
            seed: Some(1),
            ..Default::default()
        },
        logprobs: Some(true),
        return_token_ids: Some(true),
        return_tokens_as_token_ids: Some(true),
        ..ChatRequest::default()
    };
    let response = client.chat(&request).await.expect("a chat completion");
    let choice = &response.choices[0];
    let ids = choice.token_ids.as_ref().expect("choices[0].token_ids");
    let logprobs = choice
        .logprobs
        .as_ref()
        .and_then(|l| l.content.as_ref())
        .expect("logprobs");
    assert_eq!(logprobs.len(), ids.len());
    assert!(
        logprobs
            .iter()
            .zip(ids)
            .all(|(lp, id)| lp.token == format!("token_id:{id}"))
    );
    assert!(
        response
            .prompt_token_ids
            .as_ref()
            .is_some_and(|p| !p.is_empty())
    );
}

#[tokio::test]
async fn structured_output_forces_a_tool_call() {
    let client = client().await;
    let prompt = ids_of(
        &client,
        "<|im_start|>user\nAdd 3 and 4 with the add tool.<|im_end|>\n<|im_start|>assistant\n",
    )
    .await;
    let regex =
        r#"<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>"#;
    let params = GenerateParams {
        structured_outputs: Some(StructuredOutputs::Regex(regex.into())),
        ..greedy(64)
    };
    let turn = client
        .generate(&prompt, &params)
        .await
        .expect("a completion");

    let inner = turn
        .text
        .strip_prefix("<tool_call>")
        .and_then(|t| t.strip_suffix("</tool_call>"))
        .expect("a tool call");
    let call: serde_json::Value = serde_json::from_str(inner).expect("JSON inside");
    assert_eq!(call["name"], "add");
    assert_eq!(turn.logprobs.len(), turn.token_ids.len());
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_refused_with_vllms_message() {
    let client = client().await;
    let limit: usize = env("VLLM_MAX_MODEL_LEN").parse().expect("a number");
    let error = client
        .generate(&vec![504; limit + 1], &greedy(4))
        .await
        .expect_err("too long");

    assert_eq!(error.status(), Some(400));
    assert!(!error.is_retryable());
    assert!(error.is_prompt_too_long(), "{error}");
    assert!(
        error
            .to_string()
            .contains(&format!("maximum context length is {limit} tokens")),
        "{error}"
    );
    assert_eq!(client.stats().retries, 0);
}

#[tokio::test]
async fn pause_keep_holds_requests_until_resume() {
    let client = client().await;
    let prompt = [504, 3575, 282, 4649, 314];
    // vLLM shows nothing that proves a request is held rather than slow (its own test of
    // keep mode measures a gap in token times), so the hold is judged against this server's
    // speed now: the same request unpaused, then paused for ten times as long (a second at
    // least). A server merely slow is slow in both.
    let started = Instant::now();
    client
        .generate(&prompt, &greedy(4))
        .await
        .expect("a completion before the pause");
    let unpaused = started.elapsed();
    let hold = (unpaused * 10).clamp(Duration::from_secs(1), Duration::from_secs(60));

    client.pause(PauseMode::Keep).await.expect("paused");
    assert!(client.is_paused().await.expect("answers"));
    let mut turn = {
        let client = client.clone();
        tokio::spawn(async move { client.generate(&prompt, &greedy(4)).await })
    };
    let answered_while_paused = tokio::time::timeout(hold, &mut turn).await.is_ok();
    // Resumed before any assertion: the server is shared by the whole suite.
    client.resume().await.expect("resumed");
    assert!(
        !answered_while_paused,
        "answered within {hold:?} while the server was paused (unpaused it took {unpaused:?})"
    );
    let turn = tokio::time::timeout(Duration::from_secs(120), turn)
        .await
        .expect("answered within two minutes of the resume")
        .expect("no panic")
        .expect("completes after resume");

    assert_eq!(turn.token_ids.len(), turn.logprobs.len());
    assert!(!client.is_paused().await.expect("answers"));
}
