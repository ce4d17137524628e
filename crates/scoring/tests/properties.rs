//! Properties of the estimators over random groups.

use async_grpo_scoring::{AdvantageConfig, CompletionReward, Estimator, group_advantages};
use proptest::prelude::*;

fn config(estimator: Estimator) -> AdvantageConfig {
    AdvantageConfig {
        estimator,
        eps: 0.0,
        ..AdvantageConfig::default()
    }
}

fn advantages(rewards: &[f64], estimator: Estimator) -> Vec<f64> {
    let group: Vec<_> = rewards
        .iter()
        .map(|r| CompletionReward::scored(*r))
        .collect();
    group_advantages(&group, &config(estimator)).advantages
}

fn spread(rewards: &[f64]) -> f64 {
    let max = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = rewards.iter().copied().fold(f64::INFINITY, f64::min);
    max - min
}

fn rewards() -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-100.0f64..100.0, 2..16)
}

proptest! {
    #[test]
    fn advantages_sum_to_zero_when_every_completion_is_scorable(rewards in rewards()) {
        for estimator in [Estimator::Grpo, Estimator::DrGrpo, Estimator::Rloo] {
            let sum: f64 = advantages(&rewards, estimator).iter().sum();
            prop_assert!(sum.abs() < 1e-6 * rewards.len() as f64 * (1.0 + spread(&rewards)), "{estimator:?}: {sum}");
        }
    }

    #[test]
    fn adding_a_constant_to_every_reward_changes_nothing(rewards in rewards(), shift in -50.0f64..50.0) {
        let shifted: Vec<f64> = rewards.iter().map(|r| r + shift).collect();
        for estimator in [Estimator::Grpo, Estimator::DrGrpo, Estimator::Rloo] {
            let (before, after) = (advantages(&rewards, estimator), advantages(&shifted, estimator));
            for (b, a) in before.iter().zip(&after) {
                prop_assert!((b - a).abs() < 1e-6 * (1.0 + b.abs()), "{estimator:?}: {b} vs {a}");
            }
        }
    }

    #[test]
    fn with_the_std_scaling_rewards_changes_nothing_and_without_it_scales_advantages(
        rewards in rewards(),
        factor in 0.1f64..10.0,
    ) {
        prop_assume!(spread(&rewards) > 1e-3);
        let scaled: Vec<f64> = rewards.iter().map(|r| r * factor).collect();
        let (grpo, grpo_scaled) = (advantages(&rewards, Estimator::Grpo), advantages(&scaled, Estimator::Grpo));
        for (b, a) in grpo.iter().zip(&grpo_scaled) {
            prop_assert!((b - a).abs() < 1e-6 * (1.0 + b.abs()), "GRPO: {b} vs {a}");
        }
        let (dr, dr_scaled) = (advantages(&rewards, Estimator::DrGrpo), advantages(&scaled, Estimator::DrGrpo));
        for (b, a) in dr.iter().zip(&dr_scaled) {
            prop_assert!((b * factor - a).abs() < 1e-6 * (1.0 + a.abs()), "Dr. GRPO: {b} * {factor} vs {a}");
        }
    }
}
