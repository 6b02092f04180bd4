//! DDL for a description, and the startup checks that the table, its columns and every
//! statement are in order.

use std::collections::HashMap;

use broker_core::driver::indexes::IndexAdvice;
use broker_core::{ColumnType, DeadLetter, SqlxBrokerError, TableDescription};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, SqlSafeStr};

use crate::sql::{due_key, ident};

/// The SQL type of a declared column.
pub(crate) fn column_type(ty: ColumnType) -> &'static str {
    match ty {
        ColumnType::Text => "TEXT",
        ColumnType::BigInt => "BIGINT",
        ColumnType::Json => "JSONB",
        ColumnType::Bytes => "BYTEA",
    }
}

/// The time columns of a description: all `TIMESTAMPTZ`.
fn time_columns(t: &TableDescription) -> Vec<(&str, &'static str)> {
    let mut out: Vec<(&str, &'static str)> = [
        (t.locked_until(), "locked_until"),
        (t.due_at(), "due_at"),
        (t.processed_at(), "processed_at"),
    ]
    .into_iter()
    .filter_map(|(c, role)| c.map(|c| (c, role)))
    .collect();
    if let Some(DeadLetter::Column(c)) = t.dead_letter() {
        out.push((c, "dead_letter"));
    }
    out
}

/// The columns of a description as DDL, for the queue table (`identity`) or its dead-letter
/// table, which keeps the ids it is given.
fn columns(t: &TableDescription, identity: bool) -> Vec<String> {
    let mut cols = vec![format!(
        "{} BIGINT{} PRIMARY KEY",
        ident(t.id()),
        // Ids come only from the sequence, so they grow with publish order (FIFO reads it).
        if identity {
            " GENERATED ALWAYS AS IDENTITY"
        } else {
            ""
        }
    )];
    if let Some((p, ty)) = t.payload() {
        cols.push(format!("{} {}", ident(p), column_type(ty)));
    }
    cols.push(format!("{} INTEGER NOT NULL DEFAULT 1", ident(t.attempt())));
    for (c, _) in time_columns(t) {
        cols.push(format!("{} TIMESTAMPTZ", ident(c)));
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

/// An index name for `table`: `{table}_{suffix}`, or a hash of the table name where that would
/// pass PostgreSQL's 63-byte limit (a truncated name could collide with another index's, and
/// `CREATE INDEX IF NOT EXISTS` would then skip it without a word).
fn index_name(table: &str, suffix: &str) -> String {
    let name = format!("{table}_{suffix}");
    if name.len() <= 63 {
        return name;
    }
    let digest = Sha256::digest(table.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sqlx_broker_{hex}_{suffix}")
}

/// The storage settings the DDL helper gives a queue table (see [`ddl`]); the doctor's vacuum
/// check names them.
pub(crate) const VACUUM_SETTINGS: &str =
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000";

/// The DDL of a description: the table, the index the claim reads (partial: only unfinished
/// rows, in claim order: priority, due time, id; on a FIFO table only the rows without a
/// group), the group index (group, id) over unfinished rows that a FIFO claim visits the groups
/// and finds their heads through, on an advisory table without groups the key index (the key
/// template's columns, id) over unfinished rows that the key walk visits the keys through, and
/// the dead-letter table with the same columns in the same
/// order (so a row moves with `INSERT .. SELECT *`).
pub(crate) fn ddl(t: &TableDescription) -> Vec<String> {
    let table = ident(t.name());
    // A queue table churns: every row is inserted, updated and deleted (or marked) within
    // seconds. Autovacuum's default waits for a fifth of the table to be dead; these settings
    // have it clean up after every thousand dead rows instead (within its naptime).
    let mut out = vec![format!(
        "CREATE TABLE IF NOT EXISTS {table} ({}) WITH ({VACUUM_SETTINGS})",
        columns(t, true).join(", ")
    )];
    let partial = partial(t);
    if let Some(sql) = claim_index(t) {
        out.push(sql);
    }
    if let Some(g) = t.group() {
        out.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {table} ({}, {}){partial}",
            ident(&index_name(t.name(), "group")),
            ident(g),
            ident(t.id())
        ));
    }
    if let Some(sql) = key_index(t) {
        out.push(sql);
    }
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
    index_name(t.name(), "unique")
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
        partial(t)
    ))
}

