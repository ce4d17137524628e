//! [`RunSpec`]: the engine of one run, wired once: the client of the servers (waited for,
//! then health-checked), the tool pool sized by one rule, the environment's sessions on that
//! pool, the recording proxy a loop-owning agent talks to, the scorer and the loop.
//!
//! [`RunSpec::check`] finds every error that needs no server; [`RunSpec::connect`] waits for
//! the servers; [`Connected::start`] starts the loop on the run's rows. An adapter (the
//! binary, the TRL bridge) builds the spec from its own inputs and does the rest: parsing
//! and printing, or Python objects.

use std::{sync::Arc, time::Duration};

use files::data::Items;
use harness::proxy::{Proxy, ProxyConfig};
use rollout::{Agent, Engine, EngineError, Environment, Groups, RolloutConfig};
use rollout_core::{ChatTokenizer, parse::ToolCallParser};
use scoring::{Reward, Scorer, ScorerConfig, ScorerError};
use tokio::task::JoinHandle;
use tool_dispatch::{DispatcherConfig, Registry, ToolDispatcher};
use vllm_client::{Client, ClientConfig};

/// The name the proxy answers as when the run names no model.
pub const DEFAULT_MODEL_NAME: &str = "async-grpo";

/// The most threads the tool pool gets by default, whatever `max_inflight` is.
pub const MAX_DEFAULT_TOOL_THREADS: usize = 512;

/// How often the client probes a server that failed.
const HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// Builds a run's environment on the run's tool pool (its sessions' calls run there).
pub type EnvironmentFactory = Box<dyn FnOnce(ToolDispatcher) -> Arc<dyn Environment> + Send>;

/// Builds a run's loop-owning agent on the proxy it talks to.
pub type AgentFactory = Box<dyn FnOnce(Arc<Proxy>) -> Result<Arc<dyn Agent>, String> + Send>;

/// The servers a run samples from.
#[derive(Debug, Clone, Default)]
pub struct Servers {
    /// Base URLs, one per replica.
    pub urls: Vec<String>,
    /// The model they serve (default: the first one they list), which the proxy answers as.
    pub model: Option<String>,
    /// Certificates to trust besides the system's (PEM), for `https://` servers.
    pub root_certificates_pem: Option<Vec<u8>>,
}

/// The pool sync tools (and environment sessions) run on.
#[derive(Debug, Clone, Default)]
pub struct ToolPool {
    /// Its threads; default: one per rollout in flight (every rollout may be in a tool
    /// call), at most [`MAX_DEFAULT_TOOL_THREADS`]. Started on demand.
    pub threads: Option<usize>,
    /// How long a call may take when its tool sets no timeout of its own.
    pub timeout: Option<Duration>,
    /// The name of its threads.
    pub thread_name: Option<String>,
}

impl ToolPool {
    /// The pool's threads for a loop of `max_inflight` rollouts in flight.
    pub fn threads_for(&self, max_inflight: usize) -> usize {
        self.threads
            .unwrap_or_else(|| max_inflight.clamp(1, MAX_DEFAULT_TOOL_THREADS))
    }
}

/// A run that cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// No server to sample from.
    #[error("servers: give at least one server URL")]
    NoServer,
    /// A tool pool of no thread.
    #[error("tool_threads: must be at least 1")]
    NoToolThreads,
    /// The rewards cannot be scored together (two of one name, an empty name).
    #[error("rewards: {0}")]
    Rewards(#[from] ScorerError),
    /// The client cannot be made from the servers' settings.
    #[error("servers: {0}")]
    Client(vllm_client::Error),
    /// The servers did not become ready in time.
    #[error("the servers are not ready (server_wait {wait:?}): {source}")]
    NotReady {
        /// How long the run waited.
        wait: Duration,
        /// What the last try found.
        source: vllm_client::Error,
    },
    /// The proxy a loop-owning agent talks to could not start.
    #[error("the agents' proxy: {0}")]
    Proxy(String),
    /// The agent could not be built on its proxy.
    #[error("{0}")]
    Agent(String),
    /// The loop could not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One run's engine, before it starts.
pub struct RunSpec {
    config: RolloutConfig,
    tokenizer: ChatTokenizer,
    servers: Servers,
    tools: Registry,
    tool_pool: ToolPool,
    rewards: Vec<Reward>,
    scorer: ScorerConfig,
    environment: Option<EnvironmentFactory>,
    agent: Option<AgentFactory>,
    parser: Option<Box<dyn ToolCallParser>>,
}

impl std::fmt::Debug for RunSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunSpec")
            .field("config", &self.config)
            .field("servers", &self.servers.urls)
            .field("model", &self.servers.model)
            .field("tools", &self.tools.len())
            .field("tool_pool", &self.tool_pool)
            .field("rewards", &self.rewards.len())
            .field("environment", &self.environment.is_some())
            .field("agent", &self.agent.is_some())
            .field("parser", &self.parser)
            .finish_non_exhaustive()
    }
}

