//! How long the claim loop waits when it has nothing to claim: after a drained claim (the
//! adaptive poll, from the cooldown up to the poll interval) and after failed claims (the claim
//! backoff), and how each such wait is spread. Pure functions of durations, so tests need no
//! clock.

use std::time::Duration;

/// The longest wait between failing claims.
pub(super) const CLAIM_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The wait after `failures` claims failed in a row: the poll interval doubled per failure, at
/// most [`CLAIM_BACKOFF_MAX`] (or the poll interval, if that is longer). A wake-up from a
/// publish or settlement still cuts it short (those need a working database).
pub(super) fn claim_backoff(poll: Duration, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(20);
    poll.saturating_mul(1u32 << doublings)
        .min(CLAIM_BACKOFF_MAX.max(poll))
}

/// How long a drained subscription waits before it looks again when nothing wakes it: the time
/// since a claim last found rows (`since_found`), at least the poll cooldown and at most the
/// poll interval. A table that rows keep arriving in is so claimed from every cooldown (rows
/// inserted without a wake-up wait about that long), and each look that finds nothing about
/// doubles the wait, so a subscription whose table stays empty is back at the poll interval
/// within a few looks. A subscription whose claims never found rows waits the poll interval.
pub(super) fn drained_wait(
    poll_interval: Duration,
    poll_cooldown: Duration,
    since_found: Option<Duration>,
) -> Duration {
    let Some(since) = since_found else {
        return poll_interval;
    };
    since.max(poll_cooldown).min(poll_interval)
}

/// How far either way a wait for the next look is spread: a tenth.
pub(super) const SPREAD: f64 = 0.1;

/// `wait` spread by up to [`SPREAD`] of it either way, by `unit` (a number in `0.0..1.0`, drawn
/// at random per wait: 0 gives the shortest wait, 0.5 the wait itself). Subscriptions started
/// together (or drained together) would otherwise look at the same moments forever and take
/// connections out of a shared pool in bursts; spread, they drift apart, and an idle one still
/// looks once per poll interval on average. A wait that the spread would take past
/// `Duration::MAX` (a poll interval of `Duration::MAX` is valid) is `Duration::MAX`.
pub(super) fn spread(wait: Duration, unit: f64) -> Duration {
    let unit = unit.clamp(0.0, 1.0);
    Duration::try_from_secs_f64(wait.as_secs_f64() * (1.0 - SPREAD + 2.0 * SPREAD * unit))
        .unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLL: Duration = Duration::from_secs(1);
    const COOLDOWN: Duration = Duration::from_millis(25);

    #[test]
    fn failed_claims_back_off_from_the_poll_interval_doubling_per_failure() {
        let waits: Vec<u64> = (1..=7).map(|n| claim_backoff(POLL, n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn the_claim_backoff_stops_at_thirty_seconds() {
        assert_eq!(claim_backoff(POLL, u32::MAX), CLAIM_BACKOFF_MAX);
        assert_eq!(
            claim_backoff(Duration::from_millis(50), 100),
            CLAIM_BACKOFF_MAX
        );
    }

    #[test]
    fn a_poll_interval_beyond_thirty_seconds_is_the_claim_backoff_cap() {
        let poll = Duration::from_secs(60);
        assert_eq!(claim_backoff(poll, 1), poll);
        assert_eq!(claim_backoff(poll, 5), poll);
    }

    #[test]
    fn a_subscription_that_never_found_rows_waits_the_poll_interval() {
        assert_eq!(drained_wait(POLL, COOLDOWN, None), POLL);
    }

    #[test]
    fn a_drained_wait_grows_with_the_time_since_a_claim_found_rows() {
        let wait = |ms| drained_wait(POLL, COOLDOWN, Some(Duration::from_millis(ms)));
        assert_eq!(
            wait(0),
            COOLDOWN,
            "right after rows were found: the cooldown"
        );
        assert_eq!(wait(300), Duration::from_millis(300));
        assert_eq!(wait(5_000), POLL, "never longer than the poll interval");
    }

    #[test]
    fn a_wait_is_spread_by_a_tenth_either_way() {
        assert_eq!(spread(POLL, 0.0), Duration::from_millis(900));
        assert_eq!(spread(POLL, 0.5), POLL);
        assert_eq!(spread(POLL, 0.75), Duration::from_millis(1_050));
        assert!(spread(POLL, 0.999_999) < Duration::from_millis(1_100));
        assert_eq!(
            spread(POLL, 7.0),
            Duration::from_millis(1_100),
            "a unit out of range is clamped"
        );
        assert_eq!(spread(Duration::ZERO, 0.3), Duration::ZERO);
    }

    #[test]
    fn a_wait_near_duration_max_spreads_without_overflowing() {
        // `poll_interval(Duration::MAX)` is a valid option: the claim loop spreads that wait
        // each time it goes idle, and half the draws lengthen it.
        assert_eq!(spread(Duration::MAX, 1.0), Duration::MAX);
        assert_eq!(spread(Duration::MAX, 0.5), Duration::MAX);
        let short = spread(Duration::MAX, 0.0);
        assert!(
            short < Duration::MAX && short > Duration::MAX / 10 * 8,
            "{short:?}"
        );
    }
}
