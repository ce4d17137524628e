//! `python` sessions on the kernels of a real Jupyter Kernel Gateway (`gateway = ...`): what
//! a run keeps, what it leaves, and what it does when the gateway is down. Each test starts
//! its own gateway from the fixture cache's venv (`cargo xtask fixtures`).

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use test_support::jupyter::{JupyterGateway, TOKEN};

use super::rollout::{Case, exit_within, toml_path};

/// The variable the runs read the gateway's token from.
const TOKEN_ENV: &str = "ASYNC_GRPO_TEST_GATEWAY_TOKEN";

/// Writes a run of `rollouts` rollouts of one question whose `rounds` turns each call the
/// gateway-backed `python` tool with `code`.
fn write_config(case: &Case, url: &str, rollouts: usize, rounds: usize, code: &str, timeout: &str) {
    case.write_dataset(1);
    case.write_config(&format!(
        "num_generations = {rollouts}\nmax_inflight = {rollouts}\nmax_turns = {}\nretries = 0\n\
         max_tokens = 2048\n\n\
         [[tools]]\nname = \"python\"\nkind = \"python\"\nsession = \"rollout\"\n\
         gateway = \"{url}\"\ngateway_token_env = \"{TOKEN_ENV}\"\nlease_dir = {}\n\
         timeout = \"{timeout}\"\n\n\
         [simulator]\ntool_rounds = {rounds}\nanswer_tokens = 4\ntool_arguments = {{ code = {} }}\n",
        rounds + 1,
        toml_path(&case.dir.join("leases")),
        serde_json::to_string(code).expect("a string"),
    ));
}

/// The text of each tool message of a row.
fn tool_results(row: &rollout_core::TrainingSample) -> Vec<String> {
    row.completion
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect()
}

/// The lease files left in the case's lease folder.
fn lease_files(case: &Case) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![case.dir.join("leases")];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            } else {
                found.push(entry.path().display().to_string());
            }
        }
    }
    found
}

#[test]
fn a_gateway_session_keeps_its_rollout_s_state_and_no_kernel_outlives_the_run() {
    let gateway = JupyterGateway::start("cli-session", &[]);
    let case = Case::new("kernels-session");
    // The third call of a kernel kills it.
    let code =
        "import os\nn = globals().get('n', 0) + 1\nif n == 3:\n    os._exit(1)\nprint('call', n)";
    write_config(&case, &gateway.url, 2, 4, code, "30s");
    let outcome = case.run({
        let mut command = case.command(&[]);
        command.env(TOKEN_ENV, TOKEN);
        command
    });
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    assert_eq!(outcome.rows.len(), 2, "{}", outcome.stderr);
    for row in &outcome.rows {
        let results = tool_results(row);
        assert_eq!(results.len(), 4, "{results:?}");
        // Each rollout counts its own calls: its sibling's never reach its kernel.
        assert_eq!(results[..2], ["call 1", "call 2"], "{}", outcome.stderr);
        assert!(
            results[2].contains("is lost")
                && results[2].contains("the next call starts a new kernel"),
            "{}",
            results[2]
        );
        assert_eq!(
            results[3],
            "[a new Python kernel: the previous call lost its kernel, and what earlier calls \
             defined is gone]\ncall 1",
            "{}",
            outcome.stderr
        );
    }
    assert_eq!(
        gateway.kernels(),
        Vec::<String>::new(),
        "kernels outlived their run"
    );
    assert_eq!(
        lease_files(&case),
        Vec::<String>::new(),
        "a lease file outlived its run"
    );
}

