//! [`RetryPolicy`]: which failures are tried again, how often, how long apart, until when.

use std::time::Duration;

use backoff::Backoff;

/// Retries transport errors and 5xx with exponential backoff and full jitter, bounded by a
/// number of attempts *and* a deadline; a 4xx is returned at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1).
    pub max_attempts: u32,
    /// The backoff before the second attempt; it doubles each time.
    pub base_backoff: Duration,
    /// The longest backoff.
    pub max_backoff: Duration,
    /// The time one call may take, retries included.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    /// 6 attempts, 100 ms doubling to at most 5 s, within 10 minutes (long generations).
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 6,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            deadline: Duration::from_secs(600),
        }
    }
}

impl RetryPolicy {
    /// No retries at all.
    pub fn never() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        }
    }

    /// The pause after failed attempt `attempt` (0-based): uniformly random in
    /// `[0, min(max_backoff, base_backoff * 2^attempt)]` ("full jitter"), so that many
    /// rollouts failing together do not retry together.
    pub fn backoff(&self, attempt: u32) -> Duration {
        Backoff::new(self.base_backoff, self.max_backoff).delay(attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_and_never_exceeds_its_cap() {
        let policy = RetryPolicy {
            max_attempts: 10,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(800),
            deadline: Duration::from_secs(60),
        };
        for attempt in 0..40 {
            let ceiling = Duration::from_millis(100 * (1u64 << attempt.min(3)));
            for _ in 0..50 {
                assert!(policy.backoff(attempt) <= ceiling, "attempt {attempt}");
            }
        }
        // Jitter: 200 draws under a 800 ms ceiling are not all the same.
        let draws: std::collections::BTreeSet<Duration> =
            (0..200).map(|_| policy.backoff(5)).collect();
        assert!(draws.len() > 100);
    }
}
