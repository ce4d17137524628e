//! Parquet datasets and outputs (feature `parquet`).
//!
//! A dataset row is read as the JSON object arrow's JSON writer makes of it, then parsed as a
//! JSON Lines row is: a Hugging Face datasets file reads as it is (`prompt` a string or a
//! list of `{role, content, ...}` structs, other columns of any type). Training rows are
//! written one per Parquet row: ids, mask and logprobs as lists, messages, rewards, metrics
//! and the environment's `environment` object as JSON text (messages carry keys no fixed
//! schema holds; `environment` is null when absent, and an earlier output continued by a
//! resume gets it as nulls).

use std::{
    collections::VecDeque,
    fs::File,
    io::{BufRead, BufReader},
    path::Path,
    sync::Arc,
};

use arrow_array::{
    Array, ArrayRef, BinaryArray, Float64Array, ListArray, RecordBatch, StringArray, UInt64Array,
    types::{Float32Type, Float64Type, UInt8Type, UInt32Type, UInt64Type},
};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use parquet::{
    arrow::{ArrowWriter, arrow_reader::ParquetRecordBatchReaderBuilder},
    basic::Compression,
    file::properties::WriterProperties,
};
use rollout_core::TrainingSample;

use crate::{DatasetError, DatasetRow, FileError, file_error::Context};

/// Dataset rows of a Parquet file, batch by batch.
pub(crate) struct ParquetRows {
    batches: Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>,
    source: Arc<str>,
    /// The rows of the batch being read, as JSON text.
    pending: VecDeque<String>,
    /// Rows read so far (a row's number, from 1, is where its errors point).
    row: usize,
    failed: bool,
}

/// The rows of the Parquet file at `path`.
pub(crate) fn rows(path: &Path) -> Result<ParquetRows, DatasetError> {
    let source: Arc<str> = Arc::from(path.display().to_string());
    let open = |error: String| DatasetError::Open {
        path: source.to_string(),
        source: std::io::Error::other(error),
    };
    let file = File::open(path).map_err(|e| open(e.to_string()))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|builder| builder.build())
        .map_err(|e| open(format!("not a readable Parquet file: {e}")))?;
    Ok(ParquetRows {
        batches: Box::new(reader),
        source,
        pending: VecDeque::new(),
        row: 0,
        failed: false,
    })
}

/// A batch's rows as JSON objects, one text each.
fn json_rows(batch: &RecordBatch) -> Result<VecDeque<String>, ArrowError> {
    let mut writer = arrow_json::LineDelimitedWriter::new(Vec::new());
    writer.write(batch)?;
    writer.finish()?;
    let text = String::from_utf8(writer.into_inner())
        .map_err(|e| ArrowError::JsonError(format!("not UTF-8: {e}")))?;
    Ok(text.lines().map(str::to_owned).collect())
}

impl Iterator for ParquetRows {
    type Item = Result<DatasetRow, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        while self.pending.is_empty() {
            if self.failed {
                return None;
            }
            let batch = match self.batches.next()? {
                Ok(batch) => json_rows(&batch),
                Err(error) => Err(error),
            };
            match batch {
                Ok(rows) => self.pending = rows,
                Err(error) => {
                    self.failed = true;
                    return Some(Err(DatasetError::Read {
                        path: self.source.to_string(),
                        line: self.row + 1,
                        source: std::io::Error::other(error),
                    }));
                }
            }
        }
        let text = self.pending.pop_front()?;
        self.row += 1;
        Some(DatasetRow::parse(Arc::clone(&self.source), self.row, &text))
    }
}

