//! A model's tokenizer, from its folder or its parts in memory: the `tokenizers` tokenizer,
//! its chat templates, special tokens.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use super::{ChatTemplate, IncrementalRender, RenderError, RenderOptions};
use crate::Message;
use crate::render::Cause;

/// The special tokens transformers passes to templates (`special_tokens_map`), when set.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The tokenizer of [`ChatTokenizer::from_parts`] as its errors name it, in place of a file.
const IN_MEMORY_TOKENIZER: &str = "tokenizer.json (in memory)";
/// The config of [`ChatTokenizer::from_parts`] as its errors and template names name it.
const IN_MEMORY_CONFIG: &str = "tokenizer_config (in memory)";

/// A rendered conversation: the text and its token ids.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Rendered {
    /// The text the template produced.
    pub text: String,
    /// Its ids (no special token added: the template writes them).
    pub ids: Vec<u32>,
}

/// A tokenizer with its chat templates, loaded as a Hugging Face folder, built from the
/// folder's parts in memory, or assembled. A clone shares nothing with the original and costs
/// a copy of the vocabulary, far less than loading the folder again.
#[derive(Debug, Clone)]
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    /// `(name, template)`: `default`, `tool_use`, ... as transformers names them.
    templates: Vec<(String, ChatTemplate)>,
    special_tokens: Map<String, Value>,
    special_ids: HashSet<u32>,
}

/// A special token of a text: encoding a text that starts with the same bytes up to the end
/// of this token gives the same ids before it (added tokens split the input before any
/// normalization or merging), so only the text from the token on needs encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Anchor {
    /// Byte offset where the special token starts.
    pub(crate) byte: usize,
    /// Byte offset where it ends.
    pub(crate) end: usize,
    /// Its index in the ids.
    pub(crate) index: usize,
}

