//! `--serve-rows`: the binary's rows read live over Arrow Flight by arrow-flight's own client,
//! as a trainer on another machine would: the groups the stream delivers are the groups
//! `--out` holds, a trainer that stops reading stops the run's admission, and an engine
//! killed and resumed serves again exactly what its trainer did not acknowledge.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    process::{Child, Command, Stdio},
    time::Duration,
};

use arrow_array::{Array as _, UInt64Array};
use arrow_flight::{Action, FlightClient, Ticket, decode::DecodedPayload};
use futures::StreamExt as _;
use test_support::ScratchDir;

/// A run of the quickstart on the simulator, `groups` groups of 4, serving its rows.
fn start(dir: &std::path::Path, groups: u32, capacity: u32) -> (Child, SocketAddr) {
    start_with(dir, groups, capacity, &[])
}

fn start_with(
    dir: &std::path::Path,
    groups: u32,
    capacity: u32,
    args: &[&str],
) -> (Child, SocketAddr) {
    let quickstart = super::rollout::quickstart();
    let config = format!(
        "dataset = {}\ntokenizer = {}\nnum_generations = 4\ngroups = {groups}\nmax_turns = 4\n\
         out = \"rows.jsonl\"\nserve_rows = \"127.0.0.1:0\"\nserve_rows_capacity = {capacity}\n\
         progress = \"off\"\n[[rewards]]\nspec = \"numeric:answer\"\n[[tools]]\nname = \"calculator\"\n\
         kind = \"calculator\"\n[simulator]\ntool_rounds = 1\n",
        super::rollout::toml_path(&quickstart.join("arithmetic.jsonl")),
        super::rollout::toml_path(&quickstart),
    );
    std::fs::write(dir.join("run.toml"), config).expect("the config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--config", "run.toml"])
        .args(args)
        .current_dir(dir)
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let stderr = child.stderr.take().expect("stderr");
    let (found, address) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut found = Some(found);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(address) = line.strip_prefix("async-grpo: serving rows on ")
                && let Some(found) = found.take()
            {
                let _ = found.send(address.parse::<SocketAddr>().expect("an address"));
            }
        }
    });
    let address = address
        .recv_timeout(Duration::from_secs(60))
        .expect("the run says where it serves rows");
    (child, address)
}

async fn client(address: SocketAddr) -> FlightClient {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .expect("a URL")
        .connect()
        .await
        .expect("connected");
    FlightClient::new(channel)
}

/// Every group the stream delivers, acknowledged: group id to its rows' `input_ids` lengths.
async fn read_all(address: SocketAddr) -> BTreeMap<u64, Vec<usize>> {
    read(address, usize::MAX, usize::MAX)
        .await
        .into_iter()
        .map(|(_, id, lengths)| (id, lengths))
        .collect()
}

/// The first `take` groups the stream delivers (all, to its end, when there are fewer), the
/// first `acknowledge` of them acknowledged: position, group id, rows' `input_ids` lengths.
async fn read(address: SocketAddr, take: usize, acknowledge: usize) -> Vec<(u64, u64, Vec<usize>)> {
    let mut client = client(address).await;
    let mut stream = client
        .do_get(Ticket::new("rows"))
        .await
        .expect("a stream")
        .into_inner();
    let mut groups: Vec<(u64, u64, Vec<usize>)> = Vec::new();
    while groups.len() < take
        && let Some(message) = stream.next().await
    {
        let message = message.expect("a message");
        let DecodedPayload::RecordBatch(batch) = message.payload else {
            continue;
        };
        let place: serde_json::Value =
            serde_json::from_slice(&message.inner.app_metadata).expect("its place");
        let ids = batch
            .column_by_name("group_id")
            .and_then(|c| c.as_any().downcast_ref::<UInt64Array>().cloned())
            .expect("group_id");
        let tokens = batch
            .column_by_name("input_ids")
            .and_then(|c| c.as_any().downcast_ref::<arrow_array::ListArray>().cloned())
            .expect("input_ids");
        let lengths: Vec<usize> = (0..tokens.len())
            .map(|row| tokens.value(row).len())
            .collect();
        assert!(
            groups.iter().all(|(_, id, _)| *id != ids.value(0)),
            "a group twice"
        );
        let position = place["position"].as_u64().expect("a position");
        groups.push((position, ids.value(0), lengths));
        if groups.len() > acknowledge {
            continue;
        }
        let ack = serde_json::json!({"reader": place["reader"], "through": place["position"]});
        let answer = action(&mut client, "ack", &ack.to_string()).await;
        assert_eq!(answer["acknowledged"], 1);
    }
    groups
}