/// The schema training rows are written with (Parquet outputs, the row stream's batches).
pub fn schema() -> SchemaRef {
    let list = |item: DataType| DataType::List(Arc::new(Field::new_list_field(item, true)));
    Arc::new(Schema::new(vec![
        Field::new("group_id", DataType::UInt64, false),
        Field::new("group_samples", DataType::UInt64, false),
        Field::new("rollout_id", DataType::UInt64, false),
        Field::new("prompt", DataType::Utf8, false),
        Field::new("completion", DataType::Utf8, false),
        Field::new("input_ids", list(DataType::UInt32), false),
        Field::new("completion_mask", list(DataType::UInt8), false),
        Field::new("old_log_probs", list(DataType::Float32), false),
        Field::new("advantage", DataType::Float64, false),
        Field::new("reward", DataType::Float64, true),
        Field::new("rewards", DataType::Utf8, false),
        Field::new("model_version", DataType::UInt64, false),
        Field::new("metrics", DataType::Utf8, false),
        // Null when the environment said nothing beyond numbers (and in files written
        // before the column existed).
        Field::new("environment", DataType::Utf8, true),
        // Null when no reward function kept a note on the row.
        Field::new("reward_notes", DataType::Utf8, true),
        // Null when the environment gave no step reward (a null item: none for that turn).
        Field::new("step_rewards", list(DataType::Float64), true),
        // Null with episode credit; else JSON, `[{"start", "end", "advantage"}, ...]`.
        Field::new("advantage_spans", DataType::Utf8, true),
        // JSON, `[{"start", "end", "version"}, ...]`: the version of each sampled token. Null
        // in files written before the column existed.
        Field::new("token_versions", DataType::Utf8, true),
        // With routing replay (else null): the expert ids of every token, per layer, as
        // `routed_experts_shape` `[tokens, layers, top_k]` little-endian ids of
        // `routed_experts_dtype` (`uint8` or `uint16`) in token order; the tokens the server
        // reported no routing for as JSON `[[start, end], ...]` (their ids are zeros).
        Field::new("routed_experts", DataType::Binary, true),
        Field::new("routed_experts_shape", list(DataType::UInt64), true),
        Field::new("routed_experts_dtype", DataType::Utf8, true),
        Field::new("routed_experts_missing", DataType::Utf8, true),
    ]))
}

