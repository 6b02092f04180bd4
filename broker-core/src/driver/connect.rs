//! What every backend's `connect` shares: the URL's scheme checked against the backend, and one
//! connection opened before the pool, so a failure comes back within seconds with its cause.
//!
//! sqlx's pool retries a refused connection until its acquire timeout (30 s) and then reports
//! "pool timed out while waiting for an open connection", which loses the cause. A single
//! connection opened first fails at once with "connection refused", a DNS error or the server's
//! refusal, and one that gets no answer fails after [`CONNECT_TIMEOUT`].

use std::time::Duration;

use sqlx::{ConnectOptions, Connection};

use crate::error::{Result, SqlxBrokerError};

/// How long the first connection may take before `connect` gives up on a server that does not
/// answer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The URL schemes each database's backend takes, with the backend's name.
const SCHEMES: &[(&str, &str, &[&str])] = &[
    (
        "PostgreSQL",
        "broker-postgres's PgBackend",
        &["postgres", "postgresql"],
    ),
    (
        "MySQL/MariaDB",
        "broker-mysql's MySqlBackend",
        &["mysql", "mariadb"],
    ),
    ("SQLite", "broker-sqlite's SqliteBackend", &["sqlite"]),
];

/// The URL's scheme (before the first `:`), if it has one: a Windows drive letter (`C:`) or a
/// path is none.
fn scheme(url: &str) -> Option<&str> {
    let (s, _) = url.split_once(':')?;
    let mut chars = s.chars();
    let first = chars.next()?;
    (s.len() > 1
        && first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(s)
}

/// Refuses a URL whose scheme is not one of `database`'s: a `mysql://` URL given to the
/// PostgreSQL backend would otherwise fail deep in the wire protocol
/// ("unexpected message: CopyData"), and a `postgres://` URL given to SQLite would name a file.
/// `bare_path`: a URL without a scheme is a file path (SQLite).
pub fn check_scheme(url: &str, database: &'static str, bare_path: bool) -> Result<()> {
    let (_, ours, accepted) = SCHEMES
        .iter()
        .find(|(d, _, _)| *d == database)
        .copied()
        .expect("a database of SCHEMES");
    let list = accepted
        .iter()
        .map(|s| format!("{s}:"))
        .collect::<Vec<_>>()
        .join(" or ");
    let refuse = |what: String, hint: String| SqlxBrokerError::Connect {
        database,
        hint,
        source: sqlx::Error::Configuration(what.into()),
    };
    match scheme(url) {
        Some(s) if accepted.iter().any(|a| a.eq_ignore_ascii_case(s)) => Ok(()),
        Some(s) => {
            let other = SCHEMES
                .iter()
                .find(|(_, _, schemes)| schemes.iter().any(|a| a.eq_ignore_ascii_case(s)));
            Err(match other {
                Some((theirs, backend, _)) => refuse(
                    format!("the URL is a {theirs} URL ({s}:), and {ours} connects to {database}"),
                    format!("connect with {backend}, or give a {list} URL"),
                ),
                None => refuse(
                    format!("the URL's scheme {s}: is not one {ours} takes"),
                    format!("give a {list} URL"),
                ),
            })
        }
        None if bare_path => Ok(()),
        None => Err(refuse(
            "the URL has no scheme".to_owned(),
            format!("give a {list} URL"),
        )),
    }
}

/// Opens one connection with `options` and closes it, within [`CONNECT_TIMEOUT`]; the error
/// carries the driver's cause (see the module docs).
pub async fn first_connection<O>(options: &O, database: &'static str) -> Result<()>
where
    O: ConnectOptions,
    O::Connection: Sized,
{
    match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Ok(Ok(conn)) => {
            // A close that fails changes nothing: the connection is gone either way.
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(SqlxBrokerError::connect(database, e)),
        Err(_) => Err(SqlxBrokerError::connect(
            database,
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()),
            )),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_for_another_database_names_the_backend_to_use() {
        let e = check_scheme("mysql://root@localhost/test", "PostgreSQL", false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("MySQL/MariaDB URL"), "{msg}");
        assert!(msg.contains("MySqlBackend"), "{msg}");
        let e = check_scheme("postgres://u@h/db", "SQLite", true).unwrap_err();
        assert!(e.to_string().contains("PgBackend"), "{e}");
        let e = check_scheme("sqlite:jobs.db", "MySQL/MariaDB", false).unwrap_err();
        assert!(e.to_string().contains("SqliteBackend"), "{e}");
        let e = check_scheme("http://x", "PostgreSQL", false).unwrap_err();
        assert!(e.to_string().contains("postgres: or postgresql:"), "{e}");
    }

    #[test]
    fn the_backends_own_schemes_and_sqlite_paths_pass() {
        check_scheme("postgresql://u@h/db", "PostgreSQL", false).unwrap();
        check_scheme("MARIADB://u@h/db", "MySQL/MariaDB", false).unwrap();
        check_scheme("sqlite::memory:", "SQLite", true).unwrap();
        check_scheme("jobs.db", "SQLite", true).unwrap();
        check_scheme("C:\\data\\jobs.db", "SQLite", true).unwrap();
        check_scheme("u@h/db", "PostgreSQL", false).unwrap_err();
    }
}
