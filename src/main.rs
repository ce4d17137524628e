//! The `async-grpo` binary: the reference wiring of every layer of the engine.

use clap::Parser;

/// A rollout engine for asynchronous GRPO-style reinforcement learning of language models.
///
/// It drives multi-turn conversations against vLLM, runs the model's tool calls without
/// blocking, scores groups of completions and hands training rows to a trainer.
#[derive(Debug, Parser)]
#[command(name = "async-grpo", version, about, long_about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let Cli {} = Cli::parse();
    Ok(())
}
