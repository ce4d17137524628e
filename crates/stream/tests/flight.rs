//! The row stream over a real gRPC connection (tonic on loopback TCP), read with arrow-flight's
//! own client as a trainer would: every group once and in order, what a dropped reader did
//! not acknowledge delivered again, acknowledgements and versions as actions, the token.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use arrow_array::{RecordBatch, UInt64Array};
use arrow_flight::{Action, FlightClient, Ticket, decode::DecodedPayload};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use async_grpo_stream::{
    Ledger,
    flight::{self, BatchPlace, Feedback, Refusal, RowServer},
};
use futures::StreamExt as _;

async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future)
        .await
        .expect("answered within 20 s")
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new(
        "group_id",
        DataType::UInt64,
        false,
    )]))
}

/// A group of `rows` rows of `group_id`.
fn group(group_id: u64, rows: usize) -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![Arc::new(UInt64Array::from(vec![group_id; rows]))],
    )
    .expect("a batch")
}

/// What the trainer sent back, as an engine would get it.
#[derive(Default)]
struct Versions(Mutex<Vec<u64>>, Mutex<Vec<u64>>, Mutex<Vec<String>>);

#[tonic::async_trait]
impl Feedback for Versions {
    fn model_version(&self, version: u64) -> Result<(), Refusal> {
        self.0.lock().expect("not poisoned").push(version);
        Ok(())
    }

    fn acknowledged(&self, positions: &[u64]) -> Result<(), String> {
        self.1.lock().expect("not poisoned").extend(positions);
        Ok(())
    }

    async fn pause(&self, mode: Option<String>) -> Result<serde_json::Value, Refusal> {
        let mode = mode.unwrap_or_else(|| "default".to_owned());
        match mode.as_str() {
            "sideways" => return Err(Refusal::Refused(format!("no mode {mode}"))),
            "later" => return Err(Refusal::NotYet("starting".to_owned())),
            _ => {}
        }
        self.2
            .lock()
            .expect("not poisoned")
            .push(format!("pause {mode}"));
        Ok(serde_json::json!({ "paused": true }))
    }

    fn resume(&self) -> Result<serde_json::Value, Refusal> {
        self.2
            .lock()
            .expect("not poisoned")
            .push("resume".to_owned());
        Ok(serde_json::json!({ "paused": false }))
    }
}

struct Served {
    addr: SocketAddr,
    ledger: Arc<Ledger<RecordBatch>>,
    versions: Arc<Versions>,
}

async fn serve(capacity: usize, token: Option<&str>) -> Served {
    let ledger = Arc::new(Ledger::new(capacity));
    let versions = Arc::new(Versions::default());
    let server = RowServer::new(
        Arc::clone(&ledger),
        schema(),
        Arc::clone(&versions) as Arc<dyn Feedback>,
        token.map(str::to_owned),
    );
    let incoming =
        tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().expect("addr"))
            .expect("a port");
    let addr = incoming.local_addr().expect("its address");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server.into_service())
            .serve_with_incoming(incoming),
    );
    Served {
        addr,
        ledger,
        versions,
    }
}

async fn client(addr: SocketAddr, token: Option<&str>) -> FlightClient {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("a URL")
        .connect()
        .await
        .expect("connected");
    let mut client = FlightClient::new(channel);
    if let Some(token) = token {
        client
            .add_header("authorization", &format!("Bearer {token}"))
            .expect("a header");
    }
    client
}

/// The next group of a reader's stream: its place and its group ids.
async fn next_group(
    stream: &mut arrow_flight::decode::FlightDataDecoder,
) -> Option<(BatchPlace, Vec<u64>)> {
    while let Some(message) = stream.next().await {
        let message = message.expect("a message");
        if let DecodedPayload::RecordBatch(batch) = message.payload {
            let place: BatchPlace =
                serde_json::from_slice(&message.inner.app_metadata).expect("the batch's place");
            let ids = batch
                .column(0)
                .as_any()
                .downcast_ref::<UInt64Array>()
                .expect("u64")
                .values()
                .to_vec();
            return Some((place, ids));
        }
    }
    None
}

