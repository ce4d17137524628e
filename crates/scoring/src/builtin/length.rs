//! `length:MAX[:BUFFER]`: a soft penalty for answers that run into the token limit.

use crate::{
    group::Group,
    reward::{RewardError, Scores, SyncReward},
};

/// Why [`LengthPenalty::new`] refused its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LengthPenaltyError {
    /// `max_tokens` is 0.
    #[error("MAX must be at least 1 token")]
    NoTokens,
    /// The buffer is larger than `max_tokens`.
    #[error("BUFFER ({buffer}) cannot exceed MAX ({max_tokens})")]
    BufferTooLarge {
        /// The buffer given.
        buffer: usize,
        /// The limit given.
        max_tokens: usize,
    },
}

/// DAPO's soft overlong penalty on the completion's token count `L`: 0 while
/// `L <= max - buffer`, falling linearly to -1 at `L = max`, and -1 beyond. A completion whose
/// token ids are unknown (none recorded for a non-empty answer) scores `None`.
#[derive(Debug, Clone, Copy)]
pub struct LengthPenalty {
    max_tokens: usize,
    buffer: usize,
}

impl LengthPenalty {
    /// A penalty that starts `buffer` tokens before `max_tokens`.
    pub fn new(max_tokens: usize, buffer: usize) -> Result<LengthPenalty, LengthPenaltyError> {
        if max_tokens == 0 {
            return Err(LengthPenaltyError::NoTokens);
        }
        if buffer > max_tokens {
            return Err(LengthPenaltyError::BufferTooLarge { buffer, max_tokens });
        }
        Ok(LengthPenalty { max_tokens, buffer })
    }

    /// The penalty for a completion of `tokens` tokens.
    pub fn penalty(&self, tokens: usize) -> f64 {
        let free = self.max_tokens - self.buffer;
        if tokens <= free {
            0.0
        } else if tokens <= self.max_tokens {
            -((tokens - free) as f64) / self.buffer as f64
        } else {
            -1.0
        }
    }
}

impl SyncReward for LengthPenalty {
    fn score(&self, group: &Group) -> Result<Scores, RewardError> {
        Ok(group
            .completions
            .iter()
            .map(|c| {
                let unknown = c.token_ids.is_empty() && !c.text.is_empty();
                (!unknown).then(|| self.penalty(c.token_ids.len()))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Completion;

    #[test]
    fn the_penalty_is_zero_then_linear_then_minus_one() {
        // max 100, buffer 20: free up to 80 tokens; 90 tokens is halfway into the buffer.
        let penalty = LengthPenalty::new(100, 20).expect("valid");
        let values: Vec<f64> = [0, 80, 81, 90, 100, 101, 5000]
            .map(|n| penalty.penalty(n))
            .to_vec();
        assert_eq!(values, [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]);
        assert_eq!(
            LengthPenalty::new(10, 0).map(|p| (p.penalty(10), p.penalty(11))),
            Ok((0.0, -1.0))
        );
        assert_eq!(
            LengthPenalty::new(10, 11)
                .err()
                .map(|e| e.to_string())
                .as_deref(),
            Some("BUFFER (11) cannot exceed MAX (10)")
        );
    }

    #[test]
    fn completions_without_token_ids_are_unscorable() {
        let penalty = LengthPenalty::new(4, 2).expect("valid");
        let group = Group::new(
            "q",
            vec![
                Completion::from_text("abc").with_token_ids(vec![1, 2, 3]),
                Completion::from_text("abc"),
            ],
            Default::default(),
        );
        assert_eq!(penalty.score(&group).ok(), Some(vec![Some(-0.5), None]));
    }
}
