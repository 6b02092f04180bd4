//! The one error type of sqlx-broker.

use crate::claim_mode::ClaimMode;

/// Every error sqlx-broker returns.
///
/// Each variant about a table names it, and each message says what to change. The enum is
/// `#[non_exhaustive]` and its variants are struct variants, so fields and variants can be added
/// without breaking callers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqlxBrokerError {
    /// The server is older than the first version with a feature this crate relies on.
    #[error(
        "server version {server} is too old: {needed_for} needs {required} or newer; upgrade the server"
    )]
    ServerTooOld {
        /// The version the server reported.
        server: String,
        /// The first version that works.
        required: String,
        /// What the floor is for (e.g. "FOR UPDATE SKIP LOCKED").
        needed_for: &'static str,
    },

    /// A lease ran out while its handler ran and another claim holds the row now; the
    /// settlement changed nothing.
    #[error(
        "table \"{table}\": the lease on row {id} ran out and the row was claimed again; this settlement changed nothing (lengthen lease_seconds or keep renewal running)"
    )]
    LeaseLost {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
    },

    /// The delivery's claim ended before its settlement (its key lock or connection went away) and
    /// the row was claimed again; the settlement changed nothing.
    #[error(
        "table \"{table}\": the claim on row {id} ended before this settlement (its key lock or connection went away) and the row was claimed again; this settlement changed nothing"
    )]
    ClaimLost {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
    },

    /// The row was deleted (by hand, or by something other than the broker) while a delivery
    /// held it; the settlement changed nothing.
    #[error(
        "table \"{table}\": row {id} is gone: it was deleted while this delivery held it, so this settlement changed nothing (delete rows only after they are acked or dead-lettered)"
    )]
    RowGone {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
    },

    /// A subscription option has a value the engine cannot run with.
    #[error(
        "subscription on table \"{table}\": {option} = {value} is refused: {why}; accepted: {accepted}"
    )]
    InvalidOption {
        /// The table the subscription is for.
        table: String,
        /// The option's name, as its `SubscribeOptions` method is called.
        option: &'static str,
        /// The value given.
        value: String,
        /// The values accepted.
        accepted: &'static str,
        /// Why the value cannot work.
        why: &'static str,
    },

    /// The database does not offer the claim mode the table description selects.
    #[error("table \"{table}\": {database} does not offer {mode} mode; {hint}")]
    ModeNotOffered {
        /// The table.
        table: String,
        /// The mode the description selects.
        mode: ClaimMode,
        /// The database.
        database: &'static str,
        /// What to change.
        hint: &'static str,
    },

    /// The table description is invalid.
    #[error("table \"{table}\": {message}")]
    Description {
        /// The table.
        table: String,
        /// What is wrong and what to change.
        message: String,
    },

    /// A check at subscribe time found the table or a column missing, or a statement that does
    /// not prepare.
    #[error("table \"{table}\": {what} (statement \"{statement}\"): {}", driver_message(.source))]
    Schema {
        /// The table.
        table: String,
        /// What is wrong, naming the column where one is at fault, and what to change.
        what: String,
        /// The statement that failed to prepare.
        statement: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// A statement failed while the broker ran it. `table` is empty for statements that belong
    /// to no table (connecting, reading the server version); the message then leaves it out.
    #[error("{}statement \"{name}\" failed: {}", table_prefix(.table), driver_message(.source))]
    Statement {
        /// The table.
        table: String,
        /// The statement's name (e.g. "claim", "ack").
        name: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// Connecting to the database failed (a backend's `connect`), or the URL is not one for
    /// this backend. Build it with [`SqlxBrokerError::connect`], which says what to check for
    /// the kind of failure.
    #[error("could not connect to the {database} database: {}; {hint}", driver_message(.source))]
    Connect {
        /// The database the backend is for ("PostgreSQL", "MySQL/MariaDB", "SQLite").
        database: &'static str,
        /// What to check or change.
        hint: String,
        /// The driver's error: its cause, not a pool timeout (the backends connect once before
        /// they open the pool, so "connection refused" stays "connection refused").
        #[source]
        source: sqlx::Error,
    },

    /// A DDL statement (from the DDL helper) failed. `table` is empty until the broker fills
    /// in the table it ran the DDL for.
    #[error("{}DDL statement failed: {}; the statement was: {statement}", table_prefix(.table), driver_message(.source))]
    Ddl {
        /// The table.
        table: String,
        /// The statement.
        statement: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The deployment is not what the table needs, found at startup without a driver error
    /// behind it (e.g. a setting of the session or an index the claim reads).
    #[error("table \"{table}\": {what}")]
    Setup {
        /// The table.
        table: String,
        /// What is wrong and what to change.
        what: String,
    },

    /// The database answered something the broker's protocol rules out: a bug, or a change to
    /// the table made behind the broker's back. Nothing was settled on the strength of it.
    #[error("table \"{table}\": statement \"{statement}\" broke an invariant: {what}")]
    Invariant {
        /// The table.
        table: String,
        /// The statement's name.
        statement: &'static str,
        /// What was found.
        what: String,
    },

    /// A claimed row's columns could not be decoded into the handler's type.
    #[error(
        "table \"{table}\": row {id} does not decode: {}; make the row type match the table's columns", driver_message(.source)
    )]
    Decode {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// An outcome that the table description cannot express, such as a delayed retry on a table
    /// without a due-time column.
    #[error("table \"{table}\": {message}")]
    Unsupported {
        /// The table.
        table: String,
        /// What is missing and what to add.
        message: String,
    },

    /// An operation on one row (cancel, run now, requeue) found no such row.
    #[error(
        "table \"{table}\": there is no row {id}{where_}; it was acked, cancelled or moved, or never existed (check the id)"
    )]
    RowNotFound {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
        /// Where it was looked for, with a leading space (e.g. " among the dead letters").
        where_: &'static str,
    },

    /// An operation on one row was refused because a delivery holds the row now; nothing
    /// changed.
    #[error(
        "table \"{table}\": row {id} is in work ({held}), so {what} changed nothing; try again once it is settled"
    )]
    RowInWork {
        /// The table.
        table: String,
        /// The row id.
        id: i64,
        /// What holds it (e.g. "its lease runs until 12:00:03").
        held: String,
        /// What was refused (e.g. "cancel").
        what: &'static str,
    },

    /// An operation the queue's state or description does not allow (pausing a paused queue,
    /// dead letters of a table without a dead-letter target); nothing changed.
    #[error("table \"{table}\": {what} is refused: {why}")]
    Refused {
        /// The table.
        table: String,
        /// What was asked (e.g. "pause").
        what: &'static str,
        /// Why, and what to do instead.
        why: String,
    },

    /// A periodic schedule is invalid (its name, cron expression or time zone), or its name is
    /// registered with another expression, time zone or table.
    #[error("schedule \"{schedule}\": {message}")]
    Schedule {
        /// The schedule's name.
        schedule: String,
        /// What is wrong and what to change.
        message: String,
    },

    /// The broker or subscription has shut down.
    #[error("table \"{table}\": the broker is shut down; {what} was not carried out")]
    Closed {
        /// The table.
        table: String,
        /// What was refused (e.g. "the ack of row 7").
        what: String,
    },
}

