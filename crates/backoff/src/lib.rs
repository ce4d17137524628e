//! [`Backoff`]: how long to pause before trying a failed call again, for every retry of the
//! project (vLLM requests, reward services and judges, environment sessions).
//!
//! The pause before retry `n` (0-based) is drawn uniformly from
//! `[0, min(max, base * 2^n)]`: exponential, so a service that is down is not hammered, and
//! with full jitter, so that the many rollouts a failure hit together do not come back
//! together. Which failures are retried, how often and until when stays with each caller,
//! which knows its errors.
//!
//! ```
//! use std::time::Duration;
//!
//! use async_grpo_backoff::Backoff;
//!
//! let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
//! assert!(backoff.delay(0) <= Duration::from_millis(100));
//! assert!(backoff.delay(3) <= Duration::from_millis(800));
//! assert!(backoff.delay(30) <= Duration::from_secs(5));
//! ```

use std::{
    hash::{BuildHasher, Hasher},
    time::Duration,
};

/// Exponential backoff with full jitter: see the [crate] documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The ceiling of the first pause; it doubles with each retry.
    pub base: Duration,
    /// The highest ceiling.
    pub max: Duration,
}

impl Backoff {
    /// Pauses below `base`, doubling up to `max`.
    pub const fn new(base: Duration, max: Duration) -> Backoff {
        Backoff { base, max }
    }

    /// The ceiling of the pause before retry `retry` (0-based): `min(max, base * 2^retry)`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        self.base
            .saturating_mul(2u32.saturating_pow(retry))
            .min(self.max)
    }

    /// The pause before retry `retry` (0-based): uniformly random in `[0, ceiling(retry)]`.
    pub fn delay(&self, retry: u32) -> Duration {
        self.ceiling(retry).mul_f64(unit())
    }
}

/// A uniform draw from `[0, 1)`. `RandomState` keys each hasher afresh (randomly per thread,
/// then stepped per call), which is random enough to spread retries and needs no dependency.
fn unit() -> f64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u8(0);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn the_ceiling_doubles_from_the_base_up_to_the_max() {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let ceilings: Vec<u64> = (0..6)
            .map(|retry| backoff.ceiling(retry).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 800, 800]);
        assert_eq!(backoff.ceiling(u32::MAX), Duration::from_millis(800));
    }

    #[test]
    fn delays_stay_under_their_ceiling_and_are_spread_below_it() {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        for retry in 0..40 {
            for _ in 0..50 {
                assert!(
                    backoff.delay(retry) <= backoff.ceiling(retry),
                    "retry {retry}"
                );
            }
        }
        let draws: Vec<Duration> = (0..400).map(|_| backoff.delay(5)).collect();
        // Full jitter: many distinct pauses, in both halves of [0, 800 ms].
        assert!(draws.iter().collect::<BTreeSet<_>>().len() > 300);
        let low = draws
            .iter()
            .filter(|d| **d < Duration::from_millis(400))
            .count();
        assert!(
            (100..=300).contains(&low),
            "{low} of 400 below half the ceiling"
        );
    }
}
