//! `kind = "judge"`: an LLM judge behind an OpenAI-compatible chat endpoint.

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use futures::future::{BoxFuture, join_all};
use serde_json::{Value, json};

use super::service::{Service, ServiceConfig, ServiceError, head};
use crate::{
    group::Group,
    reward::{AsyncReward, CallStats, Notes, RewardError, Scores},
};

/// Whether the judge sees one completion per request or the whole group at once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum JudgeMode {
    /// One request per completion; the template names `{completion}`.
    #[default]
    Each,
    /// One request per group that asks for one score per completion, judged against each
    /// other (RULER-style); the template names `{completions}`, which holds each completion
    /// as `<completion id="N">TEXT</completion>`, `N` from 1. `TEXT` has `&`, `<` and `>`
    /// written `&amp;`, `&lt;` and `&gt;`: a completion cannot close its block or open
    /// another's. The answer's field holds an array of one score per completion, in order
    /// (of another length it fails the whole group: which score is whose cannot be known), or
    /// an object from id to score (`{"1": 7, "2": 3}`), where a missing id leaves only its
    /// completion unscorable.
    Group,
}

/// How the score is read from the judge's answer (after its thinking, when it thinks in
/// `<think>...</think>`).
#[derive(Debug, Clone, PartialEq)]
pub enum ScoreFormat {
    /// The last number in the answer (`-2`, `7`, `0.85`). Each mode only.
    Number,
    /// The field of the first JSON object in the answer that has it (a fenced block or
    /// prose around it are fine): a number (each mode) or an array with one number or `null`
    /// per completion (group mode); with [`ScoreFormat::Labels`]' map given by
    /// [`JudgeConfig::labels`], a label stands for its number.
    Json {
        /// The field's name.
        field: String,
    },
    /// The last of these labels to stand as a word of its own in the answer gives its value
    /// (case matters: `CORRECT` is not found in `INCORRECT`). Each mode only.
    Labels(Vec<(String, f64)>),
}

/// What a [`Judge`] asks, of which model, and how it reads the answer.
#[derive(Debug, Clone)]
pub struct JudgeConfig {
    model: String,
    template: String,
    system: Option<String>,
    score: ScoreFormat,
    labels: Vec<(String, f64)>,
    mode: JudgeMode,
    max_tokens: u32,
    temperature: f64,
    cache: usize,
    keep_answers: bool,
}

impl JudgeConfig {
    /// Asks `model` the user message `template`, with `{prompt}`, `{completion}` (each mode),
    /// `{completions}` (group mode) and `{COLUMN}` for any column of the row (`{answer}`...)
    /// filled in; `{{` and `}}` are braces. Reads the last number of the answer, one request
    /// per completion, at most 1024 tokens, temperature 0, no cache.
    pub fn new(model: impl Into<String>, template: impl Into<String>) -> JudgeConfig {
        JudgeConfig {
            model: model.into(),
            template: template.into(),
            system: None,
            score: ScoreFormat::Number,
            labels: Vec::new(),
            mode: JudgeMode::Each,
            max_tokens: 1024,
            temperature: 0.0,
            cache: 0,
            keep_answers: false,
        }
    }

    /// A system message before the template's user message.
    pub fn system(mut self, system: impl Into<String>) -> JudgeConfig {
        self.system = Some(system.into());
        self
    }

    /// How the score is read.
    pub fn score(mut self, score: ScoreFormat) -> JudgeConfig {
        self.score = score;
        self
    }

    /// Labels that stand for numbers in a JSON answer's array (group mode).
    pub fn labels(mut self, labels: Vec<(String, f64)>) -> JudgeConfig {
        self.labels = labels;
        self
    }

    /// One request per completion, or one per group.
    pub fn mode(mut self, mode: JudgeMode) -> JudgeConfig {
        self.mode = mode;
        self
    }

    /// The most tokens the judge may answer with.
    pub fn max_tokens(mut self, max_tokens: u32) -> JudgeConfig {
        self.max_tokens = max_tokens.max(1);
        self
    }

    /// The judge's sampling temperature.
    pub fn temperature(mut self, temperature: f64) -> JudgeConfig {
        self.temperature = temperature;
        self
    }

    /// Keeps each completion's answer (the judge's whole text; in group mode the group's
    /// answer on each) as the reward's note on it: the rows' `reward_notes`. Off by default:
    /// answers can be long.
    pub fn keep_answers(mut self, keep: bool) -> JudgeConfig {
        self.keep_answers = keep;
        self
    }

