//! The control endpoint (`--listen`): an axum server over the running engine.
//!
//! - `GET /health`: JSON of the heartbeat's age, rollouts in flight and queued, the counters,
//!   the model version, whether admission is paused; 200 when healthy, 503 while the run
//!   starts (it waits for its servers), when the heartbeat is stale or when no server can
//!   take requests.
//! - `GET /metrics`: the Prometheus text exposition of [`Engine::metrics`] (the same numbers
//!   the Python bridge reports), with the rows written, encoded by `prometheus-client`.
//! - `POST /model_version` `{"version": N}`: versions only grow; a lower one is a 409.
//! - `POST /pause?mode=wait|abort` and `POST /resume`: stop and restart admission; `wait`
//!   lets the rollouts in flight finish, `abort` cancels them; the pause answers once none
//!   is in flight.
//!
//! With a token (`--listen-token`), every endpoint but `/health` wants `Authorization:
//! Bearer TOKEN` (401 otherwise).
//!
//! The endpoint runs on a thread of its own with a runtime of its own, from the start of
//! the run to its end: it answers while the run still waits for its servers, and it can say
//! that the engine's runtime is blocked, which a server on that runtime could not.

use std::{
    fmt,
    future::IntoFuture,
    net::SocketAddr,
    sync::{Arc, OnceLock},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Context;
use axum::{
    Json, Router,
    extract::{Query, Request, State},
    http::{StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::counter::ConstCounter,
    registry::Registry,
};
use rollout_core::rollout::{Engine, Health, PauseMode};
use serde::Deserialize;
use serde_json::json;
use std::sync::atomic::Ordering;
use tokio::{net::TcpListener, sync::oneshot};
use vllm_client::Client;

use super::progress::Totals;

/// A heartbeat older than this makes `/health` answer 503: the runtime's workers are blocked.
const STALE_HEARTBEAT: Duration = Duration::from_secs(5);

/// What `/health` says while there is no engine yet.
const STARTING: &str = "the run is starting: it waits for its servers to be ready";

/// The run the endpoint watches, once its engine runs.
struct Watched {
    engine: Arc<Engine<Client>>,
    totals: Arc<Totals>,
}

/// What the handlers share.
#[derive(Clone)]
struct Control {
    run: Arc<OnceLock<Watched>>,
    registry: Arc<Registry>,
    token: Option<Arc<str>>,
}

/// The 503 of an endpoint that steers the engine while there is none yet.
fn starting() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": STARTING})),
    )
        .into_response()
}

/// The control endpoint, serving from [`ControlEndpoint::start`] until it is dropped.
pub(crate) struct ControlEndpoint {
    address: SocketAddr,
    run: Arc<OnceLock<Watched>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ControlEndpoint {
    /// Binds `address` (a busy one fails the run before anything is touched) and serves on
    /// a thread of its own; until [`ControlEndpoint::attach`], `/health` says the run is
    /// starting.
    pub(crate) fn start(
        address: SocketAddr,
        token: Option<String>,
    ) -> anyhow::Result<ControlEndpoint> {
        let listener = std::net::TcpListener::bind(address)
            .with_context(|| format!("--listen {address}: cannot listen there"))?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let run = Arc::new(OnceLock::new());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(RunMetrics {
            run: Arc::clone(&run),
        }));
        let control = Control {
            run: Arc::clone(&run),
            registry: Arc::new(registry),
            token: token.map(Arc::from),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the control endpoint's runtime")?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("control-endpoint".to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(error) => {
                            tracing::error!(%error, "the control endpoint cannot serve");
                            return;
                        }
                    };
                    tokio::select! {
                        result = axum::serve(listener, router(control)).into_future() => {
                            if let Err(error) = result {
                                tracing::error!(%error, "the control endpoint stopped");
                            }
                        }
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime here ends the connections still open.
            })
            .context("cannot start the control endpoint's thread")?;
        Ok(ControlEndpoint {
            address,
            run,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serves `engine` from now on.
    pub(crate) fn attach(&self, engine: Arc<Engine<Client>>, totals: Arc<Totals>) {
        let _ = self.run.set(Watched { engine, totals });
    }
}

impl Drop for ControlEndpoint {
    /// Stops serving and waits for the thread, which ends at once.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn router(control: Control) -> Router {
    let guarded = Router::new()
        .route("/metrics", get(metrics))
        .route("/model_version", post(model_version))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route_layer(middleware::from_fn_with_state(control.clone(), authorize));
    Router::new()
        .route("/health", get(health))
        .merge(guarded)
        .with_state(control)
}

/// Lets a request through when no token is set or it carries `Bearer TOKEN`.
async fn authorize(State(control): State<Control>, request: Request, next: Next) -> Response {
    let Some(token) = &control.token else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    if given.is_some_and(|given| same(given.as_bytes(), token.as_bytes())) {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(json!({"error": "this endpoint wants Authorization: Bearer TOKEN (--listen-token)"})),
    )
        .into_response()
}

/// Compares in time that depends on the lengths only, not on where the texts differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

async fn health(State(control): State<Control>) -> Response {
    let Some(watched) = control.run.get() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"healthy": false, "problem": STARTING, "starting": true})),
        )
            .into_response();
    };
    let health = watched.engine.health();
    let problem = problem(&health);
    let status = if problem.is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = json!({
        "healthy": problem.is_none(),
        "problem": problem,
        "starting": false,
        "heartbeat_age_s": health.heartbeat_age.as_secs_f64(),
        "in_flight": health.in_flight,
        "queued": health.queued,
        "model_version": health.model_version,
        "paused": health.paused,
        "admission_closed": health.admission_closed,
        "counters": health.stats,
        "groups_written": watched.totals.groups.load(Ordering::Relaxed),
        "samples_written": watched.totals.samples.load(Ordering::Relaxed),
    });
    (status, Json(body)).into_response()
}

