//! [`Http`]: the HTTP stack under the client, hyper's HTTP/1.1 client with rustls for `https://`.
//!
//! It is hyper-util's pooled client, set up for thousands of requests in flight: each
//! connection reads into a 2 KiB buffer (hyper's default reserves 8 KiB per read and grows it),
//! since a connection's buffers are most of what a request in flight costs (BENCHMARKS.md,
//! "rollout: the loop").

use std::{sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Uri, header::CONTENT_TYPE};
use http_body_util::{BodyExt, Full};
use hyper::body::Body as _;
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client as Pool, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use rustls_pki_types::{CertificateDer, pem::PemObject};

use crate::error::{Error, Transport};

/// What one connection reads into at a time. Small bodies (a turn's answer is a few KiB) take a
/// few reads; a 2 KiB buffer instead of hyper's 8 KiB is a quarter of a connection's memory.
const READ_BUFFER_BYTES: usize = 2048;

/// A pooled HTTP/1.1 client. Cheap to clone: clones share the pool.
#[derive(Clone)]
pub(crate) struct Http {
    pool: Pool<HttpsConnector<HttpConnector>, Full<Bytes>>,
    max_response_bytes: usize,
}

/// How [`Http::new`] sets the stack up.
pub(crate) struct Settings<'a> {
    pub(crate) connect_timeout: Duration,
    pub(crate) max_idle_per_host: usize,
    /// PEM files whose certificates are trusted besides the system's roots.
    pub(crate) root_certificates: &'a [Vec<u8>],
    pub(crate) max_response_bytes: usize,
}

impl Http {
    /// The pool; fails on a root certificate file that holds no PEM certificate.
    pub(crate) fn new(settings: Settings<'_>) -> Result<Http, Error> {
        let tls = tls_config(settings.root_certificates)?;
        let mut connector = HttpConnector::new();
        connector.enforce_http(false);
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.connect_timeout));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let pool = Pool::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_max_idle_per_host(settings.max_idle_per_host)
            .http1_read_buf_exact_size(READ_BUFFER_BYTES)
            .build(connector);
        Ok(Http {
            pool,
            max_response_bytes: settings.max_response_bytes,
        })
    }

    /// Sends one request and reads its answer: the status and the whole body (at most
    /// `max_response_bytes`, else [`Error::is_too_large`]), within `timeout` if one is given.
    pub(crate) async fn send(
        &self,
        method: &Method,
        url: &str,
        body: Option<&Bytes>,
        endpoint: &str,
        timeout: Option<Duration>,
    ) -> Result<(u16, Bytes), Error> {
        let exchange = self.exchange(method, url, body, endpoint);
        match timeout {
            None => exchange.await,
            Some(timeout) => tokio::time::timeout(timeout, exchange)
                .await
                .unwrap_or_else(|_elapsed| {
                    Err(Error::transport(
                        endpoint,
                        Transport::Timeout(timeout),
                        None,
                    ))
                }),
        }
    }

    async fn exchange(
        &self,
        method: &Method,
        url: &str,
        body: Option<&Bytes>,
        endpoint: &str,
    ) -> Result<(u16, Bytes), Error> {
        let uri: Uri = url.parse().map_err(|e| {
            Error::invalid(
                endpoint,
                format!("the request could not be built: {url}: {e}"),
            )
        })?;
        let mut request = Request::builder().method(method.clone()).uri(uri);
        if body.is_some() {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(body.cloned().unwrap_or_default()))
            .map_err(|e| {
                Error::invalid(endpoint, format!("the request could not be built: {e}"))
            })?;
        let response = self.pool.request(request).await.map_err(|e| {
            let kind = if e.is_connect() {
                Transport::Connect
            } else {
                Transport::Broken
            };
            Error::transport(endpoint, kind, Some(Box::new(e)))
        })?;
        let status = response.status().as_u16();
        let body = read_capped(
            response.into_body(),
            self.max_response_bytes,
            status,
            endpoint,
        )
        .await?;
        Ok((status, body))
    }
}

/// rustls verifying against the system's roots (the platform's verifier, as browsers do) and
/// the given PEM files' certificates.
fn tls_config(root_certificates: &[Vec<u8>]) -> Result<rustls::ClientConfig, Error> {
    let mut extra = Vec::new();
    for pem in root_certificates {
        let certificates = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::invalid("client", format!("a root certificate is not PEM: {e}")))?;
        if certificates.is_empty() {
            return Err(Error::invalid(
                "client",
                "a root certificate file holds no PEM certificate",
            ));
        }
        extra.extend(certificates);
    }
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()));
    let tls_error = |e: rustls::Error| Error::invalid("client", format!("TLS cannot start: {e}"));
    let verifier = if extra.is_empty() {
        rustls_platform_verifier::Verifier::new(provider.clone())
    } else {
        rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
    }
    .map_err(tls_error)?;
    // ALPN is left to the connector, which offers HTTP/1.1 only.
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_error)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// A response's body, read as it arrives and no further than `limit` bytes: a body that
/// says (`Content-Length`) or turns out to be longer is [`Error::is_too_large`].
async fn read_capped(
    mut body: hyper::body::Incoming,
    limit: usize,
    status: u16,
    endpoint: &str,
) -> Result<Bytes, Error> {
    let too_large = || Error::too_large(endpoint, limit, status);
    let declared = body.size_hint().exact();
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    // A body that came in one chunk is kept as it is; only a second one starts a copy, sized
    // for the whole body when its length was declared.
    let mut first: Option<Bytes> = None;
    let mut rest: Option<BytesMut> = None;
    let mut length = 0usize;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| Error::transport(endpoint, Transport::Broken, Some(Box::new(e))))?;
        let Ok(chunk) = frame.into_data() else {
            continue; // trailers
        };
        length = length.saturating_add(chunk.len());
        if length > limit {
            return Err(too_large());
        }
        match (&mut rest, first.take()) {
            (Some(rest), _) => rest.extend_from_slice(&chunk),
            (None, None) => first = Some(chunk),
            (None, Some(head)) => {
                let capacity = declared
                    .map_or(0, |d| d as usize)
                    .max(head.len() + chunk.len());
                let mut buffer = BytesMut::with_capacity(capacity);
                buffer.extend_from_slice(&head);
                buffer.extend_from_slice(&chunk);
                rest = Some(buffer);
            }
        }
    }
    Ok(match rest {
        Some(rest) => rest.freeze(),
        None => first.unwrap_or_default(),
    })
}
