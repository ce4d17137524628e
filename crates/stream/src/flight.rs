//! [`RowServer`]: the row stream over Apache Arrow Flight (feature `flight`), a
//! [`Ledger`] of record batches served to any Flight client (`pyarrow.flight`, C++, Java,
//! Go, Rust).
//!
//! - `DoGet` (any ticket): a reader's stream. Its first message is the schema; then one
//!   record batch per group, as groups complete, each with `app_metadata` naming its place:
//!   `{"position": P, "reader": R}`. The stream ends when the run does. A stream that closes
//!   gives the groups it was sent and did not acknowledge back to the ledger, for whoever
//!   reads next.
//! - `DoAction "ack"`, body `{"reader": R, "through": P}`: acknowledges every group reader
//!   `R` was sent up to position `P`, recorded by the [`Feedback`] before the answer
//!   `{"acknowledged": N}`.
//! - `DoAction "model_version"`, body `{"version": N}`: the trainer's new policy version,
//!   handed to the engine's [`Feedback`].
//! - `DoAction "pause"`, body `{"mode": "wait" | "abort" | "continue"}` or empty, and
//!   `DoAction "resume"`: stop and restart the engine's admission, as its control endpoint's
//!   `/pause` and `/resume` do (a trainer pauses, moves its weights, posts its version,
//!   resumes).
//! - An action the engine cannot do yet (the run is starting) answers `UNAVAILABLE`, the
//!   status clients retry; one it will not do as asked, `FAILED_PRECONDITION` ([`Refusal`]).
//! - With a token, every call must carry `authorization: Bearer TOKEN`; others get
//!   `UNAUTHENTICATED` and nothing else. With a certificate ([`Tls`]), TLS only.

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

pub use arrow_array::RecordBatch;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
    flight_service_server::{FlightService, FlightServiceServer},
};
use arrow_schema::SchemaRef;
use futures::{Stream, StreamExt as _, stream};
use serde::{Deserialize, Serialize};
use tokio::{sync::oneshot, task::JoinHandle};
/// The attribute a [`Feedback`] implementation with a `pause` of its own wears.
pub use tonic::async_trait;
use tonic::{Request, Response, Status, Streaming};

use crate::{Ledger, Position, Reader};

/// What the trainer sends back over the stream, for the engine to act on.
#[tonic::async_trait]
pub trait Feedback: Send + Sync + 'static {
    /// The trainer's policy is now `version`: turns sampled from now on record it.
    fn model_version(&self, version: u64) -> Result<(), Refusal>;

    /// Groups at `positions` were acknowledged, and are gone from the ledger: record them
    /// where a resumed run finds them (an error is the trainer's, as the ack's answer).
    /// Nothing is recorded by default.
    fn acknowledged(&self, positions: &[Position]) -> Result<(), String> {
        let _ = positions;
        Ok(())
    }

    /// The trainer asks admission to stop (`mode` as the engine's `in_flight`: `wait`,
    /// `abort`, `continue`; the engine's own when `None`), answering once it has: what to
    /// tell the trainer. Refused by default.
    async fn pause(&self, mode: Option<String>) -> Result<serde_json::Value, Refusal> {
        let _ = mode;
        Err(Refusal::Refused(
            "this stream cannot pause its engine".to_owned(),
        ))
    }

    /// The trainer asks admission to start again. Refused by default.
    fn resume(&self) -> Result<serde_json::Value, Refusal> {
        Err(Refusal::Refused(
            "this stream cannot resume its engine".to_owned(),
        ))
    }
}

/// Why the engine did not do what the trainer asked, as the action's gRPC status says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not now, later (the run is starting): `UNAVAILABLE`, the status clients retry.
    #[error("{0}")]
    NotYet(String),
    /// Not as asked (a version below the current one, an unknown mode):
    /// `FAILED_PRECONDITION`.
    #[error("{0}")]
    Refused(String),
}

impl From<Refusal> for Status {
    fn from(refusal: Refusal) -> Status {
        match refusal {
            Refusal::NotYet(message) => Status::unavailable(message),
            Refusal::Refused(message) => Status::failed_precondition(message),
        }
    }
}

/// The Flight service of a row stream: see the [module](self) documentation.
pub struct RowServer {
    ledger: Arc<Ledger<RecordBatch>>,
    schema: SchemaRef,
    feedback: Arc<dyn Feedback>,
    token: Option<String>,
    readers: AtomicU64,
}

/// A batch's place, as its `app_metadata` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchPlace {
    /// The group's position in the stream.
    pub position: Position,
    /// The reader the stream was opened as (what its acknowledgements name).
    pub reader: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ack {
    reader: u64,
    through: Position,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelVersion {
    version: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Pause {
    #[serde(default)]
    mode: Option<String>,
}

impl std::fmt::Debug for RowServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowServer")
            .field("ledger", &self.ledger.stats())
            .field("token", &self.token.as_ref().map(|_| "..."))
            .finish_non_exhaustive()
    }
}

