//! One rollout's capture: the conversations an agent holds with the proxy, rendered with the
//! model's template, each answer's sampled ids kept in place of the agent's copy.
//!
//! An agent sends its whole history with every request, re-serialized its own way. When a
//! request is a conversation the proxy has seen (its messages up to the proxy's last answer,
//! that answer as the agent wrote it back: same content and calls up to JSON formatting) and
//! only adds messages after it (tool results, a user message), the next prompt is the
//! previous prompt, the ids sampled and the template's delta for what was added
//! ([`IncrementalRender::delta`]): the answer is never re-rendered from the agent's text, so
//! the conversation stays one training row (`capture_reused_turns`). Anything else (history
//! rewritten, other tools, a side request) is rendered whole, the proxy's own answers put
//! back where the agent's copies match them; the engine's reconciler then realigns or forks
//! (`forked_turns`).
//!
//! Nothing is kept of a request until its answer is: [`Capture::prompt`] only plans the
//! change (a [`Prompt`]), and [`Capture::answer`] applies it once a turn was sampled. A
//! request refused (a rollout limit, a sampling failure, a render error) leaves the capture
//! as it was. A rollout holds at most `max_conversations` conversations; a request that would
//! start one more is refused with a 400.

use rollout_api::{Finish, SampleRefused, Sampler};
use rollout_core::{
    ChatTokenizer, IncrementalRender, Message, RenderError, RenderOptions, RenderState,
    ToolCallParser, parse::split_reasoning,
};
use serde_json::Value;

use super::openai::{ApiError, FinishReason, Turn, same_answer, same_message};

/// What the proxy renders and parses with: the model's tokenizer and template, its tool-call
/// parser, its end-of-answer id.
#[derive(Debug)]
pub(crate) struct Model {
    pub(crate) name: String,
    pub(crate) tokenizer: ChatTokenizer,
    pub(crate) options: RenderOptions,
    pub(crate) parser: Box<dyn ToolCallParser>,
    /// Ids in the tokenizer's vocabulary (added tokens included): a prompt id must be below.
    pub(crate) vocab_size: u32,
}

impl Model {
    /// Sampled ids as text, a final end-of-answer id left out.
    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String, ApiError> {
        self.tokenizer
            .decode_answer(ids)
            .map_err(|e| ApiError::server(format!("cannot decode the sampled ids: {e}")))
    }

    fn render_options(&self, tools: Option<&Vec<Value>>) -> RenderOptions {
        let mut options = self.options.clone();
        options.add_generation_prompt = true;
        options.tools = tools.filter(|tools| !tools.is_empty()).cloned();
        options
    }
}

fn render_error(error: RenderError) -> ApiError {
    ApiError::invalid(
        format!(
            "the model's chat template cannot render the request: {}",
            error.chain()
        ),
        Some("messages"),
    )
}

/// The proxy's last answer in a conversation.
#[derive(Debug, Clone)]
struct Last {
    /// The prompt it answered and the ids sampled.
    ids: Vec<u32>,
    /// Its index in the conversation's messages.
    at: usize,
    /// The id it ended on.
    stop: Option<u32>,
}

/// One conversation of the agent with the model.
#[derive(Debug)]
struct Thread {
    /// As the proxy renders it: the agent's messages, the proxy's own answers.
    messages: Vec<Message>,
    /// Which of `messages` are the proxy's answers.
    produced: Vec<bool>,
    tools: Option<Vec<Value>>,
    /// The render after the last message.
    state: RenderState,
    /// The render of its first prompt (where deltas start from).
    first: RenderState,
    last: Option<Last>,
    answers: usize,
    /// When it was last answered (the capture's request count then).
    used: u64,
}

impl Thread {
    /// Where the messages `sent` continue this conversation after the proxy's last answer:
    /// the index of the first new message, when they do.
    fn continued_by(&self, sent: &[Message], tools: Option<&Vec<Value>>) -> Option<(usize, Last)> {
        let last = self.last.as_ref()?;
        let known = self.messages.len();
        let continues = self.tools.as_ref() == tools
            && last.at + 1 == known
            && sent.len() > known
            && sent[..known]
                .iter()
                .zip(self.messages.iter().zip(&self.produced))
                .all(|(sent, (known, &produced))| {
                    if produced {
                        same_answer(sent, known)
                    } else {
                        same_message(sent, known)
                    }
                })
            && sent[known..].iter().all(|m| m.role() != "assistant");
        continues.then(|| (known, last.clone()))
    }
}

