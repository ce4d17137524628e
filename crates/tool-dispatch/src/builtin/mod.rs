//! Built-in tools, and [`ToolConfig`]: a tool described in a configuration file.
//!
//! | kind | runs | arguments | result |
//! |---|---|---|---|
//! | `calculator` | sync, in-process | `{"expression": "17 * 23"}` | the value (`391`) |
//! | `python` | async, `python3 -I -` in a sandboxed subprocess | `{"code": "..."}` | stdout, then stderr and the exit code if any |
//! | `python`, `session = "rollout"` | async, one sandboxed interpreter per rollout ([`crate::RolloutTool`]) | `{"code": "..."}` | stdout and stderr as written, the last expression's value, a traceback |
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
mod remote;

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Deserializer, Serialize, de::Error as _};
use serde_json::{Map, Value, json};
use settings::{Kinds, SettingError, field_names, read_kind, read_struct, read_with_part, take};

pub use self::calculator::{ExpressionError, MAX_EXPRESSION_DEPTH, evaluate};
use crate::tool::{Tool, ToolSpec};
use process::{Sandbox, SandboxKeys};

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
/// `name`, `description`, `parameters` and `timeout` are every kind's; the rest is the kind's
/// own ([`ToolKind`]: one struct per kind, read from its keys only), so a key of another
/// kind, a key of no kind, a key the kind needs and a value of the wrong type are each refused
/// by name when the table is read. `description` and `parameters` are what the chat template
/// renders; `calculator` and `python` have their own defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ToolConfig {
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// How long a call may take: `500ms`, `10s`, `2m` (default 30 s).
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<String>", extend("format" = "duration")))]
    pub timeout: Option<Duration>,
    /// What runs it, with that kind's settings.
    #[serde(flatten)]
    pub kind: ToolKind,
}

/// The keys every kind of tool reads.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Common {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
    #[serde(default, with = "humantime_serde")]
    timeout: Option<Duration>,
}

/// A built-in tool's kind (`kind`), with its own settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToolKind {
    /// An external program, sandboxed.
    Command(CommandSettings),
    /// An HTTP endpoint (feature `http`).
    Http(HttpSettings),
    /// Python code in a sandboxed subprocess.
    Python(PythonSettings),
    /// Arithmetic, in-process.
    Calculator(CalculatorSettings),
}

/// `kind = "command"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CommandSettings {
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Bytes kept of stdout and of stderr each (default 16384).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<usize>,
    /// The `sandbox` (`"bwrap"`, the default, or `"none"`), `network` (default false) and
    /// `limits` keys.
    #[serde(flatten)]
    pub keys: SandboxKeys,
}

/// `kind = "python"`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PythonSettings {
    /// The interpreter (default `python3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interpreter: Option<String>,
    /// Bytes kept of stdout and of stderr each (default 16384); in a session, of both
    /// together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<usize>,
    /// How long the interpreter lives: `"call"` (the default: a fresh one per call) or
    /// `"rollout"` (one per rollout, which keeps its variables, imports and files from call
    /// to call and is killed when the rollout ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionScope>,
    /// With `session = "rollout"`: interpreters kept started and ready for the rollouts'
    /// first calls (default 4), never more than the rollouts in flight can use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<usize>,
    /// With `session = "rollout"`: run each rollout's session on a kernel of this Jupyter
    /// gateway (Kernel Gateway or Enterprise Gateway, `http://` or `https://`) instead of a
    /// local sandboxed interpreter (feature `kernels`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// The environment variable holding the gateway's token (sent as
    /// `Authorization: token ...`); none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_token_env: Option<String>,
    /// The gateway's kernelspec to start (default: the gateway's default kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// Where the engine writes down the kernels it holds, so that the next run deletes those
    /// of a run that was killed (default `$XDG_STATE_HOME/async-grpo/kernel-leases`, else
    /// `~/.local/state/async-grpo/kernel-leases`); a folder per gateway is made in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_dir: Option<PathBuf>,
    /// The `sandbox` (`"bwrap"`, the default, or `"none"`), `network` (default false) and
    /// `limits` keys.
    #[serde(flatten)]
    pub keys: SandboxKeys,
}

