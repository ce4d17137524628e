//! The control endpoint against callers it must not obey: a token compared whole, addresses
//! other machines reach refused without a token, requests naming another host (DNS
//! rebinding) and web pages of other origins refused, model versions bounded without a token.
//! The real binary against its built-in simulator, over real HTTP.

use std::{net::SocketAddr, process::Stdio, time::Duration};

use reqwest::{StatusCode, header};
use serde_json::{Value, json};

use super::{
    operate::Running,
    rollout::{Case, runtime},
};

/// How far a model version may move at once without a token (README, `--listen-token`).
const MAX_VERSION_STEP: u64 = 1_000_000;

/// The token of the runs that have one.
const TOKEN: &str = "s3cret-token";

/// A case whose run lasts long enough to be talked to: slow answers, many rows.
fn slow_case(name: &str) -> Case {
    let case = Case::new(name);
    case.write_dataset(200);
    case.write_config(
        "num_generations = 2\nmax_inflight = 2\n\n[simulator]\nanswer_tokens = 4\n\
         latency = \"200ms\"\n",
    );
    case
}

/// A run in the background with its control endpoint, killed when dropped.
struct Run {
    _running: Running,
    address: SocketAddr,
}

impl Run {
    /// Starts `case` with `args` (no token from the test's own environment) and waits for
    /// the endpoint's log line.
    fn start(case: &Case, args: &[&str]) -> Run {
        let mut command = case.command(args);
        command.env_remove("ASYNC_GRPO_LISTEN_TOKEN");
        let mut running = Running::spawn(command);
        let address = running.address();
        Run {
            _running: running,
            address,
        }
    }
}

/// A request to a run's endpoint, built up header by header.
struct Call {
    request: reqwest::RequestBuilder,
}

/// An HTTP client of one run's control endpoint, sending exactly the headers it is given.
struct Client {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    base: String,
}

impl Client {
    fn new(address: SocketAddr) -> Client {
        Client {
            runtime: runtime(),
            client: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("a client"),
            base: format!("http://{address}"),
        }
    }

    fn get(&self, path: &str) -> Call {
        Call {
            request: self.client.get(format!("{}{path}", self.base)),
        }
    }

    fn post(&self, path: &str) -> Call {
        Call {
            request: self.client.post(format!("{}{path}", self.base)),
        }
    }

    /// Its status and body.
    fn send(&self, call: Call) -> (StatusCode, String) {
        self.runtime.block_on(async {
            let response = call.request.send().await.expect("the endpoint answers");
            let status = response.status();
            (status, response.text().await.expect("a body"))
        })
    }

    /// `/health`'s JSON, asked with the run's own address as Host.
    fn health(&self) -> Value {
        let (_, body) = self.send(self.get("/health"));
        serde_json::from_str(&body).expect("/health is JSON")
    }