impl RowServer {
    /// A server of `ledger`'s groups, each a record batch of `schema`; `token`, when given,
    /// is the bearer token every call must carry.
    pub fn new(
        ledger: Arc<Ledger<RecordBatch>>,
        schema: SchemaRef,
        feedback: Arc<dyn Feedback>,
        token: Option<String>,
    ) -> RowServer {
        RowServer {
            ledger,
            schema,
            feedback,
            token,
            readers: AtomicU64::new(0),
        }
    }

    /// As a tonic service, to serve (`tonic::transport::Server::builder().add_service(..)`).
    pub fn into_service(self) -> FlightServiceServer<RowServer> {
        FlightServiceServer::new(self).max_decoding_message_size(1 << 20)
    }

    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        // Compared whole, in time independent of where they differ.
        match given {
            Some(given)
                if given.len() == token.len()
                    && given
                        .bytes()
                        .zip(token.bytes())
                        .fold(0u8, |diff, (a, b)| diff | (a ^ b))
                        == 0 =>
            {
                Ok(())
            }
            _ => Err(Status::unauthenticated("a valid bearer token is required")),
        }
    }
}

/// Gives a reader's unacknowledged groups back when its stream is dropped (the client went
/// away, or the call ended).
struct Lease {
    ledger: Arc<Ledger<RecordBatch>>,
    reader: Reader,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.ledger.release(self.reader);
    }
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn encode(
    schema: &SchemaRef,
    batch: &RecordBatch,
    place: BatchPlace,
) -> Result<FlightData, Status> {
    let mut messages = arrow_flight::utils::batches_to_flight_data(schema, [batch])
        .map_err(|e| Status::internal(format!("cannot encode a group: {e}")))?;
    // The schema first, then the batch (the rows' schema has no dictionaries).
    let mut data = messages
        .pop()
        .ok_or_else(|| Status::internal("a group encoded to nothing"))?;
    let place = serde_json::to_vec(&place).map_err(|e| Status::internal(e.to_string()))?;
    data.app_metadata = place.into();
    Ok(data)
}

#[tonic::async_trait]
impl FlightService for RowServer {
    type HandshakeStream = Boxed<HandshakeResponse>;
    type ListFlightsStream = Boxed<FlightInfo>;
    type DoGetStream = Boxed<FlightData>;
    type DoPutStream = Boxed<PutResult>;
    type DoActionStream = Boxed<arrow_flight::Result>;
    type ListActionsStream = Boxed<ActionType>;
    type DoExchangeStream = Boxed<FlightData>;

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.authorize(&request)?;
        let reader = Reader(self.readers.fetch_add(1, Ordering::Relaxed));
        let schema = self.schema.clone();
        let first = arrow_flight::utils::batches_to_flight_data(&schema, [])
            .map_err(|e| Status::internal(e.to_string()))?;
        let lease = Lease {
            ledger: Arc::clone(&self.ledger),
            reader,
        };
        let groups = stream::unfold((lease, schema), |(lease, schema)| async move {
            let (position, batch) = lease.ledger.next(lease.reader).await?;
            let place = BatchPlace {
                position,
                reader: lease.reader.0,
            };
            let data = encode(&schema, &batch, place);
            Some((data, (lease, schema)))
        });
        let stream = stream::iter(first.into_iter().map(Ok)).chain(groups);
        Ok(Response::new(stream.boxed()))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        self.authorize(&request)?;
        let action = request.into_inner();
        let body = match action.r#type.as_str() {
            "ack" => {
                let ack: Ack = serde_json::from_slice(&action.body).map_err(|e| {
                    Status::invalid_argument(format!(
                        "ack: expected {{\"reader\": R, \"through\": POSITION}}: {e}"
                    ))
                })?;
                let positions = self.ledger.ack_through(Reader(ack.reader), ack.through);
                // Recorded before the answer: a trainer told its groups are acknowledged
                // never gets them again, even from a run resumed after a crash.
                self.feedback
                    .acknowledged(&positions)
                    .map_err(Status::internal)?;
                serde_json::json!({ "acknowledged": positions.len() })
            }
            "model_version" => {
                let version: ModelVersion = serde_json::from_slice(&action.body).map_err(|e| {
                    Status::invalid_argument(format!(
                        "model_version: expected {{\"version\": N}}: {e}"
                    ))
                })?;
                self.feedback.model_version(version.version)?;
                serde_json::json!({ "version": version.version })
            }
            "pause" => {
                let pause: Pause = if action.body.is_empty() {
                    Pause { mode: None }
                } else {
                    serde_json::from_slice(&action.body).map_err(|e| {
                        Status::invalid_argument(format!(
                            "pause: expected {{\"mode\": \"wait\" | \"abort\" | \"continue\"}} or \
                             nothing: {e}"
                        ))
                    })?
                };
                self.feedback.pause(pause.mode).await?
            }
            "resume" => self.feedback.resume()?,
            other => {
                return Err(Status::invalid_argument(format!(
                    "unknown action '{other}': expected ack, model_version, pause or resume"
                )));
            }
        };
        let result = arrow_flight::Result {
            body: body.to_string().into_bytes().into(),
        };
        Ok(Response::new(stream::iter([Ok(result)]).boxed()))
    }

    async fn list_actions(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        self.authorize(&request)?;
        let actions = [
            (
                "ack",
                "acknowledge a reader's groups: {\"reader\": R, \"through\": P}",
            ),
            (
                "model_version",
                "the trainer's policy version: {\"version\": N}",
            ),
            (
                "pause",
                "stop admission, answering once stopped: {\"mode\": \"wait\"|\"abort\"|\"continue\"} or nothing",
            ),
            ("resume", "start admission again"),
        ]
        .map(|(kind, description)| {
            Ok(ActionType {
                r#type: kind.to_owned(),
                description: description.to_owned(),
            })
        });
        Ok(Response::new(stream::iter(actions).boxed()))
    }

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented(
            "no handshake: send the bearer token with each call",
        ))
    }

    async fn list_flights(
        &self,
        _: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(Status::unimplemented("one stream: DoGet with any ticket"))
    }

    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented("one stream: DoGet with any ticket"))
    }

    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("one stream: DoGet with any ticket"))
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        self.authorize(&request)?;
        let result = SchemaResult::try_from(arrow_flight::SchemaAsIpc::new(
            &self.schema,
            &Default::default(),
        ))
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(result))
    }

    async fn do_put(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        Err(Status::unimplemented("the row stream is read-only"))
    }

    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("the row stream is read-only"))
    }
}