impl PythonSettings {
    /// A remote kernel's key that is set, if any.
    fn remote_key(&self) -> Option<&'static str> {
        [
            ("gateway", self.gateway.is_some()),
            ("gateway_token_env", self.gateway_token_env.is_some()),
            ("kernel", self.kernel.is_some()),
            ("lease_dir", self.lease_dir.is_some()),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key))
    }
}

/// How long a `python` tool's interpreter lives (`session`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum SessionScope {
    /// A fresh interpreter per call: nothing persists between calls.
    #[default]
    Call,
    /// One interpreter per rollout.
    Rollout,
}

/// `kind = "http"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    /// The endpoint, `http://` or `https://`.
    pub url: String,
    /// Bytes read of the response body (default 16384).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<usize>,
}

/// `kind = "calculator"`: no settings of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CalculatorSettings {}

impl Kinds for ToolKind {
    const NAMES: &'static [&'static str] = &["command", "http", "python", "calculator"];

    fn fields_of(kind: &str) -> Option<Vec<&'static str>> {
        match kind {
            // A program kind's own keys and the sandbox keys it flattens (which serde does not
            // list for a flattened struct), those read apart.
            "command" => Some([&["command", "max_output_bytes"][..], &SandboxKeys::KEYS].concat()),
            "python" => Some(
                [
                    &[
                        "interpreter",
                        "max_output_bytes",
                        "session",
                        "warm",
                        "gateway",
                        "gateway_token_env",
                        "kernel",
                        "lease_dir",
                    ][..],
                    &SandboxKeys::KEYS,
                ]
                .concat(),
            ),
            "http" => Some(field_names::<HttpSettings>().to_vec()),
            "calculator" => Some(Vec::new()),
            _ => None,
        }
    }

    fn read_kind(kind: &str, map: Map<String, Value>) -> Result<ToolKind, SettingError> {
        match kind {
            "command" => read_with_part(map, &SandboxKeys::KEYS, |c: &mut CommandSettings| {
                &mut c.keys
            })
            .map(ToolKind::Command),
            "http" => read_struct(map).map(ToolKind::Http),
            "python" => read_with_part(map, &SandboxKeys::KEYS, |p: &mut PythonSettings| {
                &mut p.keys
            })
            .map(ToolKind::Python),
            "calculator" => read_struct(map).map(ToolKind::Calculator),
            other => Err(SettingError::new(format!("unknown kind '{other}'"))),
        }
    }
}

impl ToolConfig {
    /// The keys every kind reads.
    const COMMON: &'static [&'static str] =
        &["name", "kind", "description", "parameters", "timeout"];

    /// The table read from its keys: the common ones, then `kind`'s own.
    pub fn read(mut map: Map<String, Value>) -> Result<ToolConfig, SettingError> {
        settings::refuse_unknown::<ToolKind>(&map, ToolConfig::COMMON)?;
        let kind = take::<String>(&mut map, "kind")?
            .ok_or_else(|| SettingError::new("missing field `kind`"))?;
        let common: Common = read_struct(settings::split(&mut map, ToolConfig::COMMON))?;
        let kind = read_kind(&kind, map)
            .map_err(|e| SettingError::new(format!("tool '{}': {e}", common.name)))?;
        Ok(ToolConfig {
            name: common.name,
            description: common.description,
            parameters: common.parameters,
            timeout: common.timeout,
            kind,
        })
    }
}