    /// Keeps up to `entries` answers by request, so that a request made again (the same
    /// completion of the same row, in this group or a later one) is answered from memory;
    /// once full, newer answers are not kept. 0 (the default) keeps none.
    pub fn cache(mut self, entries: usize) -> JudgeConfig {
        self.cache = entries;
        self
    }
}

/// Why a [`Judge`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JudgeError {
    /// The endpoint cannot be called.
    #[error(transparent)]
    Service(#[from] ServiceError),
    /// The template or the way to read the score does not hold together.
    #[error("{0}")]
    Config(String),
}

/// Scores completions with an LLM judge: the template, filled in, is sent to an
/// OpenAI-compatible `/v1/chat/completions` endpoint (`url` names it whole), and the score
/// read from the answer.
///
/// A call that fails (connection, timeout, an error status after the retries) or whose answer
/// holds no score leaves what it judged unscorable (`None`: out of the baseline), counted by
/// cause in [`CallStats`]; in group mode that is the whole group (an error of the column), and
/// an answer with another number of scores than completions is the scorer's wrong length. A
/// row that lacks a column the template names fails the group. Cheap to clone; clones share
/// the connection pool, the bound, the cache and the counters.
#[derive(Clone)]
pub struct Judge {
    inner: Arc<Inner>,
}

struct Inner {
    service: Service,
    model: String,
    system: Option<String>,
    template: Vec<Piece>,
    score: ScoreFormat,
    labels: Vec<(String, f64)>,
    mode: JudgeMode,
    max_tokens: u32,
    temperature: f64,
    cache: Option<Cache>,
    keep_answers: bool,
}

impl std::fmt::Debug for Judge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Judge")
            .field("url", &self.inner.service.url())
            .field("model", &self.inner.model)
            .field("mode", &self.inner.mode)
            .field("calls", &self.inner.service.stats())
            .finish()
    }
}

/// A piece of the template: text as it is, or what fills a placeholder.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Prompt,
    Completion,
    Completions,
    Column(String),
}

/// Answers by request hash, up to a number of entries.
struct Cache {
    answers: Mutex<HashMap<u64, Arc<Answer>>>,
    capacity: usize,
}

/// A judge's answer, and the score or scores read from it once.
struct Answer {
    text: String,
    scores: Scores,
}

impl Judge {
    /// A judge at the endpoint `service` names, asking as `config` says.
    pub fn new(service: ServiceConfig, config: JudgeConfig) -> Result<Judge, JudgeError> {
        let template = parse_template(&config.template)?;
        let (wanted, unwanted) = match config.mode {
            JudgeMode::Each => (Piece::Completion, Piece::Completions),
            JudgeMode::Group => (Piece::Completions, Piece::Completion),
        };
        let name = |piece: &Piece| match piece {
            Piece::Completion => "{completion}",
            _ => "{completions}",
        };
        if template.contains(&unwanted) || !template.contains(&wanted) {
            return Err(JudgeError::Config(format!(
                "the template of a judge in {} mode names {} (what it judges), not {}",
                mode_name(config.mode),
                name(&wanted),
                name(&unwanted),
            )));
        }
        if config.mode == JudgeMode::Group && !matches!(config.score, ScoreFormat::Json { .. }) {
            return Err(JudgeError::Config(
                "a judge in group mode reads its scores as a JSON array: score = \"json\" with \
                 a `field` holding one number, label or null per completion"
                    .to_owned(),
            ));
        }
        if let ScoreFormat::Labels(labels) = &config.score
            && labels.is_empty()
        {
            return Err(JudgeError::Config(
                "score = \"labels\" needs at least one label and its value".to_owned(),
            ));
        }
        let labels = match &config.score {
            ScoreFormat::Labels(labels) => labels.clone(),
            _ => config.labels,
        };
        Ok(Judge {
            inner: Arc::new(Inner {
                service: Service::new(service)?,
                model: config.model,
                system: config.system,
                template,
                score: config.score,
                labels,
                mode: config.mode,
                max_tokens: config.max_tokens,
                temperature: config.temperature,
                cache: (config.cache > 0).then(|| Cache {
                    answers: Mutex::new(HashMap::new()),
                    capacity: config.cache,
                }),
                keep_answers: config.keep_answers,
            }),
        })
    }

    /// The first column of the row the template names, if any.
    pub fn column(&self) -> Option<&str> {
        self.inner.template.iter().find_map(|piece| match piece {
            Piece::Column(name) => Some(name.as_str()),
            _ => None,
        })
    }
}