    /// Waits for the engine to run (the endpoints answer 503 while it starts).
    fn until_running(&self) {
        for _ in 0..3000 {
            if self.health()["starting"] == false {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("never running: {}", self.health());
    }
}

impl Call {
    fn header(self, name: header::HeaderName, value: &str) -> Call {
        Call {
            request: self.request.header(name, value),
        }
    }

    fn bearer(self, token: &str) -> Call {
        self.header(header::AUTHORIZATION, &format!("Bearer {token}"))
    }

    fn version(self, version: u64) -> Call {
        Call {
            request: self.request.json(&json!({ "version": version })),
        }
    }
}

/// The `error` of a refusal's JSON body.
fn error_of(body: &str) -> String {
    let body: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    body["error"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn the_token_is_compared_whole_so_a_prefix_a_longer_text_or_none_is_refused() {
    let case = slow_case("control-token-whole");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0", "--listen-token", TOKEN]);
    let client = Client::new(run.address);
    let longer = format!("{TOKEN}-and-more");
    for given in [&TOKEN[..3], &TOKEN[..TOKEN.len() - 1], longer.as_str(), ""] {
        for path in ["/metrics", "/resume"] {
            let call = if path == "/metrics" {
                client.get(path)
            } else {
                client.post(path)
            };
            let (status, body) = client.send(call.bearer(given));
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{path} with {given:?}: {body}"
            );
            assert!(error_of(&body).contains("--listen-token"), "{body}");
        }
    }
    let (status, _) = client.send(client.get("/metrics"));
    assert_eq!(status, StatusCode::UNAUTHORIZED, "no Authorization header");
    let (status, _) = client.send(client.get("/metrics").header(header::AUTHORIZATION, TOKEN));
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the token without `Bearer `"
    );
    let (status, body) = client.send(client.get("/metrics").bearer(TOKEN));
    assert_eq!(status, StatusCode::OK, "the exact token: {body}");
}

#[test]
fn an_address_other_machines_reach_is_refused_without_a_token_before_anything_runs() {
    let case = slow_case("control-exposed");
    for address in ["0.0.0.0:0", "[::]:0", "192.0.2.1:9090"] {
        for check in [true, false] {
            let mut args = vec!["--listen", address];
            if check {
                args.push("--check");
            }
            let output = case
                .command(&args)
                .env_remove("ASYNC_GRPO_LISTEN_TOKEN")
                .stdin(Stdio::null())
                .output()
                .expect("the binary runs");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_ne!(output.status.code(), Some(0), "{args:?}: {stderr}");
            for wanted in ["--listen", "--listen-token", "ASYNC_GRPO_LISTEN_TOKEN"] {
                assert!(stderr.contains(wanted), "{args:?} says {wanted}: {stderr}");
            }
            assert!(
                !stderr.contains("control endpoint listening"),
                "{args:?}: {stderr}"
            );
            assert!(!case.out().exists(), "{args:?} touched the output");
        }
    }
    // A token opens them; loopback addresses need none.
    for args in [
        &["--listen", "0.0.0.0:0", "--listen-token", TOKEN][..],
        &["--listen", "[::1]:0"],
        &["--listen", "127.0.0.2:0"],
        &["--listen", "0"],
    ] {
        let output = case
            .command(&[args, &["--check"]].concat())
            .env_remove("ASYNC_GRPO_LISTEN_TOKEN")
            .stdin(Stdio::null())
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {stderr}");
    }
    let output = case
        .command(&["--listen", "0.0.0.0:0", "--check"])
        .env("ASYNC_GRPO_LISTEN_TOKEN", TOKEN)
        .stdin(Stdio::null())
        .output()
        .expect("the binary runs");
    assert_eq!(
        output.status.code(),
        Some(0),
        "the token from the environment"
    );
}

#[test]
fn an_empty_token_and_an_address_that_does_not_parse_are_refused_with_what_to_set() {
    let case = slow_case("control-empty-token");
    let refused = |args: &[&str], env: Option<&str>| {
        let mut command = case.command(&[args, &["--check"]].concat());
        command.env_remove("ASYNC_GRPO_LISTEN_TOKEN");
        if let Some(token) = env {
            command.env("ASYNC_GRPO_LISTEN_TOKEN", token);
        }
        let output = command
            .stdin(Stdio::null())
            .output()
            .expect("the binary runs");
        assert_ne!(output.status.code(), Some(0), "{args:?} {env:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    for stderr in [
        refused(&["--listen", "0", "--listen-token", ""], None),
        refused(&["--listen", "0"], Some("")),
    ] {
        assert!(stderr.contains("token"), "{stderr}");
        assert!(stderr.contains("is empty"), "{stderr}");
    }
    let stderr = refused(&["--listen", "0", "--listen-token", "two words"], None);
    assert!(stderr.contains("space"), "{stderr}");
    // The error that shows an address other machines reach says it wants a token.
    let stderr = refused(&["--listen", "localhost:x"], None);
    assert!(stderr.contains("--listen"), "{stderr}");
    assert!(
        !stderr.contains("0.0.0.0") || stderr.contains("--listen-token"),
        "{stderr}"
    );
}

#[test]
fn requests_naming_another_host_are_refused_so_a_web_page_cannot_rebind_its_name_here() {
    let case = slow_case("control-host");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0"]);
    let client = Client::new(run.address);
    client.until_running();
    let port = run.address.port();
    for host in [
        format!("attacker.example:{port}"),
        "attacker.example".to_owned(),
        format!("localhost.attacker.example:{port}"),
        format!("127.0.0.1.attacker.example:{port}"),
        format!("10.1.2.3:{port}"),
        String::new(),
    ] {
        for (call, what) in [
            (client.get("/health"), "GET /health"),
            (client.get("/metrics"), "GET /metrics"),
            (client.post("/pause?mode=abort"), "POST /pause"),
            (
                client.post("/model_version").version(7),
                "POST /model_version",
            ),
        ] {
            let (status, body) = client.send(call.header(header::HOST, &host));
            assert_eq!(
                status,
                StatusCode::MISDIRECTED_REQUEST,
                "{what} naming {host:?}: {body}"
            );
            assert!(error_of(&body).contains("localhost"), "{body}");
        }
    }
    let health = client.health();
    assert_eq!(health["paused"], false, "{health}");
    assert_eq!(health["model_version"], 0, "{health}");
    for host in [
        format!("localhost:{port}"),
        "localhost".to_owned(),
        "LOCALHOST".to_owned(),
        format!("127.0.0.1:{port}"),
        "127.9.8.7".to_owned(),
        format!("[::1]:{port}"),
        "[::1]".to_owned(),
    ] {
        let (status, body) = client.send(client.get("/health").header(header::HOST, &host));
        assert_eq!(
            status,
            StatusCode::OK,
            "a local probe naming {host:?}: {body}"
        );
    }
}

#[test]
fn a_request_with_the_token_is_heard_whatever_host_it_names_and_health_without_it_is_not() {
    let case = slow_case("control-host-token");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0", "--listen-token", TOKEN]);
    let client = Client::new(run.address);
    client.until_running();
    let host = "rollout-node.cluster.example:9090";
    let (status, body) = client.send(client.get("/health").header(header::HOST, host));
    assert_eq!(status, StatusCode::MISDIRECTED_REQUEST, "{body}");
    let (status, body) = client.send(client.get("/metrics").header(header::HOST, host));
    assert_eq!(status, StatusCode::MISDIRECTED_REQUEST, "{body}");
    let (status, body) = client.send(
        client
            .get("/metrics")
            .header(header::HOST, host)
            .bearer(&format!("{TOKEN}x")),
    );
    assert_eq!(
        status,
        StatusCode::MISDIRECTED_REQUEST,
        "a wrong token: {body}"
    );
    let (status, body) = client.send(
        client
            .get("/metrics")
            .header(header::HOST, host)
            .bearer(TOKEN),
    );
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = client.send(
        client
            .get("/health")
            .header(header::HOST, host)
            .bearer(TOKEN),
    );
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[test]
fn state_changing_requests_from_a_web_page_of_another_origin_are_refused() {
    let case = slow_case("control-origin");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0"]);
    let client = Client::new(run.address);
    client.until_running();
    let port = run.address.port();
    for origin in [
        "http://attacker.example".to_owned(),
        // Another local web application (a notebook, a dev server) is another origin too.
        "http://localhost:8888".to_owned(),
        format!("http://localhost:{port}"),
        format!("https://127.0.0.1:{port}"),
        "null".to_owned(),
    ] {
        for (call, what) in [
            (client.post("/pause?mode=abort"), "POST /pause"),
            (client.post("/resume"), "POST /resume"),
            (
                client.post("/model_version").version(7),
                "POST /model_version",
            ),
        ] {
            let (status, body) = client.send(call.header(header::ORIGIN, &origin));
            assert_eq!(
                status,
                StatusCode::FORBIDDEN,
                "{what} from {origin}: {body}"
            );
            assert!(error_of(&body).contains("Origin"), "{body}");
        }
    }
    let health = client.health();
    assert_eq!(health["paused"], false, "{health}");
    assert_eq!(health["model_version"], 0, "{health}");
    // Reading is not steering (and a page cannot read the answer without CORS headers).
    let (status, body) = client.send(
        client
            .get("/health")
            .header(header::ORIGIN, "http://attacker.example"),
    );
    assert_eq!(status, StatusCode::OK, "{body}");
    // The endpoint's own origin, and no origin at all (a trainer, curl), steer.
    let own = format!("http://127.0.0.1:{port}");
    let (status, body) = client.send(
        client
            .post("/model_version")
            .version(7)
            .header(header::ORIGIN, &own),
    );
    assert_eq!(status, StatusCode::OK, "{own}: {body}");
    let (status, body) = client.send(client.post("/model_version").version(8));
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(client.health()["model_version"], 8);
}

#[test]
fn without_a_token_a_model_version_grows_by_a_bounded_step_and_never_reaches_u64_max() {
    let case = slow_case("control-version-bound");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0"]);
    let client = Client::new(run.address);
    client.until_running();
    let version = |v: u64| client.send(client.post("/model_version").version(v));
    assert_eq!(version(5).0, StatusCode::OK);
    for refused in [5 + MAX_VERSION_STEP + 1, u64::MAX / 2, u64::MAX] {
        let (status, body) = version(refused);
        assert!(status.is_client_error(), "{refused}: {status} {body}");
        assert!(error_of(&body).contains("--listen-token"), "{body}");
        let body: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(body["version"], 5, "the refusal says the current version");
        assert_eq!(client.health()["model_version"], 5, "after {refused}");
    }
    assert_eq!(version(5 + MAX_VERSION_STEP).0, StatusCode::OK);
    assert_eq!(client.health()["model_version"], 5 + MAX_VERSION_STEP);
}

#[test]
fn with_the_token_any_model_version_goes() {
    let case = slow_case("control-version-token");
    let run = Run::start(&case, &["--listen", "127.0.0.1:0", "--listen-token", TOKEN]);
    let client = Client::new(run.address);
    client.until_running();
    let (status, body) = client.send(
        client
            .post("/model_version")
            .version(u64::MAX)
            .bearer(TOKEN),
    );
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(client.health()["model_version"], u64::MAX);
}
