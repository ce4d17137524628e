//! The `async-grpo` binary: the reference wiring of every layer of the engine.

use clap::{Parser, Subcommand};

#[cfg(feature = "rollout-core")]
mod render;

/// A rollout engine for asynchronous GRPO-style reinforcement learning of language models.
///
/// It drives multi-turn conversations against vLLM, runs the model's tool calls without
/// blocking, scores groups of completions and hands training rows to a trainer.
#[derive(Debug, Parser)]
#[command(name = "async-grpo", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Render a conversation with a model's chat template and tokenize it, as
    /// transformers' `apply_chat_template` does; prints `{"text": ..., "ids": [...]}`.
    #[cfg(feature = "rollout-core")]
    Render(render::RenderArgs),
}

fn main() -> anyhow::Result<()> {
    let Cli { command } = Cli::parse();
    match command {
        #[cfg(feature = "rollout-core")]
        Some(Command::Render(args)) => render::run(&args),
        None => Ok(()),
    }
}
