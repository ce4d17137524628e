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
#[cfg(feature = "sim")]
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
#[cfg(feature = "sim")]
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

#[test]
#[cfg(not(feature = "sim"))]
fn without_the_simulator_a_run_without_a_server_says_what_to_pass() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/quickstart.toml");
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--config", config])
        .output()
        .expect("the binary starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no --server given")
            && stderr.contains("no built-in simulator")
            && stderr.contains("pass --server URL"),
        "{stderr}"
    );
}

#[test]
#[cfg(not(feature = "sim"))]
fn without_the_simulator_there_is_no_simulate_command() {
    let (ok, _) = async_grpo(&["simulate", "--port", "0"]);
    assert!(!ok);
    let (_, help) = async_grpo(&["--help"]);
    assert!(!help.contains("simulate"), "{help}");
}

#[test]
#[cfg(not(feature = "parquet"))]
fn without_parquet_a_parquet_output_or_dataset_is_refused_in_the_checks_with_the_feature_named() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/quickstart.toml");
    let dir = std::env::temp_dir().join(format!("async-grpo-cli-parquet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let dataset = dir.join("train.parquet");
    std::fs::write(&dataset, b"").expect("a dataset file");
    let out = dir.join("rows.parquet");
    let dataset = dataset.to_str().expect("utf-8");
    let out = out.to_str().expect("utf-8");
    for args in [["--out", out], ["--dataset", dataset]] {
        let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
            .args([
                "rollout",
                "--config",
                config,
                "--server",
                "http://127.0.0.1:1",
                "--check",
            ])
            .args(args)
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("`parquet` feature") && stderr.contains("--features parquet"),
            "{args:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
