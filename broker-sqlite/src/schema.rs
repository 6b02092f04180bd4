//! DDL for a description, and the startup checks that the table, its columns and every
//! statement are in order.

use broker_core::{ColumnType, DeadLetter, SqlxBrokerError, TableDescription};
use sqlx::{Executor, SqliteConnection};

use crate::sql::ident;

fn column_type(ty: ColumnType) -> &'static str {
    match ty {
        ColumnType::Text | ColumnType::Json => "TEXT",
        ColumnType::BigInt => "INTEGER",
        ColumnType::Bytes => "BLOB",
    }
}

/// The columns of a description as DDL, for the queue table (`autoincrement`) or its
/// dead-letter table. Times are INTEGER unix milliseconds.
fn columns(t: &TableDescription, autoincrement: bool) -> Vec<String> {
    let mut cols = vec![format!(
        "{} INTEGER PRIMARY KEY{}",
        ident(t.id()),
        // AUTOINCREMENT never reuses an id, so FIFO order and histories stay unambiguous.
        if autoincrement { " AUTOINCREMENT" } else { "" }
    )];
    if let Some((p, ty)) = t.payload() {
        cols.push(format!("{} {}", ident(p), column_type(ty)));
    }
    cols.push(format!("{} INTEGER NOT NULL DEFAULT 1", ident(t.attempt())));
    for c in [t.locked_until(), t.due_at(), t.processed_at()]
        .into_iter()
        .flatten()
    {
        cols.push(format!("{} INTEGER", ident(c)));
    }
    if let Some(DeadLetter::Column(c)) = t.dead_letter() {
        cols.push(format!("{} INTEGER", ident(c)));
    }
    if let Some(g) = t.group() {
        cols.push(format!("{} TEXT", ident(g)));
    }
    if let Some(p) = t.priority() {
        cols.push(format!("{} INTEGER NOT NULL DEFAULT 0", ident(p)));
    }
    for (c, ty) in t.columns() {
        cols.push(format!("{} {}", ident(c), column_type(*ty)));
    }
    cols
}

/// The DDL of a description: the table, the index the claim reads (partial: only unfinished
/// rows, in claim order), the group index FIFO heads need, and the dead-letter table.
pub(crate) fn ddl(t: &TableDescription) -> Vec<String> {
    let table = ident(t.name());
    let mut out = vec![format!(
        "CREATE TABLE IF NOT EXISTS {table} ({})",
        columns(t, true).join(", ")
    )];
    let mut unfinished = Vec::new();
    if let Some(c) = t.processed_at() {
        unfinished.push(format!("{} IS NULL", ident(c)));
    }
    if let Some(DeadLetter::Column(c)) = t.dead_letter() {
        unfinished.push(format!("{} IS NULL", ident(c)));
    }
    let partial = if unfinished.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", unfinished.join(" AND "))
    };
    let mut claim_cols = Vec::new();
    if let Some(p) = t.priority() {
        claim_cols.push(format!("{} DESC", ident(p)));
    }
    claim_cols.push(ident(t.id()));
    // Without a priority or a finishing column the claim reads the primary key in id order; an
    // index on (id) alone would duplicate it and cost every insert a second write.
    if t.priority().is_some() || !partial.is_empty() {
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}){partial}",
            ident(&format!("{}_claim", t.name())),
            claim_cols.join(", ")
        ));
    }
    if let Some(g) = t.group() {
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}, {}){partial}",
            ident(&format!("{}_group", t.name())),
            ident(g),
            ident(t.id())
        ));
    }
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!(
            "CREATE TABLE IF NOT EXISTS {} ({})",
            ident(d),
            columns(t, false).join(", ")
        ));
    }
    out
}

/// The DROP statements that undo [`ddl`].
pub(crate) fn drop_ddl(t: &TableDescription) -> Vec<String> {
    let mut out = vec![format!("DROP TABLE IF EXISTS {}", ident(t.name()))];
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!("DROP TABLE IF EXISTS {}", ident(d)));
    }
    out
}

/// Checks that the table and each named column exist, that the id and attempt columns are
/// integers, and that every statement prepares.
pub(crate) async fn check(
    conn: &mut SqliteConnection,
    t: &TableDescription,
    statements: &[(&'static str, &str)],
) -> Result<(), SqlxBrokerError> {
    let table = ident(t.name());
    let schema = |what: String, statement: &'static str, source| SqlxBrokerError::Schema {
        table: t.name().to_owned(),
        what,
        statement,
        source,
    };
    let probe = format!("SELECT * FROM {table} LIMIT 0");
    conn.prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(probe)))
        .await
        .map_err(|e| {
            schema(
                "the table does not exist or cannot be read; create it (see the DDL helper)".into(),
                "table check",
                e,
            )
        })?;
    for (column, role) in t.named_columns() {
        let probe = format!("SELECT {} FROM {table} LIMIT 0", ident(column));
        conn.prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(probe)))
            .await
            .map_err(|e| {
                schema(
                    format!(
                        "column \"{column}\" ({role}) is missing; add it or fix the description"
                    ),
                    "column check",
                    e,
                )
            })?;
    }
    for (column, role) in [(t.id(), "id"), (t.attempt(), "attempt")] {
        let declared: Option<String> =
            sqlx::query_scalar("SELECT type FROM pragma_table_info(?1) WHERE name = ?2")
                .bind(t.name())
                .bind(column)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| schema("cannot read the table's columns".into(), "column check", e))?;
        if let Some(declared) = declared
            && !declared.to_ascii_uppercase().contains("INT")
        {
            return Err(schema(
                format!(
                    "column \"{column}\" ({role}) is declared {declared}; it must be an INTEGER column"
                ),
                "column check",
                sqlx::Error::TypeNotFound {
                    type_name: declared,
                },
            ));
        }
    }
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        let probe = format!("SELECT * FROM {} LIMIT 0", ident(d));
        conn.prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(probe))).await.map_err(|e| {
            schema(
                format!("the dead-letter table \"{d}\" does not exist; create it (see the DDL helper)"),
                "dead-letter check",
                e,
            )
        })?;
    }
    for (name, sql) in statements {
        conn.prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(
            sql.to_string(),
        )))
        .await
        .map_err(|e| {
            schema(
                "a statement does not prepare; check the column types and names".into(),
                name,
                e,
            )
        })?;
    }
    Ok(())
}
