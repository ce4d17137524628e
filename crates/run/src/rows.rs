//! The row stream of a run (feature `stream`), as the binary's `--serve-rows` and the
//! bridge's `serve_rows=` serve it: each group written to the output is pushed, as a record
//! batch of the Parquet output's schema, into a bounded ledger that `async-grpo-stream`'s
//! Flight server serves. When the trainer falls behind, the push waits, the program's writer
//! with it, and the engine's admission stops. The trainer's model versions, pauses and
//! resumes reach the engine as the binary's control endpoint's do ([`crate::control`]).
//!
//! A group's position is its place among the output's groups, so positions hold across a
//! resume: each acknowledgement is appended to `OUT.acks` before it is answered, and a
//! resumed run serves again, first, every group of the output that file does not list.
//!
//! The order of a program's calls: [`RowsSpec::resolve`] (every setting checked, before
//! anything runs), [`RowStream::start`] (listening, inside a tokio runtime), once the output
//! is open [`RowStream::record_to`], once the engine runs [`RowStream::attach`]; on the
//! writer's thread [`Pusher::restore`] then [`Pusher::push`] for each group written; at the
//! end [`RowStream::finish`] (or [`RowStream::close`] first, to stop taking groups).

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use async_grpo_stream::{
    Ledger, LedgerError, Position,
    flight::{self, Feedback, RecordBatch, Refusal, RowServer},
};
use files::FileError;
use rollout::{Engine, InFlight};
use rollout_core::TrainingSample;
use vllm_client::Client;

use crate::listen;

/// The version of the rows' schema the stream serves, in its metadata
/// (`async_grpo.rows_schema`): raised when a column changes meaning or goes; new nullable
/// columns do not raise it.
pub const SCHEMA_VERSION: &str = "1";

/// How many groups a stream holds unacknowledged when not told.
pub const DEFAULT_CAPACITY: usize = 64;

/// How long the readers' streams of a settled stream have to send their ends before the
/// connections are cut (they end at once; this bounds a reader that does not read).
const STREAMS_END: Duration = Duration::from_secs(5);

/// A row stream's settings as a program takes them (the binary's `serve_rows*` keys and
/// flags, the bridge's arguments of the same names).
#[derive(Debug, Clone)]
pub struct RowsSpec {
    /// `serve_rows`: `PORT` (on 127.0.0.1) or `HOST:PORT`.
    pub address: String,
    /// `serve_rows_token`: the bearer token every call must carry; required on an address
    /// other machines reach.
    pub token: Option<String>,
    /// `serve_rows_capacity`: groups held unacknowledged at most.
    pub capacity: usize,
    /// `serve_rows_cert`: a PEM certificate (chain): the stream serves TLS only.
    pub certificate: Option<PathBuf>,
    /// `serve_rows_key`: the PEM private key of `certificate`.
    pub key: Option<PathBuf>,
}

/// A [`RowsSpec`] setting that cannot be served: its key (`serve_rows_cert`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct RowsSpecError {
    /// The setting's key.
    pub key: &'static str,
    /// What is wrong with it.
    pub message: String,
}

/// A [`RowsSpec`] checked and its files read: what [`RowStream::start`] serves.
#[derive(Debug, Clone)]
pub struct ServeRows {
    address: SocketAddr,
    token: Option<String>,
    capacity: usize,
    tls: Option<flight::Tls>,
}

impl ServeRows {
    /// The address to listen on (port 0: one the system picks).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Whether it serves TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }
}

impl RowsSpec {
    /// A stream on `address` with no token, no TLS and the default capacity.
    pub fn new(address: impl Into<String>) -> RowsSpec {
        RowsSpec {
            address: address.into(),
            token: None,
            capacity: DEFAULT_CAPACITY,
            certificate: None,
            key: None,
        }
    }