async fn ack(client: &mut FlightClient, place: BatchPlace) -> serde_json::Value {
    let body = serde_json::json!({ "reader": place.reader, "through": place.position });
    let mut results = client
        .do_action(Action::new("ack", body.to_string()))
        .await
        .expect("the ack answered");
    let answer = results.next().await.expect("a result").expect("ok");
    serde_json::from_slice(&answer).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_group_arrives_once_in_order_and_the_stream_ends_with_the_run() {
    let served = serve(4, None).await;
    let writer = tokio::spawn({
        let ledger = Arc::clone(&served.ledger);
        async move {
            for id in 0..20u64 {
                ledger.push(group(id, 8)).await.expect("open");
            }
            ledger.close();
        }
    });
    let mut client = client(served.addr, None).await;
    let mut stream = within(client.do_get(Ticket::new("rows")))
        .await
        .expect("a stream")
        .into_inner();
    let mut seen = Vec::new();
    while let Some((place, ids)) = within(next_group(&mut stream)).await {
        assert_eq!(ids, vec![place.position; 8], "the group at its position");
        // A capacity of 4: the writer goes on only as groups are acknowledged.
        assert_eq!(ack(&mut client, place).await["acknowledged"], 1);
        seen.push(place.position);
    }
    within(writer).await.expect("the writer");
    assert_eq!(seen, (0..20).collect::<Vec<_>>());
    assert_eq!(
        *served.versions.1.lock().expect("not poisoned"),
        seen,
        "every acknowledgement recorded, as answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_dropped_reader_did_not_acknowledge_comes_again_and_nothing_else() {
    let served = serve(16, None).await;
    for id in 0..6u64 {
        served.ledger.push(group(id, 2)).await.expect("open");
    }
    let mut first = client(served.addr, None).await;
    let mut stream = first
        .do_get(Ticket::new("rows"))
        .await
        .expect("a stream")
        .into_inner();
    let mut places = Vec::new();
    for _ in 0..3 {
        places.push(within(next_group(&mut stream)).await.expect("a group").0);
    }
    ack(&mut first, places[0]).await;
    // The trainer dies: its connection and stream go, unacknowledged groups 1 and 2 with it.
    drop(stream);
    drop(first);
    within(async {
        while served.ledger.stats().leased > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    served.ledger.close();
    let mut again = client(served.addr, None).await;
    let mut stream = again
        .do_get(Ticket::new("rows"))
        .await
        .expect("a stream")
        .into_inner();
    let mut positions = Vec::new();
    while let Some((place, _)) = within(next_group(&mut stream)).await {
        ack(&mut again, place).await;
        positions.push(place.position);
    }
    assert_eq!(
        positions,
        [1, 2, 3, 4, 5],
        "group 0 was acknowledged; the rest, once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_token_gets_nothing_and_the_right_one_everything() {
    let served = serve(4, Some("s3cret")).await;
    served.ledger.push(group(0, 1)).await.expect("open");
    served.ledger.close();
    for token in [None, Some("wrong"), Some("s3cret-but-longer")] {
        let mut client = client(served.addr, token).await;
        let refused = client.do_get(Ticket::new("rows")).await;
        assert!(
            matches!(&refused, Err(arrow_flight::error::FlightError::Tonic(status)) if status.code() == tonic::Code::Unauthenticated),
            "{token:?}: {:?}",
            refused.map(|_| ())
        );
        let action = client
            .do_action(Action::new("model_version", r#"{"version": 3}"#))
            .await;
        assert!(action.is_err(), "{token:?}: an action went through");
    }
    assert!(served.versions.0.lock().expect("not poisoned").is_empty());
    assert_eq!(served.ledger.stats().waiting, 1, "nothing was delivered");
    let mut client = client(served.addr, Some("s3cret")).await;
    let mut stream = client
        .do_get(Ticket::new("rows"))
        .await
        .expect("a stream")
        .into_inner();
    assert!(within(next_group(&mut stream)).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainers_model_version_reaches_the_engine_and_bad_actions_are_refused() {
    let served = serve(4, None).await;
    let mut client = client(served.addr, None).await;
    let mut results = client
        .do_action(Action::new("model_version", r#"{"version": 7}"#))
        .await
        .expect("answered");
    assert!(results.next().await.expect("a result").is_ok());
    assert_eq!(*served.versions.0.lock().expect("not poisoned"), [7]);
    for (kind, body) in [
        ("model_version", "{\"v\": 1}"),
        ("pause_forever", "{}"),
        ("pause", "{\"mode\": \"sideways\"}"),
        ("pause", "[1]"),
    ] {
        let refused = client.do_action(Action::new(kind, body)).await;
        assert!(refused.is_err(), "{kind} {body} was accepted");
    }
    // What the engine refuses as asked is not to be retried; what it cannot do yet is
    // UNAVAILABLE, which clients retry.
    for (mode, code) in [
        ("sideways", tonic::Code::FailedPrecondition),
        ("later", tonic::Code::Unavailable),
    ] {
        let body = format!("{{\"mode\": \"{mode}\"}}");
        match client.do_action(Action::new("pause", body)).await {
            Err(arrow_flight::error::FlightError::Tonic(status)) => {
                assert_eq!(status.code(), code, "{mode}: {status}");
            }
            Err(other) => panic!("{mode}: not a gRPC status: {other}"),
            Ok(_) => panic!("{mode}: accepted"),
        }
    }
    for (kind, body) in [
        ("pause", ""),
        ("pause", "{\"mode\": \"abort\"}"),
        ("resume", ""),
    ] {
        let mut results = client
            .do_action(Action::new(kind, body))
            .await
            .expect("answered");
        let answer = results.next().await.expect("a result").expect("ok");
        let answer: serde_json::Value = serde_json::from_slice(&answer).expect("JSON");
        assert_eq!(answer["paused"], kind == "pause", "{kind}: {answer}");
    }
    assert_eq!(
        *served.versions.2.lock().expect("not poisoned"),
        ["pause default", "pause abort", "resume"]
    );
}

/// The program's end, as the binary's: the server stopped on its own runtime, then that runtime
/// dropped (the process exits).
#[test]
fn a_stop_lets_a_reader_receive_its_streams_end_before_the_program_exits() {
    let ledger = Arc::new(Ledger::new(4));
    let (serving_tx, serving_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let engine = std::thread::spawn({
        let ledger = Arc::clone(&ledger);
        move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let server = RowServer::new(
                    Arc::clone(&ledger),
                    schema(),
                    Arc::new(Versions::default()) as Arc<dyn Feedback>,
                    None,
                );
                let serving = flight::serve(server, "127.0.0.1:0".parse().expect("addr"), None)
                    .expect("served");
                serving_tx.send(serving.address()).expect("the test waits");
                tokio::task::spawn_blocking(move || stop_rx.recv())
                    .await
                    .expect("joined")
                    .expect("told to stop");
                serving.stop(Duration::from_secs(20)).await;
            });
            drop(runtime);
        }
    });
    let address = serving_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("serving");
    let client_runtime = tokio::runtime::Runtime::new().expect("a runtime");
    client_runtime.block_on(async {
        ledger.push(group(0, 2)).await.expect("open");
        let mut client = client(address, None).await;
        let mut stream = within(client.do_get(Ticket::new("rows")))
            .await
            .expect("a stream")
            .into_inner();
        let (place, _) = within(next_group(&mut stream)).await.expect("group 0");
        assert_eq!(ack(&mut client, place).await["acknowledged"], 1);
        // Told to stop while the reader's stream is open (the run might push more); the run
        // ends a moment later, everything acknowledged: the stream's end must reach the
        // reader before the engine's runtime goes.
        stop_tx.send(()).expect("the engine waits");
        tokio::time::sleep(Duration::from_millis(200)).await;
        ledger.close();
        match within(stream.next()).await {
            None => {}
            Some(Ok(message)) => panic!("a message after the last group: {message:?}"),
            Some(Err(error)) => panic!("the stream was cut, not ended: {error}"),
        }
        let refused = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .expect("a URL")
            .connect()
            .await;
        assert!(refused.is_err(), "a stopped server takes no connection");
    });
    engine.join().expect("the engine's thread");
}
