//! Golden values, computed by hand (the arithmetic is in each test), for every estimator and
//! knob, including the cases where frameworks disagree.

use std::f64::consts::FRAC_1_SQRT_2;

use async_grpo_scoring::{
    AdvantageConfig, CompletionReward, EpsPlacement, Estimator, GroupKind, MAX_REWARD, StdKind,
    batch_advantages, group_advantages, in_range,
};

use crate::assert_close;

fn scored(rewards: &[f64]) -> Vec<CompletionReward> {
    rewards
        .iter()
        .map(|r| CompletionReward::scored(*r))
        .collect()
}

fn preset(name: &str) -> AdvantageConfig {
    AdvantageConfig::preset(name).expect("a preset")
}

#[test]
fn a_zero_one_pair_gives_plus_minus_one_with_the_population_std() {
    // mean 0.5; population variance ((0.5)^2 + (0.5)^2) / 2 = 0.25, std 0.5;
    // (1 - 0.5) / (0.5 + 1e-8) = 0.99999998.
    let result = group_advantages(&scored(&[0.0, 1.0]), &preset("trl"));
    assert_close(&result.advantages, &[-1.0, 1.0], 1e-6);
    assert_eq!((result.kind, result.baseline_size), (GroupKind::Normal, 2));
    assert_close(&[result.mean, result.std], &[0.5, 0.5], 1e-12);
}

#[test]
fn the_same_pair_gives_plus_minus_0_7071_with_the_unbiased_std() {
    // unbiased variance 0.5 / (2 - 1) = 0.5, std 0.70710678; 0.5 / 0.70710678 = 0.70710678,
    // that is 1 / sqrt(2).
    let config = AdvantageConfig {
        std: StdKind::Unbiased,
        ..preset("trl")
    };
    let result = group_advantages(&scored(&[0.0, 1.0]), &config);
    assert_close(&result.advantages, &[-FRAC_1_SQRT_2, FRAC_1_SQRT_2], 1e-6);
}

#[test]
fn a_singleton_gets_zero() {
    for name in async_grpo_scoring::PRESETS {
        let result = group_advantages(&scored(&[3.0]), &preset(name));
        assert_eq!(
            (result.advantages.as_slice(), result.kind),
            (&[0.0][..], GroupKind::Singleton),
            "{name}"
        );
    }
}

#[test]
fn the_trl_preset_is_the_population_std_formula() {
    // {1, 2, 3, 6}: mean 3; deviations -2, -1, 0, 3; squares sum 14;
    // population variance 14 / 4 = 3.5, std 1.870828693; (r - 3) / (1.870828693 + 1e-8).
    let result = group_advantages(&scored(&[1.0, 2.0, 3.0, 6.0]), &preset("trl"));
    assert_close(
        &result.advantages,
        &[-1.069_044_97, -0.534_522_48, 0.0, 1.603_567_45],
        1e-6,
    );
}

#[test]
fn the_grpo_preset_uses_the_unbiased_std() {
    // unbiased variance 14 / 3 = 4.666667, std 2.160246899; (r - 3) / (2.160246899 + 1e-6).
    let result = group_advantages(&scored(&[1.0, 2.0, 3.0, 6.0]), &preset("grpo"));
    assert_close(
        &result.advantages,
        &[-0.925_820_10, -0.462_910_05, 0.0, 1.388_730_15],
        1e-6,
    );
}

#[test]
fn dr_grpo_only_subtracts_the_mean() {
    let result = group_advantages(&scored(&[1.0, 2.0, 3.0, 6.0]), &preset("dr_grpo"));
    assert_close(&result.advantages, &[-2.0, -1.0, 0.0, 3.0], 1e-12);
}

#[test]
fn rloo_subtracts_the_mean_of_the_others() {
    // r = 1: others (2 + 3 + 6) / 3 = 11/3, 1 - 11/3 = -8/3; r = 2: others 10/3, -4/3;
    // r = 3: others 3, 0; r = 6: others 2, 4.
    let result = group_advantages(&scored(&[1.0, 2.0, 3.0, 6.0]), &preset("rloo"));
    assert_close(
        &result.advantages,
        &[-8.0 / 3.0, -4.0 / 3.0, 0.0, 4.0],
        1e-12,
    );
}

#[test]
fn eps_placement_and_value_change_the_scale() {
    // {0, 1}: population std 0.5, variance 0.25.
    // AddToStd, eps 0.5: 0.5 / (0.5 + 0.5) = 0.5.
    let add = AdvantageConfig {
        eps: 0.5,
        ..preset("trl")
    };
    assert_close(
        &group_advantages(&scored(&[0.0, 1.0]), &add).advantages,
        &[-0.5, 0.5],
        1e-12,
    );
    // InsideSqrt, eps 0.25: 0.5 / sqrt(0.25 + 0.25) = 0.70710678.
    let inside = AdvantageConfig {
        eps: 0.25,
        eps_placement: EpsPlacement::InsideSqrt,
        ..preset("trl")
    };
    assert_close(
        &group_advantages(&scored(&[0.0, 1.0]), &inside).advantages,
        &[-FRAC_1_SQRT_2, FRAC_1_SQRT_2],
        1e-6,
    );
}

