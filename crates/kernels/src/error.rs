//! [`KernelError`]: what can go wrong between the engine, a gateway and its kernels.

use std::{path::PathBuf, time::Duration};

/// What went wrong with a gateway or one of its kernels. None of them carries the gateway's
/// token or the credentials of its URL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The gateway's URL or token cannot be used as given.
    #[error("{0}")]
    Invalid(String),
    /// Nothing answered at the gateway's address: it is down, or the URL is wrong.
    #[error(
        "the Jupyter gateway at {url} cannot be reached ({reason}): check that it runs and that \
         the URL is right"
    )]
    Unreachable {
        /// The gateway's URL, without credentials.
        url: String,
        /// What the connection attempt said.
        reason: String,
    },
    /// The gateway took the connection but did not answer in time.
    #[error(
        "the Jupyter gateway at {url} did not answer {request} within {timeout:?}: it is \
         overloaded or stuck (a kernel that takes longer to start needs a longer start timeout)"
    )]
    TimedOut {
        /// The gateway's URL, without credentials.
        url: String,
        /// What was asked (`POST /api/kernels`, ...).
        request: String,
        /// How long the engine waited.
        timeout: Duration,
    },
    /// The gateway answered with an HTTP status that is not the request's success.
    #[error("the Jupyter gateway at {url} answered {request} with HTTP {status}{}: {body}", hint(.status))]
    Status {
        /// The gateway's URL, without credentials.
        url: String,
        /// What was asked.
        request: String,
        /// The HTTP status.
        status: u16,
        /// The start of the answer's body (its `message` when it is a JSON error), sanitised.
        body: String,
    },
    /// The gateway answered something that is not what its API says.
    #[error("{0}")]
    Protocol(String),
    /// The kernel can run no more cells: it died, its connection closed, it broke the
    /// protocol, or an earlier call on it was abandoned part-way. Its session's state is gone.
    #[error(
        "kernel {kernel} is lost: {why}. Its session's state (variables, imports, files) is \
         gone: drop it and start a new kernel"
    )]
    Lost {
        /// The kernel's id.
        kernel: String,
        /// What happened.
        why: String,
    },
    /// The lease file could not be read or written.
    #[error(
        "the lease file {} cannot be used ({source}): it must be in a folder the engine can \
         write to",
        path.display()
    )]
    Leases {
        /// The lease file.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
}

impl KernelError {
    /// Whether the kernel this came from is lost ([`KernelError::Lost`]): the caller drops it,
    /// and the next cell of the rollout needs a new kernel.
    pub fn is_lost(&self) -> bool {
        matches!(self, KernelError::Lost { .. })
    }
}

fn hint(status: &u16) -> &'static str {
    match status {
        401 => " (the gateway wants a token, or another one)",
        403 => " (forbidden: a wrong token, or the gateway's kernel limit)",
        404 => " (no such kernel or endpoint: is the URL a Jupyter gateway's?)",
        _ => "",
    }
}

/// The start of an HTTP body for an error message: a JSON error's `message` when it has one,
/// else the text; at most 300 characters, control characters replaced.
pub(crate) fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|value| {
            value
                .get("message")
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| text.into_owned());
    let mut out: String = message
        .trim()
        .chars()
        .take(300)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if message.trim().chars().count() > 300 {
        out.push('…');
    }
    if out.is_empty() {
        out.push_str("(an empty body)");
    }
    out
}

/// An error's message with its sources, as one line.
pub(crate) fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !out.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        source = cause.source();
    }
    out
}