/// The key index of an advisory table with a key walk: the key template's columns, the id,
/// over unfinished rows ([`TableDescription::key_index_columns`]).
fn key_index(t: &TableDescription) -> Option<String> {
    let cols: Vec<String> = t.key_index_columns()?.into_iter().map(ident).collect();
    Some(format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} ({}, {}){}",
        ident(&index_name(t.name(), "key")),
        ident(t.name()),
        cols.join(", "),
        ident(t.id()),
        partial(t)
    ))
}

/// The claim index's key columns, in the claim's order: the priority (highest first), the due
/// time as [`due_key`] sorts it, the id.
fn claim_index_columns(t: &TableDescription) -> Vec<String> {
    let mut cols = Vec::new();
    if let Some(p) = t.priority() {
        cols.push(format!("{} DESC", ident(p)));
    }
    if let Some(c) = t.due_at() {
        cols.push(format!("({})", due_key(&ident(c))));
    }
    cols.push(ident(t.id()));
    cols
}

/// The claim index of a description (see [`ddl`]); `None` where the claim reads the primary key:
/// a table without a priority, a due time, a finishing column or FIFO groups, whose claim order is the
/// id's. An index on (id) alone would duplicate the key and cost every insert a second write.
pub(crate) fn claim_index(t: &TableDescription) -> Option<String> {
    let cols = claim_index_columns(t);
    let partial = where_clause(claim_rows(t));
    if cols.len() == 1 && partial.is_empty() {
        return None;
    }
    Some(format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} ({}){partial}",
        ident(&index_name(t.name(), "claim")),
        ident(t.name()),
        cols.join(", ")
    ))
}

/// The conditions of unfinished rows; none when every row is unfinished (an ack deletes, a dead
/// letter moves).
fn unfinished(t: &TableDescription) -> Vec<String> {
    t.unfinished_columns()
        .into_iter()
        .map(|c| format!("{} IS NULL", ident(c)))
        .collect()
}

/// The rows the claim index holds: the unfinished ones, and on a FIFO table only those without
/// a group (a FIFO claim reaches grouped rows through the group index, group by group).
fn claim_rows(t: &TableDescription) -> Vec<String> {
    let mut rows = unfinished(t);
    if let Some(g) = t.group().filter(|_| t.fifo()) {
        rows.push(format!("{} IS NULL", ident(g)));
    }
    rows
}

/// The `WHERE` of a partial index over the rows that meet `conditions`; empty for none.
fn where_clause(conditions: Vec<String>) -> String {
    if conditions.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conditions.join(" AND "))
    }
}

/// The `WHERE` of a partial index over unfinished rows; empty when every row is unfinished.
fn partial(t: &TableDescription) -> String {
    where_clause(unfinished(t))
}

