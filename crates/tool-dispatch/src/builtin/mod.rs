//! Built-in tools, and [`ToolConfig`]: a tool described in a configuration file.
//!
//! | kind | runs | arguments | result |
//! |---|---|---|---|
//! | `calculator` | sync, in-process | `{"expression": "17 * 23"}` | the value (`391`) |
//! | `python` | async, `python3 -I -` in a sandboxed subprocess | `{"code": "..."}` | stdout, then stderr and the exit code if any |
//! | `command` | async, any program, sandboxed | the JSON arguments on its stdin | its stdout (a non-zero exit is an error) |
//! | `http` (feature `http`) | async | POSTed as JSON to `url` | the response body (a non-2xx is an error) |
//!
//! `command` and `python` kill the program at their timeout (default 30 s) and keep at most
//! `max_output_bytes` of stdout and of stderr (default 16 KiB), saying how much was cut. Each
//! call's program runs in a process group of its own, killed whole when the call ends, times
//! out or is cancelled (its future dropped): nothing it started outlives the call.
//!
//! `http` reads at most `max_output_bytes` of a body (default 16 KiB) and stops there, saying
//! that it cut (and how much, when the server sent a length); it follows at most 3 redirects,
//! all within the configured URL's origin (scheme, host and port: a redirect elsewhere is an
//! error), and its errors show the URL without credentials, query or fragment.
//!
//! `command` and `python` run what the model sends, so they are sandboxed by default
//! (`process::Sandbox`: bubblewrap, a PID namespace, the environment cleared, the file system
//! read-only but a private `/tmp`, no network, resource limits). A table sets
//! `sandbox = "none"` to run them with the engine's permissions, `network = true` to give them
//! the host's network, and `limits = { memory_mib = .., cpu_seconds = .., processes = ..,
//! file_size_mib = .., open_files = .. }` (`process::Limits`, 0 for none).

mod calculator;
#[cfg(feature = "http")]
mod http;
mod program;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub use self::calculator::{ExpressionError, MAX_EXPRESSION_DEPTH, evaluate};
use crate::tool::{Tool, ToolSpec};
use process::{Sandbox, SandboxKeys};

/// The kinds of built-in tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    /// An external program.
    Command,
    /// An HTTP endpoint (feature `http`).
    Http,
    /// Python code in a subprocess.
    Python,
    /// Arithmetic.
    Calculator,
}

impl ToolKind {
    fn as_str(self) -> &'static str {
        match self {
            ToolKind::Command => "command",
            ToolKind::Http => "http",
            ToolKind::Python => "python",
            ToolKind::Calculator => "calculator",
        }
    }
}

/// One tool as a configuration file describes it (a `[[tools]]` table):
///
/// ```toml
/// [[tools]]
/// name = "lookup"
/// kind = "command"        # "command" | "http" | "python" | "calculator"
/// command = ["./lookup.sh"]
/// description = "Look a term up"
/// parameters = { type = "object", properties = { query = { type = "string" } }, required = ["query"] }
/// timeout = "10s"
/// ```
///
/// Unknown fields are refused. `description` and `parameters` are what the chat template
/// renders; `calculator` and `python` have their own defaults.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// The name the model calls it by.
    pub name: String,
    /// What runs it.
    pub kind: ToolKind,
    /// What it does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of the arguments.
    #[serde(default)]
    pub parameters: Option<Value>,
    /// `command`: the program and its arguments.
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// `http`: the endpoint.
    #[serde(default)]
    pub url: Option<String>,
    /// `python`: the interpreter (default `python3`).
    #[serde(default)]
    pub interpreter: Option<String>,
    /// How long a call may take: `500ms`, `10s`, `2m` (default 30 s).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// `command`, `python`: bytes kept of stdout and of stderr each; `http`: bytes read of
    /// the response body (default 16384 for all three).
    #[serde(default)]
    pub max_output_bytes: Option<usize>,
    /// `command`, `python`: the `sandbox` (`"bwrap"`, the default, or `"none"`), `network`
    /// (default false) and `limits` keys.
    #[serde(flatten)]
    pub keys: SandboxKeys,
}

