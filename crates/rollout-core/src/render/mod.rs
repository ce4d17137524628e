//! Chat-template rendering and tokenization, identical to transformers' `apply_chat_template`.
//!
//! - [`ChatTemplate`]: one Jinja template compiled with minijinja, configured as
//!   transformers' sandbox is (see its docs for every detail reproduced).
//! - [`ChatTokenizer`]: a model's tokenizer folder as users have it (`tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`): its templates, special tokens, and
//!   the `tokenizers` crate for ids (never adding special tokens: the template holds them).
//! - [`IncrementalRender`]: a conversation whose token buffer grows with the suffix that
//!   new messages add; history rewritten by the template is detected and re-rendered whole,
//!   counted.
//! - [`IncrementalRender::delta`] (append mode, token-in/token-out): the ids the template
//!   writes after an assistant turn up to the next generation, derived from the template, so
//!   that a prompt can be the previous prompt + the sampled ids + these; [`NoExactDelta`]
//!   says why a turn has none.

mod append;
mod incremental;
mod pyjson;
mod template;
mod tokenizer;

use std::path::PathBuf;

use serde_json::{Map, Value};

pub use self::{
    append::NoExactDelta,
    incremental::{IncrementalRender, IncrementalStats, Prompt, RenderState},
    template::ChatTemplate,
    tokenizer::{ChatTokenizer, Rendered},
};

/// What to render besides the messages (the arguments of `apply_chat_template`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// Append the header that starts the assistant's answer.
    pub add_generation_prompt: bool,
    /// End the text inside the final message, for the model to continue it (transformers'
    /// `continue_final_message`; incompatible with `add_generation_prompt`).
    pub continue_final_message: bool,
    /// Tool JSON schemas (`tools`), `None` when no tools are offered.
    pub tools: Option<Vec<Value>>,
    /// Documents for RAG templates (`documents`).
    pub documents: Option<Vec<Value>>,
    /// Extra template variables (`enable_thinking`, `date_string`, ...); they override the
    /// special tokens of the same name, as in transformers.
    pub kwargs: Map<String, Value>,
    /// Which of the tokenizer's named templates to use (`tool_use`, ...); `None` chooses as
    /// transformers does.
    pub chat_template: Option<String>,
}

impl RenderOptions {
    /// Options that end with the generation prompt.
    pub fn generation() -> Self {
        Self {
            add_generation_prompt: true,
            ..Self::default()
        }
    }

    /// Sets `tools`.
    #[must_use]
    pub fn with_tools(mut self, tools: Vec<Value>) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Adds one template variable.
    #[must_use]
    pub fn with_kwarg(mut self, key: &str, value: Value) -> Self {
        self.kwargs.insert(key.to_owned(), value);
        self
    }
}

/// Loading, rendering or tokenizing failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RenderError {
    /// The template did not compile, or failed while rendering (an undefined value, an
    /// operation on the wrong type: Jinja2's own errors, or Python's, in transformers).
    #[error("chat template {template}{}: {message}", line.map(|l| format!(", line {l}")).unwrap_or_default())]
    Template {
        /// The template's name (its file, or its name in `tokenizer_config.json`).
        template: String,
        /// The template line, when known.
        line: Option<usize>,
        /// What went wrong.
        message: String,
    },
    /// The template refused the conversation by calling `raise_exception` (transformers'
    /// `TemplateError`): `message` is the template's own.
    #[error("chat template {template}{}: {message}", line.map(|l| format!(", line {l}")).unwrap_or_default())]
    Raised {
        /// The template's name.
        template: String,
        /// The template line, when known.
        line: Option<usize>,
        /// What the template raised.
        message: String,
    },
    /// `continue_final_message` cannot be honoured.
    #[error("chat template {template}: continue_final_message: {reason}")]
    ContinueFinalMessage {
        /// The template's name.
        template: String,
        /// Why.
        reason: String,
    },
    /// A tokenizer or template file could not be read or understood.
    #[error("{}: {message}", path.display())]
    Load {
        /// The file or folder.
        path: PathBuf,
        /// What was expected, or what could not be done.
        message: String,
        /// The error behind it (reading the file, parsing its JSON, loading the tokenizer).
        #[source]
        cause: Option<Cause>,
    },
    /// The tokenizer failed on the text.
    #[error("the tokenizer failed")]
    Tokenize {
        /// The tokenizer's error.
        #[source]
        cause: Cause,
    },
    /// No template has the requested name.
    #[error("no chat template named {name:?}; available: {available}")]
    UnknownTemplate {
        /// The name asked for.
        name: String,
        /// The names there are.
        available: String,
    },
}

/// The error behind a [`RenderError`], shared so that the error stays cheap to clone; two
/// are equal when they say the same.
#[derive(Debug, Clone)]
pub struct Cause(std::sync::Arc<dyn std::error::Error + Send + Sync>);

impl Cause {
    pub(crate) fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Cause {
        Cause(std::sync::Arc::from(error.into()))
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Cause) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Cause {}

/// The source of a `raise_exception` call's error, which tells it from the engine's own.
#[derive(Debug)]
pub(crate) struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

impl RenderError {
    /// The tokenizer's failure on a text.
    pub(crate) fn tokenize(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        RenderError::Tokenize {
            cause: Cause::new(error),
        }
    }

    /// This error and its causes, each after a colon: what a message to a person says.
    pub fn chain(&self) -> String {
        let mut text = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }

    pub(crate) fn from_minijinja(template: &str, error: &minijinja::Error) -> Self {
        let raised = std::error::Error::source(error).is_some_and(|source| source.is::<Raised>());
        if raised {
            return Self::Raised {
                template: template.to_owned(),
                line: error.line(),
                message: error.detail().unwrap_or_default().to_owned(),
            };
        }
        let message = match (error.kind(), error.detail()) {
            (minijinja::ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
            (kind, Some(detail)) => format!("{kind}: {detail}"),
            (kind, None) => kind.to_string(),
        };
        Self::Template {
            template: template.to_owned(),
            line: error.line(),
            message,
        }
    }
}
