//! The server version floor: every claim mode relies on `FOR UPDATE SKIP LOCKED`, which MySQL
//! has from 8.0.1 and MariaDB from 10.6.

use broker_core::SqlxBrokerError;

/// Which server answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// Oracle MySQL (and compatibles that report a MySQL version, e.g. Percona, Aurora).
    MySql,
    /// MariaDB.
    MariaDb,
}

/// A parsed `SELECT VERSION()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Server {
    pub(crate) flavor: Flavor,
    pub(crate) major: u32,
    pub(crate) minor: u32,
    /// `None` when the third part is not a number (Aurora MySQL 3 reports
    /// `8.0.mysql_aurora.3.04.0`).
    pub(crate) patch: Option<u32>,
}

impl Server {
    /// Whether the server is at or above `(major, minor, patch)`. An unknown patch counts as
    /// meeting the floor of its minor version: every released 8.0 build is 8.0.11 or later.
    fn at_least(&self, floor: (u32, u32, u32)) -> bool {
        let (major, minor, patch) = floor;
        (self.major, self.minor) > (major, minor)
            || ((self.major, self.minor) == (major, minor) && self.patch.is_none_or(|p| p >= patch))
    }
}

/// The first MySQL with `SKIP LOCKED` and `NOWAIT`.
pub(crate) const MYSQL_FLOOR: (u32, u32, u32) = (8, 0, 1);
/// The first MariaDB with `SKIP LOCKED`.
pub(crate) const MARIADB_FLOOR: (u32, u32, u32) = (10, 6, 0);

/// Parses a version string: `8.0.36-0ubuntu0.22.04.1`, `10.11.19-MariaDB-0+deb12u1`, and the
/// `5.5.5-10.x.y-MariaDB` form that MariaDB reports through old replication-compatible clients.
pub(crate) fn parse(version: &str) -> Option<Server> {
    let raw = version.trim();
    let flavor = if raw.to_ascii_lowercase().contains("mariadb") {
        Flavor::MariaDb
    } else {
        Flavor::MySql
    };
    let mut rest = raw;
    if flavor == Flavor::MariaDb
        && let Some(after) = rest.strip_prefix("5.5.5-")
    {
        rest = after;
    }
    let end = rest
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(rest.len());
    let mut parts = rest[..end].split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch = parts.next().and_then(|p| p.parse().ok());
    Some(Server {
        flavor,
        major,
        minor,
        patch,
    })
}

/// Refuses a server below its floor.
pub(crate) fn check(version: &str) -> Result<Server, SqlxBrokerError> {
    let too_old = |required: &str| SqlxBrokerError::ServerTooOld {
        server: version.trim().to_owned(),
        required: required.to_owned(),
        needed_for: "FOR UPDATE SKIP LOCKED",
    };
    match parse(version) {
        Some(s) if s.flavor == Flavor::MySql && s.at_least(MYSQL_FLOOR) => Ok(s),
        Some(s) if s.flavor == Flavor::MariaDb && s.at_least(MARIADB_FLOOR) => Ok(s),
        Some(s) if s.flavor == Flavor::MySql => Err(too_old("MySQL 8.0.1")),
        Some(_) => Err(too_old("MariaDB 10.6.0")),
        None => Err(too_old("MySQL 8.0.1 or MariaDB 10.6.0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(v: &str) -> Server {
        check(v).unwrap_or_else(|e| panic!("{v}: {e}"))
    }

    fn refused(v: &str, required: &str) {
        let e = check(v).unwrap_err();
        assert!(
            matches!(&e, SqlxBrokerError::ServerTooOld { server, required: r, needed_for }
                if server == v && r == required && needed_for.contains("SKIP LOCKED")),
            "{v}: {e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains(v) && msg.contains(required), "{msg}");
    }

    #[test]
    fn mysql_versions_parse_and_the_floor_is_8_0_1() {
        refused("8.0.0", "MySQL 8.0.1");
        assert_eq!(ok("8.0.1").patch, Some(1));
        let ubuntu = ok("8.0.36-0ubuntu0.22.04.1");
        assert_eq!(
            (ubuntu.flavor, ubuntu.major, ubuntu.minor, ubuntu.patch),
            (Flavor::MySql, 8, 0, Some(36))
        );
        refused("5.7.44-log", "MySQL 8.0.1");
        ok("8.4.2");
        ok("9.1.0-commercial");
        // Aurora MySQL 3 reports no numeric patch; every 8.0 release is past 8.0.1.
        assert_eq!(ok("8.0.mysql_aurora.3.04.0").patch, None);
    }

    #[test]
    fn mariadb_versions_parse_and_the_floor_is_10_6() {
        refused("10.5.23-MariaDB", "MariaDB 10.6.0");
        assert_eq!(ok("10.6.0-MariaDB").flavor, Flavor::MariaDb);
        let deb = ok("10.11.19-MariaDB-0+deb12u1");
        assert_eq!((deb.major, deb.minor, deb.patch), (10, 11, Some(19)));
        assert_eq!(ok("11.4.2-MariaDB-ubu2404").major, 11);
        // The replication-compatible prefix is not the version.
        let prefixed = ok("5.5.5-10.11.6-MariaDB-log");
        assert_eq!((prefixed.major, prefixed.minor), (10, 11));
        refused("5.5.5-10.5.9-MariaDB", "MariaDB 10.6.0");
    }

    #[test]
    fn an_unreadable_version_is_refused() {
        refused("junk", "MySQL 8.0.1 or MariaDB 10.6.0");
        refused("", "MySQL 8.0.1 or MariaDB 10.6.0");
    }
}
