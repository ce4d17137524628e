//! `python` with `gateway`: each rollout's session on a kernel of a Jupyter gateway (feature
//! `kernels`, through the `async-grpo-kernels` crate).
//!
//! A rollout's first call starts its kernel, which the rollout's next calls share; the kernel
//! is deleted when the rollout ends in any way (its dispatcher dropped). Before its first
//! kernel, the tool deletes those that engines killed earlier left, from their lease files.
//! A kernel that cannot be started (the gateway down, refusing, too slow) is not the model's
//! doing: the call is [`Unavailable`](crate::Unavailable), and the engine fails the rollout.
//! A call that kills its kernel, or outlasts its timeout, is a tool error, and the next call
//! starts a new kernel, saying so.

use std::time::Duration;

use settings::SettingError;

use super::{PythonSettings, ToolConfig};
use crate::tool::{Tool, ToolSpec};

#[cfg(not(feature = "kernels"))]
pub(super) fn tool(
    config: &ToolConfig,
    _: &PythonSettings,
    _: ToolSpec,
    _: Duration,
) -> Result<Tool, SettingError> {
    Err(config
        .error("`gateway`: this build has no remote kernels (tool-dispatch's feature `kernels`)"))
}

#[cfg(feature = "kernels")]
pub(super) use self::on_gateway::tool;

#[cfg(feature = "kernels")]
mod on_gateway {
    use std::path::PathBuf;

    use ::kernels::{Gateway, Kernel, KernelError};
    use futures::future::BoxFuture;
    use serde_json::Value;
    use tokio::time::Instant;

    use super::*;
    use crate::{
        Unavailable,
        sync::{Arc, AtomicU64, Ordering},
        tool::{Arguments, AsyncTool, RolloutTool, ToolError},
    };

    /// The tool of a `python` table with `gateway`.
    pub(in crate::builtin) fn tool(
        config: &ToolConfig,
        settings: &PythonSettings,
        spec: ToolSpec,
        timeout: Duration,
    ) -> Result<Tool, SettingError> {
        let url = settings.gateway.as_deref().unwrap_or_default();
        let token = match &settings.gateway_token_env {
            Some(variable) => Some(std::env::var(variable).map_err(|_| {
                config.error(format!(
                    "`gateway_token_env`: the environment variable {variable} is not set (it \
                     holds the gateway's token)"
                ))
            })?),
            None => None,
        };
        let gateway =
            Gateway::new(url, token).map_err(|e| config.error(format!("`gateway`: {e}")))?;
        let leases = match &settings.lease_dir {
            Some(dir) => dir.clone(),
            None => default_lease_dir().ok_or_else(|| {
                config.error(
                    "`lease_dir`: neither XDG_STATE_HOME nor HOME is set, so there is no \
                     default folder for the kernels' leases: name one",
                )
            })?,
        };
        let folder = leases.join(folder_of(gateway.url()));
        let gateway = gateway.with_lease_dir(folder);
        Ok(Tool::per_rollout(
            spec,
            PythonKernels {
                gateway,
                kernel: settings.kernel.clone(),
                timeout,
                max_output: settings
                    .max_output_bytes
                    .unwrap_or(super::super::DEFAULT_MAX_OUTPUT),
                reaped: Arc::new(tokio::sync::OnceCell::new()),
                lost: Arc::default(),
            },
        ))
    }

    /// `$XDG_STATE_HOME/async-grpo/kernel-leases`, else `~/.local/state/...`.
    fn default_lease_dir() -> Option<PathBuf> {
        let set = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        set("XDG_STATE_HOME")
            .or_else(|| set("HOME").map(|home| home.join(".local").join("state")))
            .map(|state| state.join("async-grpo").join("kernel-leases"))
    }

    /// The lease folder of one gateway: its URL as a file name (the leases hold kernel ids
    /// only, which mean something on their own gateway alone).
    fn folder_of(url: &str) -> String {
        let name: String = url
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        name.trim_matches('_').chars().take(200).collect()
    }

    /// Every rollout's session, on `gateway`.
    #[derive(Debug, Clone)]
    struct PythonKernels {
        gateway: Gateway,
        kernel: Option<String>,
        timeout: Duration,
        max_output: usize,
        /// Earlier runs' kernels deleted, once, before this run's first.
        reaped: Arc<tokio::sync::OnceCell<()>>,
        /// Sessions whose kernel was lost part-way.
        lost: Arc<AtomicU64>,
    }

    impl RolloutTool for PythonKernels {
        fn open(&self) -> Arc<dyn AsyncTool> {
            Arc::new(KernelSession {
                tools: self.clone(),
                slot: Arc::new(tokio::sync::Mutex::new(Slot::default())),
            })
        }

        fn settle(&self) -> BoxFuture<'static, ()> {
            let gateway = self.gateway.clone();
            Box::pin(async move { gateway.settle().await })
        }

