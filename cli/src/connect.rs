//! Opening the database for one command, with a pool sized for a tool and messages that say
//! what went wrong without the password.
//!
//! A backend's `connect` opens a pool of up to 16 connections, sized for a worker. The pool
//! opens them on demand, but the dashboard's pages come in parallel and each leaves its
//! connection open (idle) for ten minutes, so `sqlx-broker web` held 16 of a server's
//! `max_connections` (100 by default on PostgreSQL) after a busy minute. The CLI builds the
//! same broker on a pool of [`POOL`] connections: every command runs its statements one after
//! another, and the dashboard's pages wait their turn for one of the two.

use std::str::FromStr;

use broker_core::driver::connect::{check_scheme, first_connection};
use broker_core::{Broker, SqlxBrokerError};
use broker_mysql::sqlx::mysql::{MySqlDatabaseError, MySqlPoolOptions};
use broker_mysql::{MySqlBackend, MySqlBroker};
use broker_postgres::sqlx;
use broker_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use broker_postgres::{PgBackend, PgBroker};

/// The connections the CLI's pool holds at most (the doctor's pool excepted: see
/// [`postgres`]).
pub(crate) const POOL: u32 = 2;

const PG: &str = "PostgreSQL";
const MYSQL: &str = "MySQL/MariaDB";

/// A broker on PostgreSQL at `url` whose pool holds at most `max` connections (the doctor
/// passes the workers' pool size, since its pool check reads it; its checks open at most
/// three). One connection is opened first, as `PgBackend::connect` does, so a refusal comes
/// back at once with its cause.
pub(crate) async fn postgres(url: &str, max: u32) -> Result<PgBroker, SqlxBrokerError> {
    check_scheme(url, PG, false)?;
    let options = PgConnectOptions::from_str(url).map_err(|e| SqlxBrokerError::connect(PG, e))?;
    first_connection(&options, PG).await.map_err(explain)?;
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .map_err(|e| explain(SqlxBrokerError::connect(PG, e)))?;
    Ok(Broker::owning_pool(PgBackend::new(pool)))
}

/// A broker on MySQL or MariaDB at `url`, as [`postgres`].
pub(crate) async fn mysql(url: &str, max: u32) -> Result<MySqlBroker, SqlxBrokerError> {
    let options = MySqlBackend::connect_options(url)?;
    first_connection(&options, MYSQL).await.map_err(explain)?;
    let pool = MySqlPoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .map_err(|e| explain(SqlxBrokerError::connect(MYSQL, e)))?;
    Ok(Broker::owning_pool(MySqlBackend::new(pool)))
}

/// A connect error whose hint fits a server that is out of connections. The backends' hint
/// for any refusal by the server is to check the user, password and database name, which
/// sends an operator to the wrong place when the server has no connection left to give.
fn explain(e: SqlxBrokerError) -> SqlxBrokerError {
    match e {
        SqlxBrokerError::Connect {
            database,
            source: sqlx::Error::Database(db),
            hint,
        } => {
            let hint = if db.code().as_deref() == Some("53300") {
                format!(
                    "the server has no connection to spare: every connection that max_connections (or the role's or database's CONNECTION LIMIT) allows is in use; close idle sessions (see pg_stat_activity), give workers and tools smaller pools, or raise the limit; this CLI opens at most {POOL}"
                )
            } else if db
                .try_downcast_ref::<MySqlDatabaseError>()
                .is_some_and(|m| matches!(m.number(), 1040 | 1203 | 1226))
            {
                format!(
                    "the server has no connection to spare: every connection that max_connections (or the user's max_user_connections) allows is in use; close idle sessions (see SHOW PROCESSLIST), give workers and tools smaller pools, or raise the limit; this CLI opens at most {POOL}"
                )
            } else {
                hint
            };
            SqlxBrokerError::Connect {
                database,
                hint,
                source: sqlx::Error::Database(db),
            }
        }
        other => other,
    }
}

/// The password of `url` as written (what stands between the user's `:` and the last `@`,
/// the most a URL parser could take for it), when it is long enough to hide without hiding
/// ordinary words: [`hide`] replaces it wherever a message repeats it.
pub(crate) fn password_of(url: &str) -> Option<String> {
    let (_, rest) = url.split_once("://")?;
    let user_info = &rest[..rest.rfind('@')?];
    let (_, password) = user_info.split_once(':')?;
    (password.chars().count() >= 4).then(|| password.to_owned())
}

/// `text` with the password of any URL in it, and `secret` (written or percent-decoded)
/// anywhere in it, shown as `***`.
pub(crate) fn hide(text: &str, secret: Option<&str>) -> String {
    let mut text = broker_core::redact_passwords(text);
    if let Some(secret) = secret {
        text = text.replace(secret, "***");
        let decoded = percent_decode(secret);
        if decoded != secret && decoded.chars().count() >= 4 {
            text = text.replace(&decoded, "***");
        }
    }
    text
}

/// `%XX` sequences as the bytes they stand for (invalid UTF-8 read lossily).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_with_a_blank_or_quote_is_hidden_wherever_it_is_repeated() {
        let url = "postgres://alice:S3CR ET\"PW@db/app";
        let secret = password_of(url);
        assert_eq!(secret.as_deref(), Some("S3CR ET\"PW"));
        let shown = hide(&format!("cannot connect to {url}: no"), secret.as_deref());
        assert_eq!(shown, "cannot connect to postgres://alice:***@db/app: no");
        let secret = password_of("mysql://root:p%40ss%20w@db/app");
        assert_eq!(
            hide("the driver said p@ss w", secret.as_deref()),
            "the driver said ***"
        );
        assert_eq!(password_of("postgres://alice:abc@db/app"), None);
        assert_eq!(password_of("postgres://alice@db/app"), None);
        assert_eq!(password_of("sqlite://jobs.db"), None);
    }
}
