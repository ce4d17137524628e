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
//! - **Token-in/token-out prompts** ([`IncrementalRender::delta`]): the ids a template
//!   writes after an assistant turn up to the next generation, derived from the template,
//!   so that the next prompt can be the previous one + the ids sampled as sampled + these
//!   (the rollout engine's default, `rollout::PromptMode::Append`); [`NoExactDelta`] says
//!   why a turn has none.
//! - **Training samples** ([`TrainingSample`]): a training row with its prompt, completion,
//!   rewards, advantage and metrics, as the engine writes it (one JSON line, or one Parquet
//!   row).
//! - **Tool-call parsing** ([`parse`]): hermes/Qwen, Qwen3-Coder XML, Llama-3 JSON and
//!   Mistral outputs into content and [`ParsedCall`]s; a malformed call stays content and is
//!   reported, never a panic.
//!
//! The engine that runs conversations (admission, tools, scoring, datasets and outputs) is
//! the `rollout` crate; this one needs no runtime: minijinja, tokenizers and serde only.
//!
//! # Features
//!
//! | feature | default | what it adds | dependencies |
//! |---|---|---|---|
//! | `clap` | no | `clap::Args` for [`ReconcilerConfig`], so that a program declares none of its flags again | clap |
//!
//! # Using the pieces
//!
//! A model's own tokenizer folder (`tokenizer.json`, `tokenizer_config.json` with its chat
//! template), rendered and tokenized as transformers' `apply_chat_template` does:
//!
//! ```
//! use async_grpo_rollout_core::{ChatTokenizer, Message, RenderOptions};
//!
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/quickstart");
//! let tokenizer = ChatTokenizer::from_dir(dir)?; // a folder holding a model's tokenizer
//! let prompt = tokenizer.apply_chat_template(
//!     &[Message::user("What is 2 + 3?")],
//!     &RenderOptions::generation(),
//! )?;
//! assert_eq!(prompt.text, "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n");
//! assert_eq!(tokenizer.tokenizer().decode(&prompt.ids, false)?, prompt.text);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
//!
//! Parsing a tool call, rendering with a template given as text, and building a training row:
//!
//! ```
//! use async_grpo_rollout_core::{
//!     ChatTemplate, Message, ReconcilerConfig, RenderOptions, RolloutId, ToolCallParser,
//!     TurnRecord, parse::HermesParser, reconcile,
//! };
//! use serde_json::{Map, json};
//!
//! // A model answered with a tool call: parse it into an assistant message.
//! let parsed = HermesParser.parse(
//!     "Let me look.<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"rust\"}}\n</tool_call>",
//! );
//! assert_eq!(parsed.content, "Let me look.");
//! assert_eq!(parsed.tool_calls[0].arguments, json!({"q": "rust"}));
//! let answer = Message::assistant(parsed.content.clone()).with_tool_calls(&parsed.tool_calls);
//!
//! // Render the conversation with a chat template, as transformers would.
//! let template = ChatTemplate::new(
//!     "chatml",
//!     "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
//!      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
//! )?;
//! let text = template.render(
//!     &[Message::user("Find Rust docs"), answer, Message::tool("call_1", "3 results")],
//!     &RenderOptions::generation(),
//!     &Map::new(),
//! )?;
//! assert!(text.ends_with("<|im_start|>tool\n3 results<|im_end|>\n<|im_start|>assistant\n"));
//!
//! // Two turns of ids become one training row: sampled tokens are trained on.
//! let turns = [
//!     TurnRecord::new(vec![1, 2], vec![10, 11], vec![-0.1, -0.2], 0),
//!     TurnRecord::new(vec![1, 2, 10, 11, 3], vec![12], vec![-0.3], 0),
//! ];
//! let rows = reconcile(RolloutId(7), &turns, ReconcilerConfig::default())?.rows;
//! assert_eq!(rows[0].input_ids, [1, 2, 10, 11, 3, 12]);
//! assert_eq!(rows[0].completion_mask, [0, 0, 1, 1, 0, 1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod message;
pub mod parse;
mod reconcile;
pub mod render;
mod routing;
mod sample;
mod turn;

pub use crate::{
    message::Message,
    parse::{ParsedCall, ParsedOutput, ToolCallParser},
    reconcile::{
        ReconcileError, Reconciled, Reconciler, ReconcilerConfig, RolloutId, Tally, TrainingRow,
        Transition, reconcile,
    },
    render::{
        ChatTemplate, ChatTokenizer, IncrementalRender, NoExactDelta, RenderError, RenderOptions,
        RenderState, Rendered,
    },
    routing::{ExpertDtype, RoutedExperts, RowRouting},
    sample::{AdvantageSpan, SampleMetrics, TrainingSample, VersionSpan},
    turn::TurnRecord,
};
