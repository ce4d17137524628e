//! Training samples, the engine's output, and [`JsonlSink`], which writes them as JSON Lines a
//! group at a time.

use std::{
    fs::{File, OpenOptions},
    io::{self, Read, Seek, SeekFrom, Write},
    path::Path,
};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Message, reconcile::RolloutId};

/// One training row with everything a trainer needs to learn from it. A forked conversation
/// gives several samples with the same `rollout_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSample {
    /// The group (one dataset row, `num_generations` rollouts) the sample belongs to.
    pub group_id: u64,
    /// How many samples its group has: the group is whole in a file when that many lines
    /// carry its `group_id` (a reader resuming a cut file drops a group cut short).
    #[serde(default)]
    pub group_samples: u64,
    /// The rollout (conversation) it comes from.
    pub rollout_id: RolloutId,
    /// The prompt messages: the dataset row's, after the initial messages of the rollout's
    /// environment session when it ran in one.
    pub prompt: Vec<Message>,
    /// The messages the rollout added: assistant turns and tool results.
    pub completion: Vec<Message>,
    /// Every token of the row.
    pub input_ids: Vec<u32>,
    /// `1` for a sampled token that is trained on, `0` elsewhere.
    pub completion_mask: Vec<u8>,
    /// The sampling log-prob of each sampled token, `0.0` elsewhere.
    pub old_log_probs: Vec<f32>,
    /// The rollout's advantage within its group.
    pub advantage: f64,
    /// The combined reward; `null` when unscorable.
    pub reward: Option<f64>,
    /// Per reward function, by name: its score, or `null` when it could not score.
    pub rewards: Map<String, Value>,
    /// The model version its group's first turn was sampled under (the oldest of the
    /// group's turns); the span of the sample's own turns is in `metrics`
    /// (`model_version_min`, `model_version_max`).
    pub model_version: u64,
    /// Per-sample numbers (turns, tool calls, drift, ...).
    pub metrics: Map<String, Value>,
}

/// Writes samples as JSON Lines, one group at a time: the group is serialized whole, then
/// written with a single `write` and flushed. A group is therefore on disk entirely or not at
/// all as far as a process killed between groups is concerned, and a reader never sees a
/// group half-written. Should a write itself be cut (a full disk), at most the last line is
/// incomplete; [`JsonlSink::append`] removes such a line when the file is reopened.
#[derive(Debug)]
pub struct JsonlSink<W: Write> {
    writer: W,
    buffer: Vec<u8>,
    groups: u64,
    samples: u64,
}

impl JsonlSink<File> {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> io::Result<JsonlSink<File>> {
        Ok(JsonlSink::new(File::create(path)?))
    }

    /// Opens `path` to add to it, first removing an incomplete last line left by a run that
    /// was cut mid-write. Returns the sink and how many bytes were removed.
    pub fn append(path: &Path) -> io::Result<(JsonlSink<File>, u64)> {
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(path)?;
        let length = file.metadata()?.len();
        let complete = complete_length(&mut file, length)?;
        if complete < length {
            file.set_len(complete)?;
        }
        file.seek(SeekFrom::End(0))?;
        Ok((JsonlSink::new(file), length - complete))
    }
}

/// The length of the file up to and including its last newline.
fn complete_length(file: &mut File, length: u64) -> io::Result<u64> {
    let mut end = length;
    let mut chunk = [0u8; 4096];
    while end > 0 {
        let start = end.saturating_sub(chunk.len() as u64);
        let size = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut chunk[..size])?;
        if let Some(position) = chunk[..size].iter().rposition(|&b| b == b'\n') {
            return Ok(start + position as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

impl<W: Write> JsonlSink<W> {
    /// Writes to `writer`.
    pub fn new(writer: W) -> JsonlSink<W> {
        JsonlSink {
            writer,
            buffer: Vec::new(),
            groups: 0,
            samples: 0,
        }
    }

    /// Writes one group's samples, one line each, and flushes.
    pub fn write_group(&mut self, samples: &[TrainingSample]) -> io::Result<()> {
        self.buffer.clear();
        for sample in samples {
            serde_json::to_writer(&mut self.buffer, sample)?;
            self.buffer.push(b'\n');
        }
        self.writer.write_all(&self.buffer)?;
        self.writer.flush()?;
        self.groups += 1;
        self.samples += samples.len() as u64;
        Ok(())
    }

    /// Groups and samples written so far.
    pub fn written(&self) -> (u64, u64) {
        (self.groups, self.samples)
    }

    /// The writer.
    pub fn into_inner(self) -> W {
        self.writer
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn sample(group_id: u64, rollout: u64) -> TrainingSample {
        TrainingSample {
            group_id,
            group_samples: 1,
            rollout_id: RolloutId(rollout),
            prompt: vec![Message::user("What is 6 * 7?")],
            completion: vec![Message::assistant("42")],
            input_ids: vec![1, 2, 3, 4],
            completion_mask: vec![0, 0, 1, 1],
            old_log_probs: vec![0.0, 0.0, -0.25, -1.5],
            advantage: 0.5,
            reward: Some(1.0),
            rewards: json!({"numeric_answer": 1.0, "judge": null})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            model_version: 3,
            metrics: Map::new(),
        }
    }

    #[test]
    fn each_sample_is_one_line_that_reads_back_the_same() {
        let mut sink = JsonlSink::new(Vec::new());
        sink.write_group(&[sample(0, 0), sample(0, 1)])
            .expect("written");
        sink.write_group(&[sample(1, 2)]).expect("written");
        assert_eq!(sink.written(), (2, 3));
        let text = String::from_utf8(sink.into_inner()).expect("utf-8");
        let back: Vec<TrainingSample> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a sample"))
            .collect();
        assert_eq!(back, [sample(0, 0), sample(0, 1), sample(1, 2)]);
        assert!(
            text.lines()
                .next()
                .is_some_and(|l| l.contains("\"rewards\":{\"numeric_answer\":1.0,\"judge\":null}"))
        );
    }

    #[test]
    fn reopening_removes_a_line_cut_mid_write_and_continues_after_it() {
        let path =
            std::env::temp_dir().join(format!("rollout-core-sink-{}.jsonl", std::process::id()));
        let complete = serde_json::to_string(&sample(0, 0)).expect("json") + "\n";
        let cut = "{\"group_id\": 1, \"rollo";
        std::fs::write(&path, format!("{complete}{cut}")).expect("write");

        let (mut sink, removed) = JsonlSink::append(&path).expect("reopened");
        assert_eq!(removed, cut.len() as u64);
        sink.write_group(&[sample(1, 1)]).expect("written");
        drop(sink);

        let text = std::fs::read_to_string(&path).expect("read");
        let _ = std::fs::remove_file(&path);
        let groups: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<TrainingSample>(l)
                    .expect("complete line")
                    .group_id
            })
            .collect();
        assert_eq!(groups, [0, 1]);
    }
}
