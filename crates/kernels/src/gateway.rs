//! [`Gateway`]: a Jupyter gateway's REST API (start and delete kernels), its leases, and the
//! connection to a kernel's channels.

use std::{fmt, path::PathBuf, sync::Arc, time::Duration};

use futures::StreamExt;
use reqwest::{
    Method, StatusCode, Url,
    header::{AUTHORIZATION, HeaderValue},
};
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio_tungstenite::{
    WebSocketStream, client_async_with_config,
    tungstenite::{self, client::IntoClientRequest, protocol::WebSocketConfig},
};

use crate::{
    Kernel, KernelError,
    error::{describe, excerpt},
    kernel::{Owned, random_id},
    leases::{Leases, valid_id},
};

/// How long a TCP connection to the gateway may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request but a kernel's start may take, and opening a kernel's WebSocket.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a kernel may take to start and answer its first request (Enterprise Gateway
/// schedules a pod, which can pull an image).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// The largest WebSocket message (and frame) a kernel may send. A larger one (a cell that
/// prints more than this between two flushes of its output) loses the kernel.
const MAX_MESSAGE: usize = 16 << 20;
/// The largest REST answer read.
const MAX_BODY: usize = 1 << 20;
/// A DELETE that fails with a server error is tried again this many times, after a pause
/// doubled each time: a kernel that died and is being restarted cannot be deleted until it is
/// up again (jupyter_client 8.10 answers HTTP 500 meanwhile), which takes a second or two.
const DELETE_RETRIES: u32 = 4;
const DELETE_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Leftover kernels deleted at once by [`Gateway::reap_leases`].
const REAP_CONCURRENCY: usize = 8;

/// A Jupyter gateway (Kernel Gateway or Enterprise Gateway) the engine starts kernels on.
/// Cheap to clone; clones share the lease file.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

/// What a gateway and its kernels share.
#[derive(Clone)]
pub(crate) struct Shared {
    /// The gateway's URL, its path ending in `/`.
    base: Url,
    /// The URL for messages: no credentials, no query.
    pub(crate) shown: String,
    /// `Authorization: token …`, marked sensitive.
    auth: Option<HeaderValue>,
    pub(crate) http: reqwest::Client,
    /// For `https://` gateways: rustls with the platform's verifier, for the WebSocket.
    tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) leases: Option<Arc<Leases>>,
    /// Deletes of dropped kernels in flight.
    pub(crate) deleting: Arc<InFlight>,
    request_timeout: Duration,
    pub(crate) start_timeout: Duration,
    max_message: usize,
}

impl fmt::Debug for Gateway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gateway")
            .field("url", &self.shared.shown)
            .field("token", &self.shared.auth.as_ref().map(|_| "…"))
            .field("leases", &self.shared.leases.as_ref().map(|l| l.dir()))
            .finish_non_exhaustive()
    }
}

/// The channels WebSocket of a kernel, over TCP or TLS.
pub(crate) type Socket = WebSocketStream<Box<dyn Io>>;

/// A byte stream a WebSocket runs over.
pub(crate) trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

