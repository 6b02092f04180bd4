//! The SQLite version floor: the lease claim and the advisory take are `UPDATE .. RETURNING`,
//! which SQLite has from 3.35.0.

use broker_core::SqlxBrokerError;

/// The first SQLite with `UPDATE .. RETURNING`.
pub(crate) const FLOOR: (u32, u32, u32) = (3, 35, 0);

/// Parses `sqlite_version()` ("3.46.1").
pub(crate) fn parse(version: &str) -> Option<(u32, u32, u32)> {
    let mut parts = version.trim().split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// Refuses a library below the floor.
pub(crate) fn check(version: &str) -> Result<(), SqlxBrokerError> {
    match parse(version) {
        Some(v) if v >= FLOOR => Ok(()),
        _ => Err(SqlxBrokerError::ServerTooOld {
            server: format!("SQLite {version}"),
            required: "SQLite 3.35.0".into(),
            needed_for: "UPDATE .. RETURNING",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_the_floor_holds() {
        assert_eq!(parse("3.46.1"), Some((3, 46, 1)));
        assert!(check("3.35.0").is_ok());
        assert!(check("3.46.1").is_ok());
        let e = check("3.34.1").unwrap_err().to_string();
        assert!(e.contains("3.34.1") && e.contains("3.35.0"), "{e}");
        assert!(check("junk").is_err());
    }
}
