//! `--serve-rows`: the row stream beside the output. The writer thread pushes each group it
//! wrote as a record batch (the Parquet output's schema) into a bounded ledger that
//! `async-grpo-stream`'s Flight server serves; when the trainer falls behind, the push waits,
//! the writer with it, and the engine's admission stops. The trainer's model versions, pauses
//! and resumes reach the engine as the control endpoint's do.
//!
//! A group's position is its place among the output's groups, so positions hold across a
//! `--resume`: each acknowledgement is appended to `OUT.acks` before it is answered, and a
//! resumed run serves again, first, every group of the output that file does not list.

use std::{
    collections::HashSet,
    fs::File,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use anyhow::Context as _;
use async_grpo_stream::{
    Ledger, LedgerError, Position,
    flight::{self, Feedback, RecordBatch, RowServer},
};
use rollout::{Engine, InFlight};
use rollout_core::TrainingSample;
use vllm_client::Client;

use super::control;

/// The trainer's side of the engine: the engine once it runs (before, the highest version
/// the trainer sent, for the engine to start from), and the acknowledgement record.
#[derive(Default)]
struct Trainer {
    engine: OnceLock<Arc<Engine<Client>>>,
    early: Mutex<Option<u64>>,
    /// `OUT.acks`, open once the output is (none with rows on stdout).
    acks: Mutex<Option<(PathBuf, File)>>,
}

impl Trainer {
    fn attach(&self, engine: Arc<Engine<Client>>) {
        let early = self.early.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(version) = *early {
            // Versions only grow: one the engine already passed stays behind.
            let _ = engine.set_model_version(version);
        }
        let _ = self.engine.set(engine);
    }

    fn engine(&self) -> Result<&Arc<Engine<Client>>, String> {
        self.engine
            .get()
            .ok_or_else(|| "the run is starting: try again once it rolls out".to_owned())
    }
}

#[flight::async_trait]
impl Feedback for Trainer {
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

    fn acknowledged(&self, positions: &[Position]) -> Result<(), String> {
        let mut acks = self.acks.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((path, file)) = acks.as_mut() else {
            return Ok(());
        };
        let lines: String = positions.iter().map(|p| format!("{p}\n")).collect();
        // One write of whole lines: a run killed mid-write leaves a torn last line at most,
        // which a resume does not count.
        file.write_all(lines.as_bytes()).map_err(|e| {
            format!(
                "cannot record the acknowledgement in {}: {e}",
                path.display()
            )
        })
    }

    async fn pause(&self, mode: Option<String>) -> Result<serde_json::Value, String> {
        let engine = self.engine()?;
        let mode = mode
            .map(|mode| mode.parse::<InFlight>())
            .transpose()
            .map_err(|e| e.to_string())?;
        Ok(control::pause_engine(engine, mode).await)
    }

    fn resume(&self) -> Result<serde_json::Value, String> {
        Ok(control::resume_engine(self.engine()?))
    }
}

/// The version of the rows' schema the stream serves, in its metadata
/// (`async_grpo.rows_schema`): raised when a column changes meaning or goes; new nullable
/// columns do not raise it.
pub(crate) const SCHEMA_VERSION: &str = "1";

/// The rows' schema (the Parquet output's) with its version.
fn schema() -> arrow_schema::SchemaRef {
    let schema = files::arrow::row_schema();
    let metadata: std::collections::HashMap<String, String> = [(
        "async_grpo.rows_schema".to_owned(),
        SCHEMA_VERSION.to_owned(),
    )]
    .into();
    Arc::new(schema.as_ref().clone().with_metadata(metadata))
}

/// The row stream of a run.
pub(crate) struct RowStream {
    ledger: Arc<Ledger<RecordBatch>>,
    trainer: Arc<Trainer>,
    address: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl RowStream {
    /// Serves the stream on `address`, `capacity` groups held unacknowledged at most; the
    /// first group this run writes gets position `first` (the groups its output holds).
    pub(crate) fn start(
        address: SocketAddr,
        token: Option<String>,
        capacity: usize,
        first: Position,
        tls: Option<flight::Tls>,
    ) -> anyhow::Result<RowStream> {
        let ledger = Arc::new(Ledger::starting_at(capacity, first));
        let trainer = Arc::new(Trainer::default());
        let server = RowServer::new(
            Arc::clone(&ledger),
            schema(),
            Arc::clone(&trainer) as Arc<dyn Feedback>,
            token,
        );
        let (address, server) = flight::serve(server, address, tls)
            .with_context(|| format!("--serve-rows: cannot serve rows on {address}"))?;
        Ok(RowStream {
            ledger,
            trainer,
            address,
            server,
        })
    }

    /// Where it listens.
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }

    /// The output `out` is open (created, or cut back to its whole groups to resume): the
    /// acknowledgements go to `OUT.acks` from now on. A resumed run's backlog: the output's
    /// groups its earlier runs served and no trainer acknowledged (none when no earlier run
    /// served rows), for [`Pusher::restore`].
    pub(crate) fn record_to(&self, out: &Path, resume: bool) -> anyhow::Result<Backlog> {
        let earlier = if resume {
            files::output::acknowledged(out)?
        } else {
            None
        };
        let path = files::output::acks_path(out);
        let file = files::output::open_acks(out)?;
        *self
            .trainer
            .acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((path, file));
        Ok(Backlog {
            out: out.to_path_buf(),
            acknowledged: earlier,
        })
    }

    /// The engine the trainer's versions, pauses and resumes go to.
    pub(crate) fn attach(&self, engine: Arc<Engine<Client>>) {
        self.trainer.attach(engine);
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

/// The groups of a resumed output to serve again.
pub(crate) struct Backlog {
    out: PathBuf,
    /// What the earlier runs' trainers acknowledged; `None` when none served rows.
    acknowledged: Option<HashSet<Position>>,
}

/// The writer thread's end of the stream.
pub(crate) struct Pusher {
    ledger: Arc<Ledger<RecordBatch>>,
    runtime: tokio::runtime::Handle,
}

impl Pusher {
    /// Serves `backlog` again, lowest position first, waiting for room as pushes do (call it
    /// before the first push, off the runtime: it reads the output); how many groups.
    pub(crate) fn restore(&self, backlog: &Backlog) -> anyhow::Result<usize> {
        let Some(acknowledged) = &backlog.acknowledged else {
            return Ok(0);
        };
        let groups = files::arrow::output_groups(&backlog.out, |position| {
            !acknowledged.contains(&position)
        })?;
        let count = groups.len();
        for (position, batch) in groups {
            match self.runtime.block_on(self.ledger.restore(position, batch)) {
                Ok(()) => {}
                Err(LedgerError::Closed) => break,
                Err(error) => return Err(error).context("serving the output's groups again"),
            }
        }
        Ok(count)
    }

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
