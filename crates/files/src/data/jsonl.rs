//! Datasets as JSON Lines: one `{"prompt": "text" | [messages], ...other columns}` per line.
//!
//! The prompt becomes the conversation's opening messages (a string is one user message); the
//! other columns travel with the row to the reward functions (the answer, test cases, ...).
//! Rows are read lazily, so a dataset larger than memory streams. A bad row is an error that
//! says the file, the line and what was expected; with [`DatasetReader::skip_bad_rows`] it is
//! set aside and reported at the end instead. Blank lines are ignored. A line that is not
//! UTF-8 is a bad row like any other, with its line; a prompt message needs a known role
//! (`system`, `user`, `assistant`, `tool`) and content (an assistant message may carry
//! `tool_calls` instead).

use std::{
    fmt,
    fs::File,
    io::{BufRead, BufReader},
    path::Path,
    sync::Arc,
};

use rollout_api::{DatasetError, DatasetRow};

/// Reads a JSON Lines dataset row by row.
pub struct DatasetReader<R> {
    reader: R,
    path: Arc<str>,
    line: usize,
    buffer: Vec<u8>,
    skip_bad_rows: bool,
    skipped: Vec<DatasetError>,
    failed: bool,
}

impl DatasetReader<BufReader<File>> {
    /// Opens a `.jsonl` file.
    pub fn open(path: &Path) -> Result<Self, DatasetError> {
        let file = File::open(path).map_err(|source| DatasetError::Open {
            path: path.display().to_string(),
            source,
        })?;
        Ok(DatasetReader::new(
            BufReader::new(file),
            path.display().to_string(),
        ))
    }
}

impl<R: BufRead> DatasetReader<R> {
    /// Reads rows from `reader`; `name` is how errors refer to it.
    pub fn new(reader: R, name: impl Into<String>) -> Self {
        DatasetReader {
            reader,
            path: Arc::from(name.into()),
            line: 0,
            buffer: Vec::new(),
            skip_bad_rows: false,
            skipped: Vec::new(),
            failed: false,
        }
    }

    /// Sets bad rows aside (see [`DatasetReader::skipped`]) instead of yielding them as
    /// errors.
    pub fn skip_bad_rows(mut self, skip: bool) -> Self {
        self.skip_bad_rows = skip;
        self
    }

    /// The rows set aside so far, each with its file, line and reason.
    pub fn skipped(&self) -> &[DatasetError] {
        &self.skipped
    }
}

impl<R: BufRead> Iterator for DatasetReader<R> {
    type Item = Result<DatasetRow, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.failed {
            self.buffer.clear();
            self.line += 1;
            match self.reader.read_until(b'\n', &mut self.buffer) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(source) => {
                    self.failed = true;
                    return Some(Err(DatasetError::Read {
                        path: self.path.to_string(),
                        line: self.line,
                        source,
                    }));
                }
            }
            let row = match std::str::from_utf8(&self.buffer) {
                Ok(text) => {
                    let text = text.trim_end_matches(['\n', '\r']);
                    if text.trim().is_empty() {
                        continue;
                    }
                    DatasetRow::parse(Arc::clone(&self.path), self.line, text)
                }
                Err(error) => Err(DatasetError::Row {
                    path: self.path.to_string(),
                    line: self.line,
                    reason: not_utf8(&self.buffer, &error),
                }),
            };
            match row {
                Ok(row) => return Some(Ok(row)),
                Err(error) if self.skip_bad_rows => self.skipped.push(error),
                Err(error) => return Some(Err(error)),
            }
        }
        None
    }
}

impl<R> fmt::Debug for DatasetReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatasetReader")
            .field("path", &self.path)
            .field("line", &self.line)
            .field("skip_bad_rows", &self.skip_bad_rows)
            .field("skipped", &self.skipped.len())
            .finish()
    }
}

