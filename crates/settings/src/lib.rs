//! Settings tables read one way, for every table of the engine that chooses what it builds
//! by a `kind` key (a tool, a reward) and for every table read by several structs at once.
//!
//! - [`field_names`]: the keys a serde struct reads, so that a key no struct of a table
//!   reads can be refused.
//! - [`SettingError`]: a setting that cannot be read, with the key at fault (a path such as
//!   `limits.memory_mib`) and the problem. A program turns it into `FILE:LINE: key: problem`
//!   in one place; a library never names a flag or a file.
//! - [`Kinds`] and [`read_kind`]: one struct per kind, each read from its own keys only, so
//!   that a key of another kind, a key the kind needs and a value of the wrong type are each
//!   refused by name, in the same words for tools and rewards.
//!
//! ```
//! use async_grpo_settings::{Kinds, SettingError, read_kind, read_struct};
//! use serde_json::{Map, Value, json};
//!
//! #[derive(Debug, PartialEq, serde::Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct Http { url: String }
//!
//! #[derive(Debug, PartialEq)]
//! enum Tool { Http(Http) }
//!
//! impl Kinds for Tool {
//!     const NAMES: &'static [&'static str] = &["http"];
//!     fn fields_of(kind: &str) -> Option<Vec<&'static str>> {
//!         (kind == "http").then(|| vec!["url"])
//!     }
//!     fn read_kind(_: &str, map: Map<String, Value>) -> Result<Tool, SettingError> {
//!         read_struct(map).map(Tool::Http)
//!     }
//! }
//!
//! let table = |value: Value| value.as_object().cloned().unwrap_or_default();
//! let tool: Tool = read_kind("http", table(json!({"url": "http://x"})))?;
//! assert_eq!(tool, Tool::Http(Http { url: "http://x".into() }));
//! let error = read_kind::<Tool>("http", table(json!({"command": ["a"]}))).unwrap_err();
//! assert_eq!(error.to_string(), "`command` is not a field of kind \"http\" (it takes url)");
//! # Ok::<(), SettingError>(())
//! ```

mod fields;

use std::fmt;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

pub use self::fields::field_names;

/// A setting that cannot be read: the key at fault, when one is (a path of keys joined by
/// `.`, as serde names it), and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    /// The key, or the path of keys, at fault.
    pub key: Option<String>,
    /// What is wrong, a phrase that can follow the key.
    pub problem: String,
}

impl SettingError {
    /// A problem with the table as a whole, not one key.
    pub fn new(problem: impl Into<String>) -> SettingError {
        SettingError {
            key: None,
            problem: problem.into(),
        }
    }

    /// A problem with `key`.
    pub fn at(key: impl Into<String>, problem: impl Into<String>) -> SettingError {
        SettingError {
            key: Some(key.into()),
            problem: problem.into(),
        }
    }

    /// The same error, said of the table `outer` holds it in (`tools[2]`, `agent`): its key
    /// becomes `outer.key`.
    pub fn within(self, outer: &str) -> SettingError {
        let key = match self.key {
            Some(key) => format!("{outer}.{key}"),
            None => outer.to_owned(),
        };
        SettingError::at(key, self.problem)
    }
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) => write!(f, "{key}: {}", self.problem),
            None => f.write_str(&self.problem),
        }
    }
}

impl std::error::Error for SettingError {}

/// `T` read from `map`, the error naming the key at fault.
pub fn read_struct<T: DeserializeOwned>(map: Map<String, Value>) -> Result<T, SettingError> {
    serde_path_to_error::deserialize(Value::Object(map)).map_err(|error| {
        let path = error.path().to_string();
        SettingError {
            key: (path != ".").then_some(path),
            problem: error.inner().to_string(),
        }
    })
}

