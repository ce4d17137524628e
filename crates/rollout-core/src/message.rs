//! Chat messages, kept exactly as given (key order, `null` versus absent) for the template.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// One chat message: a JSON object with at least a string `role`.
///
/// Templates see the object exactly as given, as Python's `apply_chat_template` sees the
/// dict: key order, `null` values and extra keys (`reasoning_content`, `tool_calls`,
/// `tool_call_id`, `name`, content parts) are preserved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Map<String, Value>", into = "Map<String, Value>")]
pub struct Message(Map<String, Value>);

impl Message {
    /// A message with a role and string content.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        let mut map = Map::new();
        map.insert("role".into(), Value::from(role));
        map.insert("content".into(), Value::from(content.into()));
        Self(map)
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// A `tool` message answering the call `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        let mut message = Self::new("tool", content);
        message.set("tool_call_id", Value::from(tool_call_id.into()));
        message
    }

    /// A `tool` message naming its tool: `{"role": "tool", "name", "content",
    /// "tool_call_id"}`, the id when the call had one.
    pub fn tool_result(
        name: impl Into<String>,
        content: impl Into<String>,
        tool_call_id: Option<String>,
    ) -> Self {
        let mut map = Map::new();
        map.insert("role".into(), Value::from("tool"));
        map.insert("name".into(), Value::from(name.into()));
        map.insert("content".into(), Value::from(content.into()));
        if let Some(id) = tool_call_id {
            map.insert("tool_call_id".into(), Value::from(id));
        }
        Self(map)
    }

    /// Sets a field (`reasoning_content`, `name`, ...), keeping the position of an
    /// existing key.
    #[must_use]
    pub fn with(mut self, key: &str, value: Value) -> Self {
        self.set(key, value);
        self
    }

    /// Attaches tool calls in the OpenAI / transformers shape
    /// (`{"id", "type": "function", "function": {"name", "arguments"}}`).
    #[must_use]
    pub fn with_tool_calls(self, calls: &[crate::ParsedCall]) -> Self {
        self.with(
            "tool_calls",
            Value::Array(calls.iter().map(crate::ParsedCall::to_json).collect()),
        )
    }

    /// Sets a field.
    pub fn set(&mut self, key: &str, value: Value) {
        self.0.insert(key.to_owned(), value);
    }

    /// A mutable reference to a field.
    pub(crate) fn get_mut(&mut self, key: &str) -> Option<&mut Value> {
        self.0.get_mut(key)
    }

    /// The role.
    pub fn role(&self) -> &str {
        self.0.get("role").and_then(Value::as_str).unwrap_or("")
    }

    /// The content when it is a string.
    pub fn content(&self) -> Option<&str> {
        self.0.get("content").and_then(Value::as_str)
    }

    /// The message as a JSON object.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.0
    }

    /// Bytes of the message's text: its content, a string or the `text` of each part. A
    /// chat template renders at least this much of it.
    pub fn text_len(&self) -> usize {
        match self.0.get("content") {
            Some(Value::String(text)) => text.len(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .map(str::len)
                .sum(),
            _ => 0,
        }
    }
}

impl TryFrom<Map<String, Value>> for Message {
    type Error = String;

    fn try_from(map: Map<String, Value>) -> Result<Self, Self::Error> {
        match map.get("role") {
            Some(Value::String(_)) => Ok(Self(map)),
            Some(other) => Err(format!(
                "a message's \"role\" must be a string, not {other}"
            )),
            None => Err(format!(
                "a message needs a \"role\"; got {}",
                json!(map).to_string().chars().take(80).collect::<String>()
            )),
        }
    }
}

impl From<Message> for Map<String, Value> {
    fn from(message: Message) -> Self {
        message.0
    }
}

/// `message["content"]`: the value of a key, `null` when the message has none (as
/// `serde_json::Value` indexes).
impl std::ops::Index<&str> for Message {
    type Output = Value;

    fn index(&self, key: &str) -> &Value {
        static NULL: Value = Value::Null;
        self.0.get(key).unwrap_or(&NULL)
    }
}

/// The message as compact JSON.
impl std::fmt::Display for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = serde_json::to_string(&self.0).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}