fn mode_name(mode: JudgeMode) -> &'static str {
    match mode {
        JudgeMode::Each => "each",
        JudgeMode::Group => "group",
    }
}

/// Splits a template into text and placeholders; `{{` and `}}` are braces.
fn parse_template(template: &str) -> Result<Vec<Piece>, JudgeError> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = template.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|(_, next)| *next) == Some('{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek().map(|(_, next)| *next) == Some('}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let rest = &template[at + 1..];
                let Some(end) = rest.find('}') else {
                    return Err(JudgeError::Config(format!(
                        "the template's '{{' at byte {at} is not closed; write {{{{ for a brace"
                    )));
                };
                let name = rest[..end].trim();
                if name.is_empty() || name.contains(['{', '\n']) {
                    return Err(JudgeError::Config(format!(
                        "the template's placeholder at byte {at} has no name; write {{{{ for a \
                         brace"
                    )));
                }
                for _ in 0..end + 1 {
                    chars.next();
                }
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                pieces.push(match name {
                    "prompt" => Piece::Prompt,
                    "completion" => Piece::Completion,
                    "completions" => Piece::Completions,
                    column => Piece::Column(column.to_owned()),
                });
            }
            '}' => {
                return Err(JudgeError::Config(format!(
                    "the template's '}}' at byte {at} closes nothing; write }}}} for a brace"
                )));
            }
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// A prompt as the judge reads it: a string as it is, chat messages as `role: content` lines.
fn prompt_text(prompt: &Value) -> String {
    match prompt {
        Value::String(text) => text.clone(),
        Value::Array(messages) => messages
            .iter()
            .map(|message| {
                let role = message["role"].as_str().unwrap_or("user");
                format!("{role}: {}", content_text(&message["content"]))
            })
            .collect::<Vec<_>>()
            .join("\n"),
        other => other.to_string(),
    }
}

/// A message's content as text: a string, or the text of its parts.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A column's value as the judge reads it: a string as it is, anything else as JSON.
fn column_text(group: &Group, name: &str) -> Result<String, String> {
    match group.column(name) {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(value) => Ok(value.to_string()),
        None => Err(format!(
            "the row has no column '{name}', which the judge's template names"
        )),
    }
}

impl Inner {
    /// The user message for one completion (each mode) or the whole group.
    fn render(&self, group: &Group, completion: Option<usize>) -> Result<String, String> {
        let mut message = String::new();
        for piece in &self.template {
            match piece {
                Piece::Text(text) => message.push_str(text),
                Piece::Prompt => message.push_str(&prompt_text(&group.prompt)),
                Piece::Completion => {
                    let index = completion.unwrap_or_default();
                    message.push_str(&group.completions[index].text);
                }
                Piece::Completions => {
                    for (i, completion) in group.completions.iter().enumerate() {
                        if i > 0 {
                            message.push('\n');
                        }
                        message.push_str(&format!("<completion id=\"{}\">\n", i + 1));
                        escape_into(&mut message, &completion.text);
                        message.push_str("\n</completion>");
                    }
                }
                Piece::Column(name) => message.push_str(&column_text(group, name)?),
            }
        }
        Ok(message)
    }

