//! A chat template compiled with minijinja and configured like transformers' Jinja2 sandbox.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{
    AutoEscape, Environment, Error, ErrorKind,
    value::{Kwargs, Value, ValueKind},
};
use serde_json::Map;

use super::{
    Raised, RenderError, RenderOptions,
    pyjson::{self, JsonStyle},
};
use crate::Message;

/// The reasoning field names transformers aliases onto each other (`_REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// What transformers appends to the final message to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// One Jinja chat template, ready to render conversations exactly as transformers'
/// `apply_chat_template` does (5.x): `trim_blocks` and `lstrip_blocks`, loop controls,
/// Python string and dict methods, `tojson` as `json.dumps`, `raise_exception`,
/// `strftime_now`, `{% generation %}` blocks, and Python's way of printing values.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    name: String,
    source: String,
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; `name` appears in every error (a file name or a template name).
    pub fn new(name: impl Into<String>, source: impl Into<String>) -> Result<Self, RenderError> {
        let name = name.into();
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .map_err(|error| RenderError::from_minijinja(&name, &error))?,
        );
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            if let Some(text) = value.as_str() {
                return out.write_str(text).map_err(Error::from);
            }
            let mut text = String::new();
            pyjson::write_str(&mut text, value);
            out.write_str(&text).map_err(Error::from)
        });
        env.add_filter("tojson", tojson);
        // Jinja2's tests ask Python: None is neither iterable nor a sequence (minijinja
        // iterates None as empty), strings and dicts are both, Undefined is both.
        env.add_test("iterable", |value: Value| python_iterable(&value));
        env.add_test("sequence", |value: Value| python_iterable(&value));
        env.add_filter("string", |value: Value| {
            let mut text = String::new();
            pyjson::write_str(&mut text, &value);
            text
        });
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned(name.clone(), without_generation_tags(&source))
            .map_err(|error| RenderError::from_minijinja(&name, &error))?;
        Ok(Self { name, source, env })
    }

    /// Makes `strftime_now` read a fixed time (seconds since the Unix epoch, UTC) instead
    /// of the clock: reproducible renders for tests and golden files.
    pub fn freeze_clock(&mut self, unix_seconds: i64) {
        self.env
            .add_function("strftime_now", move |format: String| {
                strftime(&format, unix_seconds)
            });
    }

    /// The name given at construction.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` with the template's variables: `messages`, `tools`, `documents`,
    /// `add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
    /// and `options.kwargs` (which override special tokens, as in transformers).
    pub fn render(
        &self,
        messages: &[Message],
        options: &RenderOptions,
        special_tokens: &Map<String, serde_json::Value>,
    ) -> Result<String, RenderError> {
        if options.continue_final_message {
            if options.add_generation_prompt {
                return Err(RenderError::ContinueFinalMessage {
                    template: self.name.clone(),
                    reason: "continue_final_message and add_generation_prompt are not compatible"
                        .into(),
                });
            }
            return self.render_continued(messages, options, special_tokens);
        }
        let values: Vec<Value> = messages.iter().map(message_value).collect();
        self.render_raw(values, options, special_tokens)
    }

    /// Renders messages already converted with [`message_value`] (no `continue_final_message`).
    pub(crate) fn render_values(
        &self,
        messages: &[Value],
        options: &RenderOptions,
        special_tokens: &Map<String, serde_json::Value>,
    ) -> Result<String, RenderError> {
        self.render_raw(messages.to_vec(), options, special_tokens)
    }

    /// Renders messages already converted with [`message_value`], taking them.
    pub(crate) fn render_owned(
        &self,
        messages: Vec<Value>,
        options: &RenderOptions,
        special_tokens: &Map<String, serde_json::Value>,
    ) -> Result<String, RenderError> {
        self.render_raw(messages, options, special_tokens)
    }

    fn render_raw(
        &self,
        messages: Vec<Value>,
        options: &RenderOptions,
        special_tokens: &Map<String, serde_json::Value>,
    ) -> Result<String, RenderError> {
        let mut context: Vec<(String, Value)> = Vec::with_capacity(8 + options.kwargs.len());
        for (key, value) in special_tokens {
            context.push((key.clone(), json_value(value)));
        }
        for (key, value) in &options.kwargs {
            context.retain(|(k, _)| k != key);
            context.push((key.clone(), json_value(value)));
        }
        context.push(("messages".into(), Value::from(messages)));
        context.push((
            "tools".into(),
            options.tools.as_ref().map_or(Value::from(()), |items| {
                Value::from(items.iter().map(json_value).collect::<Vec<_>>())
            }),
        ));
        context.push((
            "documents".into(),
            options.documents.as_ref().map_or(Value::from(()), |items| {
                Value::from(items.iter().map(json_value).collect::<Vec<_>>())
            }),
        ));
        context.push((
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        ));
        let context = Value::from_pairs(context);
        let template = self
            .env
            .get_template(&self.name)
            .map_err(|error| RenderError::from_minijinja(&self.name, &error))?;
        template
            .render(context)
            .map_err(|error| RenderError::from_minijinja(&self.name, &error))
    }

    /// transformers' `continue_final_message`: tag the final message, render, cut at the tag.
    fn render_continued(
        &self,
        messages: &[Message],
        options: &RenderOptions,
        special_tokens: &Map<String, serde_json::Value>,
    ) -> Result<String, RenderError> {
        let fail = |reason: String| RenderError::ContinueFinalMessage {
            template: self.name.clone(),
            reason,
        };
        let Some((last, history)) = messages.split_last() else {
            return Err(fail("the conversation is empty".into()));
        };
        let field = "content";
        let mut message = last.clone();
        let final_text = match message.get_mut(field) {
            None | Some(serde_json::Value::Null) => {
                return Err(fail(format!(
                    "the final message has no \"{field}\" to continue"
                )));
            }
            Some(_) if !self.source.contains(field) => {
                return Err(fail(format!(
                    "\"{field}\" is not an accepted field in the chat template"
                )));
            }
            Some(serde_json::Value::String(text)) => {
                let original = text.clone();
                text.push_str(CONTINUE_TAG);
                original
            }
            Some(serde_json::Value::Array(blocks)) => {
                let block = blocks
                    .iter_mut()
                    .rev()
                    .find_map(|b| b.get_mut("text"))
                    .ok_or_else(|| {
                        fail("could not find any text to continue in the final message".into())
                    })?;
                let original = block.as_str().unwrap_or_default().to_owned();
                *block = serde_json::Value::from(format!("{original}{CONTINUE_TAG}"));
                original
            }
            Some(_) => {
                return Err(fail(
                    "the final message's content is neither text nor a list of blocks".into(),
                ));
            }
        };
        let mut tagged: Vec<Value> = history.iter().map(message_value).collect();
        tagged.push(message_value(&message));
        let rendered = self.render_raw(tagged, options, special_tokens)?;
        let tag = CONTINUE_TAG.trim();
        if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
            return Err(fail(
                "the final message does not appear in the chat after applying the chat template"
                    .into(),
            ));
        }
        let at = rendered.rfind(tag).unwrap_or(rendered.len());
        if rendered[at..].starts_with(CONTINUE_TAG) {
            Ok(rendered[..at].to_owned())
        } else {
            Ok(rendered[..at].trim_end().to_owned())
        }
    }
}

