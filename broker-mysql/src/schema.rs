//! DDL for a description, and the startup checks that the table, its columns and every
//! statement are in order.

use std::collections::HashMap;

use broker_core::driver::indexes::IndexAdvice;
use broker_core::{ColumnType, DeadLetter, SqlxBrokerError, TableDescription};
use sqlx::{Executor, MySqlConnection};

use crate::fifo::GROUP_INDEX;
use crate::sql::ident;

/// The name of the claim index the DDL helper creates.
pub(crate) const CLAIM_INDEX: &str = "sqlx_broker_claim";

fn column_type(ty: ColumnType) -> &'static str {
    match ty {
        ColumnType::Text => "LONGTEXT",
        ColumnType::BigInt => "BIGINT",
        // MariaDB reads JSON as LONGTEXT with a JSON_VALID check.
        ColumnType::Json => "JSON",
        ColumnType::Bytes => "LONGBLOB",
    }
}

/// The columns of a description as DDL, for the queue table (`queue`: the id is
/// AUTO_INCREMENT) or its dead-letter table (same columns, same order, so a dead letter copies
/// with `INSERT .. SELECT *`). Times are DATETIME(6) and hold UTC.
fn columns(t: &TableDescription, queue: bool) -> Vec<String> {
    let mut cols = vec![format!(
        "{} BIGINT NOT NULL{}",
        ident(t.id()),
        if queue { " AUTO_INCREMENT" } else { "" }
    )];
    if let Some((p, ty)) = t.payload() {
        cols.push(format!("{} {} NULL", ident(p), column_type(ty)));
    }
    cols.push(format!("{} INT NOT NULL DEFAULT 1", ident(t.attempt())));
    for c in [t.locked_until(), t.due_at(), t.processed_at()]
        .into_iter()
        .flatten()
    {
        cols.push(format!("{} DATETIME(6) NULL", ident(c)));
    }
    if let Some(DeadLetter::Column(c)) = t.dead_letter() {
        cols.push(format!("{} DATETIME(6) NULL", ident(c)));
    }
    if let Some(g) = t.group() {
        // Indexed, so it needs a bounded length.
        cols.push(format!("{} VARCHAR(255) NULL", ident(g)));
    }
    if let Some(e) = t.last_error() {
        cols.push(format!("{} TEXT NULL", ident(e)));
    }
    if let Some(n) = t.snoozes() {
        // Counts snoozes; 0 for rows published before the first.
        cols.push(format!("{} INT NOT NULL DEFAULT 0", ident(n)));
    }
    if let Some(u) = t.unique_key() {
        // Indexed, so it needs a bounded length (MAX_UNIQUE_KEY_CHARS).
        cols.push(format!("{} VARCHAR(255) NULL", ident(u)));
    }
    if let Some(p) = t.priority() {
        cols.push(format!("{} INT NOT NULL DEFAULT 0", ident(p)));
    }
    let walked = t.key_index_columns().unwrap_or_default();
    for (c, ty) in t.columns() {
        // A text column of the key walk's index needs a bounded length, as the group's does.
        let ty = if t.kind() == Some(c.as_str()) {
            // A kind name is 1 to MAX_KIND_CHARS ASCII characters, compared as bytes; bounded,
            // so the claim index can carry it (see claim_index_columns).
            "VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin"
        } else if *ty == ColumnType::Text && walked.contains(&c.as_str()) {
            "VARCHAR(255)"
        } else {
            column_type(*ty)
        };
        cols.push(format!("{} {ty} NULL", ident(c)));
    }
    cols.push(format!("PRIMARY KEY ({})", ident(t.id())));
    cols
}

