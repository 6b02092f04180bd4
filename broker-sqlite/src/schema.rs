//! DDL for a description, and the startup checks that the table, its columns and every
//! statement are in order.

use broker_core::driver::indexes::IndexAdvice;
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
    if let Some(e) = t.last_error() {
        cols.push(format!("{} TEXT", ident(e)));
    }
    if let Some(n) = t.snoozes() {
        // Counts snoozes; 0 for rows published before the first.
        cols.push(format!("{} INTEGER NOT NULL DEFAULT 0", ident(n)));
    }
    if let Some(u) = t.unique_key() {
        cols.push(format!("{} TEXT", ident(u)));
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
    out.extend(claim_indexes(t));
    out.extend(unique_index(t));
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!(
            "CREATE TABLE IF NOT EXISTS {} ({})",
            ident(d),
            columns(t, false).join(", ")
        ));
    }
    // Which queues are paused, shared by every queue of the database.
    out.push(crate::admin::control_ddl());
    // Cancel requests for rows in work, shared likewise.
    out.push(crate::admin::cancels_ddl());
    out.extend(crate::schedule::ddl());
    out
}

/// The name of the unique key index the DDL helper creates.
pub(crate) fn unique_index_name(t: &TableDescription) -> String {
    format!("{}_unique", t.name())
}

/// The unique index over unfinished rows' keys (partial: a finished row, acked with
/// `processed_at` or marked dead, frees its key; NULL keys never collide).
pub(crate) fn unique_index(t: &TableDescription) -> Option<String> {
    let u = t.unique_key()?;
    Some(format!(
        "CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} ({}){}",
        ident(&unique_index_name(t)),
        ident(t.name()),
        ident(u),
        partial(t, false)
    ))
}

/// The `WHERE` of a partial index over unfinished rows (empty when every row is unfinished),
/// and on a FIFO table only over rows without a group when `ungrouped`.
fn partial(t: &TableDescription, ungrouped: bool) -> String {
    let mut rows: Vec<String> = t
        .unfinished_columns()
        .into_iter()
        .map(|c| format!("{} IS NULL", ident(c)))
        .collect();
    if let Some(g) = t.group().filter(|_| ungrouped && t.fifo()) {
        rows.push(format!("{} IS NULL", ident(g)));
    }
    if rows.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", rows.join(" AND "))
    }
}

/// The indexes the claims read, by name: the claim index (priority, due time as
/// [`due_key`](crate::sql::due_key) sorts it, id; partial over unfinished rows, and on a FIFO
/// table over those without a group) and, with a group column, the group index (group, id)
/// over unfinished rows, that a FIFO claim visits the groups and finds their heads through; on an
/// advisory table without FIFO groups the key index (the key template's columns, id) over
/// unfinished rows, that the key walk visits the keys through. A plain table without a
/// priority, a due time or a finishing column gets no claim index: its claim order is the
/// primary key's, and an index on (id) alone would cost every insert a second write.
pub(crate) fn claim_indexes(t: &TableDescription) -> Vec<String> {
    let table = ident(t.name());
    let mut out = Vec::new();
    let mut claim_cols = Vec::new();
    if let Some(p) = t.priority() {
        claim_cols.push(format!("{} DESC", ident(p)));
    }
    if let Some(c) = t.due_at() {
        claim_cols.push(crate::sql::due_key(&ident(c)));
    }
    claim_cols.push(ident(t.id()));
    let claim_rows = partial(t, true);
    if claim_cols.len() > 1 || !claim_rows.is_empty() {
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}){claim_rows}",
            ident(&format!("{}_claim", t.name())),
            claim_cols.join(", ")
        ));
    }
    if let Some(g) = t.group() {
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}, {}){}",
            ident(&format!("{}_group", t.name())),
            ident(g),
            ident(t.id()),
            partial(t, false)
        ));
    }
    if let Some(cols) = t.key_index_columns() {
        let cols: Vec<String> = cols.iter().map(|c| ident(c)).collect();
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}, {}){}",
            ident(&format!("{}_key", t.name())),
            cols.join(", "),
            ident(t.id()),
            partial(t, false)
        ));
    }
    out
}

