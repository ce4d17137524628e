//! Python's `json.dumps` and `repr` over template values, as transformers' templates see them.
//!
//! Chat templates run in Jinja2 under transformers, so what they print follows Python:
//! `tojson` is `json.dumps(x, ensure_ascii=False, indent=.., separators=.., sort_keys=..)`
//! (no HTML escaping, unlike minijinja's own), and `{{ value }}` prints `str(value)`
//! (`None`, `True`, `1.0`, `{'a': 1}`). Floats use Python's shortest repr (`1e-05`, `1.0`).

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};

/// How `json.dumps` lays out containers.
#[derive(Debug, Clone, Default)]
pub(crate) struct JsonStyle {
    pub(crate) ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: a newline and `s` per level.
    pub(crate) indent: Option<String>,
    pub(crate) separators: Option<(String, String)>,
    pub(crate) sort_keys: bool,
}

/// `json.dumps(value, ...)`; `Err` names what is not JSON-serializable.
pub(crate) fn dumps(value: &Value, style: &JsonStyle) -> Result<String, String> {
    let (item, key) = match &style.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if style.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    write_json(&mut out, value, style, item, key, 0)?;
    Ok(out)
}

fn newline(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    item: &str,
    key_sep: &str,
    level: usize,
) -> Result<(), String> {
    match value.kind() {
        ValueKind::Undefined => {
            return Err("Object of type Undefined is not JSON serializable".into());
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => {
            write_json_string(out, value.as_str().unwrap_or(""), style.ensure_ascii)
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            let mut names: Vec<(String, Value)> = Vec::with_capacity(keys.len());
            for key in keys.drain(..) {
                let name = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or("").to_owned(),
                    ValueKind::None => "null".to_owned(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
                    ValueKind::Number => {
                        let mut s = String::new();
                        write_number(&mut s, &key);
                        s
                    }
                    _ => {
                        return Err(format!(
                            "keys must be str, int, float, bool or None, not {}",
                            key.kind()
                        ));
                    }
                };
                names.push((name, key));
            }
            if style.sort_keys {
                names.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (index, (name, key)) in names.iter().enumerate() {
                if index > 0 {
                    out.push_str(item);
                }
                newline(out, style, level + 1);
                write_json_string(out, name, style.ensure_ascii);
                out.push_str(key_sep);
                let child = value.get_item(key).map_err(|e| e.to_string())?;
                write_json(out, &child, style, item, key_sep, level + 1)?;
            }
            newline(out, style, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (index, child) in items.iter().enumerate() {
                if index > 0 {
                    out.push_str(item);
                }
                newline(out, style, level + 1);
                write_json(out, child, style, item, key_sep, level + 1)?;
            }
            newline(out, style, level);
            out.push(']');
        }
        other => return Err(format!("Object of type {other} is not JSON serializable")),
    }
    Ok(())
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else if let Ok(float) = f64::try_from(value.clone()) {
        out.push_str(&float_repr(float));
    } else {
        let _ = write!(out, "{value}");
    }
}

/// A JSON string literal as Python writes it.
fn write_json_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
pub(crate) fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "1.2345e-5", "1e16".
    let sci = format!("{value:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if !(-4..16).contains(&exponent) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    } else if exponent < 0 {
        out.push_str("0.");
        for _ in 0..(-exponent - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let point = exponent as usize + 1;
        if digits.len() <= point {
            out.push_str(&digits);
            for _ in digits.len()..point {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    }
    out
}

/// Python's `str(value)` for printing: strings as they are, everything else as `repr`.
pub(crate) fn write_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or("")),
        _ => write_repr(out, value),
    }
}

/// Python's `repr(value)`.
fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else if let Ok(float) = f64::try_from(value.clone()) {
                let repr = float_repr(float);
                out.push_str(match repr.as_str() {
                    "NaN" => "nan",
                    "Infinity" => "inf",
                    "-Infinity" => "-inf",
                    other => other,
                });
            }
        }
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or("")),
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (index, key) in keys.enumerate() {
                    if index > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    if let Ok(child) = value.get_item(&key) {
                        write_repr(out, &child);
                    }
                }
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (index, child) in items.enumerate() {
                    if index > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &child);
                }
            }
            out.push(']');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

fn write_str_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        for (value, expected) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e20, "1.5e+20"),
            (9999999999999998.0, "9999999999999998.0"),
            (-2.5, "-2.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (100.0, "100.0"),
        ] {
            assert_eq!(float_repr(value), expected, "{value}");
        }
    }

    #[test]
    fn json_matches_python_dumps() {
        let value = crate::render::template::json_value(&serde_json::json!({
            "b": [1, 2.0, "x<y>&'\"é\n\u{1}"], "a": {}, "c": [], "d": null, "e": true
        }));
        let compact = dumps(&value, &JsonStyle::default()).expect("serializable");
        assert_eq!(
            compact,
            r#"{"b": [1, 2.0, "x<y>&'\"é\n\u0001"], "a": {}, "c": [], "d": null, "e": true}"#
        );
        let indented = dumps(
            &value,
            &JsonStyle {
                indent: Some("  ".into()),
                sort_keys: true,
                ensure_ascii: true,
                ..JsonStyle::default()
            },
        )
        .expect("serializable");
        assert_eq!(
            indented,
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.0,\n    \"x<y>&'\\\"\\u00e9\\n\\u0001\"\n  ],\n  \"c\": [],\n  \"d\": null,\n  \"e\": true\n}"
        );
    }

    #[test]
    fn printing_follows_python_str() {
        let value = crate::render::template::json_value(
            &serde_json::json!({"a": [null, true, 1.0, "it's"]}),
        );
        let mut out = String::new();
        write_str(&mut out, &value);
        assert_eq!(out, r#"{'a': [None, True, 1.0, "it's"]}"#);
    }
}
