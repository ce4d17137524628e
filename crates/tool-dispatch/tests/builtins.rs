//! Built-in tools from their configuration, through the dispatcher.

use async_grpo_tool_dispatch::{DispatcherConfig, Outcome, ToolCall, builtin::ToolConfig};
use serde_json::{Value, json};

use crate::{dispatcher, error_of, within};

fn tool(config: Value) -> async_grpo_tool_dispatch::Tool {
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
    let results = within(
        "the calculator's turn",
        dispatcher.run(vec![
            ToolCall::new("calc", json!({"expression": "(17 + 3) * 2 / 5"})),
            ToolCall::new("calc", json!({"expression": "2 +* 3"})),
        ]),
    )
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
    // The hanging command is killed after 200 ms; the calculator then runs on the freed
    // thread. A thread never freed fails here, saying so, long before the suite's timeout.
    let results = within(
        "a turn whose hanging command is killed at 200 ms",
        dispatcher.run(vec![
            ToolCall::new("hang", json!({})),
            ToolCall::new("calc", json!({"expression": "1 + 1"})),
        ]),
    )
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
    let results = within(
        "two Python calls",
        dispatcher.run(vec![
            ToolCall::new("python", json!({"code": "print(sum(range(10)))"})),
            ToolCall::new("python", json!({"code": "raise ValueError('bad input')"})),
        ]),
    )
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
        let results = within(
            "the lookup",
            dispatcher.run(vec![ToolCall::new("lookup", json!({"query": "France"}))]),
        )
        .await
        .expect("open");

        assert_eq!(results[0].content, "Paris is the capital of France.");
        let request = within("the server's one request", server)
            .await
            .expect("served");
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
        let results = within(
            "the lookup",
            dispatcher.run(vec![ToolCall::new("lookup", json!({}))]),
        )
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

    /// A loopback server that answers its connections, one request each, with `answers` in
    /// order (`{port}` in one becomes the server's own port), then an endless chunked 200 to
    /// any further one; hands back its base URL and the requests it got.
    async fn serve(
        answers: Vec<String>,
    ) -> (
        String,
        std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("addr").port();
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = requests.clone();
        let server = tokio::spawn(async move {
            let mut answers = answers.into_iter();
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                loop {
                    let text = String::from_utf8_lossy(&request).into_owned();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|n| n.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(read) => request.extend_from_slice(&buffer[..read]),
                    }
                }
                seen.lock()
                    .expect("not poisoned")
                    .push(String::from_utf8_lossy(&request).into_owned());
                match answers.next() {
                    Some(answer) => {
                        let answer = answer.replace("{port}", &port.to_string());
                        let _ = stream.write_all(answer.as_bytes()).await;
                    }
                    None => {
                        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
                        if stream.write_all(head.as_bytes()).await.is_ok() {
                            let mut chunk = b"1000\r\n".to_vec();
                            chunk.extend(std::iter::repeat_n(b'x', 0x1000));
                            chunk.extend_from_slice(b"\r\n");
                            while stream.write_all(&chunk).await.is_ok() {}
                        }
                    }
                }
            }
        });
        (format!("http://127.0.0.1:{port}"), requests, server)
    }

    fn answer(status: &str, headers: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    async fn call_once(config: Value) -> async_grpo_tool_dispatch::ToolResult {
        let dispatcher = dispatcher(vec![tool(config)], DispatcherConfig::new(1));
        let mut results = within(
            "the lookup",
            dispatcher.run(vec![ToolCall::new("lookup", json!({"query": "France"}))]),
        )
        .await
        .expect("open");
        results.remove(0)
    }

    #[tokio::test]
    async fn an_endless_http_body_is_cut_at_max_output_bytes() {
        let (base, _requests, _server) = serve(Vec::new()).await;
        let result = call_once(json!({
            "name": "lookup", "kind": "http", "url": format!("{base}/lookup"),
            "max_output_bytes": 1000, "timeout": "10s"
        }))
        .await;
        assert_eq!(result.outcome, Outcome::Ok, "{}", result.content);
        assert_eq!(
            result.content,
            format!(
                "{}\n[response truncated: only the first 1000 bytes are kept]",
                "x".repeat(1000)
            )
        );
    }

    #[tokio::test]
    async fn a_long_http_body_is_cut_and_says_how_much() {
        let body = "y".repeat(20_000);
        let (base, _requests, _server) = serve(vec![answer("200 OK", "", &body)]).await;
        let result =
            call_once(json!({"name": "lookup", "kind": "http", "url": format!("{base}/lookup")}))
                .await;
        assert_eq!(
            result.content,
            format!(
                "{}\n[response truncated: {} more bytes]",
                "y".repeat(16384),
                20_000 - 16384
            )
        );
    }

    #[tokio::test]
    async fn an_http_redirect_to_another_port_is_refused_and_not_followed() {
        let (elsewhere, elsewhere_requests, _other) = serve(Vec::new()).await;
        let location = format!("Location: {elsewhere}/steal?x=1\r\n");
        let (base, _requests, _server) =
            serve(vec![answer("307 Temporary Redirect", &location, "")]).await;
        let result =
            call_once(json!({"name": "lookup", "kind": "http", "url": format!("{base}/lookup")}))
                .await;
        assert_eq!(result.outcome, Outcome::Failed);
        let message = error_of(&result.content);
        assert!(message.contains("redirect to another origin"), "{message}");
        assert!(!message.contains("steal"), "{message}");
        assert!(
            elsewhere_requests.lock().expect("not poisoned").is_empty(),
            "the other origin was never asked"
        );
    }

    #[tokio::test]
    async fn an_http_redirect_within_the_origin_is_followed_a_few_times_at_most() {
        let hop = |to: &str| answer("307 Temporary Redirect", &format!("Location: {to}\r\n"), "");
        let (base, requests, _server) = serve(vec![
            hop("/second"),
            hop("http://127.0.0.1:{port}/third"),
            answer("200 OK", "", "arrived"),
        ])
        .await;
        let followed =
            call_once(json!({"name": "lookup", "kind": "http", "url": format!("{base}/lookup")}))
                .await;
        assert_eq!(followed.content, "arrived");
        let paths: Vec<String> = requests
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|r| r.split(' ').take(2).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(paths, ["POST /lookup", "POST /second", "POST /third"]);

        let (base, requests, _server) =
            serve(vec![hop("/a"), hop("/b"), hop("/c"), hop("/d"), hop("/e")]).await;
        let result =
            call_once(json!({"name": "lookup", "kind": "http", "url": format!("{base}/lookup")}))
                .await;
        assert_eq!(result.outcome, Outcome::Failed);
        assert!(
            error_of(&result.content).contains("more than 3 redirects"),
            "{}",
            result.content
        );
        assert_eq!(requests.lock().expect("not poisoned").len(), 4);
    }

    #[tokio::test]
    async fn http_errors_never_show_the_urls_credentials_or_query() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
            listener.local_addr().expect("addr").port()
        };
        let refused = call_once(json!({
            "name": "lookup", "kind": "http",
            "url": format!("http://agent:hunter2@127.0.0.1:{port}/lookup?token=s3cret")
        }))
        .await;
        let (base, _requests, _server) =
            serve(vec![answer("500 Internal Server Error", "", "down")]).await;
        let failed = call_once(json!({
            "name": "lookup", "kind": "http",
            "url": base.replace("http://", "http://agent:hunter2@") + "/lookup?token=s3cret"
        }))
        .await;
        for result in [refused, failed] {
            assert_eq!(result.outcome, Outcome::Failed);
            let message = error_of(&result.content);
            assert!(message.contains("127.0.0.1"), "{message}");
            for secret in ["agent", "hunter2", "token", "s3cret"] {
                assert!(!message.contains(secret), "{secret} in {message}");
            }
        }
    }
}