impl<'de> Deserialize<'de> for ToolConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<ToolConfig, D::Error> {
        let map = Map::<String, Value>::deserialize(deserializer)?;
        ToolConfig::read(map).map_err(D::Error::custom)
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_MAX_OUTPUT: usize = 16 * 1024;
/// Interpreters a session-backed `python` tool keeps ready (`warm`).
const DEFAULT_WARM: usize = 4;
/// Rollouts in flight a tool built without knowing them is sized for (the engine's default
/// `max_inflight`).
const DEFAULT_SESSIONS: usize = 64;
/// How much longer the dispatcher waits for a program than the tool's own timeout, so that a
/// program is killed and reported before its caller gives up on it.
const PROGRAM_MARGIN: Duration = Duration::from_secs(1);

/// The parameter schema of a tool that takes any object (`command` and `http` by default).
fn open_parameters() -> Value {
    json!({ "type": "object", "properties": {} })
}

impl ToolConfig {
    /// Builds the tool: checks what the kind needs, and the timeout. A program runs in the
    /// default [`Sandbox`] as the table changes it.
    pub fn build(&self) -> Result<Tool, SettingError> {
        self.build_in(&Sandbox::default())
    }

    /// The sandbox this table's program runs in, if it runs one: `base` (what the engine
    /// hides, for one) as the table changes it.
    pub fn sandbox_in(&self, base: &Sandbox) -> Option<Sandbox> {
        match &self.kind {
            ToolKind::Command(CommandSettings { keys, .. })
            | ToolKind::Python(PythonSettings { keys, .. }) => Some(keys.apply(base.clone())),
            ToolKind::Http(_) | ToolKind::Calculator(_) => None,
        }
    }

    /// The program the tool runs (a command's, or the Python interpreter), if it runs one.
    pub fn program(&self) -> Option<&str> {
        match &self.kind {
            ToolKind::Command(command) => command.command.first().map(String::as_str),
            ToolKind::Python(python) => Some(python.interpreter.as_deref().unwrap_or("python3")),
            ToolKind::Http(_) | ToolKind::Calculator(_) => None,
        }
    }

    /// [`ToolConfig::build`] with `base` as the sandbox the table changes.
    pub fn build_in(&self, base: &Sandbox) -> Result<Tool, SettingError> {
        self.build_for(base, DEFAULT_SESSIONS)
    }

    /// [`ToolConfig::build_in`] for a run of at most `rollouts` rollouts in flight: a
    /// session-backed tool never has more interpreters than that, warm ones included.
    pub fn build_for(&self, base: &Sandbox, rollouts: usize) -> Result<Tool, SettingError> {
        if let ToolKind::Command(CommandSettings { keys, .. })
        | ToolKind::Python(PythonSettings { keys, .. }) = &self.kind
            && let Err((key, problem)) = keys.check()
        {
            return Err(self.error(format!("`{key}`: {problem}")));
        }
        let timeout = self.timeout.unwrap_or(DEFAULT_TIMEOUT);
        if timeout.is_zero() {
            return Err(self.error("timeout must be longer than 0s: no call could finish"));
        }
        match &self.kind {
            ToolKind::Calculator(_) => Ok(self.calculator_tool(timeout)),
            ToolKind::Python(python) => {
                if python.warm.is_some() && python.session != Some(SessionScope::Rollout) {
                    return Err(self.error(
                        "`warm` keeps interpreters ready for sessions: it needs \
                         `session = \"rollout\"`",
                    ));
                }
                if python.gateway.is_some() {
                    return self.kernel_tool(python, timeout);
                }
                if let Some(key) = python.remote_key() {
                    return Err(self.error(format!(
                        "`{key}` is a remote kernel's setting: it needs `gateway = \"http://...\"`"
                    )));
                }
                Ok(self.python_tool(python, base, timeout, rollouts))
            }
            ToolKind::Command(command) => self.command_tool(command, base, timeout),
            ToolKind::Http(http) => {
                let url = self.http_url(http)?;
                self.http_tool(
                    url,
                    self.description_or("Call a web service"),
                    self.parameters_or(open_parameters()),
                    timeout,
                    http.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT),
                )
                .map_err(|reason| self.error(reason))
            }
        }
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

