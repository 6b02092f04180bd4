//! The host's clock, in unix milliseconds: lease tables read the host's clock (SPEC section 4),
//! and so do due times, so every comparison uses one clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Unix milliseconds of `at` (0 before the epoch).
pub fn to_ms(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Now, in unix milliseconds.
pub fn now_ms() -> i64 {
    to_ms(SystemTime::now())
}

/// The latest due time the broker writes: 9999-12-31 23:59:59.999 UTC, the last instant every
/// backend's time column holds (MySQL's DATETIME ends there; PostgreSQL's TIMESTAMPTZ and SQLite's
/// integers go further). A longer delay means "not for a very long time", not an error.
pub const MAX_DUE_MS: i64 = 253_402_300_799_999;

/// `delay` from now, in unix milliseconds, at most [`MAX_DUE_MS`].
pub fn after_ms(delay: Duration) -> i64 {
    due_ms(now_ms(), delay)
}

/// `delay` after `now_ms`, at most [`MAX_DUE_MS`]: `Duration::MAX` is far, not out of range.
pub fn due_ms(now_ms: i64, delay: Duration) -> i64 {
    now_ms
        .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
        .min(MAX_DUE_MS.max(now_ms))
}

/// A lease expiry: `lease_seconds` after now, rounded up to a whole second, so a time column
/// without fractions stores it exactly and tokens compare equal on every database.
pub fn lease_expiry_ms(now_ms: i64, lease_seconds: u32) -> i64 {
    let whole = now_ms.div_euclid(1000) + 1;
    (whole + i64::from(lease_seconds)) * 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expiry_is_a_whole_second_at_least_the_lease_away() {
        for now in [0, 1, 999, 1000, 1_700_000_000_123] {
            let e = lease_expiry_ms(now, 2);
            assert_eq!(e % 1000, 0);
            assert!(e - now > 2000 && e - now <= 3000, "{now} -> {e}");
        }
    }
}