impl SqlxBrokerError {
    /// Wraps a driver error from a named statement on `table`.
    pub fn statement(table: &str, name: &'static str, source: sqlx::Error) -> Self {
        Self::Statement {
            table: table.to_owned(),
            name,
            source,
        }
    }

    /// A description error on `table`.
    pub fn description(table: &str, message: impl Into<String>) -> Self {
        Self::Description {
            table: table.to_owned(),
            message: message.into(),
        }
    }

    /// This error with `table` filled in where it names none (a statement run for no table,
    /// such as DDL, that the caller ran for `table`).
    pub(crate) fn for_table(self, table: &str) -> Self {
        match self {
            Self::Statement {
                table: t,
                name,
                source,
            } if t.is_empty() => Self::Statement {
                table: table.to_owned(),
                name,
                source,
            },
            Self::Ddl {
                table: t,
                statement,
                source,
            } if t.is_empty() => Self::Ddl {
                table: table.to_owned(),
                statement,
                source,
            },
            other => other,
        }
    }

    /// A claim mode the backend does not know: a newer core than the backend was built for.
    /// [`ClaimMode`] is `#[non_exhaustive]`, so every backend answers a mode it lacks with this
    /// instead of failing to compile.
    pub fn mode_not_offered(table: &str, mode: ClaimMode, database: &str) -> Self {
        Self::Unsupported {
            table: table.to_owned(),
            message: format!(
                "{mode:?} mode is not offered by this version of the {database} backend; upgrade the backend crate to the core's version"
            ),
        }
    }

