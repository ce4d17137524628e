//! The row stream's throughput against writing JSON Lines: the same groups (8 rows of 2,048
//! tokens, a realistic multi-turn row: prompt and completion messages, ids, mask, logprobs,
//! version spans) written to a JSON Lines file as the binary's writer does, and served over
//! Arrow Flight as `--serve-rows` does, each group made a record batch, pushed into a ledger
//! of 1,024 (the groups in flight), read by arrow-flight's client on loopback and
//! acknowledged: one acknowledgement per group as `RowStream.ack` after every group, then one
//! per 64 groups. Groups/s and MB/s (the bytes written, or the Arrow IPC bytes sent).
//!
//! Run with `cargo xtask bench` (or `cargo bench -p async-grpo-cli --bench rows`). Prints a
//! markdown table and, when `BENCH_OUT` names a folder, writes `rows.json` there.

#![allow(clippy::print_stdout, reason = "the report is this program's output")]
#![allow(clippy::unwrap_used, reason = "a benchmark fails loudly")]

use std::{sync::Arc, time::Instant};

use arrow_flight::{Action, FlightClient, Ticket, decode::DecodedPayload};
use async_grpo_stream::{
    Ledger, Position,
    flight::{self, Feedback, RecordBatch, RowServer},
};
use futures::StreamExt as _;
use rollout_core::{Message, RolloutId, SampleMetrics, TrainingSample, VersionSpan};

/// Groups each measurement moves.
const GROUPS: u64 = 4_096;
/// Rows of a group.
const ROWS: usize = 8;
/// Tokens of a row: 512 of prompt, 1,536 of completion.
const PROMPT: usize = 512;
const TOKENS: usize = 2_048;
/// Groups held unacknowledged at most: the stream's capacity.
const IN_FLIGHT: usize = 1_024;

fn group(id: u64) -> Vec<TrainingSample> {
    (0..ROWS)
        .map(|row| {
            let ids: Vec<u32> = (0..TOKENS)
                .map(|t| ((id as usize * 31 + row * 7 + t) % 150_000) as u32)
                .collect();
            TrainingSample {
                group_id: id,
                group_samples: ROWS as u64,
                rollout_id: RolloutId(id * ROWS as u64 + row as u64),
                prompt: vec![
                    Message::system("You are a careful assistant with a calculator tool."),
                    Message::user("What is 91 * 14? Show the steps. ".repeat(40)),
                ],
                completion: vec![Message::assistant(
                    "Let me work this out step by step. 91 * 14 = 1274. ".repeat(120),
                )],
                input_ids: ids,
                completion_mask: (0..TOKENS).map(|t| u8::from(t >= PROMPT)).collect(),
                old_log_probs: (0..TOKENS)
                    .map(|t| {
                        if t >= PROMPT {
                            -((t % 13) as f32) / 7.0
                        } else {
                            0.0
                        }
                    })
                    .collect(),
                advantage: (row as f64 - 3.5) / 2.3,
                reward: Some((row % 2) as f64),
                rewards: serde_json::Map::new(),
                model_version: 3,
                token_versions: vec![VersionSpan {
                    start: PROMPT,
                    end: TOKENS,
                    version: 3,
                }],
                routed_experts: None,
                metrics: SampleMetrics::new(),
                environment: serde_json::Map::new(),
                reward_notes: serde_json::Map::new(),
                step_rewards: Vec::new(),
                advantage_spans: Vec::new(),
            }
        })
        .collect()
}

struct Measured {
    groups_per_second: f64,
    megabytes_per_second: f64,
}

fn measured(started: Instant, bytes: u64) -> Measured {
    let seconds = started.elapsed().as_secs_f64();
    Measured {
        groups_per_second: GROUPS as f64 / seconds,
        megabytes_per_second: bytes as f64 / 1e6 / seconds,
    }
}