/// A batch of an earlier output in today's [`schema`]: the columns it lacks (it was written
/// before they existed; each is nullable) added as nulls.
fn upgraded(batch: RecordBatch) -> Result<RecordBatch, ArrowError> {
    let schema = schema();
    if batch.schema().fields() == schema.fields() {
        return Ok(batch);
    }
    let columns = schema
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(column) => Ok(Arc::clone(column)),
            None if field.is_nullable() => Ok(arrow_array::new_null_array(
                field.data_type(),
                batch.num_rows(),
            )),
            None => Err(ArrowError::SchemaError(format!(
                "no column `{}`: not a file of training rows this program wrote",
                field.name()
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema, columns)
}

/// Samples as one record batch of [`schema`].
pub fn batch(samples: &[TrainingSample]) -> Result<RecordBatch, FileError> {
    let u64s = |f: fn(&TrainingSample) -> u64| -> ArrayRef {
        Arc::new(UInt64Array::from_iter_values(samples.iter().map(f)))
    };
    let json =
        |f: fn(&TrainingSample) -> serde_json::Result<String>| -> Result<ArrayRef, FileError> {
            let texts = samples.iter().map(f).collect::<Result<Vec<_>, _>>()?;
            Ok(Arc::new(StringArray::from(texts)))
        };
    // A nullable text column: null where the sample has nothing to say.
    let json_or_null = |f: fn(&TrainingSample) -> Option<serde_json::Result<String>>| {
        samples
            .iter()
            .map(|s| f(s).transpose())
            .collect::<Result<StringArray, _>>()
            .map(|texts| Arc::new(texts) as ArrayRef)
    };
    let columns: Vec<ArrayRef> = vec![
        u64s(|s| s.group_id),
        u64s(|s| s.group_samples),
        u64s(|s| s.rollout_id.0),
        json(|s| serde_json::to_string(&s.prompt))?,
        json(|s| serde_json::to_string(&s.completion))?,
        Arc::new(ListArray::from_iter_primitive::<UInt32Type, _, _>(
            samples
                .iter()
                .map(|s| Some(s.input_ids.iter().map(|&id| Some(id)))),
        )),
        Arc::new(ListArray::from_iter_primitive::<UInt8Type, _, _>(
            samples
                .iter()
                .map(|s| Some(s.completion_mask.iter().map(|&m| Some(m)))),
        )),
        Arc::new(ListArray::from_iter_primitive::<Float32Type, _, _>(
            samples
                .iter()
                .map(|s| Some(s.old_log_probs.iter().map(|&l| Some(l)))),
        )),
        Arc::new(Float64Array::from_iter_values(
            samples.iter().map(|s| s.advantage),
        )),
        Arc::new(samples.iter().map(|s| s.reward).collect::<Float64Array>()),
        json(|s| serde_json::to_string(&s.rewards))?,
        u64s(|s| s.model_version),
        json(|s| serde_json::to_string(&s.metrics))?,
        json_or_null(|s| {
            (!s.environment.is_empty()).then(|| serde_json::to_string(&s.environment))
        })?,
        json_or_null(|s| {
            (!s.reward_notes.is_empty()).then(|| serde_json::to_string(&s.reward_notes))
        })?,
        Arc::new(ListArray::from_iter_primitive::<Float64Type, _, _>(
            samples
                .iter()
                .map(|s| (!s.step_rewards.is_empty()).then(|| s.step_rewards.iter().copied())),
        )),
        json_or_null(|s| {
            (!s.advantage_spans.is_empty()).then(|| serde_json::to_string(&s.advantage_spans))
        })?,
        json_or_null(|s| Some(serde_json::to_string(&s.token_versions)))?,
        Arc::new(
            samples
                .iter()
                .map(|s| s.routed_experts.as_ref().map(|r| r.data.as_slice()))
                .collect::<BinaryArray>(),
        ),
        Arc::new(ListArray::from_iter_primitive::<UInt64Type, _, _>(
            samples.iter().map(|s| {
                s.routed_experts.as_ref().map(|r| {
                    [r.tokens(), r.layers, r.top_k]
                        .into_iter()
                        .map(|n| Some(n as u64))
                })
            }),
        )),
        json_or_null(|s| {
            s.routed_experts.as_ref().map(|r| {
                serde_json::to_value(r.dtype).map(|v| v.as_str().unwrap_or_default().to_owned())
            })
        })?,
        json_or_null(|s| {
            s.routed_experts.as_ref().map(|r| {
                let spans: Vec<[usize; 2]> = r.missing.iter().map(|m| [m.start, m.end]).collect();
                serde_json::to_string(&spans)
            })
        })?,
    ];
    Ok(RecordBatch::try_new(schema(), columns)?)
}

/// Samples written to the Parquet file per row group.
const ROW_GROUP: usize = 1024;

/// Writes the Parquet file `out` from the rows of `previous` (an earlier Parquet output a
/// resumed run continues) and the JSON Lines `journal`, through a temporary file renamed
/// over `out` once complete. Returns the groups and samples of the journal.
pub(crate) fn write(
    out: &Path,
    previous: Option<&Path>,
    journal: &Path,
) -> Result<(u64, u64), FileError> {
    let partial = out.with_extension("parquet.tmp");
    let file =
        File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROW_GROUP))
        .build();
    let mut writer = ArrowWriter::try_new(file, schema(), Some(properties))?;
    if let Some(previous) = previous {
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(previous)?)?.build()?;
        for batch in reader {
            writer.write(&upgraded(batch?)?)?;
        }
    }
    let lines = BufReader::new(
        File::open(journal).with_context(|| format!("cannot read {}", journal.display()))?,
    );
    let mut samples = Vec::with_capacity(ROW_GROUP);
    let (mut groups, mut written) = (std::collections::HashSet::new(), 0u64);
    for (index, line) in lines.lines().enumerate() {
        let line = line?;
        let sample: TrainingSample = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a training row", journal.display(), index + 1))?;
        groups.insert(sample.group_id);
        samples.push(sample);
        if samples.len() == ROW_GROUP {
            writer.write(&batch(&samples)?)?;
            written += samples.len() as u64;
            samples.clear();
        }
    }
    if !samples.is_empty() {
        writer.write(&batch(&samples)?)?;
        written += samples.len() as u64;
    }
    writer.close()?;
    std::fs::rename(&partial, out)
        .with_context(|| format!("cannot move {} to {}", partial.display(), out.display()))?;
    Ok((groups.len() as u64, written))
}

/// The groups an output this program wrote holds, in the order they were written, each as
/// one record batch of [`schema`] with its position (its place among the output's groups,
/// from 0): those whose position is `wanted`. A Parquet output's groups are its file's, then
/// its journal's. Read after the output was opened to resume, which cut it back to its whole
/// groups.
pub fn output_groups(
    out: &Path,
    mut wanted: impl FnMut(u64) -> bool,
) -> Result<Vec<(u64, RecordBatch)>, FileError> {
    let mut groups = Groups::default();
    match crate::data::Format::of(out) {
        crate::data::Format::JsonLines => jsonl_groups(out, &mut groups, &mut wanted)?,
        crate::data::Format::Parquet => {
            if out.exists() {
                parquet_output_groups(out, &mut groups, &mut wanted)?;
            }
            let journal = crate::output::journal_path(out);
            if journal.exists() {
                jsonl_groups(&journal, &mut groups, &mut wanted)?;
            }
        }
    }
    Ok(groups.found)
}