/// The indexes of `t` that are missing or not what the claim reads (see [`ddl`]). The claim
/// index may have any name as long as its key columns are the claim's order; one under the
/// helper's name with other columns (made by the helper before the claim led with the due time)
/// is named to be dropped and made again. Only slowness follows from any of these, never a
/// wrong claim, so the caller warns.
pub(crate) async fn index_advice(
    conn: &mut PgConnection,
    t: &TableDescription,
    prepared: bool,
) -> Result<Vec<IndexAdvice>, sqlx::Error> {
    let found: Vec<(String, Vec<String>, String)> = read_by_table(
        conn,
        "SELECT c.relname::text, \
         ARRAY(SELECT pg_get_indexdef(i.indexrelid, k, true) \
               FROM generate_series(1, i.indnkeyatts::int) AS k ORDER BY k)::text[], \
         COALESCE(pg_get_expr(i.indpred, i.indrelid, true), '') \
         FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid \
         WHERE i.indrelid = to_regclass($1::text)",
        &ident(t.name()),
        prepared,
    )
    .await?;
    // Key columns as pg_get_indexdef prints them, quotes dropped.
    let plain = |s: &str| s.replace('"', "");
    // A partial index's conditions, as a sorted list whatever the parentheses and quotes.
    let conditions = |s: &str| {
        let s = s.replace(['(', ')', '"'], "");
        let mut c: Vec<String> = s
            .split(" AND ")
            .map(|c| c.trim().to_owned())
            .filter(|c| !c.is_empty())
            .collect();
        c.sort();
        c
    };
    let mut wanted: Vec<(String, Vec<String>, Vec<String>, String)> = Vec::new();
    if let Some(sql) = claim_index(t) {
        let mut keys: Vec<String> = t.priority().into_iter().map(plain).collect();
        if let Some(c) = t.due_at() {
            keys.push(format!(
                "COALESCE({}, '-infinity'::timestamp with time zone)",
                plain(c)
            ));
        }
        keys.push(plain(t.id()));
        wanted.push((
            index_name(t.name(), "claim"),
            keys,
            conditions(&claim_rows(t).join(" AND ")),
            sql,
        ));
    }
    if let Some(g) = t.group() {
        let sql = ddl(t)
            .into_iter()
            .find(|s| s.contains(&ident(&index_name(t.name(), "group"))))
            .expect("the DDL has the group index");
        wanted.push((
            index_name(t.name(), "group"),
            vec![plain(g), plain(t.id())],
            conditions(&unfinished(t).join(" AND ")),
            sql,
        ));
    }
    if let (Some(cols), Some(sql)) = (t.key_index_columns(), key_index(t)) {
        let mut keys: Vec<String> = cols.into_iter().map(plain).collect();
        keys.push(plain(t.id()));
        wanted.push((
            index_name(t.name(), "key"),
            keys,
            conditions(&unfinished(t).join(" AND ")),
            sql,
        ));
    }
    let shown = |keys: &[String], rows: &[String]| {
        let mut out = format!("({})", keys.join(", "));
        if !rows.is_empty() {
            out.push_str(&format!(" where {}", rows.join(" and ")));
        }
        out
    };
    let mut out = Vec::new();
    for (name, keys, rows, sql) in wanted {
        let fits = |(_, k, p): &&(String, Vec<String>, String)| {
            conditions(p) == rows && k.iter().map(|c| plain(c)).eq(keys.iter().cloned())
        };
        if found.iter().any(|f| fits(&f)) {
            continue;
        }
        match found.iter().find(|(n, _, _)| *n == name) {
            Some((_, k, p)) => out.push(IndexAdvice {
                found: format!(
                    "index \"{name}\" is on {}, not what the claim reads: {}",
                    shown(k, &conditions(p)),
                    shown(&keys, &rows)
                ),
                fix: vec![format!("DROP INDEX {}", ident(&name)), sql],
                name,
            }),
            None => out.push(IndexAdvice {
                found: format!("no index on {}", shown(&keys, &rows)),
                fix: vec![sql],
                name,
            }),
        }
    }
    Ok(out)
}

/// The DROP statements that undo [`ddl`] (the indexes go with their table).
pub(crate) fn drop_ddl(t: &TableDescription) -> Vec<String> {
    let mut out = vec![format!("DROP TABLE IF EXISTS {}", ident(t.name()))];
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!("DROP TABLE IF EXISTS {}", ident(d)));
    }
    // A pause of the dropped queue goes with it (the control table stays: other queues share
    // it), so a table created again under the name does not start paused.
    out.push(crate::admin::unpause_ddl(t.name()));
    out.push(broker_core::driver::uncancel_ddl(&crate::sql::literal(
        t.name(),
    )));
    out
}

