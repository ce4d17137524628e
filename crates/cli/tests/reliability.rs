//! `async-grpo rollout` when things go wrong: tool programs that leave processes behind, a
//! server that dies or never answers, hostile dataset rows, settings that cannot work, and
//! `https://` servers. Each test reproduces a failure a user met and checks what the engine
//! does instead.

use std::{
    fs::File,
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use serde_json::json;

use super::rollout::{Case, dataset_line, exit_within, quickstart, runtime, stderr_within, wait};

/// The environment variable every process of a run inherits in the process-tree tests.
pub(crate) const MARKER: &str = "ASYNC_GRPO_TEST_MARKER";

/// Live processes (not zombies) whose environment holds `MARKER=value`.
pub(crate) fn marked_processes(value: &str) -> Vec<u32> {
    let needle = format!("{MARKER}={value}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            state.is_some_and(|s| s != 'Z')
                && environ
                    .split(|&b| b == 0)
                    .any(|variable| variable == needle.as_bytes())
        })
        .collect()
}

/// Waits (a few seconds at most: a killed process takes a moment to go) for no process to
/// carry the marker, and returns those still there.
pub(crate) fn survivors(marker: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive = marked_processes(marker);
        if alive.is_empty() || Instant::now() > deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `command` to the end, its stdin closed and every process it starts marked as
/// `name`; returns its output and the marked processes still alive after it (killed, so
/// that one failure does not leak into the machine).
pub(crate) fn run_marked(command: &mut Command, name: &str) -> (Output, Vec<u32>) {
    let marker = format!("{name}-{}", std::process::id());
    let output = command
        .env(MARKER, &marker)
        .stdin(Stdio::null())
        .output()
        .expect("the binary starts");
    let left = survivors(&marker);
    kill_all(&left);
    (output, left)
}

/// Kills what a failed test left, so that one failure does not leak into the machine.
pub(crate) fn kill_all(pids: &[u32]) {
    for pid in pids {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

/// A run whose first assistant turn calls `tool` (a `command` tool running `argv`).
fn tool_case(name: &str, argv: &str, timeout: &str, rows: usize) -> Case {
    let case = Case::new(name);
    case.write_dataset(rows);
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 4\n\n[[tools]]\nname = \"slow\"\nkind = \"command\"\ncommand = {argv}\ntimeout = \"{timeout}\"\n\n[simulator]\ntool_rounds = 1\nanswer_tokens = 4\n"
    ));
    case
}

#[test]
fn a_tool_s_background_processes_die_with_its_timeout() {
    let case = tool_case(
        "tree-timeout",
        r#"["sh", "-c", "sleep 7777 & sleep 7778"]"#,
        "1s",
        2,
    );
    let (outcome, left) = run_marked(&mut case.command(&[]), "timeout");
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    // Every call ran past its timeout, and each became an error the model read.
    assert!(stderr.contains("4 tool calls (4 errors)"), "{stderr}");
    assert_eq!(left, Vec::<u32>::new(), "processes left behind: {stderr}");
}

/// Starts a run whose tool sleeps for a long time, waits until the tool's processes run,
/// sends SIGINT, and returns the exit code and stderr once the run ended.
pub(crate) fn interrupted_while_tools_run(
    case: &Case,
    marker: &str,
    args: &[&str],
) -> (Option<i32>, String) {
    let stderr_path = case.dir.join("stderr.txt");
    let mut child = case
        .command(args)
        .env(MARKER, marker)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&stderr_path).expect("create the stderr file"))
        .spawn()
        .expect("the binary starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    // The binary itself carries the marker: wait for more than it.
    while marked_processes(marker).len() < 2 {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no tool process started: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(sent.success(), "SIGINT sent");
    let code = wait(&mut child);
    (
        code,
        std::fs::read_to_string(&stderr_path).unwrap_or_default(),
    )
}

#[test]
fn tool_processes_die_when_the_drain_deadline_cancels_their_calls() {
    let marker = format!("drain-{}", std::process::id());
    let case = tool_case("tree-drain", r#"["sleep", "4242"]"#, "60s", 4);
    let (code, stderr) = interrupted_while_tools_run(&case, &marker, &["--drain-timeout", "1s"]);
    let left = survivors(&marker);
    kill_all(&left);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("drain NOT clean"), "{stderr}");
    assert_eq!(left, Vec::<u32>::new(), "processes left behind: {stderr}");
}

/// Starts a run whose four rollouts each call a `command` tool running `sleep` (its table
/// extended by `table`), SIGKILLs the engine once every call's `sleep` runs, and returns the
/// marked processes that outlived it (killed).
fn left_by_an_engine_killed_by_sigkill(name: &str, table: &str) -> Vec<u32> {
    let marker = format!("{name}-{}", std::process::id());
    let case = tool_case(name, &format!("[\"sleep\", \"4244\"]\n{table}"), "60s", 2);
    let mut child = case
        .command(&[])
        .env(MARKER, &marker)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the binary starts");
    let is_sleep = |pid: &u32| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|line| line.starts_with(b"sleep\0"))
    };
    // Every rollout's call (2 rows x 2 generations, all in flight) runs its program: none is
    // being started. (A program started at the very instant of the kill, before it has its
    // parent-death signal, could outlive the engine: that window is not what this measures.)
    let deadline = Instant::now() + Duration::from_secs(60);
    while marked_processes(&marker)
        .iter()
        .filter(|pid| is_sleep(pid))
        .count()
        < 4
    {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            kill_all(&marked_processes(&marker));
            panic!("the four tool processes did not all start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // No drain, no Drop: the engine is gone at once.
    child.kill().expect("SIGKILL sent");
    let _ = child.wait();
    let left = survivors(&marker);
    kill_all(&left);
    left
}

#[test]
fn sandboxed_tool_processes_die_with_an_engine_killed_by_sigkill() {
    assert_eq!(
        left_by_an_engine_killed_by_sigkill("tree-sigkill", ""),
        Vec::<u32>::new(),
        "tool processes outlived the engine"
    );
}

#[test]
fn unsandboxed_tool_processes_die_with_an_engine_killed_by_sigkill() {
    // No PID namespace to take them: their parent-death signal does.
    assert_eq!(
        left_by_an_engine_killed_by_sigkill("tree-sigkill-none", "sandbox = \"none\""),
        Vec::<u32>::new(),
        "unsandboxed tool processes outlived the engine"
    );
}

#[test]
fn tool_processes_die_when_their_rollout_runs_out_of_time() {
    let case = tool_case("tree-deadline", r#"["sleep", "4243"]"#, "60s", 2);
    let (outcome, left) = run_marked(
        &mut case.command(&["--rollout-timeout", "2s", "--retries", "0"]),
        "deadline",
    );
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    assert!(stderr.contains("deadline"), "{stderr}");
    assert_eq!(left, Vec::<u32>::new(), "processes left behind: {stderr}");
}

#[test]
fn a_run_in_which_every_rollout_fails_stops_and_exits_non_zero() {
    let case = Case::new("all-fail");
    case.write_dataset(40);
    case.write_config("num_generations = 4\nmax_inflight = 8\n");
    let outcome = case.rollout(&["--max-model-len", "8"]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("more than max_failure_rate 50%"),
        "{}",
        outcome.stderr
    );
    // It stopped early instead of burning through the dataset.
    let completed = outcome.stderr.lines().find_map(|line| {
        line.strip_prefix("async-grpo: ")?
            .split(" rollouts completed")
            .next()?
            .parse::<u64>()
            .ok()
    });
    assert_eq!(completed, Some(0), "{}", outcome.stderr);
    assert!(
        !outcome.stderr.contains("160 failed"),
        "every rollout of the dataset was tried: {}",
        outcome.stderr
    );
}

#[test]
fn a_run_that_writes_no_row_is_not_a_success() {
    let case = Case::new("nothing-kept");
    case.write_dataset(2);
    case.write_config("num_generations = 2\nmin_group_size = 2\n");
    // Every rollout fails, but the rate is not judged: nothing is kept, and that is an error.
    let outcome = case.rollout(&["--max-model-len", "8", "--max-failure-rate", "1"]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("no training row was written"),
        "{}",
        outcome.stderr
    );
}

/// A free port on 127.0.0.1.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}

/// `async-grpo simulate` on `port`, as a process of its own (so that it can be killed).
pub(crate) fn simulator_process(port: u16, latency_ms: u32) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["simulate", "--port", &port.to_string()])
        .args(["--latency", &format!("{latency_ms}ms")])
        .arg("--tokenizer")
        .arg(quickstart().join("tokenizer.json"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the simulator starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the simulator did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Starts a run against a simulator process, kills the simulator once a group is written,
/// and returns the run, its stderr file and the simulator's port.
fn run_losing_its_server(case: &Case, args: &[&str]) -> (Child, PathBuf, u16) {
    let port = free_port();
    let mut server = simulator_process(port, 100);
    case.write_dataset(200);
    case.write_config("num_generations = 2\nmax_inflight = 8\n");
    let stderr_path = case.dir.join("stderr.txt");
    let url = format!("http://127.0.0.1:{port}");
    let mut all = vec!["--server", url.as_str()];
    all.extend_from_slice(args);
    let mut child = case
        .command(&all)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&stderr_path).expect("create the stderr file"))
        .spawn()
        .expect("the binary starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(case.out()).is_ok_and(|text| text.contains('\n')) {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            let _ = server.kill();
            panic!(
                "no group written: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = server.kill();
    let _ = server.wait();
    (child, stderr_path, port)
}

#[test]
fn when_the_only_server_dies_admission_pauses_and_the_run_fails_after_server_wait() {
    let case = Case::new("server-dies");
    let (mut child, stderr_path, _) = run_losing_its_server(&case, &["--server-wait", "3s"]);
    let code = exit_within(
        &mut child,
        Duration::from_secs(40),
        "a run without a server must stop once --server-wait (3s) has passed",
    );
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("admission paused"), "{stderr}");
    assert!(
        stderr.contains("no server could take requests for 3s"),
        "{stderr}"
    );
    // Only what was in flight failed: the dataset was not used up.
    let failed: u64 = stderr
        .lines()
        .find_map(|line| {
            let (_, rest) = line.split_once(" rollouts completed, ")?;
            rest.split(' ').next()?.parse().ok()
        })
        .unwrap_or(u64::MAX);
    assert!(failed <= 16, "{failed} rollouts failed: {stderr}");
}

#[test]
fn when_the_server_comes_back_the_paused_run_resumes_and_finishes() {
    let case = Case::new("server-returns");
    let (mut child, stderr_path, port) = run_losing_its_server(&case, &["--groups", "12"]);
    stderr_within(
        &stderr_path,
        "admission paused",
        &mut child,
        Duration::from_secs(40),
    );
    let mut server = simulator_process(port, 1);
    let code = exit_within(
        &mut child,
        Duration::from_secs(60),
        "the run must finish once its server is back",
    );
    let _ = server.kill();
    let _ = server.wait();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("admission resumes"), "{stderr}");
    let groups: std::collections::BTreeSet<u64> =
        case.rows().iter().map(|row| row.group_id).collect();
    assert!(groups.len() >= 6, "{groups:?}: {stderr}");
}

#[test]
fn an_unreachable_server_is_reported_while_waiting_and_the_wait_is_a_setting() {
    let case = Case::new("unreachable");
    case.write_dataset(2);
    case.write_config("");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let outcome = case.rollout(&["--server", &url, "--server-wait", "6s"]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome
            .stderr
            .contains("waiting for the server; the last attempt:"),
        "{}",
        outcome.stderr
    );
    assert!(
        outcome
            .stderr
            .contains("--server-wait sets how long to wait"),
        "{}",
        outcome.stderr
    );
    assert!(!case.out().exists(), "the output was created");

    let started = Instant::now();
    let outcome = case.rollout(&[
        "--server",
        "http://nosuchhost.invalid:8000",
        "--server-wait",
        "30s",
    ]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains(
            "the host 'nosuchhost.invalid' of http://nosuchhost.invalid:8000 does not resolve"
        ),
        "{}",
        outcome.stderr
    );
    // Coarse: at once, not after the wait.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_prompt_too_large_for_the_context_is_a_bad_row_found_before_tokenizing() {
    let case = Case::new("huge-prompt");
    let huge = json!({ "prompt": "7 + ".repeat(1_250_000) + "1", "answer": "1" }).to_string();
    std::fs::write(
        case.dataset(),
        format!("{}\n{huge}\n{}\n", dataset_line(0), dataset_line(1)),
    )
    .expect("write the dataset");
    case.write_config("num_generations = 2\n");
    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome
            .stderr
            .contains("rows.jsonl:2: the prompt is 5000001 bytes of text"),
        "{}",
        outcome.stderr
    );
    let outcome = case.rollout(&["--skip-bad-rows", "--overwrite"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("1 bad dataset row(s) skipped"),
        "{}",
        outcome.stderr
    );
    assert_eq!(outcome.rows.len(), 4);
}

/// A settings mistake that `--check` finds, and that a real run finds before it empties
/// the output: `tables` go into run.toml, `args` on the command line. Returns the error.
fn refused_before_the_output_is_touched(name: &str, tables: &str, args: &[&str]) -> String {
    let case = Case::new(name);
    case.write_dataset(4);
    case.write_config(tables);
    std::fs::write(case.out(), "precious rows\n").expect("write");
    let mut check_args = vec!["--check"];
    check_args.extend_from_slice(args);
    let checked = case.rollout(&check_args);
    assert_eq!(checked.code, Some(1), "--check passed: {}", checked.stderr);
    let mut run_args = vec!["--overwrite"];
    run_args.extend_from_slice(args);
    let run = case.rollout(&run_args);
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(
        std::fs::read_to_string(case.out()).ok().as_deref(),
        Some("precious rows\n"),
        "the output was touched: {}",
        run.stderr
    );
    let error = |stderr: &str| {
        stderr
            .lines()
            .find(|line| line.starts_with("Error: "))
            .map(str::to_owned)
            .unwrap_or_else(|| stderr.to_owned())
    };
    assert_eq!(
        error(&checked.stderr),
        error(&run.stderr),
        "--check and the run agree"
    );
    error(&run.stderr)
}

#[test]
fn settings_that_cannot_work_are_refused_by_check_and_before_the_output_is_emptied() {
    // (case, [[tables]] of run.toml, flags, what the error says)
    let cases: &[(&str, &str, &[&str], &[&str])] = &[
        (
            "dup-rewards",
            "[[rewards]]\nspec = \"numeric:answer\"\n",
            &[],
            // The fix a user can make, not a Rust API.
            &["a second reward named 'numeric_answer'", "`name = \"...\"`"],
        ),
        (
            "empty-tool-name",
            "[[tools]]\nname = \"\"\nkind = \"calculator\"\n",
            &[],
            &["tools[0]", "name"],
        ),
        (
            "bad-parameters",
            "[[tools]]\nname = \"c\"\nkind = \"calculator\"\nparameters = \"a string\"\n",
            &[],
            &["parameters must be a JSON object schema"],
        ),
        (
            "zero-timeout",
            "[[tools]]\nname = \"c\"\nkind = \"calculator\"\ntimeout = \"0s\"\n",
            &[],
            &["timeout must be longer than 0s"],
        ),
        (
            "weight-twice",
            "[[rewards]]\nname = \"again\"\nspec = \"exact:answer@2\"\nweight = 3.0\n",
            &[],
            &["the weight is given twice"],
        ),
        (
            "no-column",
            "",
            &["--reward", "numeric:nosuchcol"],
            &[
                "--reward numeric:nosuchcol: no row of",
                "has a column 'nosuchcol'; its rows have: answer",
            ],
        ),
        (
            "bad-weight",
            "",
            &["--reward", "numeric:answer@abc"],
            &["the weight after '@' must be a number, got 'abc'"],
        ),
        (
            "no-program",
            "",
            &["--reward", "command:./nosuch-judge.py"],
            &["program './nosuch-judge.py' not found"],
        ),
        (
            "no-tool-program",
            "[[tools]]\nname = \"t\"\nkind = \"command\"\ncommand = [\"no-such-program-here\"]\n",
            &[],
            &["program 'no-such-program-here' not found: not on PATH"],
        ),
    ];
    for (name, tables, args, expected) in cases {
        let error = refused_before_the_output_is_touched(name, tables, args);
        for part in *expected {
            assert!(error.contains(part), "{name}: {part:?} in {error}");
        }
        assert!(!error.contains("Reward::named"), "{name}: {error}");
    }
}

#[test]
fn a_line_that_is_not_utf8_is_a_bad_row_with_its_line_and_can_be_skipped() {
    let case = Case::new("not-utf8");
    let mut bytes = Vec::new();
    for i in 0..3 {
        bytes.extend_from_slice(dataset_line(i).as_bytes());
        bytes.push(b'\n');
    }
    bytes.extend_from_slice(b"{\"prompt\": \"caf\xE9?\", \"answer\": \"1\"}\n");
    bytes.extend_from_slice(dataset_line(3).as_bytes());
    bytes.push(b'\n');
    File::create(case.dataset())
        .and_then(|mut file| file.write_all(&bytes))
        .expect("write the dataset");
    case.write_config("num_generations = 2\n");
    let outcome = case.rollout(&["--check"]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome
            .stderr
            .contains("rows.jsonl:4: not UTF-8: byte 0xE9 at column 16"),
        "{}",
        outcome.stderr
    );
    let outcome = case.rollout(&["--skip-bad-rows"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert!(
        outcome.stderr.contains("rows.jsonl:4: not UTF-8"),
        "{}",
        outcome.stderr
    );
    assert_eq!(outcome.rows.len(), 8);
}

#[test]
fn prompts_with_unknown_roles_or_no_content_and_empty_datasets_are_refused() {
    let case = Case::new("roles");
    std::fs::write(
        case.dataset(),
        format!(
            "{}\n{}\n",
            dataset_line(0),
            json!({"prompt": [{"role": "narrator", "content": "x"}], "answer": "1"})
        ),
    )
    .expect("write");
    case.write_config("");
    let outcome = case.rollout(&["--check"]);
    assert!(
        outcome
            .stderr
            .contains("rows.jsonl:2: prompt[0]: unknown role \"narrator\""),
        "{}",
        outcome.stderr
    );
    std::fs::write(
        case.dataset(),
        format!("{}\n", json!({"prompt": [{"role": "user"}], "answer": "1"})),
    )
    .expect("write");
    let outcome = case.rollout(&["--check"]);
    assert!(
        outcome
            .stderr
            .contains("rows.jsonl:1: prompt[0]: a \"user\" message needs \"content\""),
        "{}",
        outcome.stderr
    );
    std::fs::write(case.dataset(), "\n\n").expect("write");
    let outcome = case.rollout(&[]);
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        outcome
            .stderr
            .contains("no row to roll out (the file is empty)"),
        "{}",
        outcome.stderr
    );
    assert!(!case.out().exists(), "the output was created");
}

/// A TLS front for `backend` with the test certificate: the address it listens on.
fn tls_front(runtime: &tokio::runtime::Runtime, backend: SocketAddr) -> SocketAddr {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let certs = CertificateDer::pem_file_iter(dir.join("cert.pem"))
        .expect("the test certificate")
        .collect::<Result<Vec<_>, _>>()
        .expect("the test certificate parses");
    let key = PrivateKeyDer::from_pem_file(dir.join("key.pem")).expect("the test key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("a server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("an address");
    runtime.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}

#[test]
fn an_https_server_works_with_a_certificate_the_run_is_told_to_trust() {
    let runtime = runtime();
    let simulator = super::rollout::simulator(&runtime, 0, "none");
    let backend: SocketAddr = simulator
        .url()
        .trim_start_matches("http://")
        .parse()
        .expect("the simulator's address");
    let front = tls_front(&runtime, backend);
    let url = format!("https://localhost:{}", front.port());
    let case = Case::new("https");
    case.write_dataset(3);
    case.write_config("num_generations = 2\n");
    let cert = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls/cert.pem");
    let cert = cert.to_str().expect("a UTF-8 path");
    let outcome = case.rollout(&["--server", &url, "--ca-cert", cert, "--server-wait", "20s"]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 6);

    let untrusted = case.rollout(&["--server", &url, "--server-wait", "2s", "--overwrite"]);
    assert_eq!(untrusted.code, Some(1), "{}", untrusted.stderr);
    assert!(
        untrusted.stderr.to_lowercase().contains("certificate"),
        "{}",
        untrusted.stderr
    );
}

/// A run of two rollouts whose `python` session (`session = "rollout"`) starts a `sleep` and
/// waits: every process it starts is marked `marker`. Returns the running engine once both
/// sessions' `sleep`s run.
fn engine_holding_two_sessions(case: &Case, marker: &str) -> std::process::Child {
    case.write_dataset(1);
    case.write_config(
        "num_generations = 2\nmax_inflight = 2\nretries = 0\n\n\
         [[tools]]\nname = \"python\"\nkind = \"python\"\nsession = \"rollout\"\ntimeout = \"60s\"\n\n\
         [simulator]\ntool_rounds = 1\nanswer_tokens = 4\n\
         tool_arguments = { code = \"import subprocess, time\\nsubprocess.Popen(['sleep', '4246'])\\ntime.sleep(60)\" }\n",
    );
    let mut child = case
        .command(&[])
        .env(MARKER, marker)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the binary starts");
    let is_sleep = |pid: &u32| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|line| line.starts_with(b"sleep\0"))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while marked_processes(marker)
        .iter()
        .filter(|pid| is_sleep(pid))
        .count()
        < 2
    {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            kill_all(&marked_processes(marker));
            panic!("the two sessions' processes did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// The cgroups an engine of pid `engine` made (`async-grpo-<pid>-<n>`), anywhere under
/// `/sys/fs/cgroup`.
fn cgroups_of(engine: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("async-grpo-{engine}-");
    let mut found = Vec::new();
    let mut pending = vec![(std::path::PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                found.push(entry.path());
            } else if depth < 4 {
                pending.push((entry.path(), depth + 1));
            }
        }
    }
    found
}

#[test]
fn python_sessions_die_with_an_engine_killed_by_sigkill_and_the_next_run_removes_their_cgroups() {
    let marker = format!("session-sigkill-{}", std::process::id());
    let case = Case::new("session-sigkill");
    let mut child = engine_holding_two_sessions(&case, &marker);
    let engine = child.id();
    let had_cgroups = !cgroups_of(engine).is_empty();
    child.kill().expect("SIGKILL sent");
    let _ = child.wait();
    let left = survivors(&marker);
    kill_all(&left);
    assert_eq!(left, Vec::<u32>::new(), "sessions outlived the engine");
    // What a killed engine could not remove, the next one does when it makes its first.
    let next = Case::new("session-sigkill-next");
    next.write_dataset(1);
    next.write_config(
        "num_generations = 2\n\n[[tools]]\nname = \"python\"\nkind = \"python\"\n\n\
         [simulator]\ntool_rounds = 1\nanswer_tokens = 4\ntool_arguments = { code = \"print(1)\" }\n",
    );
    let outcome = next.rollout(&[]);
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    if had_cgroups {
        assert_eq!(cgroups_of(engine), Vec::<std::path::PathBuf>::new());
    }
}

#[test]
fn python_sessions_end_with_a_run_stopped_by_ctrl_c() {
    let marker = format!("session-sigint-{}", std::process::id());
    let case = Case::new("session-sigint");
    let mut child = engine_holding_two_sessions(&case, &marker);
    let engine = child.id();
    let _ = Command::new("kill")
        .args(["-INT", &engine.to_string()])
        .status();
    let code = exit_within(
        &mut child,
        Duration::from_secs(60),
        "a run stopped by Ctrl-C",
    );
    let left = survivors(&marker);
    kill_all(&left);
    assert!(code.is_some(), "the run did not stop");
    assert_eq!(left, Vec::<u32>::new(), "sessions outlived their run");
    assert_eq!(
        cgroups_of(engine),
        Vec::<std::path::PathBuf>::new(),
        "cgroups outlived their run"
    );
}
