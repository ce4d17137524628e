//! `async-grpo simulate`: the vLLM-compatible simulator as a server, until Ctrl-C.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context, bail};
use vllm_sim::{Faults, SimConfig, Simulator, training_tokenizer};

/// Options of `async-grpo simulate`.
#[derive(Debug, clap::Args)]
pub(crate) struct SimulateArgs {
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// A Hugging Face tokenizer.json; without it, a small tokenizer trained at start
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// The model name to serve
    #[arg(long, default_value = "sim")]
    model: String,
    /// Context length
    #[arg(long, default_value_t = 4096)]
    max_model_len: u32,
    /// Tokens of a final answer (before EOS)
    #[arg(long, default_value_t = 32)]
    answer_tokens: usize,
    /// Assistant turns that call a tool before the final answer
    #[arg(long, default_value_t = 0)]
    tool_rounds: usize,
    /// The tool the scripted calls name
    #[arg(long, default_value = "calculator")]
    tool_name: String,
    /// Chance that a final answer after a tool call repeats the tool's result (the last
    /// number of the prompt) rather than a random number; drawn from each request's seed
    #[arg(long, default_value_t = 0.5)]
    correct_rate: f64,
    /// The end-of-answer token (appended when the tokenizer has it)
    #[arg(long, default_value = "<|im_end|>")]
    eos_token: String,
    /// Delay before the first token, in milliseconds
    #[arg(long, default_value_t = 0.0)]
    latency_ms: f64,
    /// Delay per generated token, in milliseconds
    #[arg(long, default_value_t = 0.0)]
    per_token_ms: f64,
    /// Fraction of generation requests answered 503
    #[arg(long, default_value_t = 0.0)]
    fail_503: f64,
    /// Fraction of generation requests whose connection is dropped mid-response
    #[arg(long, default_value_t = 0.0)]
    drop_connection: f64,
    /// Fraction of generation requests delayed by --slow-ms
    #[arg(long, default_value_t = 0.0)]
    slow: f64,
    /// The delay of a slow response, in milliseconds
    #[arg(long, default_value_t = 5000.0)]
    slow_ms: f64,
    /// Fraction of generation requests answered with a malformed body
    #[arg(long, default_value_t = 0.0)]
    malformed: f64,
    /// Seed of the fault draws
    #[arg(long, default_value_t = 0)]
    fault_seed: u64,
}

fn millis(name: &str, value: f64) -> anyhow::Result<Duration> {
    if !(value.is_finite() && value >= 0.0) {
        bail!("--{name} must be a number of milliseconds >= 0, got {value}");
    }
    Ok(Duration::from_secs_f64(value / 1000.0))
}

pub(crate) fn run(args: SimulateArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&args.correct_rate) {
        bail!(
            "--correct-rate must be a fraction between 0 and 1, got {}",
            args.correct_rate
        );
    }
    let fractions = [
        ("fail-503", args.fail_503),
        ("drop-connection", args.drop_connection),
        ("slow", args.slow),
        ("malformed", args.malformed),
    ];
    for (name, value) in fractions {
        if !(0.0..=1.0).contains(&value) {
            bail!("--{name} must be a fraction between 0 and 1, got {value}");
        }
    }
    let total: f64 = fractions.iter().map(|(_, v)| v).sum();
    if total > 1.0 {
        bail!("the fault fractions add up to {total}, more than 1");
    }
    let mut config = match &args.tokenizer {
        Some(path) => SimConfig::from_tokenizer_file(path).map_err(anyhow::Error::msg)?,
        None => SimConfig::new(training_tokenizer()),
    };
    config.model = args.model;
    config.max_model_len = args.max_model_len;
    config.answer_tokens = args.answer_tokens;
    config.tool_rounds = args.tool_rounds;
    config.tool_name = args.tool_name;
    config.correct_rate = args.correct_rate;
    config.eos_token = args.eos_token;
    config.latency = millis("latency-ms", args.latency_ms)?;
    config.per_token = millis("per-token-ms", args.per_token_ms)?;
    config.faults = Faults {
        error_503: args.fail_503,
        drop_connection: args.drop_connection,
        slow: args.slow,
        slow_delay: millis("slow-ms", args.slow_ms)?,
        malformed: args.malformed,
    };
    config.fault_seed = args.fault_seed;
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| {
            format!(
                "--host {} --port {} is not an address to listen on",
                args.host, args.port
            )
        })?;

    let runtime = tokio::runtime::Runtime::new().context("could not start the async runtime")?;
    runtime.block_on(async move {
        let model = config.model.clone();
        let simulator = Simulator::start(config, addr)
            .await
            .with_context(|| format!("could not listen on {addr}"))?;
        tracing::info!(
            url = %simulator.url(),
            %model,
            "vLLM-compatible simulator (scripted answers, not a model) serving; Ctrl-C to stop"
        );
        tokio::signal::ctrl_c()
            .await
            .context("could not wait for Ctrl-C")?;
        let counters = simulator.counters();
        simulator.stop().await;
        tracing::info!(?counters, "simulator stopped");
        Ok(())
    })
}
