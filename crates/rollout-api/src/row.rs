//! The loop's input: one dataset row ([`DatasetRow`]), its prompt as messages and every
//! other column as given, parsed from the JSON object a row is in any format
//! (`{"prompt": "text" | [messages], ...other columns}`), and [`DatasetError`], why a
//! dataset could not be read, with where.
//!
//! A prompt message needs a known role (`system`, `user`, `assistant`, `tool`) and content
//! (an assistant message may carry `tool_calls` instead).

use std::{io, sync::Arc};

use serde_json::{Map, Value};

use rollout_core::{Message, parse::kind};

/// One dataset row.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetRow {
    /// The file (or stream) the row came from, as errors name it.
    pub source: Arc<str>,
    /// 1-based line number in the file.
    pub line: usize,
    /// The prompt as messages.
    pub prompt: Vec<Message>,
    /// Every other column, as given.
    pub columns: Map<String, Value>,
}

impl DatasetRow {
    /// The row as the JSON object it was read from: `prompt` (as messages) and every other
    /// column (what an environment's task or an agent's `{task_json}` is).
    pub fn to_json(&self) -> Map<String, Value> {
        let mut task = Map::new();
        let prompt = self
            .prompt
            .iter()
            .map(|m| Value::Object(m.as_map().clone()))
            .collect();
        task.insert("prompt".to_owned(), Value::Array(prompt));
        for (key, value) in &self.columns {
            task.insert(key.clone(), value.clone());
        }
        task
    }

    /// Parses one row from its JSON text (`{"prompt": ..., ...columns}`), as a line of a JSON
    /// Lines file is parsed: a row of another format (a Parquet file's, as JSON) reads the
    /// same way. `line` is where errors point (a line, or a row number).
    pub fn parse(source: Arc<str>, line: usize, text: &str) -> Result<DatasetRow, DatasetError> {
        match parse_row(text) {
            Ok((prompt, columns)) => Ok(DatasetRow {
                source,
                line,
                prompt,
                columns,
            }),
            Err(reason) => Err(DatasetError::Row {
                path: source.to_string(),
                line,
                reason,
            }),
        }
    }
}

/// Why a dataset could not be read, with where.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be opened.
    #[error("could not open dataset {path}: {source}")]
    Open {
        /// The file.
        path: String,
        /// Why.
        source: io::Error,
    },
    /// Reading failed part-way.
    #[error("{path}:{line}: could not read: {source}")]
    Read {
        /// The file.
        path: String,
        /// The line being read.
        line: usize,
        /// Why.
        source: io::Error,
    },
    /// A row is not of the expected shape.
    #[error("{path}:{line}: {reason}")]
    Row {
        /// The file.
        path: String,
        /// The row's line.
        line: usize,
        /// What is wrong and what was expected.
        reason: String,
    },
}

impl DatasetError {
    /// The line of the error (0 when the file could not be opened).
    pub fn line(&self) -> usize {
        match self {
            DatasetError::Open { .. } => 0,
            DatasetError::Read { line, .. } | DatasetError::Row { line, .. } => *line,
        }
    }
}

const SHAPE: &str = "a row is {\"prompt\": \"text\" or [messages], ...other columns}";

fn parse_row(text: &str) -> Result<(Vec<Message>, Map<String, Value>), String> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}; {SHAPE}"))?;
    let Value::Object(mut columns) = value else {
        return Err(format!(
            "a row must be a JSON object, got {}; {SHAPE}",
            kind(&value)
        ));
    };
    let prompt = match columns.remove("prompt") {
        None => return Err(format!("no \"prompt\" field; {SHAPE}")),
        Some(Value::String(text)) if text.trim().is_empty() => {
            return Err("\"prompt\" is an empty string".to_owned());
        }
        Some(Value::String(text)) => vec![Message::user(text)],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err("\"prompt\" is an empty list of messages".to_owned());
        }
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(index, item)| match item {
                Value::Object(map) => {
                    prompt_message(map).map_err(|reason| format!("prompt[{index}]: {reason}"))
                }
                other => Err(format!(
                    "prompt[{index}]: a message must be a JSON object, got {}",
                    kind(&other)
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(format!(
                "\"prompt\" must be a string or a list of messages, got {}",
                kind(&other)
            ));
        }
    };
    Ok((prompt, columns))
}

/// The roles a prompt may hold: what every chat template knows.
const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A prompt message: a known role, and content (text or a list of parts), or, for an
/// assistant, tool calls instead.
fn prompt_message(map: Map<String, Value>) -> Result<Message, String> {
    let message = Message::try_from(map)?;
    let role = message.role();
    if !ROLES.contains(&role) {
        return Err(format!(
            "unknown role \"{role}\"; expected one of {}",
            ROLES.join(", ")
        ));
    }
    let fields = message.as_map();
    let has_tool_calls =
        matches!(fields.get("tool_calls"), Some(Value::Array(calls)) if !calls.is_empty());
    match fields.get("content") {
        Some(Value::String(_) | Value::Array(_)) => Ok(message),
        None | Some(Value::Null) if role == "assistant" && has_tool_calls => Ok(message),
        None | Some(Value::Null) => Err(format!(
            "a \"{role}\" message needs \"content\" (text or a list of parts){}",
            if role == "assistant" {
                " or \"tool_calls\""
            } else {
                ""
            }
        )),
        Some(other) => Err(format!(
            "a message's \"content\" must be text or a list of parts, got {}",
            kind(other)
        )),
    }
}
