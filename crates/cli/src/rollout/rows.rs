//! `--serve-rows`: the row stream beside the output. The writer thread pushes each group it
//! wrote as a record batch (the Parquet output's schema) into a bounded ledger that
//! `async-grpo-stream`'s Flight server serves; when the trainer falls behind, the push waits,
//! the writer with it, and the engine's admission stops. The trainer's model versions reach
//! the engine as the control endpoint's do.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use anyhow::Context as _;
use async_grpo_stream::{
    Ledger, LedgerError,
    flight::{self, Feedback, RecordBatch, RowServer},
};
use rollout::Engine;
use rollout_core::TrainingSample;
use vllm_client::Client;

/// The engine, once it runs, for the trainer's versions; before, the highest version the
/// trainer sent, for the engine to start from.
#[derive(Default)]
struct Versions {
    engine: OnceLock<Arc<Engine<Client>>>,
    early: Mutex<Option<u64>>,
}

impl Versions {
    fn attach(&self, engine: Arc<Engine<Client>>) {
        let early = self.early.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(version) = *early {
            // Versions only grow: one the engine already passed stays behind.
            let _ = engine.set_model_version(version);
        }
        let _ = self.engine.set(engine);
    }
}

impl Feedback for Versions {
    fn model_version(&self, version: u64) -> Result<(), String> {
        let mut early = self.early.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(engine) = self.engine.get() else {
            *early = Some(early.map_or(version, |seen| seen.max(version)));
            return Ok(());
        };
        drop(early);
        engine.set_model_version(version).map_err(|current| {
            format!("model versions only grow: {version} is below the current {current}")
        })
    }
}

/// The row stream of a run.
pub(crate) struct RowStream {
    ledger: Arc<Ledger<RecordBatch>>,
    versions: Arc<Versions>,
    address: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl RowStream {
    /// Serves the stream on `address`, `capacity` groups held unacknowledged at most.
    pub(crate) fn start(
        address: SocketAddr,
        token: Option<String>,
        capacity: usize,
    ) -> anyhow::Result<RowStream> {
        let ledger = Arc::new(Ledger::new(capacity));
        let versions = Arc::new(Versions::default());
        let server = RowServer::new(
            Arc::clone(&ledger),
            files::arrow::row_schema(),
            Arc::clone(&versions) as Arc<dyn Feedback>,
            token,
        );
        let (address, server) = flight::serve(server, address)
            .with_context(|| format!("--serve-rows: cannot listen on {address}"))?;
        Ok(RowStream {
            ledger,
            versions,
            address,
            server,
        })
    }

    /// Where it listens.
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }

    /// The engine the trainer's versions go to.
    pub(crate) fn attach(&self, engine: Arc<Engine<Client>>) {
        self.versions.attach(engine);
    }

    /// What the writer thread pushes groups through.
    pub(crate) fn pusher(&self) -> Pusher {
        Pusher {
            ledger: Arc::clone(&self.ledger),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Stops taking groups (a drain after a signal): a push waiting for room returns, and the
    /// groups not pushed are only in the output file.
    pub(crate) fn close(&self) {
        self.ledger.close();
    }

    /// Ends the stream once every group is acknowledged, or after `timeout`: how many groups
    /// were left unacknowledged (they are in the output file).
    pub(crate) async fn finish(self, timeout: Duration) -> usize {
        self.ledger.close();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let stats = self.ledger.stats();
            let held = stats.waiting + stats.leased;
            if held == 0 || tokio::time::Instant::now() >= deadline {
                self.server.abort();
                return held;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The writer thread's end of the stream.
pub(crate) struct Pusher {
    ledger: Arc<Ledger<RecordBatch>>,
    runtime: tokio::runtime::Handle,
}

impl Pusher {
    /// Adds a group, waiting while the stream holds its capacity unacknowledged; nothing once
    /// the stream is closed.
    pub(crate) fn push(&self, samples: &[TrainingSample]) -> anyhow::Result<()> {
        let batch = files::arrow::row_batch(samples).context("a group as a record batch")?;
        match self.runtime.block_on(self.ledger.push(batch)) {
            Ok(_) | Err(LedgerError::Closed) => Ok(()),
            Err(error) => Err(error).context("the row stream"),
        }
    }
}