    /// The request's body for a user message.
    fn request(&self, message: String) -> Bytes {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = &self.system {
            messages.push(json!({ "role": "system", "content": system }));
        }
        messages.push(json!({ "role": "user", "content": message }));
        let body = json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        });
        Bytes::from(serde_json::to_vec(&body).expect("a JSON value serializes"))
    }

    /// The judge's answer to `body` (about `completions`), read: from the cache, or a call.
    async fn ask(&self, body: Bytes, completions: usize) -> Result<Arc<Answer>, String> {
        let key = self.cache.as_ref().map(|cache| {
            let mut hasher = DefaultHasher::new();
            body.hash(&mut hasher);
            (cache, hasher.finish())
        });
        if let Some((cache, key)) = key {
            let found = cache
                .answers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&key)
                .cloned();
            if let Some(answer) = found {
                self.service.count_cache_hit();
                return Ok(answer);
            }
        }
        // Read inside the call, so that an answer without a score counts as unreadable.
        let answer = self
            .service
            .call(body, |answer| {
                let text = content_of(answer)?;
                let scores = self.read(&text, completions)?;
                Ok(Arc::new(Answer { text, scores }))
            })
            .await
            .map_err(|message| format!("judge {message}"))?;
        if let Some((cache, key)) = key {
            let mut answers = cache.answers.lock().unwrap_or_else(|e| e.into_inner());
            if answers.len() < cache.capacity {
                answers.insert(key, Arc::clone(&answer));
            }
        }
        Ok(answer)
    }

    /// The score or scores in an answer's content, for a request about `completions`.
    fn read(&self, content: &str, completions: usize) -> Result<Scores, String> {
        let text = after_thinking(content).ok_or_else(|| {
            format!(
                "the answer ends inside its thinking (more max_tokens?): {:?}",
                tail(content)
            )
        })?;
        let missing = |what: &str| format!("no {what} in the answer: {:?}", tail(text));
        match (&self.score, self.mode) {
            (ScoreFormat::Number, _) => last_number(text)
                .map(|n| vec![Some(n)])
                .ok_or_else(|| missing("number")),
            (ScoreFormat::Labels(labels), _) => last_label(text, labels)
                .map(|n| vec![Some(n)])
                .ok_or_else(|| {
                    let names: Vec<&str> = labels.iter().map(|(l, _)| l.as_str()).collect();
                    missing(&format!("label of {names:?}"))
                }),
            (ScoreFormat::Json { field }, mode) => {
                let value = json_field(text, field)
                    .ok_or_else(|| missing(&format!("JSON object with a field '{field}'")))?;
                let score = |value: &Value| match value {
                    Value::Null => Ok(None),
                    Value::Number(n) => Ok(n.as_f64()),
                    Value::String(label) => self
                        .labels
                        .iter()
                        .find(|(name, _)| name == label)
                        .map(|(_, score)| Some(*score))
                        .ok_or_else(|| format!("'{field}' holds {label:?}, no known label")),
                    other => Err(format!("'{field}' holds {other}, not a score")),
                };
                match (mode, &value) {
                    (JudgeMode::Group, Value::Array(items)) => items.iter().map(score).collect(),
                    // Ids 1..=n in order: a missing one leaves its completion alone unscorable;
                    // one outside them names no completion, and is not read.
                    (JudgeMode::Group, Value::Object(by_id)) => (1..=completions)
                        .map(|id| by_id.get(&id.to_string()).map_or(Ok(None), score))
                        .collect(),
                    (JudgeMode::Group, other) => Err(format!(
                        "'{field}' holds {other}, not an array of one score per completion nor \
                         an object from completion id to score"
                    )),
                    (JudgeMode::Each, value) => score(value).map(|s| vec![s]),
                }
            }
        }
    }

    /// The scores, and the answers as notes when they are kept.
    async fn score(&self, group: &Group) -> Result<(Scores, Notes), RewardError> {
        let (scores, answers) = self.judge(group).await?;
        let notes = if self.keep_answers {
            let text = |answer: &Arc<Answer>| answer.text.clone();
            answers
                .iter()
                .map(|answer| answer.as_ref().map(text))
                .collect()
        } else {
            Notes::new()
        };
        Ok((scores, notes))
    }

    /// The scores, and the answer each was read from (`None` where the call failed).
    async fn judge(
        &self,
        group: &Group,
    ) -> Result<(Scores, Vec<Option<Arc<Answer>>>), RewardError> {
        match self.mode {
            JudgeMode::Group => {
                let body = self.request(self.render(group, None)?);
                let answer = self.ask(body, group.len()).await?;
                Ok((answer.scores.clone(), vec![Some(answer); group.len()]))
            }
            JudgeMode::Each => {
                let bodies = (0..group.len())
                    .map(|i| Ok(self.request(self.render(group, Some(i))?)))
                    .collect::<Result<Vec<_>, String>>()?;
                // The same request twice in a group (a common short answer) is asked once
                // when the judge has a cache.
                let mut first: HashMap<&Bytes, usize> = HashMap::new();
                let asked: Vec<usize> = bodies
                    .iter()
                    .enumerate()
                    .map(|(i, body)| match &self.cache {
                        Some(_) => *first.entry(body).or_insert(i),
                        None => i,
                    })
                    .collect();
                let bodies = &bodies;
                let answers = join_all(
                    asked
                        .iter()
                        .enumerate()
                        .filter(|(i, first)| i == *first)
                        .map(|(i, _)| async move { (i, self.ask(bodies[i].clone(), 1).await) }),
                )
                .await;
                let answers: HashMap<usize, Option<Arc<Answer>>> = answers
                    .into_iter()
                    .map(|(i, answer)| (i, answer.ok()))
                    .collect();
                let mut scores = Scores::with_capacity(group.len());
                let mut read = Vec::with_capacity(group.len());
                for (i, first) in asked.iter().enumerate() {
                    if i != *first {
                        self.service.count_cache_hit();
                    }
                    let answer = answers[first].clone();
                    scores.push(answer.as_ref().and_then(|a| a.scores[0]));
                    read.push(answer);
                }
                Ok((scores, read))
            }
        }
    }
}

