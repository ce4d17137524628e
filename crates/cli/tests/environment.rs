//! `async-grpo rollout` with an `[environment]`: a real MCP server written with the Python
//! `mcp` SDK (`examples/environment/kv_env.py`), over stdio and streamable HTTP, against the
//! simulator. Rows hold exactly what the simulator sampled, the `env` column is what the
//! server's verify returned, no server process outlives the run or a Ctrl-C, and servers
//! that go wrong fail their rollouts with a cause naming them.
//!
//! The Python comes from `cargo xtask fixtures` (`<cache>/venv-mcp`), or
//! `ASYNC_GRPO_MCP_PYTHON`.

use std::{
    collections::BTreeMap,
    fs::File,
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use rollout_core::TrainingSample;

use super::{
    reliability::{MARKER, interrupted_while_tools_run, kill_all, run_marked, survivors},
    rollout::{Case, assert_rows_are_what_was_sampled, runtime, simulator, toml_path},
};

/// The Python with the `mcp` package.
pub(crate) fn mcp_python() -> PathBuf {
    if let Some(python) = std::env::var_os("ASYNC_GRPO_MCP_PYTHON") {
        return PathBuf::from(python);
    }
    let python = test_support::cache_dir()
        .join("venv-mcp")
        .join("bin")
        .join("python");
    assert!(
        python.is_file(),
        "{} is missing: run `cargo xtask fixtures` (it installs the Python MCP SDK there)",
        python.display()
    );
    python
}

pub(crate) fn kv_env() -> PathBuf {
    crate::repository().join("examples/environment/kv_env.py")
}

/// What verify returned, by episode id, from the server's log.
pub(crate) fn verified(log: &Path) -> BTreeMap<String, f64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).expect("a log line");
            (
                entry["episode_id"]
                    .as_str()
                    .unwrap_or_else(|| {
                        panic!(
                            "verify ran in an episode reset never started (no task, no id): {line}"
                        )
                    })
                    .to_owned(),
                entry["reward"].as_f64().expect("a reward"),
            )
        })
        .collect()
}

/// Each row's `env` reward is what verify returned for its episode, and verify ran once
/// per rollout.
fn assert_env_rewards_are_verifys(rows: &[TrainingSample], log: &Path) {
    let verified = verified(log);
    assert_eq!(
        verified.len(),
        rows.len(),
        "one verify per rollout: {verified:?}"
    );
    for row in rows {
        let episode = format!("r{}-a1", row.rollout_id.0);
        assert_eq!(
            row.rewards["env"].as_f64(),
            Some(verified[&episode]),
            "rollout {}: the env column is what verify returned",
            row.rollout_id.0
        );
    }
    assert!(
        verified.values().any(|&r| r == 1.0) && verified.values().any(|&r| r == 0.5),
        "the rewards differ between rollouts (the simulator answers right half of the time): {verified:?}"
    );
}

fn environment_case(name: &str, environment: &str) -> Case {
    let case = Case::new(name);
    case.write_dataset(3);
    case.write_config(&format!(
        "num_generations = 4\nmax_inflight = 4\nmax_turns = 3\nseed = 7\n\n[environment]\nkind = \"mcp\"\n{environment}\ntimeout = \"60s\"\n"
    ));
    case
}

#[test]
fn a_stdio_mcp_environment_gives_sampled_rows_and_its_verify_as_the_env_reward() {
    let case = environment_case(
        "mcp-stdio",
        &format!(
            "command = [{}, {}]",
            toml_path(&mcp_python()),
            toml_path(&kv_env())
        ),
    );
    let log = case.dir.join("verify.jsonl");
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let mut command = case.command(&["--server", &sim.url()]);
    let (output, left) = run_marked(command.env("KV_ENV_LOG", &log), "mcp-stdio");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 12, "{stderr}");
    let runs = assert_rows_are_what_was_sampled(&rows, &sim.transcript());
    assert!(
        runs.iter().all(|&n| n == 2),
        "a tool turn and an answer: {runs:?}"
    );
    assert_env_rewards_are_verifys(&rows, &log);
    for row in &rows {
        // The environment's tool ran (its result is the store's JSON), and neither verify
        // nor reset was offered to the model.
        assert!(
            row.completion.iter().any(|m| m["role"] == "tool"
                && m["content"]
                    .as_str()
                    .is_some_and(|c| c.contains("\"result\""))),
            "{:?}",
            row.completion
        );
    }
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "server processes left behind: {stderr}"
    );
}

