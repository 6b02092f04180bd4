//! The schedule tables: registered schedules and the ticks published (see
//! [`broker_core::Schedule`]).

use broker_core::driver::{SCHEDULES_TABLE, ScheduleRow, TICKS_TABLE};
use broker_core::{Result, SqlxBrokerError};
use sqlx::{MySqlConnection, MySqlPool};

/// The DDL of the schedule tables, shared by every queue of the database. Names compare as
/// bytes (`utf8mb4_bin`), as the core compares them.
pub(crate) fn ddl() -> [String; 2] {
    [
        format!(
            "CREATE TABLE IF NOT EXISTS {SCHEDULES_TABLE} (name VARCHAR(200) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL PRIMARY KEY, queue VARCHAR(255) NOT NULL, \
             expression VARCHAR(255) NOT NULL, time_zone VARCHAR(64) NOT NULL, last_tick_ms BIGINT NULL) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {TICKS_TABLE} (schedule VARCHAR(200) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL, tick_ms BIGINT NOT NULL, PRIMARY KEY (schedule, tick_ms)) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ),
    ]
}

fn err(e: sqlx::Error) -> SqlxBrokerError {
    SqlxBrokerError::statement("", "schedule", e)
}

type Row = (String, String, String, String, Option<i64>);

fn row((name, queue, expression, time_zone, last): Row) -> ScheduleRow {
    ScheduleRow::new(name, queue, expression, time_zone, last)
}

const COLUMNS: &str = "CAST(name AS CHAR), CAST(queue AS CHAR), CAST(expression AS CHAR), \
                       CAST(time_zone AS CHAR), last_tick_ms";

pub(crate) async fn register(pool: &MySqlPool, s: &ScheduleRow) -> Result<ScheduleRow> {
    // INSERT IGNORE is safe here: the core bounds every value below its column's length, so
    // the only error it turns into a warning is the duplicate name.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT IGNORE INTO {SCHEDULES_TABLE} (name, queue, expression, time_zone) VALUES (?, ?, ?, ?)"
    )))
    .bind(&s.name)
    .bind(&s.queue)
    .bind(&s.expression)
    .bind(&s.time_zone)
    .execute(pool)
    .await
    .map_err(err)?;
    let found: Row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM {SCHEDULES_TABLE} WHERE name = ?"
    )))
    .bind(&s.name)
    .fetch_one(pool)
    .await
    .map_err(err)?;
    Ok(row(found))
}

pub(crate) async fn record_tick(
    conn: &mut MySqlConnection,
    name: &str,
    tick_ms: i64,
    prune_before_ms: i64,
) -> Result<bool> {
    // The primary key decides: an insert of a tick another transaction is recording waits for
    // its lock, then inserts nothing if it committed.
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT IGNORE INTO {TICKS_TABLE} (schedule, tick_ms) VALUES (?, ?)"
    )))
    .bind(name)
    .bind(tick_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {SCHEDULES_TABLE} SET last_tick_ms = GREATEST(COALESCE(last_tick_ms, ?), ?) WHERE name = ?"
    )))
    .bind(tick_ms)
    .bind(tick_ms)
    .bind(name)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {TICKS_TABLE} WHERE schedule = ? AND tick_ms < ?"
    )))
    .bind(name)
    .bind(prune_before_ms)
    .execute(&mut *conn)
    .await
    .map_err(err)?;
    Ok(true)
}

pub(crate) async fn list(pool: &MySqlPool) -> Result<Vec<ScheduleRow>> {
    let found: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(SCHEDULES_TABLE)
    .fetch_one(pool)
    .await
    .map_err(err)?;
    if found == 0 {
        return Ok(Vec::new());
    }
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM {SCHEDULES_TABLE} ORDER BY name"
    )))
    .fetch_all(pool)
    .await
    .map_err(err)?;
    Ok(rows.into_iter().map(row).collect())
}