/// The groups found so far, and where the next one is.
#[derive(Default)]
struct Groups {
    found: Vec<(u64, RecordBatch)>,
    /// The position of the group being read (`None` before the first).
    current: Option<(u64, u64)>,
    next: u64,
}

impl Groups {
    /// A row of group `id` is next: its position, a new one when the group changes.
    fn position_of(&mut self, id: u64) -> u64 {
        match self.current {
            Some((current, position)) if current == id => position,
            _ => {
                let position = self.next;
                self.next += 1;
                self.current = Some((id, position));
                position
            }
        }
    }
}

fn jsonl_groups(
    path: &Path,
    groups: &mut Groups,
    wanted: &mut impl FnMut(u64) -> bool,
) -> Result<(), FileError> {
    #[derive(serde::Deserialize)]
    struct Id {
        group_id: u64,
    }
    let file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut pending: Option<(u64, Vec<TrainingSample>)> = None;
    let flush = |pending: &mut Option<(u64, Vec<TrainingSample>)>,
                 groups: &mut Groups|
     -> Result<(), FileError> {
        if let Some((position, samples)) = pending.take() {
            groups.found.push((position, batch(&samples)?));
        }
        Ok(())
    };
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line?;
        let bad = |e: serde_json::Error| {
            format!(
                "{}:{}: not a training row ({e}); only an output this program wrote is served \
                 again",
                path.display(),
                index + 1
            )
        };
        let id: Id = serde_json::from_str(&line).map_err(|e| FileError::new(bad(e)))?;
        let position = groups.position_of(id.group_id);
        if pending.as_ref().is_some_and(|(p, _)| *p != position) {
            flush(&mut pending, groups)?;
        }
        if wanted(position) {
            let sample: TrainingSample =
                serde_json::from_str(&line).map_err(|e| FileError::new(bad(e)))?;
            pending
                .get_or_insert_with(|| (position, Vec::new()))
                .1
                .push(sample);
        }
    }
    flush(&mut pending, groups)
}

fn parquet_output_groups(
    path: &Path,
    groups: &mut Groups,
    wanted: &mut impl FnMut(u64) -> bool,
) -> Result<(), FileError> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(
        File::open(path).with_context(|| format!("cannot read {}", path.display()))?,
    )
    .and_then(|builder| builder.build())
    .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
    // A group's rows may span the reader's batches: its slices, joined when it ends.
    let mut pending: Option<(u64, Vec<RecordBatch>)> = None;
    let flush = |pending: &mut Option<(u64, Vec<RecordBatch>)>,
                 groups: &mut Groups|
     -> Result<(), FileError> {
        if let Some((position, slices)) = pending.take() {
            let joined = arrow_select::concat::concat_batches(&schema(), &slices)?;
            groups.found.push((position, joined));
        }
        Ok(())
    };
    for batch in reader {
        let batch = upgraded(batch?)?;
        let ids = batch
            .column_by_name("group_id")
            .and_then(|c| c.as_any().downcast_ref::<UInt64Array>())
            .cloned()
            .with_context(|| {
                format!(
                    "{}: no u64 column `group_id`: not a file of training rows this program \
                     wrote",
                    path.display()
                )
            })?;
        let mut start = 0;
        while start < ids.len() {
            let id = ids.value(start);
            let end = (start..ids.len())
                .find(|&i| ids.value(i) != id)
                .unwrap_or(ids.len());
            let position = groups.position_of(id);
            if pending.as_ref().is_some_and(|(p, _)| *p != position) {
                flush(&mut pending, groups)?;
            }
            if wanted(position) {
                pending
                    .get_or_insert_with(|| (position, Vec::new()))
                    .1
                    .push(batch.slice(start, end - start));
            }
            start = end;
        }
    }
    flush(&mut pending, groups)
}

