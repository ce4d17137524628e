//! The control endpoint (`--listen`): an axum server over the running engine.
//!
//! - `GET /health`: JSON of the heartbeat's age, rollouts in flight and queued, the counters,
//!   the model version, whether admission is paused; 200 when healthy, 503 while the run
//!   starts (it waits for its servers), when the heartbeat is stale or when no server can
//!   take requests.
//! - `GET /metrics`: the Prometheus text exposition of [`Engine::metrics`] (the same numbers
//!   the Python bridge reports), with the rows written, encoded by `prometheus-client`.
//! - `POST /model_version` `{"version": N}`: versions only grow; a lower one is a 409.
//!   Without a token, a version more than [`MAX_VERSION_STEP`] above the current one is a
//!   422 (with one, any version goes).
//! - `POST /pause?mode=wait|abort|continue` and `POST /resume`: stop and restart admission
//!   (`mode` defaults to the run's `in_flight`); `wait` lets the rollouts in flight finish,
//!   `abort` cancels them, `continue` interrupts their requests and holds them until the
//!   resume (set the new `/model_version` first); the pause answers once none (with
//!   `continue`: once no request is on the wire)
//!   is in flight.
//!
//! The model being trained is untrusted, and the programs it drives run on this machine, so
//! the endpoint is guarded ([`check_token`] and [`check_address`] at the checks, [`guard`] on every request):
//!
//! - With a token (`--listen-token`), every endpoint but `/health` wants `Authorization:
//!   Bearer TOKEN` (401 otherwise), compared whole and in constant time. An empty token, or
//!   one that cannot travel in a header, is refused at the checks; so is an address other
//!   machines reach (anything but 127.0.0.0/8 and ::1) without a token.
//! - A request without the token whose Host is not this endpoint (`localhost`, a loopback
//!   address or the address listened on, any port) is a 421: a web page that rebinds its
//!   own name to 127.0.0.1 cannot read or steer the run. A page cannot know the token, so a
//!   request carrying it passes whatever name it used (a trainer on another machine may say
//!   the host's name).
//! - A POST carrying an `Origin` other than the endpoint's own is a 403: a web page open in
//!   a browser on this machine cannot pause, resume or move the model version.
//!
//! The endpoint runs on a thread of its own with a runtime of its own, from the start of
//! the run to its end: it answers while the run still waits for its servers, and it can say
//! that the engine's runtime is blocked, which a server on that runtime could not.

use std::{
    fmt,
    future::IntoFuture,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, OnceLock},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Context;
use async_grpo_run::listen::{self, is_loopback};
use axum::{
    Json, Router,
    extract::{Query, Request, State},
    http::{Method, StatusCode, header},
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
use rollout::{Engine, Health, InFlight};
use serde::Deserialize;
use serde_json::json;
use std::sync::atomic::Ordering;
use tokio::{net::TcpListener, sync::oneshot};
use vllm_client::Client;

use super::progress::Totals;

/// A heartbeat older than this makes `/health` answer 503: the runtime's workers are blocked.
const STALE_HEARTBEAT: Duration = Duration::from_secs(5);

/// Without a token, how far above the current model version a posted one may be: a trainer
/// moves its version by one (or by its steps) at a time, and a program that reaches the
/// endpoint cannot push the version out of reach of the trainer's (up to `u64::MAX`).
pub(crate) const MAX_VERSION_STEP: u64 = 1_000_000;

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
    /// Where the endpoint listens: the Host a request may name besides loopback ones.
    address: SocketAddr,
}

/// How a refusal says to set the endpoint's token.
pub(crate) const SET_TOKEN: &str = "--listen-token TOKEN or ASYNC_GRPO_LISTEN_TOKEN";

/// Refuses, before anything runs, a token that guards nothing: an empty one, or one an
/// `Authorization` header cannot carry.
pub(crate) fn check_token(token: &str) -> Result<(), String> {
    listen::check_token(
        token,
        &format!("the control endpoint's token ({SET_TOKEN})"),
    )
}

/// Refuses, before anything runs, an address other machines reach (anything but
/// 127.0.0.0/8 and ::1) when no token is set: anyone reaching it could steer the run.
pub(crate) fn check_address(address: SocketAddr, token_set: bool) -> Result<(), String> {
    listen::check_reach(address, token_set, SET_TOKEN)
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
    /// starting. The settings passed [`check_token`] and
    /// [`check_address`] before.
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
            address,
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
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/model_version", post(model_version))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .layer(middleware::from_fn_with_state(control.clone(), guard))
        .with_state(control)
}

/// Lets a request through when it names this endpoint (or carries the token), when it
/// does not come from a web page of another origin (POSTs), and when it carries the token
/// if one is set (all but `/health`).
async fn guard(State(control): State<Control>, request: Request, next: Next) -> Response {
    let authorized = control.token.as_deref().is_some_and(|token| {
        bearer(&request).is_some_and(|given| same(given.as_bytes(), token.as_bytes()))
    });
    let host = request
        .headers()
        .get(header::HOST)
        .map(|value| value.to_str().unwrap_or_default());
    // HTTP/1.1 lets a request name its host in its target too (absolute form), and that
    // name wins over the Host header.
    let named = [request.uri().authority().map(|a| a.as_str()), host];
    if !authorized
        && named
            .iter()
            .flatten()
            .any(|name| !names_this_endpoint(name, control.address))
    {
        return refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "this endpoint answers to localhost, a loopback address or the address it listens \
             on (or to a request with its token), not to the host this request names",
        );
    }
    if request.method() != Method::GET
        && request.method() != Method::HEAD
        && let Some(origin) = request.headers().get(header::ORIGIN)
        && !host.is_some_and(|host| {
            origin
                .to_str()
                .is_ok_and(|origin| origin.eq_ignore_ascii_case(&format!("http://{host}")))
        })
    {
        return refuse(
            StatusCode::FORBIDDEN,
            "a web page of another origin may not steer this run (the request carries an \
             Origin header that is not this endpoint's)",
        );
    }
    if control.token.is_some() && !authorized && request.uri().path() != "/health" {
        let mut response = refuse(
            StatusCode::UNAUTHORIZED,
            "this endpoint wants Authorization: Bearer TOKEN (--listen-token)",
        );
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return response;
    }
    next.run(request).await
}