impl RunSpec {
    /// A run of the loop settings `config`, rendering with `tokenizer`, sampling from
    /// `servers`; no tools, rewards, environment or agent yet.
    pub fn new(config: RolloutConfig, tokenizer: ChatTokenizer, servers: Servers) -> RunSpec {
        RunSpec {
            config,
            tokenizer,
            servers,
            tools: Registry::new(),
            tool_pool: ToolPool::default(),
            rewards: Vec::new(),
            scorer: ScorerConfig::default(),
            environment: None,
            agent: None,
            parser: None,
        }
    }

    /// The tools every rollout may call.
    pub fn tools(mut self, tools: Registry) -> RunSpec {
        self.tools = tools;
        self
    }

    /// The pool sync tools and environment sessions run on.
    pub fn tool_pool(mut self, pool: ToolPool) -> RunSpec {
        self.tool_pool = pool;
        self
    }

    /// The reward functions, in column order.
    pub fn rewards(mut self, rewards: Vec<Reward>) -> RunSpec {
        self.rewards = rewards;
        self
    }

    /// The scorer's own settings (its threads).
    pub fn scorer(mut self, config: ScorerConfig) -> RunSpec {
        self.scorer = config;
        self
    }

    /// The environment every rollout runs in, built on the run's tool pool.
    pub fn environment(mut self, factory: EnvironmentFactory) -> RunSpec {
        self.environment = Some(factory);
        self
    }

    /// The loop-owning agent that runs every rollout, built on the run's proxy.
    pub fn agent(mut self, factory: AgentFactory) -> RunSpec {
        self.agent = Some(factory);
        self
    }

    /// The tool-call format (default: detected from the chat template).
    pub fn parser(mut self, parser: Box<dyn ToolCallParser>) -> RunSpec {
        self.parser = Some(parser);
        self
    }

    /// The loop's settings.
    pub fn config(&self) -> &RolloutConfig {
        &self.config
    }

    /// The loop's settings, to change (a resumed run's `max_groups`).
    pub fn config_mut(&mut self) -> &mut RolloutConfig {
        &mut self.config
    }

    /// The servers.
    pub fn servers_mut(&mut self) -> &mut Servers {
        &mut self.servers
    }

    /// How many tools the rollouts may call (an environment's aside).
    pub fn tool_count(&self) -> usize {
        self.tools.len()
    }

    /// The threads of the tool pool this run starts.
    pub fn tool_threads(&self) -> usize {
        self.tool_pool.threads_for(self.config.max_inflight)
    }

    /// Every check that needs no server: a server to ask, a tool pool of some thread,
    /// rewards that can be scored together, settings the loop accepts.
    ///
    /// # Errors
    ///
    /// The first of those that fails.
    pub fn check(&self) -> Result<(), SpecError> {
        if self.servers.urls.is_empty() {
            return Err(SpecError::NoServer);
        }
        if self.tool_pool.threads == Some(0) {
            return Err(SpecError::NoToolThreads);
        }
        self.config
            .validate()
            .map_err(|e| SpecError::Engine(e.into()))?;
        Scorer::check(&self.rewards)?;
        Ok(())
    }