/// The binary's JSON Lines output: one write and a flush per group, to a file.
fn jsonl(groups: &[Vec<TrainingSample>]) -> Measured {
    let dir = std::env::temp_dir().join(format!("bench-rows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rows.jsonl");
    let started = Instant::now();
    let mut sink = files::output::JsonlSink::create(&path).unwrap();
    for id in 0..GROUPS {
        sink.write_group(&groups[id as usize % groups.len()])
            .unwrap();
    }
    drop(sink);
    let bytes = std::fs::metadata(&path).unwrap().len();
    let result = measured(started, bytes);
    std::fs::remove_dir_all(&dir).unwrap();
    result
}

struct Nothing;

impl Feedback for Nothing {
    fn model_version(&self, _: u64) -> Result<(), async_grpo_stream::flight::Refusal> {
        Ok(())
    }
}

/// `--serve-rows`: each group made a record batch and pushed (waiting while 1,024 are
/// unacknowledged), served over Flight on loopback, read and acknowledged every `ack_every`
/// groups by one client.
async fn stream(groups: &[Vec<TrainingSample>], ack_every: u64) -> Measured {
    let ledger: Arc<Ledger<RecordBatch>> = Arc::new(Ledger::new(IN_FLIGHT));
    let server = RowServer::new(
        Arc::clone(&ledger),
        files::arrow::row_schema(),
        Arc::new(Nothing),
        None,
    );
    let serving = flight::serve(server, "127.0.0.1:0".parse().unwrap(), None).unwrap();
    let address = serving.address();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightClient::new(channel);
    let started = Instant::now();
    // The writer thread's work: the batch made, then pushed.
    let writer = {
        let ledger = Arc::clone(&ledger);
        let groups = groups.to_vec();
        let runtime = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            for id in 0..GROUPS {
                let batch = files::arrow::row_batch(&groups[id as usize % groups.len()]).unwrap();
                runtime.block_on(ledger.push(batch)).unwrap();
            }
            ledger.close();
        })
    };
    let mut stream = client
        .do_get(Ticket::new("rows"))
        .await
        .unwrap()
        .into_inner();
    let mut bytes = 0u64;
    let mut read = 0u64;
    let mut last: Option<(u64, Position)> = None;
    while let Some(message) = stream.next().await {
        let message = message.unwrap();
        bytes += (message.inner.data_header.len() + message.inner.data_body.len()) as u64;
        let DecodedPayload::RecordBatch(batch) = message.payload else {
            continue;
        };
        assert_eq!(batch.num_rows(), ROWS);
        let place: serde_json::Value = serde_json::from_slice(&message.inner.app_metadata).unwrap();
        let (reader, position) = (
            place["reader"].as_u64().unwrap(),
            place["position"].as_u64().unwrap(),
        );
        read += 1;
        last = Some((reader, position));
        if read.is_multiple_of(ack_every) || read == GROUPS {
            let body = serde_json::json!({"reader": reader, "through": position});
            let mut answer = client
                .do_action(Action::new("ack", body.to_string()))
                .await
                .unwrap();
            answer.next().await.unwrap().unwrap();
        }
        if read == GROUPS {
            break;
        }
    }
    assert_eq!(read, GROUPS, "every group read ({last:?})");
    writer.join().unwrap();
    let result = measured(started, bytes);
    serving.stop(std::time::Duration::ZERO).await;
    result
}

fn main() {
    let groups: Vec<Vec<TrainingSample>> = (0..64).map(group).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let written = jsonl(&groups);
    let per_group = runtime.block_on(stream(&groups, 1));
    let batched = runtime.block_on(stream(&groups, 64));
    let rows = [
        (
            "JSON Lines file (--out), one write and flush per group",
            written,
        ),
        (
            "row stream (--serve-rows), 1,024 in flight, ack per group",
            per_group,
        ),
        (
            "row stream (--serve-rows), 1,024 in flight, ack per 64 groups",
            batched,
        ),
    ];
    println!(
        "{GROUPS} groups of {ROWS} rows x {TOKENS} tokens; a {IN_FLIGHT}-group stream read on loopback"
    );
    println!("| output | groups/s | MB/s |");
    println!("|---|---:|---:|");
    for (name, measured) in &rows {
        println!(
            "| {name} | {:.0} | {:.0} |",
            measured.groups_per_second, measured.megabytes_per_second
        );
    }
    if let Some(out) = std::env::var_os("BENCH_OUT") {
        let results: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .flat_map(|(name, measured)| {
                [
                    (
                        format!("{name} (groups/s)"),
                        serde_json::json!(measured.groups_per_second),
                    ),
                    (
                        format!("{name} (MB/s)"),
                        serde_json::json!(measured.megabytes_per_second),
                    ),
                ]
            })
            .collect();
        let path = std::path::Path::new(&out).join("rows.json");
        std::fs::write(&path, serde_json::to_string_pretty(&results).unwrap()).unwrap();
        println!("wrote {}", path.display());
    }
}