/// The token of `Authorization: Bearer TOKEN`, if the request carries one.
fn bearer(request: &Request) -> Option<&str> {
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
}

/// A refusal with its reason as JSON.
fn refuse(status: StatusCode, error: &str) -> Response {
    (status, Json(json!({"error": error}))).into_response()
}

/// Whether `host` (`NAME` or `NAME:PORT`) names the endpoint listening on `listening`:
/// `localhost`, a loopback address, or the address listened on, with any port or none.
/// Listening on every address (0.0.0.0 or ::), any IP address is this endpoint's: a page
/// that rebinds a name to this machine says the name, never an address.
fn names_this_endpoint(host: &str, listening: SocketAddr) -> bool {
    let digits = |port: &str| port.bytes().all(|b| b.is_ascii_digit());
    let ip = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, "")) => ip.parse::<Ipv6Addr>().map(IpAddr::V6),
            Some((ip, port)) if port.strip_prefix(':').is_some_and(digits) => {
                ip.parse::<Ipv6Addr>().map(IpAddr::V6)
            }
            _ => return false,
        },
        None => {
            let name = match host.rsplit_once(':') {
                Some((name, port)) if digits(port) => name,
                Some(_) => return false,
                None => host,
            };
            if name.eq_ignore_ascii_case("localhost") {
                return true;
            }
            name.parse::<Ipv4Addr>().map(IpAddr::V4)
        }
    };
    ip.is_ok_and(|ip| is_loopback(ip) || ip == listening.ip() || listening.ip().is_unspecified())
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
    let current = watched.engine.model_version();
    if control.token.is_none() && body.version > current.saturating_add(MAX_VERSION_STEP) {
        // Versions only grow, so a concurrent post only makes this bound stricter.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({
                "error": format!(
                    "model version {} is more than {MAX_VERSION_STEP} above the current \
                     {current}: without --listen-token a version grows by at most \
                     {MAX_VERSION_STEP} at a time",
                    body.version
                ),
                "version": current,
            })),
        )
            .into_response();
    }
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
    /// The run's `in_flight` when not given.
    mode: Option<InFlight>,
}

async fn pause(State(control): State<Control>, Query(query): Query<PauseQuery>) -> Response {
    let Some(watched) = control.run.get() else {
        return starting();
    };
    Json(async_grpo_run::control::pause(&watched.engine, query.mode).await).into_response()
}

async fn resume(State(control): State<Control>) -> Response {
    let Some(watched) = control.run.get() else {
        return starting();
    };
    Json(async_grpo_run::control::resume(&watched.engine)).into_response()
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
    use rollout::Stats;

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
    fn a_host_names_this_endpoint_when_it_is_loopback_or_the_address_listened_on() {
        let on = |address: &str| address.parse::<SocketAddr>().expect("an address");
        let loopback = on("127.0.0.1:9090");
        for host in [
            "localhost",
            "LocalHost:9090",
            "127.0.0.1",
            "127.0.0.1:9090",
            "127.200.1.2:1",
            "[::1]",
            "[::1]:9090",
            "[::ffff:127.0.0.1]:9090",
        ] {
            assert!(names_this_endpoint(host, loopback), "{host}");
        }
        for host in [
            "",
            "attacker.example",
            "attacker.example:9090",
            "localhost.attacker.example",
            "127.0.0.1.attacker.example",
            "localhost:x",
            "127.0.0.1:9090:9090",
            "[::1",
            "[::1]x",
            "::1",
            "10.0.0.5:9090",
            "0.0.0.0:9090",
        ] {
            assert!(!names_this_endpoint(host, loopback), "{host}");
        }
        let exposed = on("10.0.0.5:9090");
        assert!(names_this_endpoint("10.0.0.5:9090", exposed));
        assert!(names_this_endpoint("localhost:9090", exposed));
        assert!(!names_this_endpoint("10.0.0.6:9090", exposed));
        assert!(!names_this_endpoint("trainer-node:9090", exposed));
        // Listening on every address: any address names it, a name other than localhost not.
        for every in [on("0.0.0.0:9090"), on("[::]:9090")] {
            assert!(names_this_endpoint("10.0.0.6:9090", every));
            assert!(names_this_endpoint("[fd00::1]:9090", every));
            assert!(!names_this_endpoint("trainer-node:9090", every));
        }
    }

    #[test]
    fn the_endpoints_refusals_say_how_to_set_its_token() {
        let exposed = "0.0.0.0:9090".parse::<SocketAddr>().expect("an address");
        let refused = check_address(exposed, false).expect_err("exposed without a token");
        assert!(refused.contains("--listen-token"), "{refused}");
        assert!(refused.contains("ASYNC_GRPO_LISTEN_TOKEN"), "{refused}");
        assert_eq!(check_address(exposed, true), Ok(()));
        let empty = check_token("").expect_err("an empty token");
        assert!(empty.starts_with("the control endpoint's token"), "{empty}");
    }

    #[test]
    fn tokens_are_the_same_only_when_whole() {
        assert!(same(b"s3cret", b"s3cret"));
        for other in [&b"s3cre"[..], b"s3cretX", b"", b"s3creT"] {
            assert!(!same(other, b"s3cret"), "{other:?}");
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