/// A [`ToolConfig`] that does not describe a usable tool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tool '{name}': {reason}")]
pub struct ToolConfigError {
    name: String,
    reason: String,
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_MAX_OUTPUT: usize = 16 * 1024;
/// How much longer the dispatcher waits for a program than the tool's own timeout, so that a
/// program is killed and reported before its caller gives up on it.
const PROGRAM_MARGIN: Duration = Duration::from_secs(1);

/// The parameter schema of a tool that takes any object (`command` and `http` by default).
fn open_parameters() -> Value {
    json!({ "type": "object", "properties": {} })
}

impl ToolConfig {
    /// Builds the tool: checks that the fields fit the kind, and parses the timeout. A program
    /// runs in the default [`Sandbox`] as the table changes it.
    pub fn build(&self) -> Result<Tool, ToolConfigError> {
        self.build_in(&Sandbox::default())
    }

    /// The sandbox this table's program runs in: `base` (what the engine hides, for one) as
    /// the table changes it.
    pub fn sandbox_in(&self, base: &Sandbox) -> Sandbox {
        self.keys.apply(base.clone())
    }

    /// Whether the tool runs a program (and so has a sandbox).
    pub fn runs_a_program(&self) -> bool {
        matches!(self.kind, ToolKind::Command | ToolKind::Python)
    }

    /// [`ToolConfig::build`] with `base` as the sandbox the table changes.
    pub fn build_in(&self, base: &Sandbox) -> Result<Tool, ToolConfigError> {
        self.check_fields()?;
        let timeout = self.timeout.unwrap_or(DEFAULT_TIMEOUT);
        if timeout.is_zero() {
            return Err(self.error("timeout must be longer than 0s: no call could finish"));
        }
        let max_output = self.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT);
        match self.kind {
            ToolKind::Calculator => Ok(self.calculator_tool(timeout)),
            ToolKind::Python => Ok(self.python_tool(self.sandbox_in(base), timeout, max_output)),
            ToolKind::Command => self.command_tool(self.sandbox_in(base), timeout, max_output),
            ToolKind::Http => {
                let url = self.http_url()?;
                self.http_tool(
                    url,
                    self.description_or("Call a web service"),
                    self.parameters_or(open_parameters()),
                    timeout,
                    max_output,
                )
                .map_err(|reason| self.error(reason))
            }
        }
    }

    /// Refuses a field set for a kind it means nothing to (`url` on a `command`, `sandbox` on
    /// a `calculator`, ...).
    fn check_fields(&self) -> Result<(), ToolConfigError> {
        let kind = self.kind.as_str();
        for (field, present, for_kind) in [
            ("command", self.command.is_some(), "command"),
            ("url", self.url.is_some(), "http"),
            ("interpreter", self.interpreter.is_some(), "python"),
        ] {
            if present && kind != for_kind {
                return Err(self.error(format!(
                    "`{field}` is only for kind \"{for_kind}\", not \"{kind}\""
                )));
            }
        }
        if !self.runs_a_program() {
            for (field, present) in SandboxKeys::KEYS.into_iter().zip([
                self.keys.sandbox.is_some(),
                self.keys.network.is_some(),
                self.keys.limits.is_some(),
            ]) {
                if present {
                    return Err(self.error(format!(
                        "`{field}` is only for kinds \"command\" and \"python\", not \"{kind}\""
                    )));
                }
            }
        }
        Ok(())
    }

    /// `calculator`: evaluated in-process, on the dispatcher's thread pool.
    fn calculator_tool(&self, timeout: Duration) -> Tool {
        Tool::new_sync(
            ToolSpec::new(
                &self.name,
                self.description_or("Evaluate an arithmetic expression"),
            )
            .parameters(self.parameters_or(calculator::parameters())),
            calculator::call,
        )
        .timeout(timeout)
    }

    /// `python`: the code runs in the interpreter (default `python3`) in `sandbox`.
    fn python_tool(&self, sandbox: Sandbox, timeout: Duration, max_output: usize) -> Tool {
        let python = program::PythonTool {
            interpreter: self
                .interpreter
                .clone()
                .unwrap_or_else(|| "python3".to_owned()),
            sandbox,
            timeout,
            max_output,
        };
        Tool::new_async(
            ToolSpec::new(
                &self.name,
                self.description_or("Run Python code and see its output"),
            )
            .parameters(self.parameters_or(program::PythonTool::parameters())),
            move |args| python.clone().call(args),
        )
        .timeout(timeout + PROGRAM_MARGIN)
    }

