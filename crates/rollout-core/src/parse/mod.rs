//! Tool-call parsers: the model's raw text in, content and tool calls out.
//!
//! One trait, [`ToolCallParser`], one implementation per output format:
//!
//! | name | format | models |
//! |---|---|---|
//! | `hermes` | `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (a final call may be unclosed) | Qwen2.5, Qwen3, Hermes, SmolLM3 |
//! | `qwen3_coder` | `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>` | Qwen3-Coder |
//! | `llama3_json` | `{"name": .., "parameters": {..}}` (after `<|python_tag|>` or alone), `;`-separated | Llama 3.1 / 3.2 / 3.3 |
//! | `mistral` | `[TOOL_CALLS][{..}, ..]` or `[TOOL_CALLS]name[ARGS]{..}` | Mistral, Mixtral, Ministral |
//!
//! Text before the first call is content. A call that cannot be parsed stays in the content
//! as the model wrote it and is reported in [`ParsedOutput::failures`] with the reason: a
//! parser never fails and never panics (fuzzed). Arguments keep the model's JSON values;
//! calls get an id when the format carries none.

mod hermes;
mod llama3;
mod mistral;
mod qwen3_coder;

use std::{
    collections::hash_map::RandomState,
    hash::{BuildHasher, Hasher},
};

use serde::Serialize;
use serde_json::{Map, Value, json};

pub use self::{
    hermes::HermesParser, llama3::Llama3JsonParser, mistral::MistralParser,
    qwen3_coder::Qwen3CoderParser,
};

/// One tool call the model made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParsedCall {
    /// The call's id: the model's own when the format has one, generated otherwise.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as the model wrote them (usually an object).
    pub arguments: Value,
}

impl ParsedCall {
    /// The call in the shape chat templates and OpenAI clients read:
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "type": "function",
            "function": { "name": self.name, "arguments": self.arguments },
        })
    }
}

/// A call that could not be parsed; its text stayed in the content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParseFailure {
    /// The call's text as the model wrote it.
    pub raw: String,
    /// Why it was not a valid call.
    pub reason: String,
}

/// What a parser made of one model output.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ParsedOutput {
    /// The text that is not a tool call: what precedes the first call, the text of any
    /// malformed call, and any other non-blank text between or after calls.
    pub content: String,
    /// The calls, in the model's order.
    pub tool_calls: Vec<ParsedCall>,
    /// Calls that were left as content, with the reason.
    pub failures: Vec<ParseFailure>,
}

impl ParsedOutput {
    /// Plain content, no call.
    pub(crate) fn content_only(text: &str) -> Self {
        Self {
            content: text.to_owned(),
            ..Self::default()
        }
    }

    /// Appends text that is outside any call: kept only if it is not blank.
    pub(crate) fn push_between(&mut self, text: &str) {
        if !text.trim().is_empty() {
            self.content.push_str(text);
        }
    }

    /// Keeps a malformed call as content and records why.
    pub(crate) fn push_failure(&mut self, raw: &str, reason: impl Into<String>) {
        self.content.push_str(raw);
        self.failures.push(ParseFailure {
            raw: raw.to_owned(),
            reason: reason.into(),
        });
    }
}

/// Turns a model's raw output into content and tool calls.
pub trait ToolCallParser: Send + Sync + std::fmt::Debug {
    /// The parser's name (`hermes`, `qwen3_coder`, `llama3_json`, `mistral`).
    fn name(&self) -> &'static str;

    /// Parses one assistant output. Never fails: what is not a valid call is content.
    fn parse(&self, text: &str) -> ParsedOutput;
}

/// Splits a reasoning model's output at its first `</think>`: the reasoning (what precedes
/// it, a leading `<think>` and surrounding newlines removed) and the rest (leading newlines
/// removed), as vLLM's `deepseek_r1` and `qwen3` reasoning parsers and Qwen3's chat template
/// split it. Without `</think>` there is no reasoning and the text is returned whole.
///
/// ```
/// use async_grpo_rollout_core::parse::split_reasoning;
///
/// assert_eq!(
///     split_reasoning("<think>\nAdd them.\n</think>\n\n5"),
///     (Some("Add them."), "5")
/// );
/// assert_eq!(split_reasoning("Add them.\n</think>\n5"), (Some("Add them."), "5"));
/// assert_eq!(split_reasoning("5"), (None, "5"));
/// ```
pub fn split_reasoning(text: &str) -> (Option<&str>, &str) {
    const END: &str = "</think>";
    let Some(at) = text.find(END) else {
        return (None, text);
    };
    let reasoning = text[..at].trim_start_matches('\n');
    let reasoning = reasoning.strip_prefix("<think>").unwrap_or(reasoning);
    (
        Some(reasoning.trim_matches('\n')),
        text[at + END.len()..].trim_start_matches('\n'),
    )
}