#[test]
fn a_stdio_mcp_server_sandboxed_on_request_serves_its_sessions_without_the_engine_s_environment() {
    // The server's first words on stderr (logged by the engine) say what it sees of the
    // engine's SECRET_X; then it is the example's server.
    let secret = format!("secret-{}", std::process::id());
    // And what it reads of root's files and of a credential planted under $HOME.
    let planted = test_support::PlantedInHome::new("mcp-sandboxed", "token", &secret);
    let case = environment_case(
        "mcp-sandboxed",
        &format!(
            "command = [\"sh\", \"-c\", \"echo seen=${{SECRET_X:-nothing}} >&2; \
             cat /etc/shadow {} >&2; exec \\\"$0\\\" \\\"$1\\\"\", {}, {}]\n\
             sandbox = \"bwrap\"",
            planted.file().display(),
            toml_path(&mcp_python()),
            toml_path(&kv_env())
        ),
    );
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let mut command = case.command(&["--server", &sim.url()]);
    let (output, left) = run_marked(
        command.env("SECRET_X", &secret).env("RUST_LOG", "info"),
        "mcp-sandboxed",
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 12, "{stderr}");
    assert!(
        rows.iter().all(|row| row.rewards["env"].as_f64().is_some()),
        "every session verified"
    );
    assert!(stderr.contains("seen=nothing"), "{stderr}");
    assert!(
        !stderr.contains(&secret),
        "the server saw the engine's variable or the planted credential: {stderr}"
    );
    assert!(
        !stderr.contains("root:"),
        "the server read /etc/shadow: {stderr}"
    );
    // Not shown at all: the sandbox's /etc is an allow-list.
    assert!(
        stderr.contains("/etc/shadow: No such file or directory"),
        "{stderr}"
    );
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "server processes left behind: {stderr}"
    );
}

/// A free port on 127.0.0.1 (bound, then released for the server to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// The example server over streamable HTTP on `port`, once it accepts connections.
fn http_server(port: u16, log: &Path, marker: &str, stderr: &Path) -> Child {
    let mut child = Command::new(mcp_python())
        .arg(kv_env())
        .args(["--http", &port.to_string()])
        .env("KV_ENV_LOG", log)
        .env(MARKER, marker)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(stderr).expect("create the stderr file"))
        .spawn()
        .expect("python starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the MCP server did not listen: {}",
                std::fs::read_to_string(stderr).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn a_streamable_http_mcp_environment_gives_one_session_per_rollout() {
    let marker = format!("mcp-http-{}", std::process::id());
    let port = free_port();
    let case = environment_case(
        "mcp-http",
        &format!("url = \"http://127.0.0.1:{port}/mcp\""),
    );
    let log = case.dir.join("verify.jsonl");
    let mut server = http_server(port, &log, &marker, &case.dir.join("server.txt"));
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let output = case
        .command(&["--server", &sim.url()])
        .stdin(Stdio::null())
        .output()
        .expect("the binary starts");
    let _ = server.kill();
    let _ = server.wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 12, "{stderr}");
    assert_rows_are_what_was_sampled(&rows, &sim.transcript());
    // Each rollout had a store of its own: every episode reached its own goal.
    assert_env_rewards_are_verifys(&rows, &log);
    assert_eq!(survivors(&marker), Vec::<u32>::new());
}