/// Whether Python's `iter()` (and `len()` with indexing) accepts the value.
fn python_iterable(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
    )
}

/// A message as transformers hands it to the template: keys whose value is `null` dropped,
/// and the reasoning fields aliased (`thinking` first, `reasoning_content` set).
pub(crate) fn message_value(message: &Message) -> Value {
    let map = message.as_map();
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|key| map.get(*key).filter(|v| !v.is_null()));
    let mut entries: Vec<(&str, &serde_json::Value)> = Vec::with_capacity(map.len() + 2);
    if let Some(reasoning) = reasoning {
        entries.push((
            "thinking",
            map.get("thinking")
                .filter(|v| !v.is_null())
                .unwrap_or(reasoning),
        ));
    }
    for (key, value) in map {
        if value.is_null() || (reasoning.is_some() && key == "thinking") {
            continue;
        }
        if key == "reasoning_content"
            && let Some(reasoning) = reasoning
        {
            entries.push(("reasoning_content", reasoning));
            continue;
        }
        entries.push((key, value));
    }
    if let Some(reasoning) = reasoning
        && !map.contains_key("reasoning_content")
    {
        entries.push(("reasoning_content", reasoning));
    }
    Value::from_pairs(
        entries
            .into_iter()
            .map(|(key, value)| (key, json_value(value))),
    )
}

/// A JSON value as a template value (integers stay integers, maps keep their order).
pub(crate) fn json_value(value: &serde_json::Value) -> Value {
    match value {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => {
            Value::from(items.iter().map(json_value).collect::<Vec<_>>())
        }
        serde_json::Value::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(indent) => Some(indent),
        None => indent,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let item = v.get_item_by_index(0)?;
            let key = v.get_item_by_index(1)?;
            Some((
                item.as_str().unwrap_or(", ").to_owned(),
                key.as_str().unwrap_or(": ").to_owned(),
            ))
        }
        _ => None,
    };
    let style = JsonStyle {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    pyjson::dumps(value, &style).map_err(|message| Error::new(ErrorKind::InvalidOperation, message))
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask
/// extension, which only marks spans) into blocks that render their body unchanged.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let Some(len) = rest[start..].find("%}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let tag = &rest[start..start + len + 2];
        let inner =
            tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match inner {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => out.push_str(&tag.replacen(inner, word, 1)),
            None => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// `datetime.now().strftime(format)` in UTC, for the common directives.
fn strftime_now(format: &str) -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    strftime(format, seconds)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

pub(crate) fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let (pad, spec) = match chars.next() {
            Some('-') => (false, chars.next()),
            other => (true, other),
        };
        let num = |n: i64, width: usize| {
            if pad {
                format!("{n:0width$}")
            } else {
                n.to_string()
            }
        };
        match spec {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year % 100, 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(if hour % 12 == 0 { 12 } else { hour % 12 }, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('b' | 'h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_like_python() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_722_000_309;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %A %a %B %j %-d %p %I %%", t),
            "2024-07-26 13:25:09 Friday Fri July 208 26 PM 01 %"
        );
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            without_generation_tags(
                "a{%- generation %}b{% endgeneration -%}c{% if x %}{% endif %}"
            ),
            "a{%- if true %}b{% endif -%}c{% if x %}{% endif %}"
        );
    }
}
