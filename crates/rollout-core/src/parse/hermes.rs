//! Hermes / Qwen tool calls: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`.

use super::{ParsedOutput, ToolCallParser, call_from_object};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Parses `<tool_call>` blocks holding one JSON object each (Qwen2.5, Qwen3, Hermes 2/3).
/// A final call whose closing tag is missing (generation stopped on it) is still a call.
#[derive(Debug, Clone, Copy, Default)]
pub struct HermesParser;

impl ToolCallParser for HermesParser {
    fn name(&self) -> &'static str {
        "hermes"
    }

    fn parse(&self, text: &str) -> ParsedOutput {
        let Some(first) = text.find(OPEN) else {
            return ParsedOutput::content_only(text);
        };
        let mut output = ParsedOutput::content_only(&text[..first]);
        let mut at = first;
        while at < text.len() {
            let Some(offset) = text[at..].find(OPEN) else {
                output.push_between(&text[at..]);
                break;
            };
            let start = at + offset;
            output.push_between(&text[at..start]);
            let body_start = start + OPEN.len();
            let next_open = text[body_start..].find(OPEN).map(|o| body_start + o);
            let close = text[body_start..].find(CLOSE).map(|o| body_start + o);
            let (body_end, end, closed) = match (close, next_open) {
                (Some(close), Some(open)) if open < close => (open, open, false),
                (Some(close), _) => (close, close + CLOSE.len(), true),
                (None, Some(open)) => (open, open, false),
                (None, None) => (text.len(), text.len(), false),
            };
            let raw = &text[start..end];
            let body = text[body_start..body_end].trim();
            match serde_json::from_str(body) {
                Ok(value) => match call_from_object(value, None) {
                    Ok(call) => output.tool_calls.push(call),
                    Err(reason) => output.push_failure(raw, reason),
                },
                Err(error) => {
                    let unclosed = if closed {
                        ""
                    } else {
                        " (and the call is not closed with </tool_call>)"
                    };
                    output.push_failure(
                        raw,
                        format!("invalid JSON in <tool_call>: {error}{unclosed}"),
                    );
                }
            }
            at = end;
        }
        output
    }
}