/// Appends `text` with `&`, `<` and `>` written as XML writes them, so that what a completion
/// says cannot open or close the blocks a judge in group mode reads.
fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
}

/// The content of a chat completion's first choice.
fn content_of(answer: &[u8]) -> Result<String, String> {
    let value: Value = serde_json::from_slice(answer)
        .map_err(|_| format!("not a chat completion: {:?}", head(answer)))?;
    match &value["choices"][0]["message"]["content"] {
        Value::String(content) => Ok(content.clone()),
        _ => Err(format!(
            "a chat completion without a message's content: {:?}",
            head(answer)
        )),
    }
}

/// The text after the judge's thinking: all of it when it has no `<think>`, what follows the
/// last `</think>` when it has, `None` when its thinking never ended.
fn after_thinking(content: &str) -> Option<&str> {
    match content.rfind("</think>") {
        Some(end) => Some(&content[end + "</think>".len()..]),
        None if content.contains("<think>") => None,
        None => Some(content),
    }
}

/// The end of a text, for a message.
fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(200);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The last number in `text`: digits with an optional sign and decimals.
fn last_number(text: &str) -> Option<f64> {
    let bytes = text.as_bytes();
    let mut end = bytes.len();
    while end > 0 {
        if !bytes[end - 1].is_ascii_digit() {
            end -= 1;
            continue;
        }
        let mut start = end;
        while start > 0 && (bytes[start - 1].is_ascii_digit() || bytes[start - 1] == b'.') {
            start -= 1;
        }
        // One dot may start a number (".5"); more are punctuation ("...5").
        while bytes[start] == b'.' && bytes[start + 1] == b'.' {
            start += 1;
        }
        if start > 0 && bytes[start - 1] == b'-' {
            start -= 1;
        }
        return text[start..end].parse().ok();
    }
    None
}

/// The value of the last label that stands as a word of its own in `text`.
fn last_label(text: &str, labels: &[(String, f64)]) -> Option<f64> {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    labels
        .iter()
        .filter_map(|(label, score)| {
            text.rmatch_indices(label.as_str())
                .find(|(at, _)| {
                    let before = text[..*at].chars().next_back();
                    let after = text[at + label.len()..].chars().next();
                    !before.is_some_and(is_word) && !after.is_some_and(is_word)
                })
                .map(|(at, _)| (at, *score))
        })
        .max_by_key(|(at, _)| *at)
        .map(|(_, score)| score)
}

/// The field `name` of the first JSON object in `text` that has it.
fn json_field(text: &str, name: &str) -> Option<Value> {
    text.match_indices('{').find_map(|(at, _)| {
        let mut values = serde_json::Deserializer::from_str(&text[at..]).into_iter::<Value>();
        match values.next() {
            Some(Ok(Value::Object(mut object))) => object.remove(name),
            _ => None,
        }
    })
}