/// Why the run is unhealthy, if it is: a stale heartbeat, or no server to send to.
fn problem(health: &Health) -> Option<String> {
    if health.heartbeat_age > STALE_HEARTBEAT {
        return Some(format!(
            "the heartbeat is {:.1}s old: the runtime's workers are blocked",
            health.heartbeat_age.as_secs_f64()
        ));
    }
    health
        .servers_unavailable
        .as_ref()
        .map(|reason| format!("no server can take requests: {reason}"))
}

async fn metrics(State(control): State<Control>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::prometheus_text::encode(&mut text, &control.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the metrics could not be encoded",
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct Version {
    version: u64,
}

async fn model_version(State(control): State<Control>, Json(body): Json<Version>) -> Response {
    let Some(watched) = control.run.get() else {
        return starting();
    };
    match watched.engine.set_model_version(body.version) {
        Ok(()) => (StatusCode::OK, Json(json!({"version": body.version}))).into_response(),
        Err(current) => (
            StatusCode::CONFLICT,
            Json(json!({
                "error": format!(
                    "model versions only grow: {} is below the current {current}",
                    body.version
                ),
                "version": current,
            })),
        )
            .into_response(),
    }
}

#[derive(Deserialize)]
struct PauseQuery {
    #[serde(default)]
    mode: PauseMode,
}

async fn pause(State(control): State<Control>, Query(query): Query<PauseQuery>) -> Response {
    let Some(watched) = control.run.get() else {
        return starting();
    };
    watched.engine.pause(query.mode).await;
    let health = watched.engine.health();
    Json(json!({"paused": true, "in_flight": health.in_flight, "queued": health.queued}))
        .into_response()
}

async fn resume(State(control): State<Control>) -> Response {
    let Some(watched) = control.run.get() else {
        return starting();
    };
    watched.engine.resume();
    Json(json!({"paused": false})).into_response()
}

/// The run's metrics at each scrape: the engine's, and what the writer has written; none
/// while the run starts.
struct RunMetrics {
    run: Arc<OnceLock<Watched>>,
}

impl fmt::Debug for RunMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunMetrics").finish_non_exhaustive()
    }
}

impl Collector for RunMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(watched) = self.run.get() else {
            return Ok(());
        };
        watched.engine.metrics().encode(&mut encoder)?;
        for (name, help, value) in [
            (
                "async_grpo_samples_written",
                "Training rows written to the output.",
                &watched.totals.samples,
            ),
            (
                "async_grpo_groups_written",
                "Groups written to the output.",
                &watched.totals.groups,
            ),
        ] {
            let counter = ConstCounter::new(value.load(Ordering::Relaxed));
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rollout_core::rollout::Stats;

    use super::*;

    fn health(heartbeat_age: Duration, servers_unavailable: Option<&str>) -> Health {
        Health {
            heartbeat_age,
            scheduler_lag_p99: Duration::ZERO,
            scheduler_lag_max: Duration::ZERO,
            in_flight: 3,
            queued: 5,
            model_version: 1,
            admission_closed: false,
            paused: false,
            servers_unavailable: servers_unavailable.map(str::to_owned),
            stats: Stats::default(),
        }
    }

    #[test]
    fn a_fresh_heartbeat_with_a_server_to_send_to_is_healthy() {
        assert_eq!(problem(&health(Duration::from_millis(200), None)), None);
        assert_eq!(problem(&health(STALE_HEARTBEAT, None)), None);
    }

    #[test]
    fn a_heartbeat_older_than_the_bound_says_the_runtime_is_blocked() {
        let stale = problem(&health(STALE_HEARTBEAT + Duration::from_millis(1500), None));
        let stale = stale.expect("a stale heartbeat is a problem");
        assert!(stale.contains("6.5s old"), "{stale}");
        assert!(stale.contains("workers are blocked"), "{stale}");
        // Blocked workers say more than a missing server: they are named first.
        let both = problem(&health(Duration::from_secs(60), Some("all ejected")));
        assert!(both.is_some_and(|p| p.contains("60.0s old")));
    }

    #[test]
    fn no_server_to_send_to_is_a_problem_with_its_reason() {
        let problem = problem(&health(Duration::ZERO, Some("every server is ejected")));
        assert_eq!(
            problem.as_deref(),
            Some("no server can take requests: every server is ejected")
        );
    }
}