/// Why a line is not UTF-8, with where in the line.
fn not_utf8(line: &[u8], error: &std::str::Utf8Error) -> String {
    let at = error.valid_up_to();
    format!(
        "not UTF-8: byte 0x{:02X} at column {} cannot start or continue a character; a \
         dataset is JSON Lines in UTF-8",
        line.get(at).copied().unwrap_or_default(),
        at + 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn read(text: &str) -> DatasetReader<&[u8]> {
        DatasetReader::new(text.as_bytes(), "data.jsonl")
    }

    #[test]
    fn a_text_prompt_is_one_user_message_and_other_columns_travel_along() {
        let rows: Vec<DatasetRow> = read(concat!(
            "{\"prompt\": \"What is 6 * 7?\", \"answer\": \"42\"}\n",
            "\n",
            "{\"prompt\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi\"}], \"id\": 7}\r\n",
        ))
        .collect::<Result<_, _>>()
        .expect("valid rows");
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].line, rows[0].prompt.len(), rows[0].prompt[0].role()),
            (1, 1, "user")
        );
        assert_eq!(rows[0].prompt[0].content(), Some("What is 6 * 7?"));
        assert_eq!(
            rows[0].columns.get("answer"),
            Some(&Value::String("42".into()))
        );
        assert_eq!(
            (
                rows[1].line,
                rows[1].prompt[0].role(),
                rows[1].prompt[1].content()
            ),
            (3, "system", Some("Hi"))
        );
        assert!(!rows[1].columns.contains_key("prompt"));
    }

    #[test]
    fn a_bad_row_names_the_file_the_line_and_what_was_expected() {
        let error = |text: &str| {
            read(text)
                .find_map(Result::err)
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            error("{\"prompt\": \"ok\"}\n{\"question\": \"x\"}\n"),
            "data.jsonl:2: no \"prompt\" field; a row is {\"prompt\": \"text\" or [messages], ...other columns}"
        );
        assert!(error("{\"prompt\": \"ok\"\n").starts_with(
            "data.jsonl:1: not valid JSON: EOF while parsing an object at line 1 column 15"
        ));
        assert_eq!(
            error("{\"prompt\": 3}\n"),
            "data.jsonl:1: \"prompt\" must be a string or a list of messages, got a number"
        );
        assert_eq!(
            error(
                "{\"prompt\": [{\"role\": \"user\", \"content\": \"a\"}, {\"content\": \"b\"}]}\n"
            ),
            "data.jsonl:1: prompt[1]: a message needs a \"role\"; got {\"content\":\"b\"}"
        );
        assert_eq!(
            error("[1, 2]\n"),
            "data.jsonl:1: a row must be a JSON object, got an array; a row is {\"prompt\": \"text\" or [messages], ...other columns}"
        );
        assert_eq!(
            error("{\"prompt\": \"  \"}\n"),
            "data.jsonl:1: \"prompt\" is an empty string"
        );
    }

    #[test]
    fn a_bad_row_is_an_error_the_caller_may_stop_at_or_skip() {
        let text = "{\"prompt\": \"a\"}\n{\"prompt\": 1}\n{\"prompt\": \"c\"}\nnot json\n{\"prompt\": \"e\"}\n";
        let strict: Result<Vec<_>, _> = read(text).collect();
        assert!(
            strict.is_err_and(|e| e.line() == 2),
            "collecting stops at the first"
        );
        let each: Vec<Result<usize, usize>> = read(text)
            .map(|row| row.map(|r| r.line).map_err(|e| e.line()))
            .collect();
        assert_eq!(each, [Ok(1), Err(2), Ok(3), Err(4), Ok(5)]);

        let mut lenient = read(text).skip_bad_rows(true);
        let lines: Vec<usize> = lenient
            .by_ref()
            .map(|row| row.map(|r| r.line).unwrap_or(0))
            .collect();
        assert_eq!(lines, [1, 3, 5]);
        let skipped: Vec<usize> = lenient.skipped().iter().map(DatasetError::line).collect();
        assert_eq!(skipped, [2, 4]);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_a_bad_row_with_its_line_and_can_be_skipped() {
        let bytes: &[u8] = b"{\"prompt\": \"a\"}\n{\"prompt\": \"caf\xE9\"}\n{\"prompt\": \"c\"}\n";
        let each: Vec<Result<usize, String>> = DatasetReader::new(bytes, "data.jsonl")
            .map(|row| row.map(|r| r.line).map_err(|e| e.to_string()))
            .collect();
        assert_eq!(
            each,
            [
                Ok(1),
                Err(
                    "data.jsonl:2: not UTF-8: byte 0xE9 at column 16 cannot start or continue \
                     a character; a dataset is JSON Lines in UTF-8"
                        .to_owned()
                ),
                Ok(3)
            ]
        );
        let mut lenient = DatasetReader::new(bytes, "data.jsonl").skip_bad_rows(true);
        let lines: Vec<usize> = lenient
            .by_ref()
            .filter_map(|row| row.ok().map(|r| r.line))
            .collect();
        assert_eq!(lines, [1, 3]);
        assert_eq!(
            lenient
                .skipped()
                .iter()
                .map(DatasetError::line)
                .collect::<Vec<_>>(),
            [2]
        );
    }

    #[test]
    fn prompt_messages_need_a_known_role_and_content() {
        let error = |messages: &str| {
            read(&format!("{{\"prompt\": {messages}}}\n"))
                .find_map(Result::err)
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            error(r#"[{"role": "narrator", "content": "x"}]"#),
            "data.jsonl:1: prompt[0]: unknown role \"narrator\"; expected one of system, user, assistant, tool"
        );
        assert_eq!(
            error(r#"[{"role": "system", "content": "x"}, {"role": "user"}]"#),
            "data.jsonl:1: prompt[1]: a \"user\" message needs \"content\" (text or a list of parts)"
        );
        assert_eq!(
            error(r#"[{"role": "assistant", "content": null}]"#),
            "data.jsonl:1: prompt[0]: a \"assistant\" message needs \"content\" (text or a list of parts) or \"tool_calls\""
        );
        assert_eq!(
            error(r#"[{"role": "user", "content": 7}]"#),
            "data.jsonl:1: prompt[0]: a message's \"content\" must be text or a list of parts, got a number"
        );
        let fine = r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}, {"role": "tool", "content": "1"}]"#;
        assert_eq!(error(fine), "");
    }

    #[test]
    fn a_missing_file_is_named() {
        let error = DatasetReader::open(Path::new("/nonexistent/data.jsonl"))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "could not open dataset /nonexistent/data.jsonl: No such file or directory (os error 2)"
            )
        );
    }
}
