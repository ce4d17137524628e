//! Chat completions: tool calls for K rounds, then a final answer; ids and logprobs.

use serde_json::json;
use vllm_client::{FinishReason, SamplingParams, types::ChatRequest};

use crate::{client, fast_retry, simulator};

fn request(messages: Vec<serde_json::Value>) -> ChatRequest {
    ChatRequest {
        model: "sim".into(),
        messages,
        tools: Some(vec![
            json!({"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}),
        ]),
        max_tokens: Some(64),
        sampling: SamplingParams {
            seed: Some(5),
            ..Default::default()
        },
        logprobs: Some(true),
        return_token_ids: Some(true),
        return_tokens_as_token_ids: Some(true),
        ..ChatRequest::default()
    }
}

#[tokio::test]
async fn the_simulator_calls_a_tool_then_answers() {
    let sim = simulator(|c| c.tool_rounds = 1).await;
    let client = client(&[&sim], fast_retry());
    let user = json!({"role": "user", "content": "What is 17 * 23?"});

    let first = client.chat(&request(vec![user.clone()])).await.expect("ok");
    let choice = &first.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::ToolCalls));
    let call = &choice.message.tool_calls.as_ref().expect("a tool call")[0];
    assert_eq!(call["function"]["name"], "calculator");
    let ids = choice.token_ids.as_ref().expect("token ids");
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
    assert!(first.prompt_token_ids.is_some());

    let history = vec![
        user,
        json!({"role": "assistant", "content": null, "tool_calls": [call]}),
        json!({"role": "tool", "tool_call_id": call["id"], "content": "391"}),
    ];
    let second = client.chat(&request(history)).await.expect("ok");
    assert_eq!(second.choices[0].finish_reason, Some(FinishReason::Stop));
    assert!(
        second.choices[0]
            .message
            .content
            .as_deref()
            .is_some_and(|c| c.starts_with("The answer is"))
    );
}
