//! examples/quickstart: the committed files are what the code that generates them produces
//! now, and the chat template renders a tool round trip as the simulator writes it.

use std::path::{Path, PathBuf};

use rollout_core::{ChatTokenizer, Message, RenderOptions};
use serde_json::{Value, json};

fn quickstart() -> PathBuf {
    crate::repository().join("examples/quickstart")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("the file is committed");
    serde_json::from_str(&text).expect("valid JSON")
}

#[test]
fn the_committed_tokenizer_is_the_one_the_simulator_trains() {
    let committed = read_json(&quickstart().join("tokenizer.json"));
    let trained: Value = serde_json::from_str(
        &vllm_sim::training_tokenizer()
            .to_string(false)
            .expect("serializes"),
    )
    .expect("valid JSON");
    // Everything that decides how text becomes ids; the file's format fields may change with
    // the tokenizers crate without changing a single id.
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
    ] {
        assert_eq!(
            committed[key], trained[key],
            "examples/quickstart/tokenizer.json: `{key}` differs from training_tokenizer(); \
             run `cargo xtask quickstart` and commit the result"
        );
    }
    for key in ["type", "vocab", "merges"] {
        assert_eq!(
            committed["model"][key], trained["model"][key],
            "examples/quickstart/tokenizer.json: `model.{key}` differs from training_tokenizer(); \
             run `cargo xtask quickstart` and commit the result"
        );
    }
    // 256 byte-level symbols, the 4 specials and 148 merges: the trainer asks for 600, but
    // its small corpus runs out of pairs to merge sooner.
    let vocab = committed["model"]["vocab"]
        .as_object()
        .map_or(0, |v| v.len());
    assert!(vocab > 260, "{vocab} tokens");
}

#[test]
fn every_quickstart_answer_is_what_the_calculator_says() {
    let text = std::fs::read_to_string(quickstart().join("arithmetic.jsonl")).expect("committed");
    let mut rows = 0;
    for (line, row) in text.lines().enumerate() {
        let row: Value = serde_json::from_str(row).expect("a JSON row");
        let prompt = row["prompt"].as_str().expect("a prompt");
        let expression = prompt
            .strip_prefix("What is ")
            .and_then(|p| p.strip_suffix('?'))
            .expect("a question");
        let value = tool_dispatch::builtin::evaluate(expression).expect("an expression");
        assert_eq!(
            row["answer"].as_str(),
            Some(format!("{value}").as_str()),
            "arithmetic.jsonl:{}",
            line + 1
        );
        rows += 1;
    }
    assert_eq!(rows, 64);
}

#[test]
fn the_quickstart_template_renders_a_tool_round_trip_as_the_simulator_writes_it() {
    let tokenizer = ChatTokenizer::from_dir(quickstart()).expect("the quickstart tokenizer loads");
    let calculator = tool_dispatch::builtin::ToolConfig {
        name: "calculator".into(),
        kind: tool_dispatch::builtin::ToolKind::Calculator(Default::default()),
        description: None,
        parameters: None,
        timeout: None,
    }
    .build()
    .expect("a calculator");
    let messages: Vec<Message> = serde_json::from_value(json!([
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "391"},
        {"role": "tool", "tool_call_id": "call_2", "content": "7"},
    ]))
    .expect("messages");
    let options = RenderOptions {
        add_generation_prompt: true,
        tools: Some(vec![calculator.spec().to_openai()]),
        ..RenderOptions::default()
    };
    let text = tokenizer.render(&messages, &options).expect("renders");

    let system = text
        .strip_prefix("<|im_start|>system\nAnswer with a number.\n\n# Tools\n")
        .expect("the system message merged with the tool list");
    assert!(
        system
            .contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calculator\""),
        "{text}"
    );
    // What the simulator answers to the question, EOS included, exactly as re-rendered.
    let rest = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n\
        <|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n\
        <|im_start|>assistant\n";
    assert!(text.ends_with(rest), "{text}");
    assert_eq!(
        tokenizer
            .special_tokens()
            .get("eos_token")
            .and_then(Value::as_str),
        Some("<|im_end|>")
    );
}
