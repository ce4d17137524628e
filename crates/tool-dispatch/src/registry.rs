//! The tool registry: tools by name, in registration order, and argument validation.

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::{
    error::RegistryError,
    tool::{Arguments, Tool, ToolSpec},
};

/// The tools a dispatcher can run, in registration order (the order the chat template lists
/// them in).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    tools: Vec<Tool>,
    by_name: HashMap<String, usize>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Adds a tool. Fails on an empty or duplicate name and on a parameters schema that is not
    /// an object schema.
    pub fn add(&mut self, tool: Tool) -> Result<&mut Registry, RegistryError> {
        let name = tool.spec.name.clone();
        if name.trim().is_empty() {
            return Err(RegistryError::EmptyName);
        }
        if self.by_name.contains_key(&name) {
            return Err(RegistryError::Duplicate { name });
        }
        check_schema(&tool.spec)?;
        self.by_name.insert(name, self.tools.len());
        self.tools.push(tool);
        Ok(self)
    }

    /// Adds a tool, builder style.
    pub fn with(mut self, tool: Tool) -> Result<Registry, RegistryError> {
        self.add(tool)?;
        Ok(self)
    }

    /// The specs of every tool, in registration order.
    pub fn specs(&self) -> impl ExactSizeIterator<Item = &ToolSpec> {
        self.tools.iter().map(|tool| &tool.spec)
    }

    /// The specs in the shape chat templates take as `tools`.
    pub fn to_openai(&self) -> Vec<Value> {
        self.specs().map(ToolSpec::to_openai).collect()
    }

    /// The names of every tool, in registration order.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> {
        self.tools.iter().map(|tool| tool.spec.name.as_str())
    }

    /// How many tools there are.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether there are no tools.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The registry one rollout runs, each per-rollout tool an instance of its own; `None`
    /// when no tool is per rollout.
    pub(crate) fn for_rollout(&self) -> Option<Registry> {
        self.tools
            .iter()
            .any(Tool::is_per_rollout)
            .then(|| Registry {
                tools: self.tools.iter().map(Tool::for_rollout).collect(),
                by_name: self.by_name.clone(),
            })
    }

    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub(crate) fn tools(&self) -> &[Tool] {
        &self.tools
    }
}

fn check_schema(spec: &ToolSpec) -> Result<(), RegistryError> {
    let invalid = |reason: &str| RegistryError::InvalidSchema {
        name: spec.name.clone(),
        reason: reason.to_owned(),
    };
    let Value::Object(schema) = &spec.parameters else {
        return Err(invalid("parameters must be a JSON object schema"));
    };
    match schema.get("type") {
        None => {}
        Some(Value::String(kind)) if kind == "object" => {}
        Some(other) => {
            return Err(invalid(&format!(
                "parameters must have type \"object\", not {other}"
            )));
        }
    }
    if let Some(properties) = schema.get("properties")
        && !properties.is_object()
    {
        return Err(invalid("\"properties\" must be an object"));
    }
    if let Some(required) = schema.get("required") {
        let all_strings = required
            .as_array()
            .is_some_and(|names| names.iter().all(Value::is_string));
        if !all_strings {
            return Err(invalid("\"required\" must be an array of property names"));
        }
    }
    Ok(())
}

/// Checks a call's arguments against the tool's schema: a JSON object (or a string holding
/// one; `null` counts as `{}`), with every `required` property, each declared property of the
/// declared JSON type, and no undeclared property when `additionalProperties` is `false`.
/// The error says which field and what was expected.
pub(crate) fn validate_arguments(spec: &ToolSpec, arguments: &Value) -> Result<Arguments, String> {
    let map = match arguments {
        Value::Object(map) => map.clone(),
        Value::Null => Map::new(),
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            Ok(other) => {
                return Err(format!(
                    "arguments must be a JSON object, got {} in a string",
                    type_name(&other)
                ));
            }
            Err(error) => return Err(format!("arguments are not valid JSON: {error}")),
        },
        other => {
            return Err(format!(
                "arguments must be a JSON object, got {}",
                type_name(other)
            ));
        }
    };

    let schema = &spec.parameters;
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        let missing: Vec<&str> = required
            .iter()
            .filter_map(Value::as_str)
            .filter(|name| !map.contains_key(*name))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "missing required argument(s): {}",
                missing.join(", ")
            ));
        }
    }

    let properties = schema.get("properties").and_then(Value::as_object);
    for (name, value) in &map {
        match properties.and_then(|properties| properties.get(name)) {
            Some(property) => {
                if let Some(expected) = property.get("type")
                    && !matches_type(expected, value)
                {
                    return Err(format!(
                        "argument '{name}' must be {}, got {}",
                        describe_type(expected),
                        type_name(value)
                    ));
                }
            }
            None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                let known: Vec<&str> = properties
                    .map(|p| p.keys().map(String::as_str).collect())
                    .unwrap_or_default();
                return Err(format!(
                    "unexpected argument '{name}'; expected only: {}",
                    known.join(", ")
                ));
            }
            None => {}
        }
    }
    Ok(Arguments::new(map))
}

