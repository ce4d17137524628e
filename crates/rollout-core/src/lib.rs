//! Conversations for RL of language models: from messages to training rows.
//!
//! - **Turn records and the reconciler** ([`TurnRecord`], [`Reconciler`]): each model call is
//!   recorded as the exact prompt ids sent, the ids sampled, their log-probs and the model
//!   version. The reconciler turns a conversation's turns into [`TrainingRow`]s
//!   (`input_ids`, `completion_mask`, `old_log_probs`), classifying each turn boundary as
//!   clean, realigned or forked, and counting drift.
//! - **Rendering** ([`render`]): a model's own Jinja chat template rendered with minijinja
//!   to the same text as transformers' `apply_chat_template`, tokenized with `tokenizers`
//!   ([`ChatTokenizer`]), and incrementally: appending messages tokenizes only what they
//!   add ([`IncrementalRender`]).
//! - **Tool-call parsing** ([`parse`]): hermes/Qwen, Qwen3-Coder XML, Llama-3 JSON and
//!   Mistral outputs into content and [`ToolCall`]s; a malformed call stays content and is
//!   reported, never a panic.

mod message;
pub mod parse;
mod reconcile;
pub mod render;
mod turn;

pub use crate::{
    message::Message,
    parse::{ParsedOutput, ToolCall, ToolCallParser},
    reconcile::{
        ReconcileError, Reconciled, Reconciler, ReconcilerConfig, RolloutId, Tally, TrainingRow,
        Transition, reconcile,
    },
    render::{
        ChatTemplate, ChatTokenizer, IncrementalRender, RenderError, RenderOptions, Rendered,
    },
    turn::TurnRecord,
};
