//! `http`: a tool served by an HTTP endpoint (a remote sandbox, a search service).
//!
//! What the endpoint sends back is read as untrusted: at most `max_output_bytes` of a body is
//! read (the rest is cut and the result says so), redirects are followed only within the
//! configured URL's origin and at most [`MAX_REDIRECTS`] times, and no message the model
//! reads shows the URL's credentials or query string.

use std::fmt;

use reqwest::{Url, redirect};
use serde_json::Value;

use crate::tool::{Arguments, ToolError};

/// Redirects followed per call, all within the configured URL's origin.
pub(crate) const MAX_REDIRECTS: usize = 3;

/// How much of an error status's body a tool error quotes.
const ERROR_HEAD_CHARS: usize = 500;

/// POSTs the call's arguments as JSON to `url`; a 2xx body is the result (its first
/// `max_output` bytes, then a note of what was cut), anything else a tool error with the
/// status and the start of the body. Awaited on the runtime; the dispatcher's timeout cancels
/// the request.
#[derive(Debug, Clone)]
pub(crate) struct HttpTool {
    client: reqwest::Client,
    url: Url,
    /// `url` as messages show it: no user, password, query or fragment.
    shown: String,
    max_output: usize,
}

/// Why a redirect was not followed (the message names no URL).
#[derive(Debug)]
struct RedirectRefused(&'static str);

impl fmt::Display for RedirectRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for RedirectRefused {}

impl HttpTool {
    /// A tool POSTing to `url` (`http://` or `https://`).
    pub(crate) fn new(url: &str, max_output: usize) -> Result<HttpTool, String> {
        let url = Url::parse(url).map_err(|e| format!("url is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err("url must be http://HOST[:PORT]/... or https://...".to_owned());
        }
        let origin = url.origin();
        let policy = redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > MAX_REDIRECTS {
                attempt.error(RedirectRefused("more than 3 redirects"))
            } else if attempt.url().origin() != origin {
                attempt.error(RedirectRefused(
                    "a redirect to another origin (only the configured scheme, host and port \
                     are followed)",
                ))
            } else {
                attempt.follow()
            }
        });
        let client = reqwest::Client::builder()
            .no_proxy()
            .redirect(policy)
            .build()
            .map_err(|e| format!("could not start an HTTP client: {}", chain(&e)))?;
        Ok(HttpTool {
            client,
            shown: redacted(&url),
            url,
            max_output,
        })
    }

    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let shown = &self.shown;
        let mut response = self
            .client
            .post(self.url.clone())
            .json(&Value::Object(args.into_inner()))
            .send()
            .await
            .map_err(|e| format!("POST {shown} failed: {}", chain(&e.without_url())))?;
        let status = response.status();
        let declared = response.content_length();
        let mut kept = Vec::new();
        let mut cut = false;
        while let Some(chunk) = response.chunk().await.map_err(|e| {
            format!(
                "reading the answer of {shown} failed: {}",
                chain(&e.without_url())
            )
        })? {
            let room = self.max_output.saturating_sub(kept.len());
            if chunk.len() > room {
                kept.extend_from_slice(&chunk[..room]);
                cut = true;
                // The rest is not read: an endless body must not hold the call.
                break;
            }
            kept.extend_from_slice(&chunk);
        }
        let mut body = utf8_prefix(kept);
        if !status.is_success() {
            let head: String = body.chars().take(ERROR_HEAD_CHARS).collect();
            return Err(format!("{shown} answered {status}: {head}").into());
        }
        if cut {
            let kept = body.len();
            match declared {
                Some(total) => body.push_str(&format!(
                    "\n[response truncated: {} more bytes]",
                    total.saturating_sub(kept as u64)
                )),
                None => body.push_str(&format!(
                    "\n[response truncated: only the first {kept} bytes are kept]"
                )),
            }
        }
        Ok(Value::String(body))
    }
}

/// `url` without its user, password, query and fragment.
fn redacted(url: &Url) -> String {
    let mut shown = url.clone();
    // Both fail only for URLs that cannot have credentials, which then have none to hide.
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.set_fragment(None);
    shown.to_string()
}

/// An error and its causes, `: `-separated.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The bytes as text; a character cut in two at the end is dropped, other invalid bytes
/// replaced.
fn utf8_prefix(mut bytes: Vec<u8>) -> String {
    if let Err(error) = std::str::from_utf8(&bytes)
        && error.error_len().is_none()
    {
        bytes.truncate(error.valid_up_to());
    }
    match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => String::from_utf8_lossy(error.as_bytes()).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_credentials_query_or_fragment() {
        let url = Url::parse("https://user:secret@example.com:8443/run?token=abc#x").expect("url");
        assert_eq!(redacted(&url), "https://example.com:8443/run");
    }

    #[test]
    fn a_character_cut_in_two_at_the_end_is_dropped() {
        let mut bytes = "né".as_bytes().to_vec();
        bytes.pop();
        assert_eq!(utf8_prefix(bytes), "n");
    }
}