/// The table's columns in table order; empty when the table does not exist (the check says so).
pub(crate) async fn table_columns(
    conn: &mut PgConnection,
    t: &TableDescription,
    prepared: bool,
) -> Result<Vec<String>, SqlxBrokerError> {
    let sql = "SELECT a.attname::text FROM pg_attribute AS a \
         WHERE a.attrelid = to_regclass($1::text) AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY a.attnum";
    read_by_table::<(String,)>(conn, sql, &ident(t.name()), prepared)
        .await
        .map(|rows| rows.into_iter().map(|(c,)| c).collect())
        .map_err(|e| SqlxBrokerError::statement(t.name(), "column list", e))
}

/// Runs a catalog query that binds the quoted table name: as it is, or inside a transaction
/// (that rolls back as it drops) when statements go unnamed (see `sql::on_pool`).
async fn read_by_table<R>(
    conn: &mut PgConnection,
    sql: &'static str,
    table: &str,
    prepared: bool,
) -> Result<Vec<R>, sqlx::Error>
where
    R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    async fn read<R>(
        conn: &mut PgConnection,
        sql: &'static str,
        table: &str,
        prepared: bool,
    ) -> Result<Vec<R>, sqlx::Error>
    where
        R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
    {
        sqlx::query_as(sql)
            .persistent(prepared)
            .bind(table)
            .fetch_all(&mut *conn)
            .await
    }
    if prepared {
        return read(conn, sql, table, prepared).await;
    }
    let mut tx = conn.begin().await?;
    read(&mut tx, sql, table, prepared).await
}

fn prepare_sql(sql: String) -> sqlx::SqlStr {
    AssertSqlSafe(sql).into_sql_str()
}

/// Checks that `sql` prepares: under sqlx's name for it (`prepared`), or, for a transaction-mode
/// pooler that loses named statements between transactions, with `PREPARE` and `DEALLOCATE`
/// inside one transaction that rolls back (the server checks it the same way; the pooler keeps
/// the transaction on one server session).
async fn probe(conn: &mut PgConnection, sql: String, prepared: bool) -> Result<(), sqlx::Error> {
    if prepared {
        return conn.prepare(prepare_sql(sql)).await.map(drop);
    }
    let mut tx = conn.begin().await?;
    sqlx::raw_sql(AssertSqlSafe(format!("PREPARE sqlx_broker_check AS {sql}")))
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(AssertSqlSafe("DEALLOCATE sqlx_broker_check".to_owned()))
        .execute(&mut *tx)
        .await?;
    tx.rollback().await
}

