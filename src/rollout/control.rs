//! The control endpoint (`--listen`): an axum server over the running engine.
//!
//! - `GET /health`: JSON of the heartbeat's age, rollouts in flight and queued, the counters,
//!   the model version, whether admission is paused; 200 when healthy, 503 when the
//!   heartbeat is stale or no server can take requests.
//! - `GET /metrics`: the Prometheus text exposition of [`Engine::metrics`] (the same numbers
//!   the Python bridge reports), with the rows written, encoded by `prometheus-client`.
//! - `POST /model_version` `{"version": N}`: versions only grow; a lower one is a 409.
//! - `POST /pause?mode=wait|abort` and `POST /resume`: stop and restart admission; `wait`
//!   lets the rollouts in flight finish, `abort` cancels them; the pause answers once none
//!   is in flight.
//!
//! With a token (`--listen-token`), every endpoint but `/health` wants `Authorization:
//! Bearer TOKEN` (401 otherwise).

use std::{fmt, net::SocketAddr, sync::Arc, time::Duration};

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
use rollout_core::rollout::{Engine, PauseMode};
use serde::Deserialize;
use serde_json::json;
use std::sync::atomic::Ordering;
use tokio::net::TcpListener;
use vllm_client::Client;

use super::progress::Totals;

/// A heartbeat older than this makes `/health` answer 503: the runtime's workers are blocked.
const STALE_HEARTBEAT: Duration = Duration::from_secs(5);

/// What the handlers share.
#[derive(Clone)]
struct Control {
    engine: Arc<Engine<Client>>,
    totals: Arc<Totals>,
    registry: Arc<Registry>,
    token: Option<Arc<str>>,
}

/// The control endpoint's socket, bound before the run starts (a busy address fails the run
/// before anything is touched).
pub(crate) struct Listener(TcpListener);

impl Listener {
    pub(crate) async fn bind(address: SocketAddr) -> anyhow::Result<Listener> {
        let listener = TcpListener::bind(address)
            .await
            .with_context(|| format!("--listen {address}: cannot listen there"))?;
        Ok(Listener(listener))
    }

    /// Where it listens.
    pub(crate) fn address(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.0.local_addr()?)
    }

    /// Serves the endpoint over `engine` until the task is aborted.
    pub(crate) fn serve(
        self,
        engine: Arc<Engine<Client>>,
        totals: Arc<Totals>,
        token: Option<String>,
    ) -> tokio::task::JoinHandle<()> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(RunMetrics {
            engine: Arc::clone(&engine),
            totals: Arc::clone(&totals),
        }));
        let control = Control {
            engine,
            totals,
            registry: Arc::new(registry),
            token: token.map(Arc::from),
        };
        let app = router(control);
        tokio::spawn(async move {
            if let Err(error) = axum::serve(self.0, app).await {
                tracing::error!(%error, "the control endpoint stopped");
            }
        })
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
    let health = control.engine.health();
    let problem = if health.heartbeat_age > STALE_HEARTBEAT {
        Some(format!(
            "the heartbeat is {:.1}s old: the runtime's workers are blocked",
            health.heartbeat_age.as_secs_f64()
        ))
    } else {
        health
            .servers_unavailable
            .as_ref()
            .map(|reason| format!("no server can take requests: {reason}"))
    };
    let status = if problem.is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = json!({
        "healthy": problem.is_none(),
        "problem": problem,
        "heartbeat_age_s": health.heartbeat_age.as_secs_f64(),
        "in_flight": health.in_flight,
        "queued": health.queued,
        "model_version": health.model_version,
        "paused": health.paused,
        "admission_closed": health.admission_closed,
        "counters": health.stats,
        "groups_written": control.totals.groups.load(Ordering::Relaxed),
        "samples_written": control.totals.samples.load(Ordering::Relaxed),
    });
    (status, Json(body)).into_response()
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
    match control.engine.set_model_version(body.version) {
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
    control.engine.pause(query.mode).await;
    let health = control.engine.health();
    Json(json!({"paused": true, "in_flight": health.in_flight, "queued": health.queued}))
        .into_response()
}

async fn resume(State(control): State<Control>) -> Response {
    control.engine.resume();
    Json(json!({"paused": false})).into_response()
}

/// The run's metrics at each scrape: the engine's, and what the writer has written.
struct RunMetrics {
    engine: Arc<Engine<Client>>,
    totals: Arc<Totals>,
}

impl fmt::Debug for RunMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunMetrics").finish_non_exhaustive()
    }
}

impl Collector for RunMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        self.engine.metrics().encode(&mut encoder)?;
        for (name, help, value) in [
            (
                "async_grpo_samples_written",
                "Training rows written to the output.",
                &self.totals.samples,
            ),
            (
                "async_grpo_groups_written",
                "Groups written to the output.",
                &self.totals.groups,
            ),
        ] {
            let counter = ConstCounter::new(value.load(Ordering::Relaxed));
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}
