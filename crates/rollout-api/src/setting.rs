//! [`ConfigError`]: a setting that cannot work, named by its key.

/// A setting that cannot work: which one (its field name, which is also its settings-file
/// key) and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{setting} {problem}")]
pub struct ConfigError {
    /// The setting's name.
    pub setting: &'static str,
    /// What is wrong with its value, a phrase that follows the name.
    pub problem: String,
}

impl ConfigError {
    /// `setting` cannot work: `problem` says why, as a phrase that follows its name.
    pub fn new(setting: &'static str, problem: impl Into<String>) -> ConfigError {
        ConfigError {
            setting,
            problem: problem.into(),
        }
    }
}