/// `key` of `map`, taken out and read.
pub fn take<T: DeserializeOwned>(
    map: &mut Map<String, Value>,
    key: &str,
) -> Result<Option<T>, SettingError> {
    match map.remove(key) {
        None => Ok(None),
        Some(value) => serde_json::from_value(value)
            .map(Some)
            .map_err(|error| SettingError::at(key, error.to_string())),
    }
}

/// The entries of `keys` taken out of `map`, as a table of their own: the part of a table that
/// a struct declared once reads (the sandbox keys, a service's keys), read apart so that its
/// errors name their key, which serde cannot through a flattened struct.
pub fn split(map: &mut Map<String, Value>, keys: &[&str]) -> Map<String, Value> {
    let mut part = Map::new();
    for key in keys {
        if let Some(value) = map.remove(*key) {
            part.insert((*key).to_owned(), value);
        }
    }
    part
}

/// `S` read from `map`, the keys `part` names read apart as `P` into the field `field` gives:
/// what a struct flattens (the sandbox keys), so that an error in one of those keys names it
/// (`limits.memory_mib`), which serde cannot through a flattened struct.
pub fn read_with_part<S: DeserializeOwned, P: DeserializeOwned>(
    mut map: Map<String, Value>,
    part: &[&str],
    field: fn(&mut S) -> &mut P,
) -> Result<S, SettingError> {
    let part = split(&mut map, part);
    let mut settings: S = read_struct(map)?;
    *field(&mut settings) = read_struct(part)?;
    Ok(settings)
}

/// Settings chosen by a `kind` key: one struct per kind, each read from its own keys.
pub trait Kinds: Sized {
    /// The kinds' names, in order.
    const NAMES: &'static [&'static str];

    /// The keys kind `kind` reads, if it is a kind.
    fn fields_of(kind: &str) -> Option<Vec<&'static str>>;

    /// Kind `kind` read from its keys (only those: [`read_kind`] has checked them).
    fn read_kind(kind: &str, map: Map<String, Value>) -> Result<Self, SettingError>;
}

/// Kind `kind`'s settings from `map`, the table's keys less those every kind shares: an
/// unknown kind, a key the kind does not take, a key it needs and a value of the wrong type
/// are each refused by name.
pub fn read_kind<K: Kinds>(kind: &str, map: Map<String, Value>) -> Result<K, SettingError> {
    let Some(fields) = K::fields_of(kind) else {
        return Err(SettingError::at(
            "kind",
            format!("unknown kind '{kind}'; expected {}", list_or(K::NAMES)),
        ));
    };
    if let Some(key) = map.keys().find(|key| !fields.contains(&key.as_str())) {
        let takes = if fields.is_empty() {
            "no key of its own".to_owned()
        } else {
            fields.join(", ")
        };
        return Err(SettingError::new(format!(
            "`{key}` is not a field of kind \"{kind}\" (it takes {takes})"
        )));
    }
    K::read_kind(kind, map).map_err(|error| match error.problem.strip_prefix("missing field ") {
        Some(key) => SettingError::new(format!("kind \"{kind}\" needs {key}")),
        None => error,
    })
}

/// Every key some kind of `K` reads, after `common` (the keys every kind shares), each once.
fn every_key<K: Kinds>(common: &[&'static str]) -> Vec<&'static str> {
    let mut keys = common.to_vec();
    for kind in K::NAMES {
        for key in K::fields_of(kind).unwrap_or_default() {
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    keys
}

/// Refuses a key of `map` that no kind of `K` nor `common` reads, naming those that are read.
pub fn refuse_unknown<K: Kinds>(
    map: &Map<String, Value>,
    common: &[&'static str],
) -> Result<(), SettingError> {
    let keys = every_key::<K>(common);
    match map.keys().find(|key| !keys.contains(&key.as_str())) {
        None => Ok(()),
        Some(key) => {
            let expected: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
            Err(SettingError::new(format!(
                "unknown field `{key}`, expected one of {}",
                expected.join(", ")
            )))
        }
    }
}

/// `a, b, c or d`.
fn list_or(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}
