//! Errors of the dispatcher itself. Tool failures are not errors: they are [`crate::Outcome`]s.

use std::fmt;

/// Why a tool could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The tool's name is empty.
    #[error("a tool needs a non-empty name")]
    EmptyName,
    /// Another tool already has this name.
    #[error("a tool named '{name}' is already registered")]
    Duplicate {
        /// The name registered twice.
        name: String,
    },
    /// The parameters are not a JSON object schema.
    #[error("tool '{name}' has an invalid parameters schema: {reason}")]
    InvalidSchema {
        /// The tool's name.
        name: String,
        /// What is wrong with the schema.
        reason: String,
    },
}

/// The dispatcher refused a turn. The only cause today is that it is shutting down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchError {
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Closed,
}

impl DispatchError {
    pub(crate) fn closed() -> DispatchError {
        DispatchError { kind: Kind::Closed }
    }

    /// Whether the dispatcher is shutting down or shut down.
    pub fn is_closed(&self) -> bool {
        self.kind == Kind::Closed
    }
}

impl fmt::Display for DispatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::Closed => {
                f.write_str("the tool dispatcher is shutting down and takes no new turns")
            }
        }
    }
}

impl std::error::Error for DispatchError {}
