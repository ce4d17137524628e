//! Kernels of a real Jupyter Kernel Gateway: each test starts `jupyter kernelgateway` from the
//! venv that `cargo xtask fixtures` makes (`<cache>/venv-jupyter`) on 127.0.0.1 at a free
//! port, with a token, and stops it when it ends. Without the venv, each test fails saying to
//! run `cargo xtask fixtures`.

use std::time::{Duration, Instant};

use async_grpo_kernels::{Gateway, Kernel, KernelError};
use test_support::{
    ScratchDir,
    jupyter::{JupyterGateway, TOKEN},
    within,
};

/// The longest a test waits for one thing.
const PATIENCE: Duration = Duration::from_secs(60);

/// The engine's view of `process`, with its token.
fn gateway_of(process: &JupyterGateway) -> Gateway {
    Gateway::new(&process.url, Some(TOKEN.to_owned())).expect("a gateway")
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
    let process = JupyterGateway::start("state", &[]);
    let gateway = gateway_of(&process);
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
    let process = JupyterGateway::start("output", &[]);
    let gateway = gateway_of(&process);
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
    let process = JupyterGateway::start("bound", &[]);
    let gateway = gateway_of(&process).with_max_message(1 << 20);
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
    assert!(!process.kernels().contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exception_gives_its_traceback() {
    let process = JupyterGateway::start("traceback", &[]);
    let gateway = gateway_of(&process);
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
    let process = JupyterGateway::start("delete", &[]);
    let gateway = gateway_of(&process);
    let closed = start(&gateway).await;
    let dropped = start(&gateway).await;
    let dropped_off_runtime = start(&gateway).await;
    let ids = [closed.id(), dropped.id(), dropped_off_runtime.id()].map(str::to_owned);
    let listed = process.kernels();
    assert!(ids.iter().all(|id| listed.contains(id)), "{listed:?}");

    closed.close().await.expect("closed");
    assert!(
        !process.kernels().contains(&ids[0]),
        "gone as soon as close returns"
    );
    // A dropped kernel is deleted in the background; `settle` waits for that.
    drop(dropped);
    within(PATIENCE, "settling", gateway.settle()).await;
    assert!(
        !process.kernels().contains(&ids[1]),
        "gone once settled after a drop"
    );
    std::thread::spawn(move || drop(dropped_off_runtime))
        .join()
        .expect("dropped on a thread with no runtime");
    within(PATIENCE, "settling", gateway.settle()).await;
    assert!(
        !process.kernels().contains(&ids[2]),
        "gone once settled after a drop with no runtime"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kernel_keeps_its_connection() {
    // The gateway pings each WebSocket every second and closes one that has not answered
    // for 30 s (jupyter_server's floor): a rollout's kernel waits that long and more between
    // two calls while the model writes.
    let process = JupyterGateway::start("idle", &["--KernelGatewayApp.ws_ping_interval=1"]);
    let gateway = gateway_of(&process);
    let mut kernel = start(&gateway).await;
    run(&mut kernel, "x = 7", 100).await;
    tokio::time::sleep(Duration::from_secs(36)).await;
    let (output, _) = run(&mut kernel, "x", 100).await;
    assert_eq!(output, "7\n");
    kernel.close().await.expect("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_dies_mid_call_or_between_calls_is_an_error() {
    let process = JupyterGateway::start("dies", &[]);
    let gateway = gateway_of(&process);
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
    assert!(!process.kernels().contains(&id));

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
    assert!(!process.kernels().contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_abandoned_part_way_loses_the_kernel() {
    let process = JupyterGateway::start("abandoned", &[]);
    let gateway = gateway_of(&process);
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
    assert!(!process.kernels().contains(&id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_a_clear_error() {
    let process = JupyterGateway::start("token", &[]);
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
    assert!(process.kernels().is_empty());
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
    std::fs::create_dir_all(&leases).expect("the lease folder");
    let left = leases.join("4000000-0123456789ab.leases");
    std::fs::write(&left, "+0000-left-by-an-earlier-run\n").expect("a lease");
    let gateway = Gateway::new(&silent, None)
        .expect("a gateway")
        .with_lease_dir(&leases)
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
        std::fs::read_to_string(&left).expect("the leases"),
        "+0000-left-by-an-earlier-run\n",
        "a lease not reaped stays"
    );
    held.abort();
}

/// What an engine killed while it held kernels leaves: its kernels on the gateway, and its
/// lease file, unlocked now that its process is gone (the binary's tests kill a real engine).
fn left_by_a_killed_engine(
    process: &JupyterGateway,
    leases: &std::path::Path,
    count: usize,
) -> Vec<String> {
    let ids: Vec<String> = (0..count)
        .map(|_| {
            let (status, body) = process.request("POST", "/api/kernels").expect("POST");
            assert_eq!(status, 201, "POST /api/kernels: {body}");
            let model: serde_json::Value = serde_json::from_str(&body).expect("a kernel");
            model["id"].as_str().expect("an id").to_owned()
        })
        .collect();
    std::fs::create_dir_all(leases).expect("the lease folder");
    let journal: String = ids.iter().map(|id| format!("+{id}\n")).collect();
    std::fs::write(leases.join("4000000-0123456789ab.leases"), journal).expect("a lease file");
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_leases_deletes_what_a_killed_engine_left_and_nothing_of_a_live_one() {
    let process = JupyterGateway::start("reap", &[]);
    let leases = process.dir.join("leases");
    let ids = left_by_a_killed_engine(&process, &leases, 3);
    // One of them gone already (culled, deleted by hand): not counted.
    assert!(process.delete(&ids[0]));
    // A live engine sharing the folder: its kernel is not reaped.
    let live = gateway_of(&process).with_lease_dir(&leases);
    let mut theirs = start(&live).await;
    run(&mut theirs, "y = 2", 100).await;
    let gateway = gateway_of(&process).with_lease_dir(&leases);
    let own = start(&gateway).await;
    let reaped = within(PATIENCE, "reaping", gateway.reap_leases())
        .await
        .expect("reaped");
    assert_eq!(reaped, 2);
    let mut listed = process.kernels();
    listed.sort();
    let mut expected = vec![theirs.id().to_owned(), own.id().to_owned()];
    expected.sort();
    assert_eq!(listed, expected);
    let (output, _) = run(&mut theirs, "y", 100).await;
    assert_eq!(output, "2\n", "the live engine's kernel is untouched");
    let files = |dir: &std::path::Path| std::fs::read_dir(dir).expect("the folder").count();
    assert_eq!(
        files(&leases),
        2,
        "the killed engine's file is gone, the live ones stay"
    );
    assert_eq!(gateway.reap_leases().await.expect("reaped"), 0);
    own.close().await.expect("closed");
    theirs.close().await.expect("closed");
    assert!(process.kernels().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_kernels_with_no_connection_are_culled() {
    // What `--MappingKernelManager.cull_idle_timeout` does for kernels no lease covers: idle
    // kernels with no connection culled after 3 s, checked every second.
    let process = JupyterGateway::start(
        "culled",
        &[
            "--MappingKernelManager.cull_idle_timeout=3",
            "--MappingKernelManager.cull_interval=1",
        ],
    );
    let gateway = gateway_of(&process);
    let mut held = start(&gateway).await;
    let leases = process.dir.join("leases");
    let orphans = left_by_a_killed_engine(&process, &leases, 2);
    // A connected kernel is not culled, however idle.
    tokio::time::sleep(Duration::from_secs(5)).await;
    process.wait_until_gone(&orphans, Duration::from_secs(15), "culled");
    assert_eq!(process.kernels(), [held.id().to_owned()]);
    run(&mut held, "1", 100).await;
    held.close().await.expect("closed");
}
