//! A conversation whose token buffer grows by what new messages add.
//!
//! Messages are appended with [`IncrementalRender::push`]; each
//! [`IncrementalRender::prompt`] (or [`IncrementalRender::conversation`]) renders the
//! conversation once with the template, finds how far the new text agrees with the text
//! kept from the previous render, and tokenizes only from the last special token (an
//! *anchor*) inside that agreeing prefix. Added tokens split the input before anything
//! else, so the ids before the anchor cannot change; the property tests check every result
//! against a full tokenization. Normally the anchor is the previous render's last special
//! token. When the template rewrites history (Qwen3 drops the reasoning of earlier turns,
//! Qwen2.5 merges consecutive tool results), or a generation header is followed by
//! something else than the answer, the text before that token changed: the rewrite is
//! counted and tokenization restarts from the last special token before the change, or
//! from the start when there is none.

use std::sync::Arc;

use minijinja::value::Value;

use super::{
    ChatTemplate, ChatTokenizer, RenderError, RenderOptions, template::message_value,
    tokenizer::Anchor,
};
use crate::{Message, reconcile::common_prefix};

/// An incremental conversation set aside: its messages, rendered text, ids and anchors,
/// without the tokenizer and template it borrows, so that it can be kept, cloned and sent
/// between tasks. [`ChatTokenizer::resume`] continues it. A rollout loop renders a group's
/// prompt once and starts each of the group's rollouts from a clone.
#[derive(Debug, Clone)]
pub struct RenderState {
    /// Shared between a conversation and the states taken of it (tool specs can be large);
    /// copied only when a render changes `add_generation_prompt`.
    pub(super) options: Arc<RenderOptions>,
    pub(super) messages: Vec<Value>,
    pub(super) text: String,
    ids: Vec<u32>,
    /// Every special token of `text`, in order.
    anchors: Vec<Anchor>,
    pub(super) stats: IncrementalStats,
}

impl RenderState {
    /// The ids of the last render.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The text of the last render.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The messages so far.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether no message was pushed.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

impl ChatTokenizer {
    /// Continues a conversation set aside with [`IncrementalRender::state`]. The state must
    /// come from this tokenizer: its ids are trusted, not checked.
    pub fn resume(&self, state: RenderState) -> Result<IncrementalRender<'_>, RenderError> {
        let template = self.template(&state.options)?;
        Ok(IncrementalRender {
            tokenizer: self,
            template,
            state,
        })
    }
}

/// What an incremental conversation did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IncrementalStats {
    /// Renders of the conversation (one per prompt).
    pub renders: u64,
    /// Renders that tokenized only the text from the anchor on.
    pub incremental: u64,
    /// Renders that changed the previous render's text before its last special token (the
    /// template rewrote history, or a generation header was not followed by the answer);
    /// tokenization restarted from the last special token before the change.
    pub rewrites: u64,
    /// Whole-text tokenizations (the first render, or no special token before a change).
    pub full_encodes: u64,
    /// Bytes of text given to the tokenizer, over all renders and deltas.
    pub encoded_bytes: u64,
    /// Token deltas after an assistant turn built for append mode
    /// ([`IncrementalRender::delta`]).
    pub deltas: u64,
    /// Template renders those deltas took (windows of the conversation).
    pub delta_renders: u64,
    /// Deltas taken from the whole conversation because the template's text after an
    /// assistant turn depended on earlier turns.
    pub wide_deltas: u64,
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
    pub(super) tokenizer: &'t ChatTokenizer,
    pub(super) template: &'t ChatTemplate,
    pub(super) state: RenderState,
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
            state: RenderState {
                options: Arc::new(options),
                messages: Vec::new(),
                text: String::new(),
                ids: Vec::new(),
                anchors: Vec::new(),
                stats: IncrementalStats::default(),
            },
        }
    }

    /// The conversation as a [`RenderState`], to continue later or elsewhere.
    pub fn state(&self) -> RenderState {
        self.state.clone()
    }

    /// The conversation as a [`RenderState`], without a copy: for a render that is done.
    pub fn into_state(self) -> RenderState {
        self.state
    }

    /// Appends messages; they are rendered by the next [`IncrementalRender::prompt`].
    pub fn push(&mut self, messages: &[Message]) {
        self.state
            .messages
            .extend(messages.iter().map(message_value));
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
        if self.state.options.add_generation_prompt != add_generation_prompt {
            Arc::make_mut(&mut self.state.options).add_generation_prompt = add_generation_prompt;
        }
        let text = self.template.render_values(
            &self.state.messages,
            &self.state.options,
            self.tokenizer.special_tokens(),
        )?;
        self.state.stats.renders += 1;
        let agreeing = common_prefix(text.as_bytes(), self.state.text.as_bytes());
        // The last anchor whose token the new text still holds, unchanged, before it.
        let keep = self
            .state
            .anchors
            .partition_point(|anchor| anchor.end <= agreeing);
        if self
            .state
            .anchors
            .last()
            .is_some_and(|last| last.end > agreeing)
        {
            self.state.stats.rewrites += 1;
        }
        match keep.checked_sub(1).map(|k| (k, self.state.anchors[k])) {
            Some((k, anchor)) => {
                let chunk = &text[anchor.byte..];
                let (new_ids, new_anchors) = self.tokenizer.encode_anchored(chunk)?;
                self.state.stats.incremental += 1;
                self.state.stats.encoded_bytes += chunk.len() as u64;
                self.state.ids.truncate(anchor.index);
                self.state.ids.extend_from_slice(&new_ids);
                self.state.anchors.truncate(k);
                self.state
                    .anchors
                    .extend(new_anchors.into_iter().map(|a| Anchor {
                        byte: anchor.byte + a.byte,
                        end: anchor.byte + a.end,
                        index: anchor.index + a.index,
                    }));
            }
            None => {
                let (ids, anchors) = self.tokenizer.encode_anchored(&text)?;
                self.state.stats.full_encodes += 1;
                self.state.stats.encoded_bytes += text.len() as u64;
                self.state.ids = ids;
                self.state.anchors = anchors;
            }
        }
        self.state.text = text;
        Ok(Prompt {
            ids: &self.state.ids,
            text: &self.state.text,
        })
    }

    /// The text of the last render.
    pub fn text(&self) -> &str {
        &self.state.text
    }

    /// The ids of the last render.
    pub fn ids(&self) -> &[u32] {
        &self.state.ids
    }

    /// How many messages the conversation holds.
    pub fn len(&self) -> usize {
        self.state.messages.len()
    }

    /// Whether no message was pushed yet.
    pub fn is_empty(&self) -> bool {
        self.state.messages.is_empty()
    }

    /// What was done so far.
    pub fn stats(&self) -> IncrementalStats {
        self.state.stats
    }
}
