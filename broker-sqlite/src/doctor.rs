//! The SQLite checks of [`Broker::doctor`](broker_core::Broker::doctor): the library version,
//! the journal mode and busy timeout that let workers take turns at the one writer, the scope of
//! advisory keys, and the indexes the claim reads.

use broker_core::doctor::{Check, DoctorOptions, UniqueIndex};
use broker_core::{ClaimMode, TableDescription};
use sqlx::{AssertSqlSafe, Row, SqlitePool};

use crate::version;

/// Runs every check; see the module docs.
pub(crate) async fn checks(
    pool: &SqlitePool,
    table: &TableDescription,
    _options: &DoctorOptions,
) -> Vec<Check> {
    let mut conn = match pool.acquire().await {
        Ok(c) => c,
        Err(e) => {
            return vec![Check::fail(
                "connection",
                format!("cannot open the database: {e}"),
                "check the path and the file's rights",
            )];
        }
    };
    let mut scalar = async |sql: &str| -> Result<String, sqlx::Error> {
        let row = sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&mut *conn)
            .await?;
        row.try_get::<String, _>(0)
            .or_else(|_| row.try_get::<i64, _>(0).map(|n| n.to_string()))
    };
    let mut out = Vec::new();
    out.push(match scalar("SELECT sqlite_version()").await {
        Ok(v) => match version::check(&v) {
            Ok(()) => Check::pass(
                "library version",
                format!("SQLite {v} (3.35 or newer needed)"),
            ),
            Err(e) => Check::fail(
                "library version",
                e.to_string(),
                "build sqlx against a newer SQLite (3.35+ has RETURNING)",
            ),
        },
        Err(e) => Check::fail(
            "library version",
            format!("cannot read it: {e}"),
            "check the database",
        ),
    });
    out.push(match scalar("PRAGMA journal_mode").await {
        Ok(m) if m.eq_ignore_ascii_case("wal") => Check::pass("journal mode", "WAL: readers do not wait for the writer"),
        Ok(m) => Check::warn(
            "journal mode",
            format!("{m}: every claim and settlement waits for readers and the one writer"),
            "open the pool with SqliteBackend::connect_options (WAL and a busy timeout), or set PRAGMA journal_mode = WAL",
        ),
        Err(e) => Check::warn("journal mode", format!("cannot read it: {e}"), "check it by hand"),
    });
    out.push(match scalar("PRAGMA busy_timeout").await {
        Ok(ms) if ms.parse::<u64>().is_ok_and(|ms| ms >= 1000) => Check::pass("busy timeout", format!("{ms} ms")),
        Ok(ms) => Check::warn(
            "busy timeout",
            format!("{ms} ms: a worker that meets another process's write fails with \"database is locked\" instead of waiting"),
            "open the pool with SqliteBackend::connect_options (a 30 s busy timeout), or set PRAGMA busy_timeout",
        ),
        Err(e) => Check::warn("busy timeout", format!("cannot read it: {e}"), "check it by hand"),
    });
    if table.mode() == ClaimMode::Advisory {
        out.push(Check::warn(
            "advisory keys",
            "keys are held in this process: two processes on one file do not see each other's keys, so a row can be delivered twice",
            "run one process per database file, or use lease mode (a locked_until column) for several",
        ));
    }
    let exists: Result<i64, _> =
        sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(table.name())
            .fetch_one(&mut *conn)
            .await;
    if matches!(exists, Ok(0)) {
        out.extend(broker_core::driver::indexes::table_missing(table.name()));
    } else {
        out.push(broker_core::driver::indexes::check(
            crate::schema::index_advice(&mut conn, table).await,
        ));
        if let Some(fix) = crate::schema::unique_index(table) {
            let found = unique_index(&mut conn, table)
                .await
                .map_err(|e| e.to_string());
            out.extend(broker_core::doctor::unique_index_check(table, found, &fix));
        }
    }
    out
}

/// Looks for a unique index over the key column alone, and whether it is partial.
async fn unique_index(
    conn: &mut sqlx::SqliteConnection,
    table: &TableDescription,
) -> Result<UniqueIndex, sqlx::Error> {
    let column = table.unique_key().unwrap_or_default();
    let indexes: Vec<(i64, String, i64, String, i64)> =
        sqlx::query_as("SELECT seq, name, \"unique\", origin, partial FROM pragma_index_list(?1)")
            .bind(table.name())
            .fetch_all(&mut *conn)
            .await?;
    let mut found = UniqueIndex::Missing;
    for (_, name, unique, _, partial) in indexes {
        if unique == 0 {
            continue;
        }
        let cols: Vec<String> =
            sqlx::query_scalar("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")
                .bind(&name)
                .fetch_all(&mut *conn)
                .await?;
        if cols != [column] {
            continue;
        }
        if partial == 1 || table.unfinished_columns().is_empty() {
            return Ok(UniqueIndex::Found);
        }
        found = UniqueIndex::CoversFinishedRows(name);
    }
    Ok(found)
}
