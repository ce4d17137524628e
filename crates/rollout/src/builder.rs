//! [`EngineBuilder`]: what a loop runs with, and the start: the dataset reader thread and
//! the wait for a server.

use std::{fmt, sync::Arc};

use rollout_core::{
    ChatTokenizer, RenderOptions, ToolCallParser,
    parse::{HermesParser, detect_parser},
};
use scoring::Scorer;
use tokio::sync::mpsc;
use tool_dispatch::ToolDispatcher;

use crate::{
    Agent, DatasetError, DatasetRow, Environment, Generator,
    admission::admit,
    config::RolloutConfig,
    engine::{Engine, EngineError, Groups},
    shared::{Control, ReadRow, Shared, Tallies, Wiring},
};

/// Builds an [`Engine`]; see [`Engine::builder`].
pub struct EngineBuilder<G> {
    pub(crate) generator: G,
    pub(crate) tokenizer: ChatTokenizer,
    pub(crate) scorer: Scorer,
    pub(crate) tools: Option<ToolDispatcher>,
    pub(crate) environment: Option<Arc<dyn Environment>>,
    pub(crate) agent: Option<Arc<dyn Agent>>,
    pub(crate) parser: Option<Box<dyn ToolCallParser>>,
    pub(crate) options: RenderOptions,
    pub(crate) config: RolloutConfig,
}

impl<G> fmt::Debug for EngineBuilder<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<G: Generator> Engine<G> {
    /// An engine sampling with `generator`, rendering with `tokenizer`'s chat template and
    /// scoring with `scorer`.
    pub fn builder(generator: G, tokenizer: ChatTokenizer, scorer: Scorer) -> EngineBuilder<G> {
        EngineBuilder {
            generator,
            tokenizer,
            scorer,
            tools: None,
            environment: None,
            agent: None,
            parser: None,
            options: RenderOptions::generation(),
            config: RolloutConfig::default(),
        }
    }
}

impl<G: Generator> EngineBuilder<G> {
    /// Runs the model's tool calls with `tools`; their specs are rendered into the prompt.
    #[must_use]
    pub fn tools(mut self, tools: ToolDispatcher) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Runs each rollout in an episode of `environment`: the episode's tools are the
    /// rollout's (instead of those of [`EngineBuilder::tools`]), a tool may end it, and its
    /// verdict is the completion's `rollout_reward` (add `scoring::builtin::environment()`
    /// to the scorer for the `env` column). See [`Environment`].
    #[must_use]
    pub fn environment(mut self, environment: Arc<dyn Environment>) -> Self {
        self.environment = Some(environment);
        self
    }

    /// Runs each rollout's conversation with `agent`, a loop-owning agent that samples every
    /// turn through the engine (see [`Agent`]); the engine's tools are then not used by the
    /// loop. With an [`EngineBuilder::environment`] too, each attempt's episode is opened
    /// before the agent runs (its tools are not the agent's) and its verify judges the
    /// agent's transcript.
    #[must_use]
    pub fn agent(mut self, agent: Arc<dyn Agent>) -> Self {
        self.agent = Some(agent);
        self
    }

    /// Parses tool calls with `parser` (default: the one the chat template's format
    /// suggests, else hermes).
    #[must_use]
    pub fn parser(mut self, parser: Box<dyn ToolCallParser>) -> Self {
        self.parser = Some(parser);
        self
    }

    /// Renders with `options` (chat template name, template kwargs); the tools' specs are
    /// added to them.
    #[must_use]
    pub fn render_options(mut self, options: RenderOptions) -> Self {
        self.options = options;
        self
    }

    /// The loop's settings.
    #[must_use]
    pub fn config(mut self, config: RolloutConfig) -> Self {
        self.config = config;
        self
    }

    /// Starts the loop on the current tokio runtime, reading groups from `rows` on a thread
    /// of its own, and returns it with its output.
    ///
    /// # Panics
    /// Outside a tokio runtime (it spawns its tasks there).
    pub fn start<I>(self, rows: I) -> Result<(Engine<G>, Groups), EngineError>
    where
        I: IntoIterator<Item = Result<DatasetRow, DatasetError>>,
        I::IntoIter: Send + 'static,
    {
        let mut next_id = 0u64;
        self.start_with_ids(rows.into_iter().map(move |row| {
            let id = next_id;
            next_id += 1;
            row.map(|row| (id, row))
        }))
    }