fn matches_type(expected: &Value, value: &Value) -> bool {
    match expected {
        Value::String(kind) => matches_one(kind, value),
        Value::Array(kinds) => kinds
            .iter()
            .filter_map(Value::as_str)
            .any(|kind| matches_one(kind, value)),
        // An unusual schema: do not second-guess it.
        _ => true,
    }
}

fn matches_one(kind: &str, value: &Value) -> bool {
    match kind {
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        _ => true,
    }
}

fn describe_type(expected: &Value) -> String {
    match expected {
        Value::String(kind) => with_article(kind),
        Value::Array(kinds) => kinds
            .iter()
            .filter_map(Value::as_str)
            .map(with_article)
            .collect::<Vec<_>>()
            .join(" or "),
        other => other.to_string(),
    }
}

fn with_article(kind: &str) -> String {
    match kind {
        "integer" | "object" | "array" => format!("an {kind}"),
        "null" => "null".to_owned(),
        _ => format!("a {kind}"),
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec() -> ToolSpec {
        ToolSpec::new("add", "Add two numbers").parameters(json!({
            "type": "object",
            "properties": { "a": { "type": "number" }, "b": { "type": ["integer", "null"] } },
            "required": ["a"],
            "additionalProperties": false
        }))
    }

    #[test]
    fn arguments_may_arrive_as_an_object_or_a_json_string() {
        let from_object = validate_arguments(&spec(), &json!({ "a": 1.5 }));
        let from_string = validate_arguments(&spec(), &json!("{\"a\": 1.5}"));
        assert_eq!(from_object, from_string);
        assert_eq!(
            from_object.map(|args| args.get("a").cloned()),
            Ok(Some(json!(1.5)))
        );
    }

    #[test]
    fn missing_required_fields_are_named() {
        let error = validate_arguments(&spec(), &json!({})).err();
        assert_eq!(error.as_deref(), Some("missing required argument(s): a"));
    }

    #[test]
    fn wrong_types_say_what_was_expected() {
        let error = validate_arguments(&spec(), &json!({ "a": "x" })).err();
        assert_eq!(
            error.as_deref(),
            Some("argument 'a' must be a number, got a string")
        );
        let error = validate_arguments(&spec(), &json!({ "a": 1, "b": 2.5 })).err();
        assert_eq!(
            error.as_deref(),
            Some("argument 'b' must be an integer or null, got a number")
        );
        assert!(validate_arguments(&spec(), &json!({ "a": 1, "b": null })).is_ok());
        assert!(validate_arguments(&spec(), &json!({ "a": 1, "b": 2.0 })).is_ok());
    }

    #[test]
    fn non_objects_and_bad_json_are_rejected() {
        let error = validate_arguments(&spec(), &json!([1, 2])).err();
        assert_eq!(
            error.as_deref(),
            Some("arguments must be a JSON object, got an array")
        );
        let error = validate_arguments(&spec(), &json!("{\"a\": "))
            .err()
            .unwrap_or_default();
        assert!(
            error.starts_with("arguments are not valid JSON: "),
            "{error}"
        );
    }

    #[test]
    fn undeclared_fields_are_rejected_only_when_the_schema_forbids_them() {
        let error = validate_arguments(&spec(), &json!({ "a": 1, "c": 3 })).err();
        assert_eq!(
            error.as_deref(),
            Some("unexpected argument 'c'; expected only: a, b")
        );
        let open = ToolSpec::new("echo", "Echo");
        assert!(validate_arguments(&open, &json!({ "anything": true })).is_ok());
    }

    #[test]
    fn registry_refuses_duplicates_and_bad_schemas() {
        let noop = |_: Arguments| Ok(json!(null));
        let mut registry = Registry::new();
        assert!(registry.add(Tool::new_sync(spec(), noop)).is_ok());
        let duplicate = registry.add(Tool::new_sync(spec(), noop)).err();
        assert_eq!(
            duplicate,
            Some(RegistryError::Duplicate { name: "add".into() })
        );
        let bad = ToolSpec::new("bad", "Bad").parameters(json!({ "type": "array" }));
        let error = registry
            .add(Tool::new_sync(bad, noop))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "tool 'bad' has an invalid parameters schema: parameters must have type \"object\", not \"array\""
            )
        );
        assert_eq!(registry.names().collect::<Vec<_>>(), ["add"]);
    }
}
