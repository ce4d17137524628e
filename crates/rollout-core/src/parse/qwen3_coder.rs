//! Qwen3-Coder XML tool calls: `<function=NAME><parameter=P>value</parameter></function>`.

use serde_json::{Map, Value};

use super::{ParsedCall, ParsedOutput, ToolCallParser, generate_id};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Parses Qwen3-Coder's XML calls, wrapped in `<tool_call>` or bare.
///
/// Parameter values are text in this format. Given the tools' JSON schemas
/// ([`Qwen3CoderParser::with_tools`]), a value is converted to its declared type (integer,
/// number, boolean, object, array; `null` for "null"), as vLLM's parser does; otherwise,
/// or when the conversion fails, it stays a string.
#[derive(Debug, Clone, Default)]
pub struct Qwen3CoderParser {
    tools: Vec<Value>,
}

impl Qwen3CoderParser {
    /// A parser that types parameter values by the tools' schemas (OpenAI tool shape
    /// `{"type": "function", "function": {"name", "parameters"}}`, or the bare function).
    pub fn with_tools(tools: Vec<Value>) -> Self {
        Self { tools }
    }

    fn parameter_type(&self, function: &str, parameter: &str) -> Option<&str> {
        self.tools.iter().find_map(|tool| {
            let function_spec = tool.get("function").unwrap_or(tool);
            if function_spec.get("name")?.as_str()? != function {
                return None;
            }
            function_spec
                .get("parameters")?
                .get("properties")?
                .get(parameter)?
                .get("type")?
                .as_str()
        })
    }

    fn convert(&self, function: &str, parameter: &str, raw: &str) -> Value {
        let Some(kind) = self.parameter_type(function, parameter) else {
            return Value::from(raw);
        };
        if raw.eq_ignore_ascii_case("null") {
            return Value::Null;
        }
        let converted = match kind {
            "integer" => raw.trim().parse::<i64>().ok().map(Value::from),
            "number" => serde_json::from_str::<serde_json::Number>(raw.trim())
                .ok()
                .map(Value::Number),
            "boolean" => match raw.trim().to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "object" | "array" => serde_json::from_str::<Value>(raw).ok(),
            _ => None,
        };
        converted.unwrap_or_else(|| Value::from(raw))
    }

    /// Parses one `<function=...>...</function>` body; `Err` says why it is not a call.
    fn parse_function(&self, block: &str) -> Result<ParsedCall, String> {
        let start = block
            .find(FUNCTION)
            .ok_or_else(|| "no <function=NAME> inside <tool_call>".to_owned())?;
        let rest = &block[start + FUNCTION.len()..];
        let name_end = rest
            .find('>')
            .ok_or_else(|| "<function= is not closed with '>'".to_owned())?;
        let name = rest[..name_end].trim();
        if name.is_empty() {
            return Err("the function name is empty".into());
        }
        let mut body = &rest[name_end + 1..];
        if let Some(end) = body.find(FUNCTION_END) {
            body = &body[..end];
        }
        let mut arguments = Map::new();
        while let Some(p) = body.find(PARAMETER) {
            let after = &body[p + PARAMETER.len()..];
            let key_end = after
                .find('>')
                .ok_or_else(|| "<parameter= is not closed with '>'".to_owned())?;
            let key = after[..key_end].trim();
            let value_text = &after[key_end + 1..];
            // A value ends at </parameter>, or (unclosed) at the next parameter.
            let end = value_text
                .find(PARAMETER_END)
                .or_else(|| value_text.find(PARAMETER))
                .unwrap_or(value_text.len());
            let mut value = &value_text[..end];
            value = value.strip_prefix('\n').unwrap_or(value);
            value = value.strip_suffix('\n').unwrap_or(value);
            arguments.insert(key.to_owned(), self.convert(name, key, value));
            let consumed = if value_text[end..].starts_with(PARAMETER_END) {
                end + PARAMETER_END.len()
            } else {
                end
            };
            body = &value_text[consumed..];
        }
        Ok(ParsedCall {
            id: generate_id("call_", 24),
            name: name.to_owned(),
            arguments: Value::Object(arguments),
        })
    }
}

impl ToolCallParser for Qwen3CoderParser {
    fn name(&self) -> &'static str {
        "qwen3_coder"
    }

    fn parse(&self, text: &str) -> ParsedOutput {
        let call_start = |from: usize| -> Option<usize> {
            let rest = &text[from..];
            match (rest.find(OPEN), rest.find(FUNCTION)) {
                (Some(a), Some(b)) => Some(from + a.min(b)),
                (a, b) => a.or(b).map(|o| from + o),
            }
        };
        let Some(first) = call_start(0) else {
            return ParsedOutput::content_only(text);
        };
        let mut output = ParsedOutput::content_only(&text[..first]);
        let mut at = first;
        while let Some(start) = call_start(at) {
            output.push_between(&text[at..start]);
            let wrapped = text[start..].starts_with(OPEN);
            let (end, marker) = if wrapped {
                (CLOSE, OPEN.len())
            } else {
                (FUNCTION_END, FUNCTION.len())
            };
            // The call ends at its closing tag, else at the next call, else at the end.
            let search_from = start + marker;
            let close = text[search_from..]
                .find(end)
                .map(|o| search_from + o + end.len());
            let next = if wrapped {
                text[search_from..].find(OPEN).map(|o| search_from + o)
            } else {
                call_start(search_from)
            };
            let stop = match (close, next) {
                (Some(c), Some(n)) if n < c - end.len() => n,
                (Some(c), _) => c,
                (None, Some(n)) => n,
                (None, None) => text.len(),
            };
            let raw = &text[start..stop];
            match self.parse_function(raw) {
                Ok(call) => output.tool_calls.push(call),
                Err(reason) => output.push_failure(raw, reason),
            }
            at = stop;
        }
        output.push_between(&text[at..]);
        output
    }
}