#[test]
fn clipping_bounds_every_advantage() {
    // Dr. GRPO on {1, 2, 3, 6} gives -2, -1, 0, 3; clipped to [-1.5, 1.5].
    let config = AdvantageConfig {
        clip: Some(1.5),
        ..preset("dr_grpo")
    };
    let result = group_advantages(&scored(&[1.0, 2.0, 3.0, 6.0]), &config);
    assert_close(&result.advantages, &[-1.5, -1.0, 0.0, 1.5], 1e-12);
}

#[test]
fn unscorable_completions_get_zero_and_stay_out_of_the_baseline() {
    // Baseline {0, 1} as in the pair test; counting the None as 0 would give mean 1/3.
    let group = [
        CompletionReward::scored(0.0),
        CompletionReward::unscorable(),
        CompletionReward::scored(1.0),
    ];
    let result = group_advantages(&group, &preset("trl"));
    assert_close(&result.advantages, &[-1.0, 0.0, 1.0], 1e-6);
    assert_eq!(result.baseline_size, 2);
}

#[test]
fn a_completion_without_a_training_row_never_enters_its_siblings_baseline() {
    // The empty-trace case: its reward 1.0 would move the mean to 2/3 if it counted.
    let group = [
        CompletionReward::scored(0.0),
        CompletionReward::scored(1.0),
        CompletionReward {
            reward: Some(1.0),
            has_training_row: false,
        },
    ];
    let result = group_advantages(&group, &preset("trl"));
    assert_close(&result.advantages, &[-1.0, 1.0, 0.0], 1e-6);
    assert_close(&[result.mean], &[0.5], 1e-12);
}

#[test]
fn zero_variance_groups_get_zero_and_are_dropped_only_when_asked() {
    let kept = group_advantages(&scored(&[2.0, 2.0, 2.0]), &preset("trl"));
    assert_eq!(
        (kept.advantages, kept.kind, kept.dropped),
        (vec![0.0; 3], GroupKind::ZeroVariance, false)
    );
    let filter = AdvantageConfig {
        drop_zero_variance: true,
        ..preset("trl")
    };
    let dropped = group_advantages(&scored(&[2.0, 2.0, 2.0]), &filter);
    assert!(dropped.dropped);
    assert!(!group_advantages(&scored(&[2.0, 3.0]), &filter).dropped);
}

#[test]
fn a_non_finite_reward_is_an_error_of_its_own_not_a_poisoned_group() {
    let result = group_advantages(
        &scored(&[f64::NAN, 0.0, 1.0, f64::INFINITY]),
        &preset("trl"),
    );
    assert_close(&result.advantages, &[0.0, -1.0, 1.0, 0.0], 1e-6);
    assert_eq!((result.non_finite, result.baseline_size), (2, 2));
}

#[test]
fn a_reward_beyond_the_bound_stays_out_as_a_nan_does_and_its_siblings_stay_finite() {
    // 1e308 and -1e308 would overflow the sum (and their squares the std) to infinity and
    // give every sibling a NaN advantage; beyond MAX_REWARD they are left out.
    let result = group_advantages(
        &scored(&[1e308, 0.0, 1.0, -1e308, MAX_REWARD * 2.0, MAX_REWARD]),
        &preset("trl"),
    );
    assert_eq!((result.non_finite, result.baseline_size), (3, 3));
    assert!(
        result.advantages.iter().all(|a| a.is_finite()),
        "{result:?}"
    );
    assert_eq!(result.kind, GroupKind::Normal);
    assert_eq!(result.advantages[0], 0.0);
    assert!(in_range(MAX_REWARD) && !in_range(-MAX_REWARD * 2.0) && !in_range(f64::NAN));
}

#[test]
fn an_advantage_that_comes_out_infinite_drops_its_group_never_reaching_a_row() {
    // With eps = 0 two rewards apart by the smallest subnormal have a std that underflows
    // to 0: (5e-324 - 0) / 0 is infinite, (0 - 0) / 0 NaN.
    let config = AdvantageConfig {
        eps: 0.0,
        ..preset("trl")
    };
    let result = group_advantages(&scored(&[0.0, 5e-324]), &config);
    assert_eq!(result.kind, GroupKind::NonFinite);
    assert!(result.dropped);
    assert_eq!(result.advantages, vec![0.0, 0.0]);
    // The default eps keeps the same group finite and normal.
    let result = group_advantages(&scored(&[0.0, 5e-324]), &preset("trl"));
    assert_eq!((result.kind, result.dropped), (GroupKind::Normal, false));
}