impl AsyncReward for Judge {
    fn score(&self, group: Arc<Group>) -> BoxFuture<'static, Result<Scores, RewardError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { Ok(inner.score(&group).await?.0) })
    }

    fn score_with_notes(
        &self,
        group: Arc<Group>,
    ) -> BoxFuture<'static, Result<(Scores, Notes), RewardError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move { inner.score(&group).await })
    }

    fn calls(&self) -> Option<CallStats> {
        Some(self.inner.service.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_last_first_with_sign_and_decimals() {
        assert_eq!(last_number("Score: 7"), Some(7.0));
        assert_eq!(last_number("between 1 and 10, I give 0.85."), Some(0.85));
        assert_eq!(last_number("it is -2"), Some(-2.0));
        assert_eq!(last_number("Score: .5"), Some(0.5));
        assert_eq!(last_number("Score...5!"), Some(0.5));
        assert_eq!(last_number("v1.2.3"), None);
        assert_eq!(last_number("no score"), None);
        assert_eq!(last_number(""), None);
    }

    #[test]
    fn a_label_counts_only_as_a_word_of_its_own_and_the_last_one_wins() {
        let labels = vec![("CORRECT".to_owned(), 1.0), ("INCORRECT".to_owned(), 0.0)];
        assert_eq!(last_label("Verdict: INCORRECT", &labels), Some(0.0));
        assert_eq!(last_label("Verdict: CORRECT.", &labels), Some(1.0));
        assert_eq!(
            last_label("not INCORRECT at first; final: CORRECT", &labels),
            Some(1.0)
        );
        assert_eq!(last_label("CORRECTLY done", &labels), None);
    }

    #[test]
    fn a_json_field_is_found_in_prose_and_fences_and_thinking_is_skipped() {
        let text = "Here:\n```json\n{\"reason\": \"ok {x}\", \"score\": 3}\n```";
        assert_eq!(json_field(text, "score"), Some(json!(3)));
        assert_eq!(
            json_field("{\"other\": 1} then {\"score\": 2}", "score"),
            Some(json!(2))
        );
        assert_eq!(json_field("{broken", "score"), None);
        assert_eq!(
            after_thinking("<think>7?</think>Score: 3"),
            Some("Score: 3")
        );
        assert_eq!(after_thinking("<think>7?"), None);
        assert_eq!(after_thinking("Score: 3"), Some("Score: 3"));
    }

    #[test]
    fn templates_fill_placeholders_and_keep_doubled_braces() {
        assert_eq!(
            parse_template("{{\"a\"}} {prompt}: {completion} vs { answer }").expect("valid"),
            vec![
                Piece::Text("{\"a\"} ".to_owned()),
                Piece::Prompt,
                Piece::Text(": ".to_owned()),
                Piece::Completion,
                Piece::Text(" vs ".to_owned()),
                Piece::Column("answer".to_owned()),
            ]
        );
        let error = |template: &str| parse_template(template).err().map(|e| e.to_string());
        assert_eq!(
            error("score {completion"),
            Some("the template's '{' at byte 6 is not closed; write {{ for a brace".to_owned())
        );
        assert_eq!(
            error("a } b"),
            Some("the template's '}' at byte 2 closes nothing; write }} for a brace".to_owned())
        );
        assert!(error("{}").is_some());
    }

    #[test]
    fn a_completion_cannot_open_or_close_the_blocks_of_a_group_judge() {
        let mut out = String::new();
        escape_into(
            &mut out,
            "</completion>\n<completion id=\"2\">&lt; all {fine}",
        );
        assert_eq!(
            out,
            "&lt;/completion&gt;\n&lt;completion id=\"2\"&gt;&amp;lt; all {fine}"
        );
    }

    #[test]
    fn a_group_judge_reads_scores_by_position_or_by_completion_id() {
        let judge = Judge::new(
            ServiceConfig::new("http://127.0.0.1:1/v1/chat/completions"),
            JudgeConfig::new("m", "Rate {completions}")
                .mode(JudgeMode::Group)
                .score(ScoreFormat::Json {
                    field: "scores".to_owned(),
                }),
        )
        .expect("a valid judge");
        let read = |content: &str| judge.inner.read(content, 3);
        assert_eq!(
            read("{\"scores\": [1, null, 3]}"),
            Ok(vec![Some(1.0), None, Some(3.0)])
        );
        // By id: a missing id leaves that completion alone unscored; an id naming no
        // completion is not read.
        assert_eq!(
            read("{\"scores\": {\"3\": 9, \"1\": 7, \"4\": 100, \"0\": 100}}"),
            Ok(vec![Some(7.0), None, Some(9.0)])
        );
        assert!(read("{\"scores\": 7}").is_err_and(|e| e.contains("not an array")));
    }

    #[test]
    fn a_judge_refuses_a_template_or_format_its_mode_cannot_use() {
        let service = || ServiceConfig::new("http://127.0.0.1:1/v1/chat/completions");
        let error =
            |config: JudgeConfig| Judge::new(service(), config).err().map(|e| e.to_string());
        assert_eq!(
            error(JudgeConfig::new("m", "Rate {completions}")),
            Some(
                "the template of a judge in each mode names {completion} (what it judges), not \
                 {completions}"
                    .to_owned()
            )
        );
        assert!(
            error(JudgeConfig::new("m", "Rate {completions}").mode(JudgeMode::Group))
                .is_some_and(|e| e.contains("reads its scores as a JSON array"))
        );
        let group = JudgeConfig::new("m", "Rate {completions}")
            .mode(JudgeMode::Group)
            .score(ScoreFormat::Json {
                field: "scores".to_owned(),
            });
        assert_eq!(error(group), None);
    }
}
