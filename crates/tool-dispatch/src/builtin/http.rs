//! `http`: a tool served by an HTTP endpoint (a remote sandbox, a search service).

use serde_json::Value;

use crate::tool::{Arguments, ToolError};

/// POSTs the call's arguments as JSON to `url`; a 2xx body is the result, anything else a
/// tool error with the status and the start of the body. Awaited on the runtime; the
/// dispatcher's timeout cancels the request.
#[derive(Debug, Clone)]
pub(crate) struct HttpTool {
    pub(crate) client: reqwest::Client,
    pub(crate) url: String,
}

impl HttpTool {
    pub(crate) async fn call(self, args: Arguments) -> Result<Value, ToolError> {
        let response = self
            .client
            .post(&self.url)
            .json(&Value::Object(args.into_inner()))
            .send()
            .await
            .map_err(|e| format!("POST {} failed: {e}", self.url))?;
        let status = response.status();
        let body = response
            .text()
            .await
            .map_err(|e| format!("reading the answer of {} failed: {e}", self.url))?;
        if !status.is_success() {
            let head: String = body.chars().take(500).collect();
            return Err(format!("{} answered {status}: {head}", self.url).into());
        }
        Ok(Value::String(body))
    }
}