    /// `python`: the code runs in the interpreter (default `python3`) in `base` as the table
    /// changes it.
    fn python_tool(
        &self,
        settings: &PythonSettings,
        base: &Sandbox,
        timeout: Duration,
        rollouts: usize,
    ) -> Tool {
        let interpreter = settings
            .interpreter
            .clone()
            .unwrap_or_else(|| "python3".to_owned());
        let sandbox = settings.keys.apply(base.clone());
        let max_output = settings.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT);
        let session = settings.session.unwrap_or_default();
        let spec = ToolSpec::new(
            &self.name,
            self.description_or(match session {
                SessionScope::Call => "Run Python code and see its output",
                SessionScope::Rollout => {
                    "Run Python code and see its output; variables, imports and files persist \
                     from call to call, and the value of a last expression is shown"
                }
            }),
        )
        .parameters(self.parameters_or(program::PythonTool::parameters()));
        let tool = match session {
            SessionScope::Call => {
                let python = program::PythonTool {
                    interpreter,
                    sandbox,
                    timeout,
                    max_output,
                };
                Tool::new_async(spec, move |args| python.clone().call(args))
            }
            SessionScope::Rollout => {
                let warm = settings.warm.unwrap_or(DEFAULT_WARM).min(rollouts);
                let pool = process::InterpreterPool::new(
                    process::InterpreterSpec::new(interpreter, sandbox),
                    warm,
                    rollouts,
                );
                Tool::per_rollout(
                    spec,
                    program::PythonSessions {
                        pool,
                        timeout,
                        max_output,
                    },
                )
            }
        };
        tool.timeout(timeout + PROGRAM_MARGIN)
    }

    /// `python` with `gateway`: each rollout's session on a kernel of that Jupyter gateway.
    fn kernel_tool(
        &self,
        settings: &PythonSettings,
        timeout: Duration,
    ) -> Result<Tool, SettingError> {
        if settings.session != Some(SessionScope::Rollout) {
            return Err(self.error(
                "`gateway` runs sessions on remote kernels: it needs `session = \"rollout\"`",
            ));
        }
        for (key, set) in [
            ("warm", settings.warm.is_some()),
            ("interpreter", settings.interpreter.is_some()),
        ] {
            if set {
                return Err(self.error(format!(
                    "`{key}` is a local interpreter's setting; a gateway's kernels start at a \
                     rollout's first call, as the gateway's `kernel` names them"
                )));
            }
        }
        if settings.keys != SandboxKeys::default() {
            return Err(self.error(
                "the sandbox keys (`sandbox`, `network`, `limits`, `home`, `read_only`, \
                 `writable`) bound programs run on this machine; a gateway's kernels run where \
                 the gateway runs them, under its limits",
            ));
        }
        let spec = ToolSpec::new(
            &self.name,
            self.description_or(
                "Run Python code and see its output; variables, imports and files persist from \
                 call to call, and the value of a last expression is shown",
            ),
        )
        .parameters(self.parameters_or(program::PythonTool::parameters()));
        let tool = remote::tool(self, settings, spec, timeout)?;
        Ok(tool.timeout(timeout + PROGRAM_MARGIN))
    }