fn out_groups(path: &std::path::Path) -> BTreeMap<u64, Vec<usize>> {
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for line in std::fs::read_to_string(path).expect("the output").lines() {
        let row: serde_json::Value = serde_json::from_str(line).expect("a row");
        groups
            .entry(row["group_id"].as_u64().expect("a group id"))
            .or_default()
            .push(row["input_ids"].as_array().expect("input_ids").len());
    }
    groups
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_delivers_every_group_of_the_output_once() {
    let dir = ScratchDir::new("async-grpo-row-stream");
    let (mut child, address) = start(&dir, 12, 2);
    let streamed = tokio::time::timeout(Duration::from_secs(120), read_all(address))
        .await
        .expect("the stream ended");
    let status = child.wait().expect("the run ends");
    assert!(status.success(), "{status}");
    assert_eq!(streamed.len(), 12);
    assert_eq!(streamed, out_groups(&dir.join("rows.jsonl")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_does_not_read_stops_admission_and_ctrl_c_still_ends_the_run() {
    let dir = ScratchDir::new("async-grpo-row-stream-stalled");
    let (mut child, _address) = start(&dir, 64, 2);
    // No one reads: at most the stream's 2 groups, the writer's one and what the engine's
    // bounded channel holds get written; the run does not finish its 64.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        child.try_wait().expect("its state").is_none(),
        "the run ended unread"
    );
    let written = out_groups(&dir.join("rows.jsonl")).len();
    assert!(written < 64, "{written} groups written with no reader");
    // Stopped, not slowed: two seconds on, nothing more was written, and the engine's memory
    // did not grow with groups held for no one.
    let rss = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    };
    let before = rss(child.id());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        out_groups(&dir.join("rows.jsonl")).len(),
        written,
        "admission went on"
    );
    let after = rss(child.id());
    assert!(
        after < before + 16 * 1024,
        "the engine grew from {before} kB to {after} kB with admission stopped"
    );
    let pid =
        rustix::process::Pid::from_raw(i32::try_from(child.id()).expect("a pid")).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT");
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(status) = child.try_wait().expect("its state") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("Ctrl-C ended a run waiting for its trainer");
    // A clean drain: the rollouts in flight finished into the file, none lost.
    assert!(ended.success(), "{ended}");
    assert!(out_groups(&dir.join("rows.jsonl")).len() >= written);
}

/// Kills the engine outright (no drain, no goodbye), as a crash or an OOM kill would.
fn kill(child: &mut Child) {
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_and_resumed_serves_again_what_was_not_acknowledged_and_nothing_else() {
    let dir = ScratchDir::new("async-grpo-row-stream-resume");
    let (mut child, address) = start(&dir, 12, 3);
    // Five groups read, the first three acknowledged; then the engine dies.
    let first = tokio::time::timeout(Duration::from_secs(120), read(address, 5, 3))
        .await
        .expect("five groups");
    let positions: Vec<u64> = first.iter().map(|(position, ..)| *position).collect();
    assert_eq!(positions, [0, 1, 2, 3, 4]);
    kill(&mut child);
    let acknowledged: BTreeMap<u64, Vec<usize>> = first[..3]
        .iter()
        .map(|(_, id, lengths)| (*id, lengths.clone()))
        .collect();

    let (mut child, address) = start_with(&dir, 12, 3, &["--resume"]);
    let rest = tokio::time::timeout(
        Duration::from_secs(120),
        read(address, usize::MAX, usize::MAX),
    )
    .await
    .expect("the resumed stream ended");
    let status = child.wait().expect("the run ends");
    assert!(status.success(), "{status}");
    // The resumed stream starts where the acknowledgements stop: group 3, read and not
    // acknowledged before the kill, comes first, at its position.
    assert_eq!(rest.first().map(|(position, ..)| *position), Some(3));
    let mut streamed = acknowledged.clone();
    for (position, id, lengths) in rest {
        assert!(
            !acknowledged.contains_key(&id),
            "group {id} at {position}: acknowledged before the kill, delivered again"
        );
        assert!(streamed.insert(id, lengths).is_none(), "group {id} twice");
    }
    assert_eq!(
        streamed,
        out_groups(&dir.join("rows.jsonl")),
        "the stream is the output"
    );
    assert_eq!(streamed.len(), 12);
}

#[test]
fn a_certificate_that_is_not_pem_is_refused_before_the_run_naming_the_field_and_file() {
    let dir = ScratchDir::new("async-grpo-row-stream-tls");
    let tls = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    std::fs::write(dir.join("not-a-key.pem"), "hello\n").expect("a file");
    let quickstart = super::rollout::quickstart();
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .arg("rollout")
        .arg("--dataset")
        .arg(quickstart.join("arithmetic.jsonl"))
        .arg("--tokenizer")
        .arg(&quickstart)
        .args(["--serve-rows", "0"])
        .arg("--serve-rows-cert")
        .arg(tls.join("cert.pem"))
        .arg("--serve-rows-key")
        .arg(dir.join("not-a-key.pem"))
        .args(["--reward", "numeric:answer"])
        .current_dir(&dir)
        .output()
        .expect("the binary runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--serve-rows-key")
            && stderr.contains("not-a-key.pem holds no PEM private key"),
        "{stderr}"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_async-grpo"))
        .args(["rollout", "--serve-rows", "0", "--serve-rows-cert"])
        .arg(tls.join("cert.pem"))
        .current_dir(&dir)
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("--serve-rows-key"),
        "{stderr}"
    );
}

/// A Flight action on `client`, retried while the run is starting (no engine to act on yet):
/// its JSON answer.
async fn action(client: &mut FlightClient, kind: &str, body: &str) -> serde_json::Value {
    for _ in 0..600 {
        match client.do_action(Action::new(kind, body.to_owned())).await {
            Ok(mut results) => {
                let answer = results.next().await.expect("an answer").expect("ok");
                return serde_json::from_slice(&answer).expect("JSON");
            }
            Err(error) if error.to_string().contains("starting") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("{kind}: {error}"),
        }
    }
    panic!("{kind}: the run never started");
}

/// The engine's `/health` (its control endpoint's, beside the stream).
async fn paused(port: u16) -> bool {
    let health: serde_json::Value = reqwest::get(format!("http://127.0.0.1:{port}/health"))
        .await
        .expect("/health answers")
        .json()
        .await
        .expect("JSON");
    health["paused"].as_bool().expect("paused")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_pauses_and_resumes_the_engine_over_the_stream() {
    let dir = ScratchDir::new("async-grpo-row-stream-pause");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let listen = format!("127.0.0.1:{port}");
    let (mut child, address) = start_with(&dir, 16, 2, &["--listen", &listen]);
    let mut control = client(address).await;
    let answer = action(&mut control, "pause", r#"{"mode": "wait"}"#).await;
    assert_eq!(answer["paused"], true, "{answer}");
    assert_eq!(
        answer["in_flight"], 0,
        "a wait pause answers once none is in flight"
    );
    assert!(paused(port).await, "the engine is paused");
    assert_eq!(action(&mut control, "resume", "").await["paused"], false);
    assert!(!paused(port).await, "the engine runs again");
    let streamed = tokio::time::timeout(Duration::from_secs(120), read_all(address))
        .await
        .expect("the stream ended");
    let status = child.wait().expect("the run ends");
    assert!(status.success(), "{status}");
    assert_eq!(streamed.len(), 16);
}
