//! `async-grpo render`: a conversation through a model's chat template and tokenizer.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use clap::Args;
use rollout_core::{ChatTokenizer, Message, RenderOptions, parse::kind};
use serde_json::{Map, Value, json};

/// Arguments of `async-grpo render`.
#[derive(Debug, Args)]
pub(crate) struct RenderArgs {
    /// A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json, and
    /// optionally chat_template.jinja).
    #[arg(long, value_name = "PATH")]
    tokenizer: PathBuf,
    /// A JSON file holding the messages: `[{"role": "user", "content": "..."}, ...]`.
    #[arg(long, value_name = "FILE")]
    messages: PathBuf,
    /// A JSON file holding the tool schemas offered to the model (a list).
    #[arg(long, value_name = "FILE")]
    tools: Option<PathBuf>,
    /// A chat template file (.jinja) to use instead of the tokenizer's own.
    #[arg(long, value_name = "FILE")]
    template: Option<PathBuf>,
    /// Do not end with the assistant header (`add_generation_prompt=False`).
    #[arg(long)]
    no_generation_prompt: bool,
    /// Extra template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON")]
    kwargs: Option<String>,
}

pub(crate) fn run(args: &RenderArgs) -> anyhow::Result<()> {
    let messages: Vec<Message> =
        serde_json::from_value(read_json(&args.messages)?).with_context(|| {
            format!(
                "{}: expected a JSON array of messages, each an object with a string \"role\"",
                args.messages.display()
            )
        })?;
    let tools = match &args.tools {
        Some(path) => match read_json(path)? {
            Value::Array(tools) => Some(tools),
            other => bail!(
                "{}: expected a JSON array of tool schemas, got {}",
                path.display(),
                kind(&other)
            ),
        },
        None => None,
    };
    let kwargs: Map<String, Value> = match &args.kwargs {
        Some(text) => match serde_json::from_str(text) {
            Ok(Value::Object(kwargs)) => kwargs,
            Ok(other) => bail!("--kwargs: expected a JSON object, got {}", kind(&other)),
            Err(error) => bail!("--kwargs: expected a JSON object: {error}"),
        },
        None => Map::new(),
    };
    let mut tokenizer = ChatTokenizer::from_dir(&args.tokenizer)?;
    if let Some(template) = &args.template {
        tokenizer = tokenizer.with_template_file(template)?;
    }
    let options = RenderOptions {
        add_generation_prompt: !args.no_generation_prompt,
        tools,
        kwargs,
        ..RenderOptions::default()
    };
    let rendered = tokenizer.apply_chat_template(&messages, &options)?;
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer(
        &mut stdout,
        &json!({"text": rendered.text, "ids": rendered.ids}),
    )?;
    writeln!(stdout)?;
    Ok(())
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read the file", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))
}
