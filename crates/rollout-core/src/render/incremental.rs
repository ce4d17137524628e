//! A conversation whose token buffer grows by the suffix new messages add.
//!
//! Each [`IncrementalRender::push`] renders the conversation once (the rendering without
//! the new messages is the one kept from the previous push), checks that the kept text is a
//! prefix of the new one, and tokenizes only the difference: from the last special token
//! of the kept text on, since added tokens split the input and the ids before that token
//! cannot change. When the template rewrites history (Qwen3 drops the reasoning of earlier
//! turns, for one) the kept text is not a prefix: the whole text is tokenized again and the
//! rewrite is counted.

use minijinja::value::Value;

use super::{
    ChatTemplate, ChatTokenizer, RenderError, RenderOptions, template::message_value,
    tokenizer::Anchor,
};
use crate::Message;

/// What an incremental conversation did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IncrementalStats {
    /// Calls to [`IncrementalRender::push`].
    pub pushes: u64,
    /// Pushes or prompts that tokenized only the new suffix.
    pub incremental: u64,
    /// Pushes whose rendering did not start with the kept text: history was rewritten and
    /// the whole conversation was tokenized again.
    pub rewrites: u64,
    /// Whole-text tokenizations for any reason (first push, rewrites, no special token yet).
    pub full_encodes: u64,
    /// Bytes of text given to the tokenizer, over all calls.
    pub encoded_bytes: u64,
}

/// The ids of a generation prompt: the conversation so far plus the assistant header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Every id to send.
    pub ids: Vec<u32>,
    /// The text the generation prompt added after the conversation.
    pub suffix: String,
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
        options.add_generation_prompt = false;
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

    /// Appends messages; on error nothing is changed.
    pub fn push(&mut self, messages: &[Message]) -> Result<(), RenderError> {
        let before = self.messages.len();
        self.messages.extend(messages.iter().map(message_value));
        let rendered = self.template.render_values(
            &self.messages,
            &self.options,
            self.tokenizer.special_tokens(),
        );
        let text = match rendered {
            Ok(text) => text,
            Err(error) => {
                self.messages.truncate(before);
                return Err(error);
            }
        };
        self.stats.pushes += 1;
        let rewritten = !text.starts_with(&self.text);
        if rewritten {
            self.stats.rewrites += 1;
        }
        let (keep, new_ids, anchor) = self.extend(&text, rewritten)?;
        self.ids.truncate(keep);
        self.ids.extend_from_slice(&new_ids);
        self.anchor = anchor;
        self.text = text;
        Ok(())
    }

    /// The ids to send for the next answer: the conversation and the generation prompt.
    pub fn prompt(&mut self) -> Result<Prompt, RenderError> {
        let options = RenderOptions {
            add_generation_prompt: true,
            ..self.options.clone()
        };
        let text = self.template.render_values(
            &self.messages,
            &options,
            self.tokenizer.special_tokens(),
        )?;
        let rewritten = !text.starts_with(&self.text);
        let suffix = if rewritten {
            String::new()
        } else {
            text[self.text.len()..].to_owned()
        };
        let (keep, new_ids, _) = self.extend(&text, rewritten)?;
        let mut ids = Vec::with_capacity(keep + new_ids.len());
        ids.extend_from_slice(&self.ids[..keep]);
        ids.extend_from_slice(&new_ids);
        Ok(Prompt { ids, suffix })
    }

    /// The ids of `text` as how many kept ids stay, the new ids after them, and the new
    /// anchor; only the suffix from the kept anchor on is tokenized when `text` extends the
    /// kept text.
    fn extend(
        &mut self,
        text: &str,
        rewritten: bool,
    ) -> Result<(usize, Vec<u32>, Option<Anchor>), RenderError> {
        match self.anchor {
            Some(anchor) if !rewritten => {
                let chunk = &text[anchor.byte..];
                let (new_ids, new_anchor) = self.tokenizer.encode_anchored(chunk)?;
                self.stats.incremental += 1;
                self.stats.encoded_bytes += chunk.len() as u64;
                let shifted = new_anchor.map(|a| Anchor {
                    byte: anchor.byte + a.byte,
                    index: anchor.index + a.index,
                });
                Ok((anchor.index, new_ids, shifted))
            }
            _ => {
                self.stats.full_encodes += 1;
                self.stats.encoded_bytes += text.len() as u64;
                let (ids, anchor) = self.tokenizer.encode_anchored(text)?;
                Ok((0, ids, anchor))
            }
        }
    }

    /// The text of the conversation so far (no generation prompt).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The ids of [`IncrementalRender::text`].
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