impl Gateway {
    /// The gateway at `url` (`http://` or `https://`, with the path it is served under, if
    /// any), with `token` sent as `Authorization: token <token>` when given. Nothing is
    /// contacted yet.
    pub fn new(url: &str, token: Option<String>) -> Result<Gateway, KernelError> {
        let invalid = |why: &str| KernelError::Invalid(format!("the gateway URL {why}"));
        let mut base = Url::parse(url).map_err(|e| invalid(&format!("cannot be parsed: {e}")))?;
        let mut hidden = base.clone();
        let _ = hidden.set_username("");
        let _ = hidden.set_password(None);
        hidden.set_query(None);
        hidden.set_fragment(None);
        let shown = hidden.to_string();
        let shown = shown.strip_suffix('/').unwrap_or(&shown).to_owned();
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid(&format!("{shown} is not http:// or https://")));
        }
        if base.host().is_none() {
            return Err(invalid(&format!("{shown} names no host")));
        }
        base.set_query(None);
        base.set_fragment(None);
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let auth = match token {
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("token {token}")).map_err(|_| {
                    KernelError::Invalid(
                        "the gateway token is not a valid HTTP header value (it holds a line \
                         break or a control character)"
                            .to_owned(),
                    )
                })?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let tls = match base.scheme() {
            "https" => Some(Arc::new(tls_config()?)),
            _ => None,
        };
        Ok(Gateway {
            shared: Arc::new(Shared {
                base,
                shown,
                auth,
                http: http_client()?,
                tls,
                leases: None,
                deleting: Arc::default(),
                request_timeout: REQUEST_TIMEOUT,
                start_timeout: START_TIMEOUT,
                max_message: MAX_MESSAGE,
            }),
        })
    }

    /// With the lease folder `dir`: each kernel is recorded in this engine's file there when
    /// it starts and released when it is deleted, and [`reap_leases`](Self::reap_leases)
    /// deletes those that engines which are gone left. The folder is made if it is missing.
    /// Engines may share a folder: none reaps a live one's kernels.
    pub fn with_lease_dir(mut self, dir: impl Into<PathBuf>) -> Gateway {
        Arc::make_mut(&mut self.shared).leases = Some(Arc::new(Leases::new(dir.into())));
        self
    }

    /// With `timeout` for each request but a kernel's start, and for opening a kernel's
    /// WebSocket (default 30 s).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Gateway {
        Arc::make_mut(&mut self.shared).request_timeout = timeout;
        self
    }

    /// With `timeout` for a kernel's start, until it answers its first request (default
    /// 120 s).
    pub fn with_start_timeout(mut self, timeout: Duration) -> Gateway {
        Arc::make_mut(&mut self.shared).start_timeout = timeout;
        self
    }

    /// With `bytes` as the largest WebSocket message a kernel may send (default 16 MiB). A
    /// larger one loses the kernel.
    pub fn with_max_message(mut self, bytes: usize) -> Gateway {
        Arc::make_mut(&mut self.shared).max_message = bytes.max(4096);
        self
    }

    /// The gateway's URL, without credentials.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// Starts a kernel (`POST /api/kernels`; `kernel_name` is a kernelspec, else the
    /// gateway's default), records it in the lease file, opens its channels WebSocket and
    /// waits until it answers a `kernel_info_request`. A kernel that could not be made ready
    /// is deleted; so is one whose start is abandoned part-way (its future dropped).
    pub async fn start(&self, kernel_name: Option<&str>) -> Result<Kernel, KernelError> {
        let shared = &self.shared;
        let body = match kernel_name {
            Some(name) => serde_json::json!({ "name": name }),
            None => serde_json::json!({}),
        };
        let request = "POST /api/kernels";
        let (status, bytes) = shared
            .call(
                &shared.http,
                Method::POST,
                shared.endpoint("api/kernels")?,
                Some(body),
                shared.start_timeout,
                request,
            )
            .await?;
        if !matches!(status, StatusCode::CREATED | StatusCode::OK) {
            return Err(shared.status(request, status, &bytes));
        }
        #[derive(Deserialize)]
        struct Model {
            id: String,
        }
        let model: Model = serde_json::from_slice(&bytes).map_err(|e| {
            KernelError::Protocol(format!(
                "the Jupyter gateway at {} answered {request} with no kernel model ({e}): is \
                 it a Jupyter gateway?",
                shared.shown
            ))
        })?;
        if !valid_id(&model.id) {
            return Err(KernelError::Protocol(format!(
                "the Jupyter gateway at {} answered {request} with a kernel id that is not one \
                 ({:?})",
                shared.shown,
                model.id.chars().take(64).collect::<String>()
            )));
        }
        // From here the kernel exists: whatever happens, it is deleted unless handed over.
        let mut owned = Owned::new(Arc::clone(shared), model.id);
        if let Some(leases) = &shared.leases
            && let Err(error) = leases.add(owned.id())
        {
            let _ = owned.delete().await;
            return Err(error);
        }
        owned.leased = shared.leases.is_some();
        let session = random_id();
        let socket = match shared.connect(owned.id(), &session).await {
            Ok(socket) => socket,
            Err(error) => {
                let _ = owned.delete().await;
                return Err(error);
            }
        };
        let mut kernel = Kernel::new(owned, socket, session);
        if let Err(error) = kernel.ready().await {
            let _ = kernel.close().await;
            return Err(error);
        }
        Ok(kernel)
    }

    /// Deletes the kernels that engines which are gone (killed before they could delete them)
    /// left in the lease folder, and their lease files; says how many the gateway still had.
    /// Call it before the run starts kernels. Without a lease folder it deletes nothing.
    pub async fn reap_leases(&self) -> Result<usize, KernelError> {
        let shared = &self.shared;
        let Some(leases) = &shared.leases else {
            return Ok(0);
        };
        std::fs::create_dir_all(leases.dir()).map_err(|source| KernelError::Leases {
            path: leases.dir().to_owned(),
            source,
        })?;
        let mut reaped = 0;
        let mut failure = None;
        for left in leases.left()? {
            // Owned ids and a clone of `shared` per delete: the future stays `Send` for
            // any caller (borrowing closures here trip rustc's higher-ranked `Send` check).
            let deletes = left.held.iter().cloned().map(|id| {
                let shared = Arc::clone(shared);
                async move {
                    let outcome = shared.delete(&shared.http, &id).await;
                    (id, outcome)
                }
            });
            let outcomes: Vec<(String, Result<bool, KernelError>)> = futures::stream::iter(deletes)
                .buffer_unordered(REAP_CONCURRENCY)
                .collect()
                .await;
            let mut still_held = std::collections::BTreeSet::new();
            for (id, outcome) in outcomes {
                match outcome {
                    Ok(deleted) => reaped += usize::from(deleted),
                    Err(error) => {
                        still_held.insert(id);
                        failure = failure.or(Some(error));
                    }
                }
            }
            if let Err(error) = left.finish(&still_held) {
                failure = failure.or(Some(error));
            }
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(reaped),
        }
    }

    /// Waits until the kernels dropped without [`Kernel::close`] are deleted (their deletes
    /// run in the background): call it before the runtime shuts down, bounded by a timeout of
    /// the caller's, so that the last rollouts' kernels do not outlive the engine.
    pub async fn settle(&self) {
        self.shared.deleting.settled().await;
    }
}

