//! Llama-3 JSON tool calls: `{"name": .., "parameters": {..}}`, alone or after `<|python_tag|>`.

use super::{ParsedOutput, ToolCallParser, call_from_object, leading_json};

const PYTHON_TAG: &str = "<|python_tag|>";

/// Parses Llama 3.1 / 3.2 / 3.3 JSON calls: the output is one or more JSON objects
/// (separated by `;`), either from its start or after `<|python_tag|>`; text before the
/// tag is content. An output that starts with neither is plain content.
#[derive(Debug, Clone, Copy, Default)]
pub struct Llama3JsonParser;

impl ToolCallParser for Llama3JsonParser {
    fn name(&self) -> &'static str {
        "llama3_json"
    }

    fn parse(&self, text: &str) -> ParsedOutput {
        let (mut output, mut at) = match text.find(PYTHON_TAG) {
            Some(tag) => (
                ParsedOutput::content_only(&text[..tag]),
                tag + PYTHON_TAG.len(),
            ),
            None if text.trim_start().starts_with('{') => (ParsedOutput::default(), 0),
            None => return ParsedOutput::content_only(text),
        };
        loop {
            let rest = &text[at..];
            let skipped = rest.len()
                - rest
                    .trim_start_matches(|c: char| c.is_whitespace() || c == ';')
                    .len();
            at += skipped;
            if at >= text.len() {
                break;
            }
            let rest = &text[at..];
            if !rest.starts_with('{') {
                output.push_between(rest);
                break;
            }
            match leading_json(rest) {
                Ok((value, used)) => {
                    match call_from_object(value, None) {
                        Ok(call) => output.tool_calls.push(call),
                        Err(reason) => output.push_failure(&rest[..used], reason),
                    }
                    at += used;
                }
                Err(error) => {
                    output.push_failure(rest, format!("invalid JSON tool call: {error}"));
                    break;
                }
            }
        }
        output
    }
}
