//! The tables of the settings file in the reference, from the JSON schemas their structs
//! derive (`schemars`, the `schema` feature of the crates that declare them, reading the same
//! serde attributes that read the file): each key, its value, its default and its doc
//! comment. A table chosen by `kind` gets a section per kind; the sandbox keys, which several
//! tables flatten, get one section that those tables link to.

use std::fmt::Write as _;

use schemars::{Schema, schema_for};
use serde_json::{Map, Value};

use super::one_line;

/// A table of the file: how it is written, what it is for, and its struct's schema.
struct Table {
    header: &'static str,
    about: &'static str,
    schema: Schema,
}

fn tables() -> [Table; 5] {
    [
        Table {
            header: "[[tools]]",
            about: "A tool the model may call, one table per tool.",
            schema: schema_for!(tool_dispatch::builtin::ToolConfig),
        },
        Table {
            header: "[[rewards]]",
            about: "A reward function, one table per function (`--reward` flags replace them \
                    all); the row's reward is their weighted sum.",
            schema: schema_for!(scoring::RewardTable),
        },
        Table {
            header: "[environment]",
            about: "The MCP server every rollout runs in: its tools are the rollout's, its \
                    verify tool gives the `env` reward column.",
            schema: schema_for!(harness::mcp::McpEnvironment),
        },
        Table {
            header: "[agent]",
            about: "The loop-owning agent program that runs every rollout, talking to the \
                    engine's recording proxy.",
            schema: schema_for!(harness::agent::ProgramConfig),
        },
        Table {
            header: "[simulator]",
            about: "The built-in simulator's behaviour, used only when no server is given \
                    (also the flags of `async-grpo simulate`).",
            schema: schema_for!(vllm_sim::SimSettings),
        },
    ]
}

/// The value of a key that is a table of named keys (`limits`), whose keys follow.
const NESTED: &str = "table (keys below)";

/// One key of a table, as a row of the reference.
struct Key {
    name: String,
    value: String,
    default: String,
    help: String,
}

/// Appends the tables' sections to `out`.
pub(super) fn markdown(out: &mut String) {
    let sandbox = schema_for!(process::SandboxKeys);
    let sandbox = Doc::new(&sandbox);
    let shared: Vec<String> = sandbox
        .keys(sandbox.root)
        .into_iter()
        .map(|key| key.name)
        .collect();
    out.push_str(
        "\n## Tables of the settings file\n\n\
         Besides the keys above, the file given with `--config` holds these tables (file \
         only, no flags). A key of no table, a key of another kind and a value of the wrong \
         type are refused by name, with the file and line. A duration is a string such as \
         `\"500ms\"`, `\"30s\"` or `\"10m\"`.\n",
    );
    for table in tables() {
        let doc = Doc::new(&table.schema);
        let _ = write!(out, "\n### `{}`\n\n{}\n\n", table.header, table.about);
        let (kinds, alternatives) = doc.kinds(doc.root);
        let mut keys = doc.keys(doc.root);
        for alternative in &alternatives {
            for mut key in doc.keys(alternative) {
                key.default = "or `kind`".to_owned();
                keys.push(key);
            }
        }
        if !kinds.is_empty() {
            let names: Vec<String> = kinds
                .iter()
                .map(|(name, ..)| format!("`\"{name}\"`"))
                .collect();
            let instead: Vec<String> = alternatives
                .iter()
                .flat_map(|alternative| doc.keys(alternative))
                .map(|key| format!(" (or `{}`)", key.name))
                .collect();
            keys.push(Key {
                name: "kind".to_owned(),
                value: names.join(" or "),
                default: format!("required{}", instead.concat()),
                help: "What it is; each kind's own keys are below".to_owned(),
            });
        }
        doc.rows(out, keys, &shared);
        for (name, about, variant) in kinds {
            let _ = write!(out, "\n#### `kind = \"{name}\"`\n\n");
            if !about.is_empty() {
                let _ = write!(out, "{about}\n\n");
            }
            let keys = doc.keys(variant);
            if keys.is_empty() {
                out.push_str("No key of its own.\n");
            } else {
                doc.rows(out, keys, &shared);
            }
        }
    }
    out.push_str(
        "\n### Sandbox keys\n\n\
         The keys of every table that starts programs (the `command` and `python` tools, the \
         `command` reward, `[environment]` with a `command`, `[agent]`): each key given \
         changes the sandbox the table's programs start in, each left out keeps it (see the \
         table's kind or its `command` key for where it starts from).\n\n",
    );
    sandbox.rows(out, sandbox.keys(sandbox.root), &[]);
}

