//! Wire shapes: every response recorded from a real vLLM 0.32 server (`tests/fixtures/`,
//! see its README) decodes into the client's types, with the fields RL reads where they are.

use async_grpo_vllm_client::{
    FinishReason,
    types::{
        ChatResponse, CompletionRequest, CompletionResponse, DetokenizeResponse, ModelList,
        ServerError, TokenizeResponse,
    },
};
use serde::de::DeserializeOwned;

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

fn decode<T: DeserializeOwned>(name: &str) -> T {
    let text = fixture(name);
    let mut deserializer = serde_json::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(&mut deserializer)
        .unwrap_or_else(|e| panic!("{name} does not decode at `{}`: {}", e.path(), e.inner()))
}

#[test]
fn a_token_id_completion_carries_ids_and_a_logprob_per_id_inside_the_choice() {
    let response: CompletionResponse = decode("completion_token_ids.response.json");
    let choice = &response.choices[0];
    let ids = choice.token_ids.as_ref().expect("token_ids in the choice");
    let logprobs = &choice.logprobs.as_ref().expect("logprobs").token_logprobs;
    assert_eq!(ids.len(), 8);
    assert_eq!(logprobs.len(), ids.len());
    assert!(logprobs.iter().all(|lp| lp.is_some_and(|v| v < 0.0)));
    assert_eq!(choice.prompt_token_ids.as_ref().map(Vec::len), Some(5));
    assert_eq!(choice.finish_reason, Some(FinishReason::Length));
}

#[test]
fn the_recorded_request_round_trips_through_the_typed_request() {
    // The recorded request decodes into the typed request and re-encodes to the same JSON (that
    // `generate` builds exactly this body is a unit test next to it, in src/client.rs).
    let recorded: serde_json::Value =
        serde_json::from_str(&fixture("completion_token_ids.request.json")).expect("json");
    let typed: CompletionRequest = serde_json::from_value(recorded.clone()).expect("typed");
    assert_eq!(serde_json::to_value(&typed).expect("serializes"), recorded);
}

#[test]
fn a_finished_choice_ends_with_the_eos_id() {
    let response: CompletionResponse = decode("completion_stop.response.json");
    let choice = &response.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        choice.token_ids.as_ref().and_then(|ids| ids.last()),
        Some(&2),
        "SmolLM2's <|im_end|>"
    );
}

#[test]
fn token_id_strings_and_structured_outputs_decode() {
    let as_ids: CompletionResponse = decode("completion_tokens_as_token_ids.response.json");
    let choice = &as_ids.choices[0];
    let tokens = &choice.logprobs.as_ref().expect("logprobs").tokens;
    let ids = choice.token_ids.as_ref().expect("ids");
    assert!(
        tokens
            .iter()
            .zip(ids)
            .all(|(t, id)| *t == format!("token_id:{id}"))
    );

    let structured: CompletionResponse = decode("completion_structured_tool_call.response.json");
    assert!(
        structured.choices[0].text.starts_with("<tool_call>"),
        "{}",
        structured.choices[0].text
    );
}

#[test]
fn an_aborted_completion_is_a_partial_answer() {
    let response: CompletionResponse = decode("completion_aborted_by_pause.response.json");
    let choice = &response.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::Abort));
    let ids = choice.token_ids.as_ref().expect("partial ids");
    assert!(!ids.is_empty() && ids.len() < 400);
    assert_eq!(
        choice.logprobs.as_ref().map(|l| l.token_logprobs.len()),
        Some(ids.len())
    );
}

#[test]
fn chat_ids_are_in_the_choice_and_the_prompt_ids_at_the_top() {
    let response: ChatResponse = decode("chat_completion.response.json");
    let choice = &response.choices[0];
    let ids = choice.token_ids.as_ref().expect("choices[0].token_ids");
    let logprobs = choice
        .logprobs
        .as_ref()
        .and_then(|l| l.content.as_ref())
        .expect("logprobs.content");
    assert_eq!(logprobs.len(), ids.len());
    assert!(
        response
            .prompt_token_ids
            .as_ref()
            .is_some_and(|p| !p.is_empty())
    );

    let as_ids: ChatResponse = decode("chat_completion_tokens_as_token_ids.response.json");
    let choice = &as_ids.choices[0];
    let content = choice
        .logprobs
        .as_ref()
        .and_then(|l| l.content.as_ref())
        .expect("content");
    let ids = choice.token_ids.as_ref().expect("ids");
    assert!(
        content
            .iter()
            .zip(ids)
            .all(|(t, id)| t.token == format!("token_id:{id}"))
    );
}

#[test]
fn errors_are_nested_and_carry_the_parameter() {
    for (name, status_param) in [
        ("completion_prompt_too_long.response.json", "input_tokens"),
        (
            "completion_prompt_fills_context.response.json",
            "max_tokens",
        ),
        ("completion_unknown_model.response.json", "model"),
    ] {
        #[derive(serde::Deserialize)]
        struct Body {
            error: ServerError,
        }
        let body: Body = decode(name);
        assert_eq!(body.error.param.as_deref(), Some(status_param), "{name}");
        assert!(!body.error.message.is_empty());
    }
}

#[test]
fn the_small_endpoints_decode() {
    let models: ModelList = decode("models.response.json");
    assert_eq!(
        (models.data[0].id.as_str(), models.data[0].max_model_len),
        ("SmolLM2-135M-Instruct", Some(2048))
    );
    let tokens: TokenizeResponse = decode("tokenize.response.json");
    assert_eq!(tokens.count as usize, tokens.tokens.len());
    let text: DetokenizeResponse = decode("detokenize.response.json");
    assert!(!text.prompt.is_empty());
}