/// The DDL of a description: the table with the index the claim reads and, for groups, the
/// index the FIFO head check and guard read; then the dead-letter table.
///
/// The claim index holds the columns that finish a row (so finished rows are not scanned), then
/// the claim order (`priority DESC, due time, id`). A `FOR UPDATE SKIP LOCKED` claim that has to sort its
/// rows (a filesort) locks every row it scans before sorting, so a second worker finds them all
/// locked and gets nothing; reading an index in claim order, the claim stops after its `LIMIT`.
/// Without finishing columns, a priority or a due time the primary key already is that order. (Descending
/// index parts need MySQL 8.0 or MariaDB 10.8; MariaDB 10.6 and 10.7 read the index backwards
/// for a priority table and sort.)
pub(crate) fn ddl(t: &TableDescription) -> Vec<String> {
    let table = ident(t.name());
    let mut cols = columns(t, true);
    let unfinished: Vec<String> = t.unfinished_columns().into_iter().map(ident).collect();
    if let Some(claim) = claim_index(t) {
        cols.push(claim);
    }
    if let Some(key) = key_index(t) {
        cols.push(key);
    }
    cols.extend(unique_index(t));
    if let Some(g) = t.group() {
        let mut group = vec![ident(g)];
        group.extend(unfinished.iter().cloned());
        group.push(ident(t.id()));
        cols.push(format!(
            "INDEX {} ({})",
            ident(GROUP_INDEX),
            group.join(", ")
        ));
    }
    let mut out = vec![format!(
        "CREATE TABLE IF NOT EXISTS {table} ({}) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
        cols.join(", ")
    )];
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        out.push(format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
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
pub(crate) const UNIQUE_INDEX: &str = "sqlx_broker_unique";

/// The generated column the unique index reads on a table whose rows finish in place: the key
/// while the row is unfinished, NULL once it is acked (`processed_at`) or marked dead. MySQL
/// and MariaDB have no partial indexes; NULLs never collide in a unique index, so a finished
/// row frees its key. INVISIBLE keeps it out of `SELECT *`, so a dead letter still copies with
/// `INSERT .. SELECT *` (invisible columns need MySQL 8.0.23 or MariaDB 10.3).
pub(crate) const UNIQUE_LIVE_COLUMN: &str = "sqlx_broker_unique_live";

/// The unique index's parts of the table definition: on a table whose rows finish in place,
/// the generated column [`UNIQUE_LIVE_COLUMN`] and the index over it; otherwise (an ack deletes,
/// a dead letter moves) the index over the key column itself.
pub(crate) fn unique_index(t: &TableDescription) -> Vec<String> {
    let Some(u) = t.unique_key() else {
        return Vec::new();
    };
    let unfinished = t.unfinished_columns();
    if unfinished.is_empty() {
        return vec![format!(
            "UNIQUE INDEX {} ({})",
            ident(UNIQUE_INDEX),
            ident(u)
        )];
    }
    let cond: Vec<String> = unfinished
        .into_iter()
        .map(|c| format!("{} IS NULL", ident(c)))
        .collect();
    vec![
        format!(
            "{} VARCHAR(255) AS (CASE WHEN {} THEN {} END) STORED INVISIBLE",
            ident(UNIQUE_LIVE_COLUMN),
            cond.join(" AND "),
            ident(u)
        ),
        format!(
            "UNIQUE INDEX {} ({})",
            ident(UNIQUE_INDEX),
            ident(UNIQUE_LIVE_COLUMN)
        ),
    ]
}

/// The name of the key index the DDL helper creates on advisory tables with a key walk.
pub(crate) const KEY_INDEX: &str = "sqlx_broker_key";

/// The key index's columns: the key template's, then the id
/// ([`TableDescription::key_index_columns`]).
fn key_index_columns(t: &TableDescription) -> Option<Vec<String>> {
    let mut cols: Vec<String> = t
        .key_index_columns()?
        .into_iter()
        .map(str::to_owned)
        .collect();
    cols.push(t.id().to_owned());
    Some(cols)
}

/// The key index as an index definition: what an advisory claim's key walk reads.
fn key_index(t: &TableDescription) -> Option<String> {
    key_index_columns(t).map(|cols| {
        format!(
            "INDEX {} ({})",
            ident(KEY_INDEX),
            cols.iter().map(|c| ident(c)).collect::<Vec<_>>().join(", ")
        )
    })
}

/// The claim index's columns: on a FIFO table the group column, then those that finish a row
/// (compared with `IS NULL`, so finished rows sit apart), then the claim order: priority
/// (highest first), due time, id.
fn claim_index_columns(t: &TableDescription) -> Vec<(String, bool)> {
    // A FIFO claim reads this index only for rows without a group (grouped rows come through
    // the group index, group by group), so there it leads with the group column: those rows
    // are then one range, in claim order, whatever the groups hold.
    let mut cols: Vec<(String, bool)> = t
        .group()
        .filter(|_| t.fifo())
        .map(|g| (g.to_owned(), false))
        .into_iter()
        .collect();
    cols.extend(
        t.unfinished_columns()
            .into_iter()
            .map(|c| (c.to_owned(), false)),
    );
    if let Some(p) = t.priority() {
        cols.push((p.to_owned(), true));
    }
    if let Some(c) = t.due_at() {
        cols.push((c.to_owned(), false));
    }
    cols.push((t.id().to_owned(), false));
    // A kinds table's claims keep only their kinds: with the kind in the index, the claim
    // window's read tests it on the index entry instead of looking up every row it passes
    // (a MariaDB row lock drain of 10 kinds ran at 0.80 of one type's without it).
    if let Some(k) = t.kind() {
        cols.push((k.to_owned(), false));
    }
    cols
}

/// The claim index as an index definition inside CREATE TABLE or after ADD; `None` where the
/// primary key is the claim order (no finishing column, priority or due time).
fn claim_index(t: &TableDescription) -> Option<String> {
    let cols = claim_index_columns(t);
    (cols.len() > 1).then(|| {
        format!(
            "INDEX {} ({})",
            ident(CLAIM_INDEX),
            cols.iter()
                .map(|(c, desc)| format!("{}{}", ident(c), if *desc { " DESC" } else { "" }))
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// Whether the claim index (and on an advisory table with a key walk, the key index) is missing
/// or not in the claim's order: what was found and the statement that puts it right. Any index whose columns are the claim index's counts, whatever
/// its name; one named `sqlx_broker_claim` with other columns (made by the DDL helper before the
/// claim led with the due time) is dropped and made again by the statement. Without it a claim
/// sorts what it reads (a filesort) and locks every row it scans; only slowness follows, so the
/// caller warns.
pub(crate) async fn index_advice(
    conn: &mut MySqlConnection,
    t: &TableDescription,
) -> Result<Vec<IndexAdvice>, sqlx::Error> {
    let wanted: Vec<(&str, Vec<String>, String)> = [
        claim_index(t).map(|d| {
            let cols = claim_index_columns(t).into_iter().map(|(c, _)| c).collect();
            (CLAIM_INDEX, cols, d)
        }),
        key_index(t).and_then(|d| Some((KEY_INDEX, key_index_columns(t)?, d))),
    ]
    .into_iter()
    .flatten()
    .collect();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(INDEX_NAME AS CHAR), CAST(COLUMN_NAME AS CHAR) FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? ORDER BY INDEX_NAME, SEQ_IN_INDEX",
    )
    .persistent(false)
    .bind(t.name())
    .fetch_all(&mut *conn)
    .await?;
    let mut found: Vec<(String, Vec<String>)> = Vec::new();
    for (index, column) in rows {
        match found.last_mut() {
            Some((name, cols)) if *name == index => cols.push(column),
            _ => found.push((index, vec![column])),
        }
    }
    let table = ident(t.name());
    let mut out = Vec::new();
    for (name, wanted, definition) in wanted {
        if found.iter().any(|(_, cols)| *cols == wanted) {
            continue;
        }
        out.push(match found.iter().find(|(n, _)| n == name) {
            Some((_, cols)) => IndexAdvice {
                name: name.to_owned(),
                found: format!(
                    "it is on ({}), not ({})",
                    cols.join(", "),
                    wanted.join(", ")
                ),
                fix: vec![format!(
                    "ALTER TABLE {table} DROP INDEX {}, ADD {definition}",
                    ident(name)
                )],
            },
            None => IndexAdvice {
                name: name.to_owned(),
                found: format!("no index on ({})", wanted.join(", ")),
                fix: vec![format!("ALTER TABLE {table} ADD {definition}")],
            },
        });
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

const INTEGER_TYPES: &[&str] = &["tinyint", "smallint", "mediumint", "int", "bigint"];
const TIME_TYPES: &[&str] = &["datetime", "timestamp"];
const TEXT_TYPES: &[&str] = &[
    "char",
    "varchar",
    "tinytext",
    "text",
    "mediumtext",
    "longtext",
];

/// The index the FIFO guard reads a group through: `sqlx_broker_group` if the table has it, else
/// another index that starts with the group column. `None` for tables that are not FIFO; an error
/// naming the column when a FIFO table has no such index, because the guard would then scan (and
/// lock) rows of other groups, and give up whenever one of them is in work.
pub(crate) async fn group_index(
    conn: &mut MySqlConnection,
    t: &TableDescription,
) -> Result<Option<String>, SqlxBrokerError> {
    let (true, Some(group)) = (t.fifo(), t.group()) else {
        return Ok(None);
    };
    let schema = |what: String, source| SqlxBrokerError::Schema {
        table: t.name().to_owned(),
        what,
        statement: "index check",
        source,
    };
    let index: Option<String> = sqlx::query_scalar(
        "SELECT CAST(INDEX_NAME AS CHAR) FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND SEQ_IN_INDEX = 1 \
         AND COLUMN_NAME = ? ORDER BY INDEX_NAME <> ?, INDEX_NAME LIMIT 1",
    )
    .bind(t.name())
    .bind(group)
    .bind(GROUP_INDEX)
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| schema("cannot read the table's indexes".into(), e))?;
    match index {
        Some(index) => Ok(Some(index)),
        None => Err(SqlxBrokerError::Setup {
            table: t.name().to_owned(),
            what: format!(
                "the FIFO guard reads a group through an index that starts with the group column \"{group}\", and the table has none; add one, e.g. INDEX {} ({}, {}) as the DDL helper does",
                ident(GROUP_INDEX),
                ident(group),
                ident(t.id())
            ),
        }),
    }
}

async fn prepare_sql(conn: &mut MySqlConnection, sql: String) -> Result<(), sqlx::Error> {
    conn.prepare(sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(sql)))
        .await
        .map(|_| ())
}

/// Checks that the table and each named column exist, that the id and attempt columns are
/// integers and the time columns DATETIME or TIMESTAMP, and that the dead-letter table exists.
/// `utc`: the session converts times as UTC.
pub(crate) async fn check_table(
    conn: &mut MySqlConnection,
    t: &TableDescription,
    utc: bool,
) -> Result<(), SqlxBrokerError> {
    let table = ident(t.name());
    let schema = |what: String, statement: &'static str, source| SqlxBrokerError::Schema {
        table: t.name().to_owned(),
        what,
        statement,
        source,
    };
    let prepare = prepare_sql;
    prepare(conn, format!("SELECT * FROM {table} LIMIT 0"))
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
        if let Err(e) = prepare(conn, probe).await {
            missing.push((column, role));
            first.get_or_insert(e);
        }
    }
    if let Some(e) = first {
        return Err(broker_core::driver::missing_columns(t, &missing, e));
    }
    let types: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(COLUMN_NAME AS CHAR), CAST(LOWER(DATA_TYPE) AS CHAR) \
         FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(t.name())
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| schema("cannot read the table's columns".into(), "column check", e))?;
    // Column names compare without case in MySQL.
    let types: HashMap<String, String> = types
        .into_iter()
        .map(|(c, ty)| (c.to_lowercase(), ty))
        .collect();
    let declared = |column: &str| types.get(&column.to_lowercase());
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
        if let Some(ty) = declared(column)
            && !INTEGER_TYPES.contains(&ty.as_str())
        {
            return Err(mismatch(
                column,
                role,
                ty,
                "an integer column (BIGINT, INT)",
            ));
        }
    }
    let dead_col = match t.dead_letter() {
        Some(DeadLetter::Column(c)) => Some(c.as_str()),
        _ => None,
    };
    for (column, role) in [
        (t.locked_until(), "locked_until"),
        (t.due_at(), "due_at"),
        (t.processed_at(), "processed_at"),
        (dead_col, "dead_letter"),
    ] {
        let Some(column) = column else { continue };
        let Some(ty) = declared(column) else { continue };
        if !TIME_TYPES.contains(&ty.as_str()) {
            return Err(mismatch(
                column,
                role,
                ty,
                "DATETIME or TIMESTAMP (DATETIME(6) is best)",
            ));
        }
        if ty == "timestamp" && !utc {
            return Err(SqlxBrokerError::Setup {
                table: t.name().to_owned(),
                what: format!(
                    "column \"{column}\" ({role}) is a TIMESTAMP, which the server converts through the session time zone, and this pool's sessions are not UTC; keep sqlx's default MySqlConnectOptions::timezone(Some(\"+00:00\")) or make the column DATETIME(6)"
                ),
            });
        }
    }
    if let Some(column) = t.last_error()
        && let Some(ty) = declared(column)
        && !TEXT_TYPES.contains(&ty.as_str())
    {
        return Err(mismatch(
            column,
            "last_error",
            ty,
            "a text column (TEXT or VARCHAR): it keeps the handler's error message",
        ));
    }
    if let Some(column) = t.unique_key()
        && let Some(ty) = declared(column)
        && !TEXT_TYPES.contains(&ty.as_str())
    {
        return Err(mismatch(
            column,
            "unique_key",
            ty,
            "a text column (VARCHAR(255)): it keeps each row's unique key",
        ));
    }
    if let Some(DeadLetter::Table(d)) = t.dead_letter() {
        prepare(conn, format!("SELECT * FROM {} LIMIT 0", ident(d)))
            .await
            .map_err(|e| {
                schema(
                    format!(
                        "the dead-letter table \"{d}\" does not exist; create it (see the DDL helper)"
                    ),
                    "dead-letter check",
                    e,
                )
            })?;
    }
    Ok(())
}

/// Prepares every statement of the table's mode, so a statement the table cannot run fails at
/// startup, naming it.
pub(crate) async fn check_statements(
    conn: &mut MySqlConnection,
    t: &TableDescription,
    statements: &[(&'static str, &str)],
) -> Result<(), SqlxBrokerError> {
    for &(name, sql) in statements {
        prepare_sql(conn, sql.to_owned())
            .await
            .map_err(|e| SqlxBrokerError::Schema {
                table: t.name().to_owned(),
                what: "a statement does not prepare; check the column types and names".into(),
                statement: name,
                source: e,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kinds_table_has_a_bounded_binary_kind_column_at_the_end_of_its_claim_index() {
        let t = TableDescription::builder("jobs")
            .kind("kind")
            .payload("args", ColumnType::Json)
            .locked_until("lu")
            .due_at("due")
            .build()
            .unwrap();
        let queue = ddl(&t).join("\n");
        assert!(
            queue.contains("`kind` VARCHAR(100) CHARACTER SET ascii COLLATE ascii_bin NULL"),
            "{queue}"
        );
        assert!(
            queue.contains("INDEX `sqlx_broker_claim` (`due`, `id`, `kind`)"),
            "{queue}"
        );
    }

    #[test]
    fn the_ddl_creates_the_claim_and_group_indexes_and_a_matching_dead_letter_table() {
        let t = TableDescription::builder("jobs")
            .payload("payload", ColumnType::Json)
            .group("grp")
            .fifo(true)
            .priority("prio")
            .processed_at("done")
            .due_at("due")
            .locked_until("lu")
            .column("account", ColumnType::BigInt)
            .max_attempts(3)
            .dead_letter(DeadLetter::Table("jobs_dead".into()))
            .build()
            .unwrap();
        let ddl = ddl(&t);
        assert_eq!(
            ddl.len(),
            6,
            "queue, dead letters, control, cancels, schedules, ticks"
        );
        assert!(ddl[2].contains("sqlx_broker_control"), "{}", ddl[2]);
        assert!(ddl[3].contains("sqlx_broker_cancels"), "{}", ddl[3]);
        let queue = &ddl[0];
        assert!(
            queue.contains("`id` BIGINT NOT NULL AUTO_INCREMENT"),
            "{queue}"
        );
        assert!(queue.contains("`payload` JSON NULL"), "{queue}");
        assert!(
            queue.contains("`attempt` INT NOT NULL DEFAULT 1"),
            "{queue}"
        );
        assert!(queue.contains("`lu` DATETIME(6) NULL"), "{queue}");
        assert!(queue.contains("`grp` VARCHAR(255) NULL"), "{queue}");
        assert!(queue.contains("`prio` INT NOT NULL DEFAULT 0"), "{queue}");
        assert!(
            queue.contains("INDEX `sqlx_broker_claim` (`grp`, `done`, `prio` DESC, `due`, `id`)"),
            "{queue}"
        );
        assert!(
            queue.contains("INDEX `sqlx_broker_group` (`grp`, `done`, `id`)"),
            "{queue}"
        );
        assert!(
            queue.ends_with("ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"),
            "{queue}"
        );
        let dead = &ddl[1];
        assert!(
            dead.starts_with("CREATE TABLE IF NOT EXISTS `jobs_dead`"),
            "{dead}"
        );
        assert!(
            !dead.contains("AUTO_INCREMENT") && !dead.contains("INDEX"),
            "{dead}"
        );
        // Same columns in the same order.
        let names = |queue| {
            columns(&t, queue)
                .iter()
                .map(|c| c.split(' ').next().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(true), names(false));
        assert_eq!(names(true).len(), 10, "{:?}", names(true));
        assert_eq!(
            drop_ddl(&t),
            vec![
                "DROP TABLE IF EXISTS `jobs`",
                "DROP TABLE IF EXISTS `jobs_dead`",
                "DELETE FROM sqlx_broker_control WHERE queue = \
                 CONVERT(X'6a6f6273' USING utf8mb4) COLLATE utf8mb4_bin",
                "DELETE FROM sqlx_broker_cancels WHERE queue = \
                 CONVERT(X'6a6f6273' USING utf8mb4) COLLATE utf8mb4_bin",
            ]
        );
    }

    #[test]
    fn a_plain_table_claims_through_its_primary_key() {
        let t = TableDescription::builder("jobs")
            .payload("payload", ColumnType::Text)
            .build()
            .unwrap();
        let ddl = ddl(&t);
        assert!(!ddl[0].contains("INDEX"), "{}", ddl[0]);
        assert!(ddl[0].contains("`payload` LONGTEXT NULL"));
    }
}