/// Starts a run of two rollouts whose kernels sleep, and returns it with the ids of its two
/// kernels once both are in their cell (each kernel marks that with a file: kernels of one
/// Kernel Gateway share its machine's files).
fn engine_holding_two_kernels(
    case: &Case,
    gateway: &JupyterGateway,
) -> (std::process::Child, Vec<String>) {
    let marks = case.dir.join("marks");
    std::fs::create_dir_all(&marks).expect("the marks' folder");
    let code = format!(
        "import os, time\nopen(os.path.join({}, 'in-cell-%d' % os.getpid()), 'w').close()\n\
         time.sleep(3)\nprint('slept')",
        serde_json::to_string(&marks.display().to_string()).expect("a string")
    );
    write_config(case, &gateway.url, 2, 1, &code, "60s");
    let mut child = case
        .command(&[])
        .env(TOKEN_ENV, TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(case.dir.join("stderr.txt")).expect("the engine's stderr"))
        .spawn()
        .expect("the binary starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let in_cell = std::fs::read_dir(&marks).map_or(0, |entries| entries.count());
        if in_cell == 2 {
            return (child, gateway.kernels());
        }
        if Instant::now() > deadline || child.try_wait().ok().flatten().is_some() {
            let _ = child.kill();
            panic!(
                "the engine's two kernels did not start their cells:\n{}",
                gateway.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_engine_killed_mid_run_leaves_no_kernel_after_the_gateway_s_cull_timeout() {
    // Idle kernels with no connection culled after 3 s, checked every second.
    let gateway = JupyterGateway::start(
        "cli-culled",
        &[
            "--MappingKernelManager.cull_idle_timeout=3",
            "--MappingKernelManager.cull_interval=1",
        ],
    );
    let case = Case::new("kernels-culled");
    let (mut child, ids) = engine_holding_two_kernels(&case, &gateway);
    assert_eq!(ids.len(), 2, "{ids:?}");
    child.kill().expect("SIGKILL sent");
    let _ = child.wait();
    // Each finishes its 3 s cell, is idle with no connection, and is culled 3 s on.
    gateway.wait_until_gone(&ids, Duration::from_secs(30), "culled");
}

#[test]
fn the_next_run_deletes_the_kernels_of_an_engine_killed_mid_run() {
    let gateway = JupyterGateway::start("cli-reaped", &[]);
    let case = Case::new("kernels-reaped");
    let (mut child, ids) = engine_holding_two_kernels(&case, &gateway);
    child.kill().expect("SIGKILL sent");
    let _ = child.wait();
    assert_eq!(
        lease_files(&case).len(),
        1,
        "the killed engine's lease file"
    );
    let mut still = gateway.kernels();
    still.sort();
    let mut held = ids.clone();
    held.sort();
    assert_eq!(
        still, held,
        "no cull here: the killed engine's kernels are still there"
    );
    // The next run (same lease folder) deletes them before its first kernel.
    write_config(&case, &gateway.url, 2, 1, "print('next')", "60s");
    let outcome = case.run({
        let mut command = case.command(&["--overwrite"]);
        command.env(TOKEN_ENV, TOKEN);
        command
    });
    assert_eq!(outcome.code, Some(0), "{}", outcome.stderr);
    outcome.assert_said("deleted the kernels that runs killed earlier left");
    assert_eq!(gateway.kernels(), Vec::<String>::new());
    assert_eq!(lease_files(&case), Vec::<String>::new());
}

#[test]
fn a_gateway_that_is_down_fails_the_rollouts_and_the_run_s_failure_policy_ends_the_run() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let case = Case::new("kernels-down");
    write_config(
        &case,
        &format!("http://127.0.0.1:{port}"),
        2,
        1,
        "print(1)",
        "30s",
    );
    let started = Instant::now();
    let outcome = case.run({
        let mut command = case.command(&[]);
        command.env(TOKEN_ENV, TOKEN);
        command
    });
    assert_eq!(outcome.code, Some(1), "{}", outcome.stderr);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    outcome.assert_said("tool_backend");
    outcome.assert_said(&format!(
        "the Jupyter gateway at http://127.0.0.1:{port} cannot be reached"
    ));
    assert!(!outcome.stderr.contains(TOKEN), "{}", outcome.stderr);
}

#[test]
fn a_gateway_table_that_cannot_work_is_refused_by_name() {
    let case = Case::new("kernels-refused");
    for (table, expected) in [
        (
            "gateway = \"http://127.0.0.1:9\"",
            "`gateway` runs sessions on remote kernels: it needs `session = \"rollout\"`",
        ),
        (
            "session = \"rollout\"\ngateway = \"http://127.0.0.1:9\"\nwarm = 2",
            "`warm` is a local interpreter's setting",
        ),
        (
            "session = \"rollout\"\ngateway = \"http://127.0.0.1:9\"\nlimits = { processes = 4 }",
            "a gateway's kernels run where the gateway runs them",
        ),
        (
            "session = \"rollout\"\nkernel = \"python3\"",
            "`kernel` is a remote kernel's setting: it needs `gateway = \"http://...\"`",
        ),
        (
            "session = \"rollout\"\ngateway = \"ftp://127.0.0.1:9\"",
            "is not http:// or https://",
        ),
        (
            "session = \"rollout\"\ngateway = \"http://127.0.0.1:9\"\n\
             gateway_token_env = \"ASYNC_GRPO_TEST_NO_SUCH_VARIABLE\"",
            "the environment variable ASYNC_GRPO_TEST_NO_SUCH_VARIABLE is not set",
        ),
    ] {
        case.write_dataset(1);
        case.write_config(&format!(
            "num_generations = 2\n\n[[tools]]\nname = \"python\"\nkind = \"python\"\n{table}\n"
        ));
        let outcome = case.rollout(&[]);
        assert_eq!(outcome.code, Some(1), "{table}: {}", outcome.stderr);
        outcome.assert_said("tool 'python'");
        outcome.assert_said(expected);
    }
}

#[test]
fn a_run_stopped_by_ctrl_c_leaves_no_kernel() {
    let gateway = JupyterGateway::start("cli-sigint", &[]);
    let case = Case::new("kernels-sigint");
    let (mut child, ids) = engine_holding_two_kernels(&case, &gateway);
    assert_eq!(ids.len(), 2, "{ids:?}");
    let _ = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let code = exit_within(
        &mut child,
        Duration::from_secs(60),
        "a run stopped by Ctrl-C",
    );
    assert!(code.is_some(), "the run did not stop");
    // At once: the engine's drain waited for the deletes.
    assert_eq!(
        gateway.kernels(),
        Vec::<String>::new(),
        "kernels outlived their run"
    );
    assert_eq!(lease_files(&case), Vec::<String>::new());
}