    /// A failed connection to a `database` server, with a hint chosen by the kind of failure:
    /// a refused connection names the port, an unanswered one the host, a refusal by the
    /// server the credentials and database name.
    pub fn connect(database: &'static str, source: sqlx::Error) -> Self {
        let hint = match &source {
            sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                "nothing accepts connections at that host and port: check the port in the URL and that the server is up"
            }
            sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                "the server did not answer: check the host in the URL, firewalls, and that the server is up"
            }
            sqlx::Error::Io(_) => "check the host and port in the URL and that the server is up",
            sqlx::Error::Tls(_) => {
                "check the TLS settings in the URL (sslmode, ssl-mode) and the server's certificate"
            }
            sqlx::Error::Database(db) if out_of_connections(&**db) => {
                "the server has no connection to spare: every connection its limit allows (PostgreSQL's max_connections or a role's CONNECTION LIMIT; MySQL's max_connections or max_user_connections) is in use; close idle sessions, give workers and tools smaller pools, or raise the limit"
            }
            sqlx::Error::Database(_) => {
                "the server refused the session: check the user, password and database name in the URL"
            }
            sqlx::Error::Configuration(_) => "fix the URL",
            _ => "check the URL, that the server is up, and the credentials",
        };
        Self::Connect {
            database,
            hint: hint.to_owned(),
            source,
        }
    }

    /// A failed DDL statement.
    pub fn ddl(statement: &str, source: sqlx::Error) -> Self {
        Self::Ddl {
            table: String::new(),
            statement: statement.to_owned(),
            source,
        }
    }

    /// The driver error under this error, if there is one.
    pub fn sqlx_source(&self) -> Option<&sqlx::Error> {
        match self {
            Self::Schema { source, .. }
            | Self::Statement { source, .. }
            | Self::Connect { source, .. }
            | Self::Ddl { source, .. }
            | Self::Decode { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Whether a server refused a session because its connections are all in use: PostgreSQL's
/// SQLSTATE 53300 (`too_many_connections`), MySQL's and MariaDB's 08004 (error 1040, "Too many
/// connections") and their per-user limits (errors 1203 and 1226, whose SQLSTATE 42000 is
/// shared with syntax errors, so they are known by their text).
fn out_of_connections(db: &dyn sqlx::error::DatabaseError) -> bool {
    let message = db.message().to_ascii_lowercase();
    matches!(db.code().as_deref(), Some("53300" | "08004"))
        || message.contains("too many connections")
        || message.contains("max_user_connections")
}

/// A driver error as our messages show it. A database's error is its message and code, without
/// PostgreSQL's "at line N": that is the line of the server's C source that raised it, which
/// reads as a line of the user's SQL.
pub fn driver_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (code {code})", db.message()),
            None => db.message().to_owned(),
        },
        other => other.to_string(),
    }
}

/// `table "t": ` before a message about a table, nothing for statements of no table, so no
/// message ever names `table ""`.
fn table_prefix(table: &str) -> String {
    if table.is_empty() {
        String::new()
    } else {
        format!("table \"{table}\": ")
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = SqlxBrokerError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's refusal with `code` and `message`, as a driver reports it.
    #[derive(Debug)]
    struct Refused(&'static str, &'static str);

    impl std::fmt::Display for Refused {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.1)
        }
    }

    impl std::error::Error for Refused {}

    impl sqlx::error::DatabaseError for Refused {
        fn message(&self) -> &str {
            self.1
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn connect_hint(code: &'static str, message: &'static str) -> String {
        let e = SqlxBrokerError::connect(
            "test",
            sqlx::Error::Database(Box::new(Refused(code, message))),
        );
        e.to_string()
    }

    #[test]
    fn a_server_out_of_connections_is_not_blamed_on_the_credentials() {
        for (code, message) in [
            ("53300", "sorry, too many clients already"),
            ("08004", "Too many connections"),
            (
                "42000",
                "User 'app' has exceeded the 'max_user_connections' resource (current value: 2)",
            ),
        ] {
            let msg = connect_hint(code, message);
            assert!(msg.contains("no connection to spare"), "{msg}");
            assert!(!msg.contains("password"), "{msg}");
        }
        let msg = connect_hint("28P01", "password authentication failed for user \"app\"");
        assert!(msg.contains("check the user, password"), "{msg}");
    }

    #[test]
    fn a_statement_of_no_table_never_names_an_empty_table() {
        let e = SqlxBrokerError::statement("", "connect", sqlx::Error::PoolTimedOut);
        let msg = e.to_string();
        assert!(!msg.contains("table \"\""), "{msg}");
        assert!(msg.starts_with("statement \"connect\" failed"), "{msg}");
        let msg = e.for_table("jobs").to_string();
        assert!(msg.starts_with("table \"jobs\": statement"), "{msg}");
    }
}