#[test]
fn empty_groups_have_nothing_to_compare() {
    let result = group_advantages(&[], &preset("trl"));
    assert_eq!(
        (result.advantages.len(), result.kind),
        (0, GroupKind::Empty)
    );
    let all_unscorable = group_advantages(&[CompletionReward::unscorable(); 3], &preset("trl"));
    assert_eq!(
        (all_unscorable.advantages, all_unscorable.kind),
        (vec![0.0; 3], GroupKind::Empty)
    );
}

#[test]
fn batch_std_centres_on_each_group_and_scales_by_the_batch() {
    // Batch rewards {0, 1, 2, 4}: mean 1.75; squares 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75;
    // population variance 2.1875, std 1.479019946.
    // Group {0, 1}: mean 0.5, +-0.5 / 1.479019946 = +-0.338061702.
    // Group {2, 4}: mean 3, +-1 / 1.479019946 = +-0.676123404.
    let groups = vec![scored(&[0.0, 1.0]), scored(&[2.0, 4.0])];
    let results = batch_advantages(&groups, &preset("batch"));
    assert_close(&results[0].advantages, &[-0.338_061_70, 0.338_061_70], 1e-6);
    assert_close(&results[1].advantages, &[-0.676_123_40, 0.676_123_40], 1e-6);

    // Any other estimator treats each group alone.
    let alone = batch_advantages(&groups, &preset("trl"));
    assert_close(&alone[1].advantages, &[-1.0, 1.0], 1e-6);
}

#[test]
fn presets_are_named_and_unknown_names_are_refused() {
    assert_eq!(preset("rloo").estimator, Estimator::Rloo);
    assert_eq!(AdvantageConfig::default(), preset("trl"));
    assert!(AdvantageConfig::preset("ppo").is_none());
}

#[test]
fn bad_clip_and_eps_values_are_refused_by_validate_and_never_panic() {
    let negative = AdvantageConfig {
        clip: Some(-1.0),
        ..preset("trl")
    };
    assert_eq!(
        negative.validate().map_err(|e| e.to_string()),
        Err("clip must be a finite number >= 0, got -1".to_owned())
    );
    // Ignored rather than a panic in `f64::clamp`.
    let result = group_advantages(&scored(&[0.0, 1.0]), &negative);
    assert_close(&result.advantages, &[-1.0, 1.0], 1e-6);
    let nan = AdvantageConfig {
        clip: Some(f64::NAN),
        ..preset("trl")
    };
    assert!(nan.validate().is_err());
    assert_eq!(
        group_advantages(&scored(&[0.0, 1.0]), &nan)
            .advantages
            .len(),
        2
    );
    let eps = AdvantageConfig {
        eps: -1e-8,
        ..preset("trl")
    };
    assert_eq!(
        eps.validate().map_err(|e| e.to_string()),
        Err("eps must be a finite number >= 0, got -0.00000001".to_owned())
    );
    assert_eq!(preset("trl").validate(), Ok(()));
}

#[test]
fn batch_std_reports_the_std_it_divided_by() {
    // The batch {0, 1, 2, 4} of the test above: population std 1.479019946.
    let results = batch_advantages(
        &[scored(&[0.0, 1.0]), scored(&[2.0, 4.0])],
        &preset("batch"),
    );
    assert_close(
        &[results[0].std, results[1].std],
        &[1.479_019_95, 1.479_019_95],
        1e-6,
    );
}

/// Three completions with step rewards, discounted by 0.5 per turn:
/// - c0: steps [1, -], outcome 1: returns t1 = 1, t0 = 1 + 0.5 * 1 = 1.5;
/// - c1: steps [-], outcome 0: returns [0];
/// - c2: steps [0.5, -0.5, -], outcome 1: t2 = 1, t1 = -0.5 + 0.5 * 1 = 0,
///   t0 = 0.5 + 0.5 * 0 = 0.5.
fn three_with_steps() -> Vec<Vec<f64>> {
    let gamma = 0.5;
    let returns = vec![
        async_grpo_scoring::turn_returns(&[Some(1.0), None], 1.0, gamma),
        async_grpo_scoring::turn_returns(&[None], 0.0, gamma),
        async_grpo_scoring::turn_returns(&[Some(0.5), Some(-0.5), None], 1.0, gamma),
    ];
    assert_close(&returns[0], &[1.5, 1.0], 1e-12);
    assert_close(&returns[1], &[0.0], 1e-12);
    assert_close(&returns[2], &[0.5, 0.0, 1.0], 1e-12);
    returns
}

