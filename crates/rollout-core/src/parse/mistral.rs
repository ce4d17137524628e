//! Mistral tool calls: `[TOOL_CALLS][{..}, ..]` (v3) or `[TOOL_CALLS]name[ARGS]{..}` (v11+).

use serde_json::Value;

use super::{ParsedOutput, ToolCallParser, call_from_object, generate_id, kind, leading_json};

const TOOL_CALLS: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";

/// Parses Mistral's `[TOOL_CALLS]` marker followed by a JSON array of calls (older
/// tokenizers), or by `name[ARGS]{json}` per call (tokenizer v11 and later, with an optional
/// `[CALL_ID]id`). Ids are the model's when present, else 9 alphanumerics as Mistral uses.
#[derive(Debug, Clone, Copy, Default)]
pub struct MistralParser;

impl ToolCallParser for MistralParser {
    fn name(&self) -> &'static str {
        "mistral"
    }

    fn parse(&self, text: &str) -> ParsedOutput {
        let Some(first) = text.find(TOOL_CALLS) else {
            return ParsedOutput::content_only(text);
        };
        let mut output = ParsedOutput::content_only(&text[..first]);
        let mut at = first;
        while let Some(offset) = text[at..].find(TOOL_CALLS) {
            let start = at + offset;
            output.push_between(&text[at..start]);
            let body_start = start + TOOL_CALLS.len();
            let segment_end = text[body_start..]
                .find(TOOL_CALLS)
                .map_or(text.len(), |o| body_start + o);
            let segment = &text[body_start..segment_end];
            let trimmed = segment.trim_start();
            let parsed = if trimmed.starts_with('[') || trimmed.starts_with('{') {
                parse_json_calls(trimmed, &mut output)
            } else {
                parse_named_call(trimmed, &mut output)
            };
            match parsed {
                Ok(used) => {
                    output.push_between(&trimmed[used..]);
                }
                Err(reason) => output.push_failure(&text[start..segment_end], reason),
            }
            at = segment_end;
        }
        output
    }
}

fn mistral_id(call: &mut super::ParsedCall, had_id: bool) {
    if !had_id {
        call.id = generate_id("", 9);
    }
}

/// `[{"name", "arguments", "id"?}, ..]` or a single object; returns the bytes used.
fn parse_json_calls(text: &str, output: &mut ParsedOutput) -> Result<usize, String> {
    let (value, used) =
        leading_json(text).map_err(|error| format!("invalid JSON after [TOOL_CALLS]: {error}"))?;
    let items = match value {
        Value::Array(items) => items,
        object @ Value::Object(_) => vec![object],
        other => {
            return Err(format!(
                "expected a JSON array of calls after [TOOL_CALLS], got {}",
                kind(&other)
            ));
        }
    };
    let mut calls = Vec::with_capacity(items.len());
    for item in items {
        let had_id = item
            .get("id")
            .and_then(Value::as_str)
            .is_some_and(|id| !id.is_empty());
        let mut call = call_from_object(item, None)?;
        mistral_id(&mut call, had_id);
        calls.push(call);
    }
    output.tool_calls.extend(calls);
    Ok(used)
}

/// `name[ARGS]{..}` or `name[CALL_ID]id[ARGS]{..}`; returns the bytes used.
fn parse_named_call(text: &str, output: &mut ParsedOutput) -> Result<usize, String> {
    let args = text
        .find(ARGS)
        .ok_or_else(|| "expected a JSON array or name[ARGS]{..} after [TOOL_CALLS]".to_owned())?;
    let head = &text[..args];
    let (name, id) = match head.find(CALL_ID) {
        Some(c) => (
            &head[..c],
            Some(head[c + CALL_ID.len()..].trim().to_owned()),
        ),
        None => (head, None),
    };
    let name = name.trim();
    if name.is_empty() {
        return Err("the call has no name before [ARGS]".into());
    }
    let arguments_text = &text[args + ARGS.len()..];
    let (arguments, used) = leading_json(arguments_text)
        .map_err(|error| format!("invalid JSON arguments after [ARGS]: {error}"))?;
    output.tool_calls.push(super::ParsedCall {
        id: id
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| generate_id("", 9)),
        name: name.to_owned(),
        arguments,
    });
    Ok(args + ARGS.len() + used)
}