#[test]
fn ctrl_c_leaves_no_mcp_server_process_behind() {
    let marker = format!("mcp-sigint-{}", std::process::id());
    let case = Case::new("mcp-sigint");
    case.write_dataset(40);
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 4\nmax_turns = 3\n\n[environment]\nkind = \"mcp\"\ncommand = [{}, {}]\n\n[simulator]\ntool_rounds = 1\ntool_name = \"calculator\"\nlatency = \"300ms\"\n",
        toml_path(&mcp_python()),
        toml_path(&kv_env())
    ));
    // SIGINT once a server process runs besides the binary.
    let (code, stderr) = interrupted_while_tools_run(&case, &marker, &["--drain-timeout", "1s"]);
    let left = survivors(&marker);
    kill_all(&left);
    assert!(matches!(code, Some(0..=2)), "{code:?}: {stderr}");
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "server processes left behind: {stderr}"
    );
}

#[test]
fn a_server_s_own_child_processes_die_with_its_session() {
    let python = toml_path(&mcp_python());
    let server = toml_path(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_server_with_child.py"),
    );
    let case = Case::new("mcp-child");
    case.write_dataset(2);
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 4\nmax_turns = 3\n\n[environment]\nkind = \"mcp\"\ncommand = [{python}, {server}]\ntimeout = \"60s\"\n\n[simulator]\ntool_rounds = 1\ntool_name = \"calculator\"\n"
    ));
    let children = case.dir.join("children.txt");
    let (output, left) = run_marked(
        case.command(&[]).env("MCP_CHILD_LOG", &children),
        "mcp-child",
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 4, "{stderr}");
    assert!(
        rows.iter()
            .all(|row| row.rewards["env"].as_f64() == Some(1.0)),
        "every session verified"
    );
    let helpers = std::fs::read_to_string(&children).unwrap_or_default();
    assert_eq!(
        helpers.lines().count(),
        rows.len(),
        "a server, and its helper, per rollout: {helpers}"
    );
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "the helpers of closed sessions were left running: {stderr}"
    );
}

/// Runs an environment `command` that goes wrong; returns stderr.
fn bad_environment(name: &str, command: &str, timeout: &str) -> String {
    let case = Case::new(&format!("mcp-bad-{name}"));
    case.write_dataset(2);
    case.write_config(&format!(
        "num_generations = 2\nmax_inflight = 2\nretries = 0\n\n[environment]\nkind = \"mcp\"\ncommand = {command}\ntimeout = \"{timeout}\"\ncreate_attempts = 1\n\n[simulator]\ntool_rounds = 1\ntool_name = \"calculator\"\n"
    ));
    let (output, left) = run_marked(&mut case.command(&[]), &format!("mcp-bad-{name}"));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "{name}: processes left behind: {stderr}"
    );
    assert_eq!(
        output.status.code(),
        Some(1),
        "{name}: every rollout failed: {stderr}"
    );
    stderr
}

