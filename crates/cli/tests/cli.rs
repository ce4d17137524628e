//! The command line: help, version, the simulator's server, and what a build without it says.

use std::process::Command;

fn async_grpo(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(args)
        .output()
        .expect("the binary starts");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn version_prints_the_package_version() {
    let (ok, stdout) = async_grpo(&["--version"]);
    assert!(ok);
    assert_eq!(
        stdout.trim(),
        format!("async-grpo {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn help_says_what_the_engine_is() {
    let (ok, stdout) = async_grpo(&["--help"]);
    assert!(ok);
    assert!(
        stdout.contains("rollout engine for asynchronous GRPO"),
        "{stdout}"
    );
    assert!(stdout.contains("Usage: async-grpo"), "{stdout}");
}

#[test]
fn an_unknown_flag_is_an_error() {
    let (ok, _) = async_grpo(&["--no-such-flag"]);
    assert!(!ok);
}

#[test]
fn the_simulator_serves_vllm_json_until_stopped() {
    use std::{io::Read, net::TcpStream, time::Duration};

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args([
            "simulate",
            "--port",
            &port.to_string(),
            "--model",
            "demo",
            "--max-model-len",
            "777",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the binary starts");
    let mut body = String::new();
    for _ in 0..200 {
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            use std::io::Write;
            let request = "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
            stream.write_all(request.as_bytes()).expect("write");
            stream.read_to_string(&mut body).expect("read");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.contains(r#""id":"demo""#) && body.contains(r#""max_model_len":777"#),
        "{body}"
    );
}

#[test]
fn simulator_flags_are_checked() {
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["simulate", "--error-503", "0.7", "--malformed", "0.5"])
        .output()
        .expect("the binary starts");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the fault fractions add up to 1.2, more than 1"),
        "{stderr}"
    );
}
