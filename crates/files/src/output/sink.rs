//! [`JsonlSink`]: training samples written as JSON Lines, a group at a time.

use std::{
    fs::{File, OpenOptions},
    io::{self, Read, Seek, SeekFrom, Write},
    path::Path,
};

use rollout_core::TrainingSample;

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

    use rollout_core::{Message, RolloutId};
    use serde_json::Map;

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
            token_versions: Vec::new(),
            routed_experts: None,
            metrics: rollout_core::SampleMetrics::new(),
            environment: Map::new(),
            reward_notes: Map::new(),
            step_rewards: Vec::new(),
            advantage_spans: Vec::new(),
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
        let path = std::env::temp_dir().join(format!("rollout-sink-{}.jsonl", std::process::id()));
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