impl ChatTokenizer {
    /// Loads a Hugging Face tokenizer folder: `tokenizer.json` (required),
    /// `tokenizer_config.json` (special tokens; the chat template as a string or as a list of
    /// named templates), `chat_template.jinja` and `additional_chat_templates/*.jinja`
    /// (which take precedence, as in transformers).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, RenderError> {
        let dir = dir.as_ref();
        let tokenizer = read_tokenizer(dir)?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_config(&config_path)?;
        let special_tokens = special_tokens_of(&config);
        let jinja = dir.join("chat_template.jinja");
        let templates = if jinja.is_file() {
            templates_from_files(dir, &jinja)?
        } else {
            templates_from_config(&config, &config_path)?
        };
        Ok(Self::assemble(tokenizer, templates, special_tokens))
    }

    /// Builds a tokenizer from what a folder's files would hold, given in memory (a
    /// tokenizer as transformers holds it, its chat template edited or not):
    /// `tokenizer_json`, the text of a `tokenizer.json`; `config`, an object read as
    /// `tokenizer_config.json` is: the special tokens (`bos_token`, `eos_token`, ... as
    /// strings or as added tokens with a `content`) and `chat_template`, a string or a list
    /// of `{"name": .., "template": ..}`. Truncation and padding set in `tokenizer_json` are
    /// dropped: `apply_chat_template` encodes without them.
    ///
    /// Errors are [`RenderError::Load`] whose path names the part at fault
    /// (`tokenizer.json (in memory)`, `tokenizer_config (in memory)`), or a template's
    /// [`RenderError::Template`].
    pub fn from_parts(
        tokenizer_json: &str,
        config: &Map<String, Value>,
    ) -> Result<Self, RenderError> {
        let not_a_tokenizer = |error| RenderError::Load {
            path: PathBuf::from(IN_MEMORY_TOKENIZER),
            message: "not a tokenizers tokenizer.json".into(),
            cause: Some(Cause::new(error)),
        };
        let mut tokenizer = tokenizer_json
            .parse::<Tokenizer>()
            .map_err(not_a_tokenizer)?;
        // transformers' apply_chat_template encodes with neither, whatever an earlier call
        // with truncation= or padding= left set on a tokenizer in memory.
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(not_a_tokenizer)?;
        let templates = templates_from_config(config, Path::new(IN_MEMORY_CONFIG))?;
        Ok(Self::assemble(
            tokenizer,
            templates,
            special_tokens_of(config),
        ))
    }

    /// A tokenizer with one template and the given special tokens (`bos_token`, ...).
    pub fn new(
        tokenizer: Tokenizer,
        template: ChatTemplate,
        special_tokens: Map<String, Value>,
    ) -> Self {
        Self::assemble(
            tokenizer,
            vec![("default".to_owned(), template)],
            special_tokens,
        )
    }

    fn assemble(
        tokenizer: Tokenizer,
        templates: Vec<(String, ChatTemplate)>,
        special_tokens: Map<String, Value>,
    ) -> Self {
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Self {
            tokenizer,
            templates,
            special_tokens,
            special_ids,
        }
    }

    /// Replaces the templates with the one in `path` (a `.jinja` file, or a JSON file with
    /// a `chat_template` string as some repositories ship).
    pub fn with_template_file(mut self, path: impl AsRef<Path>) -> Result<Self, RenderError> {
        let path = path.as_ref();
        let text = read(path)?;
        let source = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| {
                    v.get("chat_template")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                })
                .ok_or_else(|| {
                    load_error(
                        path,
                        "expected a JSON object with a \"chat_template\" string",
                    )
                })?
        } else {
            text
        };
        self.templates = vec![(
            "default".to_owned(),
            ChatTemplate::new(display(path), source)?,
        )];
        Ok(self)
    }

    /// Makes every template's `strftime_now` read a fixed time (see
    /// [`ChatTemplate::freeze_clock`]).
    #[must_use]
    pub fn with_frozen_clock(mut self, unix_seconds: i64) -> Self {
        for (_, template) in &mut self.templates {
            template.freeze_clock(unix_seconds);
        }
        self
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The special tokens given to templates (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &Map<String, Value> {
        &self.special_tokens
    }

    /// The id of the beginning-of-sequence token, when the tokenizer names one (templates
    /// write it; it is never added a second time).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special_tokens
            .get("bos_token")
            .and_then(Value::as_str)
            .and_then(|token| self.tokenizer.token_to_id(token))
    }

    /// The id of the end-of-sequence token, when the tokenizer names one.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_tokens
            .get("eos_token")
            .and_then(Value::as_str)
            .and_then(|token| self.tokenizer.token_to_id(token))
    }

    /// The template names this tokenizer has.
    pub fn template_names(&self) -> Vec<&str> {
        self.templates
            .iter()
            .map(|(name, _)| name.as_str())
            .collect()
    }

    /// The template transformers would use for these options: the one named by
    /// `options.chat_template`, else `tool_use` when tools are given and it exists, else
    /// `default`, else the only one.
    pub fn template(&self, options: &RenderOptions) -> Result<&ChatTemplate, RenderError> {
        let (name, with_tools) = (options.chat_template.as_deref(), options.tools.is_some());
        let find = |wanted: &str| {
            self.templates
                .iter()
                .find(|(n, _)| n == wanted)
                .map(|(_, t)| t)
        };
        let found = match name {
            Some(name) => find(name),
            None if self.templates.len() == 1 => self.templates.first().map(|(_, t)| t),
            None if with_tools => find("tool_use").or_else(|| find("default")),
            None => find("default"),
        };
        found.ok_or_else(|| {
            if self.templates.is_empty() {
                RenderError::UnknownTemplate {
                    name: name.unwrap_or("default").to_owned(),
                    available: "none (the tokenizer has no chat template; give a template file)"
                        .into(),
                }
            } else {
                RenderError::UnknownTemplate {
                    name: name.unwrap_or("default").to_owned(),
                    available: self.template_names().join(", "),
                }
            }
        })
    }

    /// Renders the conversation to text, as `apply_chat_template(..., tokenize=False)`.
    pub fn render(
        &self,
        messages: &[Message],
        options: &RenderOptions,
    ) -> Result<String, RenderError> {
        self.template(options)?
            .render(messages, options, &self.special_tokens)
    }

    /// Renders and tokenizes, as `apply_chat_template(..., tokenize=True)`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        options: &RenderOptions,
    ) -> Result<Rendered, RenderError> {
        let text = self.render(messages, options)?;
        let ids = self.encode(&text)?;
        Ok(Rendered { text, ids })
    }

    /// The ids of `text`, special tokens matched but none added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RenderError> {
        self.tokenizer
            .encode(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(RenderError::tokenize)
    }

    /// Ids of `text` and where each of its special tokens is, in order.
    pub(crate) fn encode_anchored(
        &self,
        text: &str,
    ) -> Result<(Vec<u32>, Vec<Anchor>), RenderError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(RenderError::tokenize)?;
        let ids = encoding.get_ids();
        let offsets = encoding.get_offsets();
        let anchors = ids
            .iter()
            .enumerate()
            .filter(|(_, id)| self.special_ids.contains(id))
            .map(|(index, _)| {
                let (byte, end) = offsets[index];
                Anchor { byte, end, index }
            })
            .collect();
        Ok((ids.to_vec(), anchors))
    }

    /// The text of `id` when it is a special token (one that splits the input before anything
    /// else, as the tokens templates write are).
    pub(crate) fn special_token(&self, id: u32) -> Option<String> {
        self.special_ids
            .contains(&id)
            .then(|| self.tokenizer.id_to_token(id))
            .flatten()
    }

    /// The text of sampled ids as a tool-call parser reads it: special tokens kept (tool-call
    /// markers are often special), a final end-of-answer token left out.
    pub fn decode_answer(&self, ids: &[u32]) -> Result<String, RenderError> {
        let ids = match (ids.split_last(), self.eos_token_id()) {
            (Some((last, rest)), Some(eos)) if *last == eos => rest,
            _ => ids,
        };
        self.tokenizer
            .decode(ids, false)
            .map_err(RenderError::tokenize)
    }

    /// A conversation rendered incrementally with this tokenizer's template.
    pub fn incremental(
        &self,
        options: RenderOptions,
    ) -> Result<IncrementalRender<'_>, RenderError> {
        let template = self.template(&options)?;
        Ok(IncrementalRender::new(self, template, options))
    }
}