/// Counts of parsed outputs, calls and failures, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ParseTally {
    /// Outputs parsed.
    pub outputs: u64,
    /// Valid calls found.
    pub calls: u64,
    /// Malformed calls left as content.
    pub failures: u64,
}

impl ParseTally {
    /// Adds one parsed output.
    pub fn record(&mut self, output: &ParsedOutput) {
        self.outputs += 1;
        self.calls += output.tool_calls.len() as u64;
        self.failures += output.failures.len() as u64;
    }
}

/// The parser names [`parser_by_name`] knows, with their aliases.
pub const PARSER_NAMES: &[(&str, &[&str])] = &[
    ("hermes", &["qwen", "qwen2.5", "qwen3"]),
    ("qwen3_coder", &["qwen3-coder", "qwen3_xml"]),
    ("llama3_json", &["llama3", "llama"]),
    ("mistral", &[]),
];

/// No parser has that name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no tool-call parser named {name:?}; known: hermes, qwen3_coder, llama3_json, mistral")]
pub struct UnknownParser {
    /// The name asked for.
    pub name: String,
}

/// The parser of that name (or alias).
pub fn parser_by_name(name: &str) -> Result<Box<dyn ToolCallParser>, UnknownParser> {
    let canonical = PARSER_NAMES
        .iter()
        .find(|(n, aliases)| *n == name || aliases.contains(&name))
        .map(|(n, _)| *n);
    match canonical {
        Some("hermes") => Ok(Box::new(HermesParser)),
        Some("qwen3_coder") => Ok(Box::new(Qwen3CoderParser::default())),
        Some("llama3_json") => Ok(Box::new(Llama3JsonParser)),
        Some("mistral") => Ok(Box::new(MistralParser)),
        _ => Err(UnknownParser {
            name: name.to_owned(),
        }),
    }
}

/// The parser matching how a chat template renders tool calls, if it renders any.
pub fn detect_parser(template: &str) -> Option<Box<dyn ToolCallParser>> {
    if template.contains("<function=") && template.contains("<parameter=") {
        Some(Box::new(Qwen3CoderParser::default()))
    } else if template.contains("<tool_call>") {
        Some(Box::new(HermesParser))
    } else if template.contains("[TOOL_CALLS]") {
        Some(Box::new(MistralParser))
    } else if template.contains("<|python_tag|>")
        || (template.contains("<|start_header_id|>") && template.contains("tool_call"))
    {
        Some(Box::new(Llama3JsonParser))
    } else {
        None
    }
}

/// A fresh random id: `call_` and 24 alphanumerics (the OpenAI shape).
pub(crate) fn generate_id(prefix: &str, len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = String::with_capacity(prefix.len() + len);
    id.push_str(prefix);
    let mut bits = 0u64;
    for i in 0..len {
        if i % 10 == 0 {
            // A new RandomState has fresh keys: 64 random bits without a dependency.
            let mut hasher = RandomState::new().build_hasher();
            hasher.write_usize(i);
            bits = hasher.finish();
        }
        id.push(char::from(ALPHABET[(bits % 62) as usize]));
        bits /= 62;
    }
    id
}

/// Reads `{"name": .., "arguments" | "parameters": ..}` into a call.
pub(crate) fn call_from_object(value: Value, id: Option<String>) -> Result<ParsedCall, String> {
    let Value::Object(mut object) = value else {
        return Err(format!(
            "expected a JSON object with \"name\" and \"arguments\", got {}",
            kind(&value)
        ));
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.is_empty() => name,
        Some(Value::String(_)) => return Err("the call's \"name\" is empty".into()),
        Some(other) => {
            return Err(format!(
                "the call's \"name\" is {}, not a string",
                kind(&other)
            ));
        }
        None => return Err("the call has no \"name\"".into()),
    };
    let arguments = object
        .remove("arguments")
        .or_else(|| object.remove("parameters"))
        .unwrap_or_else(|| Value::Object(Map::new()));
    let id = id
        .or_else(|| match object.remove("id") {
            Some(Value::String(id)) if !id.is_empty() => Some(id),
            _ => None,
        })
        .unwrap_or_else(|| generate_id("call_", 24));
    Ok(ParsedCall {
        id,
        name,
        arguments,
    })
}

/// A JSON value's kind with its article ("a string", "an object", "null"), for messages
/// about a value of the wrong kind.
pub fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses the first JSON value at the start of `text` (after whitespace); returns it and
/// the number of bytes consumed.
pub(crate) fn leading_json(text: &str) -> Result<(Value, usize), serde_json::Error> {
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match stream.next() {
        Some(Ok(value)) => Ok((value, stream.byte_offset())),
        Some(Err(error)) => Err(error),
        None => Err(serde::de::Error::custom("no JSON value")),
    }
}