    /// As [`EngineBuilder::start`], each row with the id its group takes (its rollouts are
    /// `id * num_generations + i`, and request seeds derive from those): a program that skips
    /// rows (a resumed run, one shard of a dataset) keeps every group's id, and seeds, as in a
    /// run over every row. Ids must be distinct.
    ///
    /// # Panics
    /// Outside a tokio runtime (it spawns its tasks there).
    pub fn start_with_ids<I>(self, rows: I) -> Result<(Engine<G>, Groups), EngineError>
    where
        I: IntoIterator<Item = Result<(u64, DatasetRow), DatasetError>>,
        I::IntoIter: Send + 'static,
    {
        let config = self.config;
        config.validate()?;
        let mut options = self.options;
        options.add_generation_prompt = true;
        if let Some(tools) = &self.tools
            && !tools.registry().is_empty()
        {
            options.tools = Some(tools.registry().to_openai());
        }
        let template = self.tokenizer.template(&options)?;
        let template_name = template.name().to_owned();
        let parser = self.parser.unwrap_or_else(|| {
            detect_parser(template.source()).unwrap_or_else(|| Box::new(HermesParser))
        });
        let max_model_len = config.max_model_len.or(self.generator.max_model_len());
        // A template may refuse an empty conversation; groups then render from nothing.
        let base = self
            .tokenizer
            .incremental(options.clone())
            .ok()
            .and_then(|mut render| {
                render.conversation().ok()?;
                Some(render.state())
            });
        let max_token_bytes = self
            .tokenizer
            .tokenizer()
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        let groups_in_flight = config.max_inflight.div_ceil(config.num_generations) + 1;
        let (output, groups) = mpsc::channel(groups_in_flight + config.output_buffer.max(1));
        let shared = Arc::new(Shared {
            wiring: Wiring {
                generator: self.generator,
                tokenizer: self.tokenizer,
                options,
                parser,
                tools: self.tools,
                environment: self.environment,
                agent: self.agent,
                scorer: self.scorer,
                max_model_len,
                base,
                max_token_bytes,
                template_name,
            },
            control: Control::new(config.max_inflight),
            tallies: Tallies::default(),
            config,
        });
        let rows =
            spawn_reader(rows.into_iter(), Arc::clone(&shared)).map_err(EngineError::Thread)?;
        let heartbeat = Arc::clone(&shared);
        tokio::spawn(async move {
            let stop = heartbeat.control.stop_heartbeat.clone();
            let config = &heartbeat.config;
            heartbeat
                .tallies
                .heartbeat
                .run(config.heartbeat, config.lag_warning, stop)
                .await;
        });
        shared
            .control
            .tracker
            .spawn(admit(Arc::clone(&shared), rows, output));
        Ok((Engine { shared }, Groups { receiver: groups }))
    }
}

/// Reads rows on a thread of its own (files block), a few rows ahead of admission, and
/// renders each prompt there: tokenizing is CPU work that must not hold a runtime thread.
pub(crate) fn spawn_reader<I, G>(
    rows: I,
    shared: Arc<Shared<G>>,
) -> std::io::Result<mpsc::Receiver<ReadRow>>
where
    I: Iterator<Item = Result<(u64, DatasetRow), DatasetError>> + Send + 'static,
    G: Generator,
{
    let (sender, receiver) = mpsc::channel(64);
    std::thread::Builder::new()
        .name("rollout-dataset".to_owned())
        .spawn(move || {
            for row in rows {
                let read = row.and_then(|(id, row)| {
                    shared
                        .wiring
                        .check_prompt_size(&row)
                        .map_err(|reason| DatasetError::Row {
                            path: row.source.to_string(),
                            line: row.line,
                            reason,
                        })?;
                    let prompt = shared.wiring.render_prompt(&row);
                    Ok((id, row, prompt))
                });
                if sender.blocking_send(read).is_err() {
                    break;
                }
            }
        })?;
    Ok(receiver)
}