/// The folder's `tokenizer.json`, which it must have.
fn read_tokenizer(dir: &Path) -> Result<Tokenizer, RenderError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(RenderError::Load {
            path: dir.to_owned(),
            message: "expected a Hugging Face tokenizer folder holding tokenizer.json".into(),
            cause: None,
        });
    }
    Tokenizer::from_file(&path).map_err(|error| RenderError::Load {
        path,
        message: "not a tokenizers tokenizer.json".into(),
        cause: Some(Cause::new(error)),
    })
}

/// The JSON object in `tokenizer_config.json`; empty when the folder has no such file.
fn read_config(path: &Path) -> Result<Map<String, Value>, RenderError> {
    if !path.is_file() {
        return Ok(Map::new());
    }
    let text = read(path)?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(config)) => Ok(config),
        Ok(_) => Err(load_error(path, "expected a JSON object")),
        Err(error) => Err(RenderError::Load {
            path: path.to_owned(),
            message: "invalid JSON".into(),
            cause: Some(Cause::new(error)),
        }),
    }
}

/// The special tokens the config sets, each as a string or as an added token's `content`.
fn special_tokens_of(config: &Map<String, Value>) -> Map<String, Value> {
    let mut special_tokens = Map::new();
    for key in SPECIAL_TOKEN_KEYS {
        let content = match config.get(key) {
            Some(Value::String(token)) => Some(token.clone()),
            Some(Value::Object(token)) => token
                .get("content")
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        };
        if let Some(content) = content {
            special_tokens.insert(key.to_owned(), Value::from(content));
        }
    }
    special_tokens
}

/// The templates of the folder's files: `chat_template.jinja` (`jinja`) as `default`, then
/// each `additional_chat_templates/NAME.jinja` as `NAME`, in file-name order.
fn templates_from_files(
    dir: &Path,
    jinja: &Path,
) -> Result<Vec<(String, ChatTemplate)>, RenderError> {
    let mut templates = vec![(
        "default".to_owned(),
        ChatTemplate::new(display(jinja), read(jinja)?)?,
    )];
    let extra = dir.join("additional_chat_templates");
    if let Ok(entries) = std::fs::read_dir(&extra) {
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        {
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            templates.push((name, ChatTemplate::new(display(&path), read(&path)?)?));
        }
    }
    Ok(templates)
}

/// The templates of the config's `chat_template`: one string (`default`), a list of named
/// templates, or none at all; `config_path` names the config in template names and errors.
fn templates_from_config(
    config: &Map<String, Value>,
    config_path: &Path,
) -> Result<Vec<(String, ChatTemplate)>, RenderError> {
    let mut templates = Vec::new();
    match config.get("chat_template") {
        Some(Value::String(source)) => templates.push((
            "default".to_owned(),
            ChatTemplate::new(
                format!("{}#chat_template", display(config_path)),
                source.clone(),
            )?,
        )),
        Some(Value::Array(list)) => {
            for entry in list {
                let (Some(name), Some(source)) = (
                    entry.get("name").and_then(Value::as_str),
                    entry.get("template").and_then(Value::as_str),
                ) else {
                    return Err(load_error(
                        config_path,
                        "expected chat_template entries as {\"name\": .., \"template\": ..}",
                    ));
                };
                templates.push((
                    name.to_owned(),
                    ChatTemplate::new(format!("{}#{name}", display(config_path)), source)?,
                ));
            }
        }
        Some(_) => {
            return Err(load_error(
                config_path,
                "expected chat_template to be a string or a list of named templates",
            ));
        }
        None => {}
    }
    Ok(templates)
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

fn read(path: &Path) -> Result<String, RenderError> {
    std::fs::read_to_string(path).map_err(|error| RenderError::Load {
        path: path.to_owned(),
        message: "cannot read it".into(),
        cause: Some(Cause::new(error)),
    })
}

fn load_error(path: &Path, message: &str) -> RenderError {
    RenderError::Load {
        path: path.to_owned(),
        message: message.to_owned(),
        cause: None,
    }
}