/// How a prompt was made, counted once its turn is answered.
#[derive(Debug, Clone, Copy)]
enum Made {
    /// The previous prompt, the sampled ids and the template's delta.
    Reused,
    /// Rendered whole although it continues a conversation (no exact delta).
    Fallback,
    /// Rendered whole: a new conversation.
    Rendered,
}

/// What answering a prompt adds to the capture.
enum Change {
    /// `new` appended to conversation `index`, whose render after them (after the answer,
    /// once [`Capture::answer`] has it) is `state`.
    Continue {
        index: usize,
        new: Vec<Message>,
        state: RenderState,
    },
    /// A new conversation.
    Start(Box<Thread>),
}

/// What a request is sent as, and what its answer will add to the capture: nothing is kept
/// before [`Capture::answer`] applies it.
pub(crate) struct Prompt {
    change: Change,
    made: Made,
    pub(crate) ids: Vec<u32>,
}

/// What the capture counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Chat requests answered (limits included).
    pub requests: u64,
    /// Turns whose prompt continued the previous one with the sampled ids (the agent's copy
    /// of the answer not re-rendered).
    pub reused_turns: u64,
    /// Turns rendered whole: a new conversation, or history the agent changed.
    pub rendered_turns: u64,
    /// Turns that continued a conversation but whose template has no exact delta (rendered
    /// whole instead).
    pub delta_fallbacks: u64,
    /// Requests answered with `finish_reason: "length"` because a rollout limit was reached.
    pub limited: u64,
    /// Tool calls in the proxy's answers.
    pub tool_calls: u64,
    /// Conversations held (at most the proxy's `max_conversations`).
    pub conversations: u64,
}

/// One rollout's capture.
#[derive(Debug)]
pub(crate) struct Capture {
    pub(crate) sampler: Sampler,
    threads: Vec<Thread>,
    /// The most conversations kept.
    max_conversations: usize,
    pub(crate) stats: CaptureStats,
}

impl Capture {
    pub(crate) fn new(sampler: Sampler, max_conversations: usize) -> Capture {
        Capture {
            sampler,
            threads: Vec::new(),
            max_conversations,
            stats: CaptureStats::default(),
        }
    }

    /// The ids to send for `sent` with `tools`: the continuation of a known conversation, or
    /// a new one rendered whole (refused past `max_conversations`). Changes nothing but the
    /// request count: the answer applies the [`Prompt`].
    pub(crate) fn prompt(
        &mut self,
        model: &Model,
        sent: Vec<Message>,
        tools: Option<Vec<Value>>,
    ) -> Result<Prompt, ApiError> {
        self.stats.requests += 1;
        let continued = self
            .threads
            .iter()
            .enumerate()
            .rev()
            .find_map(|(index, thread)| {
                let (from, last) = thread.continued_by(&sent, tools.as_ref())?;
                Some((index, from, last))
            });
        if let Some((index, from, last)) = continued {
            return self.continue_thread(model, index, last, &sent[from..]);
        }
        self.start_thread(model, sent, tools)
    }

    /// The previous prompt, the sampled ids and the template's delta for `new`.
    fn continue_thread(
        &self,
        model: &Model,
        index: usize,
        last: Last,
        new: &[Message],
    ) -> Result<Prompt, ApiError> {
        let thread = &self.threads[index];
        let mut render = model
            .tokenizer
            .resume(thread.state.clone())
            .map_err(render_error)?;
        render.push(new);
        let delta = match last.stop {
            Some(stop) => render.delta(&thread.first, last.at, stop).ok(),
            None => None,
        };
        let (ids, made) = match delta {
            Some(delta) => {
                let mut ids = last.ids;
                ids.extend_from_slice(&delta);
                (ids, Made::Reused)
            }
            None => (whole(&mut render)?, Made::Fallback),
        };
        Ok(Prompt {
            change: Change::Continue {
                index,
                new: new.to_vec(),
                state: render.into_state(),
            },
            made,
            ids,
        })
    }

