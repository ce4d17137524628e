//! Response bodies are capped: a server that answers without end is cut off at the cap,
//! named in an error that is not retried.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};
use vllm_client::{Client, ClientConfig, GenerateParams, RetryPolicy};

/// A server on a free loopback port that answers every request with `status` and a chunked
/// body that never ends; counts the requests.
async fn endless_server(status: &'static str) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let url = format!("http://{}", listener.local_addr().expect("an address"));
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buffer = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buffer[..n]),
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let header = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                     transfer-encoding: chunked\r\n\r\n"
                );
                if stream.write_all(header.as_bytes()).await.is_err() {
                    return;
                }
                let mut chunk = b"10000\r\n".to_vec();
                chunk.extend(std::iter::repeat_n(b' ', 0x10000));
                chunk.extend_from_slice(b"\r\n");
                while stream.write_all(&chunk).await.is_ok() {}
            });
        }
    });
    (url, requests)
}

fn client(url: String, cap: usize) -> Client {
    let retry = RetryPolicy {
        max_attempts: 4,
        base_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(20),
        deadline: Duration::from_secs(5),
    };
    let config = ClientConfig::new(url)
        .model("sim")
        .retry(retry)
        .max_response_bytes(cap);
    Client::new(config).expect("the client starts")
}

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        ..GenerateParams::default()
    }
}

#[tokio::test]
async fn an_endless_body_is_cut_at_the_cap_and_not_retried() {
    let (url, requests) = endless_server("200 OK").await;
    let client = client(url, 1 << 20);
    let error = client
        .generate(&[1, 2], &params())
        .await
        .expect_err("an endless body is no answer");
    assert!(error.is_too_large(), "{error}");
    assert!(!error.is_retryable());
    let message = error.to_string();
    assert!(message.contains("POST /v1/completions"), "{message}");
    assert!(message.contains("1048576 bytes"), "{message}");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "the request was not retried"
    );
}

#[tokio::test]
async fn an_endless_error_body_is_cut_at_the_cap_and_not_retried() {
    let (url, requests) = endless_server("503 Service Unavailable").await;
    let client = client(url, 64 << 10);
    let error = client
        .generate(&[1, 2], &params())
        .await
        .expect_err("an endless body is no answer");
    assert!(error.is_too_large(), "{error}");
    assert!(error.to_string().contains("status 503"), "{error}");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "the request was not retried"
    );
}

#[tokio::test]
async fn the_default_cap_lets_real_answers_through() {
    let sim = crate::simulator(|_| {}).await;
    let client = client(sim.url(), ClientConfig::DEFAULT_MAX_RESPONSE_BYTES);
    let turn = client
        .generate(&[1, 2], &params())
        .await
        .expect("an answer");
    assert!(!turn.token_ids.is_empty());
    let tiny = self::client(sim.url(), 16);
    let error = tiny
        .generate(&[1, 2], &params())
        .await
        .expect_err("a 16-byte cap is too small for any answer");
    assert!(error.is_too_large(), "{error}");
}
