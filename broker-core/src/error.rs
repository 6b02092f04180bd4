//! The one error type of sqlx-broker.

use crate::table::ClaimMode;

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
    #[error("table \"{table}\": {what} (statement \"{statement}\"): {source}")]
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

    /// A statement failed while the broker ran it.
    #[error("table \"{table}\": statement \"{name}\" failed: {source}")]
    Statement {
        /// The table.
        table: String,
        /// The statement's name (e.g. "claim", "ack").
        name: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// A claimed row's columns could not be decoded into the handler's type.
    #[error(
        "table \"{table}\": row {id} does not decode: {source}; make the row type match the table's columns"
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

    /// The driver error under this error, if there is one.
    pub fn sqlx_source(&self) -> Option<&sqlx::Error> {
        match self {
            Self::Schema { source, .. }
            | Self::Statement { source, .. }
            | Self::Decode { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = SqlxBrokerError> = std::result::Result<T, E>;
