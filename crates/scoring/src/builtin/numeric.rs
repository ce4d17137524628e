//! `numeric:COLUMN`: the answer's number equals the column's, within a tolerance.

use std::sync::LazyLock;

use regex::Regex;

use crate::{
    group::Group,
    reward::{RewardError, Scores, SyncReward},
};

/// A number: with thousands separators (`1,234.5`), plain (`-12`, `3.5`) or a bare fraction
/// part (`.5`).
static NUMBER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
        .unwrap_or_else(|e| unreachable!("the number pattern is valid: {e}"))
});

static FRACTION: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$|^(-?[\d.]+)/([\d.]+)$")
        .unwrap_or_else(|e| unreachable!("the fraction pattern is valid: {e}"))
});

/// The number a completion answers with: the content of its last `\boxed{...}` if it has
/// one (a fraction `\frac{a}{b}` or `a/b` inside is evaluated), else the last number in the
/// text. Thousands separators are dropped. `None` when there is no number.
pub fn extract_number(text: &str) -> Option<f64> {
    match last_boxed(text) {
        Some(boxed) => parse_boxed(boxed),
        None => last_number(text),
    }
}

fn last_number(text: &str) -> Option<f64> {
    let found = NUMBER.find_iter(text).last()?;
    found.as_str().replace(',', "").parse().ok()
}

/// The content of the last `\boxed{...}`, braces balanced.
fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + offset]);
                }
            }
            _ => {}
        }
    }
    None
}

fn parse_boxed(boxed: &str) -> Option<f64> {
    let cleaned: String = boxed
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\%", "")
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '$')
        .collect();
    let cleaned = cleaned.trim_end_matches('.');
    if let Some(parts) = FRACTION.captures(cleaned) {
        let number = |i: usize| {
            parts
                .get(i)
                .and_then(|m| m.as_str().replace(',', "").parse::<f64>().ok())
        };
        let (sign, numerator, denominator) = if parts.get(2).is_some() {
            (
                if parts.get(1).is_some_and(|m| m.as_str() == "-") {
                    -1.0
                } else {
                    1.0
                },
                number(2)?,
                number(3)?,
            )
        } else {
            (1.0, number(4)?, number(5)?)
        };
        return (denominator != 0.0).then(|| sign * numerator / denominator);
    }
    last_number(cleaned)
}

/// 1.0 when a completion's number ([`extract_number`]) equals the column's within
/// `abs_tol + rel_tol * |expected|`, 0.0 when it differs or the completion has no number,
/// `None` when the row's column is missing or holds no number.
#[derive(Debug, Clone)]
pub struct NumericMatch {
    column: String,
    abs_tol: f64,
    rel_tol: f64,
}

impl NumericMatch {
    /// Compares with `column`; tolerances default to `1e-6` absolute and `1e-6` relative.
    pub fn new(column: impl Into<String>) -> NumericMatch {
        NumericMatch {
            column: column.into(),
            abs_tol: 1e-6,
            rel_tol: 1e-6,
        }
    }

    /// Sets the absolute and relative tolerances.
    pub fn tolerance(mut self, abs_tol: f64, rel_tol: f64) -> NumericMatch {
        self.abs_tol = abs_tol;
        self.rel_tol = rel_tol;
        self
    }
}

impl SyncReward for NumericMatch {
    fn score(&self, group: &Group) -> Result<Scores, RewardError> {
        let expected = match group.column(&self.column) {
            Some(serde_json::Value::Number(number)) => number.as_f64(),
            Some(serde_json::Value::String(text)) => extract_number(text),
            _ => None,
        };
        let Some(expected) = expected else {
            return Ok(vec![None; group.len()]);
        };
        let tolerance = self.abs_tol + self.rel_tol * expected.abs();
        Ok(group
            .completions
            .iter()
            .map(|completion| {
                let close = extract_number(&completion.text)
                    .is_some_and(|got| (got - expected).abs() <= tolerance);
                Some(if close { 1.0 } else { 0.0 })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::group::Completion;

    #[test]
    fn the_last_boxed_value_wins_over_other_numbers() {
        assert_eq!(
            extract_number("2 + 3 = 5, so \\boxed{5}. Check: 10/2"),
            Some(5.0)
        );
        assert_eq!(
            extract_number("first \\boxed{1} then \\boxed{\\frac{3}{4}}"),
            Some(0.75)
        );
        assert_eq!(extract_number("\\boxed{-\\dfrac{1}{2}}"), Some(-0.5));
        assert_eq!(extract_number("\\boxed{7/2}"), Some(3.5));
        assert_eq!(extract_number("\\boxed{\\$1,234.50}"), Some(1234.5));
        assert_eq!(extract_number("\\boxed{{12}}"), Some(12.0));
    }

    #[test]
    fn without_a_box_the_last_number_counts() {
        assert_eq!(
            extract_number("She has 3 apples and buys 1,200 more: 1,203."),
            Some(1203.0)
        );
        assert_eq!(extract_number("The answer is -4.5"), Some(-4.5));
        assert_eq!(extract_number("items 1,2,3"), Some(3.0));
        assert_eq!(extract_number("no digits here"), None);
        assert_eq!(extract_number("\\boxed{x}"), None);
    }

    #[test]
    fn scores_compare_within_tolerance_and_missing_columns_are_unscorable() {
        let completions = ["#### 72", "I think 72.0000001", "\\boxed{71}", "nothing"]
            .into_iter()
            .map(Completion::from_text)
            .collect();
        let mut group = Group::new(
            "q",
            completions,
            json!({ "answer": "72" })
                .as_object()
                .cloned()
                .unwrap_or_default(),
        );
        let scores = NumericMatch::new("answer").score(&group).ok();
        assert_eq!(
            scores,
            Some(vec![Some(1.0), Some(1.0), Some(0.0), Some(0.0)])
        );

        group.row.insert("answer".into(), json!(71));
        let loose = NumericMatch::new("answer")
            .tolerance(1.5, 0.0)
            .score(&group)
            .ok();
        assert_eq!(
            loose,
            Some(vec![Some(1.0), Some(1.0), Some(1.0), Some(0.0)])
        );

        group.row.insert("answer".into(), json!("unknown"));
        assert_eq!(
            NumericMatch::new("answer").score(&group).ok(),
            Some(vec![None; 4])
        );
    }
}