    /// `command`: the program runs in `sandbox`; the table must name it.
    fn command_tool(
        &self,
        sandbox: Sandbox,
        timeout: Duration,
        max_output: usize,
    ) -> Result<Tool, ToolConfigError> {
        let argv = self.command.clone().unwrap_or_default();
        if argv.first().is_none_or(|program| program.trim().is_empty()) {
            return Err(
                self.error("kind \"command\" needs `command = [\"program\", \"arg\", ...]`")
            );
        }
        let command = program::CommandTool {
            argv,
            sandbox,
            timeout,
            max_output,
        };
        Ok(Tool::new_async(
            ToolSpec::new(&self.name, self.description_or("Run a command"))
                .parameters(self.parameters_or(open_parameters())),
            move |args| command.clone().call(args),
        )
        .timeout(timeout + PROGRAM_MARGIN))
    }

    /// `http`: the table's `url`, which must be there and be an http or https one.
    fn http_url(&self) -> Result<String, ToolConfigError> {
        let url = self
            .url
            .clone()
            .ok_or_else(|| self.error("kind \"http\" needs `url = \"http://...\"`"))?;
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(self.error(format!("url '{url}' must start with http:// or https://")));
        }
        Ok(url)
    }

    #[cfg(feature = "http")]
    fn http_tool(
        &self,
        url: String,
        description: String,
        parameters: Value,
        timeout: Duration,
        max_output: usize,
    ) -> Result<Tool, String> {
        let http = http::HttpTool::new(&url, max_output)?;
        Ok(Tool::new_async(
            ToolSpec::new(&self.name, description).parameters(parameters),
            move |args| http.clone().call(args),
        )
        .timeout(timeout))
    }

    #[cfg(not(feature = "http"))]
    fn http_tool(
        &self,
        _: String,
        _: String,
        _: Value,
        _: Duration,
        _: usize,
    ) -> Result<Tool, String> {
        Err("kind \"http\" needs tool-dispatch's `http` feature".to_owned())
    }

    /// The table's description, else the kind's own.
    fn description_or(&self, default: &str) -> String {
        self.description
            .clone()
            .unwrap_or_else(|| default.to_owned())
    }

    /// The table's parameter schema, else the kind's own.
    fn parameters_or(&self, default: Value) -> Value {
        self.parameters.clone().unwrap_or(default)
    }

    /// This table's error, saying why.
    fn error(&self, reason: impl Into<String>) -> ToolConfigError {
        ToolConfigError {
            name: self.name.clone(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml_like: Value) -> ToolConfig {
        serde_json::from_value(toml_like).expect("a tool table")
    }

    #[test]
    fn a_config_says_which_tool_and_which_field_is_wrong() {
        let no_command = config(json!({"name": "lookup", "kind": "command"}))
            .build()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            no_command.as_deref(),
            Some("tool 'lookup': kind \"command\" needs `command = [\"program\", \"arg\", ...]`")
        );
        let misplaced = config(json!({"name": "calc", "kind": "calculator", "url": "http://x"}))
            .build()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            misplaced.as_deref(),
            Some("tool 'calc': `url` is only for kind \"http\", not \"calculator\"")
        );
        let timeout = serde_json::from_value::<ToolConfig>(
            json!({"name": "calc", "kind": "calculator", "timeout": "soon"}),
        )
        .err()
        .map(|e| e.to_string());
        assert!(
            timeout
                .as_deref()
                .is_some_and(|e| e.contains("\"soon\", expected a duration")),
            "{timeout:?}"
        );
        let unknown = serde_json::from_value::<ToolConfig>(
            json!({"name": "calc", "kind": "calculator", "colour": "red"}),
        );
        assert!(unknown.is_err_and(|e| e.to_string().starts_with("unknown field `colour`")));
    }

    #[test]
    fn built_in_kinds_come_with_their_schema_and_description() {
        let calculator = config(json!({"name": "calc", "kind": "calculator"}))
            .build()
            .expect("valid");
        assert!(calculator.is_sync());
        assert_eq!(
            calculator.spec().parameters["required"],
            json!(["expression"])
        );
        let python = config(json!({"name": "py", "kind": "python", "timeout": "5s"}))
            .build()
            .expect("valid");
        assert_eq!(
            python.spec().description,
            "Run Python code and see its output"
        );
        let lookup = config(json!({
            "name": "lookup", "kind": "command", "command": ["./lookup.sh"], "description": "Look a term up",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
        }))
        .build()
        .expect("valid");
        assert_eq!(
            lookup.spec().to_openai()["function"]["parameters"]["required"],
            json!(["query"])
        );
    }
}