/// Each completion's turn advantages, the group estimated over the episode returns.
fn per_turn(returns: &[Vec<f64>], config: &AdvantageConfig) -> Vec<Vec<f64>> {
    let episodes: Vec<CompletionReward> = returns
        .iter()
        .map(|r| CompletionReward::scored(r[0]))
        .collect();
    let group = group_advantages(&episodes, config);
    returns
        .iter()
        .zip(&episodes)
        .map(|(r, c)| async_grpo_scoring::turn_advantages(r, c, &group, config))
        .collect()
}

#[test]
fn turn_advantages_with_grpo_share_the_episode_returns_mean_and_std() {
    // Episode returns {1.5, 0, 0.5}: mean 2/3; deviations 5/6, -2/3, -1/6; population
    // variance (25/36 + 16/36 + 1/36) / 3 = 7/18, so 1 / std = sqrt(18/7) = 1.6035675.
    // c0: t0 (5/6) * 1.6035675 = 1.3363062, t1 (1 - 2/3) * 1.6035675 = 0.5345225;
    // c1: (-2/3) * 1.6035675 = -1.0690450;
    // c2: t0 (-1/6) * 1.6035675 = -0.2672612, t1 (0 - 2/3) = -1.0690450, t2 (1/3) = 0.5345225.
    let advantages = per_turn(&three_with_steps(), &preset("trl"));
    assert_close(&advantages[0], &[1.3363062, 0.5345225], 1e-6);
    assert_close(&advantages[1], &[-1.0690450], 1e-6);
    assert_close(&advantages[2], &[-0.2672612, -1.0690450, 0.5345225], 1e-6);
}

#[test]
fn turn_advantages_with_rloo_leave_the_completion_s_own_episode_out_of_its_baseline() {
    // c0's baseline: the mean of the others' episode returns (0 + 0.5) / 2 = 0.25:
    //   t0 1.5 - 0.25 = 1.25, t1 1 - 0.25 = 0.75;
    // c1's: (1.5 + 0.5) / 2 = 1: 0 - 1 = -1;
    // c2's: (1.5 + 0) / 2 = 0.75: t0 -0.25, t1 -0.75, t2 0.25.
    let advantages = per_turn(&three_with_steps(), &preset("rloo"));
    assert_close(&advantages[0], &[1.25, 0.75], 1e-12);
    assert_close(&advantages[1], &[-1.0], 1e-12);
    assert_close(&advantages[2], &[-0.25, -0.75, 0.25], 1e-12);
}

#[test]
fn without_step_rewards_and_discount_every_turn_gets_the_episode_s_advantage() {
    let config = preset("trl");
    let outcomes = [1.0, 0.0, 1.0, 3.0];
    let turns = [3, 1, 2, 4];
    let returns: Vec<Vec<f64>> = outcomes
        .iter()
        .zip(turns)
        .map(|(outcome, turns)| async_grpo_scoring::turn_returns(&vec![None; turns], *outcome, 1.0))
        .collect();
    let episode = group_advantages(&scored(&outcomes), &config).advantages;
    for (completion, advantages) in per_turn(&returns, &config).iter().enumerate() {
        assert_eq!(advantages.len(), turns[completion]);
        assert_close(
            advantages,
            &vec![episode[completion]; turns[completion]],
            1e-12,
        );
    }
}

#[test]
fn turn_advantages_are_zero_outside_the_baseline_and_in_a_group_without_spread() {
    let config = preset("trl");
    let returns = [vec![1.0, 0.5], vec![0.0]];
    let unscorable = CompletionReward::unscorable();
    let group = group_advantages(&[CompletionReward::scored(1.0), unscorable], &config);
    assert_eq!(
        async_grpo_scoring::turn_advantages(&returns[1], &unscorable, &group, &config),
        vec![0.0]
    );
    // Equal episode returns, different turn returns: the group carries no signal.
    let equal = [CompletionReward::scored(1.0), CompletionReward::scored(1.0)];
    let group = group_advantages(&equal, &config);
    assert_eq!(group.kind, GroupKind::ZeroVariance);
    assert_eq!(
        async_grpo_scoring::turn_advantages(&returns[0], &equal[0], &group, &config),
        vec![0.0, 0.0]
    );
}

#[test]
fn a_gamma_outside_zero_to_one_is_refused() {
    for gamma in [-0.1, 1.5, f64::NAN] {
        let config = AdvantageConfig {
            credit: async_grpo_scoring::Credit::Turn { gamma },
            ..preset("trl")
        };
        assert!(config.validate().is_err(), "{gamma}");
    }
    let config = AdvantageConfig {
        credit: async_grpo_scoring::Credit::Turn { gamma: 0.9 },
        ..preset("trl")
    };
    assert_eq!(config.validate(), Ok(()));
}
