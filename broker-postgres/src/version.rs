//! The PostgreSQL version floor: advisory keys and FIFO group guards hash with
//! `hashtextextended`, which PostgreSQL has from 11 (`SKIP LOCKED` came in 9.5).

use broker_core::SqlxBrokerError;

/// The first PostgreSQL with `hashtextextended`, as `server_version_num` spells it.
pub(crate) const FLOOR: u32 = 110_000;

/// The first PostgreSQL with `COMMIT AND CHAIN`: from it, a row lock settlement that keeps its
/// connection begins the next claim's transaction in its commit.
pub(crate) const CHAIN: u32 = 120_000;

/// Parses `server_version_num` ("150018", "90624").
pub(crate) fn parse_num(num: &str) -> Option<u32> {
    num.trim().parse().ok().filter(|n| *n >= 10_000)
}

/// Parses `SHOW server_version` ("15.18 (Debian 15.18-0+deb12u1)", "10.23", "17beta1",
/// "9.6.24") into the `server_version_num` form.
pub(crate) fn parse(text: &str) -> Option<u32> {
    fn number(s: &str) -> (Option<u32>, &str) {
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        (s[..end].parse().ok(), &s[end..])
    }
    let (major, rest) = number(text.trim());
    let major = major?;
    let (minor, rest) = match rest.strip_prefix('.') {
        Some(r) => number(r),
        None => (None, rest),
    };
    let minor = minor.unwrap_or(0);
    if major >= 10 {
        // From 10 on, the second number is the minor release: 15.18 is 150018.
        return Some(major * 10_000 + minor.min(9_999));
    }
    // Before 10, major releases had two numbers: 9.6.24 is 90624.
    let patch = rest
        .strip_prefix('.')
        .and_then(|r| number(r).0)
        .unwrap_or(0);
    Some(major * 10_000 + minor.min(99) * 100 + patch.min(99))
}

/// Refuses a server below the floor, or returns its version in the `server_version_num` form.
/// `num` is `server_version_num`, `text` is `server_version`; the number wins where it parses.
pub(crate) fn check(num: &str, text: &str) -> Result<u32, SqlxBrokerError> {
    match parse_num(num).or_else(|| parse(text)) {
        Some(v) if v >= FLOOR => Ok(v),
        _ => Err(SqlxBrokerError::ServerTooOld {
            server: format!("PostgreSQL {}", text.trim()),
            required: "PostgreSQL 11".into(),
            needed_for: "hashtextextended (advisory keys and FIFO group guards)",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_strings_parse() {
        assert_eq!(parse("10.23"), Some(100_023));
        assert_eq!(parse("11.0"), Some(110_000));
        assert_eq!(parse("15.18 (Debian 15.18-0+deb12u1)"), Some(150_018));
        assert_eq!(parse("17beta1"), Some(170_000));
        assert_eq!(parse("9.6.24"), Some(90_624));
        assert_eq!(parse("junk"), None);
    }

    #[test]
    fn version_numbers_parse() {
        assert_eq!(parse_num("100023"), Some(100_023));
        assert_eq!(parse_num("150018"), Some(150_018));
        assert_eq!(parse_num(" 110000\n"), Some(110_000));
        assert_eq!(parse_num(""), None);
        assert_eq!(parse_num("15"), None);
    }

    #[test]
    fn chained_commits_start_at_postgresql_12() {
        assert_eq!(check("120000", "12.0").unwrap(), CHAIN);
        assert!(check("110022", "11.22").unwrap() < CHAIN);
        assert!(check("150018", "15.18").unwrap() >= CHAIN);
    }

    #[test]
    fn the_floor_is_postgresql_11() {
        assert!(check("110000", "11.0").is_ok());
        assert!(check("150018", "15.18 (Debian 15.18-0+deb12u1)").is_ok());
        assert!(check("", "17beta1").is_ok());
        let err = check("100023", "10.23").unwrap_err();
        assert!(
            matches!(&err, SqlxBrokerError::ServerTooOld { server, required, .. }
                if server == "PostgreSQL 10.23" && required == "PostgreSQL 11"),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("10.23") && msg.contains("PostgreSQL 11"),
            "{msg}"
        );
        // The text decides when the number is missing.
        assert!(check("", "10.23").is_err());
        assert!(check("", "9.6.24").is_err());
        assert!(check("junk", "junk").is_err());
    }
}