/// A schema with the definitions its `$ref`s point to.
struct Doc<'a> {
    root: &'a Value,
    defs: Option<&'a Map<String, Value>>,
}

impl<'a> Doc<'a> {
    fn new(schema: &'a Schema) -> Doc<'a> {
        let root = schema.as_value();
        Doc {
            root,
            defs: root.get("$defs").and_then(Value::as_object),
        }
    }

    /// The definition `schema` refers to, if it is a `$ref`.
    fn target(&self, schema: &'a Value) -> Option<&'a Value> {
        let name = schema.get("$ref")?.as_str()?.strip_prefix("#/$defs/")?;
        self.defs?.get(name)
    }

    /// `schema` with an optional value's `null` left out: `T` of `anyOf [T, null]`.
    fn not_null(&self, schema: &'a Value) -> &'a Value {
        match schema.get("anyOf").and_then(Value::as_array) {
            Some(options) if options.len() == 2 => options
                .iter()
                .find(|option| option.get("type").and_then(Value::as_str) != Some("null"))
                .unwrap_or(schema),
            _ => schema,
        }
    }

    /// The keys `schema` reads (its own and those of the struct it refers to or flattens),
    /// but `kind` when it is a tag.
    fn keys(&self, schema: &'a Value) -> Vec<Key> {
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let mut keys = Vec::new();
        for (name, property) in schema
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            if property.get("const").is_some() {
                continue; // the tag of a kind
            }
            let default = match property.get("default") {
                Some(value) => toml_value(value),
                None if required.contains(&name.as_str()) => "required".to_owned(),
                None => String::new(),
            };
            keys.push(Key {
                name: name.clone(),
                value: self.value(property),
                default,
                help: plain(
                    property
                        .get("description")
                        .and_then(Value::as_str)
                        .unwrap_or(""),
                ),
            });
        }
        if let Some(target) = self.target(schema) {
            keys.extend(self.keys(target));
        }
        keys
    }

    /// The kinds of a table chosen by `kind` (name, what it is, its schema), and the
    /// alternatives to a kind (a reward's `spec`).
    #[allow(clippy::type_complexity, reason = "a private pair of lists")]
    fn kinds(&self, schema: &'a Value) -> (Vec<(String, String, &'a Value)>, Vec<&'a Value>) {
        let mut kinds = Vec::new();
        let mut alternatives = Vec::new();
        let options = ["oneOf", "anyOf"]
            .into_iter()
            .filter_map(|key| schema.get(key).and_then(Value::as_array))
            .flatten();
        for option in options {
            let tag = option
                .pointer("/properties/kind/const")
                .and_then(Value::as_str);
            match (tag, self.target(option)) {
                (Some(tag), _) => kinds.push((
                    tag.to_owned(),
                    plain(
                        option
                            .get("description")
                            .and_then(Value::as_str)
                            .unwrap_or(""),
                    ),
                    option,
                )),
                (None, Some(target)) => {
                    let (more, others) = self.kinds(target);
                    kinds.extend(more);
                    alternatives.extend(others);
                }
                (None, None) => alternatives.push(option),
            }
        }
        (kinds, alternatives)
    }

    /// What a value of `schema` is, in words.
    fn value(&self, schema: &'a Value) -> String {
        let schema = self.not_null(schema);
        if let Some(target) = self.target(schema) {
            return self.value(target);
        }
        if let Some(tag) = schema.get("const") {
            return toml_value(tag);
        }
        if let Some(options) = schema.get("oneOf").and_then(Value::as_array) {
            let words: Vec<String> = options.iter().map(|o| self.value(o)).collect();
            return words.join(" or ");
        }
        let kind = match schema.get("type") {
            Some(Value::String(kind)) => kind.as_str(),
            Some(Value::Array(kinds)) => kinds
                .iter()
                .filter_map(Value::as_str)
                .find(|kind| *kind != "null")
                .unwrap_or(""),
            _ => "",
        };
        match kind {
            "string" if schema.get("format").and_then(Value::as_str) == Some("duration") => {
                "duration".to_owned()
            }
            "string" | "integer" | "number" | "boolean" => kind.to_owned(),
            "array" => match schema.get("items") {
                Some(items) => format!("list of {}", plural(&self.value(items))),
                None => "list".to_owned(),
            },
            "object" => match schema.get("additionalProperties") {
                Some(values) if values.is_object() => {
                    format!("table of {}", plural(&self.value(values)))
                }
                _ if schema.get("properties").is_some() => NESTED.to_owned(),
                _ => "table".to_owned(),
            },
            _ => "any".to_owned(),
        }
    }

    /// `keys` as a Markdown table, the sandbox keys (`shared`) in one row when all are there,
    /// then the keys of each table-valued key.
    fn rows(&self, out: &mut String, mut keys: Vec<Key>, shared: &[String]) {
        let flattens = !shared.is_empty()
            && shared
                .iter()
                .all(|name| keys.iter().any(|key| &key.name == name));
        if flattens {
            keys.retain(|key| !shared.contains(&key.name));
        }
        out.push_str("| key | value | default | what it sets |\n|---|---|---|---|\n");
        for key in &keys {
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} |",
                key.name, key.value, key.default, key.help
            );
        }
        if flattens {
            let names: Vec<String> = shared.iter().map(|name| format!("`{name}`")).collect();
            let _ = writeln!(
                out,
                "| {} | | | The [sandbox keys](#sandbox-keys) |",
                names.join(", ")
            );
        }
        // A key whose value is a table of named keys (`limits`): its keys, after.
        if !flattens {
            let properties = keys.iter().filter(|key| key.value == NESTED);
            for key in properties {
                if let Some(table) = self.nested(&key.name) {
                    let _ = write!(
                        out,
                        "\n#### `{}`\n\nThe keys of the table `{}` holds.\n\n",
                        key.name, key.name
                    );
                    self.rows(out, self.keys(table), &[]);
                }
            }
        }
    }

    /// The object schema of the key `name` of the root, if its value is a table.
    fn nested(&self, name: &str) -> Option<&'a Value> {
        let property = self.root.get("properties")?.get(name)?;
        let schema = self.not_null(property);
        Some(self.target(schema).unwrap_or(schema))
    }
}

/// A value as TOML writes it (strings quoted).
fn toml_value(value: &Value) -> String {
    match value {
        Value::String(text) => format!("`\"{text}\"`"),
        Value::Null => String::new(),
        other => format!("`{other}`"),
    }
}

/// `string` as `strings`, for `list of strings`.
fn plural(word: &str) -> String {
    match word {
        "string" | "integer" | "number" | "boolean" => format!("{word}s"),
        "list of strings" => "lists of strings".to_owned(),
        other => other.to_owned(),
    }
}

/// A doc comment as one line of Markdown: rustdoc's intra-doc links (`` [`Limits`] ``,
/// `` [`X`](crate::X) ``) as plain code spans.
fn plain(doc: &str) -> String {
    let mut out = String::with_capacity(doc.len());
    let mut rest = doc;
    while let Some(start) = rest.find("[`") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        match after.find("`]") {
            Some(end) => {
                out.push_str(&after[..end + 1]);
                rest = &after[end + 2..];
                // A link's target, `(crate::X)`, goes too.
                if let Some(target) = rest.strip_prefix('(')
                    && let Some(close) = target.find(')')
                    && !target[..close].contains(' ')
                {
                    rest = &target[close + 1..];
                }
            }
            None => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    one_line(&out)
}
