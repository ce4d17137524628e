//! `async-grpo simulate`: the vLLM-compatible simulator as a server, until Ctrl-C.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, bail};
use vllm_sim::{SimConfig, SimSettings, Simulator, training_tokenizer};

use crate::layered::{Defaults, Layer};

/// Options of `async-grpo simulate`: where it listens, its tokenizer, and how it answers
/// ([`SimSettings`], the same settings a run's `[simulator]` table holds).
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
    #[command(flatten)]
    settings: Layer<SimSettings>,
}

impl Defaults for SimSettings {
    fn defaults_table() -> toml::Table {
        toml::Table::try_from(SimSettings::default()).unwrap_or_default()
    }
}

pub(crate) fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let mut settings = SimSettings::default();
    args.settings.lay_over(&mut settings)?;
    settings.validate().map_err(|e| {
        let flag = e.key.as_deref().unwrap_or_default().replace('_', "-");
        anyhow::anyhow!("--{flag}: {}", e.problem)
    })?;
    let total = settings.error_503 + settings.drop_connection + settings.slow + settings.malformed;
    if total > 1.0 {
        bail!("the fault fractions add up to {total}, more than 1");
    }
    let mut config = match &args.tokenizer {
        Some(path) => SimConfig::from_tokenizer_file(path).context("--tokenizer")?,
        None => SimConfig::new(training_tokenizer()),
    };
    settings.apply_to(&mut config);
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