/// The certificate (chain) and private key a stream serves TLS with, both PEM.
#[derive(Clone)]
pub struct Tls {
    /// The certificate chain, PEM.
    pub certificate: Vec<u8>,
    /// Its private key, PEM.
    pub key: Vec<u8>,
}

/// The part of a [`Tls`] that is not PEM of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// The certificate.
    #[error("holds no PEM certificate (-----BEGIN CERTIFICATE-----)")]
    Certificate,
    /// The key.
    #[error("holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)")]
    Key,
}

impl Tls {
    /// Whether each part is PEM of its kind: tonic reads them only at the first handshake,
    /// so [`serve`] asks first, and a program can ask before it starts anything.
    pub fn check(&self) -> Result<(), TlsError> {
        let holds = |pem: &[u8], label: &str| {
            String::from_utf8_lossy(pem)
                .lines()
                .any(|line| line.starts_with("-----BEGIN ") && line.contains(label))
        };
        if !holds(&self.certificate, "CERTIFICATE") {
            return Err(TlsError::Certificate);
        }
        if !holds(&self.key, "PRIVATE KEY") {
            return Err(TlsError::Key);
        }
        Ok(())
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

/// Serves `server` on `address` (port 0 for any) on the current tokio runtime, over TLS when
/// `tls` is given (clients connect to `grpc+tls://`). A certificate or key that is not PEM is
/// an error now, not at the first connection.
pub fn serve(server: RowServer, address: SocketAddr, tls: Option<Tls>) -> std::io::Result<Serving> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        tls.check().map_err(|error| {
            let part = match error {
                TlsError::Certificate => "the certificate",
                TlsError::Key => "the key",
            };
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{part} {error}"))
        })?;
        let identity = tonic::transport::Identity::from_pem(tls.certificate, tls.key);
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    }
    // No Nagle: an acknowledgement is a small write answered at once, and waiting to batch
    // it with the next costs a trainer that acknowledges each group tens of milliseconds.
    let incoming = tonic::transport::server::TcpIncoming::bind(address)?.with_nodelay(Some(true));
    let address = incoming.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let served = builder
            .add_service(server.into_service())
            .serve_with_incoming_shutdown(incoming, async {
                // A dropped sender stops the server as a sent stop does.
                let _ = stopped.await;
            })
            .await;
        if let Err(error) = served {
            tracing_free_log(&error);
        }
    });
    Ok(Serving {
        address,
        stop: Mutex::new(Some((stop, task))),
    })
}

/// A [`RowServer`] being served: where it listens, and its end.
#[derive(Debug)]
pub struct Serving {
    address: SocketAddr,
    /// The server's stop signal and task, until stopped.
    stop: Mutex<Option<(oneshot::Sender<()>, JoinHandle<()>)>>,
}

impl Serving {
    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops serving: no new connection or call, and the streams and calls under way end as
    /// they would for at most `grace` (a reader whose stream ended receives its end, not a
    /// cut connection); then the connections are cut. Once; later calls return at once.
    pub async fn stop(&self, grace: Duration) {
        let taken = self
            .stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some((stop, mut task)) = taken else {
            return;
        };
        let _ = stop.send(());
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some((_, task)) = self
            .stop
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// A server that stopped on an error says so on stderr (this crate logs nothing else).
#[allow(
    clippy::print_stderr,
    reason = "the one message of a server that stopped"
)]
fn tracing_free_log(error: &dyn std::fmt::Display) {
    eprintln!("async-grpo: the row stream stopped: {error}");
}
