//! [`Error`]: one opaque type with predicates, in the style of reqwest and hyper.

use std::{fmt, time::Duration};

use crate::types::ServerError;

/// Why a request to vLLM failed. Boxed inside, so that a `Result` stays small.
#[derive(Debug)]
pub struct Error {
    inner: Box<Inner>,
}

#[derive(Debug)]
struct Inner {
    kind: Kind,
    /// The endpoint, e.g. `POST /v1/completions`.
    endpoint: String,
}

/// The error a transport failure carries from the HTTP stack.
pub(crate) type Source = Box<dyn std::error::Error + Send + Sync>;

/// How a connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// It could not be made (refused, no route, the connect timeout, TLS).
    Connect,
    /// No whole answer within the request's timeout.
    Timeout(Duration),
    /// It broke (reset, closed before or in the middle of the answer).
    Broken,
}

#[derive(Debug)]
enum Kind {
    /// The connection failed or broke (refused, reset, closed mid-body, timed out).
    Transport(Transport, Option<Source>),
    /// The server answered with an error status.
    Status {
        status: u16,
        server: Option<ServerError>,
        body: String,
    },
    /// The body was not the JSON expected; names the path of the offending field.
    Decode { path: String, message: String },
    /// The response body was longer than the client's cap (`max_response_bytes`).
    TooLarge { limit: usize, status: u16 },
    /// The response was well-formed but unusable (e.g. no token ids).
    Invalid(String),
    /// The deadline passed before a usable answer; the last failure before it, if any.
    Timeout(Duration, Option<Error>),
}

impl Error {
    fn new(kind: Kind, endpoint: &str) -> Error {
        Error {
            inner: Box::new(Inner {
                kind,
                endpoint: endpoint.to_owned(),
            }),
        }
    }

    pub(crate) fn transport(endpoint: &str, how: Transport, source: Option<Source>) -> Error {
        Error::new(Kind::Transport(how, source), endpoint)
    }

    pub(crate) fn from_status(endpoint: &str, status: u16, body: &[u8]) -> Error {
        let server = ServerError::parse(body);
        let body = String::from_utf8_lossy(&body[..body.len().min(2000)]).into_owned();
        Error::new(
            Kind::Status {
                status,
                server,
                body,
            },
            endpoint,
        )
    }

    pub(crate) fn decode(endpoint: &str, path: String, message: String) -> Error {
        Error::new(Kind::Decode { path, message }, endpoint)
    }

    pub(crate) fn too_large(endpoint: &str, limit: usize, status: u16) -> Error {
        Error::new(Kind::TooLarge { limit, status }, endpoint)
    }

    pub(crate) fn invalid(endpoint: &str, message: impl Into<String>) -> Error {
        Error::new(Kind::Invalid(message.into()), endpoint)
    }

    pub(crate) fn timeout(endpoint: &str, after: Duration, last: Option<Error>) -> Error {
        Error::new(Kind::Timeout(after, last), endpoint)
    }

    /// Whether the deadline (or a request timeout) passed.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self.inner.kind,
            Kind::Timeout(..) | Kind::Transport(Transport::Timeout(_), _)
        )
    }

    /// Whether the server could not be reached (refused while loading, no route).
    pub fn is_connect(&self) -> bool {
        matches!(self.inner.kind, Kind::Transport(Transport::Connect, _))
    }

    /// Whether the connection failed or broke.
    pub fn is_transport(&self) -> bool {
        matches!(self.inner.kind, Kind::Transport(..))
    }

    /// Whether the server answered with an error status.
    pub fn is_status(&self) -> bool {
        matches!(self.inner.kind, Kind::Status { .. })
    }

    /// The HTTP status, when the server answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self.inner.kind {
            Kind::Status { status, .. } => Some(status),
            _ => None,
        }
    }

    /// vLLM's own error, when its body had one.
    pub fn server_error(&self) -> Option<&ServerError> {
        match &self.inner.kind {
            Kind::Status { server, .. } => server.as_ref(),
            _ => None,
        }
    }

    /// Whether vLLM refused the request because the prompt (with `max_tokens`) does not fit
    /// its context: a 400 whose message says "maximum context length", as vLLM 0.32 words it.
    pub fn is_prompt_too_long(&self) -> bool {
        self.status() == Some(400)
            && self
                .server_error()
                .is_some_and(|e| e.message.contains("maximum context length"))
    }

    /// Whether the response body was longer than the client's cap
    /// ([`ClientConfig::max_response_bytes`](crate::ClientConfig::max_response_bytes)). Not
    /// retryable: the same request would get the same answer.
    pub fn is_too_large(&self) -> bool {
        matches!(self.inner.kind, Kind::TooLarge { .. })
    }

    /// Whether the body could not be decoded.
    pub fn is_decode(&self) -> bool {
        matches!(self.inner.kind, Kind::Decode { .. })
    }

    /// Whether trying again may help: transport errors and 5xx, never a 4xx (a prompt too
    /// long stays too long).
    pub fn is_retryable(&self) -> bool {
        match &self.inner.kind {
            Kind::Transport(..) => true,
            Kind::Status { status, .. } => *status >= 500,
            _ => false,
        }
    }

    /// The endpoint the error came from.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let endpoint = &self.inner.endpoint;
        match &self.inner.kind {
            Kind::Transport(Transport::Timeout(after), _) => {
                write!(
                    f,
                    "{endpoint}: connection failed: no answer within {after:?}"
                )
            }
            Kind::Transport(_, source) => {
                write!(f, "{endpoint}: connection failed")?;
                // hyper's errors say little on their own ("client error (Connect)"); their
                // causes say what happened ("Connection refused").
                let mut cause = source
                    .as_deref()
                    .map(|e| e as &(dyn std::error::Error + 'static));
                while let Some(error) = cause {
                    write!(f, ": {error}")?;
                    cause = error.source();
                }
                Ok(())
            }
            Kind::Status {
                status,
                server: Some(server),
                ..
            } => {
                write!(f, "{endpoint}: vLLM answered {status}: {}", server.message)?;
                if let Some(param) = &server.param {
                    write!(f, " (parameter: {param})")?;
                }
                Ok(())
            }
            Kind::Status {
                status,
                server: None,
                body,
            } => {
                write!(f, "{endpoint}: the server answered {status}: {body}")
            }
            Kind::Decode { path, message } => {
                write!(
                    f,
                    "{endpoint}: unexpected response body at `{path}`: {message}"
                )
            }
            Kind::TooLarge { limit, status } => write!(
                f,
                "{endpoint}: the response body (status {status}) is over the client's cap of \
                 {limit} bytes; the read stopped there (raise `max_response_bytes` if the \
                 server's answers are really this long)"
            ),
            Kind::Invalid(message) => write!(f, "{endpoint}: {message}"),
            Kind::Timeout(after, last) => {
                write!(f, "{endpoint}: no usable answer within {after:?}")?;
                if let Some(last) = last {
                    write!(f, "; last error: {last}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.inner.kind {
            Kind::Transport(_, Some(source)) => Some(source.as_ref()),
            Kind::Timeout(_, Some(last)) => Some(last),
            _ => None,
        }
    }
}