impl Shared {
    /// `path` under the gateway's URL.
    fn endpoint(&self, path: &str) -> Result<Url, KernelError> {
        self.base.join(path).map_err(|e| {
            KernelError::Invalid(format!(
                "the gateway URL {} cannot take the path {path}: {e}",
                self.shown
            ))
        })
    }

    /// Deletes kernel `id` (`DELETE /api/kernels/{id}`) with `client`: `true` if the gateway
    /// had it, `false` if it had not (deleted already, culled).
    pub(crate) async fn delete(
        &self,
        client: &reqwest::Client,
        id: &str,
    ) -> Result<bool, KernelError> {
        let request = format!("DELETE /api/kernels/{id}");
        let url = self.endpoint(&format!("api/kernels/{id}"))?;
        let mut pause = DELETE_RETRY_PAUSE;
        let mut retries = 0;
        loop {
            let (status, body) = self
                .call(
                    client,
                    Method::DELETE,
                    url.clone(),
                    None,
                    self.request_timeout,
                    &request,
                )
                .await?;
            match status {
                s if s.is_success() => return Ok(true),
                StatusCode::NOT_FOUND => return Ok(false),
                s if s.is_server_error() && retries < DELETE_RETRIES => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    retries += 1;
                }
                s => return Err(self.status(&request, s, &body)),
            }
        }
    }

    /// One request, its answer's status and body (the first [`MAX_BODY`] bytes), within
    /// `timeout`.
    async fn call(
        &self,
        client: &reqwest::Client,
        method: Method,
        url: Url,
        body: Option<serde_json::Value>,
        timeout: Duration,
        request: &str,
    ) -> Result<(StatusCode, Vec<u8>), KernelError> {
        let mut builder = client.request(method, url).timeout(timeout);
        if let Some(auth) = &self.auth {
            builder = builder.header(AUTHORIZATION, auth.clone());
        }
        if let Some(body) = body {
            builder = builder.json(&body);
        }
        let failed = |error: reqwest::Error| {
            if error.is_timeout() {
                KernelError::TimedOut {
                    url: self.shown.clone(),
                    request: request.to_owned(),
                    timeout,
                }
            } else {
                KernelError::Unreachable {
                    url: self.shown.clone(),
                    reason: describe(&error.without_url()),
                }
            }
        };
        let mut response = builder.send().await.map_err(failed)?;
        let status = response.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            let room = MAX_BODY - bytes.len();
            bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if chunk.len() >= room {
                break;
            }
        }
        Ok((status, bytes))
    }

    fn status(&self, request: &str, status: StatusCode, body: &[u8]) -> KernelError {
        KernelError::Status {
            url: self.shown.clone(),
            request: request.to_owned(),
            status: status.as_u16(),
            body: excerpt(body),
        }
    }

    /// Opens kernel `id`'s channels WebSocket (`/api/kernels/{id}/channels`) for the
    /// engine's Jupyter session `session`, within the request timeout, its messages bounded.
    async fn connect(&self, id: &str, session: &str) -> Result<Socket, KernelError> {
        let mut url = self.endpoint(&format!("api/kernels/{id}/channels"))?;
        url.set_query(Some(&format!("session_id={session}")));
        let scheme = if self.tls.is_some() { "wss" } else { "ws" };
        if url.set_scheme(scheme).is_err() {
            return Err(KernelError::Invalid(format!(
                "the gateway URL {} cannot be made a WebSocket URL",
                self.shown
            )));
        }
        let request = format!("GET /api/kernels/{id}/channels (WebSocket)");
        let unreachable = |reason: String| KernelError::Unreachable {
            url: self.shown.clone(),
            reason,
        };
        let open = async {
            // An IPv6 host is bracketed in a URL, not in a socket address.
            let Some(host) = url.host_str() else {
                return Err(unreachable("no host".to_owned()));
            };
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = url.port_or_known_default().unwrap_or(80);
            let tcp = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| unreachable(describe(&e)))?;
            let _ = tcp.set_nodelay(true);
            let stream: Box<dyn Io> = match &self.tls {
                Some(config) => {
                    let name = rustls_pki_types::ServerName::try_from(host.clone())
                        .map_err(|e| unreachable(format!("{host} is no TLS server name: {e}")))?;
                    let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
                        .connect(name, tcp)
                        .await
                        .map_err(|e| unreachable(format!("TLS: {}", describe(&e))))?;
                    Box::new(tls)
                }
                None => Box::new(tcp),
            };
            let mut handshake = url.as_str().into_client_request().map_err(|e| {
                KernelError::Invalid(format!(
                    "the kernel's WebSocket URL cannot be requested: {e}"
                ))
            })?;
            if let Some(auth) = &self.auth {
                handshake.headers_mut().insert(AUTHORIZATION, auth.clone());
            }
            let config = WebSocketConfig::default()
                .max_message_size(Some(self.max_message))
                .max_frame_size(Some(self.max_message));
            match client_async_with_config(handshake, stream, Some(config)).await {
                Ok((socket, _)) => Ok(socket),
                Err(tungstenite::Error::Http(response)) => {
                    let body = response.body().as_deref().unwrap_or_default();
                    Err(KernelError::Status {
                        url: self.shown.clone(),
                        request: request.clone(),
                        status: response.status().as_u16(),
                        body: excerpt(body),
                    })
                }
                Err(error) => Err(unreachable(format!("WebSocket: {}", describe(&error)))),
            }
        };
        tokio::time::timeout(self.request_timeout, open)
            .await
            .map_err(|_| KernelError::TimedOut {
                url: self.shown.clone(),
                request: request.clone(),
                timeout: self.request_timeout,
            })?
    }
}

/// A count of background work, and a wait for it to be none.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    none: tokio::sync::Notify,
}

impl InFlight {
    /// One more, until the guard is dropped.
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlightGuard(Arc::clone(self))
    }

    async fn settled(&self) {
        loop {
            let none = self.none.notified();
            tokio::pin!(none);
            none.as_mut().enable();
            if self.count.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            none.await;
        }
    }
}

/// One piece of background work of an [`InFlight`].
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self
            .0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.none.notify_waiters();
        }
    }
}

/// The HTTP client: bounded connection time; each request has its own timeout.
pub(crate) fn http_client() -> Result<reqwest::Client, KernelError> {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .map_err(|e| KernelError::Invalid(format!("no HTTP client: {}", describe(&e))))
}

/// rustls verifying against the system's roots (the platform's verifier), for `wss://`.
fn tls_config() -> Result<rustls::ClientConfig, KernelError> {
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()));
    let failed = |e: rustls::Error| KernelError::Invalid(format!("TLS cannot start: {e}"));
    let verifier = rustls_platform_verifier::Verifier::new(provider.clone()).map_err(failed)?;
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(failed)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}
