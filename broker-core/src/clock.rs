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

/// `delay` from now, in unix milliseconds.
pub fn after_ms(delay: Duration) -> i64 {
    now_ms().saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
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