        fn sessions_lost(&self) -> u64 {
            self.lost.load(Ordering::Relaxed)
        }
    }

    /// One rollout's session.
    struct KernelSession {
        tools: PythonKernels,
        slot: Arc<tokio::sync::Mutex<Slot>>,
    }

    /// A session's kernel, and why the last one was lost when it was.
    #[derive(Default)]
    struct Slot {
        kernel: Option<Kernel>,
        lost: Option<String>,
    }

    impl PythonKernels {
        /// A kernel for a session, after the kernels earlier runs left are deleted.
        async fn start(&self) -> Result<Kernel, KernelError> {
            let gateway = self.gateway.clone();
            self.reaped.get_or_init(move || reap(gateway)).await;
            self.gateway.start(self.kernel.as_deref()).await
        }
    }

    /// Deletes the kernels that engines killed earlier left.
    async fn reap(gateway: Gateway) {
        match gateway.reap_leases().await {
            Ok(0) => {}
            Ok(reaped) => tracing::info!(
                gateway = gateway.url(),
                reaped,
                "deleted the kernels that runs killed earlier left"
            ),
            Err(error) => {
                tracing::warn!(
                    "could not delete the kernels that runs killed earlier left: {error}"
                )
            }
        }
    }

    impl AsyncTool for KernelSession {
        fn call(&self, args: Arguments) -> BoxFuture<'static, Result<Value, ToolError>> {
            let (tools, slot) = (self.tools.clone(), Arc::clone(&self.slot));
            Box::pin(async move {
                let code = super::super::program::code(&args)?.to_owned();
                let deadline = Instant::now() + tools.timeout;
                let timeout = crate::call::human(tools.timeout);
                // One cell at a time; a call dropped part-way drops its kernel, deleted.
                let mut slot = slot.lock().await;
                let mut note = String::new();
                let mut kernel = match slot.kernel.take() {
                    Some(kernel) => kernel,
                    None => {
                        let started = tokio::time::timeout_at(deadline, tools.start()).await;
                        let kernel = match started {
                            Ok(Ok(kernel)) => kernel,
                            Ok(Err(error)) => {
                                return Err(Unavailable(format!("no kernel: {error}")).into());
                            }
                            Err(_) => {
                                return Err(Unavailable(format!(
                                    "no kernel: the Jupyter gateway at {} did not start one \
                                     within the tool's timeout ({timeout})",
                                    tools.gateway.url()
                                ))
                                .into());
                            }
                        };
                        if let Some(why) = slot.lost.take() {
                            note = format!(
                                "[a new Python kernel: {why}, and what earlier calls defined \
                                 is gone]\n"
                            );
                        }
                        kernel
                    }
                };
                slot.lost = Some("the previous call did not finish".to_owned());
                match tokio::time::timeout_at(deadline, kernel.execute(&code, tools.max_output))
                    .await
                {
                    Ok(Ok(cell)) => {
                        slot.kernel = Some(kernel);
                        slot.lost = None;
                        Ok(Value::String(
                            format!("{note}{}", cell.output)
                                .trim_end_matches('\n')
                                .to_owned(),
                        ))
                    }
                    Ok(Err(error)) => {
                        tools.lost.fetch_add(1, Ordering::Relaxed);
                        slot.lost = Some("the previous call lost its kernel".to_owned());
                        let why = match &error {
                            KernelError::Lost { why, .. } => format!("the kernel is lost: {why}"),
                            other => other.to_string(),
                        };
                        Err(format!(
                            "{why}; the session's state is gone, and the next call starts a new \
                             kernel"
                        )
                        .into())
                    }
                    Err(_) => {
                        tools.lost.fetch_add(1, Ordering::Relaxed);
                        slot.lost = Some(format!("the previous call timed out after {timeout}"));
                        Err(format!(
                            "timed out after {timeout}: the kernel was deleted and the \
                             session's state is lost; the next call starts a new kernel"
                        )
                        .into())
                    }
                }
            })
        }
    }

    /// On a real Jupyter Kernel Gateway (the fixture cache's venv: `cargo xtask fixtures`;
    /// the binary's tests run whole runs on it).
    #[cfg(test)]
    mod real_gateway {
        use serde_json::json;
        use test_support::{
            ScratchDir,
            jupyter::{JupyterGateway, TOKEN},
            within,
        };

        use super::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_lost_kernel_is_said_counted_and_replaced_and_no_kernel_outlives_its_session() {
            let process = JupyterGateway::start("tool-dispatch-kernels", &[]);
            let leases = ScratchDir::new("tool-dispatch-kernel-leases");
            let gateway = Gateway::new(&process.url, Some(TOKEN.to_owned()))
                .expect("a gateway")
                .with_lease_dir(leases.join("gateway"));
            let tools = PythonKernels {
                gateway,
                kernel: None,
                timeout: Duration::from_secs(20),
                max_output: 4096,
                reaped: Arc::new(tokio::sync::OnceCell::new()),
                lost: Arc::default(),
            };
            let session = tools.open();
            let call = |code: &str| {
                let args = json!({ "code": code });
                within(
                    Duration::from_secs(60),
                    "a call",
                    session.call(Arguments::new(
                        args.as_object().cloned().unwrap_or_default(),
                    )),
                )
            };
            assert_eq!(call("x = 1\nx + 1").await.ok(), Some(json!("2")));
            let died = call("import os; os._exit(1)")
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                died.starts_with("the kernel is lost: ")
                    && died.ends_with(
                        "; the session's state is gone, and the next call starts a new kernel"
                    ),
                "{died}"
            );
            assert_eq!(tools.sessions_lost(), 1);
            assert_eq!(
                call("'x' in globals()").await.ok(),
                Some(json!(
                    "[a new Python kernel: the previous call lost its kernel, and what earlier \
                     calls defined is gone]\nFalse"
                ))
            );
            // The lost kernel is deleted in the background; once settled, only the new one.
            within(Duration::from_secs(60), "settling", tools.settle()).await;
            assert_eq!(process.kernels().len(), 1);
            drop(session);
            within(Duration::from_secs(60), "settling", tools.settle()).await;
            assert_eq!(process.kernels(), Vec::<String>::new());
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_gateways_lease_folder_is_named_by_its_url() {
            assert_eq!(folder_of("http://127.0.0.1:8888"), "127.0.0.1_8888");
            assert_eq!(
                folder_of("https://kernels.internal/team/gw"),
                "kernels.internal_team_gw"
            );
            assert_ne!(
                folder_of("http://127.0.0.1:8888"),
                folder_of("http://127.0.0.1:8889")
            );
        }
    }
}
