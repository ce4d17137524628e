//! `exact:COLUMN`: the answer equals a dataset column, after normalisation.

use crate::{
    builtin::column_text,
    group::Group,
    reward::{RewardError, Scores, SyncReward},
};

/// How both sides are normalised before comparing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Normalization {
    /// Remove leading and trailing whitespace (default on).
    pub trim: bool,
    /// Turn every run of whitespace into one space (default on).
    pub collapse_whitespace: bool,
    /// Compare without regard to case (default off).
    pub case_insensitive: bool,
    /// Remove trailing `.`, `!`, `?` and quotes (default off).
    pub strip_trailing_punctuation: bool,
}

impl Default for Normalization {
    fn default() -> Normalization {
        Normalization {
            trim: true,
            collapse_whitespace: true,
            case_insensitive: false,
            strip_trailing_punctuation: false,
        }
    }
}

impl Normalization {
    /// Applies the normalisation.
    pub fn apply(&self, text: &str) -> String {
        let mut text = if self.collapse_whitespace {
            text.split_whitespace().collect::<Vec<_>>().join(" ")
        } else if self.trim {
            text.trim().to_owned()
        } else {
            text.to_owned()
        };
        if self.strip_trailing_punctuation {
            let kept = text.trim_end_matches(['.', '!', '?', '"', '\'']).len();
            text.truncate(kept);
            if self.trim {
                text = text.trim_end().to_owned();
            }
        }
        if self.case_insensitive {
            text = text.to_lowercase();
        }
        text
    }
}

/// 1.0 when a completion's answer equals the dataset column `column`, else 0.0; `None` for
/// every completion when the row has no such column (or it holds an array or object).
#[derive(Debug, Clone)]
pub struct ExactMatch {
    column: String,
    normalization: Normalization,
}

impl ExactMatch {
    /// Compares with `column` under the default normalisation.
    pub fn new(column: impl Into<String>) -> ExactMatch {
        ExactMatch {
            column: column.into(),
            normalization: Normalization::default(),
        }
    }

    /// Sets the normalisation.
    pub fn normalization(mut self, normalization: Normalization) -> ExactMatch {
        self.normalization = normalization;
        self
    }
}

impl SyncReward for ExactMatch {
    fn score(&self, group: &Group) -> Result<Scores, RewardError> {
        let Some(expected) = column_text(group, &self.column) else {
            return Ok(vec![None; group.len()]);
        };
        let expected = self.normalization.apply(&expected);
        Ok(group
            .completions
            .iter()
            .map(|c| {
                Some(if self.normalization.apply(&c.text) == expected {
                    1.0
                } else {
                    0.0
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::group::Completion;

    fn group(answers: &[&str], row: serde_json::Value) -> Group {
        let row = row.as_object().cloned().unwrap_or_default();
        Group::new(
            "q",
            answers.iter().map(|a| Completion::from_text(*a)).collect(),
            row,
        )
    }

    #[test]
    fn default_normalisation_ignores_surrounding_and_repeated_whitespace_only() {
        let g = group(
            &["  Paris ", "paris", "Paris\n\n"],
            json!({ "answer": "Paris" }),
        );
        assert_eq!(
            ExactMatch::new("answer").score(&g).ok(),
            Some(vec![Some(1.0), Some(0.0), Some(1.0)])
        );
    }

    #[test]
    fn options_fold_case_and_trailing_punctuation() {
        let g = group(&["PARIS.", "Paris!", "Lyon"], json!({ "answer": "paris" }));
        let loose = Normalization {
            case_insensitive: true,
            strip_trailing_punctuation: true,
            ..Normalization::default()
        };
        let scores = ExactMatch::new("answer")
            .normalization(loose)
            .score(&g)
            .ok();
        assert_eq!(scores, Some(vec![Some(1.0), Some(1.0), Some(0.0)]));
    }

    #[test]
    fn numbers_in_the_column_compare_as_text_and_a_missing_column_is_unscorable() {
        let g = group(&["42", "42.0"], json!({ "answer": 42 }));
        assert_eq!(
            ExactMatch::new("answer").score(&g).ok(),
            Some(vec![Some(1.0), Some(0.0)])
        );
        assert_eq!(
            ExactMatch::new("solution").score(&g).ok(),
            Some(vec![None, None])
        );
    }
}
