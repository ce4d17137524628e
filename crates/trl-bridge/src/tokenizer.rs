//! `processing_class` as the worker hands it over: a tokenizer folder, or a tokenizer's parts
//! as it is in memory (`async_grpo._tokenizer` decides which).

use std::path::PathBuf;

use pyo3::FromPyObject;
use rollout_core::ChatTokenizer;
use serde_json::{Map, Value};

/// The engine's tokenizer, as `Engine(tokenizer=...)` (the Python class) takes it.
#[derive(Debug, FromPyObject)]
pub(crate) enum TokenizerSource {
    /// A Hugging Face tokenizer folder (a `str` or a path), loaded as `ChatTokenizer::from_dir`.
    Folder(PathBuf),
    /// `(tokenizer_json, config_json)`: the text of the tokenizer's `tokenizer.json`, and a
    /// JSON object read as `tokenizer_config.json` is (its special tokens and chat template).
    Parts(String, String),
}

impl TokenizerSource {
    /// The tokenizer, or why it cannot be built (to be raised naming `processing_class`).
    pub(crate) fn load(&self) -> Result<ChatTokenizer, String> {
        match self {
            TokenizerSource::Folder(dir) => ChatTokenizer::from_dir(dir),
            TokenizerSource::Parts(tokenizer_json, config_json) => {
                let config =
                    serde_json::from_str::<Map<String, Value>>(config_json).map_err(|error| {
                        format!("the tokenizer's config is not a JSON object: {error}")
                    })?;
                ChatTokenizer::from_parts(tokenizer_json, &config)
            }
        }
        .map_err(|error| error.to_string())
    }
}
