//! Token-in/token-out prompts (append mode): the ids a chat template writes after an
//! assistant turn, up to the next generation.
//!
//! In append mode the next prompt is the previous prompt, the ids the model sampled as it
//! sampled them (its stop token included), and the *delta*: what the model's own template
//! writes after that assistant turn (end-of-turn text the model did not emit, the tool
//! results or user message that follow, the generation prompt). The model's tokens are never
//! detokenized and re-encoded, so a rollout is one training row whatever the template does to
//! history. [`IncrementalRender::delta`] derives the delta from the template alone, with no
//! table per model family:
//!
//! 1. Render a *window* of the conversation with the generation prompt: the prompt's
//!    messages, the assistant message, and the messages after it (`X`); and the same with the
//!    content of every message after the assistant's replaced by a probe (`Y`).
//! 2. The assistant turn starts where `X` stops agreeing with the prompt's own render (the
//!    text the model continued) and ends before `X` and `Y` part (the first new content).
//!    Between the two the template must write the token the model stopped on exactly once:
//!    that token ends the turn. No such token, or two, means there is no exact delta.
//! 3. Tokenize `X` from that token and drop it. Added tokens split the input before anything
//!    else, so the ids after a special token do not depend on the text before it: they are
//!    the ids a full tokenization of the conversation gives there.
//!
//! The window leaves out the turns between the prompt and this assistant message, so its
//! cost does not grow with the conversation. That is exact when what a template writes after
//! an assistant turn does not depend on earlier turns, which each delta checks: the window
//! one turn wider must end with the same text. When it does not (a template numbering tool
//! calls over the whole conversation), the delta is taken from the whole conversation
//! instead, counted in [`IncrementalStats::wide_deltas`](super::IncrementalStats).
//!
//! When there is no exact delta ([`NoExactDelta`] says why), the caller renders the whole
//! conversation for that turn, as rerender mode does.

use std::sync::Arc;

use minijinja::value::Value;

use super::{IncrementalRender, RenderError, RenderOptions, RenderState};
use crate::reconcile::common_prefix;

/// Why an assistant turn has no exact token delta; the turn's next prompt is then rendered
/// from the whole conversation (rerender).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoExactDelta {
    /// The answer did not end on a special token, so nothing marks where the template's text
    /// after it starts (an empty answer, or one ended by a stop string).
    #[error(
        "the answer did not end on a special token (its last id: {last:?}): nothing marks where the template's text after it starts"
    )]
    NoStopToken {
        /// The answer's last id, if it has one.
        last: Option<u32>,
    },
    /// The template does not end an assistant turn with the token the model stopped on.
    #[error(
        "the template does not end an assistant turn with {token}, the token the model stopped on"
    )]
    StopNotWritten {
        /// The stop token's text.
        token: String,
    },
    /// The template writes the stop token more than once between the start of the assistant
    /// turn and the next message's content.
    #[error(
        "the template writes {token}, the token the model stopped on, {count} times between the start of the assistant turn and the next message: which one ends the turn is ambiguous"
    )]
    StopAmbiguous {
        /// The stop token's text.
        token: String,
        /// How many times it is written there.
        count: usize,
    },
    /// Where the template writes the stop token, the tokenizer does not read it back as that
    /// token.
    #[error("the template writes {token} where the tokenizer does not read it as that token")]
    StopNotTokenized {
        /// The stop token's text.
        token: String,
    },
    /// The template failed on a window of the conversation.
    #[error("the template failed on the conversation: {0}")]
    Template(RenderError),
    /// The assistant message asked for is not in the conversation after its prompt.
    #[error(
        "no message {index} after the prompt's {prompt} in a conversation of {len}: the assistant turn must follow the prompt"
    )]
    NoSuchMessage {
        /// The index given.
        index: usize,
        /// Messages of the prompt.
        prompt: usize,
        /// Messages of the conversation.
        len: usize,
    },
}