#[test]
fn servers_that_go_wrong_fail_their_rollouts_naming_the_server_and_the_problem() {
    let python = toml_path(&mcp_python());
    let bad =
        toml_path(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mcp_bad_server.py"));
    let cases = [
        (
            "no-start",
            r#"["sh", "-c", "exit 3"]"#.to_owned(),
            "session_create: MCP server `sh -c exit 3`: no session after 1 attempt(s): MCP server `sh -c exit 3`: the MCP handshake failed",
        ),
        (
            "garbage",
            r#"["sh", "-c", "echo '{not json'; echo 'nor this'; sleep 60"]"#.to_owned(),
            "session_create: MCP server `sh -c echo '{not json'; echo 'nor this'; sleep 60`: no session",
        ),
        (
            "no-tools",
            format!("[{python}, {bad}, \"no-tools\"]"),
            "lists no tools",
        ),
        (
            "no-verify",
            format!("[{python}, {bad}, \"no-verify\"]"),
            "has no verify tool `verify` (its tools: calculator)",
        ),
        (
            "exit-mid",
            format!("[{python}, {bad}, \"exit-mid\"]"),
            "environment: MCP server",
        ),
    ];
    for (name, command, expected) in cases {
        // A server that never answers is waited for as long as the timeout says; a Python
        // server gets time to start on a busy machine.
        let timeout = if name == "garbage" { "5s" } else { "60s" };
        let stderr = bad_environment(name, &command, timeout);
        assert!(
            stderr.contains(expected),
            "{name}: expected {expected:?} in: {stderr}"
        );
    }
}

#[test]
fn step_rewards_of_an_mcp_environment_are_kept_per_turn_and_give_each_turn_its_credit() {
    // kv_env's calculator gives 0.25 to the call that stores the goal; the simulator calls it
    // once with the question's expression, then answers. Turn credit with gamma 0.5: a
    // row's returns are t1 = R (its reward) and t0 = 0.25 + 0.5 * R.
    let case = environment_case(
        "mcp-steps",
        &format!(
            "command = [{}, {}]",
            toml_path(&mcp_python()),
            toml_path(&kv_env())
        ),
    );
    let config = std::fs::read_to_string(case.config_file()).expect("the config");
    // A reward that differs within groups, so that their advantages are not all 0: whether
    // the answer's number (random, drawn from each request's seed) starts with 0 to 4.
    let config = config.replacen(
        "seed = 7\n",
        "seed = 7\ncredit = \"turn\"\ngamma = 0.5\n",
        1,
    ) + "\n[[rewards]]\nspec = \"regex:answer is [0-4]\"\n";
    std::fs::write(case.config_file(), config).expect("the config");
    let runtime = runtime();
    let sim = simulator(&runtime, 1, "calculator");
    let (output, _) = run_marked(&mut case.command(&["--server", &sim.url()]), "mcp-steps");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let rows = case.rows();
    assert_eq!(rows.len(), 12, "{stderr}");

    let mut groups: BTreeMap<u64, Vec<&TrainingSample>> = BTreeMap::new();
    for row in &rows {
        // The tool turn's step reward is what the server put in its result; the answer's
        // turn made no call.
        let told: f64 = row.environment["tools"]
            .as_array()
            .expect("the calls' metadata")
            .iter()
            .filter_map(|call| call["metadata"]["structured"]["reward"].as_f64())
            .sum();
        assert_eq!(told, 0.25, "{:?}", row.environment);
        assert_eq!(row.step_rewards, [Some(0.25), None]);
        // One span per assistant turn, covering exactly the trained tokens.
        assert_eq!(row.advantage_spans.len(), 2);
        let mut in_spans = vec![0u8; row.input_ids.len()];
        for span in &row.advantage_spans {
            in_spans[span.start..span.end].fill(1);
        }
        assert_eq!(in_spans, row.completion_mask);
        groups.entry(row.group_id).or_default().push(row);
    }
    let mut spread_groups = 0;
    for (group, rows) in groups {
        // By hand: TRL's GRPO over the episode returns (population std, 1e-8 added to it),
        // each turn's return through the same mean and std.
        let reward = |row: &TrainingSample| row.reward.expect("scored");
        let episodes: Vec<f64> = rows.iter().map(|row| 0.25 + 0.5 * reward(row)).collect();
        let mean = episodes.iter().sum::<f64>() / episodes.len() as f64;
        let std = (episodes.iter().map(|g| (g - mean).powi(2)).sum::<f64>()
            / episodes.len() as f64)
            .sqrt();
        let spread = episodes.iter().any(|&g| g != episodes[0]);
        spread_groups += usize::from(spread);
        for row in rows {
            let expected = |value: f64| {
                if spread {
                    (value - mean) / (std + 1e-8)
                } else {
                    0.0
                }
            };
            let (first, second) = (&row.advantage_spans[0], &row.advantage_spans[1]);
            let context = format!("group {group}, rollout {}", row.rollout_id.0);
            assert!(
                (first.advantage - expected(0.25 + 0.5 * reward(row))).abs() < 1e-9,
                "{context}: {first:?}"
            );
            assert!(
                (second.advantage - expected(reward(row))).abs() < 1e-9,
                "{context}: {second:?}"
            );
            assert_eq!(row.advantage, first.advantage, "{context}");
        }
    }
    assert!(
        spread_groups > 0,
        "some group's rewards differ: {:?}",
        rows.iter()
            .map(|row| (row.group_id, row.reward))
            .collect::<Vec<_>>()
    );
}