    /// `command`: the program runs in `base` as the table changes it; the table must name it.
    fn command_tool(
        &self,
        settings: &CommandSettings,
        base: &Sandbox,
        timeout: Duration,
    ) -> Result<Tool, SettingError> {
        let argv = settings.command.clone();
        if argv.first().is_none_or(|program| program.trim().is_empty()) {
            return Err(
                self.error("kind \"command\" needs `command = [\"program\", \"arg\", ...]`")
            );
        }
        let command = program::CommandTool {
            argv,
            sandbox: settings.keys.apply(base.clone()),
            timeout,
            max_output: settings.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT),
        };
        Ok(Tool::new_async(
            ToolSpec::new(&self.name, self.description_or("Run a command"))
                .parameters(self.parameters_or(open_parameters())),
            move |args| command.clone().call(args),
        )
        .timeout(timeout + PROGRAM_MARGIN))
    }

    /// `http`: the table's `url`, which must be an http or https one.
    fn http_url(&self, settings: &HttpSettings) -> Result<String, SettingError> {
        let url = &settings.url;
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(self.error(format!("url '{url}' must start with http:// or https://")));
        }
        Ok(url.clone())
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

    /// The tool cannot be built: `reason`, said of this tool.
    fn error(&self, reason: impl std::fmt::Display) -> SettingError {
        SettingError::new(format!("tool '{}': {reason}", self.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml_like: Value) -> ToolConfig {
        serde_json::from_value(toml_like).expect("a tool table")
    }

    fn refused(toml_like: Value) -> String {
        match serde_json::from_value::<ToolConfig>(toml_like) {
            Ok(config) => panic!("read: {config:?}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn a_config_says_which_tool_and_which_field_is_wrong() {
        assert_eq!(
            refused(json!({"name": "lookup", "kind": "command"})),
            "tool 'lookup': kind \"command\" needs `command`"
        );
        let empty = config(json!({"name": "lookup", "kind": "command", "command": []}))
            .build()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            empty.as_deref(),
            Some("tool 'lookup': kind \"command\" needs `command = [\"program\", \"arg\", ...]`")
        );
        assert_eq!(
            refused(json!({"name": "calc", "kind": "calculator", "url": "http://x"})),
            "tool 'calc': `url` is not a field of kind \"calculator\" (it takes no key of its own)"
        );
        assert_eq!(
            refused(json!({"name": "c", "kind": "http", "url": "http://x", "network": true})),
            "tool 'c': `network` is not a field of kind \"http\" (it takes url, max_output_bytes)"
        );
        assert_eq!(
            refused(json!({"name": "c", "kind": "shell"})),
            "tool 'c': kind: unknown kind 'shell'; expected command, http, python or calculator"
        );
        assert_eq!(
            refused(json!({"name": "py", "kind": "python", "limits": {"memory_mb": 1}})),
            "tool 'py': limits.memory_mb: unknown field `memory_mb`, expected one of `memory_mib`, \
             `cpu_seconds`, `processes`, `file_size_mib`, `open_files`, `tmp_mib`"
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
    fn each_kind_reads_the_keys_it_lists_and_writes_them_back() {
        for (kind, table) in [
            (
                "command",
                json!({"command": ["./a"], "max_output_bytes": 1, "sandbox": "none", "network": true, "limits": {"processes": 2}, "home": [".cache/uv"], "read_only": ["/data"], "writable": ["/scratch"]}),
            ),
            (
                "python",
                json!({"interpreter": "python3.11", "max_output_bytes": 1, "session": "rollout", "warm": 2, "gateway": "http://gw", "gateway_token_env": "T", "kernel": "python3", "lease_dir": "/leases", "sandbox": "bwrap", "network": false, "limits": {"processes": 2}, "home": [], "read_only": [], "writable": []}),
            ),
            ("http", json!({"url": "http://x", "max_output_bytes": 1})),
            ("calculator", json!({})),
        ] {
            let mut full = json!({"name": "t", "kind": kind, "description": "d", "timeout": "1s"});
            for (key, value) in table.as_object().expect("a table") {
                full[key] = value.clone();
            }
            let read = config(full.clone());
            let written = serde_json::to_value(&read).expect("written");
            let keys = |table: &Value| {
                let mut keys: Vec<String> = table
                    .as_object()
                    .expect("a table")
                    .keys()
                    .cloned()
                    .collect();
                keys.sort_unstable();
                keys
            };
            assert_eq!(
                keys(&written),
                keys(&full),
                "{kind}: every key written back"
            );
            assert_eq!(
                config(written),
                read,
                "{kind}: what is written reads the same"
            );
            let mut listed = ToolKind::fields_of(kind).expect("a kind");
            listed.sort_unstable();
            let mut given: Vec<&str> = table
                .as_object()
                .expect("a table")
                .keys()
                .map(String::as_str)
                .collect();
            given.sort_unstable();
            assert_eq!(listed, given, "{kind}: the keys listed are the keys read");
        }
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