    /// Checks every setting and reads the PEM files: the address parses, a token can be
    /// carried, an address other machines reach has one, the capacity holds a group, the
    /// certificate and key come together and are PEM of their kinds. `set_token` says, in a
    /// refusal, how the program's user sets a token (`--serve-rows-token TOKEN or
    /// ASYNC_GRPO_ROWS_TOKEN`).
    pub fn resolve(&self, set_token: &str) -> Result<ServeRows, RowsSpecError> {
        let refuse = |key, message: String| RowsSpecError { key, message };
        let address = listen::listen_address(&self.address, set_token)
            .map_err(|e| refuse("serve_rows", e))?;
        if let Some(token) = &self.token {
            listen::check_token(token, &format!("the row stream's token ({set_token})"))
                .map_err(|e| refuse("serve_rows_token", e))?;
        }
        listen::check_reach(address, self.token.is_some(), set_token)
            .map_err(|e| refuse("serve_rows", e))?;
        if self.capacity == 0 {
            return Err(refuse(
                "serve_rows_capacity",
                "must be at least 1 (the groups held unacknowledged at most)".to_owned(),
            ));
        }
        let tls = match (&self.certificate, &self.key) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(refuse(
                    "serve_rows_cert",
                    "needs serve_rows_key (its private key)".to_owned(),
                ));
            }
            (None, Some(_)) => {
                return Err(refuse(
                    "serve_rows_key",
                    "needs serve_rows_cert (the certificate it signs)".to_owned(),
                ));
            }
            (Some(certificate), Some(key)) => {
                let read = |key, path: &Path| {
                    std::fs::read(path)
                        .map_err(|e| refuse(key, format!("cannot read {}: {e}", path.display())))
                };
                let tls = flight::Tls {
                    certificate: read("serve_rows_cert", certificate)?,
                    key: read("serve_rows_key", key)?,
                };
                if let Err(error) = tls.check() {
                    let (key, path) = match error {
                        flight::TlsError::Certificate => ("serve_rows_cert", certificate),
                        flight::TlsError::Key => ("serve_rows_key", key),
                    };
                    return Err(refuse(key, format!("{} {error}", path.display())));
                }
                Some(tls)
            }
        };
        Ok(ServeRows {
            address,
            token: self.token.clone(),
            capacity: self.capacity,
            tls,
        })
    }
}