    /// A conversation rendered whole, the proxy's own answers in place of the agent's copies.
    fn start_thread(
        &self,
        model: &Model,
        sent: Vec<Message>,
        tools: Option<Vec<Value>>,
    ) -> Result<Prompt, ApiError> {
        if self.threads.len() >= self.max_conversations {
            return Err(ApiError::invalid(
                format!(
                    "this rollout already holds {} conversations, the proxy's max_conversations: \
                     continue one of them (its history with the proxy's answers as they were, \
                     then only new non-assistant messages) instead of starting another",
                    self.threads.len()
                ),
                Some("messages"),
            ));
        }
        let mut produced = Vec::with_capacity(sent.len());
        let messages: Vec<Message> = sent
            .into_iter()
            .map(|message| match self.own_answer(&message) {
                Some(own) => {
                    produced.push(true);
                    own
                }
                None => {
                    produced.push(false);
                    message
                }
            })
            .collect();
        let mut render = model
            .tokenizer
            .incremental(model.render_options(tools.as_ref()))
            .map_err(render_error)?;
        render.push(&messages);
        let ids = whole(&mut render)?;
        let state = render.into_state();
        Ok(Prompt {
            change: Change::Start(Box::new(Thread {
                messages,
                produced,
                tools,
                first: state.clone(),
                state,
                last: None,
                answers: 0,
                used: self.stats.requests,
            })),
            made: Made::Rendered,
            ids,
        })
    }

    /// The proxy's own earlier answer that `message` is a copy of.
    fn own_answer(&self, message: &Message) -> Option<Message> {
        if message.role() != "assistant" {
            return None;
        }
        self.threads.iter().rev().find_map(|thread| {
            thread
                .messages
                .iter()
                .zip(&thread.produced)
                .find(|(known, produced)| **produced && same_answer(message, known))
                .map(|(known, _)| known.clone())
        })
    }

    /// Samples the answer to `prompt` and adds it to its conversation.
    pub(crate) async fn answer(
        &mut self,
        model: &Model,
        prompt: Prompt,
        max_tokens: Option<u32>,
    ) -> Result<Turn, ApiError> {
        let prompt_tokens = prompt.ids.len();
        let conversation = match &prompt.change {
            Change::Continue { index, .. } => *index,
            Change::Start(_) => self.threads.len(),
        };
        let sampled = match self
            .sampler
            .sample_in(conversation, prompt.ids.clone(), max_tokens)
            .await
        {
            Ok(sampled) => sampled,
            Err(SampleRefused::Failed(message)) => return Err(ApiError::server(message)),
            Err(limit) => {
                self.stats.limited += 1;
                tracing::debug!(%limit, "a rollout limit ended the agent's turn");
                return Ok(Turn::limited(prompt_tokens));
            }
        };
        let text = model.decode(&sampled.token_ids)?;
        let (reasoning, rest) = split_reasoning(&text);
        let parsed = model.parser.parse(rest);
        let mut message = Message::assistant(parsed.content.clone());
        if let Some(reasoning) = reasoning {
            message = message.with("reasoning_content", Value::from(reasoning));
        }
        if !parsed.tool_calls.is_empty() {
            message = message.with_tool_calls(&parsed.tool_calls);
        }
        self.stats.tool_calls += parsed.tool_calls.len() as u64;
        let finish = match sampled.finish {
            Finish::Length | Finish::Abort => FinishReason::Length,
            Finish::Stop if parsed.tool_calls.is_empty() => FinishReason::Stop,
            Finish::Stop => FinishReason::ToolCalls,
        };
        self.record(model, prompt, &sampled.token_ids, message)?;
        Ok(Turn {
            content: parsed.content,
            reasoning: reasoning.map(str::to_owned),
            calls: parsed.tool_calls,
            finish,
            prompt_tokens,
            completion_tokens: sampled.token_ids.len(),
        })
    }

