//! Built-in tools from their configuration, through the dispatcher.

use serde_json::{Value, json};
use tool_dispatch::{DispatcherConfig, Outcome, ToolCall, builtin::ToolConfig};

use crate::{dispatcher, error_of};

fn tool(config: Value) -> tool_dispatch::Tool {
    serde_json::from_value::<ToolConfig>(config)
        .expect("a tool table")
        .build()
        .expect("a valid tool")
}

#[tokio::test]
async fn the_calculator_answers_and_explains_bad_expressions() {
    let dispatcher = dispatcher(
        vec![tool(json!({"name": "calc", "kind": "calculator"}))],
        DispatcherConfig::new(1),
    );
    let results = dispatcher
        .run(vec![
            ToolCall::new("calc", json!({"expression": "(17 + 3) * 2 / 5"})),
            ToolCall::new("calc", json!({"expression": "2 +* 3"})),
        ])
        .await
        .expect("open");
    assert_eq!(results[0].content, "8");
    assert_eq!(results[1].outcome, Outcome::Failed);
    assert_eq!(
        error_of(&results[1].content),
        "tool 'calc' failed: expected a number, '(' or a function at position 4 but found '*'"
    );
}

#[tokio::test]
async fn a_command_that_hangs_is_killed_at_its_timeout_and_the_turn_goes_on() {
    let hangs = tool(
        json!({"name": "hang", "kind": "command", "command": ["sleep", "30"], "timeout": "200ms"}),
    );
    let calc = tool(json!({"name": "calc", "kind": "calculator"}));
    let dispatcher = dispatcher(vec![hangs, calc], DispatcherConfig::new(1));
    let results = dispatcher
        .run(vec![
            ToolCall::new("hang", json!({})),
            ToolCall::new("calc", json!({"expression": "1 + 1"})),
        ])
        .await
        .expect("open");
    assert_eq!(
        error_of(&results[0].content),
        "tool 'hang' failed: 'sleep' timed out after 200ms and was killed"
    );
    assert_eq!(
        results[1].content, "2",
        "the next call ran on the freed thread"
    );
    assert_eq!(dispatcher.metrics().pool.stuck, 0);
}

#[tokio::test]
async fn python_runs_code_and_shows_errors_as_output() {
    let dispatcher = dispatcher(
        vec![tool(
            json!({"name": "python", "kind": "python", "timeout": "20s"}),
        )],
        DispatcherConfig::new(2),
    );
    let results = dispatcher
        .run(vec![
            ToolCall::new("python", json!({"code": "print(sum(range(10)))"})),
            ToolCall::new("python", json!({"code": "raise ValueError('bad input')"})),
        ])
        .await
        .expect("open");
    assert_eq!(
        (results[0].outcome, results[0].content.as_str()),
        (Outcome::Ok, "45")
    );
    assert_eq!(
        results[1].outcome,
        Outcome::Ok,
        "a traceback is something the model should read"
    );
    assert!(
        results[1].content.contains("ValueError: bad input")
            && results[1].content.ends_with("[exit code 1]")
    );
}

#[cfg(feature = "http")]
mod http {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A one-request HTTP server on loopback: answers `status` with `body`, and hands back the
    /// request it got.
    async fn serve_once(
        status: &'static str,
        body: &'static str,
    ) -> (String, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let url = format!("http://{}/lookup", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("a connection");
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            while !String::from_utf8_lossy(&request).contains("}") {
                let read = stream.read(&mut buffer).await.expect("read");
                if read == 0 {
                    break;
                }
                request.extend_from_slice(&buffer[..read]);
            }
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(response.as_bytes()).await.expect("write");
            String::from_utf8_lossy(&request).into_owned()
        });
        (url, server)
    }

    #[tokio::test]
    async fn an_http_tool_posts_the_arguments_and_answers_with_the_body() {
        let (url, server) = serve_once("200 OK", "Paris is the capital of France.").await;
        let lookup = tool(json!({"name": "lookup", "kind": "http", "url": url}));
        assert!(!lookup.is_sync());
        let dispatcher = dispatcher(vec![lookup], DispatcherConfig::new(1));
        let results = dispatcher
            .run(vec![ToolCall::new("lookup", json!({"query": "France"}))])
            .await
            .expect("open");

        assert_eq!(results[0].content, "Paris is the capital of France.");
        let request = server.await.expect("served");
        assert!(request.starts_with("POST /lookup HTTP/1.1"), "{request}");
        assert!(request.ends_with("{\"query\":\"France\"}"), "{request}");
    }

    #[tokio::test]
    async fn an_http_error_status_is_a_tool_error_with_the_body() {
        let (url, _server) = serve_once("503 Service Unavailable", "sandbox pool exhausted").await;
        let dispatcher = dispatcher(
            vec![tool(
                json!({"name": "lookup", "kind": "http", "url": url.clone()}),
            )],
            DispatcherConfig::new(1),
        );
        let results = dispatcher
            .run(vec![ToolCall::new("lookup", json!({}))])
            .await
            .expect("open");
        assert_eq!(results[0].outcome, Outcome::Failed);
        assert_eq!(
            error_of(&results[0].content),
            format!(
                "tool 'lookup' failed: {url} answered 503 Service Unavailable: sandbox pool exhausted"
            )
        );
    }
}