/// The claim indexes of `t` that are missing or differ from what [`claim_indexes`] makes: for
/// each, what was found and the statements that put it right. An index of any name with the same
/// definition counts; one under the helper's name with another definition (made before the claim
/// led with the due time) is named to be dropped and made again. Only slowness follows, so the
/// caller warns.
pub(crate) async fn index_advice(
    conn: &mut SqliteConnection,
    t: &TableDescription,
) -> Result<Vec<IndexAdvice>, sqlx::Error> {
    let found: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ?1",
    )
    .bind(t.name())
    .fetch_all(&mut *conn)
    .await?;
    // SQLite keeps each CREATE INDEX as written, less IF NOT EXISTS: compare what follows " ON ".
    let body = |sql: &str| sql.split_once(" ON ").map(|(_, b)| b.trim().to_owned());
    let mut out = Vec::new();
    for sql in claim_indexes(t) {
        let rest = sql
            .strip_prefix("CREATE INDEX IF NOT EXISTS ")
            .expect("the helper's indexes");
        let name = rest[..rest.find(" ON ").expect("an ON")].to_owned();
        let want = body(&sql);
        if found
            .iter()
            .any(|(_, s)| s.as_deref().and_then(body) == want)
        {
            continue;
        }
        let plain = name.trim_matches('`').replace("``", "`");
        match found.iter().find(|(n, _)| *n == plain) {
            Some((_, have)) => out.push(IndexAdvice {
                name: plain,
                found: format!(
                    "it is {}, not the claim's {rest}",
                    have.as_deref().unwrap_or("?")
                ),
                fix: vec![format!("DROP INDEX {name}"), sql.clone()],
            }),
            None => out.push(IndexAdvice {
                name: plain,
                found: format!("missing: {rest}"),
                fix: vec![sql.clone()],
            }),
        }
    }
    Ok(out)
}

/// The DROP statements that undo [`ddl`].
pub(crate) fn drop_ddl(t: &TableDescription) -> Vec<String> {
    let mut out = vec![format!("DROP TABLE IF EXISTS {}", ident(t.name()))];
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!("DROP TABLE IF EXISTS {}", ident(d)));
    }
    // A pause of the dropped queue goes with it (the control table stays: other queues share
    // it), so a table created again under the name does not start paused.
    out.push(crate::admin::unpause_ddl(t.name()));
    out.push(crate::admin::uncancel_ddl(t.name()));
    out
}

/// Whether SQLite gives a column declared `declared` text affinity (its rules: a type naming
/// INT is an integer; one naming CHAR, CLOB or TEXT is text).
fn has_text_affinity(declared: &str) -> bool {
    let t = declared.to_ascii_uppercase();
    !t.contains("INT") && (t.contains("CHAR") || t.contains("CLOB") || t.contains("TEXT"))
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
    let mut missing = Vec::new();
    let mut first = None;
    for (column, role) in t.named_columns() {
        let probe = format!("SELECT {} FROM {table} LIMIT 0", ident(column));
        if let Err(e) = conn
            .prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(probe)))
            .await
        {
            missing.push((column, role));
            first.get_or_insert(e);
        }
    }
    if let Some(e) = first {
        return Err(broker_core::driver::missing_columns(t, &missing, e));
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
    for (column, role, what) in [
        (
            t.last_error(),
            "last_error",
            "it keeps the handler's error message",
        ),
        (
            t.unique_key(),
            "unique_key",
            "it keeps each row's unique key",
        ),
    ] {
        let Some(column) = column else { continue };
        let declared: Option<String> =
            sqlx::query_scalar("SELECT type FROM pragma_table_info(?1) WHERE name = ?2")
                .bind(t.name())
                .bind(column)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| schema("cannot read the table's columns".into(), "column check", e))?;
        if let Some(declared) = declared
            && !has_text_affinity(&declared)
        {
            return Err(schema(
                format!(
                    "column \"{column}\" ({role}) is declared {declared}; it must be a text column (TEXT): {what}"
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