    /// Samples a raw completion of `ids` (`/v1/completions`): a turn of the rollout outside
    /// its chat conversations.
    pub(crate) async fn complete(
        &mut self,
        model: &Model,
        ids: Vec<u32>,
        max_tokens: Option<u32>,
    ) -> Result<Turn, ApiError> {
        self.stats.requests += 1;
        let prompt_tokens = ids.len();
        let sampled = match self.sampler.sample(ids, max_tokens).await {
            Ok(sampled) => sampled,
            Err(SampleRefused::Failed(message)) => return Err(ApiError::server(message)),
            Err(_) => {
                self.stats.limited += 1;
                return Ok(Turn::limited(prompt_tokens));
            }
        };
        let content = model.decode(&sampled.token_ids)?;
        Ok(Turn {
            content,
            reasoning: None,
            calls: Vec::new(),
            finish: match sampled.finish {
                Finish::Stop => FinishReason::Stop,
                Finish::Length | Finish::Abort => FinishReason::Length,
            },
            prompt_tokens,
            completion_tokens: sampled.token_ids.len(),
        })
    }

    /// Applies the prompt's change and adds the answer to its conversation: the next prompt
    /// may continue after its ids. Nothing is changed when it fails.
    fn record(
        &mut self,
        model: &Model,
        prompt: Prompt,
        sampled: &[u32],
        message: Message,
    ) -> Result<(), ApiError> {
        let used = self.stats.requests;
        let Prompt { change, made, ids } = prompt;
        // The prompt's render, moved (not copied) on to the answer's.
        let answered = |before: RenderState| -> Result<RenderState, ApiError> {
            let mut render = model.tokenizer.resume(before).map_err(render_error)?;
            render.push(std::slice::from_ref(&message));
            Ok(render.into_state())
        };
        let change = match change {
            Change::Continue { index, new, state } => Change::Continue {
                index,
                new,
                state: answered(state)?,
            },
            Change::Start(mut thread) => {
                thread.state = answered(thread.state)?;
                Change::Start(thread)
            }
        };
        let thread = self.apply(change, made);
        let mut ids = ids;
        ids.extend_from_slice(sampled);
        thread.messages.push(message);
        thread.produced.push(true);
        thread.last = Some(Last {
            ids,
            at: thread.messages.len() - 1,
            stop: sampled.last().copied(),
        });
        thread.answers += 1;
        thread.used = used;
        Ok(())
    }

    /// Keeps what a prompt added (the messages sent, a new conversation) and counts how it
    /// was made; the conversation it went to.
    fn apply(&mut self, change: Change, made: Made) -> &mut Thread {
        match made {
            Made::Reused => self.stats.reused_turns += 1,
            Made::Fallback => {
                self.stats.delta_fallbacks += 1;
                self.stats.rendered_turns += 1;
            }
            Made::Rendered => self.stats.rendered_turns += 1,
        }
        let index = match change {
            Change::Continue { index, new, state } => {
                let thread = &mut self.threads[index];
                thread.produced.extend(new.iter().map(|_| false));
                thread.messages.extend(new);
                thread.state = state;
                index
            }
            Change::Start(thread) => {
                self.threads.push(*thread);
                self.stats.conversations = self.threads.len() as u64;
                self.threads.len() - 1
            }
        };
        &mut self.threads[index]
    }

    /// The agent's main conversation: the one with the most answers, the latest of equals.
    /// The longest rather than the last: an agent's last request may be a side one (a
    /// title, a summary), while its work is where it asked the most.
    pub(crate) fn main(&self) -> Option<usize> {
        self.threads
            .iter()
            .enumerate()
            .filter(|(_, thread)| thread.answers > 0)
            .max_by_key(|(_, thread)| (thread.answers, thread.used))
            .map(|(index, _)| index)
    }

    /// The agent's transcript: its [`main`](Self::main) conversation split before the
    /// proxy's first answer.
    pub(crate) fn transcript(&self) -> (Vec<Message>, Vec<Message>) {
        let Some(main) = self.main().map(|index| &self.threads[index]) else {
            return (Vec::new(), Vec::new());
        };
        let split = main
            .produced
            .iter()
            .position(|&produced| produced)
            .unwrap_or(main.messages.len());
        let (prompt, completion) = main.messages.split_at(split);
        (prompt.to_vec(), completion.to_vec())
    }
}

/// Renders the whole conversation with the generation prompt.
fn whole(render: &mut IncrementalRender<'_>) -> Result<Vec<u32>, ApiError> {
    Ok(render.prompt().map_err(render_error)?.ids.to_vec())
}