    /// Checks the spec, then waits for the servers (up to `server_wait`) and probes a server
    /// that fails from then on, so that a run paused for want of one resumes when it answers.
    ///
    /// # Errors
    ///
    /// What [`RunSpec::check`] finds, a client that cannot be made, or servers that are not
    /// ready in time.
    pub async fn connect(self) -> Result<Connected, SpecError> {
        self.check()?;
        let mut config = ClientConfig::with_servers(self.servers.urls.clone());
        if let Some(model) = &self.servers.model {
            config = config.model(model.clone());
        }
        if let Some(pem) = &self.servers.root_certificates_pem {
            config = config.root_certificates_pem(pem.clone());
        }
        let client = Client::new(config).map_err(SpecError::Client)?;
        let wait = self.config.server_wait;
        tracing::info!(servers = ?self.servers.urls, ?wait, "waiting for the servers to be ready");
        let card = client
            .wait_until_ready(wait)
            .await
            .map_err(|source| SpecError::NotReady { wait, source })?;
        tracing::info!(model = %card.id, max_model_len = ?client.max_model_len(), "servers ready");
        let health_checks = HealthChecks(client.spawn_health_checks(HEALTH_CHECK_INTERVAL));
        Ok(Connected {
            spec: self,
            client,
            health_checks,
        })
    }
}

/// A run whose servers answered.
#[derive(Debug)]
pub struct Connected {
    spec: RunSpec,
    client: Client,
    health_checks: HealthChecks,
}

/// A running loop and what it was started with.
#[derive(Debug)]
pub struct Running {
    /// The loop.
    pub engine: Arc<Engine<Client>>,
    /// Its scored groups, in the order they complete.
    pub groups: Groups,
    /// The client, for its retry counters.
    pub client: Client,
    /// The servers' health checks: they stop when this is dropped.
    pub health_checks: HealthChecks,
}

/// The client's health checks of its servers, stopped when dropped.
#[derive(Debug)]
pub struct HealthChecks(JoinHandle<()>);

impl Drop for HealthChecks {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Connected {
    /// The client of the servers.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Starts the loop on `items`: the scorer, the tool pool (when the run has tools or an
    /// environment), the environment on it, the proxy and the agent on it, the parser.
    ///
    /// # Errors
    ///
    /// The scorer, the proxy, the agent or the loop cannot start.
    pub async fn start(self, items: Items) -> Result<Running, SpecError> {
        let Connected {
            spec,
            client,
            health_checks,
        } = self;
        let tool_threads = spec.tool_threads();
        let RunSpec {
            config,
            tokenizer,
            servers,
            tools,
            tool_pool,
            rewards,
            scorer,
            environment,
            agent,
            parser,
        } = spec;
        let proxy_tokenizer = agent.is_some().then(|| tokenizer.clone());
        let scorer = Scorer::new(rewards, scorer)?;
        let mut builder = Engine::builder(client.clone(), tokenizer, scorer).config(config);
        if !tools.is_empty() || environment.is_some() {
            let mut pool = DispatcherConfig::new(tool_threads);
            if let Some(timeout) = tool_pool.timeout {
                pool = pool.default_timeout(timeout);
            }
            if let Some(name) = tool_pool.thread_name {
                pool = pool.thread_name(name);
            }
            let dispatcher = ToolDispatcher::new(tools, pool);
            if let Some(environment) = environment {
                // Its sessions' calls run on the same pool, and stop with it.
                builder = builder.environment(environment(dispatcher.clone()));
            }
            builder = builder.tools(dispatcher);
        }
        if let (Some(agent), Some(tokenizer)) = (agent, proxy_tokenizer) {
            // One proxy for the run's rollouts, each with a key of its own; it stops when the
            // loop (the agent's last holder) is dropped.
            let model = servers
                .model
                .unwrap_or_else(|| DEFAULT_MODEL_NAME.to_owned());
            let proxy = Proxy::start(tokenizer, ProxyConfig::new(model))
                .await
                .map_err(|e| SpecError::Proxy(e.to_string()))?;
            tracing::info!(url = %proxy.base_url(), "the agents' proxy is listening");
            builder = builder.agent(agent(Arc::new(proxy)).map_err(SpecError::Agent)?);
        }
        if let Some(parser) = parser {
            builder = builder.parser(parser);
        }
        let (engine, groups) = builder.start_with_ids(items)?;
        Ok(Running {
            engine: Arc::new(engine),
            groups,
            client,
            health_checks,
        })
    }
}