/// The `(group_id, group_samples)` of every row of a Parquet output this program wrote.
pub(crate) fn groups(path: &Path) -> Result<Vec<(u64, u64)>, FileError> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(
        File::open(path).with_context(|| format!("cannot read {}", path.display()))?,
    )
    .and_then(|builder| builder.build())
    .with_context(|| format!("{}: not a readable Parquet file", path.display()))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch?;
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_any().downcast_ref::<UInt64Array>())
                .cloned()
                .with_context(|| {
                    format!(
                        "{}: no u64 column `{name}`: not a file of training rows this program \
                         wrote",
                        path.display()
                    )
                })
        };
        let (ids, sizes) = (column("group_id")?, column("group_samples")?);
        rows.extend((0..ids.len()).map(|i| (ids.value(i), sizes.value(i))));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use rollout_core::{Message, RolloutId};
    use serde_json::{Map, json};

    use super::*;

    fn sample(group_id: u64, environment: Map<String, serde_json::Value>) -> TrainingSample {
        TrainingSample {
            group_id,
            group_samples: 1,
            rollout_id: RolloutId(group_id),
            prompt: vec![Message::user("What is 6 * 7?")],
            completion: vec![Message::assistant("42")],
            input_ids: vec![1, 2],
            completion_mask: vec![0, 1],
            old_log_probs: vec![0.0, -0.5],
            advantage: 0.0,
            reward: Some(1.0),
            rewards: Map::new(),
            model_version: 0,
            token_versions: Vec::new(),
            routed_experts: None,
            metrics: rollout_core::SampleMetrics::new(),
            environment,
            reward_notes: Map::new(),
            step_rewards: Vec::new(),
            advantage_spans: Vec::new(),
        }
    }

    /// The groups of a Parquet output and its journal, in the order written, at positions
    /// counted across both: a group of 1,500 rows (past the reader's batches of 1,024) in one
    /// batch, and only the positions asked for.
    #[test]
    fn an_outputs_groups_come_back_whole_at_their_positions() {
        let dir = std::env::temp_dir().join(format!("parquet-groups-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let out = dir.join("rows.parquet");
        let group = |id: u64, rows: usize| -> Vec<TrainingSample> {
            (0..rows)
                .map(|_| TrainingSample {
                    group_samples: rows as u64,
                    ..sample(id, Map::new())
                })
                .collect()
        };
        let mut writer = ArrowWriter::try_new(File::create(&out).expect("created"), schema(), None)
            .expect("a writer");
        for (id, rows) in [(7, 3), (5, 1_500), (9, 2)] {
            writer
                .write(&batch(&group(id, rows)).expect("a batch"))
                .expect("written");
        }
        writer.close().expect("closed");
        let journal = crate::output::journal_path(&out);
        let lines: String = [(4, 2), (8, 1)]
            .iter()
            .flat_map(|&(id, rows)| group(id, rows))
            .map(|s| serde_json::to_string(&s).expect("JSON") + "\n")
            .collect();
        std::fs::write(&journal, lines).expect("the journal");

        let ids = |groups: &[(u64, RecordBatch)]| -> Vec<(u64, u64, usize)> {
            groups
                .iter()
                .map(|(position, batch)| {
                    let column = batch
                        .column_by_name("group_id")
                        .and_then(|c| c.as_any().downcast_ref::<UInt64Array>().cloned())
                        .expect("group ids");
                    assert!(column.values().iter().all(|&id| id == column.value(0)));
                    (*position, column.value(0), batch.num_rows())
                })
                .collect()
        };
        let all = output_groups(&out, |_| true).expect("read back");
        assert_eq!(
            ids(&all),
            [(0, 7, 3), (1, 5, 1_500), (2, 9, 2), (3, 4, 2), (4, 8, 1)]
        );
        let some = output_groups(&out, |position| position % 2 == 1).expect("read back");
        assert_eq!(ids(&some), [(1, 5, 1_500), (3, 4, 2)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_later_columns_are_written_and_files_written_before_them_are_continued() {
        let dir = std::env::temp_dir().join(format!("parquet-environment-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        // An output of the first schema: every column up to `metrics`, none of those added
        // since (`environment`, `reward_notes`, `step_rewards`, `advantage_spans`,
        // `token_versions`).
        let old = dir.join("old.parquet");
        let full = batch(&[sample(0, Map::new())]).expect("a batch");
        let metrics = full.schema().index_of("metrics").expect("a metrics column");
        let without = full
            .project(&(0..=metrics).collect::<Vec<_>>())
            .expect("projected");
        let mut writer =
            ArrowWriter::try_new(File::create(&old).expect("created"), without.schema(), None)
                .expect("a writer");
        writer.write(&without).expect("written");
        writer.close().expect("closed");

        let said = json!({"artifacts": {"log": "ok"}})
            .as_object()
            .cloned()
            .unwrap_or_default();
        let mut new = sample(1, said);
        new.step_rewards = vec![Some(0.25), None];
        new.advantage_spans = vec![rollout_core::AdvantageSpan {
            start: 1,
            end: 2,
            advantage: -0.5,
        }];
        new.token_versions = vec![rollout_core::VersionSpan {
            start: 1,
            end: 2,
            version: 3,
        }];
        new.routed_experts = Some(rollout_core::RowRouting {
            layers: 2,
            top_k: 1,
            dtype: rollout_core::ExpertDtype::Uint8,
            data: vec![4, 5, 6, 7, 0, 0],
            missing: std::iter::once(2..3).collect(),
        });
        let journal = dir.join("out.partial.jsonl");
        let line = serde_json::to_string(&new).expect("JSON");
        std::fs::write(&journal, format!("{line}\n")).expect("the journal");
        let out = dir.join("out.parquet");
        write(&out, Some(&old), &journal).expect("the old rows and the new ones are written");

        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&out).expect("opened"))
            .and_then(|builder| builder.build())
            .expect("readable");
        let (mut environment, mut spans, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        let (mut versions, mut routing) = (Vec::new(), Vec::new());
        for batch in reader {
            let batch = batch.expect("a batch");
            let text = |name: &str| {
                batch
                    .column_by_name(name)
                    .and_then(|c| c.as_any().downcast_ref::<StringArray>().cloned())
                    .expect("a text column")
            };
            environment.extend(text("environment").iter().map(|t| t.map(str::to_owned)));
            spans.extend(text("advantage_spans").iter().map(|t| t.map(str::to_owned)));
            versions.extend(text("token_versions").iter().map(|t| t.map(str::to_owned)));
            let experts = batch
                .column_by_name("routed_experts")
                .and_then(|c| c.as_any().downcast_ref::<BinaryArray>().cloned())
                .expect("a binary column");
            let shapes = batch
                .column_by_name("routed_experts_shape")
                .and_then(|c| c.as_any().downcast_ref::<ListArray>().cloned())
                .expect("a list column");
            for i in 0..experts.len() {
                routing.push((!experts.is_null(i)).then(|| {
                    let shape = shapes.value(i);
                    let shape = shape.as_any().downcast_ref::<UInt64Array>().expect("u64s");
                    (
                        experts.value(i).to_vec(),
                        shape.values().to_vec(),
                        text("routed_experts_dtype").value(i).to_owned(),
                        text("routed_experts_missing").value(i).to_owned(),
                    )
                }));
            }
            let lists = batch
                .column_by_name("step_rewards")
                .and_then(|c| c.as_any().downcast_ref::<ListArray>().cloned())
                .expect("a step_rewards column");
            for i in 0..lists.len() {
                steps.push((!lists.is_null(i)).then(|| {
                    let list = lists.value(i);
                    let values = list
                        .as_any()
                        .downcast_ref::<Float64Array>()
                        .expect("floats")
                        .clone();
                    values.iter().collect::<Vec<_>>()
                }));
            }
        }
        assert_eq!(
            environment,
            [None, Some(r#"{"artifacts":{"log":"ok"}}"#.to_owned())]
        );
        assert_eq!(steps, [None, Some(vec![Some(0.25), None])]);
        assert_eq!(
            spans,
            [
                None,
                Some(r#"[{"start":1,"end":2,"advantage":-0.5}]"#.to_owned())
            ]
        );
        assert_eq!(
            versions,
            [
                None,
                Some(r#"[{"start":1,"end":2,"version":3}]"#.to_owned())
            ]
        );
        assert_eq!(
            routing,
            [
                None,
                Some((
                    vec![4, 5, 6, 7, 0, 0],
                    vec![3, 2, 1],
                    "uint8".to_owned(),
                    "[[2,3]]".to_owned()
                ))
            ]
        );
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
