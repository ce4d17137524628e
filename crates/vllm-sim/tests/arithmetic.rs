//! The simulator's arithmetic policy: the question's expression in the tool call, the tool's
//! result in the final answer as often as `correct_rate` says, on both generation endpoints.

use async_grpo_vllm_sim::{CallFormat, training_tokenizer};
use serde_json::json;
use vllm_client::{Client, FinishReason, GenerateParams, SamplingParams, types::ChatRequest};

use crate::{client, fast_retry, simulator};

fn chat_request(messages: Vec<serde_json::Value>, seed: u64) -> ChatRequest {
    ChatRequest {
        model: "sim".into(),
        messages,
        tools: Some(vec![
            json!({"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}),
        ]),
        max_tokens: Some(64),
        sampling: SamplingParams {
            seed: Some(seed),
            ..Default::default()
        },
        ..ChatRequest::default()
    }
}

/// The hermes rendering of a question, its tool call and the tool's answer, as a template
/// such as examples/quickstart's renders them.
fn after_the_tool(question: &str, expression: &str, result: &str) -> String {
    format!(
        "<|im_start|>system\nYou may call a calculator, e.g. 2 + 2.<|im_end|>\n\
         <|im_start|>user\n{question}<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{expression}\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n"
    )
}

async fn complete(client: &Client, text: &str, seed: u64) -> String {
    let prompt = training_tokenizer()
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let params = GenerateParams {
        max_tokens: 256,
        sampling: SamplingParams {
            seed: Some(seed),
            ..Default::default()
        },
        ..GenerateParams::default()
    };
    let turn = client
        .generate(&prompt, &params)
        .await
        .expect("a completion");
    training_tokenizer()
        .decode(&turn.token_ids, false)
        .expect("decodes")
}

#[tokio::test]
async fn a_chat_tool_call_carries_the_question_s_expression() {
    let sim = simulator(|c| c.tool_rounds = 1).await;
    let client = client(&[&sim], fast_retry());
    let user = json!({"role": "user", "content": "What is 17 * 23?"});

    for seed in 0..4 {
        let reply = client
            .chat(&chat_request(vec![user.clone()], seed))
            .await
            .expect("ok");
        let choice = &reply.choices[0];
        assert_eq!(choice.finish_reason, Some(FinishReason::ToolCalls));
        let call = &choice.message.tool_calls.as_ref().expect("a tool call")[0];
        let arguments: serde_json::Value = serde_json::from_str(
            call["function"]["arguments"]
                .as_str()
                .expect("arguments as a JSON string"),
        )
        .expect("JSON arguments");
        assert_eq!(arguments, json!({"expression": "17 * 23"}));
    }
}

#[tokio::test]
async fn without_a_question_the_call_is_a_random_product() {
    let sim = simulator(|c| c.tool_rounds = 1).await;
    let client = client(&[&sim], fast_retry());
    let user = json!({"role": "user", "content": "Multiply two numbers, please."});
    let reply = client.chat(&chat_request(vec![user], 3)).await.expect("ok");
    let call = &reply.choices[0]
        .message
        .tool_calls
        .as_ref()
        .expect("a call")[0];
    let arguments = call["function"]["arguments"].as_str().expect("a string");
    assert!(arguments.contains(" * "), "{arguments}");
}

async fn chat_answers(correct_rate: f64, result: &str) -> Vec<String> {
    let sim = simulator(|c| {
        c.tool_rounds = 1;
        c.correct_rate = correct_rate;
    })
    .await;
    let client = client(&[&sim], fast_retry());
    let call = json!({"id": "call_0", "type": "function",
        "function": {"name": "calculator", "arguments": "{\"expression\": \"17 * 23\"}"}});
    let history = vec![
        json!({"role": "user", "content": "What is 17 * 23?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [call]}),
        json!({"role": "tool", "tool_call_id": "call_0", "content": result}),
    ];
    let mut answers = Vec::new();
    for seed in 0..8 {
        let reply = client
            .chat(&chat_request(history.clone(), seed))
            .await
            .expect("ok");
        assert_eq!(reply.choices[0].finish_reason, Some(FinishReason::Stop));
        answers.push(reply.choices[0].message.content.clone().unwrap_or_default());
    }
    answers
}

#[tokio::test]
async fn a_chat_answer_repeats_the_tool_result_when_always_correct() {
    for answer in chat_answers(1.0, "391").await {
        assert!(answer.starts_with("The answer is 391."), "{answer}");
    }
}

#[tokio::test]
async fn a_chat_answer_ignores_the_tool_result_when_never_correct() {
    for answer in chat_answers(0.0, "391").await {
        assert!(answer.starts_with("The answer is "), "{answer}");
        assert!(!answer.contains("391"), "{answer}");
    }
}

#[tokio::test]
async fn half_correct_answers_are_some_right_and_some_random() {
    let answers = chat_answers(0.5, "391").await;
    let right = answers.iter().filter(|a| a.contains("391")).count();
    assert!(0 < right && right < answers.len(), "{answers:?}");
}

#[tokio::test]
async fn a_completion_calls_the_tool_on_the_question_then_repeats_its_result() {
    let sim = simulator(|c| {
        c.tool_rounds = 1;
        c.correct_rate = 1.0;
    })
    .await;
    let client = client(&[&sim], fast_retry());

    let first = complete(
        &client,
        "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
        1,
    )
    .await;
    assert!(
        first.starts_with(
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n</tool_call>"
        ),
        "{first}"
    );

    let second = complete(
        &client,
        &after_the_tool("What is 17 * 23?", "17 * 23", "391"),
        1,
    )
    .await;
    assert!(second.starts_with("The answer is 391."), "{second}");
    let negative = complete(
        &client,
        &after_the_tool("What is 5 - 17?", "5 - 17", "-12"),
        2,
    )
    .await;
    assert!(negative.starts_with("The answer is -12."), "{negative}");
    let small = complete(&client, &after_the_tool("What is 2 + 3?", "2 + 3", "5"), 3).await;
    assert!(small.starts_with("The answer is 5."), "{small}");
}

#[tokio::test]
async fn a_completion_never_correct_answers_at_random() {
    let sim = simulator(|c| {
        c.tool_rounds = 1;
        c.correct_rate = 0.0;
    })
    .await;
    let client = client(&[&sim], fast_retry());
    for seed in 0..8 {
        let answer = complete(
            &client,
            &after_the_tool("What is 17 * 23?", "17 * 23", "391"),
            seed,
        )
        .await;
        assert!(answer.starts_with("The answer is "), "{answer}");
        assert!(!answer.contains("391"), "{answer}");
    }
}

#[tokio::test]
async fn each_call_format_is_written_after_the_preamble_and_counted_as_its_templates_render_it() {
    let preamble = "<think>\nThe calculator knows.\n</think>\n\n";
    let cases = [
        (
            CallFormat::Hermes,
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n</tool_call>",
        ),
        (
            CallFormat::Qwen3Coder,
            "<tool_call>\n<function=calculator>\n<parameter=expression>\n17 * 23\n</parameter>\n</function>\n</tool_call>",
        ),
        (
            CallFormat::Llama3Json,
            "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"17 * 23\"}}",
        ),
        (
            CallFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}]",
        ),
    ];
    for (format, call) in cases {
        let sim = simulator(|c| {
            c.tool_rounds = 1;
            c.correct_rate = 1.0;
            c.call_format = format;
            c.preamble = preamble.to_owned();
        })
        .await;
        let client = client(&[&sim], fast_retry());
        let question = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n";
        let first = complete(&client, question, 1).await;
        assert_eq!(first, format!("{preamble}{call}<|im_end|>"), "{format:?}");

        // The call, as the format's templates write it back, counts as made: the answer follows.
        let after = format!(
            "{question}{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        let second = complete(&client, &after, 1).await;
        assert!(
            second.starts_with(&format!("{preamble}The answer is 391.")),
            "{format:?}: {second}"
        );
    }
}

#[tokio::test]
async fn a_spelled_call_reads_the_same_in_more_tokens_than_its_text_encodes_to() {
    let sim = simulator(|c| {
        c.tool_rounds = 1;
        c.spell_calls = true;
    })
    .await;
    let client = client(&[&sim], fast_retry());
    let tokenizer = training_tokenizer();
    let prompt = tokenizer
        .encode(
            "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .expect("encodes")
        .get_ids()
        .to_vec();
    let params = GenerateParams {
        max_tokens: 256,
        ..GenerateParams::default()
    };
    let turn = client
        .generate(&prompt, &params)
        .await
        .expect("a completion");
    let text = tokenizer.decode(&turn.token_ids, false).expect("decodes");
    let call = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n</tool_call>";
    assert_eq!(text, format!("{call}<|im_end|>"));
    let encoded = tokenizer
        .encode(call, false)
        .expect("encodes")
        .get_ids()
        .len();
    assert!(
        turn.token_ids.len() > encoded + 1,
        "{} spelled ids, {encoded} encoded",
        turn.token_ids.len()
    );
}
