//! The `env` column: the reward an environment gave each rollout's episode.

use std::sync::Arc;

use crate::{group::Group, reward::Reward};

/// The name of the column [`environment`] scores.
pub const ENVIRONMENT_COLUMN: &str = "env";

/// A reward column named `env` that scores each completion with its
/// [`rollout_reward`](crate::Completion::rollout_reward): what the rollout's environment
/// verified. A completion whose episode could not be verified scores `None` (unscorable, out
/// of the baseline for this column). Weight it like any other with [`Reward::weight`].
pub fn environment() -> Reward {
    Reward::new_async(ENVIRONMENT_COLUMN, |group: Arc<Group>| async move {
        Ok(group
            .completions
            .iter()
            .map(|completion| completion.rollout_reward)
            .collect())
    })
}

#[cfg(all(test, feature = "scorer"))]
mod tests {
    use super::*;
    use crate::{Completion, Scorer, ScorerConfig};

    #[tokio::test]
    async fn the_environment_column_is_each_rollouts_reward_and_none_stays_unscorable() {
        let mut verified = Completion::from_text("a");
        verified.rollout_reward = Some(0.75);
        let unverified = Completion::from_text("b");
        let scorer = Scorer::new(vec![environment().weight(2.0)], ScorerConfig::default())
            .expect("one column");
        let group = Arc::new(Group::new(
            "p",
            vec![verified, unverified],
            Default::default(),
        ));
        let scores = scorer.score(group).await;
        assert_eq!(scores.columns[0].name, "env");
        assert_eq!(scores.columns[0].values, vec![Some(0.75), None]);
        assert_eq!(scores.rewards, vec![Some(1.5), None]);
    }
}
