//! The `async-grpo` binary: the reference wiring of every layer of the engine, the
//! simulator (`simulate`, and the server of a rollout given none) and Parquet included.

mod layered;
mod reference;
mod render;
mod rollout;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc rather than glibc's malloc: a turn allocates and frees many small buffers on one
/// thread and drops them on another, where glibc's arenas spend their time consolidating.
/// BENCHMARKS.md ("The binary and the bridge against TRL's worker") has what it changed.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Roll out a dataset: multi-turn conversations against vLLM (or the built-in simulator)
    /// with tool calls, scored by reward functions, written as JSONL training rows
    Rollout(Box<rollout::config::RolloutArgs>),
    /// Render a conversation with a model's chat template and tokenize it, as
    /// transformers' `apply_chat_template` does; prints `{"text": ..., "ids": [...]}`.
    Render(render::RenderArgs),
    /// Serve the vLLM-compatible simulator: scripted answers, not a model, for demos and tests
    Simulate(simulate::SimulateArgs),
    /// Inside an agent's sandbox: listen on the proxy's port, run the agent, hand each
    /// connection to the proxy's socket (started by `rollout`, not by hand)
    #[command(hide = true)]
    AgentForward(rollout::agent::ForwardArgs),
    /// Print the settings reference (docs/reference/settings.md) as Markdown
    #[command(hide = true)]
    Reference,
}

/// Where log lines go: stderr, clearing the rollout progress bar first when one is shown.
fn log_writer() -> Box<dyn std::io::Write> {
    Box::new(rollout::progress::LogWriter)
}

fn main() -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rmcp=warn")),
        )
        .with_writer(log_writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Rollout(args)) => {
            let check = args.check;
            let resolved = rollout::config::Settings::resolve(*args)?;
            if check {
                let checked = rollout::preflight::check(&resolved)?;
                #[allow(clippy::print_stdout, reason = "--check prints the settings")]
                {
                    println!("{}", resolved.to_toml()?.trim_end());
                }
                eprintln!(
                    "async-grpo: the settings check out; {} dataset rows to roll out{}",
                    checked.rows,
                    if checked.bad_rows > 0 {
                        format!(", {} bad rows set aside", checked.bad_rows)
                    } else {
                        String::new()
                    }
                );
                return Ok(ExitCode::SUCCESS);
            }
            rollout::run::run(resolved)
        }
        Some(Command::Render(args)) => render::run(&args).map(|()| ExitCode::SUCCESS),
        Some(Command::Simulate(args)) => simulate::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::AgentForward(args)) => rollout::agent::forward(args),
        Some(Command::Reference) => {
            use clap::CommandFactory;
            #[allow(clippy::print_stdout, reason = "the reference is the output")]
            {
                print!("{}", reference::markdown(&Cli::command()));
            }
            Ok(ExitCode::SUCCESS)
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
