//! `regex:PATTERN`: the answer matches a regular expression.

use regex::Regex;

use crate::{
    group::Group,
    reward::{RewardError, Scores, SyncReward},
};

/// 1.0 when the pattern matches anywhere in a completion's answer, else 0.0. Anchor the
/// pattern (`^...$`) to require a whole-answer match; `(?s)` lets `.` cross lines.
#[derive(Debug, Clone)]
pub struct RegexMatch {
    regex: Regex,
}

impl RegexMatch {
    /// Compiles `pattern` (Rust `regex` syntax).
    pub fn new(pattern: &str) -> Result<RegexMatch, regex::Error> {
        Ok(RegexMatch {
            regex: Regex::new(pattern)?,
        })
    }
}

impl SyncReward for RegexMatch {
    fn score(&self, group: &Group) -> Result<Scores, RewardError> {
        Ok(group
            .completions
            .iter()
            .map(|c| {
                Some(if self.regex.is_match(&c.text) {
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
    use super::*;
    use crate::group::Completion;

    #[test]
    fn a_format_reward_checks_the_answer_shape() {
        let format =
            RegexMatch::new(r"(?s)^<think>.*</think>\s*<answer>.*</answer>$").expect("valid");
        let group = Group::new(
            "q",
            vec![
                Completion::from_text("<think>2+2</think>\n<answer>4</answer>"),
                Completion::from_text("<answer>4</answer>"),
            ],
            Default::default(),
        );
        assert_eq!(format.score(&group).ok(), Some(vec![Some(1.0), Some(0.0)]));
    }
}