/// What went wrong serving rows.
#[derive(Debug, thiserror::Error)]
pub enum RowsError {
    /// The server could not listen.
    #[error("cannot serve rows on {address}: {source}")]
    Serve {
        /// The address asked for.
        address: SocketAddr,
        /// Why not.
        source: std::io::Error,
    },
    /// The output's acknowledgements or groups could not be read, or a group not made a
    /// record batch.
    #[error("the row stream: {0}")]
    File(#[from] FileError),
    /// The ledger refused a group.
    #[error("the row stream: {0}")]
    Ledger(#[from] LedgerError),
}

/// The trainer's side of the engine: the engine once it runs (before, the highest version
/// the trainer sent, for the engine to start from), and the acknowledgement record.
#[derive(Debug, Default)]
struct Trainer {
    engine: OnceLock<Arc<Engine<Client>>>,
    early: Mutex<Option<u64>>,
    /// `OUT.acks`, open once the output is (none without an output file).
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

    fn engine(&self) -> Result<&Arc<Engine<Client>>, Refusal> {
        self.engine.get().ok_or_else(|| {
            Refusal::NotYet("the run is starting: try again once it rolls out".to_owned())
        })
    }
}

#[flight::async_trait]
impl Feedback for Trainer {
    fn model_version(&self, version: u64) -> Result<(), Refusal> {
        let mut early = self.early.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(engine) = self.engine.get() else {
            *early = Some(early.map_or(version, |seen| seen.max(version)));
            return Ok(());
        };
        drop(early);
        engine.set_model_version(version).map_err(|current| {
            Refusal::Refused(format!(
                "model versions only grow: {version} is below the current {current}"
            ))
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

    async fn pause(&self, mode: Option<String>) -> Result<serde_json::Value, Refusal> {
        let engine = self.engine()?;
        let mode = mode
            .map(|mode| mode.parse::<InFlight>())
            .transpose()
            .map_err(|e| Refusal::Refused(e.to_string()))?;
        Ok(crate::control::pause(engine, mode).await)
    }

    fn resume(&self) -> Result<serde_json::Value, Refusal> {
        Ok(crate::control::resume(self.engine()?))
    }
}

/// The rows' schema (the Parquet output's) with its version.
fn schema() -> arrow_schema::SchemaRef {
    let schema = files::arrow::row_schema();
    let metadata: HashMap<String, String> = [(
        "async_grpo.rows_schema".to_owned(),
        SCHEMA_VERSION.to_owned(),
    )]
    .into();
    Arc::new(schema.as_ref().clone().with_metadata(metadata))
}

/// The row stream of a run, served until [`RowStream::finish`].
#[derive(Debug)]
pub struct RowStream {
    ledger: Arc<Ledger<RecordBatch>>,
    trainer: Arc<Trainer>,
    server: flight::Serving,
}

impl RowStream {
    /// Serves `rows` on the current tokio runtime; the first group this run pushes gets
    /// position `first` (the groups a resumed output holds).
    pub fn start(rows: ServeRows, first: Position) -> Result<RowStream, RowsError> {
        let ServeRows {
            address,
            token,
            capacity,
            tls,
        } = rows;
        let ledger = Arc::new(Ledger::starting_at(capacity, first));
        let trainer = Arc::new(Trainer::default());
        let server = RowServer::new(
            Arc::clone(&ledger),
            schema(),
            Arc::clone(&trainer) as Arc<dyn Feedback>,
            token,
        );
        let server = flight::serve(server, address, tls)
            .map_err(|source| RowsError::Serve { address, source })?;
        Ok(RowStream {
            ledger,
            trainer,
            server,
        })
    }

    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.server.address()
    }

    /// The output `out` is open (created, or cut back to its whole groups to resume): the
    /// acknowledgements go to `OUT.acks` from now on. A resumed run's backlog: the output's
    /// groups its earlier runs served and no trainer acknowledged (none when no earlier run
    /// served rows), for [`Pusher::restore`].
    pub fn record_to(&self, out: &Path, resume: bool) -> Result<Backlog, RowsError> {
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
    pub fn attach(&self, engine: Arc<Engine<Client>>) {
        self.trainer.attach(engine);
    }

    /// What the writer's thread pushes groups through; call it inside the runtime.
    pub fn pusher(&self) -> Pusher {
        Pusher {
            ledger: Arc::clone(&self.ledger),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Stops taking groups (a drain after a signal or a stop): a push waiting for room
    /// returns, and the groups not pushed are only in the output file.
    pub fn close(&self) {
        self.ledger.close();
    }

    /// The groups held: pushed and not yet acknowledged.
    pub fn held(&self) -> usize {
        let stats = self.ledger.stats();
        stats.waiting + stats.leased
    }

    /// Waits until every group pushed is acknowledged.
    pub async fn settled(&self) {
        self.ledger.settled().await;
    }

    /// Ends the stream once every group is acknowledged, or after `timeout`: how many groups
    /// were left unacknowledged (they are in the output file).
    pub async fn finish(&self, timeout: Duration) -> usize {
        self.ledger.close();
        let settled = tokio::time::timeout(timeout, self.ledger.settled())
            .await
            .is_ok();
        // Settled, every reader's stream ends now: let each send its end rather than cut the
        // connection under a reader about to read it. Otherwise the readers still hold
        // groups, and their streams would not end by themselves.
        let grace = if settled { STREAMS_END } else { Duration::ZERO };
        self.server.stop(grace).await;
        self.held()
    }
}

/// The groups of a resumed output to serve again.
#[derive(Debug)]
pub struct Backlog {
    out: PathBuf,
    /// What the earlier runs' trainers acknowledged; `None` when none served rows.
    acknowledged: Option<HashSet<Position>>,
}

/// The writer's end of the stream, used off the runtime (it blocks).
#[derive(Debug, Clone)]
pub struct Pusher {
    ledger: Arc<Ledger<RecordBatch>>,
    runtime: tokio::runtime::Handle,
}

impl Pusher {
    /// Serves `backlog` again, lowest position first, waiting for room as pushes do (call it
    /// before the first push: it reads the output); how many groups.
    pub fn restore(&self, backlog: &Backlog) -> Result<usize, RowsError> {
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
                Err(error) => return Err(error.into()),
            }
        }
        Ok(count)
    }

    /// Adds a group, waiting while the stream holds its capacity unacknowledged: whether it
    /// was pushed (not once the stream is closed).
    pub fn push(&self, samples: &[TrainingSample]) -> Result<bool, RowsError> {
        let batch = files::arrow::row_batch(samples)?;
        match self.runtime.block_on(self.ledger.push(batch)) {
            Ok(_) => Ok(true),
            Err(LedgerError::Closed) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }
}