impl NoExactDelta {
    /// A short name of the reason (`no_stop_token`, `stop_not_written`, ...), the same for
    /// every turn failing the same way: for counters and for warning once per reason.
    pub fn kind(&self) -> &'static str {
        match self {
            NoExactDelta::NoStopToken { .. } => "no_stop_token",
            NoExactDelta::StopNotWritten { .. } => "stop_not_written",
            NoExactDelta::StopAmbiguous { .. } => "stop_ambiguous",
            NoExactDelta::StopNotTokenized { .. } => "stop_not_tokenized",
            NoExactDelta::Template(_) => "template",
            NoExactDelta::NoSuchMessage { .. } => "no_such_message",
        }
    }
}

/// A delta found in one rendered window.
struct Found {
    ids: Vec<u32>,
    /// The window's text.
    text: String,
    /// Where the stop token that ends the assistant turn starts in `text`.
    at: usize,
}

impl IncrementalRender<'_> {
    /// The ids the template writes after the assistant message at index `assistant` of this
    /// conversation, up to the next generation: end-of-turn text the model did not emit, the
    /// messages pushed after it, and the generation prompt. The model stopped on `stop` (the
    /// last id it sampled, which the next prompt keeps as sampled); `prompt` is the state
    /// this conversation started from (its messages are the window's context, its text what
    /// the model was given first). The next prompt in append mode is the previous prompt, the
    /// sampled ids and these.
    ///
    /// How: the window of the prompt's messages, the assistant message and the messages after
    /// it is rendered with the generation prompt, and again with those messages' contents
    /// probed. The turn runs from where the window leaves the prompt's own render to where
    /// the two renders part; there the template must write `stop` exactly once, and the
    /// window is tokenized from that special token on (added tokens split the input, so the
    /// ids after it are those of a full tokenization). A render one turn wider must end the
    /// same way, else the delta comes from the whole conversation. So the cost does not grow
    /// with the conversation, and only the delta is tokenized. The conversation's own render
    /// state (what [`IncrementalRender::prompt`] compares with) is not changed.
    pub fn delta(
        &mut self,
        prompt: &RenderState,
        assistant: usize,
        stop: u32,
    ) -> Result<Vec<u32>, NoExactDelta> {
        let base = prompt.len();
        let len = self.state.messages.len();
        if assistant < base || assistant >= len {
            return Err(NoExactDelta::NoSuchMessage {
                index: assistant,
                prompt: base,
                len,
            });
        }
        let stop_text = self
            .tokenizer
            .special_token(stop)
            .ok_or(NoExactDelta::NoStopToken { last: Some(stop) })?;
        let options = self.generation_options();
        let messages = &self.state.messages;
        let window = |from: usize| -> Vec<Value> {
            messages[..base]
                .iter()
                .chain(&messages[from..])
                .cloned()
                .collect()
        };
        let narrow = window(assistant);
        // One turn more of history: the previous assistant turn on, or the whole conversation.
        let wider = (assistant > base).then(|| {
            let from = (base..assistant)
                .rev()
                .find(|&i| is_assistant(&messages[i]))
                .unwrap_or(base);
            window(from)
        });
        let found = self.delta_in(&prompt.text, narrow, base + 1, stop, &stop_text)?;
        if let Some(wider) = wider {
            // The window is exact if one turn more of history leaves the text after the
            // assistant turn as it is; else the delta comes from the whole conversation.
            let wider = self.render_window(wider, &options)?;
            if !wider.ends_with(&found.text[found.at..]) {
                let lead =
                    self.render_window(self.state.messages[..assistant].to_vec(), &options)?;
                let whole = self.state.messages.clone();
                let found = self.delta_in(&lead, whole, assistant + 1, stop, &stop_text)?;
                self.state.stats.wide_deltas += 1;
                self.state.stats.deltas += 1;
                return Ok(found.ids);
            }
        }
        self.state.stats.deltas += 1;
        Ok(found.ids)
    }

    /// The delta in `messages` after the assistant message just before `new_from`, `lead`
    /// being the render of what precedes it with the generation prompt.
    fn delta_in(
        &mut self,
        lead: &str,
        messages: Vec<Value>,
        new_from: usize,
        stop: u32,
        stop_text: &str,
    ) -> Result<Found, NoExactDelta> {
        let options = self.generation_options();
        let probed: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(i, message)| {
                if i >= new_from {
                    probe(message)
                } else {
                    message.clone()
                }
            })
            .collect();
        let text = self.render_window(messages, &options)?;
        let other = self.render_window(probed, &options)?;
        // The turn: after what the model was given, before the first new content.
        let start = common_prefix(lead.as_bytes(), text.as_bytes());
        let end = floor_boundary(&text, common_prefix(text.as_bytes(), other.as_bytes()));
        // A stop token straddling `start` is new text too: search from a token's length
        // before it, keep what ends after it.
        let from = floor_boundary(
            &text,
            start.saturating_sub(stop_text.len().saturating_sub(1)),
        );
        let mut ends = text
            .get(from.min(end)..end)
            .unwrap_or_default()
            .match_indices(stop_text)
            .map(|(i, _)| from + i)
            .filter(|&at| at + stop_text.len() > start);
        let at = match (ends.next(), ends.count()) {
            (Some(at), 0) => at,
            (None, _) => {
                return Err(NoExactDelta::StopNotWritten {
                    token: stop_text.to_owned(),
                });
            }
            (Some(_), more) => {
                return Err(NoExactDelta::StopAmbiguous {
                    token: stop_text.to_owned(),
                    count: more + 1,
                });
            }
        };
        let chunk = &text[at..];
        let encoding = self
            .tokenizer
            .tokenizer()
            .encode(chunk, false)
            .map_err(|error| NoExactDelta::Template(RenderError::tokenize(error)))?;
        self.state.stats.encoded_bytes += chunk.len() as u64;
        let ids = encoding.get_ids();
        if ids.first() != Some(&stop) || encoding.get_offsets().first().map(|o| o.0) != Some(0) {
            return Err(NoExactDelta::StopNotTokenized {
                token: stop_text.to_owned(),
            });
        }
        Ok(Found {
            ids: ids[1..].to_vec(),
            at,
            text,
        })
    }

    /// The conversation's options with the generation prompt on (append mode always ends a
    /// prompt with it).
    fn generation_options(&self) -> Arc<RenderOptions> {
        if self.state.options.add_generation_prompt {
            Arc::clone(&self.state.options)
        } else {
            let mut options = (*self.state.options).clone();
            options.add_generation_prompt = true;
            Arc::new(options)
        }
    }

    fn render_window(
        &mut self,
        messages: Vec<Value>,
        options: &RenderOptions,
    ) -> Result<String, NoExactDelta> {
        self.state.stats.delta_renders += 1;
        self.template
            .render_owned(messages, options, self.tokenizer.special_tokens())
            .map_err(NoExactDelta::Template)
    }
}

fn is_assistant(message: &Value) -> bool {
    message
        .get_attr("role")
        .ok()
        .is_some_and(|role| role.as_str() == Some("assistant"))
}

/// The message with its content replaced by a text that differs from its first character
/// on (a message without content is left as it is).
fn probe(message: &Value) -> Value {
    let content = Value::from("content");
    match message.get_item(&content) {
        Ok(value) if !value.is_undefined() => {
            let replacement = match value.as_str() {
                Some(text) if text.starts_with('A') => "B",
                _ => "A",
            };
            let Ok(keys) = message.try_iter() else {
                return message.clone();
            };
            Value::from_pairs(keys.map(|key| {
                let value = if key == content {
                    Value::from(replacement)
                } else {
                    message.get_item(&key).unwrap_or_default()
                };
                (key, value)
            }))
        }
        _ => message.clone(),
    }
}

/// The largest char boundary of `text` at or before `index`.
fn floor_boundary(text: &str, index: usize) -> usize {
    let mut index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}