/// Checks that the table and each named column exist, that the id and attempt columns are
/// integers and the time columns `TIMESTAMPTZ`, and that every statement prepares.
pub(crate) async fn check(
    conn: &mut PgConnection,
    t: &TableDescription,
    statements: &[(&'static str, &str)],
    prepared: bool,
) -> Result<(), SqlxBrokerError> {
    let table = ident(t.name());
    let schema = |what: String, statement: &'static str, source| SqlxBrokerError::Schema {
        table: t.name().to_owned(),
        what,
        statement,
        source,
    };
    probe(conn, format!("SELECT * FROM {table} LIMIT 0"), prepared)
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
        let sql = format!("SELECT {} FROM {table} LIMIT 0", ident(column));
        if let Err(e) = probe(conn, sql, prepared).await {
            missing.push((column, role));
            first.get_or_insert(e);
        }
    }
    if let Some(e) = first {
        return Err(broker_core::driver::missing_columns(t, &missing, e));
    }
    let types: HashMap<String, String> = read_by_table::<(String, String)>(
        conn,
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute AS a \
         WHERE a.attrelid = to_regclass($1::text) AND a.attnum > 0 AND NOT a.attisdropped",
        &table,
        prepared,
    )
    .await
    .map_err(|e| schema("cannot read the table's columns".into(), "column check", e))?
    .into_iter()
    .collect();
    let mismatch = |column: &str, role: &str, declared: &str, wanted: &str| {
        schema(
            format!("column \"{column}\" ({role}) is declared {declared}; it must be {wanted}"),
            "column check",
            sqlx::Error::TypeNotFound {
                type_name: declared.to_owned(),
            },
        )
    };
    for (column, role) in [(t.id(), "id"), (t.attempt(), "attempt")] {
        if let Some(declared) = types.get(column)
            && !matches!(declared.as_str(), "smallint" | "integer" | "bigint")
        {
            return Err(mismatch(
                column,
                role,
                declared,
                "an integer column (BIGINT or INTEGER)",
            ));
        }
    }
    for (column, role) in time_columns(t) {
        if let Some(declared) = types.get(column)
            && declared != "timestamp with time zone"
        {
            return Err(mismatch(
                column,
                role,
                declared,
                "TIMESTAMPTZ (times are compared as instants, whatever the session's time zone)",
            ));
        }
    }
    if let Some(column) = t.last_error()
        && let Some(declared) = types.get(column)
        && !(declared == "text" || declared.starts_with("character varying"))
    {
        return Err(mismatch(
            column,
            "last_error",
            declared,
            "a text column (TEXT or VARCHAR): it keeps the handler's error message",
        ));
    }
    if let Some(column) = t.unique_key()
        && let Some(declared) = types.get(column)
        && !(declared == "text" || declared.starts_with("character varying"))
    {
        return Err(mismatch(
            column,
            "unique_key",
            declared,
            "a text column (TEXT or VARCHAR): it keeps each row's unique key",
        ));
    }
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        let sql = format!("SELECT * FROM {} LIMIT 0", ident(d));
        probe(conn, sql, prepared).await.map_err(|e| {
            schema(
                format!(
                    "the dead-letter table \"{d}\" does not exist; create it (see the DDL helper)"
                ),
                "dead-letter check",
                e,
            )
        })?;
    }
    for (name, sql) in statements {
        probe(conn, sql.to_string(), prepared).await.map_err(|e| {
            schema(
                "a statement does not prepare; check the column types and names".into(),
                name,
                e,
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_table_names_get_index_names_that_fit() {
        assert_eq!(index_name("jobs", "claim"), "jobs_claim");
        let long = "x".repeat(60);
        let claim = index_name(&long, "claim");
        let group = index_name(&long, "group");
        assert!(claim.len() <= 63 && group.len() <= 63);
        assert_ne!(claim, group);
    }

    #[test]
    fn the_dead_letter_table_has_the_queue_columns_in_order() {
        let t = TableDescription::builder("jobs")
            .payload("payload", ColumnType::Json)
            .locked_until("locked_until")
            .group("grp")
            .priority("prio")
            .column("account", ColumnType::BigInt)
            .max_attempts(3)
            .dead_letter(DeadLetter::Table("jobs_dead".into()))
            .build()
            .unwrap();
        let ddl = ddl(&t);
        let queue = &ddl[0];
        let dead = ddl.iter().find(|s| s.contains("\"jobs_dead\"")).unwrap();
        assert!(queue.contains("GENERATED ALWAYS AS IDENTITY"), "{queue}");
        assert!(!dead.contains("IDENTITY"), "{dead}");
        let names = |sql: &str| -> Vec<String> {
            // The column list, before the queue table's storage settings.
            let sql = sql.split(" WITH (").next().unwrap();
            let inner = &sql[sql.find('(').unwrap() + 1..sql.rfind(')').unwrap()];
            inner
                .split(", ")
                .map(|c| c.split(' ').next().unwrap().to_owned())
                .collect()
        };
        assert_eq!(names(queue), names(dead));
        assert!(queue.contains("\"payload\" JSONB"), "{queue}");
        assert!(queue.contains("\"locked_until\" TIMESTAMPTZ"), "{queue}");
    }
}
