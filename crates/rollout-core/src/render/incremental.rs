//! A conversation whose token buffer grows by what new messages add.
//!
//! Messages are appended with [`IncrementalRender::push`]; each
//! [`IncrementalRender::prompt`] (or [`IncrementalRender::conversation`]) renders the conversation
//! once with the template, checks that the text kept from the previous render is still a
//! prefix up to and including its last special token (the *anchor*), and tokenizes only
//! the text from the anchor on. Added tokens split the input before anything else, so the
//! ids before the anchor cannot change; the property tests check the result against a
//! full tokenization. When the template rewrites history (Qwen3 drops the reasoning of
//! earlier turns, for one) the kept text is not a prefix: the whole text is tokenized again
//! and the rewrite is counted.

use minijinja::value::Value;

use super::{
    ChatTemplate, ChatTokenizer, RenderError, RenderOptions, template::message_value,
    tokenizer::Anchor,
};
use crate::Message;

/// What an incremental conversation did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IncrementalStats {
    /// Renders of the conversation (one per prompt).
    pub renders: u64,
    /// Renders that tokenized only the text from the anchor on.
    pub incremental: u64,
    /// Renders whose text did not start with the kept text up to its anchor: the template
    /// rewrote history and the whole conversation was tokenized again.
    pub rewrites: u64,
    /// Whole-text tokenizations for any reason (first render, rewrites, no special token).
    pub full_encodes: u64,
    /// Bytes of text given to the tokenizer, over all renders.
    pub encoded_bytes: u64,
}

/// The ids of a render: the conversation, plus the assistant header for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt<'a> {
    /// Every id to send.
    pub ids: &'a [u32],
    /// The rendered text.
    pub text: &'a str,
}

/// A conversation rendered with a template, its text and ids kept between turns.
#[derive(Debug)]
pub struct IncrementalRender<'t> {
    tokenizer: &'t ChatTokenizer,
    template: &'t ChatTemplate,
    options: RenderOptions,
    messages: Vec<Value>,
    text: String,
    ids: Vec<u32>,
    anchor: Option<Anchor>,
    stats: IncrementalStats,
}

impl<'t> IncrementalRender<'t> {
    pub(crate) fn new(
        tokenizer: &'t ChatTokenizer,
        template: &'t ChatTemplate,
        mut options: RenderOptions,
    ) -> Self {
        options.continue_final_message = false;
        Self {
            tokenizer,
            template,
            options,
            messages: Vec::new(),
            text: String::new(),
            ids: Vec::new(),
            anchor: None,
            stats: IncrementalStats::default(),
        }
    }

    /// Appends messages; they are rendered by the next [`IncrementalRender::prompt`].
    pub fn push(&mut self, messages: &[Message]) {
        self.messages.extend(messages.iter().map(message_value));
    }

    /// Renders the conversation with the generation prompt: the ids to send for the next
    /// answer. On error the kept state is unchanged.
    pub fn prompt(&mut self) -> Result<Prompt<'_>, RenderError> {
        self.render(true)
    }

    /// Renders the conversation without the generation prompt (the whole conversation as
    /// a training or evaluation text). On error the kept state is unchanged.
    pub fn conversation(&mut self) -> Result<Prompt<'_>, RenderError> {
        self.render(false)
    }

    /// Renders, tokenizing only what changed after the kept anchor.
    fn render(&mut self, add_generation_prompt: bool) -> Result<Prompt<'_>, RenderError> {
        self.options.add_generation_prompt = add_generation_prompt;
        let text = self.template.render_values(
            &self.messages,
            &self.options,
            self.tokenizer.special_tokens(),
        )?;
        self.stats.renders += 1;
        let kept = self.anchor.filter(|anchor| {
            text.as_bytes()
                .starts_with(&self.text.as_bytes()[..anchor.end])
        });
        if self.anchor.is_some() && kept.is_none() {
            self.stats.rewrites += 1;
        }
        match kept {
            Some(anchor) => {
                let chunk = &text[anchor.byte..];
                let (new_ids, new_anchor) = self.tokenizer.encode_anchored(chunk)?;
                self.stats.incremental += 1;
                self.stats.encoded_bytes += chunk.len() as u64;
                self.ids.truncate(anchor.index);
                self.ids.extend_from_slice(&new_ids);
                self.anchor = new_anchor.map(|a| Anchor {
                    byte: anchor.byte + a.byte,
                    end: anchor.byte + a.end,
                    index: anchor.index + a.index,
                });
            }
            None => {
                let (ids, anchor) = self.tokenizer.encode_anchored(&text)?;
                self.stats.full_encodes += 1;
                self.stats.encoded_bytes += text.len() as u64;
                self.ids = ids;
                self.anchor = anchor;
            }
        }
        self.text = text;
        Ok(Prompt {
            ids: &self.ids,
            text: &self.text,
        })
    }

    /// The text of the last render.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The ids of the last render.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// How many messages the conversation holds.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether no message was pushed yet.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// What was done so far.
    pub fn stats(&self) -> IncrementalStats {
        self.stats
    }
}
