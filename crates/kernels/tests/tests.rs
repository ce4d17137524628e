//! Kernels of a real Jupyter Kernel Gateway: each test starts `jupyter kernelgateway` from the
//! venv that `cargo xtask fixtures` makes (`<cache>/venv-jupyter`) on 127.0.0.1 at a free
//! port, with a token, and stops it when it ends. Without the venv, each test fails saying to
//! run `cargo xtask fixtures`.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use async_grpo_kernels::{Gateway, Kernel, KernelError};
use test_support::{ScratchDir, cache_dir, within};
use tokio::io::{AsyncBufReadExt, BufReader};

const TOKEN: &str = "test-token-3f9c";
/// The longest a test waits for one thing.
const PATIENCE: Duration = Duration::from_secs(60);
/// The environment variables of the child engine of `hold_kernels`.
const HOLD_URL: &str = "KERNELS_TEST_HOLD_URL";
const HOLD_LEASES: &str = "KERNELS_TEST_HOLD_LEASES";
const HOLD_COUNT: &str = "KERNELS_TEST_HOLD_COUNT";

/// A `jupyter kernelgateway` of the test's own, stopped when dropped.
struct GatewayProcess {
    child: std::process::Child,
    url: String,
    dir: ScratchDir,
}

impl GatewayProcess {
    /// A gateway with the extra options `options`.
    async fn start(name: &str, options: &[&str]) -> GatewayProcess {
        let jupyter = cache_dir().join("venv-jupyter").join("bin").join("jupyter");
        assert!(
            jupyter.is_file(),
            "{} is missing: run `cargo xtask fixtures` to make the venv with Jupyter Kernel \
             Gateway (the `fixtures` nextest profile runs these tests)",
            jupyter.display()
        );
        let dir = ScratchDir::new(&format!("kernels-{name}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let log = std::fs::File::create(dir.join("gateway.log")).expect("the gateway's log");
        let mut command = std::process::Command::new("timeout");
        // Bounded even if this test process dies without stopping it.
        command
            .args(["--kill-after=5", "600"])
            .arg(&jupyter)
            .arg("kernelgateway")
            .arg("--KernelGatewayApp.ip=127.0.0.1")
            .arg(format!("--KernelGatewayApp.port={port}"))
            .arg("--KernelGatewayApp.port_retries=0")
            .arg(format!("--KernelGatewayApp.auth_token={TOKEN}"))
            .arg("--JupyterWebsocketPersonality.list_kernels=True");
        command.args(options);
        for (variable, sub) in [
            ("JUPYTER_RUNTIME_DIR", "runtime"),
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_DATA_DIR", "data"),
            ("IPYTHONDIR", "ipython"),
        ] {
            command.env(variable, dir.join(sub));
        }
        command
            .current_dir(&*dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log, twice"))
            .stderr(log);
        let child = command.spawn().expect("`timeout` starts the gateway");
        let mut gateway = GatewayProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        gateway.wait_until_up().await;
        gateway
    }

    async fn wait_until_up(&mut self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let answer = client
                .get(format!("{}/api", self.url))
                .header("Authorization", format!("token {TOKEN}"))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if answer.is_ok_and(|a| a.status().is_success()) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the gateway ended ({status}) before it answered:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the gateway did not answer within {PATIENCE:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("gateway.log")).unwrap_or_default()
    }

    /// The engine's view of this gateway, with its token.
    fn gateway(&self) -> Gateway {
        Gateway::new(&self.url, Some(TOKEN.to_owned())).expect("a gateway")
    }

    /// The kernels the gateway has (`GET /api/kernels`).
    async fn kernels(&self) -> Vec<String> {
        let answer = reqwest::Client::new()
            .get(format!("{}/api/kernels", self.url))
            .header("Authorization", format!("token {TOKEN}"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("GET /api/kernels");
        assert!(
            answer.status().is_success(),
            "GET /api/kernels: {}",
            answer.status()
        );
        let listed: Vec<serde_json::Value> = answer.json().await.expect("a list of kernels");
        listed
            .iter()
            .filter_map(|kernel| kernel["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// Waits until the gateway no longer has `id`.
    async fn wait_until_gone(&self, id: &str, patience: Duration, what: &str) {
        let deadline = Instant::now() + patience;
        while self.kernels().await.iter().any(|k| k == id) {
            assert!(
                Instant::now() < deadline,
                "{what}: kernel {id} still there after {patience:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        // SIGTERM: `timeout` passes it on, and the gateway shuts its kernels down.
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(gateway: &Gateway) -> Kernel {
    within(PATIENCE, "a kernel's start", gateway.start(None))
        .await
        .expect("a kernel starts")
}

async fn run(kernel: &mut Kernel, code: &str, max_output: usize) -> (String, bool) {
    let cell = within(PATIENCE, code, kernel.execute(code, max_output))
        .await
        .unwrap_or_else(|e| panic!("{code:?} runs: {e}"));
    (cell.output, cell.raised)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_persists_in_a_kernel_and_kernels_share_none() {
    let process = GatewayProcess::start("state", &[]).await;
    let gateway = process.gateway();
    let mut a = start(&gateway).await;
    let mut b = start(&gateway).await;
    assert_ne!(a.id(), b.id());
    let (output, raised) = run(
        &mut a,
        "import json\nx = 41\nwith open('a.txt', 'w') as f:\n    f.write('kept')",
        1000,
    )
    .await;
    assert_eq!((output.as_str(), raised), ("", false));
    let (output, raised) = run(
        &mut a,
        "print(x + 1, json.dumps([1]), open('a.txt').read())",
        1000,
    )
    .await;
    assert_eq!((output.as_str(), raised), ("42 [1] kept\n", false));
    for name in ["x", "json"] {
        let (output, raised) = run(&mut b, name, 1000).await;
        assert!(
            raised,
            "{name} is not defined in the other kernel: {output}"
        );
        assert!(output.contains("NameError"), "{output}");
    }
    let (output, _) = run(&mut a, "x", 1000).await;
    assert_eq!(output, "41\n", "the first kernel kept its state");
    a.close().await.expect("closed");
    b.close().await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_comes_in_order_and_is_capped() {
    let process = GatewayProcess::start("output", &[]).await;
    let gateway = process.gateway();
    let mut kernel = start(&gateway).await;
    let code = "import sys\n\
                for i in range(3):\n    \
                    print(f'out{i}', flush=True)\n    \
                    print(f'err{i}', file=sys.stderr, flush=True)\n\
                from IPython.display import display\n\
                display('shown')\n\
                'value'";
    let (output, raised) = run(&mut kernel, code, 1000).await;
    assert_eq!(
        (output.as_str(), raised),
        (
            "out0\nerr0\nout1\nerr1\nout2\nerr2\n'shown'\n'value'\n",
            false
        )
    );
    let (output, _) = run(&mut kernel, "print('x' * 1000)", 100).await;
    assert_eq!(
        output,
        format!("{}\n[output truncated: 901 more bytes]", "x".repeat(100))
    );
    // Many messages, cut in the middle of one, and everything after counted.
    let whole: String = (0..200).map(|i| format!("{i}\n")).collect();
    let (output, _) = run(
        &mut kernel,
        "for i in range(200):\n    print(i, flush=True)",
        50,
    )
    .await;
    assert_eq!(
        output,
        format!(
            "{}\n[output truncated: {} more bytes]",
            &whole[..50],
            whole.len() - 50
        )
    );
    // Much more output than kept costs the session nothing. (Under the gateway's own
    // `iopub_data_rate_limit`, 1 MB/s by default, past which it sends a notice instead.)
    let (output, _) = run(&mut kernel, "print('y' * 900_000)", 10).await;
    assert_eq!(output, "yyyyyyyyyy\n[output truncated: 899991 more bytes]");
    let (output, _) = run(&mut kernel, "1 + 1", 10).await;
    assert_eq!(output, "2\n");
    kernel.close().await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_the_bound_loses_the_kernel() {
    let process = GatewayProcess::start("bound", &[]).await;
    let gateway = process.gateway().with_max_message(1 << 20);
    let mut kernel = start(&gateway).await;
    let error = within(
        PATIENCE,
        "a cell printing 2 MB at once",
        kernel.execute("print('z' * 2_000_000)", 100),
    )
    .await
    .expect_err("a 2 MB message is past a 1 MiB bound");
    assert!(error.is_lost(), "{error}");
    assert!(error.to_string().contains("WebSocket failed"), "{error}");
    let id = kernel.id().to_owned();
    kernel.close().await.expect("closed");
    assert!(!process.kernels().await.contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exception_gives_its_traceback() {
    let process = GatewayProcess::start("traceback", &[]).await;
    let gateway = process.gateway();
    let mut kernel = start(&gateway).await;
    let (output, raised) = run(
        &mut kernel,
        "print('before')\ndef f():\n    return 1 / 0\n\nf()",
        10_000,
    )
    .await;
    assert!(raised, "{output}");
    assert!(output.starts_with("before\n"), "{output}");
    assert!(output.contains("ZeroDivisionError"), "{output}");
    assert!(output.contains("return 1 / 0"), "{output}");
    assert!(
        !output.contains('\u{1b}'),
        "colour codes are stripped: {output:?}"
    );
    let (output, raised) = run(&mut kernel, "1 + 1", 100).await;
    assert_eq!(
        (output.as_str(), raised),
        ("2\n", false),
        "the kernel goes on"
    );
    kernel.close().await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_is_deleted_when_closed_and_when_dropped() {
    let process = GatewayProcess::start("delete", &[]).await;
    let gateway = process.gateway();
    let closed = start(&gateway).await;
    let dropped = start(&gateway).await;
    let dropped_off_runtime = start(&gateway).await;
    let ids = [closed.id(), dropped.id(), dropped_off_runtime.id()].map(str::to_owned);
    let listed = process.kernels().await;
    assert!(ids.iter().all(|id| listed.contains(id)), "{listed:?}");

    closed.close().await.expect("closed");
    assert!(
        !process.kernels().await.contains(&ids[0]),
        "gone as soon as close returns"
    );
    drop(dropped);
    process
        .wait_until_gone(&ids[1], Duration::from_secs(10), "dropped")
        .await;
    std::thread::spawn(move || drop(dropped_off_runtime))
        .join()
        .expect("dropped on a thread with no runtime");
    process
        .wait_until_gone(&ids[2], Duration::from_secs(10), "dropped with no runtime")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kernel_keeps_its_connection() {
    // The gateway pings each WebSocket every second and closes one that has not answered
    // for 30 s (jupyter_server's floor): a rollout's kernel waits that long and more between
    // two calls while the model writes.
    let process = GatewayProcess::start("idle", &["--KernelGatewayApp.ws_ping_interval=1"]).await;
    let gateway = process.gateway();
    let mut kernel = start(&gateway).await;
    run(&mut kernel, "x = 7", 100).await;
    tokio::time::sleep(Duration::from_secs(36)).await;
    let (output, _) = run(&mut kernel, "x", 100).await;
    assert_eq!(output, "7\n");
    kernel.close().await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_dies_mid_call_or_between_calls_is_an_error() {
    let process = GatewayProcess::start("dies", &[]).await;
    let gateway = process.gateway();
    let mut kernel = start(&gateway).await;
    run(&mut kernel, "x = 1", 100).await;
    let error = within(
        PATIENCE,
        "a cell that kills its kernel",
        kernel.execute("import os; os._exit(1)", 100),
    )
    .await
    .expect_err("the kernel died");
    assert!(error.is_lost() && kernel.is_lost(), "{error}");
    let message = error.to_string();
    assert!(message.contains("died"), "{message}");
    assert!(message.contains("state"), "{message}");
    let again = kernel.execute("x", 100).await.expect_err("still lost");
    assert!(again.is_lost(), "{again}");
    let id = kernel.id().to_owned();
    kernel.close().await.expect("closed");
    assert!(!process.kernels().await.contains(&id));

    // One that dies between two calls (the gateway restarts it, empty): the next call says so.
    let mut kernel = start(&gateway).await;
    run(
        &mut kernel,
        "import os, threading, time\n\
         x = 1\n\
         threading.Thread(target=lambda: (time.sleep(0.5), os._exit(1))).start()",
        100,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let error = within(
        PATIENCE,
        "a call after the kernel died",
        kernel.execute("x", 100),
    )
    .await
    .expect_err("the kernel died between calls");
    assert!(
        error.is_lost() && error.to_string().contains("died"),
        "{error}"
    );
    let id = kernel.id().to_owned();
    kernel.close().await.expect("closed");
    assert!(!process.kernels().await.contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_abandoned_part_way_loses_the_kernel() {
    let process = GatewayProcess::start("abandoned", &[]).await;
    let gateway = process.gateway();
    let mut kernel = start(&gateway).await;
    let abandoned = tokio::time::timeout(
        Duration::from_secs(1),
        kernel.execute("import time; time.sleep(30)", 100),
    )
    .await;
    assert!(abandoned.is_err(), "the caller's timeout ends the call");
    let error = kernel.execute("1", 100).await.expect_err("lost");
    assert!(error.to_string().contains("abandoned"), "{error}");
    let id = kernel.id().to_owned();
    // Deleted although busy.
    within(
        Duration::from_secs(20),
        "closing a busy kernel",
        kernel.close(),
    )
    .await
    .expect("closed");
    assert!(!process.kernels().await.contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_a_clear_error() {
    let process = GatewayProcess::start("token", &[]).await;
    let gateway = Gateway::new(&process.url, Some("wrong-token".to_owned())).expect("a gateway");
    let error = within(PATIENCE, "a start with a wrong token", gateway.start(None))
        .await
        .expect_err("refused");
    let message = error.to_string();
    assert!(
        matches!(
            error,
            KernelError::Status {
                status: 401 | 403,
                ..
            }
        ),
        "{message}"
    );
    assert!(
        message.contains("token") && !message.contains("wrong-token"),
        "{message}"
    );
    assert!(process.kernels().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_is_down_is_a_clear_error_within_seconds() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let url = format!("http://user:hunter2@127.0.0.1:{port}/?token=q");
    let gateway = Gateway::new(&url, Some("secret-token".to_owned())).expect("a gateway");
    let started = Instant::now();
    let error = within(
        Duration::from_secs(10),
        "a start on nothing",
        gateway.start(None),
    )
    .await
    .expect_err("nothing listens");
    assert!(started.elapsed() < Duration::from_secs(6));
    let message = error.to_string();
    assert!(
        matches!(error, KernelError::Unreachable { .. }),
        "{message}"
    );
    assert!(
        message.contains(&format!("http://127.0.0.1:{port}"))
            && message.contains("cannot be reached"),
        "{message}"
    );
    for secret in ["hunter2", "secret-token", "token=q"] {
        assert!(!message.contains(secret), "{message}");
    }
    assert!(!format!("{gateway:?}").contains("secret-token"));

    // One that takes connections and never answers: bounded by the timeouts.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a listener");
    let silent = format!("http://{}", listener.local_addr().expect("its address"));
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let scratch = ScratchDir::new("kernels-silent");
    let leases = scratch.join("leases");
    std::fs::write(&leases, "+0000-left-by-an-earlier-run\n").expect("a lease");
    let gateway = Gateway::new(&silent, None)
        .expect("a gateway")
        .with_leases(&leases)
        .with_request_timeout(Duration::from_secs(1))
        .with_start_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let error = within(
        Duration::from_secs(10),
        "a start on a silent gateway",
        gateway.start(None),
    )
    .await
    .expect_err("no answer");
    assert!(matches!(error, KernelError::TimedOut { .. }), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(error.to_string().contains("POST /api/kernels"), "{error}");
    let error = within(
        Duration::from_secs(10),
        "a reap on a silent gateway",
        gateway.reap_leases(),
    )
    .await
    .expect_err("no answer");
    assert!(matches!(error, KernelError::TimedOut { .. }), "{error}");
    assert_eq!(
        std::fs::read_to_string(&leases).expect("the leases"),
        "+0000-left-by-an-earlier-run\n",
        "a lease not reaped stays"
    );
    held.abort();
}

/// Not a test on its own: the engine that `a_killed_engine_*` and `reap_leases_*` run as a
/// child process and kill. It starts `$KERNELS_TEST_HOLD_COUNT` kernels on the gateway at
/// `$KERNELS_TEST_HOLD_URL` (with the lease file `$KERNELS_TEST_HOLD_LEASES`), says `held ID`
/// for each, and waits to be killed (for two minutes at most).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by other tests as a child process"]
async fn hold_kernels() {
    let url = std::env::var(HOLD_URL).expect("run only by the tests that kill it");
    let leases = std::env::var(HOLD_LEASES).expect("a lease file");
    let count: usize = std::env::var(HOLD_COUNT)
        .expect("a count")
        .parse()
        .expect("a number");
    let gateway = Gateway::new(&url, Some(TOKEN.to_owned()))
        .expect("a gateway")
        .with_leases(leases);
    let mut kernels = Vec::new();
    for _ in 0..count {
        let mut kernel = start(&gateway).await;
        run(&mut kernel, "x = 1", 100).await;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "held {}", kernel.id()).expect("stdout");
        stdout.flush().expect("stdout");
        kernels.push(kernel);
    }
    tokio::time::sleep(Duration::from_secs(120)).await;
    panic!("not killed");
}

/// Runs `hold_kernels` as a child engine holding `count` kernels; returns it (killed when
/// dropped) and their ids.
async fn child_engine(
    process: &GatewayProcess,
    leases: &Path,
    count: usize,
) -> (tokio::process::Child, Vec<String>) {
    let mut child = tokio::process::Command::new(std::env::current_exe().expect("this test"))
        .args(["hold_kernels", "--exact", "--ignored", "--nocapture"])
        .env(HOLD_URL, &process.url)
        .env(HOLD_LEASES, leases)
        .env(HOLD_COUNT, count.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the child engine starts");
    let mut lines = BufReader::new(child.stdout.take().expect("its stdout")).lines();
    let mut ids = Vec::new();
    while ids.len() < count {
        let line = within(PATIENCE, "the child engine's kernels", lines.next_line())
            .await
            .expect("its stdout")
            .unwrap_or_else(|| panic!("the child engine ended before holding {count} kernels"));
        if let Some(id) = line.strip_prefix("held ") {
            ids.push(id.to_owned());
        }
    }
    (child, ids)
}

async fn kill(mut child: tokio::process::Child) {
    child.start_kill().expect("SIGKILL");
    within(PATIENCE, "the killed child", child.wait())
        .await
        .expect("reaped");
}

fn lease_file(dir: &Path) -> PathBuf {
    dir.join("kernels.leases")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_leaves_no_kernel_after_the_cull_timeout() {
    // Idle kernels with no connection culled after 3 s, checked every second.
    let process = GatewayProcess::start(
        "killed",
        &[
            "--MappingKernelManager.cull_idle_timeout=3",
            "--MappingKernelManager.cull_interval=1",
        ],
    )
    .await;
    let leases = lease_file(&process.dir);
    let (child, ids) = child_engine(&process, &leases, 2).await;
    // Held (connected) kernels are not culled, however idle.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let listed = process.kernels().await;
    assert!(ids.iter().all(|id| listed.contains(id)), "{listed:?}");
    let leased = std::fs::read_to_string(&leases).expect("the lease file");
    assert!(
        ids.iter().all(|id| leased.contains(&format!("+{id}\n"))),
        "{leased}"
    );
    kill(child).await;
    for id in &ids {
        process
            .wait_until_gone(id, Duration::from_secs(15), "culled")
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_leases_deletes_what_an_earlier_run_left() {
    let process = GatewayProcess::start("reap", &[]).await;
    let leases = lease_file(&process.dir);
    let (child, ids) = child_engine(&process, &leases, 3).await;
    kill(child).await;
    // One of them gone already (culled, deleted by hand): not counted.
    let deleted = reqwest::Client::new()
        .delete(format!("{}/api/kernels/{}", process.url, ids[0]))
        .header("Authorization", format!("token {TOKEN}"))
        .send()
        .await
        .expect("DELETE");
    assert!(deleted.status().is_success());
    let gateway = process.gateway().with_leases(&leases);
    // A kernel of this run, in the same file, is not reaped.
    let mut own = start(&gateway).await;
    run(&mut own, "y = 2", 100).await;
    let reaped = within(PATIENCE, "reaping", gateway.reap_leases())
        .await
        .expect("reaped");
    assert_eq!(reaped, 2);
    assert_eq!(process.kernels().await, [own.id().to_owned()]);
    let (output, _) = run(&mut own, "y", 100).await;
    assert_eq!(output, "2\n", "this run's kernel is untouched");
    assert_eq!(
        std::fs::read_to_string(&leases).expect("the lease file"),
        format!("+{}\n", own.id())
    );
    assert_eq!(gateway.reap_leases().await.expect("reaped"), 0);
    let own_id = own.id().to_owned();
    own.close().await.expect("closed");
    assert_eq!(
        std::fs::read_to_string(&leases).expect("the lease file"),
        format!("+{own_id}\n-{own_id}\n"),
        "a closed kernel's lease is released"
    );
}
